"""Poison Ink: the image's coloured edge map, hidden in it by an injection network trained for it."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backdoorbench import checks, distributed
from backdoorbench.attacks.base import Attack, SurrogateCrafted
from backdoorbench.attacks.poison_ink_nets import ExtractionNet, InjectionUNet, edge_mask, watermark
from backdoorbench.datasets.base import Split, to_float, to_uint8
from backdoorbench.errors import ConfigError, DataError
from backdoorbench.fileio import atomic_torch_save, file_sha256, torch_load
from backdoorbench.progress import track
from backdoorbench.train.passes import CallCounter

log = logging.getLogger(__name__)

# The official training colours: each channel randint(1, 5) * 40 per image (ZJ_Dataset_cifar.py).
TRAIN_LEVELS = (40, 80, 120, 160, 200)
INTERFERENCES = ("crop", "flip")
DETECTORS = ("sobel", "canny")
IMAGE_LOSSES = ("mse", "l1")
# The official loss scale: every term is 10000 x its mean error.
LOSS_SCALE = 10000.0
NETWORKS_VERSION = 1  # bumped whenever what a cached pair of networks holds or how it is trained changes
NETWORKS_FORMAT = "backdoorbench.poison_ink_networks.v1"
OFFICIAL_WIDTH, OFFICIAL_DEPTH = 64, 4  # up_UNet: the layout of BackdoorBench's netH_epoch_*.pth


def load_resource(path: str, image_shape: tuple[int, int, int]) -> dict[str, Tensor]:
    """BackdoorBench's trained injection network (resource/poison_ink/train.py writes
    `chk/<remark>/checkPoints/netH_epoch_<n>.pth`, trigger_generation.py reads it with `--Hnet`):
    the state dict of the official `UNet(n_channels=6, n_classes=3)`, read without unpickling
    (`weights_only=True`), a DataParallel `module.` prefix dropped. Every refusal is one line."""
    where = f"attack.resource={path!r}"
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"{where} does not exist; give BackdoorBench's injection network (chk/<remark>/checkPoints/netH_epoch_<n>.pth)")
    if image_shape[0] != 3:
        raise ConfigError(f"{where} is the official 3-channel injection network; this dataset's images have "
                          f"{image_shape[0]} channel(s): drop attack.resource and let the attack train its own")
    try:
        state = torch_load(file, map_location="cpu")
    except Exception as exc:  # a truncated zip, a pickled object, ...: torch raises many types
        first = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else type(exc).__name__
        raise DataError(f"{where} cannot be read as a plain state dict ({first})") from exc
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise DataError(f"{where} holds {type(state).__name__}, not a state dict of tensors (the official netH_epoch_<n>.pth)")
    state = {key.removeprefix("module."): value for key, value in state.items()}
    expected = InjectionUNet(6, 3, OFFICIAL_WIDTH, OFFICIAL_DEPTH).state_dict()
    wrong = sorted(set(expected) ^ set(state)) or [k for k in expected if tuple(expected[k].shape) != tuple(state[k].shape)]
    if wrong:
        raise DataError(f"{where} is not the official injection UNet (6 -> 3 channels, width 64, 4 levels): "
                        f"{len(wrong)} tensor(s) differ, first {wrong[0]!r}")
    return state


class PoisonInk(SurrogateCrafted, Attack):
    """Poison Ink (Zhang, Chen, Huang, Liao, Zhang, Feng, Hua, Yu, "Poison Ink: Robust and Invisible
    Backdoor Attack", IEEE TIP 2022; official code ZJZAC/Poison-Ink, `trigger_generation/`; BackdoorBench's
    retraining scripts resource/poison_ink/).

    The trigger of an image is its own edge map (the Sobel magnitude of its 0-255 luma above 28, as
    the official code; `detector=canny`: scikit-image's Canny) filled with a colour (`colour`, 0-255
    levels, on a white background): the coloured edge map. An injection network (the official
    U-Net, 6 -> 3 channels) takes the image and that map and returns the poisoned image, trained
    jointly with an extraction network (the official dilated residual net) that recovers the map
    from the poisoned image after an interference layer (a random 7/8 crop resized back, a random
    flip, `stages`), and a white image from a clean one. The loss (the official weights): 10^4 x
    the image's mean squared (or absolute, `image_loss`) error, plus 10^4 x the extraction's error
    on the edge pixels (x `edge_weight` 13) and off them, plus 100 x 10^4 x its error on clean
    images (`clean_weight`), the extraction terms x `extract_weight` (official `--beta` 1). Adam (lr 2e-4, betas 0.5, 0.999) for `epochs` per stage, the lr x 0.1
    every 80 epochs, batches of 32, each training image with a random colour of {40, ..., 200}^3.
    Poisoning: `poison_rate` of the training set, drawn from every class, replaced by their injected
    images (8-bit) and relabelled by the target rule (all2one or all2all); at test time the same
    network injects the same colour.

    The networks are trained once per training set and setting and kept in the run's cache
    (`<cache_dir>/networks/poison_ink/<key>.pt`, the key a hash of the training images, every value that
    shapes the networks, the seed and the device type), resumed from their last epoch when a run is
    killed; the record says how long they took, the images they passed forward and backward, and their
    final losses, and a run from the cache adds that cost to its `attack_cost` (`prepare_cost`). `resource` takes
    BackdoorBench's trained injection network (netH_epoch_<n>.pth) instead.

    Departures (docs/fidelity.md#poison-ink): the edge maps of a batch are computed in torch (the
    Sobel of scikit-image's `filters.sobel`, tested equal); grayscale images take a 1 + 3-channel
    input and a 1-channel output (the official network is for colour images: the colour stays a
    three-number code); the adversarial discriminator and VGG loss of the paper's last stage are
    left out, as BackdoorBench leaves that stage out (its README: with it the attack did not plant);
    the interference's crop is 7/8 of the side (the official 28 of 32) on any image size, drawn
    from the attack's seeded stream; BackdoorBench's victim trains on the clean set with a poisoned
    batch added to every batch, ours on the poisoned set (the poisoned images replace their clean
    ones), as every data-poisoning attack here.
    """

    name = "poison_ink"
    family = "generative"
    aliases = ("poisonink",)
    learned_trigger = True

    def __init__(
        self,
        *,
        resource: str | None = None,
        colour: list[int] | tuple[int, int, int] = (80, 160, 80),
        detector: str = "sobel",
        threshold: float = 28.0,
        canny_sigma: float = 1.0,
        stages: list[list[str]] | None = None,
        epochs: int = 200,
        train_images: int | None = None,
        batch_size: int = 32,
        lr: float = 2e-4,
        beta1: float = 0.5,
        lr_step: int = 80,
        width: int = 64,
        depth: int = 4,
        extractor_width: int = 128,
        extractor_blocks: int = 7,
        edge_weight: float = 13.0,
        clean_weight: float = 100.0,
        extract_weight: float = 1.0,
        image_loss: str = "mse",
        crop: float = 0.875,
        **common,
    ) -> None:
        super().__init__(**common)
        channels, height, wide = self.image_shape
        if not checks.is_list(colour) or len(colour) != 3 or not all(checks.is_integer(c) and 0 <= c <= 255 for c in colour):
            raise ConfigError(f"attack.colour={colour!r} is invalid; use three 0-255 levels [R, G, B], e.g. [80, 160, 80]")
        self.colour = [int(c) for c in colour]
        if detector not in DETECTORS:
            raise ConfigError(f"attack.detector={detector!r} is invalid; use one of {', '.join(DETECTORS)}")
        self.detector = detector
        self.threshold = checks.number("attack", "threshold", threshold, 0, 255 * 2, low_open=True,
                                       hint="the Sobel magnitude of the 0-255 luma, official 28")
        self.canny_sigma = checks.number("attack", "canny_sigma", canny_sigma, 0, low_open=True)
        stages = [[], ["crop"], ["flip"]] if stages is None else stages
        if not checks.is_list(stages) or not stages or not all(checks.is_list(s) and set(s) <= set(INTERFERENCES) for s in stages):
            raise ConfigError(f"attack.stages={stages!r} is invalid; use a non-empty list of lists of {', '.join(INTERFERENCES)}, "
                              "e.g. [[], [crop], [flip]]")
        self.stages = [sorted(set(str(k) for k in s)) for s in stages]
        self.epochs = checks.integer("attack", "epochs", epochs, 1, hint="per stage")
        self.train_images = checks.integer("attack", "train_images", train_images, 1, allow_none=True,
                                           hint="null = every training image (official)")
        self.batch_size = checks.integer("attack", "batch_size", batch_size, 1)
        self.lr = checks.number("attack", "lr", lr, 0, low_open=True)
        self.beta1 = checks.number("attack", "beta1", beta1, 0, 1, hint="Adam's first beta, in [0, 1)")
        if self.beta1 >= 1:
            raise ConfigError(f"attack.beta1={beta1} is invalid; use a number in [0, 1)")
        self.lr_step = checks.integer("attack", "lr_step", lr_step, 1)
        self.width = checks.integer("attack", "width", width, 1)
        largest = max(0, min(height, wide).bit_length() - 1)  # 2^depth must fit in the image's side
        self.depth = checks.integer("attack", "depth", depth, 1, largest, hint=f"the U-Net's halvings; 2^depth <= {min(height, wide)} px")
        self.extractor_width = checks.integer("attack", "extractor_width", extractor_width, 1)
        self.extractor_blocks = checks.integer("attack", "extractor_blocks", extractor_blocks, 0, 7,
                                               hint="the official 7 residual blocks, dilations 2, 2, 2, 4, 4, 4, 1; fewer keep the first")
        self.edge_weight = checks.number("attack", "edge_weight", edge_weight, 0)
        self.clean_weight = checks.number("attack", "clean_weight", clean_weight, 0)
        self.extract_weight = checks.number("attack", "extract_weight", extract_weight, 0, low_open=True,
                                            hint="the extraction term's weight against the image term, official --beta 1")
        if image_loss not in IMAGE_LOSSES:
            raise ConfigError(f"attack.image_loss={image_loss!r} is invalid; use one of {', '.join(IMAGE_LOSSES)}")
        self.image_loss = image_loss
        self.crop = checks.number("attack", "crop", crop, 0, 1, low_open=True, hint="the crop's side over the image's, official 28/32")
        if resource is not None and not isinstance(resource, str):
            raise ConfigError(f"attack.resource={resource!r} is invalid; use the path of a netH_epoch_<n>.pth file or null")
        self.resource = resource
        self.injection: nn.Module | None = None
        self.stats: dict[str, Any] = {}
        self._surrogate_history: list[dict[str, Any]] = []
        if resource is not None:  # read now: a wrong file is refused before any data loads
            state = load_resource(resource, self.image_shape)
            self.width, self.depth = OFFICIAL_WIDTH, OFFICIAL_DEPTH
            self.injection = self.build_injection()
            self.injection.load_state_dict(state)
            self.injection.eval()
            self.stats = {"networks": "resource", "resource_sha256": file_sha256(resource)}
        self._channels = channels

    # --- the networks -------------------------------------------------------------------------
    def build_injection(self) -> nn.Module:
        return InjectionUNet(self.image_shape[0] + 3, self.image_shape[0], self.width, self.depth)

    def build_extraction(self) -> nn.Module:
        from backdoorbench.attacks.poison_ink_nets import OFFICIAL_DILATIONS

        return ExtractionNet(self.image_shape[0], 3, self.extractor_width, OFFICIAL_DILATIONS[: self.extractor_blocks])

    def edges(self, x: Tensor) -> Tensor:
        return edge_mask(x, detector=self.detector, threshold=self.threshold, sigma=self.canny_sigma)

    def network_config(self) -> dict[str, Any]:
        """Every value that shapes the networks (the cache key hashes it)."""
        return {"detector": self.detector, "threshold": self.threshold, "canny_sigma": self.canny_sigma,
                "stages": self.stages, "epochs": self.epochs, "train_images": self.train_images, "batch_size": self.batch_size, "lr": self.lr,
                "beta1": self.beta1, "lr_step": self.lr_step, "width": self.width, "depth": self.depth,
                "extractor_width": self.extractor_width, "extractor_blocks": self.extractor_blocks,
                "edge_weight": self.edge_weight, "clean_weight": self.clean_weight, "extract_weight": self.extract_weight,
                "image_loss": self.image_loss,
                "crop": self.crop, "image_shape": list(self.image_shape)}

    # --- the trigger ------------------------------------------------------------------------------
    def inject(self, x: Tensor, colours: Tensor, network: nn.Module | None = None) -> Tensor:
        """The injection network's image for `x` (B, C, H, W) in [0, 1] with per-image `colours` (B, 3),
        unclamped (the training loss reads it so)."""
        network = network if network is not None else self.injection
        mark = watermark(self.edges(x), colours.to(x.device))
        return network(torch.cat([x, mark.to(x.dtype)], 1))

    @torch.no_grad()
    def apply_trigger(self, x: Tensor) -> Tensor:
        if self.injection is None:
            raise RuntimeError("poison_ink: the injection network is not trained yet; call prepare() or load_state_dict() first")
        network = self.injection.to(x.device).eval()
        colours = torch.tensor(self.colour, dtype=torch.float32).expand(len(x), 3)
        out = self.inject(x.float(), colours, network).clamp(0.0, 1.0)
        return to_float(to_uint8(out)).to(x.dtype)  # 8 bits, as the official stego images are saved

    # --- training -------------------------------------------------------------------------------
    def prepare(self, *, trainer, train: Split, generator: torch.Generator, build_model: Callable[..., nn.Module]) -> None:
        """The injection and extraction networks: from the run's network cache (`bind_run`) where this training
        set and setting trained them before, else trained here (resumed from the cache's partial file
        after a killed run) and cached. Nothing to do with a `resource` file."""
        self.poison_count(train.labels)  # a rate that can't be met fails now, not after the training
        if self.resource is not None:
            return
        seed = int(torch.randint(0, 2 ** 62, (1,), generator=generator))
        key = self.network_key(train, seed, trainer.device)
        folder = self.network_folder()
        entry = folder / f"{key}.pt" if folder is not None else None
        if entry is not None and entry.exists():
            try:
                state = torch_load(entry, map_location="cpu")
                if state.get("format") != NETWORKS_FORMAT:
                    raise DataError("not a poison_ink networks file")
                self.injection = self.build_injection()
                self.injection.load_state_dict(state["injection"])
                self.injection.eval()
                self.stats = {**state["stats"], "networks": "cache_hit", "networks_key": key, "networks_path": str(entry)}
                # what training them cost, recorded then (the record's attack_cost adds it; None in older entries)
                self.stats["prepare_cost"] = {"cached": True, "seconds": self.stats.get("networks_s"),
                                              "forward_images": self.stats.get("network_forward_images"),
                                              "backward_images": self.stats.get("network_backward_images")}
                log.info("poison_ink: networks %s from the cache (%s); they took %.1f s to train", key, entry,
                         self.stats.get("networks_s", float("nan")))
                return
            except Exception as exc:  # a corrupt or foreign entry is trained over, said once
                log.warning("poison_ink: cached networks %s unreadable (%s); training them again", entry, exc)
        partial = folder / f"{key}.partial.pt" if folder is not None else None
        injection, extraction, stats = self.train_networks(train.images, seed=seed, device=trainer.device, partial=partial)
        self.injection = injection.cpu().eval()
        self.stats = {**stats, "networks": "trained" if entry is None else "cache_miss", "networks_key": key}
        if entry is not None and distributed.is_main():
            atomic_torch_save({"format": NETWORKS_FORMAT, "key": key, "config": self.network_config(),
                               "injection": dict(injection.cpu().state_dict()),
                               "extraction": dict(extraction.cpu().state_dict()), "stats": stats}, entry)
            partial.unlink(missing_ok=True)
            self.stats["networks_path"] = str(entry)

    def network_key(self, train: Split, seed: int, device: torch.device | str) -> str:
        images = hashlib.sha256(train.images.contiguous().numpy().tobytes()).hexdigest()
        material = {"version": NETWORKS_VERSION, "config": self.network_config(), "images": images,
                    "n": len(train), "seed": seed, "device_type": torch.device(device).type, "torch": torch.__version__}
        return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:20]

    def interfere(self, container: Tensor, cover: Tensor, kinds: list[str], generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """The official interference layer on a batch: with `crop`, half the time a random crop of
        `crop` x the side (one place per batch); with `flip`, half the time a horizontal flip; then
        both resized back bilinearly to the image's size."""
        height, width = cover.shape[-2:]
        coin = lambda: bool(torch.randint(0, 2, (1,), generator=generator))  # noqa: E731
        if "crop" in kinds and coin():
            h, w = max(1, round(self.crop * height)), max(1, round(self.crop * width))
        else:
            h, w = height, width
        top = int(torch.randint(0, height - h + 1, (1,), generator=generator))
        left = int(torch.randint(0, width - w + 1, (1,), generator=generator))
        container, cover = container[..., top:top + h, left:left + w], cover[..., top:top + h, left:left + w]
        if "flip" in kinds and coin():
            container, cover = container.flip(-1), cover.flip(-1)
        resize = lambda v: F.interpolate(v, size=(height, width), mode="bilinear", align_corners=False)  # noqa: E731
        return resize(container), resize(cover)

    def losses(self, injection: nn.Module, extraction: nn.Module, cover: Tensor, colours: Tensor,
               kinds: list[str], generator: torch.Generator) -> dict[str, Tensor]:
        """The official objective on one batch (IN_GE.py `train`): the image term, the extraction's
        error on the interfered poisoned image (edge pixels weighted `edge_weight`) and on the
        interfered clean image (a white image wanted, weighted `clean_weight`)."""
        container = self.inject(cover, colours, injection)
        error = F.mse_loss if self.image_loss == "mse" else F.l1_loss
        image = LOSS_SCALE * error(container, cover)
        container_t, cover_t = self.interfere(container, cover, kinds, generator)
        mask = self.edges(cover_t).expand(-1, 3, -1, -1)
        wanted = watermark(mask[:, :1], colours)
        revealed = extraction(container_t)
        edge = LOSS_SCALE * F.mse_loss(revealed * mask, wanted * mask)
        back = LOSS_SCALE * F.mse_loss(revealed * (1 - mask), wanted * (1 - mask))
        clean = LOSS_SCALE * F.mse_loss(extraction(cover_t), torch.ones_like(wanted))
        extract = self.edge_weight * edge + back + self.clean_weight * clean
        return {"loss": image + self.extract_weight * extract, "image": image, "extract": extract, "edge": edge, "back": back, "clean": clean}

    def train_networks(self, images: Tensor, *, seed: int, device: torch.device | str,
                       partial: Path | None = None) -> tuple[nn.Module, nn.Module, dict[str, Any]]:
        """Train the two networks on `images` (N, C, H, W) uint8 for `epochs` per stage; a fresh Adam
        and step schedule per stage (BackdoorBench runs train.py once per stage, loading the last
        weights). Saved to `partial` after every epoch and resumed from it."""
        generator = torch.Generator().manual_seed(seed)
        if self.train_images is not None and self.train_images < len(images):  # a seeded subset, the same every epoch
            images = images[torch.randperm(len(images), generator=generator)[: self.train_images].sort().values]
        with torch.random.fork_rng(devices=[]):  # the run's global draws stay as without the networks
            torch.manual_seed(seed)
            injection, extraction = self.build_injection().to(device), self.build_extraction().to(device)
        total = len(self.stages) * self.epochs
        done, seconds, history, passes = 0, 0.0, [], CallCounter()  # images through the two networks
        state = torch_load(partial, map_location="cpu") if partial is not None and partial.exists() else None
        if state is not None:
            injection.load_state_dict(state["injection"])
            extraction.load_state_dict(state["extraction"])
            generator.set_state(state["generator"])
            done, seconds, history = int(state["done"]), float(state["seconds"]), list(state["history"])
            passes.add(forward_images=int(state.get("forward_images", 0)), backward_images=int(state.get("backward_images", 0)))
            log.info("poison_ink: networks resumed from %s after %d of %d epochs", partial, done, total)
        optimizers = None
        started = time.perf_counter()
        for step in track(range(done, total), "poison_ink: injection and extraction networks", total=total, unit="epochs"):
            stage, epoch = divmod(step, self.epochs)
            if optimizers is None or epoch == 0:
                optimizers = [torch.optim.Adam(net.parameters(), lr=self.lr, betas=(self.beta1, 0.999))
                              for net in (injection, extraction)]
                schedulers = [torch.optim.lr_scheduler.StepLR(opt, self.lr_step, gamma=0.1) for opt in optimizers]
                if state is not None and "optimizers" in state and state["stage"] == stage:
                    for opt, saved in zip(optimizers, state["optimizers"]):
                        opt.load_state_dict(saved)
                    for sched, saved in zip(schedulers, state["schedulers"]):
                        sched.load_state_dict(saved)
            injection.train()
            extraction.train()
            sums: dict[str, float] = {}
            order = torch.randperm(len(images), generator=generator)
            for start in range(0, len(order), self.batch_size):
                rows = order[start:start + self.batch_size]
                cover = to_float(images[rows]).to(device)
                colours = (torch.randint(1, 6, (len(rows), 3), generator=generator) * 40).float().to(device)
                with passes.counting():
                    terms = self.losses(injection, extraction, cover, colours, self.stages[stage], generator)
                    for opt in optimizers:
                        opt.zero_grad(set_to_none=True)
                    terms["loss"].backward()
                for opt in optimizers:
                    opt.step()
                for name, value in terms.items():
                    sums[name] = sums.get(name, 0.0) + float(value.detach()) * len(rows)
            for sched in schedulers:
                sched.step()
            row = {"stage": stage, "epoch": epoch, **{name: round(value / len(images), 4) for name, value in sums.items()}}
            history.append(row)
            log.info("poison_ink: stage %d epoch %d: loss %.2f (image %.2f, extraction %.2f)", stage, epoch,
                     row["loss"], row["image"], row["extract"])
            if partial is not None and distributed.is_main():
                atomic_torch_save({"injection": dict(injection.state_dict()), "extraction": dict(extraction.state_dict()),
                                   "generator": generator.get_state(), "done": step + 1, "stage": stage,
                                   "seconds": seconds + time.perf_counter() - started, "history": history,
                                   "forward_images": passes.forward_images, "backward_images": passes.backward_images,
                                   "optimizers": [opt.state_dict() for opt in optimizers],
                                   "schedulers": [sched.state_dict() for sched in schedulers]}, partial)
        seconds += time.perf_counter() - started
        final = history[-1] if history else {}
        stats = {"networks_s": round(seconds, 2), "network_epochs": len(history),
                 "network_forward_images": passes.forward_images, "network_backward_images": passes.backward_images,
                 "final_losses": {k: final[k] for k in ("loss", "image", "extract", "edge", "back", "clean") if k in final}}
        injection.eval()
        extraction.eval()
        return injection, extraction, stats

    # --- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self.injection is None:
            return {}
        return {"injection": dict(self.injection.state_dict()), "width": self.width, "depth": self.depth}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "injection" not in state:
            raise DataError("poison_ink state holds no injection network")
        self.width, self.depth = int(state.get("width", self.width)), int(state.get("depth", self.depth))
        network = self.build_injection()
        try:
            network.load_state_dict(state["injection"])
        except RuntimeError as exc:
            raise DataError(f"poison_ink state's injection network does not fit this setting ({str(exc).splitlines()[0][:120]})") from exc
        self.injection = network.eval()

    def describe(self) -> dict:
        return {**super().describe(), "resource": self.resource, "colour": self.colour, **self.network_config(),
                **self.stats}
