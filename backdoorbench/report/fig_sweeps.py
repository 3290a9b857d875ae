"""Figures of sweeps: CA and ASR vs poison rate (2) and vs the defender's clean-data budget (9)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import matplotlib

matplotlib.use("Agg")  # files only: no display, no GUI toolkit

from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import NullLocator  # noqa: E402

from backdoorbench.records import RunRecord  # noqa: E402
from backdoorbench.run_keys import config_hash  # noqa: E402
from backdoorbench.report.plot import (Run, distinct_colour, mean_std, panel_grid, save_figure,
                                      shared_legend, training_text)  # noqa: E402
from backdoorbench.report.query import NON_RESULT_KEYS, setting_labels  # noqa: E402


class SweepPanel(NamedTuple):
    """The runs of one setting that differ only in a swept config key and the seed."""
    key: tuple  # the series `key_of` named; its first item is the dataset
    training: str  # the victim's training, as _training writes it
    setting: str  # how this setting differs from the others of its series ("" when it is the only one)
    members: list[Run]


def _sweep_panels(runs: list[Run], swept: str, key_of: Callable[[Run], tuple | None],
                  value_of: Callable[[Run], float]) -> dict[str, list[SweepPanel]]:
    """dataset -> panels, for each series `key_of` names (None: the run is left out) and each setting
    of it that holds at least two values of `swept`."""
    drop = NON_RESULT_KEYS + ("seed", swept)
    series: dict[tuple, dict[str, list[Run]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        key = key_of(run)
        if key is not None:
            series[key][config_hash(run.record.config, drop)].append(run)
    short = swept.rsplit(".", 1)[-1]
    panels: dict[str, list[SweepPanel]] = defaultdict(list)
    for key, by_setting in sorted(series.items()):
        kept = [members for _, members in sorted(by_setting.items()) if len({value_of(m) for m in members}) >= 2]
        # what tells the settings of a series apart (`report.setting`), less the swept key the axis shows
        labels = setting_labels([members[0].record.report.get("setting") or {} for members in kept], (short,))
        for members, label in zip(kept, labels):
            panels[key[0]].append(SweepPanel(key, training_text(members[0].record.config), label, members))
    return panels


def one_per_seed(members: list[Run], value_of: Callable[[Run], float]) -> dict[float, list[RunRecord]]:
    """Swept value -> the records at it, one per seed: of a seed run twice at one value (records of two
    schemas that read alike once upgraded), the newest, so a point is never a mean over one seed twice."""
    newest: dict[tuple[float, int], RunRecord] = {}
    for m in sorted(members, key=lambda m: (m.record.created_at, m.record.run_id)):
        newest[(value_of(m), m.record.seed)] = m.record
    by_value: dict[float, list[RunRecord]] = defaultdict(list)
    for (value, _), record in sorted(newest.items()):
        by_value[value].append(record)
    return by_value


def _sweep_curves(ax, members: list[Run], value_of: Callable[[Run], float], block: str, names: tuple[str, str],
                  xlabel: str) -> None:
    """CA and ASR of `block` (mean ± std over seeds) against the swept value, on a log axis: the
    values span orders of magnitude (0.5% .. 20%), which a linear axis would crowd together."""
    by_value = one_per_seed(members, value_of)
    xs = sorted(by_value)
    for metric, style, name in (("clean_acc", "o-", names[0]), ("asr", "s--", names[1])):
        stats = [mean_std([r.metrics[block][metric] for r in by_value[x]]) for x in xs]
        ax.errorbar(xs, [100 * mean for mean, _ in stats], yerr=[100 * std for _, std in stats], fmt=style, capsize=3,
                    label=name)
    ax.set_xscale("log")
    ax.set_xticks(xs, [f"{100 * x:g}%" for x in xs])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel(xlabel)
    ax.set_ylabel("% on the test set")
    ax.set_ylim(-2, 102)


def poison_rate_curves(runs: list[Run], out: Path, residual_scale: float = 10.0, suffix: str = "") -> list[Path]:
    def rate(run: Run) -> float:
        return float(run.record.attack["poison_rate"])

    def key(run: Run) -> tuple | None:
        if run.record.defense["name"] != "none":
            return None
        return run.dataset, run.record.attack["name"], run.record.attack["target_mode"]

    panels = _sweep_panels(runs, "attack.poison_rate", key, rate)
    written = []
    for dataset, chosen in sorted(panels.items()):
        fig, axes, spare = panel_grid(len(chosen))
        for ax, panel in zip(axes, chosen):
            _sweep_curves(ax, panel.members, rate, "attacked", ("CA", "ASR"), "poison rate (log scale)")
            title = f"{panel.key[1]} {panel.key[2]}\n{panel.training}" + (f"; {panel.setting}" if panel.setting else "")
            ax.set_title(title, fontsize=9)
        shared_legend(fig, axes[0], spare)
        fig.suptitle(f"CA and ASR vs poison rate, {dataset} (mean ± std over seeds)")
        written += save_figure(fig, out, f"{dataset}_2_poison_rate{suffix}")
    return written


def clean_budget_curves(runs: list[Run], out: Path, residual_scale: float = 10.0, suffix: str = "") -> list[Path]:
    """Figure 9 (the clean-data budget protocol): how a defense's result depends on the clean data it holds.
    One panel per defense (and victim training and defense budget), one colour per attack: ASR
    after the defense solid, CA after dashed, mean ± std over seeds, on a log axis of the budget."""
    def budget(run: Run) -> float:
        return float(run.record.defense["clean_fraction"])

    def key(run: Run) -> tuple | None:
        defense = run.record.defense
        if defense["name"] == "none" or run.record.metrics.get("defended") is None or "clean_fraction" not in defense:
            return None
        return run.dataset, defense["name"], run.record.attack["name"], run.record.attack["target_mode"]

    series = _sweep_panels(runs, "defense.clean_fraction", key, budget)
    written = []
    for dataset, chosen in sorted(series.items()):
        panels: dict[tuple[str, str], list[tuple[str, list[Run]]]] = defaultdict(list)
        for panel in chosen:
            cut = (panel.members[0].record.config.get("defense") or {}).get("budget")
            name = panel.key[1] + (f" (budget={cut})" if cut not in (None, "official") else "")
            attack = f"{panel.key[2]} {panel.key[3]}"  # a colour; the training is the panel's
            panels[(name, panel.training)].append((f"{attack}, {panel.setting}" if panel.setting else attack,
                                                   panel.members))
        labels = sorted({label for entries in panels.values() for label, _ in entries})
        colours = {label: distinct_colour(i) for i, label in enumerate(labels)}
        fig, axes, spare = panel_grid(len(panels), width=4.0, height=3.2)
        seeds: set[int] = set()
        for ax, ((name, training), entries) in zip(axes, sorted(panels.items())):
            for label, members in sorted(entries):
                by_value = one_per_seed(members, budget)
                # like with like: the seeds every budget of the series ran (a budget that is also the
                # defense table's setting has its three seeds; the sweep, seed 0)
                common = set.intersection(*({r.seed for r in records} for records in by_value.values()))
                by_value = {x: [r for r in records if r.seed in common] for x, records in by_value.items()}
                seeds.update(common)
                xs = sorted(by_value)
                for metric, style, alpha in (("asr", "o-", 1.0), ("clean_acc", "s--", 0.5)):
                    stats = [mean_std([r.metrics["defended"][metric] for r in by_value[x]]) for x in xs]
                    ax.errorbar(xs, [100 * mean for mean, _ in stats], yerr=[100 * std for _, std in stats], fmt=style,
                                color=colours[label], alpha=alpha, capsize=3, markersize=4,
                                label=f"{label}: {'ASR' if metric == 'asr' else 'CA'} after")
            ticks = sorted({budget(m) for _, members in entries for m in members})
            ax.set_xscale("log")
            ax.set_xticks(ticks, [f"{100 * x:g}%" for x in ticks])
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_title(f"{name}\n{training}", fontsize=9)
            ax.set_xlabel("defense.clean_fraction (log scale)")
            ax.set_ylabel("% on the test set")
            ax.set_ylim(-2, 102)
        handles = [Line2D([], [], color=colours[label], marker="o", label=label) for label in labels]
        handles += [Line2D([], [], color="grey", marker="o", label="solid: ASR after"),
                    Line2D([], [], color="grey", marker="s", linestyle="--", alpha=0.5, label="dashed: CA after")]
        shared_legend(fig, handles, spare)
        over = f"seed {min(seeds)}" if len(seeds) == 1 else "mean ± std over seeds"
        fig.suptitle(f"CA and ASR after the defense vs its clean-data budget, {dataset} ({over})")
        written += save_figure(fig, out, f"{dataset}_9_clean_budget{suffix}")
    return written
