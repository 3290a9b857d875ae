"""L_inf PGD on the attacked and defended models, and its memo: the attacked model's results kept
beside its victim-cache entry, so a sweep of defenses over one cached victim attacks it once."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from backdoorbench import checks, distributed
from backdoorbench.datasets.base import ImageDataset
from backdoorbench.fileio import atomic_torch_save, torch_load
from backdoorbench.metrics.robustness import eps_list, masking_suspects, robustness_curve

log = logging.getLogger(__name__)


def pgd_images(data: ImageDataset, pgd_cfg: DictConfig):
    """`pgd_cfg.images` test images: all of them when there are no more, else a seeded choice
    (not the first N: mnist5k's test split is sorted by class, so its first 50 are all zeros)."""
    count = min(pgd_cfg.images, len(data.test))
    if count == len(data.test):
        pick = torch.arange(count)
    else:
        pick = torch.randperm(len(data.test), generator=torch.Generator().manual_seed(pgd_cfg.seed))[:count].sort().values
    test = data.test.subset(pick)
    return test.float_images(), test.labels


def measure_pgd(model, data: ImageDataset, pgd_cfg: DictConfig, device: torch.device, *, keep_examples: bool = False):
    """L_inf PGD on `pgd_cfg.images` clean test images (`pgd_images`), at every eps and loss of
    `pgd_cfg`: the metrics to record (`pgd`: a row per loss and eps; `pgd_acc` too when eps is
    one number and ce is among the losses, as before eps lists) and the adversarial images
    (with `keep_examples`, for a transfer attack)."""
    images, labels = pgd_images(data, pgd_cfg)
    rows, examples = robustness_curve(
        model, images, labels, eps=eps_list(pgd_cfg.eps), losses=list(pgd_cfg.get("losses", ["ce"])),
        steps=pgd_cfg.steps, step_size=pgd_cfg.step_size, rel_step_size=pgd_cfg.get("rel_step_size"),
        random_start=pgd_cfg.get("random_start", True), seed=pgd_cfg.seed, device=device, keep_examples=keep_examples)
    for row in masking_suspects(rows):
        log.warning("PGD (%s) leaves %.1f%% accuracy at eps %g: at that radius a working attack leaves ~0; "
                    "suspect gradient masking, not robustness", row["loss"], 100 * row["acc"], row["eps"])
    metrics: dict[str, Any] = {"pgd": rows}
    single = [r["acc"] for r in rows if r["loss"] == "ce"]
    if checks.is_number(pgd_cfg.eps) and single:
        metrics["pgd_acc"] = single[0]
    return metrics, examples


PGD_MEMO_FORMAT = "backdoorbench-pgd-memo-1"


def pgd_memo_path(victim: dict[str, Any], pgd_cfg: DictConfig, device: torch.device, keep_examples: bool) -> Path | None:
    """Where the attacked model's PGD results are kept beside its victim-cache entry
    (`<key>.pgd-<digest>.pt`, the digest over eval.pgd and the device type), or None without a cache."""
    if not victim.get("path"):
        return None
    material = {"format": PGD_MEMO_FORMAT, "pgd": OmegaConf.to_container(pgd_cfg, resolve=True),
                "keep_examples": bool(keep_examples), "device": device.type}
    digest = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:16]
    entry = Path(victim["path"])
    return entry.with_name(f"{entry.stem}.pgd-{digest}.pt")


def attacked_pgd(model, data: ImageDataset, pgd_cfg: DictConfig, device: torch.device, victim: dict[str, Any], *,
                 keep_examples: bool = False) -> tuple[dict[str, Any], dict, str]:
    """`measure_pgd` on the attacked model, memoised beside its victim-cache entry: a sweep over
    defenses (or over a defense's settings) attacks one cached victim once, not once per run. PGD
    draws its random starts from eval.pgd.seed, so a recomputation on the same weights gives the
    same numbers on the CPU. Returns (metrics, adversarial images, memo state: "off" without the
    victim cache, "hit" when read, "saved" when computed and kept)."""
    path = pgd_memo_path(victim, pgd_cfg, device, keep_examples) if distributed.is_main() else None
    if path is not None and victim.get("cache") == "hit" and path.exists():
        try:
            entry = torch_load(path, map_location="cpu")
            if not isinstance(entry, dict) or entry.get("format") != PGD_MEMO_FORMAT:
                raise ValueError(f"not a {PGD_MEMO_FORMAT} file")
            examples = {(str(loss), float(eps)): images for loss, eps, images in entry["examples"]}
            log.info("PGD on the attacked model from %s (computed with its victim)", path)
            return json.loads(entry["metrics"]), examples, "hit"
        except Exception as exc:  # truncated or foreign file: compute again and overwrite it
            log.warning("PGD memo %s is unusable (%s); attacking the model again", path, type(exc).__name__)
    metrics, examples = measure_pgd(model, data, pgd_cfg, device, keep_examples=keep_examples)
    if path is None:
        return metrics, examples, "off"
    atomic_torch_save({"format": PGD_MEMO_FORMAT, "metrics": json.dumps(metrics),
                       "examples": [(loss, eps, images) for (loss, eps), images in examples.items()]}, path)
    return metrics, examples, "saved"
