"""`python -m backdoorbench.leaderboard [results_dir=DIR] [dataset=..] [model=..] [target_mode=..]`.

Tables built from records only, per dataset: (a) attacks x target mode of the runs without a
defense (CA, ASR, RA, PSNR, SSIM, LPIPS), (b) defenses x attacks (CA and ASR after the defense,
DER, detection AUROC where the defense detects). Records that differ only in their seed (same
`group_id`) form one row: mean ± std over seeds, with n, flagged † when n < 3. Different settings
of the same attack are different rows, labelled by what differs between them (e.g. `epochs=1`).
Writes Markdown, CSV and a self-contained sortable HTML page to `<results_dir>/leaderboard/`.
A record that can't be read is skipped with one warning naming the file; it never stops the table.
"""

from __future__ import annotations

import csv
import html
import io
import json
import statistics
import sys
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backdoorbench.config import NON_RESULT_KEYS
from backdoorbench.errors import ConfigError, UserError
from backdoorbench.fileio import atomic_write_text, ensure_writable_dir
from backdoorbench.records import RecordError, RunRecord, latest_repeats, load_record

TARGET_MODES = ("all2one", "all2all")
FILTERS = ("dataset", "model", "target_mode")
FEW_SEEDS = 3  # rows with fewer seeds than this are flagged
FLAG = "†"
USAGE = "usage: python -m backdoorbench.leaderboard [results_dir=DIR] [dataset=NAME] [model=NAME] [target_mode=all2one|all2all]"
HELP = f"""{USAGE}

Builds the leaderboard from the run records under <results_dir>/runs: one row per setting (the
mean and spread over its seeds) in <results_dir>/leaderboard/leaderboard.md, leaderboard.html,
attacks.csv and defenses.csv. dataset=, model= and target_mode= keep only the matching records.
results_dir defaults to results (the committed tables)."""


@dataclass(frozen=True)
class Column:
    """One numeric column: its header, how to read it from a record, how to print a value."""

    header: str
    key: str  # the CSV name
    read: Callable[[RunRecord], float | None]
    fmt: Callable[[float], str]


def _pct(value: float) -> str:
    return f"{100 * value:.2f}"


def _stealth(name: str) -> Callable[[RunRecord], float | None]:
    def read(record: RunRecord) -> float | None:
        entry = (record.stealth or {}).get(name)
        return entry.get("mean") if isinstance(entry, dict) else None
    return read


def _metric(stage: str, name: str) -> Callable[[RunRecord], float | None]:
    def read(record: RunRecord) -> float | None:
        block = record.metrics.get(stage)
        return block.get(name) if isinstance(block, dict) else None
    return read


def _auroc(record: RunRecord) -> float | None:
    detection = record.metrics.get("detection")
    return detection.get("auroc") if isinstance(detection, dict) else None


ATTACK_COLUMNS = (
    Column("CA %", "ca", _metric("attacked", "clean_acc"), _pct),
    Column("ASR %", "asr", _metric("attacked", "asr"), _pct),
    Column("RA %", "ra", _metric("attacked", "ra"), _pct),
    Column("PSNR dB", "psnr", _stealth("psnr"), lambda v: f"{v:.2f}"),
    Column("SSIM", "ssim", _stealth("ssim"), lambda v: f"{v:.4f}"),
    Column("LPIPS", "lpips", _stealth("lpips"), lambda v: f"{v:.4f}"),
    # Filled per row by build_rows, not read from one record: see clean_controls.
    Column("ΔCA vs clean", "ca_vs_clean", lambda r: None, lambda v: f"{100 * v:+.2f}"),
)
CLEAN_ATTACK = "none"  # the clean control: the same training without a trigger (attack=none)
DEFENSE_COLUMNS = (
    Column("CA after %", "ca_after", _metric("defended", "clean_acc"), _pct),
    Column("ASR after %", "asr_after", _metric("defended", "asr"), _pct),
    Column("DER", "der", lambda r: r.metrics.get("der"), lambda v: f"{v:.3f}"),
    Column("AUROC", "auroc", _auroc, lambda v: f"{v:.3f}"),
)


@dataclass
class Cell:
    mean: float
    std: float  # sample std over seeds; 0 for one value
    n: int


@dataclass(frozen=True)
class NotApplicable:
    """A defense cell whose defense's threat model excludes the attack (the record says
    `applicable: false`): shown as n/a, never as a value. Falsy, so it sorts and exports like a
    missing value where a renderer only asks whether there is a number."""

    reason: str

    def __bool__(self) -> bool:
        return False


NOT_APPLICABLE = "n/a"


@dataclass
class Row:
    table: str  # "attacks" or "defenses"
    dataset: str
    model: str
    attack: str
    target_mode: str  # e.g. all2one(0), all2all
    defense: str
    group_id: str
    seeds: list[int]
    config: dict[str, Any]
    cells: dict[str, Cell | None] = field(default_factory=dict)
    label: str = ""  # what differs from the other rows of the same attack (and defense)

    @property
    def n(self) -> int:
        return len(self.seeds)

    @property
    def training(self) -> str:
        """The victim's training budget, e.g. `10 ep` or `30 ep, no aug`: rows of one table may differ in it."""
        trainer = self.config.get("trainer") or {}
        text = f"{trainer.get('epochs', '?')} ep"
        return text if trainer.get("augment", True) else text + ", no aug"


def load_records_with_paths(results_dir: Path) -> list[tuple[RunRecord, Path]]:
    """Every readable record under `<results_dir>/runs/` with its path; one warning per file that is
    not. A config run more than once (`<run_id>.<n>.json`) counts once: its latest repeat."""
    records = []
    for path in sorted((Path(results_dir) / "runs").rglob("*.json")):
        try:
            records.append((load_record(path), path))
        except RecordError as exc:
            warnings.warn(f"skipping record {exc}", stacklevel=2)
    return latest_repeats(records)


def load_records(results_dir: Path) -> list[RunRecord]:
    """Every readable record under `<results_dir>/runs/`; one warning per file that is not."""
    return [record for record, _ in load_records_with_paths(results_dir)]


def filter_records(records: list[RunRecord], *, dataset: str | None = None, model: str | None = None,
                   target_mode: str | None = None) -> list[RunRecord]:
    """The records matching every filter given; a filter no record matches is a ConfigError."""
    if target_mode is not None and target_mode not in TARGET_MODES:
        raise ConfigError(f"target_mode={target_mode!r} is unknown; choose one of: {', '.join(TARGET_MODES)}")
    wanted = {"dataset": dataset, "model": model, "target_mode": target_mode}
    getters = {
        "dataset": lambda r: r.dataset["name"],
        "model": lambda r: r.model["name"],
        "target_mode": lambda r: r.attack["target_mode"],
    }
    for key, value in wanted.items():
        if value is None:
            continue
        present = sorted({str(getters[key](r)) for r in records})
        kept = [r for r in records if getters[key](r) == value]
        if not kept:
            found = ", ".join(present) if present else "none"
            raise ConfigError(f"no record has {key}={value!r}; the records have {key}: {found}")
        records = kept
    return records


def summarize(values: list[float]) -> Cell | None:
    values = [float(v) for v in values if v is not None]
    if not values:
        return None
    return Cell(statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0, len(values))


def _flatten(node: Any, prefix: str = "") -> dict[str, str]:
    if isinstance(node, dict):
        out: dict[str, str] = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: json.dumps(node, sort_keys=True)}


def _short_value(text: str) -> str:
    value = json.loads(text)
    if isinstance(value, str):
        return value.rsplit(".", 1)[-1] if value.count(".") >= 2 else value  # a _target_ path: its class
    if isinstance(value, float):
        return f"{value:g}"
    return text


def setting_labels(configs: list[dict[str, Any]]) -> list[str]:
    """For configs of rows that share attack (and defense), a short label per config of the values
    in which they differ, e.g. `epochs=1, poison_rate=0.05`; "" when there is only one."""
    if len(configs) < 2:
        return [""] * len(configs)
    ignored = set(NON_RESULT_KEYS) | {"seed"}
    flat = [{k: v for k, v in _flatten(c).items() if not any(k == i or k.startswith(i + ".") for i in ignored)}
            for c in configs]
    keys = sorted(set().union(*flat))
    differing = [k for k in keys if len({f.get(k, "null") for f in flat}) > 1]
    names: dict[str, str] = {}
    for key in differing:
        parts = key.split(".")
        short = parts[-1] if parts[-1] != "_target_" else ".".join(parts[:-1])
        clash = [k for k in differing if k != key and k.split(".")[-1] == parts[-1]]
        names[key] = key if clash else short
    differing.sort(key=lambda k: names[k])
    labels = []
    for f in flat:
        labels.append(", ".join(f"{names[k]}={_short_value(f[k]) if k in f else '–'}" for k in differing))
    return labels


def _mode(attack: dict[str, Any]) -> str:
    target = attack.get("target")
    return attack["target_mode"] + (f"({target})" if target is not None and attack["target_mode"] == "all2one" else "")


def build_rows(records: list[RunRecord]) -> list[Row]:
    """One row per group of records that differ only in seed, in the attacks or the defenses table."""
    groups: dict[str, list[RunRecord]] = defaultdict(list)
    for record in records:
        groups[record.group_id].append(record)
    rows = []
    for group_id, members in groups.items():
        members.sort(key=lambda r: r.seed)
        first = members[0]
        table = "attacks" if first.defense["name"] == "none" else "defenses"
        columns = ATTACK_COLUMNS if table == "attacks" else DEFENSE_COLUMNS
        row = Row(table=table, dataset=first.dataset["name"], model=first.model["name"], attack=first.attack["name"],
                  target_mode=_mode(first.attack), defense=first.defense["name"], group_id=group_id,
                  seeds=[r.seed for r in members], config=first.config)
        excluded = first.defense.get("applicable") is False  # the same config: every seed agrees
        row.cells = {c.key: NotApplicable(first.defense.get("not_applicable", "")) if excluded
                     else summarize([c.read(r) for r in members]) for c in columns}
        rows.append(row)
    peers: dict[tuple, list[Row]] = defaultdict(list)
    for row in rows:
        peers[(row.table, row.dataset, row.model, row.attack, row.target_mode, row.defense)].append(row)
    for members in peers.values():
        for row, label in zip(members, setting_labels([m.config for m in members])):
            row.label = label
            budget = (row.config.get("defense") or {}).get("budget")
            if budget not in (None, "official") and "budget=" not in label:  # a cut budget is always named
                row.label = ", ".join(filter(None, [label, f"budget={budget}"]))
    clean_controls(rows)
    rows.sort(key=lambda r: (r.dataset, r.table, r.defense, r.model, r.attack, r.target_mode, r.label, r.group_id))
    return rows


def _training_key(row: Row) -> tuple[str, str, str]:
    trainer = {k: v for k, v in _flatten(row.config).items() if k.startswith("trainer.") and k not in NON_RESULT_KEYS}
    return row.dataset, row.model, json.dumps(trainer, sort_keys=True)


def clean_controls(rows: list[Row]) -> None:
    """Fill each attack row's `ca_vs_clean`: its mean CA minus the mean CA of the clean control
    (attack `none`, no defense) of the same dataset, model and trainer config (every trainer key
    but progress), in points. The control rows of both target modes are pooled (a clean model has
    no mode): their seed-weighted mean, their std the larger of the rows' stds and the spread of
    their means; the cell's ± is the root-sum-square of the two stds. No control trained the same
    way: no value (run `attack=none` with that trainer)."""
    controls: dict[tuple[str, str, str], list[Cell]] = defaultdict(list)
    for row in rows:
        if row.table == "attacks" and row.attack == CLEAN_ATTACK and row.cells.get("ca") is not None:
            controls[_training_key(row)].append(row.cells["ca"])
    for row in rows:
        if row.table != "attacks":
            continue
        row.cells["ca_vs_clean"] = None
        found, ca = controls.get(_training_key(row)), row.cells.get("ca")
        if row.attack == CLEAN_ATTACK or not found or ca is None:
            continue
        n = sum(c.n for c in found)
        mean = sum(c.mean * c.n for c in found) / n
        spread = statistics.stdev([c.mean for c in found]) if len(found) > 1 else 0.0
        std = max(spread, max(c.std for c in found))
        row.cells["ca_vs_clean"] = Cell(ca.mean - mean, (ca.std**2 + std**2) ** 0.5, ca.n)


def cell_text(cell: Cell | NotApplicable | None, column: Column, row_n: int) -> str:
    if isinstance(cell, NotApplicable):
        return NOT_APPLICABLE
    if cell is None:
        return "–"
    text = column.fmt(cell.mean) if cell.n == 1 else f"{column.fmt(cell.mean)} ± {column.fmt(cell.std).lstrip('+')}"
    if cell.n != row_n:
        text += f" (n={cell.n})"
    return text + (f" {FLAG}" if cell.n < FEW_SEEDS else "")


def _key_columns(table: str) -> list[str]:
    keys = ["model", "attack", "mode", "training", "setting", "n"]
    return (["defense"] + keys) if table == "defenses" else keys


def _key_values(row: Row) -> list[str]:
    values = [row.model, row.attack, row.target_mode, row.training, row.label or "–", str(row.n)]
    return ([row.defense] + values) if row.table == "defenses" else values


TABLES = (("attacks", "Attacks (no defense)", ATTACK_COLUMNS), ("defenses", "Defenses", DEFENSE_COLUMNS))
FOOTNOTE = (f"{FLAG} fewer than {FEW_SEEDS} seeds (n < {FEW_SEEDS}): read the spread with care. "
            "Mean ± sample std over seeds; (n=k) where only k of the row's runs have the value; "
            "– where none has it (e.g. LPIPS without its weights, AUROC of a defense that does not detect); "
            "n/a where the defense's threat model excludes the attack (its records say why).")


def _by_dataset(rows: list[Row]) -> dict[str, list[Row]]:
    out: dict[str, list[Row]] = defaultdict(list)
    for row in rows:
        out[row.dataset].append(row)
    return dict(sorted(out.items()))


def _describe_filters(filters: dict[str, str | None]) -> str:
    given = [f"{k}={v}" for k, v in filters.items() if v is not None]
    return f" Filters: {', '.join(given)}." if given else ""


def to_markdown(rows: list[Row], filters: dict[str, str | None] | None = None) -> str:
    lines = [
        "# backdoorbench leaderboard",
        "",
        "Generated by `python -m backdoorbench.leaderboard` from the records under `runs/`; do not edit."
        + _describe_filters(filters or {}),
        "CA, ASR, RA in %; ΔCA vs clean in points: CA minus that of the clean control (`attack=none`) trained "
        "the same way; 'after' = after the defense; DER and AUROC in [0, 1]; "
        "`setting` names what differs from the other rows of the same attack.",
    ]
    for dataset, members in _by_dataset(rows).items():
        lines += ["", f"## {dataset}"]
        for table, title, columns in TABLES:
            chosen = [r for r in members if r.table == table]
            if not chosen:
                continue
            header = _key_columns(table) + [c.header for c in columns] + ["config"]
            lines += ["", f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
            for row in chosen:
                cells = _key_values(row) + [cell_text(row.cells[c.key], c, row.n) for c in columns] + [f"`{row.group_id[:8]}`"]
                lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    lines += ["", FOOTNOTE, ""]
    return "\n".join(lines)


def to_csv(rows: list[Row], table: str) -> str:
    columns = dict((t, c) for t, _, c in TABLES)[table]
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    keys = ["dataset"] + (["defense"] if table == "defenses" else []) + ["model", "attack", "target_mode", "training",
                                                                        "setting", "n", "seeds", "group_id"]
    writer.writerow(keys + [f"{c.key}_{part}" for c in columns for part in ("mean", "std", "n")])
    for row in (r for r in rows if r.table == table):
        values = {"dataset": row.dataset, "defense": row.defense, "model": row.model, "attack": row.attack,
                  "target_mode": row.target_mode, "training": row.training, "setting": row.label, "n": row.n,
                  "seeds": " ".join(map(str, row.seeds)), "group_id": row.group_id}
        out = [values[k] for k in keys]
        for c in columns:
            cell = row.cells[c.key]
            if isinstance(cell, NotApplicable):
                out += [NOT_APPLICABLE, "", 0]
            else:
                out += [repr(cell.mean), repr(cell.std), cell.n] if cell else ["", "", 0]
        writer.writerow(out)
    return buffer.getvalue()


# Sorting reads each cell's data-sort (a number, or text); no library, no server, no network.
SORT_SCRIPT = """
document.querySelectorAll("table.sortable th").forEach(function (th, column) {
  th.addEventListener("click", function () {
    var table = th.closest("table"), body = table.tBodies[0];
    var ascending = th.getAttribute("aria-sort") !== "ascending";
    table.querySelectorAll("th").forEach(function (h) { h.removeAttribute("aria-sort"); });
    th.setAttribute("aria-sort", ascending ? "ascending" : "descending");
    var rows = Array.prototype.slice.call(body.rows);
    rows.sort(function (a, b) {
      var x = a.cells[column].getAttribute("data-sort"), y = b.cells[column].getAttribute("data-sort");
      var nx = parseFloat(x), ny = parseFloat(y), order;
      if (x === "" && y === "") order = 0;
      else if (x === "") return 1;   /* missing values last, either way */
      else if (y === "") return -1;
      else if (!isNaN(nx) && !isNaN(ny)) order = nx - ny;
      else order = x.localeCompare(y);
      return ascending ? order : -order;
    });
    rows.forEach(function (r) { body.appendChild(r); });
  });
});
"""
STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin-bottom: 1.5em; font-size: 14px; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: right; white-space: nowrap; }
th { background: #f2f2f2; cursor: pointer; user-select: none; }
th[aria-sort=ascending]::after { content: " ▲"; } th[aria-sort=descending]::after { content: " ▼"; }
td.text { text-align: left; } code { font-size: 12px; }
"""


def to_html(rows: list[Row], filters: dict[str, str | None] | None = None) -> str:
    esc = html.escape
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', "<title>backdoorbench leaderboard</title>",
        f"<style>{STYLE}</style></head><body>", "<h1>backdoorbench leaderboard</h1>",
        "<p>Generated by <code>python -m backdoorbench.leaderboard</code> from the records under <code>runs/</code>; "
        f"do not edit.{esc(_describe_filters(filters or {}))} Click a column header to sort.</p>",
    ]
    for dataset, members in _by_dataset(rows).items():
        parts.append(f"<h2>{esc(dataset)}</h2>")
        for table, title, columns in TABLES:
            chosen = [r for r in members if r.table == table]
            if not chosen:
                continue
            header = _key_columns(table) + [c.header for c in columns] + ["config"]
            parts += [f"<h3>{esc(title)}</h3>", '<table class="sortable"><thead><tr>']
            parts += [f"<th>{esc(h)}</th>" for h in header]
            parts.append("</tr></thead><tbody>")
            for row in chosen:
                parts.append("<tr>")
                for key, value in zip(_key_columns(table), _key_values(row)):
                    sort = value if key != "n" else str(row.n)
                    parts.append(f'<td class="text" data-sort="{esc(sort)}">{esc(value)}</td>')
                for c in columns:
                    cell = row.cells[c.key]
                    sort = repr(cell.mean) if cell else ""
                    parts.append(f'<td data-sort="{sort}">{esc(cell_text(cell, c, row.n))}</td>')
                parts.append(f'<td class="text" data-sort="{esc(row.group_id)}"><code>{esc(row.group_id[:8])}</code></td>')
                parts.append("</tr>")
            parts.append("</tbody></table>")
    if not rows:
        parts.append("<p>No records.</p>")
    parts += [f"<p>{esc(FOOTNOTE)}</p>", f"<script>{SORT_SCRIPT}</script>", "</body></html>", ""]
    return "\n".join(parts)


@dataclass
class LeaderboardFiles:
    markdown: Path
    html: Path
    csv: dict[str, Path]
    n_rows: int
    n_records: int


def write_leaderboard(results_dir: str | Path, *, dataset: str | None = None, model: str | None = None,
                      target_mode: str | None = None) -> LeaderboardFiles:
    """Build the tables from the records under `<results_dir>/runs/` and write them to
    `<results_dir>/leaderboard/` (leaderboard.md, leaderboard.html, attacks.csv, defenses.csv)."""
    results_dir = Path(results_dir).expanduser()
    if not (results_dir / "runs").is_dir():
        raise ConfigError(f"results_dir={str(results_dir)!r} has no runs/ folder; run `python -m backdoorbench "
                          f"results_dir={results_dir}` first, or pass the results_dir that holds the records")
    filters = {"dataset": dataset, "model": model, "target_mode": target_mode}
    records = filter_records(load_records(results_dir), **filters)
    if not records:
        raise ConfigError(f"no readable record under {results_dir / 'runs'}; run `python -m backdoorbench` first")
    rows = build_rows(records)
    out = ensure_writable_dir(results_dir / "leaderboard", "the leaderboard folder at results_dir")
    texts = {"leaderboard.md": to_markdown(rows, filters), "leaderboard.html": to_html(rows, filters),
             "attacks.csv": to_csv(rows, "attacks"), "defenses.csv": to_csv(rows, "defenses")}
    paths = {name: atomic_write_text(out / name, text) for name, text in texts.items()}
    return LeaderboardFiles(markdown=paths["leaderboard.md"], html=paths["leaderboard.html"],
                            csv={"attacks": paths["attacks.csv"], "defenses": paths["defenses.csv"]},
                            n_rows=len(rows), n_records=len(records))


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


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if "-h" in args or "--help" in args:
        print(HELP)
        return 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            options = parse_args(args, {"results_dir": "results", **{k: None for k in FILTERS}}, USAGE)
            results_dir = options.pop("results_dir")
            files = write_leaderboard(results_dir, **options)
        except UserError as exc:
            files = exc
    for warning in caught:  # one line each, not Python's two-line warning format
        print(f"warning: {warning.message}", file=sys.stderr)
    if isinstance(files, UserError):
        print(f"error: {files}", file=sys.stderr)
        return 2
    print(f"{files.n_rows} rows from {files.n_records} records -> {files.markdown}, {files.html}, "
          f"{files.csv['attacks']}, {files.csv['defenses']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
