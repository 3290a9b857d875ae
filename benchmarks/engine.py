"""Training throughput of our engine vs a standard torchvision input pipeline, same model and data.

Ours: the split lives on the device as one uint8 tensor; crops and flips are batched tensor ops
(backdoorbench.train.Trainer). Baseline: what most backdoor repositories do, a Dataset of PIL
images (decoded per item, as torchvision.datasets.CIFAR10 does) with RandomCrop(padding),
RandomHorizontalFlip (where the data allows it), ToTensor, Normalize, and a shuffling DataLoader.
Both sides train the same initial weights with the same SGD, batch size, epochs, and the same
bf16 autocast / channels_last on CUDA, so the ratio measures the input path and loop overhead.

    python benchmarks/engine.py --model mnist_cnn --data mnist5k --epochs 1
    python benchmarks/engine.py --model preact_resnet18 --data cifar-shaped --size 512 --warmup-steps 2

A figure-printing script, not a test. It runs unchanged on a GPU (device auto = CUDA if present).
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import time
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
from backdoorbench.datasets.base import ImageDataset, Split
from backdoorbench.models.base import Normalized
from backdoorbench.train import Trainer, resolve_device

CONF = Path(backdoorbench.__file__).parent / "conf"
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


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


def baseline_epoch(net, loader, optimizer, device, amp, memory_format, max_steps: int | None = None) -> int:
    """One epoch (or `max_steps` batches) of the usual loop; returns the images seen."""
    net.train()
    seen = 0
    loss_sum = torch.zeros((), device=device)
    for step, (x, y) in enumerate(loader):
        if max_steps is not None and step >= max_steps:
            break
        x = x.to(device, non_blocking=True).contiguous(memory_format=memory_format)
        y = y.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = F.cross_entropy(net(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_sum += loss.detach()
        seen += len(y)
    loss_sum.item()  # wait for the device before the clock stops
    return seen


def input_epoch_ours(train: Split, trainer: Trainer, generator: torch.Generator) -> None:
    """The input path of one epoch of Trainer.fit alone: shuffle, index, crop/flip, to float."""
    from backdoorbench.datasets.base import to_float
    from backdoorbench.train import apply_augmentation, batch_bounds, draw_augmentation

    images = train.images.to(trainer.device)
    order = torch.randperm(len(train), generator=generator).to(trainer.device)
    offsets, flips = draw_augmentation(len(train), generator, trainer.crop_padding, trainer.hflip)
    offsets = offsets.to(trainer.device) if offsets is not None else None
    flips = flips.to(trainer.device) if flips is not None else None
    total = torch.zeros((), device=trainer.device)
    for start, stop in batch_bounds(len(train), trainer.batch_size):
        batch = apply_augmentation(images[order[start:stop]], offsets[start:stop] if offsets is not None else None,
                                   flips[start:stop] if flips is not None else None, trainer.crop_padding)
        total += to_float(batch)[:, 0, 0, 0].sum()  # touch the batch, as a model would
    total.item()


def input_epoch_baseline(loader, device) -> None:
    total = torch.zeros((), device=device)
    for x, _ in loader:
        total += x.to(device, non_blocking=True)[:, 0, 0, 0].sum()
    total.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mnist_cnn", help="a conf/model/*.yaml name, e.g. mnist_cnn, preact_resnet18")
    parser.add_argument("--data", default="mnist5k", choices=["mnist5k", "cifar-shaped"])
    parser.add_argument("--size", type=int, default=5000, help="images of cifar-shaped data")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers of the baseline")
    parser.add_argument("--warmup-steps", type=int, default=0, help="warm-up batches per side (0 = one epoch)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--no-amp", action="store_true", help="fp32 on CUDA too, both sides")
    parser.add_argument("--input-only", action="store_true",
                        help="time only the input path (data to device, shuffle, crop/flip), no model")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    device = resolve_device(args.device)
    data = load_data(args.data, args.size, args.seed)
    train = data.train
    n = len(train)
    torch.manual_seed(args.seed)
    initial = build_net(args.model, data)
    optimizer = partial(torch.optim.SGD, lr=0.01, momentum=0.9, weight_decay=5e-4)
    amp = not args.no_amp

    gpu = f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
    print(f"device {device}{gpu}; torch {torch.__version__}, torchvision {torchvision.__version__}, "
          f"python {platform.python_version()}; torch threads {torch.get_num_threads()}, cpus {os.cpu_count()}")
    print(f"model {args.model} ({sum(p.numel() for p in initial.parameters()):,} parameters), data {args.data}: "
          f"{n} images {tuple(data.image_shape)}, crop padding {data.crop_padding}, hflip {data.hflip}; "
          f"batch {args.batch_size}, epochs {args.epochs}, baseline workers {args.workers}, "
          f"bf16 autocast + channels_last on CUDA: {amp and device.type == 'cuda'}")

    trainer = Trainer(epochs=args.epochs, batch_size=args.batch_size, optimizer=optimizer, schedule="constant",
                      crop_padding=data.crop_padding, hflip=data.hflip, amp=amp, channels_last=amp,
                      progress=False, device=device)
    # The baseline's input pipeline.
    steps = [transforms.RandomCrop(data.image_shape[1], padding=data.crop_padding)]
    if data.hflip:
        steps.append(transforms.RandomHorizontalFlip())
    steps += [transforms.ToTensor(), transforms.Normalize(data.mean, data.std)]
    loader = DataLoader(PILImages(train, transforms.Compose(steps)), batch_size=args.batch_size, shuffle=True,
                        num_workers=args.workers, pin_memory=device.type == "cuda",
                        persistent_workers=args.workers > 0)
    if args.input_only:
        ours_s, base_s = [], []
        for _ in range(args.epochs + 1):  # the first of each is the warm-up
            start = time.perf_counter()
            input_epoch_ours(train, trainer, torch.Generator().manual_seed(3))
            ours_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            input_epoch_baseline(loader, device)
            base_s.append(time.perf_counter() - start)
        ours_s, base_s, images = sum(ours_s[1:]), sum(base_s[1:]), n * args.epochs
        print(f"input path only: ours {ours_s:.3f} s ({images / ours_s:.0f} images/s), "
              f"baseline {base_s:.3f} s ({images / base_s:.0f} images/s), ratio {base_s / ours_s:.1f}x")
        return

    # --- ours
    ours = Normalized(copy.deepcopy(initial), data.mean, data.std)
    warm = train if args.warmup_steps == 0 else train.subset(torch.arange(min(n, args.warmup_steps * args.batch_size)))
    trainer.fit(ours, warm, generator=torch.Generator().manual_seed(1), epochs=1, desc="warm-up")
    start = time.perf_counter()
    trainer.fit(ours, train, generator=torch.Generator().manual_seed(2))
    ours_s = time.perf_counter() - start

    # --- baseline
    memory_format = torch.channels_last if amp and device.type == "cuda" else torch.contiguous_format
    net = copy.deepcopy(initial).to(device, memory_format=memory_format)
    sgd = optimizer(net.parameters())
    use_amp = amp and device.type == "cuda"
    baseline_epoch(net, loader, sgd, device, use_amp, memory_format, args.warmup_steps or None)
    start = time.perf_counter()
    seen = sum(baseline_epoch(net, loader, sgd, device, use_amp, memory_format) for _ in range(args.epochs))
    base_s = time.perf_counter() - start
    assert seen == n * args.epochs

    images = n * args.epochs
    print(f"ours      {ours_s:8.2f} s  {images / ours_s:10.1f} images/s")
    print(f"baseline  {base_s:8.2f} s  {images / base_s:10.1f} images/s")
    print(f"ratio     {base_s / ours_s:.2f}x (ours / baseline throughput)")


if __name__ == "__main__":
    main()
