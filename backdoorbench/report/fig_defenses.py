"""Figures of what a defense saw: Neural Cleanse's anomaly index (3), STRIP's entropy (4), fine-pruning's
curve (5), and the ASR the retuning attack recovers after each defense (10)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display, no GUI toolkit

from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
import numpy as np  # noqa: E402

from backdoorbench.report.plot import (Run, distinct_colour, panel_grid, pick_per_attack, run_setting, save_figure,
                                      shared_legend)  # noqa: E402


def neural_cleanse_anomaly(runs: list[Run], out: Path, residual_scale: float = 10.0, suffix: str = "") -> list[Path]:
    written = []
    for dataset, by_attack in pick_per_attack(runs, ("nc_anomaly_index", "nc_mask_l1"), "neural_cleanse").items():
        fig, axes, spare = panel_grid(len(by_attack))
        thresholds = set()
        for ax, (label, run) in zip(axes, by_attack.items()):
            index, norms = run.artifacts["nc_anomaly_index"], run.artifacts["nc_mask_l1"]
            threshold = float(run.artifacts.get("nc_anomaly_threshold", 2.0))
            thresholds.add(threshold)
            flagged = (norms < np.median(norms)) & (index > threshold)  # as Neural Cleanse flags them
            ax.bar(np.arange(len(index)), np.minimum(index, 20), color=np.where(flagged, "tab:red", "tab:blue"))
            ax.axhline(threshold, color="k", linestyle="--", linewidth=1)
            ax.set_xticks(np.arange(len(index)))
            ax.set_title(f"{label}\n{run_setting(run)}", fontsize=9)
            ax.set_xlabel("class")
            ax.set_ylabel("anomaly index (capped at 20)")
        threshold = f" {thresholds.pop():g}" if len(thresholds) == 1 else ""
        shared_legend(fig, [Line2D([], [], color="k", linestyle="--", linewidth=1, label=f"threshold{threshold}"),
                             Patch(color="tab:red", label="flagged: above the threshold, small mask"),
                             Patch(color="tab:blue", label="not flagged")], spare)
        fig.suptitle(f"Neural Cleanse anomaly index per class, {dataset}")
        written += save_figure(fig, out, f"{dataset}_3_neural_cleanse{suffix}")
    return written


def strip_histograms(runs: list[Run], out: Path, residual_scale: float = 10.0, suffix: str = "") -> list[Path]:
    written = []
    for dataset, by_attack in pick_per_attack(runs, ("strip_entropy_clean", "strip_entropy_poisoned"), "strip").items():
        fig, axes, spare = panel_grid(len(by_attack))
        sizes = {(len(r.artifacts["strip_entropy_clean"]), len(r.artifacts["strip_entropy_poisoned"]))
                 for r in by_attack.values()}
        n_clean, n_poisoned = ("", "")
        if len(sizes) == 1:  # the same test inputs in every panel: say n once, in the legend
            n_clean, n_poisoned = (f" (n={n})" for n in sizes.pop())
        for ax, (label, run) in zip(axes, by_attack.items()):
            clean, poisoned = run.artifacts["strip_entropy_clean"], run.artifacts["strip_entropy_poisoned"]
            bins = np.linspace(min(clean.min(), poisoned.min()), max(clean.max(), poisoned.max()) + 1e-9, 30)
            ax.hist(clean, bins=bins, alpha=0.6, density=True, label=f"clean test inputs{n_clean}")
            ax.hist(poisoned, bins=bins, alpha=0.6, density=True, label=f"triggered test inputs{n_poisoned}")
            if "strip_entropy_threshold" in run.artifacts:
                ax.axvline(float(run.artifacts["strip_entropy_threshold"]), color="k", linestyle="--", linewidth=1,
                           label="rejection threshold")
            extra = "" if n_clean else f"; n = {len(clean)}, {len(poisoned)}"
            ax.set_title(f"{label}\n{run_setting(run)}{extra}", fontsize=9)
            ax.set_xlabel("mean entropy (bits)")
            ax.set_ylabel("density")
        shared_legend(fig, axes[0], spare)
        fig.suptitle(f"STRIP entropy, clean vs triggered test inputs, {dataset}")
        written += save_figure(fig, out, f"{dataset}_4_strip_entropy{suffix}")
    return written


def fine_pruning_curves(runs: list[Run], out: Path, residual_scale: float = 10.0, suffix: str = "") -> list[Path]:
    written = []
    for dataset, by_attack in pick_per_attack(runs, ("fp_pruned_fraction", "fp_clean_acc", "fp_asr"), "fine_pruning").items():
        fig, axes, spare = panel_grid(len(by_attack))
        for ax, (label, run) in zip(axes, by_attack.items()):
            a = run.artifacts
            ax.plot(a["fp_pruned_fraction"], 100 * a["fp_clean_acc"], "o-", label="CA")
            ax.plot(a["fp_pruned_fraction"], 100 * a["fp_asr"], "s--", label="ASR")
            if "fp_chosen_fraction" in a:
                ax.axvline(float(a["fp_chosen_fraction"]), color="k", linestyle=":", linewidth=1, label="pruned by the defense")
            ax.set_title(f"{label}\n{run_setting(run)}", fontsize=9)
            ax.set_xlabel("fraction of last-stage channels pruned")
            ax.set_ylabel("% on the test set")
            ax.set_ylim(-2, 102)
        # the panel that draws the most (the defense's line included) names them all
        shared_legend(fig, max(axes, key=lambda ax: len(ax.get_legend_handles_labels()[1])), spare)
        fig.suptitle(f"Fine-pruning before fine-tuning, {dataset}")
        written += save_figure(fig, out, f"{dataset}_5_fine_pruning{suffix}")
    return written


UNDEFENDED = "no defense (victim)"


def _reactivation_curves(runs: list[Run]) -> dict[str, dict[str, dict[str, dict[int, list[float]]]]]:
    """dataset -> attack label -> curve name (a defense, or UNDEFENDED) -> seed -> ASR per step.
    The victim's curve is the same in every run of a seed (one victim, one random stream): kept once."""
    curves: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))
    for run in sorted(runs, key=lambda r: (r.record.seed, r.record.run_id)):
        block = getattr(run.record, "reactivation", None) or {}
        for part, name in (("defended", run.record.defense["name"]), ("attacked", UNDEFENDED)):
            curve = block.get(part)
            if isinstance(curve, dict) and curve.get("asr"):
                curves[run.dataset][run.attack_label][name].setdefault(run.record.seed, (curve["steps"], curve["asr"]))
    return curves


def reactivation_curves(runs: list[Run], out: Path, residual_scale: float = 10.0, suffix: str = "") -> list[Path]:
    written = []
    for dataset, by_attack in sorted(_reactivation_curves(runs).items()):
        fig, axes, spare = panel_grid(len(by_attack), width=4.8, height=4.2)
        names = sorted({name for by_name in by_attack.values() for name in by_name}, key=lambda n: (n != UNDEFENDED, n))
        colours = {name: distinct_colour(i) for i, name in enumerate(names)}
        handles: dict[str, Any] = {}
        for ax, (label, by_name) in zip(axes, sorted(by_attack.items())):
            for name in sorted(by_name, key=lambda n: (n != UNDEFENDED, n)):
                seeds = by_name[name]
                # seeds share one budget in a sweep; a seed retuned with another budget is left out
                steps = max((tuple(st) for st, _ in seeds.values()), key=lambda st: sum(tuple(x) == st for x, _ in seeds.values()))
                values = np.array([asr for st, asr in seeds.values() if tuple(st) == steps], dtype=float) * 100
                mean, std = values.mean(0), values.std(0, ddof=1) if len(values) > 1 else np.zeros(values.shape[1])
                style = dict(color=colours[name], linestyle="--" if name == UNDEFENDED else "-", marker="o", markersize=3)
                ax.plot(steps, mean, label=name, **style)
                if len(values) > 1:
                    ax.fill_between(steps, mean - std, mean + std, color=colours[name], alpha=0.2, linewidth=0)
                handles.setdefault(name, Line2D([], [], label=name, **style))
            ax.set_title(label, fontsize=9)
            ax.set_xlabel("retuning steps (SGD)")
            ax.set_ylabel("ASR % on the test set")
            ax.set_ylim(-2, 102)
        shared_legend(fig, list(handles.values()), spare)
        seeds = sorted({seed for by_name in by_attack.values() for curve in by_name.values() for seed in curve})
        over = f"seed {seeds[0]}" if len(seeds) == 1 else "mean ± std over seeds"
        fig.suptitle(f"ASR recovered by the retuning attack vs steps, {dataset} ({over})")
        written += save_figure(fig, out, f"{dataset}_10_reactivation{suffix}")
    return written
