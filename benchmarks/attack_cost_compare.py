"""What poisoning costs per training image, ours against BackdoorBench's, on the same work.

Where BackdoorBench's implementation of one of our attacks runs here without downloads, both
sides poison the same uint8 images and the script times them side by side in one process, on
one thread: FTrojan (its `utils/bd_img_transform/ftrojann.py`, `ftrojann_version`, with the values
of its `config/attack/ftrojannn/default.yaml`) and CTRL (its `utils/bd_img_transform/ctrl.py`, the
`ctrl` transform with its `config/attack/ctrl/default.yaml`; needs kornia, pytorch_wavelets and
PyWavelets, else that row says it was skipped). Each side is timed from the images it is handed
to the 8-bit images it keeps: BackdoorBench's transform per PIL image, as its dataset calls it
(plus its `astype(np.uint8)` for FTrojan's float output), ours `apply_trigger` on batches, as
`Attack.poison_dataset` runs it. The images are `--images` seeded random 3x32x32 ones standing in
for CIFAR-10 (the cost does not depend on the content) and as many of mnist5k's real 1x28x28
digits; the median of `--repeats` interleaved rounds is reported, after one warm-up call each.
The outputs are compared too (max absolute difference in 0-255 levels, each side's own rounding),
with a cause check for each difference: a speed ratio of two different computations means nothing.

The other four of BackdoorBench's six matching attacks have no computation here to compare on the
same work: its SSBA, Poison Ink and LF read pre-made resources that must be downloaded, and its
Blind is a training loop with no poisoning step. For those, and for ours of all six, the script
prints our seconds per training image of applying the trigger (SSBA and Poison Ink with the quick
protocol's small networks, untrained and seeded; LF with a seeded stand-in pattern: timing only)
and, for Blind, our victim training's passes per image per epoch (the record's
`attack_cost.victim_training`), measured on one short epoch.

    python benchmarks/attack_cost_compare.py --backdoorbench ~/src/BackdoorBench --images 1000 --out cost.md

The user supplies the BackdoorBench checkout (https://github.com/SCLBD/BackdoorBench, written
against f02e3534645f0ee63d6848653062cd6c0d6c400d); its two transform files are loaded from it by
path, and this project holds none of its code. Its code predates numpy 1.24 (`np.float`) and
setuptools 81 (pytorch_wavelets imports `pkg_resources`): where they are gone, the script aliases
`np.float = float` and gives `pkg_resources` a one-function stand-in (`resource_stream`) before
loading it, and says so in its output. Any failure is one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import importlib.resources
import importlib.util
import os
import platform
import shlex
import statistics
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

CHECKOUT_FILES = ("utils/bd_img_transform/ftrojann.py", "config/attack/ftrojannn/default.yaml",
                  "utils/bd_img_transform/ctrl.py", "config/attack/ctrl/default.yaml")
SHAPES = ((3, 32, 32), (1, 28, 28))
BATCH = 1024  # Attack.poison_dataset's batch
SEED = 0


class CompareError(Exception):
    """A one-line reason the comparison can't go on."""


@dataclass
class Row:
    """One attack on one image shape: ms per image on each side (None: not run) and what was done."""

    attack: str
    shape: tuple[int, int, int]
    ours_ms: float
    bb_ms: float | None
    note: str


@dataclass
class Agreement:
    """Both sides' outputs compared: max |difference| in 0-255 levels, the share of values that
    differ, and the cause check (a line saying what explains the difference)."""

    attack: str
    shape: tuple[int, int, int]
    max_diff: int
    differing: float
    cause: str


def check_checkout(path: Path) -> Path:
    """The checkout's root, or a one-line CompareError saying what is missing."""
    path = path.expanduser()
    if not path.exists():
        raise CompareError(f"--backdoorbench {path}: no such folder; clone https://github.com/SCLBD/BackdoorBench there")
    if not path.is_dir():
        raise CompareError(f"--backdoorbench {path} is a file; give the folder of a BackdoorBench checkout")
    missing = [p for p in CHECKOUT_FILES if not (path / p).is_file()]
    if missing:
        raise CompareError(f"--backdoorbench {path} is not a BackdoorBench checkout: {missing[0]} is missing"
                           f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; "
                           "clone https://github.com/SCLBD/BackdoorBench (f02e353 or later)")
    return path.resolve()


def compatibility_shims() -> list[str]:
    """What BackdoorBench's transforms need that today's packages dropped, put back; the lines saying so."""
    said = []
    if not hasattr(np, "float"):  # removed in numpy 1.24; ftrojann.py allocates with dtype=np.float
        np.float = float  # type: ignore[attr-defined]
        said.append(f"np.float aliased to float (numpy {np.__version__} has none; BackdoorBench's ftrojann.py uses it)")
    if "pkg_resources" not in sys.modules and importlib.util.find_spec("pkg_resources") is None:
        stand_in = types.ModuleType("pkg_resources")
        stand_in.resource_stream = lambda package, name: importlib.resources.files(package).joinpath(name).open("rb")
        sys.modules["pkg_resources"] = stand_in
        said.append("pkg_resources given a stand-in (resource_stream only): setuptools >= 81 has none and "
                    "pytorch_wavelets, which BackdoorBench's ctrl.py imports, reads its filters with it")
    return said


def load_module(bb: Path, relative: str) -> types.ModuleType:
    """One of BackdoorBench's files as a module, loaded by path (it imports nothing of its own)."""
    spec = importlib.util.spec_from_file_location(f"backdoorbench_peer_{Path(relative).stem}", bb / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_yaml(bb: Path, relative: str) -> dict:
    import yaml

    return yaml.safe_load((bb / relative).read_text()) or {}


def stand_in_images(shape: tuple[int, int, int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded random uint8 images (N, C, H, W) and labels; mnist5k's digits for 1x28x28."""
    if shape == (1, 28, 28):
        from backdoorbench import create_dataset

        train = create_dataset("mnist5k").train
        return train.images[:n].clone(), train.labels[:n].clone()
    g = torch.Generator().manual_seed(SEED)
    return torch.randint(0, 256, (n, *shape), generator=g, dtype=torch.uint8), torch.randint(0, 10, (n,), generator=g)


def shape_name(shape: tuple[int, int, int]) -> str:
    return "x".join(map(str, shape)) + (" (mnist5k)" if shape == (1, 28, 28) else " (random)")


# --- our side ----------------------------------------------------------------------------------------


def poison_ours(attack, images: torch.Tensor) -> torch.Tensor:
    """`Attack.poison_dataset`'s inner loop: uint8 batches in, the triggered uint8 images out."""
    from backdoorbench.datasets.base import to_float, to_uint8

    return torch.cat([to_uint8(attack.apply_trigger(to_float(chunk))) for chunk in images.split(BATCH)])


def our_attack(name: str, shape: tuple[int, int, int], **values):
    """Ours for `shape` (10 classes); SSBA and Poison Ink with the quick protocol's networks
    (mnist5k's values, on either shape) untrained and seeded, LF with a seeded stand-in pattern."""
    from backdoorbench import create_attack

    quick = name in ("ssba", "poison_ink", "blind")
    attack = create_attack(name, dataset="mnist5k" if quick else "cifar10", protocol="quick" if quick else None,
                           num_classes=10, image_shape=shape, **values)
    torch.manual_seed(SEED)
    if name == "ssba":
        from backdoorbench.attacks.stegastamp import StegaStampEncoder

        encoder = StegaStampEncoder(shape[0], shape[1], shape[2], attack.code_bits, attack.residual, attack.width)
        attack.load_state_dict({"encoder": encoder.state_dict()})
    elif name == "poison_ink":
        attack.load_state_dict({"injection": attack.build_injection().state_dict()})
    elif name == "lf":  # a smooth-looking 8-bit pattern in [0, magnitude]: its content does not change the cost
        pattern = torch.rand(shape, generator=torch.Generator().manual_seed(SEED)) * attack.magnitude
        attack.load_state_dict({"pattern": (pattern * 255).round() / 255})
    return attack


def blind_passes(shape: tuple[int, int, int], images: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Our Blind's victim training passes per image per epoch (the record's
    `attack_cost.victim_training.passes_per_epoch`), on one epoch of `images` with a linear model,
    the backdoor loss from the first batch (before BackdoorBench's loss threshold a batch costs 1 / 1)."""
    from backdoorbench.datasets.base import Split
    from backdoorbench.metrics.cost import attack_cost
    from backdoorbench.train import Trainer
    from backdoorbench.train.passes import CallCounter

    attack = our_attack("blind", shape, loss_threshold=None)
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(shape)), 10))
    trainer = Trainer(epochs=1, batch_size=32, device="cpu", progress=False, augment=False)
    counter = CallCounter()
    with counter.counting():
        attack.train_victim(trainer, model, Split(images, labels), torch.Generator().manual_seed(SEED))
    return attack_cost({}, len(images), training=counter)["victim_training"]["passes_per_epoch"]


# --- BackdoorBench's side ----------------------------------------------------------------------------


def pil_images(images: torch.Tensor) -> list:
    """Each image as the PIL image BackdoorBench's dataset hands its transforms (RGB or L)."""
    from PIL import Image

    arrays = images.permute(0, 2, 3, 1).numpy()
    return [Image.fromarray(a[:, :, 0] if a.shape[2] == 1 else a) for a in arrays]


def hwc(images: torch.Tensor) -> np.ndarray:
    return images.permute(0, 2, 3, 1).numpy().astype(np.int64)


def bb_ftrojan(module, settings: dict, shape, geometry) -> tuple[Callable, str]:
    """BackdoorBench's FTrojan transform as its dataset applies it (image in, `astype(np.uint8)` out)
    for `shape`, and the note saying with which values. On 1x28x28 its pipeline refuses the image
    (cv2's YCrCb takes 3 channels, position 31 is outside a 28-px tile): its transform runs with
    YUV off and ours' geometry for 28 px, on HxWx1 arrays (its DCT indexes a channel axis)."""
    window, positions, channels = geometry
    if shape[0] == 3:
        transform = module.ftrojann_version(YUV=settings["YUV"], channel_list=settings["channel_list"],
                                            window_size=settings["window_size"], magnitude=settings["magnitude"],
                                            pos_list=positions)
        note = (f"its ftrojann_version per PIL image: YUV (cv2 YCrCb), magnitude {settings['magnitude']:g}, "
                f"channels {list(channels)}, window {window}, positions {[list(p) for p in positions]}")
        return (lambda image: transform(image).astype(np.uint8)), note
    transform = module.ftrojann_version(YUV=False, channel_list=list(channels), window_size=window,
                                        magnitude=settings["magnitude"], pos_list=positions)
    note = (f"its pipeline refuses 1 channel and 28 px; its transform run with YUV off, window {window}, "
            f"positions {[list(p) for p in positions]}, magnitude {settings['magnitude']:g}, on 28x28x1 arrays")
    return (lambda image: transform(np.asarray(image)[:, :, None]).astype(np.uint8)), note


def bb_ctrl(module, settings: dict, shape, geometry) -> tuple[Callable, str, float]:
    """BackdoorBench's CTRL transform (its `ctrl(args, train=True)`, PIL image in and out) for
    `shape`, its note and its magnitude (hard-coded in the transform). On 1x28x28 its yaml's YUV
    would refuse one channel: use_yuv off, channel 0, positions [13, 27] as ours resolves them."""
    window, positions, channels = geometry
    yuv = bool(settings["use_yuv"]) and shape[0] == 3
    args = types.SimpleNamespace(img_size=(shape[1], shape[2], shape[0]), use_dct=settings["use_dct"], use_yuv=yuv,
                                 trigger_channels=list(settings["trigger_channels"]) if shape[0] == 3 else list(channels),
                                 pos_list=list(settings["pos_list"]) if shape[0] == 3 else [u for u, _ in positions])
    transform = module.ctrl(args, train=True)
    if shape[0] == 3:
        note = (f"its ctrl transform per PIL image: kornia YUV, magnitude {transform.magnitude:g} (hard-coded), "
                f"channels {args.trigger_channels}, window {shape[1]} (its image size), positions {args.pos_list}")
    else:
        note = (f"its yaml's YUV refuses 1 channel; its transform run with use_yuv off, channel {args.trigger_channels}, "
                f"positions {args.pos_list}, window {shape[1]}")
    return (lambda image: np.asarray(transform(image, 0))), note, float(transform.magnitude)


def stacked(outputs: list) -> np.ndarray:
    arrays = [np.asarray(o, dtype=np.int64) for o in outputs]
    return np.stack([a[:, :, None] if a.ndim == 2 else a for a in arrays])


# --- cause checks: what explains a difference --------------------------------------------------------


def ftrojan_cause(module, settings, images, ours: np.ndarray, geometry) -> str:
    """BackdoorBench's own FTrojan steps with its 8-bit truncation (`astype(np.uint8)` of the inverse
    DCT's floats, which wraps values outside 0-255) replaced by ours' rounding and saturation."""
    window, positions, channels = geometry
    colour = settings["YUV"] and images.shape[1] == 3
    rows, outside, total = [], 0, 0
    for image in images.permute(0, 2, 3, 1).numpy():
        x = image[None].astype(np.float64)
        x = module.DCT(module.RGB2YUV(x) if colour else x, window)
        for channel in channels:
            for u, v in positions:
                x[0, channel, u::window, v::window] += settings["magnitude"]
        x = module.IDCT(x, window)
        outside, total = outside + int(((x <= -1) | (x >= 256)).sum()), total + x.size
        x = np.clip(np.rint(x), 0, 255)
        rows.append((module.YUV2RGB(x) if colour else x)[0].astype(np.uint8))
    diff = np.abs(np.stack(rows).astype(np.int64) - ours)
    where = "the inverse DCT's YCrCb floats" if colour else "its float output"
    rest = " (cv2's fixed-point YCrCb against ours' formula)" if colour and diff.any() else ""
    return (f"BB casts {where} with astype(np.uint8): truncated where ours rounds (an untouched level k - 1e-13 "
            f"becomes k - 1), and {outside} values ({outside / total:.2%}) at or past -1 or 256 wrap where ours saturates "
            f"(docs/fidelity.md#ftrojan); BB's own steps with ours' rounding: max abs diff {diff.max()}, "
            f"{(diff > 0).mean():.2%} of values{rest}")


def ctrl_cause(images, bb: np.ndarray, magnitude: float, geometry, yuv: bool) -> str:
    """Ours' DCT pipeline with BackdoorBench's truncation (`.to(torch.uint8)`) in place of rounding and,
    on colour images, the installed kornia's conversions in place of kornia 0.6.5's coefficients,
    on the values inside 0-255 (outside it, its cast wraps where ours saturates)."""
    from backdoorbench.attacks import frequency

    window, positions, channels = geometry
    levels = images.to(torch.float64)
    kornia_note = ""
    if yuv:
        import kornia

        levels = kornia.color.rgb_to_yuv(levels)
        kornia_note = (f"; kornia {kornia.__version__}'s yuv_to_rgb here is the exact inverse, ours follows "
                       "0.6.5's rounded coefficients (CTRL's pin)")
    levels = frequency.block_idct(frequency.bump(frequency.block_dct(levels, window), channels, window, positions,
                                                 magnitude), window)
    if yuv:
        levels = kornia.color.yuv_to_rgb(levels)
    levels = levels.permute(0, 2, 3, 1).numpy()
    inside = (levels > -1) & (levels < 256)  # what truncates into 0-255; the rest wraps
    diff = np.abs(np.trunc(np.where(inside, levels, 0)).astype(np.int64) - bb)[inside]
    return (f"BB truncates (.to(torch.uint8)) where ours rounds{kornia_note}; ours' steps with its truncation"
            f"{' and that kornia' if yuv else ''}: max abs diff {diff.max() if diff.size else 0} on the values that truncate into "
            f"0-255; {int((~inside).sum())} values ({1 - inside.mean():.2%}) at or past -1 or 256, where BB's cast wraps "
            "and ours saturates")


# --- timing -------------------------------------------------------------------------------------------


def median_times(arms: dict[str, Callable[[], object]], repeats: int) -> tuple[dict[str, float], dict[str, object]]:
    """Median seconds of each arm over `repeats` interleaved rounds (order rotated each round), after
    one untimed warm-up call each; and each arm's last output."""
    outputs = {name: run() for name, run in arms.items()}
    times: dict[str, list[float]] = {name: [] for name in arms}
    names = list(arms)
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            start = time.perf_counter()
            outputs[name] = arms[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}, outputs


def compare_frequency(name: str, shape, images, bb: Path, repeats: int, modules: dict) -> tuple[Row, Agreement | None]:
    """FTrojan or CTRL on `images` on both sides: the row and the agreement."""
    n = len(images)
    if name == "ftrojan":
        settings = read_yaml(bb, "config/attack/ftrojannn/default.yaml")
        pairs = settings["pos_list"]
        settings["pos_list"] = [(int(pairs[i]), int(pairs[i + 1])) for i in range(0, len(pairs) - 1, 2)]
        values = {"magnitude": float(settings["magnitude"])}
        if shape[0] == 3:
            values.update(channels=list(settings["channel_list"]), window=int(settings["window_size"]),
                          positions=[list(p) for p in settings["pos_list"]], yuv=bool(settings["YUV"]))
        ours = our_attack("ftrojan", shape, **values)
    else:
        settings = read_yaml(bb, "config/attack/ctrl/default.yaml")
        ours = our_attack("ctrl", shape)
    geometry = (ours.window, ours.positions, ours.channels)
    if name not in modules:
        return Row(name, shape, 1e3 * median_times({"ours": lambda: poison_ours(ours, images)}, repeats)[0]["ours"] / n,
                   None, modules.get(f"{name}_skipped", "skipped")), None
    try:
        if name == "ftrojan":
            transform, note = bb_ftrojan(modules[name], settings, shape, geometry)
        else:
            transform, note, magnitude = bb_ctrl(modules[name], settings, shape, geometry)
            if magnitude != ours.magnitude:
                note += f"; its magnitude {magnitude:g}, ours {ours.magnitude:g}"
        pils = pil_images(images)
        seconds, outputs = median_times({"ours": lambda: poison_ours(ours, images),
                                         "bb": lambda: [transform(p) for p in pils]}, repeats)
    except Exception as exc:  # its code on this shape or with these packages: the row says why
        seconds = median_times({"ours": lambda: poison_ours(ours, images)}, repeats)[0]
        return Row(name, shape, 1e3 * seconds["ours"] / n, None,
                   f"BackdoorBench's transform failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"), None
    mine, theirs = hwc(outputs["ours"]), stacked(outputs["bb"])
    diff = np.abs(mine - theirs)
    if not diff.any():
        cause = "identical"
    elif name == "ftrojan":
        cause = ftrojan_cause(modules[name], settings, images, mine, geometry)
    else:
        cause = ctrl_cause(images, theirs, float(ours.magnitude), geometry, ours.yuv)
    row = Row(name, shape, 1e3 * seconds["ours"] / n, 1e3 * seconds["bb"] / n, note)
    return row, Agreement(name, shape, int(diff.max()), float((diff > 0).mean()), cause)


def ours_only(name: str, shape, images, repeats: int) -> Row:
    """One of ours with no BackdoorBench computation to set beside it: its trigger timing and why."""
    attack = our_attack(name, shape)
    seconds = median_times({"ours": lambda: poison_ours(attack, images)}, repeats)[0]["ours"]
    if name == "lf":
        note = ("BB reads a pre-made resource/lowFrequency/<dataset>_<model>_0_255.npy (a download); ours adds its "
                "crafted pattern, here a seeded stand-in (crafting not timed)")
    elif name == "ssba":
        note = ("BB reads pre-made poisoned sets resource/ssba/*.npy (a download); ours: the quick encoder "
                f"(width {attack.width}, {attack.code_bits} bits), untrained and seeded: timing only")
    elif name == "poison_ink":
        note = ("BB reads pre-made poisoned images resource/poison_ink/ (a download); ours: the quick U-Net "
                f"(width {attack.width}, depth {attack.depth}), untrained and seeded: timing only")
    else:
        note = "BB's Blind is its training loop (no poisoning step); ours' cost is attack_cost.victim_training, below"
    return Row(name, shape, 1e3 * seconds / len(images), None, note)


def load_backdoorbench(bb: Path) -> tuple[dict, list[str]]:
    """BackdoorBench's FTrojan and CTRL transform modules (where they load), and lines to print."""
    lines = compatibility_shims()
    modules: dict = {}
    try:
        modules["ftrojan"] = load_module(bb, "utils/bd_img_transform/ftrojann.py")
    except ImportError as exc:
        modules["ftrojan_skipped"] = f"ftrojan: skipped (BackdoorBench's ftrojann.py needs {exc.name})"
        lines.append(modules["ftrojan_skipped"])
    needed = [m for m in ("kornia", "pytorch_wavelets", "pywt") if importlib.util.find_spec(m) is None]
    if needed:
        modules["ctrl_skipped"] = "ctrl: skipped (needs kornia, pytorch_wavelets)" + (
            "" if set(needed) <= {"kornia", "pytorch_wavelets"} else f"; missing here: {', '.join(needed)}")
        lines.append(modules["ctrl_skipped"])
    else:
        try:
            modules["ctrl"] = load_module(bb, "utils/bd_img_transform/ctrl.py")
        except ImportError as exc:
            modules["ctrl_skipped"] = f"ctrl: skipped (BackdoorBench's ctrl.py needs {exc.name})"
            lines.append(modules["ctrl_skipped"])
    return modules, lines


def versions() -> str:
    """The versions of the packages either side runs on (read from their metadata, nothing imported)."""
    from importlib.metadata import PackageNotFoundError, version

    found = [f"torch {torch.__version__}", f"numpy {np.__version__}"]
    for name in ("opencv-python", "opencv-python-headless", "kornia", "pytorch_wavelets", "PyWavelets"):
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            pass
    return ", ".join(found)


def report(rows: list[Row], agreements: list[Agreement], blind: dict, header: list[str], load_after: str) -> str:
    """The markdown text: the header lines, the cost table, the agreement table, Blind's passes."""
    lines = [*header, "BB = BackdoorBench", "", "| attack | image shape | ours ms/image | BB ms/image | BB/ours ratio | note |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        bb = f"{r.bb_ms:.4f}" if r.bb_ms is not None else "–"
        ratio = f"{r.bb_ms / r.ours_ms:.1f}x" if r.bb_ms is not None and r.ours_ms > 0 else "–"
        lines.append(f"| {r.attack} | {shape_name(r.shape)} | {r.ours_ms:.4f} | {bb} | {ratio} | {r.note} |")
    if agreements:
        lines += ["", "Outputs (uint8, each side's own rounding), BackdoorBench against ours:", "",
                  "| attack | image shape | max abs diff (levels) | values differing | why |", "|---|---|---|---|---|"]
        lines += [f"| {a.attack} | {shape_name(a.shape)} | {a.max_diff} | {a.differing:.2%} | {a.cause} |" for a in agreements]
    lines.append("")
    for shape, passes in blind.items():
        lines.append(f"blind, ours, {shape_name(shape)}: victim training {passes['forward']:.2f} forward / "
                     f"{passes['backward']:.2f} backward passes per image per epoch (a clean training: 1 / 1), "
                     "measured on one epoch, backdoor loss from the first batch")
    lines.append(f"load average after: {load_after}")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backdoorbench", required=True, type=Path, help="a BackdoorBench checkout (its root folder)")
    parser.add_argument("--images", type=int, default=1000, help="images per shape, both sides the same")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (median), at least 3")
    parser.add_argument("--out", type=Path, help="also write the text to this file")
    args = parser.parse_args(argv)
    if args.images < 1:
        parser.error(f"--images {args.images}: use 1 or more")
    if args.repeats < 3:
        parser.error(f"--repeats {args.repeats}: use 3 or more (the median of the rounds is reported)")
    return args


def load_average() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        bb = check_checkout(args.backdoorbench)
        torch.set_num_threads(1)
        try:
            import cv2

            cv2.setNumThreads(1)
        except ImportError:
            pass
        command = sys.argv if argv is None else ["benchmarks/attack_cost_compare.py", *argv]
        header = [f"$ python {shlex.join(command)}",
                  f"BackdoorBench checkout {bb}",
                  f"load average before: {load_average()}",
                  f"CPU: {platform.machine()}, torch CPU capability {torch.backends.cpu.get_cpu_capability()}, "
                  f"1 thread (torch, cv2); {versions()}"]
        modules, said = load_backdoorbench(bb)
        header += said
        rows, agreements, blind = [], [], {}
        for shape in SHAPES:
            images, labels = stand_in_images(shape, args.images)
            if len(images) < args.images:
                header.append(f"{shape_name(shape)}: {len(images)} images (all there are)")
            for name in ("ftrojan", "ctrl"):
                row, agreement = compare_frequency(name, shape, images, bb, args.repeats, modules)
                rows.append(row)
                if agreement is not None:
                    agreements.append(agreement)
            rows += [ours_only(name, shape, images, args.repeats) for name in ("lf", "ssba", "poison_ink", "blind")]
            blind[shape] = blind_passes(shape, images[:256], labels[:256])
        header.append(f"{args.images} images per shape, median of {args.repeats} interleaved rounds after a warm-up; "
                      f"ours in batches of {BATCH} (uint8 in, uint8 out), BackdoorBench per image")
        text = report(rows, agreements, blind, header, load_average())
        if args.out is not None:
            args.out.write_text(text)
    except CompareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
