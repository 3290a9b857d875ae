"""How an epoch is cut into batches and a batch into each process's share, and the one host-to-device
copy that does not make the host wait."""

from __future__ import annotations

import torch
from torch import Tensor


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """A copy from pageable host memory makes the host wait for the GPU; from pinned memory it
    is queued like a kernel (the caching host allocator keeps the buffer alive until it ran)."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def batch_bounds(count: int, batch_size: int, min_last: int = 2) -> list[tuple[int, int]]:
    """(start, stop) of each batch; a last batch smaller than `min_last` joins the one before it,
    because batch norm cannot train on a single sample (it raises on a (1, C) input). With N
    processes `min_last` is 2N, so that every process's share of the last batch has two."""
    starts = list(range(0, count, batch_size))
    if len(starts) > 1 and count - starts[-1] < min_last:
        starts.pop()
    return [(start, min(start + batch_size, count) if i < len(starts) - 1 else count) for i, start in enumerate(starts)]


def shard_bounds(start: int, stop: int, rank: int, world: int) -> tuple[int, int]:
    """This process's contiguous share of the batch [start, stop): the first (size mod world)
    processes take one sample more, as torch.tensor_split does."""
    base, extra = divmod(stop - start, world)
    low = start + rank * base + min(rank, extra)
    return low, low + base + (1 if rank < extra else 0)


def refresh_every(batches: int) -> int:
    """Batches between two readings of the running loss and accuracy for the bar: about eight per
    epoch, at most 50 apart. Each reading waits for the GPU, so not every step."""
    return max(1, min(50, batches // 8))
