"""SSBA: an invisible, sample-specific trigger: a fixed code hidden in each image by a StegaStamp encoder."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from backdoorbench import checks
from backdoorbench.attacks.base import Attack
from backdoorbench.attacks.stegastamp import StegaStampDecoder, StegaStampEncoder
from backdoorbench.datasets.base import Split, to_float, to_uint8
from backdoorbench.errors import ConfigError, DataError
from backdoorbench.fileio import atomic_torch_save, torch_load
from backdoorbench.progress import track
from backdoorbench.train.passes import CallCounter

log = logging.getLogger(__name__)

NETWORK_FORMAT = "backdoorbench.ssba_networks.v2"  # bump when what the networks are or how they train changes
CODE_CHARS = 7  # the official code: the secret padded with spaces to 7 characters (56 bits) for a 100-bit code
CHECK_IMAGES = 512  # training images the decoder's bit accuracy on the attack's code is measured on


BCH_PRIMITIVE = 137  # generate_fingerprints.py: BCH_POLYNOMIAL 137 = x^7 + x^3 + 1, codes of 127 bits
BCH_LAYOUT = {100: (7, 5), 50: (4, 2)}  # code bits -> (characters of the padded secret, errors corrected)


def _gf2_mul(a: int, b: int) -> int:
    """Product of two GF(2) polynomials held as integers (bit k = the x^k coefficient)."""
    out = 0
    while b:
        if b & 1:
            out ^= a
        a, b = a << 1, b >> 1
    return out


def bch_generator(t: int, m: int = 7, primitive: int = BCH_PRIMITIVE) -> int:
    """The generator polynomial of the binary BCH code of length 2^m - 1 correcting t errors:
    the product of the distinct minimal polynomials of alpha^1, alpha^3, ..., alpha^(2t - 1) over
    GF(2^m) built on `primitive` (what the Linux kernel's bch library, bchlib, encodes with)."""
    n = (1 << m) - 1
    exp, log, x = [0] * n, [0] * (n + 1), 1
    for i in range(n):
        exp[i], log[x] = x, i
        x <<= 1
        if x >> m:
            x ^= primitive
    generator, seen = 1, set()
    for i in range(1, 2 * t, 2):
        if i in seen:
            continue
        coset, j = [], i
        while j not in coset:
            coset.append(j)
            j = 2 * j % n
        seen.update(coset)
        poly = [1]  # prod (x + alpha^j), coefficients in GF(2^m), lowest degree first
        for j in coset:
            nxt = [0] * (len(poly) + 1)
            for k, c in enumerate(poly):
                nxt[k + 1] ^= c
                if c:
                    nxt[k] ^= exp[(log[c] + j) % n]
            poly = nxt
        generator = _gf2_mul(generator, sum(c << k for k, c in enumerate(poly)))  # coefficients are 0/1
    return generator


def bch_parity(data: bytes, t: int) -> bytes:
    """bchlib's BCH(prim_poly=137, t).encode(data): the remainder of data(x) * x^deg(g) by the
    generator, most significant bit first, padded with zero bits to whole bytes."""
    generator = bch_generator(t)
    degree = generator.bit_length() - 1
    mask = (1 << degree) - 1
    rem = 0
    for byte in data:
        for k in range(7, -1, -1):
            top = ((rem >> (degree - 1)) & 1) ^ ((byte >> k) & 1)
            rem = (rem << 1) & mask
            if top:
                rem ^= generator & mask
    size = -(-degree // 8)
    return (rem << (8 * size - degree)).to_bytes(size, "big")


def code_of(secret: str, bits: int) -> Tensor:
    """The attacker's code (bits,) in {0, 1}, as BackdoorBench's generate_fingerprints_from_bch
    makes it: at 100 bits the secret's UTF-8 bytes padded with spaces to 7 characters, their 40 bits
    of BCH(t=5) parity, 4 zero bits; at 50 bits 4 characters, 16 bits of BCH(t=2) parity, 2 zero
    bits; most significant bit first. Other lengths (no official code) take the padded string
    (bits // 8 characters, at most 7) and zeros."""
    if bits in BCH_LAYOUT:
        chars, t = BCH_LAYOUT[bits]
    else:
        chars, t = min(CODE_CHARS, bits // 8), 0
    data = secret.encode("utf-8")
    data = data + b" " * (chars - len(data))
    if t:
        data = data + bch_parity(data, t)
    stream = [int(bit) for byte in data for bit in format(byte, "08b")]
    return torch.tensor(stream + [0] * (bits - len(stream)), dtype=torch.float32)


def resource_files(path: str, dataset: str | None) -> tuple[Path, Path]:
    """BackdoorBench's pair of pre-made poisoned sets (attack/ssba.py's defaults
    resource/ssba/<dataset>_ssba_{train,test}_b1.npy): a folder holding them, or the train file
    (its test file is the one named with `test` for the last `train`)."""
    where = f"attack.resource={path!r}"
    given = Path(path).expanduser()
    if not given.exists():
        raise ConfigError(f"{where} does not exist; give BackdoorBench's resource/ssba folder or its "
                          "<dataset>_ssba_train_b1.npy")
    if given.is_dir():
        if dataset is None:
            raise ConfigError(f"{where} is a folder but the dataset is not known; give the train .npy file")
        train = given / f"{dataset}_ssba_train_b1.npy"
    else:
        train = given
    if train.suffix != ".npy" or "train" not in train.name:
        raise ConfigError(f"{where} is not a folder or a *train*.npy file; give BackdoorBench's resource/ssba folder "
                          "or its <dataset>_ssba_train_b1.npy")
    head, _, tail = train.name.rpartition("train")
    test = train.with_name(f"{head}test{tail}")
    for file in (train, test):
        if not file.is_file():
            raise ConfigError(f"{where}: {str(file)!r} does not exist; BackdoorBench's SSBA needs both "
                              "<dataset>_ssba_train_b1.npy and <dataset>_ssba_test_b1.npy")
    return train, test


def load_replacements(file: Path, image_shape: tuple[int, int, int]) -> np.ndarray:
    """One pre-made set as BackdoorBench reads it (np.load, then each image clipped to 0-255 and
    cast to uint8 by npClipAndToUint8): (N, H, W, C), or (N, H, W) for one channel, read without
    unpickling; returned as uint8 (N, C, H, W). Every refusal is one line."""
    channels, height, width = image_shape
    where = f"attack.resource file {str(file)!r}"
    try:
        array = np.load(file, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        reason = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else type(exc).__name__
        raise DataError(f"{where} cannot be read as a plain numpy array ({reason})") from exc
    if array.ndim == 3 and channels == 1:
        array = array[..., None]
    if array.ndim != 4 or tuple(array.shape[1:]) != (height, width, channels):
        raise DataError(f"{where} has shape {tuple(array.shape)}; expected (N, {height}, {width}, {channels}) "
                        "(N images, H, W, C: the dataset's)" + (f" or (N, {height}, {width})" if channels == 1 else ""))
    if array.dtype.kind not in "uif":
        raise DataError(f"{where} holds {array.dtype} values; expected 0-255 image levels")
    values = np.asarray(array)
    if values.dtype != np.uint8:
        values = np.clip(values, 0, 255).astype(np.uint8)  # npClipAndToUint8
    return np.ascontiguousarray(values.transpose(0, 3, 1, 2))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class SSBA(Attack):
    """SSBA (Li, Li, Wu, Li, He, Lyu, "Invisible Backdoor Attack with Sample-Specific Triggers",
    ICCV 2021; official code SCLBD/ISSBA, its encoder StegaStamp, tancik/StegaStamp).

    A StegaStamp encoder hides a fixed code (the attacker's string `secret`, 'a' as the official
    encode_image.py, as `code_bits` bits) in each image; the trigger is the encoded image, so the
    change it makes (encoded minus clean) differs from image to image and is invisible. The
    encoder and its decoder are trained jointly on the clean training images with random codes
    (BackdoorBench's resource/ssba/train.py): Adam (`lr`) on both, the decoder's binary
    cross-entropy on the code plus an image L2 term whose weight stays 0 until the decoder reads
    0.9 of the bits of a batch, then waits `l2_await` steps and ramps to `l2_weight` over
    `l2_ramp` steps; `epochs` passes in batches of `batch_size` (`lr_drop`: the share of the last
    steps run at lr / 10, 0 as the official). Dirty-label: `poison_rate` of the
    training set, drawn from every class, encoded and relabelled by the target rule (all2one or
    all2all); the same encoder makes the test-time trigger.

    The networks are cached content-hashed in the run's cache folder (`networks/ssba/<key>.pt`, the
    key hashing the training images, the image shape, every training value, the seed drawn for them,
    the device type and the code version), so all2one and all2all, and every defense, share them;
    a killed training resumes from its last epoch (`<key>.partial.pt`). The record says the seconds,
    the final losses, the images through the two networks forward and backward, and the decoder's bit
    accuracy on the attack's code (`networks`); a run from the cache adds what the training cost to
    its `attack_cost` (`prepare_cost`).

    `resource` takes BackdoorBench's pre-made poisoned sets instead (resource/ssba/
    <dataset>_ssba_{train,test}_b1.npy, each the poisoned version of every image of the split, in
    the split's order, as BackdoorBench's SSBA_attack_replace_version reads them by index): the
    trigger of an image is its pre-made row, found by the clean image's content.

    Departures (docs/fidelity.md#ssba): the encoder is BackdoorBench's reduced recipe (image L2 and
    code BCE: no LPIPS, no critic, no perturbation layers, as its resource/ssba/train.py), not the
    paper's TensorFlow StegaStamp with LPIPS and a WGAN critic at 400 px; sizes that are not a multiple of 16 px are handled as
    backdoorbench/attacks/stegastamp.py says; the encoder is trained on the run's own training split
    (BackdoorBench: the same split, written out as image files). The quick protocol on mnist5k
    trains a cut of the recipe (the residual encoder, width 16, a 32-bit code, 24 epochs at Adam
    1e-3, the last quarter at 1e-4, L2 waiting 100 and ramping over 300 steps): BackdoorBench's own
    values stay on StegaStamp's plateau (code loss at log 2) in a CPU budget.
    """

    name = "ssba"
    family = "invisible"
    aliases = ("issba", "sample_specific")
    learned_trigger = True

    def __init__(
        self,
        *,
        resource: str | None = None,
        secret: str = "a",
        code_bits: int = 100,
        residual: bool = False,
        epochs: int = 20,
        batch_size: int = 64,
        lr: float = 1.0e-4,
        l2_weight: float = 10.0,
        l2_await: int = 1000,
        l2_ramp: int = 3000,
        lr_drop: float = 0.0,
        width: int = 32,
        **common,
    ) -> None:
        super().__init__(**common)
        self.code_bits = checks.integer("attack", "code_bits", code_bits, 8, hint="bits of the hidden code (official 100)")
        if not isinstance(secret, str) or not secret:
            raise ConfigError(f"attack.secret={secret!r} is invalid; use a non-empty string (official 'a')")
        room = BCH_LAYOUT[self.code_bits][0] if self.code_bits in BCH_LAYOUT else min(CODE_CHARS, self.code_bits // 8)
        if len(secret.encode("utf-8")) > room:
            raise ConfigError(f"attack.secret={secret!r} takes {len(secret.encode('utf-8'))} bytes; a {self.code_bits}-bit "
                              f"code holds {room} (use a shorter secret or more attack.code_bits)")
        self.secret = secret
        if not isinstance(residual, bool):
            raise ConfigError(f"attack.residual={residual!r} is invalid; use true (encoder output added to the image) "
                              "or false (the encoded image itself, BackdoorBench's use_residual 0)")
        self.residual = residual
        self.epochs = checks.integer("attack", "epochs", epochs, 1, hint="the encoder/decoder's passes (official 20)")
        self.batch_size = checks.integer("attack", "batch_size", batch_size, 1)
        self.lr = checks.number("attack", "lr", lr, 0, low_open=True, hint="Adam's, on the encoder and decoder")
        self.l2_weight = checks.number("attack", "l2_weight", l2_weight, 0)
        self.l2_await = checks.integer("attack", "l2_await", l2_await, 0)
        self.l2_ramp = checks.integer("attack", "l2_ramp", l2_ramp, 1)
        self.lr_drop = checks.number("attack", "lr_drop", lr_drop, 0, 1, high_open=True,
                                     hint="the share of the last steps run at lr / 10 (official 0: constant lr)")
        self.width = checks.integer("attack", "width", width, 1, hint="the networks' first width (official 32)")
        if resource is not None and not isinstance(resource, str):
            raise ConfigError(f"attack.resource={resource!r} is invalid; use BackdoorBench's resource/ssba folder or null")
        self.resource = resource
        self.code = code_of(secret, self.code_bits)
        self.encoder: StegaStampEncoder | None = None
        self.stats: dict[str, Any] = {}
        self._replacements: dict[str, np.ndarray] = {}
        self._lookup: dict[bytes, tuple[str, int]] | None = None
        if resource is not None:  # read now: a wrong file is refused before any data loads
            files = resource_files(resource, self.dataset)
            self._replacements = {split: load_replacements(file, self.image_shape) for split, file in zip(("train", "test"), files)}
            self.stats = {"networks": {"source": "resource",
                                       "resource_sha256": {s: _sha256(Path(f).read_bytes()) for s, f in zip(("train", "test"), files)}}}

    # --- the run's data and cache ---------------------------------------------------------------
    def bind_run(self, *, data, network_cache: Path | None) -> None:
        super().bind_run(data=data, network_cache=network_cache)
        if self.resource is None:
            return
        lookup: dict[bytes, tuple[str, int]] = {}
        for split_name, split in (("train", data.train), ("test", data.test)):
            made = self._replacements[split_name]
            if len(made) != len(split):
                raise DataError(f"attack.resource: the {split_name} file has {len(made)} images, dataset {data.name} "
                                f"{len(split)}; give the files made from this dataset's {split_name} split")
            for row, image in enumerate(split.images):
                lookup.setdefault(image.numpy().tobytes(), (split_name, row))
        self._lookup = lookup

    # --- trigger ----------------------------------------------------------------------------------
    def apply_trigger(self, x: Tensor) -> Tensor:
        if self.resource is not None:
            return self._premade(x)
        if self.encoder is None:
            raise RuntimeError("ssba: the encoder is not trained yet; call prepare() or load_state_dict() first")
        encoder = self.encoder.to(x.device)
        out = []
        with torch.no_grad():
            for chunk in x.float().split(256):
                code = self.code.to(chunk.device).expand(len(chunk), -1)
                out.append(encoder(code, chunk).clamp(0.0, 1.0))
        return torch.cat(out).to(x.dtype)

    def _premade(self, x: Tensor) -> Tensor:
        if self._lookup is None:
            raise RuntimeError("ssba: the resource's images are not matched to the dataset yet (bind_run)")
        rows = []
        for image in to_uint8(x.detach().cpu()):
            found = self._lookup.get(image.numpy().tobytes())
            if found is None:
                raise DataError("ssba: an image to poison is not one of the dataset's, so attack.resource has no "
                                "pre-made version of it (BackdoorBench's files poison the dataset's images only)")
            rows.append(torch.from_numpy(self._replacements[found[0]][found[1]].copy()))
        return to_float(torch.stack(rows)).to(x.device, x.dtype)

    # --- the encoder and decoder -------------------------------------------------------------------
    def _training_values(self) -> dict[str, Any]:
        return {"code_bits": self.code_bits, "residual": self.residual, "epochs": self.epochs,
                "batch_size": self.batch_size, "lr": self.lr, "l2_weight": self.l2_weight,
                "l2_await": self.l2_await, "l2_ramp": self.l2_ramp, "lr_drop": self.lr_drop, "width": self.width}

    def network_key(self, train: Split, seed: int, device: torch.device) -> str:
        material = {"format": NETWORK_FORMAT, "image_shape": list(self.image_shape),
                    "images_sha256": _sha256(train.images.contiguous().numpy().tobytes()), "seed": seed,
                    "device_type": torch.device(device).type, "torch": torch.__version__, **self._training_values()}
        return _sha256(json.dumps(material, sort_keys=True).encode())[:20]

    def prepare(self, *, trainer, train: Split, generator: torch.Generator, build_model) -> None:
        """The encoder and decoder: from the network cache, else trained (resuming a killed
        training) and cached. One seed is drawn from `generator` either way, so a cache hit leaves
        the run's streams as a training does. Nothing to do with a `resource`."""
        self.poison_count(train.labels)  # a rate that can't be met fails now, not after the training
        if self.resource is not None:
            return
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        device = torch.device(getattr(trainer, "device", "cpu"))
        key = self.network_key(train, seed, device)
        folder = self.network_folder()
        path = folder / f"{key}.pt" if folder is not None else None
        if path is not None and path.exists():
            try:
                entry = torch_load(path, map_location="cpu")
                if not isinstance(entry, dict) or entry.get("format") != NETWORK_FORMAT or entry.get("key") != key:
                    raise ValueError("not this attack's networks")
                self._load_encoder(entry["encoder"])
                self.stats = {"networks": {**entry["stats"], "cache": "hit", "key": key, "path": str(path)}}
                # what training them cost, recorded then (the record's attack_cost adds it; None in older entries)
                self.stats["prepare_cost"] = {"cached": True, "seconds": entry["stats"].get("seconds"),
                                              "forward_images": entry["stats"].get("forward_images"),
                                              "backward_images": entry["stats"].get("backward_images")}
                log.info("ssba: encoder/decoder %s from the cache (%s)", key, path)
                return
            except Exception as exc:  # a truncated or foreign file: train over it
                log.warning("ssba: cached networks %s are unusable (%s); training them again", path, type(exc).__name__)
        encoder, stats = self.train_networks(train, seed, device, partial=folder / f"{key}.partial.pt" if folder else None)
        self.encoder = encoder
        self.stats = {"networks": {**stats, "cache": "miss" if path else "off", "key": key,
                                   **({"path": str(path)} if path else {})}}
        if path is not None:
            atomic_torch_save({"format": NETWORK_FORMAT, "key": key, "encoder": self._encoder_state(),
                               "stats": stats}, path)
            (folder / f"{key}.partial.pt").unlink(missing_ok=True)

    def train_networks(self, train: Split, seed: int, device: torch.device,
                       partial: Path | None = None) -> tuple[StegaStampEncoder, dict[str, Any]]:
        """BackdoorBench's resource/ssba/train.py on the training images: each step a batch with
        random codes, loss = l2 weight * MSE(encoded, clean) + BCE(decoded logits, codes), Adam on
        both networks. Returns the encoder (eval mode, CPU) and the record's numbers."""
        channels, height, width = self.image_shape
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # the networks' initialisation, apart from the run's global stream
            encoder = StegaStampEncoder(channels, height, width, self.code_bits, self.residual, self.width).to(device)
            decoder = StegaStampDecoder(channels, height, width, self.code_bits, self.width).to(device)
        optimizer = torch.optim.Adam([*decoder.parameters(), *encoder.parameters()], lr=self.lr)
        rng = torch.Generator().manual_seed(seed)
        state = {"epoch": 0, "step": 0, "since_l2": -1, "seconds": 0.0, "bce": None, "l2": None, "bit_acc": None,
                 "forward_images": 0, "backward_images": 0}
        passes = CallCounter()  # images through the encoder and the decoder
        if partial is not None and partial.exists():
            try:
                saved = torch_load(partial, map_location="cpu")
                encoder.load_state_dict(saved["encoder"])
                decoder.load_state_dict(saved["decoder"])
                optimizer.load_state_dict(saved["optimizer"])
                rng.set_state(saved["rng"])
                state = dict(saved["state"])
                passes.add(forward_images=int(state.get("forward_images", 0)),
                           backward_images=int(state.get("backward_images", 0)))
                log.info("ssba: encoder/decoder training resumed after epoch %d", state["epoch"])
            except Exception as exc:
                log.warning("ssba: partial training %s is unusable (%s); starting over", partial, type(exc).__name__)
        per_epoch = -(-len(train) // self.batch_size)
        started = time.perf_counter() - float(state["seconds"])
        encoder.train()
        decoder.train()
        total = self.epochs * per_epoch
        drop_at = total - int(round(self.lr_drop * total))  # the quick cut's last steps at lr / 10
        steps = range(state["epoch"] * per_epoch, total)
        for _ in track(steps, "ssba: encoder/decoder", total=len(steps), unit="steps"):
            if state["step"] % per_epoch == 0:
                order = torch.randperm(len(train), generator=rng)
            rows = order[(state["step"] % per_epoch) * self.batch_size:][: self.batch_size]
            images = to_float(train.images[rows]).to(device)
            codes = torch.randint(0, 2, (len(rows), self.code_bits), generator=rng).float().to(device)
            for group in optimizer.param_groups:
                group["lr"] = self.lr * (0.1 if state["step"] >= drop_at else 1.0)
            l2_weight = min(max(0.0, self.l2_weight * (state["since_l2"] - self.l2_await) / self.l2_ramp), self.l2_weight)
            with passes.counting():
                encoded = encoder(codes, images)
                logits = decoder(encoded)
                l2 = F.mse_loss(encoded, images)
                bce = F.binary_cross_entropy_with_logits(logits.flatten(), codes.flatten())
                loss = l2_weight * l2 + bce
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
            optimizer.step()
            bit_acc = float(((logits > 0).float() == codes).float().mean())
            if state["since_l2"] == -1:
                if bit_acc > 0.9:  # train.py: the L2 term's clock starts once the decoder reads 90% of a batch
                    state["since_l2"] = 0
            else:
                state["since_l2"] += 1
            state.update(step=state["step"] + 1, bce=float(bce.detach()), l2=float(l2.detach()), bit_acc=bit_acc, l2_weight=l2_weight,
                         forward_images=passes.forward_images, backward_images=passes.backward_images)
            if state["step"] % per_epoch == 0:
                state["epoch"] = state["step"] // per_epoch
                state["seconds"] = time.perf_counter() - started
                if partial is not None:
                    atomic_torch_save({"encoder": encoder.state_dict(), "decoder": decoder.state_dict(),
                                       "optimizer": optimizer.state_dict(), "rng": rng.get_state(), "state": state}, partial)
        seconds = time.perf_counter() - started
        encoder.eval()
        decoder.eval()
        check = to_float(train.images[torch.randperm(len(train), generator=rng)[:CHECK_IMAGES]]).to(device)
        with torch.no_grad():
            code = self.code.to(device).expand(len(check), -1)
            encoded = encoder(code, check).clamp(0, 1)
            encoded = to_float(to_uint8(encoded))  # as the poisoned images are stored
            code_acc = float(((decoder(encoded) > 0).float() == code).float().mean())
            psnr = float((10 * torch.log10(1.0 / F.mse_loss(encoded, check, reduction="none").flatten(1).mean(1)
                                           .clamp_min(1e-10))).mean())
        stats = {"source": "trained", "seconds": round(seconds, 2), "steps": state["step"], "epochs": self.epochs,
                 "final_bce": _round(state["bce"]), "final_l2": _round(state["l2"]), "final_l2_weight": _round(state.get("l2_weight")),
                 "final_batch_bit_accuracy": _round(state["bit_acc"]), "l2_started_at_step": None if state["since_l2"] < 0
                 else state["step"] - state["since_l2"], "code_bit_accuracy": round(code_acc, 4),
                 "code_psnr_db": round(psnr, 2), "forward_images": passes.forward_images,
                 "backward_images": passes.backward_images}
        log.info("ssba: encoder/decoder trained in %.0f s (%d steps): BCE %.4f, L2 %.5f, bit accuracy on the code %.3f, "
                 "PSNR %.1f dB", seconds, state["step"], stats["final_bce"] or 0, stats["final_l2"] or 0, code_acc, psnr)
        return encoder.cpu(), stats

    # --- state ------------------------------------------------------------------------------------
    def _encoder_state(self) -> dict[str, Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.encoder.state_dict().items()}

    def _load_encoder(self, weights: dict[str, Tensor]) -> None:
        channels, height, width = self.image_shape
        encoder = StegaStampEncoder(channels, height, width, self.code_bits, self.residual, self.width)
        try:
            encoder.load_state_dict(weights)
        except (RuntimeError, KeyError, TypeError) as exc:
            raise DataError(f"ssba state holds an encoder of another shape; expected {self.image_shape} images, "
                            f"{self.code_bits}-bit codes ({type(exc).__name__})") from exc
        self.encoder = encoder.eval()

    def state_dict(self) -> dict[str, Any]:
        return {"encoder": self._encoder_state()} if self.encoder is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.resource is not None:
            return
        if "encoder" not in state:
            raise DataError("ssba state holds no encoder")
        self._load_encoder(state["encoder"])

    def prepare_state(self) -> dict[str, Any] | None:
        return {**self.state_dict(), "stats": dict(self.stats)} if self.encoder is not None else None

    def load_prepare_state(self, state: dict[str, Any]) -> None:
        self.load_state_dict(state)
        self.stats = dict(state.get("stats", {}))

    def describe(self) -> dict:
        return {**super().describe(), "resource": self.resource, "secret": self.secret, **self._training_values(),
                **self.stats}


def _round(value: float | None, digits: int = 5) -> float | None:
    return None if value is None else round(float(value), digits)
