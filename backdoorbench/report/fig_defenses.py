"""Figures of what a defense saw: Neural Cleanse's anomaly index (3), STRIP's entropy (4), fine-pruning's
curve (5), and the ASR the retuning attack recovers after each defense (10)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display, no GUI toolkit

from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
import numpy as np  # noqa: E402

from backdoorbench.report.plot import (Run, panel_grid, pick_per_attack, run_setting, save_figure,
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
    """One panel per attack, one row per defense (the undefended victim first): the ASR after the defense
    (open circle) joined to the ASR after the retuning attack's last step (filled, ± std over seeds). A
    rise of 10 points or more is drawn red, a fall of as much blue. Rows, not curves: with twenty
    defenses, per-step curves and their bands overlap into one smear; the per-step numbers are in the
    records and the leaderboard's reactivation table."""
    written = []
    for dataset, by_attack in sorted(_reactivation_curves(runs).items()):
        names = sorted({name for by_name in by_attack.values() for name in by_name}, key=lambda n: (n != UNDEFENDED, n))
        fig, axes, spare = panel_grid(len(by_attack), width=4.6, height=0.8 + 0.24 * len(names))
        last_steps = set()
        for ax, (label, by_name) in zip(axes, sorted(by_attack.items())):
            for row, name in enumerate(names):
                seeds = by_name.get(name)
                if not seeds:
                    continue
                # seeds share one budget in a sweep; a seed retuned with another budget is left out
                steps = max((tuple(st) for st, _ in seeds.values()), key=lambda st: sum(tuple(x) == st for x, _ in seeds.values()))
                values = np.array([asr for st, asr in seeds.values() if tuple(st) == steps], dtype=float) * 100
                last_steps.add(steps[-1])
                start, final = values[:, 0].mean(), values[:, -1].mean()
                spread = values[:, -1].std(ddof=1) if len(values) > 1 else 0.0
                rise = final - start
                colour = "tab:red" if rise >= 10 else "tab:blue" if rise <= -10 else "0.45"
                ax.plot([start, final], [row, row], color=colour, linewidth=1.6, zorder=1)
                if spread:  # the spread of the final ASR, a thin bar just under the row
                    ax.errorbar(final, row + 0.25, xerr=spread, fmt="none", ecolor=colour, alpha=0.6, capsize=2,
                                elinewidth=0.8, zorder=2)
                ax.plot(final, row, "o", color=colour, markersize=5, zorder=3)
                ax.plot(start, row, "o", markerfacecolor="white", markeredgecolor=colour, markersize=5, zorder=4)
            ax.set_title(label, fontsize=9)
            ax.set_xlim(-3, 103)
            ax.set_ylim(len(names) - 0.4, -0.6)
            ax.set_yticks(range(len(names)))
            ax.set_yticklabels(names, fontsize=8)
            ax.grid(axis="x", color="0.9")
            ax.set_xlabel("ASR % on the test set")
        after = "/".join(str(s) for s in sorted(last_steps))
        handles = [Line2D([], [], linestyle="", marker="o", markerfacecolor="white", markeredgecolor="0.3",
                          label="after the defense"),
                   Line2D([], [], linestyle="", marker="o", color="0.3", label=f"after {after} retuning steps (SGD)"),
                   Line2D([], [], color="tab:red", label="rises 10 points or more"),
                   Line2D([], [], color="tab:blue", label="falls 10 points or more"),
                   Line2D([], [], color="0.45", label="within 10 points"),
                   Line2D([], [], linestyle="", label="empty row: no reactivation record (n/a, or not run)")]
        shared_legend(fig, handles, spare)
        seeds = sorted({seed for by_name in by_attack.values() for curve in by_name.values() for seed in curve})
        over = f"seed {seeds[0]}" if len(seeds) == 1 else "mean ± std over seeds"
        fig.suptitle(f"ASR after the defense and after the retuning attack, {dataset} ({over})")
        written += save_figure(fig, out, f"{dataset}_10_reactivation{suffix}")
    return written
