"""The trainer's per-epoch checkpoint: everything a killed fit needs to resume bit-exactly on the CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from backdoorbench.errors import DataError
from backdoorbench.fileio import atomic_torch_save, torch_load

CHECKPOINT_FORMAT = "backdoorbench.trainer_checkpoint.v1"


def save_checkpoint(
    path: Path,
    meta: dict[str, Any],
    epoch: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    generator: torch.Generator,
    extra_params: list[nn.Parameter],
    history: list[dict[str, Any]],
    *,
    companion: Any = None,
) -> None:
    """Write the state after `epoch` to a temp file beside `path`, then rename it over `path`,
    so a crash mid-write leaves the previous epoch's checkpoint intact. `companion`'s
    `training_state()` (e.g. a training-controlled attack's generator) is saved with it."""
    state = {
        "format": CHECKPOINT_FORMAT,
        "meta": meta,
        "epoch": epoch,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "generator": generator.get_state(),
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
        "extra_params": [p.detach().cpu() for p in extra_params],
        "history": history,
        "companion": companion.training_state() if companion is not None else None,
    }
    atomic_torch_save(state, path)


def load_checkpoint(
    path: Path,
    meta: dict[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    generator: torch.Generator,
    extra_params: list[nn.Parameter],
    *,
    companion: Any = None,
) -> tuple[int, list[dict[str, Any]]]:
    """Restore everything `save_checkpoint` wrote; return (epochs done, their history rows).
    Anything unreadable or written by a different fit is one DataError line."""
    where = f"checkpoint {str(path)!r}"
    try:
        state = torch_load(path, map_location="cpu")
    except Exception as exc:  # a truncated zip, a foreign pickle, ...: torch raises many types
        raise DataError(f"{where} cannot be read ({type(exc).__name__}); delete it to train from scratch") from exc
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise DataError(f"{where} is not a trainer checkpoint ({CHECKPOINT_FORMAT}); delete it or give another path")
    if state.get("meta") != meta:
        raise DataError(f"{where} was written by another fit ({state.get('meta')}), not this one ({meta}); "
                        "delete it or give another path")
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if len(state["extra_params"]) != len(extra_params):
            raise ValueError(f"{len(state['extra_params'])} extra parameters saved, {len(extra_params)} given")
        with torch.no_grad():
            for param, saved in zip(extra_params, state["extra_params"]):
                param.copy_(saved)
        if (state.get("companion") is None) != (companion is None):
            raise ValueError("the checkpoint's training-time attack state does not match this fit's")
        if companion is not None:
            companion.load_training_state(state["companion"])
        generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        if state["cuda_rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        epoch, history = int(state["epoch"]), list(state["history"])
    except (KeyError, RuntimeError, ValueError, TypeError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"{where} does not fit this model or optimizer ({reason[:200]}); delete it or give another path") from exc
    if not 0 <= epoch <= meta["epochs"]:
        raise DataError(f"{where} is at epoch {epoch}, outside 0..{meta['epochs']}; delete it or give another path")
    return epoch, history
