"""`python -m backdoorbench.figures [results_dir=DIR] [dataset=NAME] [residual_scale=10]`.

Paper figures drawn from records and their artifacts only (never retraining), as PNG and PDF
under `<results_dir>/figures/`, one file per figure and dataset, with a panel (or row) per attack:

1. trigger gallery: clean, poisoned, residual |poisoned - clean| x residual_scale;
2. CA and ASR vs poison rate (runs without a defense that differ only in poison rate and seed);
3. Neural Cleanse anomaly index per class, threshold line at 2;
4. STRIP entropy histograms, clean vs triggered test inputs;
5. fine-pruning: CA and ASR vs fraction of channels pruned (before fine-tuning);
6. GradCAM heatmaps of clean and poisoned inputs on the attacked model.

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
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display, no GUI toolkit

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from backdoorbench import checks  # noqa: E402
from backdoorbench.artifacts import load_artifacts  # noqa: E402
from backdoorbench.config import NON_RESULT_KEYS  # noqa: E402
from backdoorbench.errors import ConfigError, DataError, UserError  # noqa: E402
from backdoorbench.fileio import atomic_write_bytes, ensure_writable_dir  # noqa: E402
from backdoorbench.leaderboard import filter_records, load_records_with_paths, parse_args, setting_labels  # noqa: E402
from backdoorbench.records import RunRecord, artifacts_path  # noqa: E402

USAGE = "usage: python -m backdoorbench.figures [results_dir=DIR] [dataset=NAME] [residual_scale=10]"
HELP = f"""{USAGE}

Draws the figures from the run records under <results_dir>/runs (and the arrays saved beside
them) into <results_dir>/figures, as PNG and PDF; a figure whose runs are missing is skipped
with the command that makes them. dataset= keeps one dataset; residual_scale= multiplies the poisoned-minus-clean
residuals of the trigger gallery. results_dir defaults to results (the committed figures)."""
EXAMPLES_SHOWN = 2  # example images per attack in the gallery and GradCAM figures


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
    for suffix in ("png", "pdf"):
        buffer = io.BytesIO()
        fig.savefig(buffer, format=suffix, dpi=150, bbox_inches="tight", metadata={"CreationDate": None} if suffix == "pdf" else None)
        paths.append(atomic_write_bytes(out_dir / f"{stem}.{suffix}", buffer.getvalue()))
    plt.close(fig)
    return paths


def pick_per_attack(runs: list[Run], needs: tuple[str, ...], defense: str | None = None) -> dict[str, dict[str, Run]]:
    """dataset -> attack label -> one run having artifacts `needs` (lowest seed, then run id),
    among runs of `defense` (None = any)."""
    chosen: dict[str, dict[str, Run]] = defaultdict(dict)
    for run in sorted(runs, key=lambda r: (r.record.seed, r.record.run_id)):
        if defense is not None and run.record.defense["name"] != defense:
            continue
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


def _grid(rows: int, cols: int, size: float = 1.6):
    fig, axes = plt.subplots(rows, cols, figsize=(size * cols, size * rows + 0.4), squeeze=False)
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
    return fig, axes


def _panels(count: int, width: float = 3.6, height: float = 2.8):
    cols = min(count, 3)
    rows = math.ceil(count / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    for ax in axes.flat[count:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:count])


def _run_tag(run: Run) -> str:
    return f"seed {run.record.seed}, run {run.record.run_id[:8]}"


def trigger_gallery(runs: list[Run], out: Path, residual_scale: float = 10.0) -> list[Path]:
    written = []
    for dataset, by_attack in pick_per_attack(runs, ("examples_clean", "examples_poisoned")).items():
        shown = EXAMPLES_SHOWN
        fig, axes = _grid(len(by_attack), 3 * shown)
        for row, (label, run) in enumerate(by_attack.items()):
            clean, poisoned = run.artifacts["examples_clean"], run.artifacts["examples_poisoned"]
            for i in range(min(shown, len(clean))):
                residual = np.abs(poisoned[i] - clean[i]) * residual_scale
                for j, (title, array) in enumerate((("clean", clean[i]), ("poisoned", poisoned[i]),
                                                    (f"residual x{residual_scale:g}", residual))):
                    ax = axes[row, 3 * i + j]
                    image, kwargs = _image(array)
                    ax.imshow(image, **kwargs)
                    if row == 0:
                        ax.set_title(title, fontsize=8)
            axes[row, 0].set_ylabel(label, fontsize=8)
        fig.suptitle(f"Trigger gallery, {dataset}")
        written += save_figure(fig, out, f"{dataset}_1_trigger_gallery")
    return written


def poison_rate_curves(runs: list[Run], out: Path, residual_scale: float = 10.0) -> list[Path]:
    from backdoorbench.pipeline import config_hash

    drop = NON_RESULT_KEYS + ("seed", "attack.poison_rate")
    series: dict[tuple[str, str, str], dict[str, list[Run]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        if run.record.defense["name"] != "none":
            continue
        key = (run.dataset, run.record.attack["name"], run.record.attack["target_mode"])
        series[key][config_hash(run.record.config, drop)].append(run)
    plotted: dict[str, dict[str, list[tuple[str, list[Run]]]]] = defaultdict(lambda: defaultdict(list))
    for (dataset, attack, mode), by_setting in sorted(series.items()):
        kept = [(s, members) for s, members in sorted(by_setting.items())
                if len({m.record.attack["poison_rate"] for m in members}) >= 2]
        labels = setting_labels([members[0].record.config for _, members in kept])
        for (_, members), label in zip(kept, labels):
            label = label.replace("poison_rate=", "").strip(", ")
            plotted[dataset][attack].append((mode + (f" ({label})" if label and len(kept) > 1 else ""), members))
    written = []
    for dataset, by_attack in sorted(plotted.items()):
        fig, axes = _panels(len(by_attack))
        for ax, (attack, lines) in zip(axes, sorted(by_attack.items())):
            for label, members in lines:
                by_rate: dict[float, list[RunRecord]] = defaultdict(list)
                for m in members:
                    by_rate[float(m.record.attack["poison_rate"])].append(m.record)
                rates = sorted(by_rate)
                for metric, style in (("clean_acc", "o-"), ("asr", "s--")):
                    values = [[r.metrics["attacked"][metric] for r in by_rate[rate]] for rate in rates]
                    mean = np.array([np.mean(v) for v in values])
                    std = np.array([np.std(v, ddof=1) if len(v) > 1 else 0.0 for v in values])
                    name = "CA" if metric == "clean_acc" else "ASR"
                    ax.errorbar(rates, 100 * mean, yerr=100 * std, fmt=style, capsize=3, label=f"{name}, {label}")
            ax.set_title(attack, fontsize=10)
            ax.set_xlabel("poison rate")
            ax.set_ylabel("%")
            ax.set_ylim(-2, 102)
            ax.legend(fontsize=7)
        fig.suptitle(f"CA and ASR vs poison rate, {dataset} (mean ± std over seeds)")
        fig.tight_layout()
        written += save_figure(fig, out, f"{dataset}_2_poison_rate")
    return written


def neural_cleanse_anomaly(runs: list[Run], out: Path, residual_scale: float = 10.0) -> list[Path]:
    written = []
    for dataset, by_attack in pick_per_attack(runs, ("nc_anomaly_index", "nc_mask_l1"), "neural_cleanse").items():
        fig, axes = _panels(len(by_attack))
        for ax, (label, run) in zip(axes, by_attack.items()):
            index, norms = run.artifacts["nc_anomaly_index"], run.artifacts["nc_mask_l1"]
            threshold = float(run.artifacts.get("nc_anomaly_threshold", 2.0))
            flagged = (norms < np.median(norms)) & (index > threshold)  # as Neural Cleanse flags them
            ax.bar(np.arange(len(index)), np.minimum(index, 20), color=np.where(flagged, "tab:red", "tab:blue"))
            ax.axhline(threshold, color="k", linestyle="--", linewidth=1, label=f"threshold {threshold:g}")
            ax.set_title(f"{label}\n({_run_tag(run)})", fontsize=9)
            ax.set_xlabel("class (red: flagged, small mask)")
            ax.set_ylabel("anomaly index (capped at 20)")
            ax.legend(fontsize=7)
        fig.suptitle(f"Neural Cleanse anomaly index per class, {dataset}")
        fig.tight_layout()
        written += save_figure(fig, out, f"{dataset}_3_neural_cleanse")
    return written


def strip_histograms(runs: list[Run], out: Path, residual_scale: float = 10.0) -> list[Path]:
    written = []
    for dataset, by_attack in pick_per_attack(runs, ("strip_entropy_clean", "strip_entropy_poisoned"), "strip").items():
        fig, axes = _panels(len(by_attack))
        for ax, (label, run) in zip(axes, by_attack.items()):
            clean, poisoned = run.artifacts["strip_entropy_clean"], run.artifacts["strip_entropy_poisoned"]
            bins = np.linspace(min(clean.min(), poisoned.min()), max(clean.max(), poisoned.max()) + 1e-9, 30)
            ax.hist(clean, bins=bins, alpha=0.6, density=True, label=f"clean (n={len(clean)})")
            ax.hist(poisoned, bins=bins, alpha=0.6, density=True, label=f"triggered (n={len(poisoned)})")
            if "strip_entropy_threshold" in run.artifacts:
                ax.axvline(float(run.artifacts["strip_entropy_threshold"]), color="k", linestyle="--", linewidth=1,
                           label="threshold")
            ax.set_title(f"{label}\n({_run_tag(run)})", fontsize=9)
            ax.set_xlabel("mean entropy (bits)")
            ax.set_ylabel("density")
            ax.legend(fontsize=7)
        fig.suptitle(f"STRIP entropy, clean vs triggered test inputs, {dataset}")
        fig.tight_layout()
        written += save_figure(fig, out, f"{dataset}_4_strip_entropy")
    return written


def fine_pruning_curves(runs: list[Run], out: Path, residual_scale: float = 10.0) -> list[Path]:
    written = []
    for dataset, by_attack in pick_per_attack(runs, ("fp_pruned_fraction", "fp_clean_acc", "fp_asr"), "fine_pruning").items():
        fig, axes = _panels(len(by_attack))
        for ax, (label, run) in zip(axes, by_attack.items()):
            a = run.artifacts
            ax.plot(a["fp_pruned_fraction"], 100 * a["fp_clean_acc"], "o-", label="CA")
            ax.plot(a["fp_pruned_fraction"], 100 * a["fp_asr"], "s--", label="ASR")
            if "fp_chosen_fraction" in a:
                ax.axvline(float(a["fp_chosen_fraction"]), color="k", linestyle=":", linewidth=1, label="pruned by the defense")
            ax.set_title(f"{label}\n({_run_tag(run)})", fontsize=9)
            ax.set_xlabel("fraction of last-stage channels pruned")
            ax.set_ylabel("% on the test set")
            ax.set_ylim(-2, 102)
            ax.legend(fontsize=7)
        fig.suptitle(f"Fine-pruning before fine-tuning, {dataset}")
        fig.tight_layout()
        written += save_figure(fig, out, f"{dataset}_5_fine_pruning")
    return written


def gradcam_heatmaps(runs: list[Run], out: Path, residual_scale: float = 10.0) -> list[Path]:
    needs = ("examples_clean", "examples_poisoned", "gradcam_clean", "gradcam_poisoned")
    written = []
    for dataset, by_attack in pick_per_attack(runs, needs).items():
        shown = EXAMPLES_SHOWN
        fig, axes = _grid(len(by_attack), 4 * shown)
        for row, (label, run) in enumerate(by_attack.items()):
            a = run.artifacts
            for i in range(min(shown, len(a["examples_clean"]))):
                for j, kind in enumerate(("clean", "poisoned")):
                    image, kwargs = _image(a[f"examples_{kind}"][i])
                    ax_image, ax_cam = axes[row, 4 * i + 2 * j], axes[row, 4 * i + 2 * j + 1]
                    ax_image.imshow(image, **kwargs)
                    ax_cam.imshow(image, **kwargs)
                    ax_cam.imshow(a[f"gradcam_{kind}"][i], cmap="jet", alpha=0.5, vmin=0, vmax=1)
                    if row == 0:
                        ax_image.set_title(kind, fontsize=8)
                        ax_cam.set_title(f"GradCAM, {kind}", fontsize=8)
            axes[row, 0].set_ylabel(label, fontsize=8)
        fig.suptitle(f"GradCAM on the attacked model, {dataset}")
        written += save_figure(fig, out, f"{dataset}_6_gradcam")
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
)


def write_figures(results_dir: str | Path, *, dataset: str | None = None, residual_scale: float = 10.0,
                  report: Callable[[str], None] = print) -> dict[int, list[Path]]:
    """Draw every figure whose data the records under `<results_dir>/runs/` hold; `report` gets one
    line per figure skipped. Returns figure number -> files written."""
    results_dir = Path(results_dir).expanduser()
    if not (results_dir / "runs").is_dir():
        raise ConfigError(f"results_dir={str(results_dir)!r} has no runs/ folder; run `python -m backdoorbench "
                          f"results_dir={results_dir}` first, or pass the results_dir that holds the records")
    checks.number("", "residual_scale", residual_scale, 0, low_open=True, hint="e.g. 10")
    loaded = load_records_with_paths(results_dir)
    kept = {id(r) for r in filter_records([r for r, _ in loaded], dataset=dataset)}
    runs = [Run(record, path) for record, path in loaded if id(record) in kept]
    out = ensure_writable_dir(results_dir / "figures", "the figures folder at results_dir")
    where = "" if str(results_dir) == "results" else f" results_dir={results_dir}"
    written: dict[int, list[Path]] = {}
    for figure in FIGURES:
        written[figure.number] = figure.draw(runs, out, residual_scale=residual_scale)
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
            options = parse_args(args, {"results_dir": "results", "dataset": None, "residual_scale": "10"}, USAGE)
            try:
                scale = float(options["residual_scale"])
            except ValueError:
                raise ConfigError(f"residual_scale={options['residual_scale']!r} is not a number; use e.g. residual_scale=10") from None
            result: dict[int, list[Path]] | UserError = write_figures(
                options["results_dir"], dataset=options["dataset"], residual_scale=scale,
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
