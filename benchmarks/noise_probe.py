"""What the cached victims predict on uniform noise, the "inert pattern" SentiNet pastes each input's
salient region onto (its avg. confidence is the mean top softmax probability over such images). A
victim that gives noise one class with confidence near 1 is flagged by SentiNet's fixed rule
(avg. confidence > 0.9) on every input, clean or triggered.

For each record of `--defense` (default sentinet) under `--results`, the victim its run used (from the
victim cache, loaded weights-only) predicts `--n` images of uniform noise floored to 8 bits, as SentiNet
draws them. Printed per dataset, attack and mode, over the seeds found: the class each seed's victim
gives most of the noise images, that class's share (mean ± std) and the mean top softmax probability.
Run it where the runs ran (a record's victim path may be relative to that directory):

    python -m benchmarks.noise_probe --results results
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch
from omegaconf import OmegaConf

from backdoorbench.defenses.sentinet import inert_noise
from backdoorbench.factory import build
from backdoorbench.fileio import torch_load
from backdoorbench.models.base import Normalized


def victim(record: dict) -> Normalized:
    """The record's victim: its architecture from the record's config, its weights from the cache entry."""
    channels, size, _ = record["dataset"]["image_shape"]
    net = build(OmegaConf.create(record["config"]["model"]), in_channels=channels,
                num_classes=record["dataset"]["num_classes"], image_size=size)
    model = Normalized(net, (0.0,) * channels, (1.0,) * channels)  # mean and std come with the weights
    model.load_state_dict(torch_load(record["victim"]["path"], map_location="cpu")["model"])  # a relative path: from the run's directory
    return model.eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=Path("results"), help="the results_dir of the runs")
    parser.add_argument("--defense", default="sentinet", help="the records whose victims are probed")
    parser.add_argument("--n", type=int, default=500, help="noise images per victim")
    args = parser.parse_args(argv)
    found: dict[tuple[str, str, str], dict[int, dict]] = defaultdict(dict)
    for path in sorted((args.results / "runs").glob("*/*/*.json")):
        record = json.loads(path.read_text())
        if record["defense"]["name"] != args.defense or not record.get("victim", {}).get("path"):
            continue
        attack = record["attack"]
        found[(record["dataset"]["name"], attack["name"], attack["target_mode"])][record["seed"]] = record
    if not found:
        print(f"no records of defense {args.defense!r} with a cached victim under {args.results / 'runs'}", file=sys.stderr)
        return 1
    print("dataset attack mode seeds: the class most noise images get, per seed; its share (mean ± std); the mean top probability")
    for (dataset, attack, mode), seeds in sorted(found.items()):
        shares, tops, classes = [], [], []
        for seed, record in sorted(seeds.items()):
            noise = inert_noise((args.n, *record["dataset"]["image_shape"]), torch.Generator().manual_seed(seed))
            with torch.no_grad():
                probs = victim(record)(noise).softmax(1)
            counts = torch.bincount(probs.argmax(1), minlength=probs.shape[1])
            shares.append(float(counts.max()) / args.n)
            classes.append(int(counts.argmax()))
            tops.append(float(probs.amax(1).mean()))
        spread = f" ± {statistics.stdev(shares):.3f}" if len(shares) > 1 else ""
        print(f"{dataset} {attack} {mode} {','.join(map(str, sorted(seeds)))}: class {','.join(map(str, classes))}; "
              f"{statistics.mean(shares):.3f}{spread}; {statistics.mean(tops):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
