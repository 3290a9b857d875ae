"""Data-parallel runs across processes started by torchrun: the process group, ranks, collectives.

`torchrun --nproc_per_node=N -m backdoorbench ...` starts N copies of one run. Each joins one
process group from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), over
NCCL when it trains on CUDA (GPU LOCAL_RANK) and gloo on the CPU. Every process holds the whole
in-memory dataset and runs the whole pipeline with the same seeds; the trainer gives each one a
disjoint share of every global batch and averages gradients (DistributedDataParallel), so all
processes hold the same weights after every step. Only rank 0 writes records, checkpoints and logs.
Without torchrun (WORLD_SIZE unset or 1) everything here is a no-op.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from backdoorbench.errors import ConfigError


def launched_world_size() -> int:
    """The number of processes torchrun started (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def active() -> bool:
    """Whether this process trains in a process group of more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def rank() -> int:
    """This process's rank; read from torchrun's environment before the group exists, so code that
    runs before the trainer (loggers, Hydra's output folder) already knows whether it may write."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def is_main() -> bool:
    """Rank 0: the one process that writes records, checkpoints, logs and prints."""
    return rank() == 0


def local_device(device: torch.device) -> torch.device:
    """Under torchrun, a bare `cuda` means this process's GPU, cuda:LOCAL_RANK."""
    if launched_world_size() > 1 and device.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if device.index is not None and device.index != local:
            raise ConfigError(f"device={device} under torchrun: each process uses its own GPU (LOCAL_RANK {local}); "
                              "use device=auto or device=cuda")
        return torch.device("cuda", local)
    return device


def init_from_env(device: torch.device) -> None:
    """Join torchrun's process group once (NCCL for CUDA, gloo for the CPU); no-op without torchrun."""
    if launched_world_size() <= 1 or (dist.is_available() and dist.is_initialized()):
        return
    if not dist.is_available():
        raise ConfigError("torchrun started several processes but this torch build has no torch.distributed; "
                          "run a single process")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    atexit.register(_destroy)


def _destroy() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(t: Tensor) -> Tensor:
    """The element-wise sum of `t` over all processes, in place (unchanged in a single process)."""
    if active():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def rank_0_says(flag: bool) -> bool:
    """Rank 0's `flag` in every process (`flag` itself in one process), so all take one branch."""
    if not active():
        return flag
    box = [flag]
    dist.broadcast_object_list(box, src=0)
    return bool(box[0])


def average_gradients(params: Iterable[nn.Parameter]) -> None:
    """Average the .grad of `params` over all processes, for parameters a side optimizer steps
    outside the trainer's DistributedDataParallel module (e.g. a trigger generator)."""
    if not active():
        return
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat.div_(dist.get_world_size())
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def broadcast_state(module: nn.Module, src: int = 0) -> None:
    """Copy rank `src`'s parameters and buffers into every process's `module`."""
    if not active():
        return
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src)
