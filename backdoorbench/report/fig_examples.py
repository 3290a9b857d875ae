"""Figures of images: the trigger gallery (1) and GradCAM heatmaps (6), a row per attack and mode, in pages."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display, no GUI toolkit

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.cm import ScalarMappable  # noqa: E402
import numpy as np  # noqa: E402

from backdoorbench.report.plot import (Run, image_args, image_grid, page_title, pages_of, pick_per_attack, row_label,
                                      save_pages)  # noqa: E402


EXAMPLES_SHOWN = 2  # example images per attack in the gallery and GradCAM figures


def trigger_gallery(runs: list[Run], out: Path, residual_scale: float = 10.0, suffix: str = "") -> list[Path]:
    written = []
    residual_map = plt.get_cmap("magma")
    for dataset, by_attack in pick_per_attack(runs, ("examples_clean", "examples_poisoned")).items():
        shown, pages, figures = EXAMPLES_SHOWN, pages_of(by_attack), []
        for page, items in enumerate(pages, start=1):
            fig, axes = image_grid(len(items), 3 * shown)
            residual_image = None
            for row, (label, run) in enumerate(items):
                clean, poisoned = run.artifacts["examples_clean"], run.artifacts["examples_poisoned"]
                for i in range(min(shown, len(clean))):
                    image, kwargs = image_args(clean[i])
                    axes[row, 3 * i].imshow(image, **kwargs)
                    image, kwargs = image_args(poisoned[i])
                    axes[row, 3 * i + 1].imshow(image, **kwargs)
                    # the largest change over the channels, in pixel units: colour, not contrast-stretched grey
                    residual = np.abs(poisoned[i] - clean[i]).max(axis=0)
                    residual_image = axes[row, 3 * i + 2].imshow(residual, cmap=residual_map, vmin=0,
                                                                 vmax=1 / residual_scale)
                    if row == 0:
                        for j, title in enumerate(("clean", "poisoned", "|poisoned − clean|")):
                            axes[row, 3 * i + j].set_title(title, fontsize=9)
                row_label(axes[row, 0], label)
            if residual_image is not None:
                fig.colorbar(residual_image, ax=axes[:, 2::3].ravel().tolist(), shrink=min(0.9, 2.5 / len(items)),
                             extend="max", label=f"|poisoned − clean|, pixel units (brightest: ≥ {1 / residual_scale:g})")
            fig.suptitle(page_title(f"Trigger gallery, {dataset}", page, len(pages)))
            figures.append(fig)
        written += save_pages(figures, out, f"{dataset}_1_trigger_gallery{suffix}")
    return written


def gradcam_heatmaps(runs: list[Run], out: Path, residual_scale: float = 10.0, suffix: str = "") -> list[Path]:
    needs = ("examples_clean", "examples_poisoned", "gradcam_clean", "gradcam_poisoned")
    written = []
    for dataset, by_attack in pick_per_attack(runs, needs).items():
        shown, pages, figures = EXAMPLES_SHOWN, pages_of(by_attack), []
        for page, items in enumerate(pages, start=1):
            fig, axes = image_grid(len(items), 4 * shown)
            heat = None
            for row, (label, run) in enumerate(items):
                a = run.artifacts
                for i in range(min(shown, len(a["examples_clean"]))):
                    for j, kind in enumerate(("clean", "poisoned")):
                        image, kwargs = image_args(a[f"examples_{kind}"][i])
                        ax_image, ax_cam = axes[row, 4 * i + 2 * j], axes[row, 4 * i + 2 * j + 1]
                        ax_image.imshow(image, **kwargs)
                        ax_cam.imshow(image, **kwargs)
                        heat = ax_cam.imshow(a[f"gradcam_{kind}"][i], cmap="jet", alpha=0.5, vmin=0, vmax=1)
                        if row == 0:
                            ax_image.set_title(kind, fontsize=9)
                            ax_cam.set_title(f"GradCAM, {kind}", fontsize=9)
                row_label(axes[row, 0], label)
            if heat is not None:
                bar = fig.colorbar(ScalarMappable(heat.norm, heat.cmap), ax=axes.ravel().tolist(),
                                   shrink=min(0.9, 2.5 / len(items)))
                bar.set_label("GradCAM, scaled to [0, 1] per image (last conv stage)")
            fig.suptitle(page_title(f"GradCAM on the attacked model, {dataset}", page, len(pages)))
            figures.append(fig)
        written += save_pages(figures, out, f"{dataset}_6_gradcam{suffix}")
    return written
