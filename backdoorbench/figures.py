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

Figures 1 and 6 have a row per attack and mode, split into pages of ROWS_PER_PAGE rows
(`<stem>_page<k>`); `attacks=` keeps only the attacks named, in files named after them
(`<stem>_badnets-wanet`). Panel titles name the attack, its
mode and setting (poison rate, training, seed); a legend shared by the panels sits in a spare panel
or below them, never over a curve.

A figure whose data is absent is skipped with one line naming the runs that would produce it.
"""

from __future__ import annotations

import io
import math
import sys
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import matplotlib

matplotlib.use("Agg")  # files only: no display, no GUI toolkit

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.cm import ScalarMappable  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import NullLocator  # noqa: E402
import numpy as np  # noqa: E402

from backdoorbench import checks  # noqa: E402
from backdoorbench.artifacts import load_artifacts  # noqa: E402
from backdoorbench.config import NON_RESULT_KEYS  # noqa: E402
from backdoorbench.errors import ConfigError, DataError, UserError  # noqa: E402
from backdoorbench.fileio import atomic_write_bytes, ensure_writable_dir  # noqa: E402
from backdoorbench.leaderboard import build_rows, filter_records, load_records_with_paths, parse_args, setting_labels  # noqa: E402
from backdoorbench.records import RunRecord, artifacts_path  # noqa: E402

USAGE = "usage: python -m backdoorbench.figures [results_dir=DIR] [dataset=NAME] [attacks=NAME,NAME] [residual_scale=10]"
HELP = f"""{USAGE}

Draws the figures from the run records under <results_dir>/runs (and the arrays saved beside
them) into <results_dir>/figures, as PNG and PDF; a figure whose runs are missing is skipped
with the command that makes them. dataset= keeps one dataset; attacks= draws the trigger gallery and GradCAM
figures for those attacks only (files named after them); residual_scale= multiplies the poisoned-minus-clean
residuals of the trigger gallery. results_dir defaults to outputs, where runs write by default; the committed figures are
results_dir=results."""
EXAMPLES_SHOWN = 2  # example images per attack in the gallery and GradCAM figures
ROWS_PER_PAGE = 6  # attack rows per page of the gallery and GradCAM figures: a page a journal can print


@dataclass
class Run:
    record: RunRecord
    path: Path
    _artifacts: dict[str, np.ndarray] | None = None

    @property
    def artifacts(self) -> dict[str, np.ndarray]:
        """The run's artifacts, loaded once; {} (and one warning) if it has none or they can't be read."""
        if self._artifacts is None:
            self._artifacts = {}
            where = artifacts_path(self.record, self.path)
            if where is not None:
                try:
                    self._artifacts = load_artifacts(where)
                except DataError as exc:
                    warnings.warn(f"skipping artifacts of {self.path}: {exc}", stacklevel=2)
        return self._artifacts

    @property
    def attack_label(self) -> str:
        attack = self.record.attack
        return f"{attack['name']} {attack['target_mode']}"

    @property
    def dataset(self) -> str:
        return self.record.dataset["name"]


def save_figure(fig, out_dir: Path, stem: str) -> list[Path]:
    """`stem`.png and `stem`.pdf under `out_dir`, each written atomically."""
    paths = []
    if fig.get_layout_engine() is not None:
        # lay the figure out once, then keep those positions: each save (and bbox_inches="tight")
        # would otherwise redo constrained layout, the costliest part of a page of images
        fig.canvas.draw()
        fig.set_layout_engine("none")
    for suffix in ("png", "pdf"):
        buffer = io.BytesIO()
        fig.savefig(buffer, format=suffix, dpi=150, bbox_inches="tight", metadata={"CreationDate": None} if suffix == "pdf" else None)
        paths.append(atomic_write_bytes(out_dir / f"{stem}.{suffix}", buffer.getvalue()))
    plt.close(fig)
    return paths


def save_pages(figures: list, out_dir: Path, stem: str) -> list[Path]:
    """One figure: `stem`.png/.pdf; several: `stem`_page1.png/.pdf, ... Pages of `stem` left from an
    earlier, longer run are removed, so the folder never mixes two runs' pages."""
    names = [stem] if len(figures) == 1 else [f"{stem}_page{k}" for k in range(1, len(figures) + 1)]
    written = [path for fig, name in zip(figures, names) for path in save_figure(fig, out_dir, name)]
    for old in [*out_dir.glob(f"{stem}.*"), *out_dir.glob(f"{stem}_page*.*")]:
        if old.suffix in (".png", ".pdf") and old not in written:
            old.unlink()
    return written


def canonical_groups(runs: list[Run]) -> set[str]:
    """The group ids of the leaderboard's canonical rows among `runs` (per attack, mode and defense:
    the most seeds, the attack's and defense's defaults, the newest)."""
    return {row.group_id for row in build_rows([run.record for run in runs]) if row.canonical}


def pick_per_attack(runs: list[Run], needs: tuple[str, ...], defense: str | None = None) -> dict[str, dict[str, Run]]:
    """dataset -> attack label -> one run having artifacts `needs`, among runs of `defense` (None =
    any): a run of the leaderboard's canonical row where there is one (so a figure shows the
    setting the tables report, not an older sweep's), then the lowest seed, then the run id."""
    if defense is not None:  # a defense row's canonical choice is among rows of its own defense
        runs = [run for run in runs if run.record.defense["name"] == defense]
    canonical = canonical_groups(runs)
    chosen: dict[str, dict[str, Run]] = defaultdict(dict)
    for run in sorted(runs, key=lambda r: (r.record.group_id not in canonical, r.record.seed, r.record.run_id)):
        if run.record.artifacts is None or not all(k in run.artifacts for k in needs):
            continue
        chosen[run.dataset].setdefault(run.attack_label, run)
    return {d: dict(sorted(by.items())) for d, by in sorted(chosen.items())}


def _image(array: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
    """(C, H, W) in [0, 1] -> what imshow takes, and its arguments."""
    array = np.clip(array, 0, 1)
    if array.shape[0] == 1:
        return array[0], {"cmap": "gray", "vmin": 0, "vmax": 1}
    return np.transpose(array[:3], (1, 2, 0)), {}


def _grid(rows: int, cols: int, size: float = 1.3):
    # constrained layout sizes the margins to the labels, title and colour bar: no blank band, no overlap
    fig, axes = plt.subplots(rows, cols, figsize=(size * cols + 2.4, size * rows + 0.9), squeeze=False,
                             layout="constrained")
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
    return fig, axes


def _row_label(ax, label: str) -> None:
    """The attack and its mode, on two lines, horizontal, left of the row."""
    ax.set_ylabel(label.replace(" ", "\n", 1), rotation=0, ha="right", va="center", fontsize=9, labelpad=6)


def _pages(by_attack: dict[str, Run]) -> list[list[tuple[str, Run]]]:
    """Rows split into pages of at most ROWS_PER_PAGE, as even as they can be: 24 -> 6 x 4, 16 -> 6, 5, 5."""
    items = list(by_attack.items())
    count = math.ceil(len(items) / ROWS_PER_PAGE)
    sizes = [len(items) // count + (k < len(items) % count) for k in range(count)]
    starts = np.cumsum([0, *sizes])
    return [items[a:b] for a, b in zip(starts[:-1], starts[1:])]


def _page_title(title: str, page: int, pages: int) -> str:
    return title if pages == 1 else f"{title} (page {page} of {pages})"


def _panel_columns(count: int) -> int:
    """Columns for `count` panels and their shared legend: the legend takes a spare slot if there is
    one; the fewest slots left empty, three columns on a tie."""
    if count <= 3:
        return count
    def wasted(cols: int) -> int:
        spare = -count % cols
        return spare - 1 if spare else 0
    return min((3, 4), key=lambda cols: (wasted(cols), cols))


def _panels(count: int, width: float = 3.6, height: float = 2.8):
    """A figure with `count` panels; the first spare slot (if any) is returned for the legend."""
    cols = _panel_columns(count)
    rows = math.ceil(count / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows + 0.6), squeeze=False,
                             layout="constrained")
    spare = list(axes.flat[count:])
    for ax in spare:
        ax.set_visible(False)
    return fig, list(axes.flat[:count]), (spare[0] if spare else None)


def _shared_legend(fig, source, spare) -> None:
    """One legend for panels that draw the same things (`source`: an axes that draws them all, or
    its handles): in the spare panel, or below the panels."""
    handles = source if isinstance(source, list) else source.get_legend_handles_labels()[0]
    labels = [h.get_label() for h in handles]
    if spare is not None:
        spare.set_visible(True)
        spare.axis("off")
        spare.legend(handles, labels, loc="center", fontsize=9, frameon=False)
    else:
        # below the panels (above them it would meet the figure's title), in as many columns as the
        # figure's width holds: one long row would widen the figure and shrink its panels
        columns = max(1, min(len(labels), int(fig.get_figwidth() / 1.7)))
        fig.legend(handles, labels, loc="outside lower center", ncols=columns, fontsize=9, frameon=False)


def _training(config: dict[str, Any]) -> str:
    trainer = config.get("trainer") or {}
    text = f"{trainer.get('epochs', '?')} ep"
    return text if trainer.get("augment", True) else text + ", no aug"


def _setting(run: Run) -> str:
    """What a reader needs to place the panel: poison rate, training and seed (not a run hash)."""
    rate = run.record.attack.get("poison_rate")
    poisoned = f"poison rate {100 * float(rate):g}%, " if rate is not None else ""
    return f"{poisoned}{_training(run.record.config)}, seed {run.record.seed}"


def trigger_gallery(runs: list[Run], out: Path, residual_scale: float = 10.0, suffix: str = "") -> list[Path]:
    written = []
    residual_map = plt.get_cmap("magma")
    for dataset, by_attack in pick_per_attack(runs, ("examples_clean", "examples_poisoned")).items():
        shown, pages, figures = EXAMPLES_SHOWN, _pages(by_attack), []
        for page, items in enumerate(pages, start=1):
            fig, axes = _grid(len(items), 3 * shown)
            residual_image = None
            for row, (label, run) in enumerate(items):
                clean, poisoned = run.artifacts["examples_clean"], run.artifacts["examples_poisoned"]
                for i in range(min(shown, len(clean))):
                    image, kwargs = _image(clean[i])
                    axes[row, 3 * i].imshow(image, **kwargs)
                    image, kwargs = _image(poisoned[i])
                    axes[row, 3 * i + 1].imshow(image, **kwargs)
                    # the largest change over the channels, in pixel units: colour, not contrast-stretched grey
                    residual = np.abs(poisoned[i] - clean[i]).max(axis=0)
                    residual_image = axes[row, 3 * i + 2].imshow(residual, cmap=residual_map, vmin=0,
                                                                 vmax=1 / residual_scale)
                    if row == 0:
                        for j, title in enumerate(("clean", "poisoned", "|poisoned − clean|")):
                            axes[row, 3 * i + j].set_title(title, fontsize=9)
                _row_label(axes[row, 0], label)
            if residual_image is not None:
                fig.colorbar(residual_image, ax=axes[:, 2::3].ravel().tolist(), shrink=min(0.9, 2.5 / len(items)),
                             extend="max", label=f"|poisoned − clean|, pixel units (brightest: ≥ {1 / residual_scale:g})")
            fig.suptitle(_page_title(f"Trigger gallery, {dataset}", page, len(pages)))
            figures.append(fig)
        written += save_pages(figures, out, f"{dataset}_1_trigger_gallery{suffix}")
    return written


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
    from backdoorbench.pipeline import config_hash

    drop = NON_RESULT_KEYS + ("seed", swept)
    series: dict[tuple, dict[str, list[Run]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        key = key_of(run)
        if key is not None:
            series[key][config_hash(run.record.config, drop)].append(run)
    short = swept.rsplit(".", 1)[-1] + "="
    panels: dict[str, list[SweepPanel]] = defaultdict(list)
    for key, by_setting in sorted(series.items()):
        kept = [members for _, members in sorted(by_setting.items()) if len({value_of(m) for m in members}) >= 2]
        labels = setting_labels([members[0].record.config for members in kept])
        for members, label in zip(kept, labels):
            label = ", ".join(part for part in label.split(", ") if not part.startswith(short))
            panels[key[0]].append(SweepPanel(key, _training(members[0].record.config), label, members))
    return panels


def _sweep_curves(ax, members: list[Run], value_of: Callable[[Run], float], block: str, names: tuple[str, str],
                  xlabel: str) -> None:
    """CA and ASR of `block` (mean ± std over seeds) against the swept value, on a log axis: the
    values span orders of magnitude (0.5% .. 20%), which a linear axis would crowd together."""
    by_value: dict[float, list[RunRecord]] = defaultdict(list)
    for m in members:
        by_value[value_of(m)].append(m.record)
    xs = sorted(by_value)
    for metric, style, name in (("clean_acc", "o-", names[0]), ("asr", "s--", names[1])):
        stats = [_mean_std([r.metrics[block][metric] for r in by_value[x]]) for x in xs]
        ax.errorbar(xs, [100 * mean for mean, _ in stats], yerr=[100 * std for _, std in stats], fmt=style, capsize=3,
                    label=name)
    ax.set_xscale("log")
    ax.set_xticks(xs, [f"{100 * x:g}%" for x in xs])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel(xlabel)
    ax.set_ylabel("% on the test set")
    ax.set_ylim(-2, 102)


def _mean_std(values: list[float]) -> tuple[float, float]:
    return float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


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
        fig, axes, spare = _panels(len(chosen))
        for ax, panel in zip(axes, chosen):
            _sweep_curves(ax, panel.members, rate, "attacked", ("CA", "ASR"), "poison rate (log scale)")
            title = f"{panel.key[1]} {panel.key[2]}\n{panel.training}" + (f"; {panel.setting}" if panel.setting else "")
            ax.set_title(title, fontsize=9)
        _shared_legend(fig, axes[0], spare)
        fig.suptitle(f"CA and ASR vs poison rate, {dataset} (mean ± std over seeds)")
        written += save_figure(fig, out, f"{dataset}_2_poison_rate{suffix}")
    return written


def neural_cleanse_anomaly(runs: list[Run], out: Path, residual_scale: float = 10.0, suffix: str = "") -> list[Path]:
    written = []
    for dataset, by_attack in pick_per_attack(runs, ("nc_anomaly_index", "nc_mask_l1"), "neural_cleanse").items():
        fig, axes, spare = _panels(len(by_attack))
        thresholds = set()
        for ax, (label, run) in zip(axes, by_attack.items()):
            index, norms = run.artifacts["nc_anomaly_index"], run.artifacts["nc_mask_l1"]
            threshold = float(run.artifacts.get("nc_anomaly_threshold", 2.0))
            thresholds.add(threshold)
            flagged = (norms < np.median(norms)) & (index > threshold)  # as Neural Cleanse flags them
            ax.bar(np.arange(len(index)), np.minimum(index, 20), color=np.where(flagged, "tab:red", "tab:blue"))
            ax.axhline(threshold, color="k", linestyle="--", linewidth=1)
            ax.set_xticks(np.arange(len(index)))
            ax.set_title(f"{label}\n{_setting(run)}", fontsize=9)
            ax.set_xlabel("class")
            ax.set_ylabel("anomaly index (capped at 20)")
        threshold = f" {thresholds.pop():g}" if len(thresholds) == 1 else ""
        _shared_legend(fig, [Line2D([], [], color="k", linestyle="--", linewidth=1, label=f"threshold{threshold}"),
                             Patch(color="tab:red", label="flagged: above the threshold, small mask"),
                             Patch(color="tab:blue", label="not flagged")], spare)
        fig.suptitle(f"Neural Cleanse anomaly index per class, {dataset}")
        written += save_figure(fig, out, f"{dataset}_3_neural_cleanse{suffix}")
    return written


def strip_histograms(runs: list[Run], out: Path, residual_scale: float = 10.0, suffix: str = "") -> list[Path]:
    written = []
    for dataset, by_attack in pick_per_attack(runs, ("strip_entropy_clean", "strip_entropy_poisoned"), "strip").items():
        fig, axes, spare = _panels(len(by_attack))
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
            ax.set_title(f"{label}\n{_setting(run)}{extra}", fontsize=9)
            ax.set_xlabel("mean entropy (bits)")
            ax.set_ylabel("density")
        _shared_legend(fig, axes[0], spare)
        fig.suptitle(f"STRIP entropy, clean vs triggered test inputs, {dataset}")
        written += save_figure(fig, out, f"{dataset}_4_strip_entropy{suffix}")
    return written


def fine_pruning_curves(runs: list[Run], out: Path, residual_scale: float = 10.0, suffix: str = "") -> list[Path]:
    written = []
    for dataset, by_attack in pick_per_attack(runs, ("fp_pruned_fraction", "fp_clean_acc", "fp_asr"), "fine_pruning").items():
        fig, axes, spare = _panels(len(by_attack))
        for ax, (label, run) in zip(axes, by_attack.items()):
            a = run.artifacts
            ax.plot(a["fp_pruned_fraction"], 100 * a["fp_clean_acc"], "o-", label="CA")
            ax.plot(a["fp_pruned_fraction"], 100 * a["fp_asr"], "s--", label="ASR")
            if "fp_chosen_fraction" in a:
                ax.axvline(float(a["fp_chosen_fraction"]), color="k", linestyle=":", linewidth=1, label="pruned by the defense")
            ax.set_title(f"{label}\n{_setting(run)}", fontsize=9)
            ax.set_xlabel("fraction of last-stage channels pruned")
            ax.set_ylabel("% on the test set")
            ax.set_ylim(-2, 102)
        # the panel that draws the most (the defense's line included) names them all
        _shared_legend(fig, max(axes, key=lambda ax: len(ax.get_legend_handles_labels()[1])), spare)
        fig.suptitle(f"Fine-pruning before fine-tuning, {dataset}")
        written += save_figure(fig, out, f"{dataset}_5_fine_pruning{suffix}")
    return written


def gradcam_heatmaps(runs: list[Run], out: Path, residual_scale: float = 10.0, suffix: str = "") -> list[Path]:
    needs = ("examples_clean", "examples_poisoned", "gradcam_clean", "gradcam_poisoned")
    written = []
    for dataset, by_attack in pick_per_attack(runs, needs).items():
        shown, pages, figures = EXAMPLES_SHOWN, _pages(by_attack), []
        for page, items in enumerate(pages, start=1):
            fig, axes = _grid(len(items), 4 * shown)
            heat = None
            for row, (label, run) in enumerate(items):
                a = run.artifacts
                for i in range(min(shown, len(a["examples_clean"]))):
                    for j, kind in enumerate(("clean", "poisoned")):
                        image, kwargs = _image(a[f"examples_{kind}"][i])
                        ax_image, ax_cam = axes[row, 4 * i + 2 * j], axes[row, 4 * i + 2 * j + 1]
                        ax_image.imshow(image, **kwargs)
                        ax_cam.imshow(image, **kwargs)
                        heat = ax_cam.imshow(a[f"gradcam_{kind}"][i], cmap="jet", alpha=0.5, vmin=0, vmax=1)
                        if row == 0:
                            ax_image.set_title(kind, fontsize=9)
                            ax_cam.set_title(f"GradCAM, {kind}", fontsize=9)
                _row_label(axes[row, 0], label)
            if heat is not None:
                bar = fig.colorbar(ScalarMappable(heat.norm, heat.cmap), ax=axes.ravel().tolist(),
                                   shrink=min(0.9, 2.5 / len(items)))
                bar.set_label("GradCAM, scaled to [0, 1] per image (last conv stage)")
            fig.suptitle(_page_title(f"GradCAM on the attacked model, {dataset}", page, len(pages)))
            figures.append(fig)
        written += save_pages(figures, out, f"{dataset}_6_gradcam{suffix}")
    return written


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
    from backdoorbench.pipeline import config_hash

    found: dict[str, dict[tuple[str, str], dict[int, tuple[Run, str]]]] = defaultdict(lambda: defaultdict(dict))
    for run in sorted(runs, key=lambda r: (r.record.seed, r.record.run_id)):
        config, seed = run.record.config, run.record.seed
        if _pgd_rows(run, "attacked"):
            victim = {key: config.get(key) for key in ("dataset", "model", "attack", "trainer", "eval")}
            key = ("attacked", config_hash(victim, NON_RESULT_KEYS + ("eval.lpips_weights",)))
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
                stats = [_mean_std([rows[(loss, source, e)] for rows in per_seed if (loss, source, e) in rows]) for e in radii]
                panels[(loss, source)].append((label, radii, [m for m, _ in stats], [sd for _, sd in stats], len(per_seed)))
        if not panels:
            continue
        order = sorted(panels, key=lambda k: (k[1] != "self", k[0]))
        # one colour and marker per model in every panel: a transfer panel holds only the defended
        # models, and the default colour cycle would restart there with another model's colour
        cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        markers = "osD^vP*X"
        style = {label: (cycle[i % len(cycle)], markers[i % len(markers)]) for i, label in enumerate(curves)}
        fig, axes, spare = _panels(len(order))
        for ax, key in zip(axes, order):
            for label, radii, mean, std, n in panels[key]:
                colour, marker = style[label]
                ax.errorbar(radii, 100 * np.array(mean), yerr=100 * np.array(std), fmt=f"{marker}-", color=colour,
                            capsize=3, label=f"{label} (n={n})")
            ax.set_title(PGD_PANELS.get(key, f"PGD-{key[0]}, from {key[1]}"), fontsize=9)
            ax.set_xlabel("L_inf radius eps (pixel units)")
            ax.set_ylabel("robust accuracy (%)")
            ax.set_ylim(-2, 102)
        _shared_legend(fig, max(axes, key=lambda ax: len(ax.get_legend_handles_labels()[1])), spare)
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
    from backdoorbench.pipeline import config_hash

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
        fig, axes, spare = _panels(len(chosen))
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
                stats = [_mean_std(v) for _, v in kept]
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
            ax.set_title(f"{_training(members[0].record.config)}; seeds per λ: {'/'.join(map(str, n))}", fontsize=9)
            ax.set_xlabel("λ (penalty_weight), symlog axis")
            ax.set_ylabel("accuracy (%)")
            ax.set_ylim(-2, 102)
        _shared_legend(fig, max(axes, key=lambda ax: len(ax.get_legend_handles_labels()[1])), spare)
        fig.suptitle(f"Angular margin: clean and robust accuracy vs λ, {dataset} (mean ± std over seeds)")
        written += save_figure(fig, out, f"{dataset}_8_penalty_weight{suffix}")
    return written


def clean_budget_curves(runs: list[Run], out: Path, residual_scale: float = 10.0, suffix: str = "") -> list[Path]:
    """Figure 9 (issue 18, protocol 4): how a defense's result depends on the clean data it holds.
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
        colours = {label: _distinct_colour(i) for i, label in enumerate(labels)}
        fig, axes, spare = _panels(len(panels), width=4.0, height=3.2)
        seeds: set[int] = set()
        for ax, ((name, training), entries) in zip(axes, sorted(panels.items())):
            for label, members in sorted(entries):
                by_value: dict[float, list[RunRecord]] = defaultdict(list)
                for m in members:
                    by_value[budget(m)].append(m.record)
                # like with like: the seeds every budget of the series ran (a budget that is also the
                # defense table's setting has its three seeds; the sweep, seed 0)
                common = set.intersection(*({r.seed for r in records} for records in by_value.values()))
                by_value = {x: [r for r in records if r.seed in common] for x, records in by_value.items()}
                seeds.update(common)
                xs = sorted(by_value)
                for metric, style, alpha in (("asr", "o-", 1.0), ("clean_acc", "s--", 0.5)):
                    stats = [_mean_std([r.metrics["defended"][metric] for r in by_value[x]]) for x in xs]
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
        _shared_legend(fig, handles, spare)
        over = f"seed {min(seeds)}" if len(seeds) == 1 else "mean ± std over seeds"
        fig.suptitle(f"CA and ASR after the defense vs its clean-data budget, {dataset} ({over})")
        written += save_figure(fig, out, f"{dataset}_9_clean_budget{suffix}")
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


def _distinct_colour(index: int) -> tuple[float, ...]:
    """The index-th of 19 distinct colours: tab10, then the darkest of each tab20b hue, then
    tab20c's; a figure with 11 or more curves (every defense) repeats none of them."""
    palette = ([plt.get_cmap("tab10")(i) for i in range(10)] + [plt.get_cmap("tab20b")(i) for i in (0, 4, 8, 12, 16)]
               + [plt.get_cmap("tab20c")(i) for i in (0, 4, 8, 12)])
    return palette[index % len(palette)]


def reactivation_curves(runs: list[Run], out: Path, residual_scale: float = 10.0, suffix: str = "") -> list[Path]:
    written = []
    for dataset, by_attack in sorted(_reactivation_curves(runs).items()):
        fig, axes, spare = _panels(len(by_attack), width=4.8, height=4.2)
        names = sorted({name for by_name in by_attack.values() for name in by_name}, key=lambda n: (n != UNDEFENDED, n))
        colours = {name: _distinct_colour(i) for i, name in enumerate(names)}
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
        _shared_legend(fig, list(handles.values()), spare)
        seeds = sorted({seed for by_name in by_attack.values() for curve in by_name.values() for seed in curve})
        over = f"seed {seeds[0]}" if len(seeds) == 1 else "mean ± std over seeds"
        fig.suptitle(f"ASR recovered by the retuning attack vs steps, {dataset} ({over})")
        written += save_figure(fig, out, f"{dataset}_10_reactivation{suffix}")
    return written


@dataclass(frozen=True)
class Figure:
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
    Figure(10, "ASR vs retuning steps (reactivation)", reactivation_curves,
           "--multirun attack=<name> defense=<name>,<name> eval.reactivation.enabled=true seed=0,1,2"),
)


def write_figures(results_dir: str | Path, *, dataset: str | None = None, attacks: list[str] | None = None,
                  residual_scale: float = 10.0, report: Callable[[str], None] = print) -> dict[int, list[Path]]:
    """Draw every figure whose data the records under `<results_dir>/runs/` hold, of the `attacks`
    named (None: all); `report` gets one line per figure skipped. Returns figure number -> files written."""
    results_dir = Path(results_dir).expanduser()
    if not (results_dir / "runs").is_dir():
        raise ConfigError(f"results_dir={str(results_dir)!r} has no runs/ folder; run `python -m backdoorbench "
                          f"results_dir={results_dir}` first, or pass the results_dir that holds the records")
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
    args = sys.argv[1:] if argv is None else argv
    if "-h" in args or "--help" in args:
        print(HELP)
        return 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            options = parse_args(args, {"results_dir": "outputs", "dataset": None, "attacks": None,
                                        "residual_scale": "10"}, USAGE)
            try:
                scale = float(options["residual_scale"])
            except ValueError:
                raise ConfigError(f"residual_scale={options['residual_scale']!r} is not a number; use e.g. residual_scale=10") from None
            result: dict[int, list[Path]] | UserError = write_figures(
                options["results_dir"], dataset=options["dataset"], residual_scale=scale,
                attacks=options["attacks"].split(",") if options["attacks"] else None,
                report=lambda line: print(line, file=sys.stderr))
        except UserError as exc:
            result = exc
    for warning in caught:
        if not issubclass(warning.category, UserWarning) or "matplotlib" in str(warning.filename):
            continue
        print(f"warning: {warning.message}", file=sys.stderr)
    if isinstance(result, UserError):
        print(f"error: {result}", file=sys.stderr)
        return 2
    for number, paths in result.items():
        for path in paths:
            print(f"figure {number}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
