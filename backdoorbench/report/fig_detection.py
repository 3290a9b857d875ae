"""Figure 11: ROC curves of the detectors, a panel per attack, a curve per detector, drawn from the
per-item scores the runs saved (run_keys.DETECTION_*; an older STRIP record's entropies), for the
detection board's cell of each detector and attack; one figure per level (dataset-level detectors
flag training samples, input-level ones test inputs: the two never share a ROC's items). Over seeds, the curves are averaged vertically:
the mean TPR at each FPR of a fixed grid, each seed's ROC interpolated linearly between its points."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display, no GUI toolkit

from matplotlib.lines import Line2D  # noqa: E402
import numpy as np  # noqa: E402

from backdoorbench.report import detection  # noqa: E402
from backdoorbench.report.derived import build_rows  # noqa: E402
from backdoorbench.report.plot import Run, distinct_colour, panel_grid, save_figure, shared_legend  # noqa: E402
from backdoorbench.run_keys import (DETECTION_FLAGGED, DETECTION_SCORES, DETECTION_THRESHOLD,  # noqa: E402
                                    DETECTION_TRUTH)

FPR_GRID = np.linspace(0.0, 1.0, 201)  # where the seeds' TPRs are averaged
# Older records of input detectors kept their scores under the detector's own names: (clean, triggered,
# threshold or None, the sign that makes higher = more suspicious). STRIP saved entropies (low = triggered).
LEGACY_INPUT_ARRAYS = (("strip_entropy_clean", "strip_entropy_poisoned", "strip_entropy_threshold", -1.0),
                       ("input_scores_clean", "input_scores_poisoned", None, 1.0))
LEVEL_TEXT = {"dataset": "training samples", "input": "test inputs"}
LEVEL_TITLE = {"dataset": "dataset-level detector (training samples flagged)",
               "input": "input-level detector (test inputs rejected)"}


def detection_arrays(artifacts: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
    """(scores, truth, flagged) of a run's saved detection, higher = more suspicious, one entry per
    scored item; flagged None where the run kept no verdict. None when the run saved no scores."""
    if DETECTION_SCORES in artifacts and DETECTION_TRUTH in artifacts:
        scores, truth = artifacts[DETECTION_SCORES].astype(float), artifacts[DETECTION_TRUTH].astype(bool)
        flagged = artifacts.get(DETECTION_FLAGGED)
        if flagged is None and DETECTION_THRESHOLD in artifacts:
            flagged = scores > float(artifacts[DETECTION_THRESHOLD])
        return scores, truth, None if flagged is None else flagged.astype(bool)
    for clean_key, triggered_key, threshold_key, sign in LEGACY_INPUT_ARRAYS:
        if clean_key in artifacts and triggered_key in artifacts:
            clean, triggered = artifacts[clean_key].astype(float), artifacts[triggered_key].astype(float)
            scores = sign * np.concatenate([clean, triggered])
            truth = np.concatenate([np.zeros(len(clean), bool), np.ones(len(triggered), bool)])
            threshold = artifacts.get(threshold_key) if threshold_key else None
            return scores, truth, None if threshold is None else scores > sign * float(threshold)
    return None


def roc_points(scores: np.ndarray, truth: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(FPR, TPR) at every distinct threshold, from (0, 0) to (1, 1); tied scores are one point (the
    curve crosses them diagonally, as the AUROC counts ties one half)."""
    order = np.argsort(-scores, kind="stable")
    ranked, hits = scores[order], truth[order]
    last_of_ties = np.r_[np.nonzero(np.diff(ranked))[0], len(ranked) - 1]
    tps, fps = np.cumsum(hits)[last_of_ties], np.cumsum(~hits)[last_of_ties]
    return np.r_[0.0, fps / max(int((~truth).sum()), 1)], np.r_[0.0, tps / max(int(truth.sum()), 1)]


def area(fpr: np.ndarray, tpr: np.ndarray) -> float:
    """The area under a ROC of `roc_points`: the AUROC, ties counted one half (the diagonal across them)."""
    return float(np.sum(np.diff(fpr) * (tpr[1:] + tpr[:-1]) / 2))


def vertical_average(curves: list[tuple[np.ndarray, np.ndarray]], grid: np.ndarray = FPR_GRID
                     ) -> tuple[np.ndarray, np.ndarray]:
    """The mean and sample std (0 for one curve) over `curves` of the TPR at each FPR of `grid`: each
    curve linear between its points, at an FPR where it rises vertically the top of the rise."""
    tprs = np.array([np.interp(grid, fpr, tpr) for fpr, tpr in curves])
    return tprs.mean(0), tprs.std(0, ddof=1) if len(tprs) > 1 else np.zeros(len(grid))


def _curves(runs: list[Run]) -> dict[str, dict[str, dict[str, tuple[str, str, list[tuple]]]]]:
    """dataset -> attack label -> detector -> (level, the victims' training, [(seed, scores, truth,
    flagged)] of the runs of the detection board's cell that saved their scores)."""
    by_id = {run.record.run_id: run for run in runs}
    found: dict = defaultdict(lambda: defaultdict(dict))
    for board in detection.boards(build_rows([run.record for run in runs])):
        for entry in board.entries:
            saved = []
            for run_id in entry.row.run_ids:
                run = by_id.get(run_id)
                arrays = detection_arrays(run.artifacts) if run is not None and run.record.artifacts else None
                if arrays is not None and arrays[1].any() and (~arrays[1]).any():  # both classes: a ROC exists
                    saved.append((run.record.seed, *arrays))
            if saved:
                row = entry.row
                mode = row.target_mode.split("(")[0]  # as the other figures name a panel: `badnets all2one`
                found[row.dataset][f"{row.attack} {mode}"][row.defense] = (board.level, row.training, saved)
    return found


def detection_roc(runs: list[Run], out: Path, residual_scale: float = 10.0, suffix: str = "") -> list[Path]:
    written = []
    for dataset, by_attack in sorted(_curves(runs).items()):
        for level in sorted({level for by_detector in by_attack.values() for level, _, _ in by_detector.values()}):
            at_level = {label: {name: cell for name, cell in by_detector.items() if cell[0] == level}
                        for label, by_detector in by_attack.items()}
            at_level = {label: cells for label, cells in at_level.items() if cells}
            written += _roc_figure(dataset, level, at_level, out, suffix)
    return written


def _roc_figure(dataset: str, level: str, by_attack: dict, out: Path, suffix: str) -> list[Path]:
    """One level's figure: a panel per attack, a curve per detector of that level."""
    detectors = sorted({d for by_detector in by_attack.values() for d in by_detector})
    colours = {name: distinct_colour(i) for i, name in enumerate(detectors)}
    counts: dict[str, set[int]] = defaultdict(set)
    seeds: set[int] = set()
    for by_detector in by_attack.values():
        for name, (_, _, saved) in by_detector.items():
            counts[name].add(len(saved))
            seeds.update(seed for seed, *_ in saved)
    # the seeds behind each detector's curves, in the legend: one number, or the range over the panels
    seeds_text = {name: "" if len(seeds) == 1 else f", n={min(c)}" if len(c) == 1 else f", n={min(c)}–{max(c)}"
                  for name, c in counts.items()}
    fig, axes, spare = panel_grid(len(by_attack), width=3.4, height=3.8)
    handles: dict[str, Line2D] = {}
    for ax, (label, by_detector) in zip(axes, sorted(by_attack.items())):
        ax.plot([0, 1], [0, 1], color="0.6", linestyle=":", linewidth=1)
        areas = []
        for name in sorted(by_detector):
            _, _, saved = by_detector[name]
            curves = [roc_points(scores, truth) for _, scores, truth, _ in saved]
            mean, std = vertical_average(curves)
            areas.append((name, float(np.mean([area(*curve) for curve in curves]))))
            style = dict(color=colours[name], linestyle="-", linewidth=1.6)
            ax.plot(FPR_GRID, mean, **style)
            if len(saved) > 1:
                ax.fill_between(FPR_GRID, np.clip(mean - std, 0, 1), np.clip(mean + std, 0, 1),
                                color=colours[name], alpha=0.15, linewidth=0)
            verdicts = [(float(flagged[~truth].mean()), float(flagged[truth].mean()))
                        for _, _, truth, flagged in saved if flagged is not None]
            if verdicts:  # the detector's own threshold: mean (FPR, TPR) over the seeds
                ax.plot(*np.mean(verdicts, 0), marker="o", markersize=6, color=colours[name],
                        markeredgecolor="k", linestyle="none")
            handles.setdefault(name, Line2D([], [], label=f"{name}{seeds_text[name]}", **style))
        # each detector's AUROC (the mean over its seeds), in its colour, where the curves seldom go;
        # a panel of many detectors stacks them closer, below the diagonal's upper half
        step = min(0.075, 0.55 / max(len(areas), 1))
        for k, (name, value) in enumerate(reversed(areas)):
            ax.text(0.97, 0.04 + step * k, f"AUROC {value:.3f}", color=colours[name],
                    fontsize=8 if step >= 0.07 else 7, ha="right", va="bottom", transform=ax.transAxes)
        trainings = sorted({training for _, training, _ in by_detector.values()})
        ax.set_title(f"{label}\nvictim {' / '.join(trainings)}", fontsize=9)  # its detectors' cells may differ
        ax.set_xlim(-0.01, 1.01)
        ax.set_ylim(-0.01, 1.01)
        ax.set_aspect("equal")
        ax.set_xlabel("false positive rate")
        ax.set_ylabel("true positive rate")
    legend = [handles[name] for name in detectors] + [
        Line2D([], [], color="0.6", linestyle=":", label="chance"),
        Line2D([], [], color="0.4", marker="o", markeredgecolor="k", linestyle="none",
               label="the detector's own threshold")]
    shared_legend(fig, legend, spare)
    over = (f"seed {min(seeds)}" if len(seeds) == 1 else
            "mean over seeds by vertical averaging: the mean TPR at each FPR; ± std shaded")
    fig.suptitle(f"ROC of each {LEVEL_TITLE[level]} per attack, {dataset}\n({over})", fontsize=11)
    return save_figure(fig, out, f"{dataset}_11_detection_roc_{level}{suffix}")
