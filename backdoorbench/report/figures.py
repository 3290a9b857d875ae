"""`python -m backdoorbench.figures [results_dir=DIR] [dataset=NAME] [attacks=A,B] [residual_scale=10]`.

Paper figures drawn from records and their artifacts only (never retraining), as PNG and PDF
under `<results_dir>/figures/`, one file per figure and dataset, with a panel (or row) per attack:

1. trigger gallery: clean, poisoned, and the residual |poisoned - clean| as a heat map with its
   colour bar (full scale 1/residual_scale of the pixel range);
2. CA and ASR vs poison rate on a log axis (runs without a defense that differ only in poison
   rate and seed), a panel per attack, mode and setting;
3. Neural Cleanse anomaly index per class, threshold line at 2;
4. STRIP entropy histograms, clean vs triggered test inputs;
5. fine-pruning: CA and ASR vs fraction of channels pruned (before fine-tuning);
6. GradCAM heatmaps of clean and poisoned inputs on the attacked model, with a colour bar;
7. robust accuracy vs L_inf eps, a curve per model (the attacked one and each defended setting),
   mean ± std over seeds, a panel per PGD loss (CE, CW) and source (white-box, transferred from
   the attacked model): runs with eval.pgd.eps a list;
8. the angular-margin defense: clean and PGD-CE accuracy vs lambda (penalty_weight).
9. clean-data budget: CA after and ASR after vs the defender's clean fraction, a panel per
   defense, attack, mode and setting (runs that differ only in `defense.clean_fraction` and seed).
10. post-purification robustness: ASR recovered by the retuning attack vs its fine-tuning steps
    (eval.reactivation), a panel per attack, a curve per defense (mean ± std over seeds), the
    undefended victim's curve as the reference.
11. ROC curves of the detectors, a panel per attack, a curve per detector (the leaderboard's
    detection board cell: its runs that saved their per-item scores), averaged vertically over
    seeds (the mean TPR at each FPR), the detector's own threshold marked; a figure per level
    (`_dataset`: training samples flagged; `_input`: test inputs rejected).

Figures 1 and 6 have a row per attack and mode, split into pages of ROWS_PER_PAGE rows
(`<stem>_page<k>`); `attacks=` keeps only the attacks named, in files named after them
(`<stem>_badnets-wanet`). Panel titles name the attack, its
mode and setting (poison rate, training, seed); a legend shared by the panels sits in a spare panel
or below them, never over a curve.

A figure whose data is absent is skipped with one line naming the runs that would produce it.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from backdoorbench import checks
from backdoorbench.errors import ConfigError
from backdoorbench.fileio import ensure_writable_dir
from backdoorbench.report.fig_detection import detection_roc
from backdoorbench.report.fig_defenses import (fine_pruning_curves, neural_cleanse_anomaly, reactivation_curves,
                                               strip_histograms)
from backdoorbench.report.fig_examples import gradcam_heatmaps, trigger_gallery
from backdoorbench.report.fig_robust import penalty_weight_curves, robust_accuracy_curves
from backdoorbench.report.fig_sweeps import clean_budget_curves, poison_rate_curves
from backdoorbench.report.leaderboard import parse_args, results_runs, run_command
from backdoorbench.report.plot import Run
from backdoorbench.report.query import filter_records, load_records_with_paths

USAGE = "usage: python -m backdoorbench.figures [results_dir=DIR] [dataset=NAME] [attacks=NAME,NAME] [residual_scale=10]"
HELP = f"""{USAGE}

Draws the figures from the run records under <results_dir>/runs (and the arrays saved beside
them) into <results_dir>/figures, as PNG and PDF; a figure whose runs are missing is skipped
with the command that makes them. dataset= keeps one dataset; attacks= draws the trigger gallery and GradCAM
figures for those attacks only (files named after them); residual_scale= multiplies the poisoned-minus-clean
residuals of the trigger gallery. results_dir defaults to outputs, where runs write by default; the committed figures are
results_dir=results."""


@dataclass(frozen=True)
class Figure:
    """One figure: its number, its title, the function that draws it, and the runs that make its data."""

    number: int
    title: str
    draw: Callable[..., list[Path]]
    produce: str  # the overrides of the runs that make its data


FIGURES = (
    Figure(1, "trigger gallery", trigger_gallery, "attack=<name> (any run with eval.stealth_images > 0)"),
    Figure(2, "CA and ASR vs poison rate", poison_rate_curves,
           "--multirun attack=<name> attack.poison_rate=0.01,0.05,0.1 seed=0,1,2"),
    Figure(3, "Neural Cleanse anomaly index", neural_cleanse_anomaly, "attack=<name> defense=neural_cleanse"),
    Figure(4, "STRIP entropy histograms", strip_histograms, "attack=<name> defense=strip"),
    Figure(5, "fine-pruning CA/ASR vs fraction pruned", fine_pruning_curves, "attack=<name> defense=fine_pruning"),
    Figure(6, "GradCAM heatmaps", gradcam_heatmaps, "attack=<name> (any run with eval.stealth_images > 0)"),
    Figure(7, "robust accuracy vs eps", robust_accuracy_curves, "--multirun experiment=angular_margin_xu2020"),
    Figure(8, "angular margin: clean and robust accuracy vs lambda", penalty_weight_curves,
           "--multirun experiment=angular_margin_xu2020"),
    Figure(9, "CA/ASR after vs clean-data budget", clean_budget_curves,
           "--multirun experiment=clean_budget attack=<name> seed=0,1,2"),
    Figure(10, "ASR after the defense and after retuning (reactivation)", reactivation_curves,
           "--multirun attack=<name> defense=<name>,<name> eval.reactivation.enabled=true seed=0,1,2"),
    Figure(11, "ROC curves of the detectors", detection_roc,
           "--multirun attack=<name> defense=spectral,activation_clustering,strip eval.detection_only=true seed=0,1,2"),
)


def write_figures(results_dir: str | Path, *, dataset: str | None = None, attacks: list[str] | None = None,
                  residual_scale: float = 10.0, report: Callable[[str], None] = print) -> dict[int, list[Path]]:
    """Draw every figure whose data the records under `<results_dir>/runs/` hold, of the `attacks`
    named (None: all); `report` gets one line per figure skipped. Returns figure number -> files written."""
    results_dir = results_runs(results_dir)
    checks.number("", "residual_scale", residual_scale, 0, low_open=True, hint="e.g. 10")
    loaded = load_records_with_paths(results_dir)
    kept = {id(r) for r in filter_records([r for r, _ in loaded], dataset=dataset)}
    if attacks is not None:
        present = sorted({r.attack["name"] for r, _ in loaded if id(r) in kept})
        unknown = [a for a in attacks if a not in present]
        if unknown:
            raise ConfigError(f"attacks={','.join(attacks)}: no record has attack {', '.join(unknown)}; "
                              f"the records have: {', '.join(present) or 'none'}")
        kept = {id(r) for r, _ in loaded if id(r) in kept and r.attack["name"] in attacks}
    runs = [Run(record, path) for record, path in loaded if id(record) in kept]
    # a chosen subset gets its own file names: it never replaces the figures of every attack
    suffix = "_" + "-".join(attacks) if attacks is not None else ""
    out = ensure_writable_dir(results_dir / "figures", "the figures folder at results_dir")
    where = "" if str(results_dir) == "outputs" else f" results_dir={results_dir}"
    written: dict[int, list[Path]] = {}
    for figure in FIGURES:
        written[figure.number] = figure.draw(runs, out, residual_scale=residual_scale, suffix=suffix)
        if not written[figure.number]:
            report(f"skipped figure {figure.number} ({figure.title}): no run has its data; "
                   f"make it with: python -m backdoorbench {figure.produce}{where}")
    return written


def main(argv: list[str] | None = None) -> int:
    """The command line: 0 on success, 2 with one `error:` line on bad input."""
    def work(args: list[str]) -> list[str]:
        options = parse_args(args, {"results_dir": "outputs", "dataset": None, "attacks": None,
                                    "residual_scale": "10"}, USAGE)
        try:
            scale = float(options["residual_scale"])
        except ValueError:
            raise ConfigError(f"residual_scale={options['residual_scale']!r} is not a number; use e.g. residual_scale=10") from None
        written = write_figures(options["results_dir"], dataset=options["dataset"], residual_scale=scale,
                                attacks=options["attacks"].split(",") if options["attacks"] else None,
                                report=lambda line: print(line, file=sys.stderr))
        return [f"figure {number}: {path}" for number, paths in written.items() for path in paths]

    def shown(warning: warnings.WarningMessage) -> bool:  # ours, not matplotlib's
        return issubclass(warning.category, UserWarning) and "matplotlib" not in str(warning.filename)

    return run_command(sys.argv[1:] if argv is None else argv, HELP, work, shown)
