"""What every figure shares: a run and its artifacts, saving (PNG and PDF, atomically, in pages),
panel grids with one shared legend, the run picked per attack (the leaderboard's canonical row first),
and the colours."""

from __future__ import annotations

import io
import math
import warnings
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display, no GUI toolkit

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from backdoorbench.errors import DataError  # noqa: E402
from backdoorbench.fileio import atomic_write_bytes, load_arrays  # noqa: E402
from backdoorbench.records import RunRecord, artifacts_path  # noqa: E402
from backdoorbench.report.derived import build_rows  # noqa: E402
from backdoorbench.report.query import victim_training  # noqa: E402

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
                    self._artifacts = load_arrays(where)
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


def image_args(array: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
    """(C, H, W) in [0, 1] -> what imshow takes, and its arguments."""
    array = np.clip(array, 0, 1)
    if array.shape[0] == 1:
        return array[0], {"cmap": "gray", "vmin": 0, "vmax": 1}
    return np.transpose(array[:3], (1, 2, 0)), {}


def image_grid(rows: int, cols: int, size: float = 1.3):
    # constrained layout sizes the margins to the labels, title and colour bar: no blank band, no overlap
    fig, axes = plt.subplots(rows, cols, figsize=(size * cols + 2.4, size * rows + 0.9), squeeze=False,
                             layout="constrained")
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
    return fig, axes


def row_label(ax, label: str) -> None:
    """The attack and its mode, on two lines, horizontal, left of the row."""
    ax.set_ylabel(label.replace(" ", "\n", 1), rotation=0, ha="right", va="center", fontsize=9, labelpad=6)


def pages_of(by_attack: dict[str, Run]) -> list[list[tuple[str, Run]]]:
    """Rows split into pages of at most ROWS_PER_PAGE, as even as they can be: 24 -> 6 x 4, 16 -> 6, 5, 5."""
    items = list(by_attack.items())
    count = math.ceil(len(items) / ROWS_PER_PAGE)
    sizes = [len(items) // count + (k < len(items) % count) for k in range(count)]
    starts = np.cumsum([0, *sizes])
    return [items[a:b] for a, b in zip(starts[:-1], starts[1:])]


def page_title(title: str, page: int, pages: int) -> str:
    return title if pages == 1 else f"{title} (page {page} of {pages})"


def panel_columns(count: int) -> int:
    """Columns for `count` panels and their shared legend: the legend takes a spare slot if there is
    one; the fewest slots left empty, three columns on a tie."""
    if count <= 3:
        return count
    def wasted(cols: int) -> int:
        spare = -count % cols
        return spare - 1 if spare else 0
    return min((3, 4), key=lambda cols: (wasted(cols), cols))


def panel_grid(count: int, width: float = 3.6, height: float = 2.8):
    """A figure with `count` panels; the first spare slot (if any) is returned for the legend."""
    cols = panel_columns(count)
    rows = math.ceil(count / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows + 0.6), squeeze=False,
                             layout="constrained")
    spare = list(axes.flat[count:])
    for ax in spare:
        ax.set_visible(False)
    return fig, list(axes.flat[:count]), (spare[0] if spare else None)


def shared_legend(fig, source, spare) -> None:
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


def training_text(config: dict[str, Any]) -> str:
    trainer = victim_training(config)
    text = f"{trainer.get('epochs', '?')} ep"
    return text if trainer.get("augment", True) else text + ", no aug"


def run_setting(run: Run) -> str:
    """What a reader needs to place the panel: poison rate, training and seed (not a run hash)."""
    rate = run.record.attack.get("poison_rate")
    poisoned = f"poison rate {100 * float(rate):g}%, " if rate is not None else ""
    return f"{poisoned}{training_text(run.record.config)}, seed {run.record.seed}"



def mean_std(values: list[float]) -> tuple[float, float]:
    return float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else 0.0



def distinct_colour(index: int) -> tuple[float, ...]:
    """The index-th of 19 distinct colours: tab10, then the darkest of each tab20b hue, then
    tab20c's; a figure with 11 or more curves (every defense) repeats none of them."""
    palette = ([plt.get_cmap("tab10")(i) for i in range(10)] + [plt.get_cmap("tab20b")(i) for i in (0, 4, 8, 12, 16)]
               + [plt.get_cmap("tab20c")(i) for i in (0, 4, 8, 12)])
    return palette[index % len(palette)]
