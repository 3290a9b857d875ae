"""`python -m backdoorbench.leaderboard [results_dir=DIR] [dataset=..] [model=..] [target_mode=..]`.

Tables built from records only, per dataset and protocol: the defense x attack matrix of canonical
cells, the detection board (detector x attack: TPR, FPR, F1, AUROC at the detector's own threshold,
benign FP; report/detection.py), then (a) attacks x target mode of the runs without a defense (CA,
ASR, RA, PSNR, SSIM, LPIPS), (b) defenses x attacks (CA and ASR after the defense, DER, detection
AUROC where the defense detects, ASR after the reactivation stage where measured). Records that
differ only in their seed (same `group_id`) form one row: mean ± std over seeds, with n, flagged †
when n < 3. Different settings
of the same attack are different rows, labelled by the method's own values that differ from the
protocol's defaults (e.g. `poison_rate=0.05`). One row per attack x mode (x defense) is *canonical*,
the benchmark's protocol setting; the others are sweeps and earlier settings (query.mark_canonical).
Writes Markdown, CSV, a self-contained sortable HTML page and the protocol tables to
`<results_dir>/leaderboard/`. A record that can't be read is skipped with one warning naming the
file; it never stops the table.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from backdoorbench.errors import ConfigError, UserError
from backdoorbench.fileio import atomic_write_text, ensure_writable_dir
from backdoorbench.report import detection
from backdoorbench.report.csv_table import to_csv
from backdoorbench.report.derived import build_rows
from backdoorbench.report.html_page import to_html
from backdoorbench.report.markdown import to_markdown
from backdoorbench.report.protocol_tables import protocol_markdown
from backdoorbench.report.query import FILTERS, filter_records, load_records_with_paths

USAGE = "usage: python -m backdoorbench.leaderboard [results_dir=DIR] [dataset=NAME] [model=NAME] [target_mode=all2one|all2all]"
HELP = f"""{USAGE}

Builds the leaderboard from the run records under <results_dir>/runs: one row per setting (the
mean and spread over its seeds) in <results_dir>/leaderboard/leaderboard.md, leaderboard.html,
attacks.csv, defenses.csv and detection.csv, opening on the defense x attack matrix and the detection
board (each detector x attack at its own threshold: TPR, FPR, F1, AUROC); protocols.md holds the
reactivation, clean-budget and sensitivity tables. dataset=, model= and target_mode= keep only the
matching records. results_dir defaults to outputs, where runs write by default; the committed tables
are results_dir=results."""


@dataclass
class LeaderboardFiles:
    """What `write_leaderboard` wrote, and from how many records."""

    markdown: Path
    html: Path
    csv: dict[str, Path]
    n_rows: int
    n_records: int
    protocols: Path | None = None  # the reactivation, clean-budget and sensitivity tables


def results_runs(results_dir: str | Path) -> Path:
    """`results_dir` as a Path, checked to hold a runs/ folder (a ConfigError naming it if not)."""
    results_dir = Path(results_dir).expanduser()
    if not (results_dir / "runs").is_dir():
        raise ConfigError(f"results_dir={str(results_dir)!r} has no runs/ folder; run `python -m backdoorbench "
                          f"results_dir={results_dir}` first, or pass the results_dir that holds the records")
    return results_dir


def write_leaderboard(results_dir: str | Path, *, dataset: str | None = None, model: str | None = None,
                      target_mode: str | None = None) -> LeaderboardFiles:
    """Build the tables from the records under `<results_dir>/runs/` and write them to
    `<results_dir>/leaderboard/` (leaderboard.md, leaderboard.html, attacks.csv, defenses.csv,
    detection.csv, and protocols.md: the reactivation, clean-budget and sensitivity tables)."""
    results_dir = results_runs(results_dir)
    filters = {"dataset": dataset, "model": model, "target_mode": target_mode}
    loaded = load_records_with_paths(results_dir)
    records = filter_records([r for r, _ in loaded], **filters)
    if not records:
        raise ConfigError(f"no readable record under {results_dir / 'runs'}; run `python -m backdoorbench` first")
    where = {id(r): p.relative_to(results_dir).as_posix() for r, p in loaded}
    rows = build_rows(records, [where[id(r)] for r in records])
    out = ensure_writable_dir(results_dir / "leaderboard", "the leaderboard folder at results_dir")
    # results/README.md tells the commands of the committed rows; another results_dir may have its own
    notes = "../README.md" if (results_dir / "README.md").is_file() else None
    texts = {"leaderboard.md": to_markdown(rows, filters), "leaderboard.html": to_html(rows, filters, notes),
             "attacks.csv": to_csv(rows, "attacks"), "defenses.csv": to_csv(rows, "defenses"),
             "detection.csv": detection.to_csv(rows), "protocols.md": protocol_markdown(rows, records)}
    paths = {name: atomic_write_text(out / name, text) for name, text in texts.items()}
    return LeaderboardFiles(markdown=paths["leaderboard.md"], html=paths["leaderboard.html"],
                            csv={"attacks": paths["attacks.csv"], "defenses": paths["defenses.csv"],
                                 "detection": paths["detection.csv"]},
                            n_rows=len(rows), n_records=len(records), protocols=paths["protocols.md"])


def parse_args(args: list[str], options: dict[str, str | None], usage: str) -> dict[str, str | None]:
    """key=value arguments over `options` (the defaults); a ConfigError naming a bad one."""
    options = dict(options)
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or key not in options:
            raise ConfigError(f"unknown argument {arg!r}; {usage}")
        if not value:
            raise ConfigError(f"{key}= needs a value; {usage}")
        options[key] = value
    return options


def run_command(args: list[str], help_text: str, work: Callable[[list[str]], list[str]],
                shown: Callable[[warnings.WarningMessage], bool] = lambda warning: True) -> int:
    """A report command line: `--help` prints `help_text`; else `work(args)` runs and its lines are
    printed. Warnings (those `shown` keeps) are one `warning:` line each, not Python's two-line format;
    bad input is one `error:` line and exit 2. Returns the exit code."""
    if "-h" in args or "--help" in args:
        print(help_text)
        return 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result: list[str] | UserError = work(args)
        except UserError as exc:
            result = exc
    for warning in caught:
        if shown(warning):
            print(f"warning: {warning.message}", file=sys.stderr)
    if isinstance(result, UserError):
        print(f"error: {result}", file=sys.stderr)
        return 2
    for line in result:
        print(line)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The command line: 0 on success, 2 with one `error:` line on bad input."""
    def work(args: list[str]) -> list[str]:
        options = parse_args(args, {"results_dir": "outputs", **{k: None for k in FILTERS}}, USAGE)
        files = write_leaderboard(options.pop("results_dir"), **options)
        return [f"{files.n_rows} rows from {files.n_records} records -> {files.markdown}, {files.html}, "
                f"{files.csv['attacks']}, {files.csv['defenses']}, {files.csv['detection']}, {files.protocols}"]

    return run_command(sys.argv[1:] if argv is None else argv, HELP, work)
