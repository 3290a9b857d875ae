"""Figures of robustness: robust accuracy vs L_inf eps (7) and the angular margin's clean and PGD accuracy
vs lambda (8)."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display, no GUI toolkit

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullLocator  # noqa: E402
import numpy as np  # noqa: E402

from backdoorbench.run_keys import config_hash  # noqa: E402
from backdoorbench.report.plot import (Run, mean_std, panel_grid, save_figure, shared_legend,
                                      training_text)  # noqa: E402
from backdoorbench.report.query import NON_RESULT_KEYS  # noqa: E402


PGD_PANELS = {("ce", "self"): "PGD, cross-entropy", ("cw", "self"): "PGD, CW margin",
              ("ce", "attacked"): "PGD-CE, transferred from the attacked model",
              ("cw", "attacked"): "PGD-CW, transferred from the attacked model"}


def _pgd_rows(run: Run, which: str) -> list[dict[str, Any]]:
    block = run.record.metrics.get(which) or {}
    rows = block.get("pgd")
    return rows if isinstance(rows, list) else []


def _model_curves(runs: list[Run]) -> dict[str, dict[str, dict[int, tuple[Run, str]]]]:
    """dataset -> curve label -> seed -> (run, "attacked" | "defended"): one curve per model
    setting. The attacked model of a run is one curve per victim setting (the runs of one sweep
    share it, so it is counted once per seed); a defended model, one per setting of the run."""
    found: dict[str, dict[tuple[str, str], dict[int, tuple[Run, str]]]] = defaultdict(lambda: defaultdict(dict))
    for run in sorted(runs, key=lambda r: (r.record.seed, r.record.run_id)):
        config, seed = run.record.config, run.record.seed
        if _pgd_rows(run, "attacked"):
            victim = {key: config.get(key) for key in ("dataset", "model", "attack", "trainer", "eval")}
            key = ("attacked", config_hash(victim, NON_RESULT_KEYS))
            found[run.dataset][key].setdefault(seed, (run, "attacked"))
        if _pgd_rows(run, "defended"):
            key = ("defended", config_hash(config, NON_RESULT_KEYS + ("seed",)))
            found[run.dataset][key].setdefault(seed, (run, "defended"))
    curves: dict[str, dict[str, dict[int, tuple[Run, str]]]] = {}
    for dataset, by_key in sorted(found.items()):
        labelled: dict[str, dict[int, tuple[Run, str]]] = {}
        def order(item) -> tuple:  # the attacked model first, then the defended ones by name and lambda
            (kind, digest), by_seed = item
            run = next(iter(by_seed.values()))[0]
            lam = _lambda_of(run) if kind == "defended" else 0.0
            return kind != "attacked", run.record.defense["name"], 0.0 if math.isnan(lam) else lam, digest

        for (kind, digest), by_seed in sorted(by_key.items(), key=order):
            run = next(iter(by_seed.values()))[0]
            model = run.record.model.get("name", "?")
            if kind == "attacked":
                attack = run.record.attack["name"]
                label = f"attacked model ({model}" + (f", {attack})" if attack != "none" else ", plain)")
            else:
                defense = run.record.defense
                label = defense["name"] + (f" λ={_lambda_of(run):g}" if "penalty_weight" in defense else "")
            if label in labelled:
                label = f"{label} [{digest[:6]}]"
            labelled[label] = by_seed
        curves[dataset] = labelled
    return curves


def _lambda_of(run: Run) -> float:
    return float(run.record.defense.get("penalty_weight", math.nan))


def robust_accuracy_curves(runs: list[Run], out: Path, residual_scale: float = 10.0, suffix: str = "") -> list[Path]:
    """Robust accuracy vs eps, one curve per model (mean ± std over seeds), a panel per PGD loss
    and source (white-box, or transferred from the attacked model); curves need >= 2 eps."""
    written = []
    for dataset, curves in _model_curves(runs).items():
        panels: dict[tuple[str, str], list[tuple[str, list[float], list[float], list[float], int]]] = defaultdict(list)
        for label, by_seed in curves.items():
            per_seed = [{(r["loss"], r["source"], float(r["eps"])): float(r["acc"]) for r in _pgd_rows(run, which)}
                        for run, which in by_seed.values()]
            for loss, source in sorted({(loss, source) for rows in per_seed for loss, source, _ in rows}):
                radii = sorted({eps for rows in per_seed for l, s, eps in rows if (l, s) == (loss, source)})
                if len(radii) < 2:
                    continue
                stats = [mean_std([rows[(loss, source, e)] for rows in per_seed if (loss, source, e) in rows]) for e in radii]
                panels[(loss, source)].append((label, radii, [m for m, _ in stats], [sd for _, sd in stats], len(per_seed)))
        if not panels:
            continue
        order = sorted(panels, key=lambda k: (k[1] != "self", k[0]))
        # one colour and marker per model in every panel: a transfer panel holds only the defended
        # models, and the default colour cycle would restart there with another model's colour
        cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        markers = "osD^vP*X"
        style = {label: (cycle[i % len(cycle)], markers[i % len(markers)]) for i, label in enumerate(curves)}
        fig, axes, spare = panel_grid(len(order))
        for ax, key in zip(axes, order):
            for label, radii, mean, std, n in panels[key]:
                colour, marker = style[label]
                ax.errorbar(radii, 100 * np.array(mean), yerr=100 * np.array(std), fmt=f"{marker}-", color=colour,
                            capsize=3, label=f"{label} (n={n})")
            ax.set_title(PGD_PANELS.get(key, f"PGD-{key[0]}, from {key[1]}"), fontsize=9)
            ax.set_xlabel("L_inf radius eps (pixel units)")
            ax.set_ylabel("robust accuracy (%)")
            ax.set_ylim(-2, 102)
        shared_legend(fig, max(axes, key=lambda ax: len(ax.get_legend_handles_labels()[1])), spare)
        fig.suptitle(f"Robust accuracy vs eps, {dataset} (mean ± std over seeds)")
        written += save_figure(fig, out, f"{dataset}_7_robust_accuracy{suffix}")
    return written


def _clean_and_pgd_ce(runs: list[Run], which: str, radii: list[float]) -> dict[str, list[float]]:
    """{"clean": the clean accuracy of each run's `which` model ("attacked" or "defended"),
    "PGD-CE eps=<e>": its white-box PGD-CE accuracy at each e of `radii`}, in that order."""
    found = {"clean": [run.record.metrics[which]["clean_acc"] for run in runs]}
    for eps in radii:
        found[f"PGD-CE eps={eps:g}"] = [r["acc"] for run in runs for r in _pgd_rows(run, which)
                                        if r["loss"] == "ce" and r["source"] == "self" and float(r["eps"]) == eps]
    return found


def penalty_weight_curves(runs: list[Run], out: Path, residual_scale: float = 10.0, suffix: str = "") -> list[Path]:
    """Clean and white-box PGD-CE accuracy of angular-margin models vs lambda (penalty_weight),
    mean ± std over seeds, a panel per setting; needs >= 2 lambdas."""
    settings: dict[str, dict[str, list[Run]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        if run.record.defense["name"] != "angular_margin" or not _pgd_rows(run, "defended"):
            continue
        settings[run.dataset][config_hash(run.record.config, NON_RESULT_KEYS + ("seed", "defense.penalty_weight"))].append(run)
    written = []
    for dataset, by_setting in sorted(settings.items()):
        chosen = [members for _, members in sorted(by_setting.items()) if len({_lambda_of(m) for m in members}) >= 2]
        if not chosen:
            continue
        fig, axes, spare = panel_grid(len(chosen))
        for ax, members in zip(axes, chosen):
            by_lambda: dict[float, list[Run]] = defaultdict(list)
            for m in members:
                by_lambda[_lambda_of(m)].append(m)
            lambdas = sorted(by_lambda)
            radii = sorted({float(r["eps"]) for m in members for r in _pgd_rows(m, "defended")
                            if r["loss"] == "ce" and r["source"] == "self"})
            per_lambda = [_clean_and_pgd_ce(by_lambda[lam], "defended", radii) for lam in lambdas]
            series = {name: [accuracies[name] for accuracies in per_lambda] for name in per_lambda[0]}
            # the plain model (each run's attacked model, once per seed) as a dotted line in its series' colour
            plain_runs = {m.record.seed: m for m in members if _pgd_rows(m, "attacked")}
            plain = _clean_and_pgd_ce(list(plain_runs.values()), "attacked", radii)
            for name, values in series.items():
                kept = [(lam, v) for lam, v in zip(lambdas, values) if v]
                stats = [mean_std(v) for _, v in kept]
                drawn = ax.errorbar([lam for lam, _ in kept], [100 * m for m, _ in stats], yerr=[100 * sd for _, sd in stats],
                                    fmt="s--" if name == "clean" else "o-", capsize=3, label=name)
                if plain.get(name):
                    ax.axhline(100 * float(np.mean(plain[name])), color=drawn.lines[0].get_color(), ls=":", lw=1.2)
            if any(plain.values()):
                ax.plot([], [], ls=":", color="grey", label=f"dotted: the plain model (attacked), n={len(plain_runs)}")
            # lambda spans 0 and several decades: linear up to 1, logarithmic above
            ax.set_xscale("symlog", linthresh=1)
            ax.set_xticks(lambdas, [f"{lam:g}" for lam in lambdas])
            ax.xaxis.set_minor_locator(NullLocator())
            n = sorted({len(v) for v in by_lambda.values()})
            ax.set_title(f"{training_text(members[0].record.config)}; seeds per λ: {'/'.join(map(str, n))}", fontsize=9)
            ax.set_xlabel("λ (penalty_weight), symlog axis")
            ax.set_ylabel("accuracy (%)")
            ax.set_ylim(-2, 102)
        shared_legend(fig, max(axes, key=lambda ax: len(ax.get_legend_handles_labels()[1])), spare)
        fig.suptitle(f"Angular margin: clean and robust accuracy vs λ, {dataset} (mean ± std over seeds)")
        written += save_figure(fig, out, f"{dataset}_8_penalty_weight{suffix}")
    return written
