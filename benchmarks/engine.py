"""Training throughput of our engine vs a standard torchvision input pipeline, same model and data.

Ours: the split lives on the device as one uint8 tensor; crops and flips are batched tensor ops
(backdoorbench.train.Trainer, one `fit` of one epoch per repeat). Baseline: what most backdoor
repositories do, a Dataset of PIL images (made per item, as torchvision.datasets.CIFAR10 does)
with RandomCrop(padding), RandomHorizontalFlip (where the data allows it), ToTensor, Normalize,
and a shuffling DataLoader, once with `--workers` 0 and once with 2 (persistent, so worker start-up
is not counted against it). Both sides train copies of the same initial weights with the same SGD,
batch size and the trainer's memory format and autocast, so the ratio measures the input path and
the loop (`--baseline-format contiguous` leaves the baselines in NCHW, as most scripts do, so the
ratio also holds what channels_last buys our trainer). A third arm, `compute`, runs the same number of forward/backward/SGD steps on one
batch that is already on the device: the model's own cost, which neither side can go below.

On a shared machine one epoch's time swings with the load, so the arms run interleaved (a warm-up
round, then `--repeats` rounds, the order rotated each round) and the script prints the median,
min and max of each arm, the ratio of medians, the median and range of the per-round ratios, the
load average before and after, and the thread counts.

    python benchmarks/engine.py --model mnist_cnn --data mnist5k --repeats 7 --threads 1
    python benchmarks/engine.py --model mnist_cnn --data mnist5k --repeats 7 --threads 2
    python benchmarks/engine.py --model mnist_cnn --data mnist5k --repeats 7 --threads 1 --baseline-format contiguous
    python benchmarks/engine.py --model preact_resnet18 --data cifar-shaped --size 512 --repeats 3 --threads 1
    python benchmarks/engine.py --input-only --repeats 7 --threads 1    # the input path alone, no model
    python benchmarks/engine.py --profile --threads 1    # where the model's step time goes, by operator

A figure-printing script, not a test. It is meant to run unchanged on a GPU (device auto = CUDA
if present) but has not been run on one yet; benchmarks/gpu_check.py's throughput section uses it.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision
from omegaconf import OmegaConf
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms

import backdoorbench
from backdoorbench.datasets.base import ImageDataset, Split, to_float
from backdoorbench.models.base import Normalized
from backdoorbench.train import Trainer, apply_augmentation, batch_bounds, draw_augmentation, resolve_device

CONF = Path(backdoorbench.__file__).parent / "conf"
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


def format_name(memory_format: torch.memory_format) -> str:
    return "channels_last" if memory_format == torch.channels_last else "contiguous"


def load_data(name: str, size: int, seed: int) -> ImageDataset:
    if name == "mnist5k":
        from backdoorbench.datasets.mnist5k import load_mnist5k

        return load_mnist5k()
    # CIFAR-10 itself cannot be downloaded here: random pixels of its shape and settings cost the same.
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (size, 3, 32, 32), generator=g, dtype=torch.uint8)
    labels = torch.randint(0, 10, (size,), generator=g)
    split = Split(images, labels)
    return ImageDataset("cifar-shaped", split, split, 10, CIFAR_MEAN, CIFAR_STD, hflip=True, crop_padding=4)


def build_net(model: str, data: ImageDataset) -> nn.Module:
    from hydra.utils import instantiate

    cfg = OmegaConf.load(CONF / "model" / f"{model}.yaml")
    channels, height, _ = data.image_shape
    return instantiate(cfg, in_channels=channels, num_classes=data.num_classes, image_size=height)


class PILImages(Dataset):
    """Images kept as HWC uint8 arrays and turned into PIL images per item, like torchvision's CIFAR10."""

    def __init__(self, split: Split, transform) -> None:
        self.images = split.images.permute(0, 2, 3, 1).numpy()
        self.labels = split.labels.tolist()
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        array = self.images[i]
        image = Image.fromarray(array[:, :, 0] if array.shape[2] == 1 else array)
        return self.transform(image), self.labels[i]


def baseline_loader(data: ImageDataset, batch_size: int, workers: int, device: torch.device) -> DataLoader:
    """The usual pipeline over `data.train`: PIL images, RandomCrop(padding), RandomHorizontalFlip
    where allowed, ToTensor, Normalize, a shuffling DataLoader (workers persist between epochs)."""
    steps = [transforms.RandomCrop(data.image_shape[1], padding=data.crop_padding)]
    if data.hflip:
        steps.append(transforms.RandomHorizontalFlip())
    steps += [transforms.ToTensor(), transforms.Normalize(data.mean, data.std)]
    return DataLoader(PILImages(data.train, transforms.Compose(steps)), batch_size=batch_size, shuffle=True,
                      num_workers=workers, pin_memory=device.type == "cuda", persistent_workers=workers > 0)


def sgd_step(net: nn.Module, optimizer: torch.optim.Optimizer, x, y, amp: bool) -> torch.Tensor:
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=amp):
        loss = F.cross_entropy(net(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach()


def baseline_epoch(net, loader, optimizer, device, amp, memory_format, max_steps: int | None = None) -> int:
    """One epoch (or `max_steps` batches) of the usual loop; returns the images seen."""
    net.train()
    seen = 0
    loss_sum = torch.zeros((), device=device)
    for step, (x, y) in enumerate(loader):
        if max_steps is not None and step >= max_steps:
            break
        x = x.to(device, non_blocking=True).contiguous(memory_format=memory_format)
        loss_sum += sgd_step(net, optimizer, x, y.to(device, non_blocking=True), amp)
        seen += len(y)
    loss_sum.item()  # wait for the device before the clock stops
    return seen


def compute_epoch(net, optimizer, x, y, sizes: list[int], amp: bool) -> None:
    """The epoch's forward/backward/SGD steps on one batch already on the device: no input path."""
    net.train()
    loss_sum = torch.zeros((), device=x.device)
    for size in sizes:
        loss_sum += sgd_step(net, optimizer, x[:size], y[:size], amp)
    loss_sum.item()


def input_epoch_ours(images: torch.Tensor, trainer: Trainer, generator: torch.Generator) -> None:
    """The input path of one epoch of Trainer.fit alone: shuffle, index, crop/flip, to float."""
    n = len(images)
    order = torch.randperm(n, generator=generator).to(trainer.device)
    offsets, flips = draw_augmentation(n, generator, trainer.crop_padding, trainer.hflip)
    offsets = offsets.to(trainer.device) if offsets is not None else None
    flips = flips.to(trainer.device) if flips is not None else None
    total = torch.zeros((), device=trainer.device)
    for start, stop in batch_bounds(n, trainer.batch_size):
        batch = apply_augmentation(images[order[start:stop]], offsets[start:stop] if offsets is not None else None,
                                   flips[start:stop] if flips is not None else None, trainer.crop_padding)
        total += to_float(batch)[:, 0, 0, 0].sum()  # touch the batch, as a model would
    total.item()


def input_epoch_baseline(loader, device) -> None:
    total = torch.zeros((), device=device)
    for x, _ in loader:
        total += x.to(device, non_blocking=True)[:, 0, 0, 0].sum()
    total.item()


# torch.profiler operator names -> what they are, for the --profile table (self time, CPU or CUDA)
CATEGORIES = (
    ("convolution backward", ("convolution_backward",)),
    ("convolution forward", ("convolution", "conv2d")),
    ("batch norm", ("batch_norm",)),
    ("relu (forward, backward)", ("clamp_min", "threshold_backward", "relu")),
    ("max/avg pooling", ("pool",)),
    ("linear (mm, addmm)", ("aten::mm", "aten::addmm", "aten::bmm")),
    ("dropout", ("bernoulli", "dropout")),
    ("zeroing (fill_, zero_)", ("fill_", "zero_")),
    ("loss", ("log_softmax", "nll_loss")),
    ("elementwise (optimizer, grads, normalization)", ("add", "mul", "sub", "div", "foreach", "lerp", "sqrt")),
)


def profile_compute(run: Callable[[], None], device: torch.device) -> None:
    """Self time per operator category of one compute epoch (the model's steps alone)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        run()
    events = prof.key_averages()
    cuda = device.type == "cuda"
    totals: dict[str, float] = {}
    optimizer_us = 0.0
    for event in events:
        if event.key.startswith("Optimizer.step"):
            optimizer_us += event.cpu_time_total
        if event.key.startswith(("Optimizer.", "ProfilerStep", "autograd::engine")):
            continue
        us = getattr(event, "self_device_time_total" if cuda else "self_cpu_time_total", 0.0)
        name = next((c for c, keys in CATEGORIES if any(k in event.key for k in keys)), "other")
        totals[name] = totals.get(name, 0.0) + us
    whole = sum(totals.values())
    print(f"profile of one compute epoch ({'CUDA kernel' if cuda else 'CPU'} self time, {whole / 1e3:.0f} ms):")
    for name, us in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<46} {us / 1e3:9.1f} ms  {us / whole:6.1%}")
    if not cuda:
        print(f"  (the optimizer's step, all its operators together: {optimizer_us / 1e3:.1f} ms, {optimizer_us / whole:.1%})")


def interleaved(arms: dict[str, Callable[[], None]], warmups: dict[str, Callable[[], None]], repeats: int) -> dict[str, list[float]]:
    """Seconds of each arm per round: one warm-up round, then `repeats` rounds, the order rotated
    every round so that no arm always runs right after the same neighbour."""
    for warm in warmups.values():
        warm()
    names = list(arms)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(repeats):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            arms[name]()
            seconds[name].append(time.perf_counter() - start)
    return seconds


def report(seconds: dict[str, list[float]], images: int, ours: str = "ours") -> None:
    width = max(len(name) for name in seconds)
    print(f"{'arm':<{width}}  {'median s':>9}  {'min s':>7}  {'max s':>7}  {'images/s (median)':>17}")
    for name, values in seconds.items():
        median = statistics.median(values)
        print(f"{name:<{width}}  {median:9.3f}  {min(values):7.3f}  {max(values):7.3f}  {images / median:17.1f}")
    mine = seconds[ours]
    for name, values in seconds.items():
        if name == ours:
            continue
        paired = [theirs / own for theirs, own in zip(values, mine)]
        print(f"ratio {name} / {ours}: {statistics.median(values) / statistics.median(mine):.2f}x of medians; "
              f"per round median {statistics.median(paired):.2f}x, range {min(paired):.2f}-{max(paired):.2f}x "
              f"(n={len(paired)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mnist_cnn", help="a conf/model/*.yaml name, e.g. mnist_cnn, preact_resnet18")
    parser.add_argument("--data", default="mnist5k", choices=["mnist5k", "cifar-shaped"])
    parser.add_argument("--size", type=int, default=5000, help="images of cifar-shaped data")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--workers", default="0,2", help="DataLoader workers of the baseline arms, comma-separated")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds of every arm (one epoch each)")
    parser.add_argument("--warmup-steps", type=int, default=0, help="warm-up batches per arm (0 = one epoch)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--no-amp", action="store_true", help="fp32 on CUDA too, both sides")
    parser.add_argument("--channels-last", choices=["auto", "on", "off"], default="auto",
                        help="memory format of every arm: the trainer's default (auto), or forced")
    parser.add_argument("--baseline-format", choices=["same", "contiguous"], default="same",
                        help="the baselines' memory format: ours (same, the fair default) or plain NCHW, as most "
                             "training scripts leave it")
    parser.add_argument("--input-only", action="store_true",
                        help="time only the input path (shuffle, crop/flip, to float; the DataLoader), no model")
    parser.add_argument("--profile", action="store_true", help="also profile one compute epoch by operator")
    parser.add_argument("--threads", type=int, default=0, help="torch threads of this process (0 = torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    workers = [int(w) for w in args.workers.split(",") if w.strip()]

    device = resolve_device(args.device)
    data = load_data(args.data, args.size, args.seed)
    train = data.train
    n = len(train)
    torch.manual_seed(args.seed)
    initial = build_net(args.model, data)
    optimizer = partial(torch.optim.SGD, lr=0.01, momentum=0.9, weight_decay=5e-4)
    amp = not args.no_amp
    trainer = Trainer(epochs=1, batch_size=args.batch_size, optimizer=optimizer, schedule="constant",
                      crop_padding=data.crop_padding, hflip=data.hflip, precision="bf16" if amp and device.type == "cuda" else "fp32",
                      channels_last=args.channels_last != "off", progress=False, device=device)
    if args.channels_last == "on":
        trainer.memory_format = torch.channels_last
    memory_format, use_amp = trainer.memory_format, trainer.precision == "bf16"
    baseline_format = memory_format if args.baseline_format == "same" else torch.contiguous_format

    gpu = f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
    print(f"device {device}{gpu}; torch {torch.__version__}, torchvision {torchvision.__version__}, "
          f"python {platform.python_version()}; cpus {os.cpu_count()}, torch threads {torch.get_num_threads()} "
          f"(DataLoader workers: 1 each), OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    print("load average before: " + " ".join(f"{v:.2f}" for v in os.getloadavg()))
    print(f"model {args.model} ({sum(p.numel() for p in initial.parameters()):,} parameters), data {args.data}: "
          f"{n} images {tuple(data.image_shape)}, crop padding {data.crop_padding}, hflip {data.hflip}; "
          f"batch {args.batch_size}; memory format {format_name(memory_format)} (baselines: {format_name(baseline_format)}), "
          f"bf16 autocast {use_amp} (all arms); repeats {args.repeats}")

    loaders = {w: baseline_loader(data, args.batch_size, w, device) for w in workers}
    warm_steps = args.warmup_steps or None

    if args.input_only:
        images = train.images.to(device)
        generator = torch.Generator().manual_seed(3)
        arms = {"ours": lambda: input_epoch_ours(images, trainer, generator)}
        arms.update({f"baseline workers={w}": partial(input_epoch_baseline, loader, device) for w, loader in loaders.items()})
        seconds = interleaved(arms, arms, args.repeats)
        print("input path only (no model):")
        report(seconds, n)
        print("load average after: " + " ".join(f"{v:.2f}" for v in os.getloadavg()))
        return

    # ours: one Trainer.fit of one epoch per round, on its own copy of the weights
    ours = Normalized(copy.deepcopy(initial), data.mean, data.std)
    warm_split = train if warm_steps is None else train.subset(torch.arange(min(n, warm_steps * args.batch_size)))
    generator = torch.Generator().manual_seed(2)
    arms: dict[str, Callable[[], None]] = {"ours": lambda: trainer.fit(ours, train, generator=generator)}
    warmups: dict[str, Callable[[], None]] = {"ours": lambda: trainer.fit(ours, warm_split, generator=generator)}

    # baselines: each DataLoader trains its own copy (normalization is in the transforms)
    for w, loader in loaders.items():
        net = copy.deepcopy(initial).to(device, memory_format=baseline_format)
        sgd = optimizer(net.parameters())
        run = partial(baseline_epoch, net, loader, sgd, device, use_amp, baseline_format)
        arms[f"baseline workers={w}"] = run
        warmups[f"baseline workers={w}"] = partial(run, max_steps=warm_steps)

    # compute: the model's steps alone, on one batch prepared once (same model wrapper as ours)
    net = trainer.prepare(Normalized(copy.deepcopy(initial), data.mean, data.std))
    sgd = optimizer(net.parameters())
    sizes = [stop - start for start, stop in batch_bounds(n, args.batch_size)]
    x = to_float(train.images[: max(sizes)].to(device)).contiguous(memory_format=memory_format)
    y = train.labels[: max(sizes)].to(device)
    arms["compute"] = partial(compute_epoch, net, sgd, x, y, sizes, use_amp)
    warmups["compute"] = partial(compute_epoch, net, sgd, x, y, sizes[: warm_steps or len(sizes)], use_amp)

    seconds = interleaved(arms, warmups, args.repeats)
    report(seconds, n)
    compute = statistics.median(seconds["compute"])
    for name, values in seconds.items():
        if name != "compute":
            print(f"share of {name}'s epoch in the model's forward/backward/SGD: {compute / statistics.median(values):.0%}")
    print("load average after: " + " ".join(f"{v:.2f}" for v in os.getloadavg()))
    if args.profile:
        profile_compute(arms["compute"], device)


if __name__ == "__main__":
    main()
