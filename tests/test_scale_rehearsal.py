"""Scale rehearsal: every attack, with its default config, on three datasets of the
shapes and class counts of the real ones, written in their real file formats and read by the
real loaders:

- mnist:          10 classes, 28x28x1 (gzipped IDX), target class 0 below 10% of the set, as in
                  full MNIST (5,923 of 60,000);
- gtsrb:          43 classes, 32x32x3 (PPM folders + CSV, resized), target class 0 rare (GTSRB's
                  class 0 holds 210 of 39,209 images);
- tiny_imagenet: 200 classes, 64x64x3 (JPEG folders), 0.5% of the set per class;
- cifar10:        10 classes, 32x32x3 (the pickled batches), the classes in turn.

cifar10, gtsrb and tiny_imagenet run their paper-scale protocol (`backdoorbench`): every
attack builds from that protocol's resolved config (its optimizer, schedule, batch, augmentation,
precision and per-dataset method values), shrunk only in epochs (one) and model; and a whole
pipeline run there, with the protocol's own model, writes a record naming its protocol and precision.

For each (dataset, attack) the pipeline's own steps run: validate_config, the dataset, attack,
trainer and model built from the composed config, the attack's preparation (surrogates, mask
pre-training), the poisoning, one tiny training of the victim (one epoch of batches of 128;
training-controlled attacks through their own step) and the evaluation. Then the attack's
defining property is checked on that data: the poisoned count and which samples are eligible,
the target rule on poisoned labels (all2one and all2all), the test-time trigger changing every
image within the attack's budget.

These are the runs that would have caught two faults fixed on 2026-12-01/02: WB's target-class reference
empty in a batch of many-class data (f1f81cb) and clean-label rates as a share of the whole set,
refused where the target class is under 10% of it). Only the model is not the default: the
small CNN (`model=mnist_cnn`, 32 hidden units) takes every shape here and keeps the runs short.
The quick suite runs the cheap attacks on mnist and gtsrb and one of each kind on tiny_imagenet
(~20 s); the attacks that train a surrogate or a trigger generator (label_consistent, trojannn,
input_aware, lira, wb, lf), the other 64 px runs and every all2all run are marked slow.
"""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from backdoorbench import registry
from backdoorbench.attacks.base import TrainingAttack
from backdoorbench.datasets.spec import dataset_spec
from backdoorbench.errors import ConfigError
from backdoorbench.factory import build, build_model
from backdoorbench.metrics import evaluate
from backdoorbench.stages import stream
from backdoorbench.validation import validate_config
from backdoorbench.victim import prepare_attack
from tests import dataset_files as files
from tests.tiny import one_thread  # noqa: F401  (autouse: one thread for these tiny nets)

ATTACKS = registry.list_attacks()  # every attack the registry lists, a new one included
# What costs, read from the classes: an attack that trains networks of its own to make its trigger
# (`learned_trigger`: generators, surrogates) rehearses with -m slow, a new one included.
SLOW = {name for name in ATTACKS if registry.method_class("attack", name).learned_trigger}
# 64 px costs ~10x 28 px per image: the quick suite keeps there the first attack (in the registry's
# order) of each kind, dirty-label, clean-label and training-controlled, of those not slow already.
def first_of_each_kind() -> set[str]:
    first: dict[tuple[str, bool], str] = {}
    for name in ATTACKS:
        cls = registry.method_class("attack", name)
        if name not in SLOW and name != "none":
            first.setdefault((cls.kind, cls.clean_label), name)
    return set(first.values())


QUICK_AT_64PX = first_of_each_kind()
CLEAN_LABEL = {name for name in ATTACKS if registry.method_class("attack", name).clean_label}
DATASETS = ("mnist", "gtsrb", "tiny_imagenet", "cifar10")
PAPER_SCALE = {"cifar10", "gtsrb", "tiny_imagenet"}
TARGET = 0
PIXEL = 1 / 255 + 1e-6  # one uint8 level: what storing a poisoned image as uint8 may add


# ------------------------------------------------------------------------------------ the files

def write_mnist(root: Path) -> None:
    """10 classes x 8 training images, class 0 with 7 (8.9% of the set, under 10%)."""
    written = files.write_mnist(root, train_per_class=8, test_per_class=3, seed=1)
    images, labels = written["train"]
    keep = np.ones(len(labels), dtype=bool)
    keep[np.flatnonzero(labels == TARGET)[0]] = False
    raw = root / "MNIST" / "raw"
    (raw / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(files.idx_bytes(images[keep])))
    (raw / "train-labels-idx1-ubyte.gz").write_bytes(gzip.compress(files.idx_bytes(labels[keep])))


def write_gtsrb(root: Path) -> None:
    """43 classes x 6 training signs, class 0 with 2 (0.8% of the set); every class in the test set."""
    files.write_gtsrb(root, train_per_class=6, n_test=43, seed=1)
    folder = root / "gtsrb" / "GTSRB" / "Training" / f"{TARGET:05d}"
    csv = folder / f"GT-{TARGET:05d}.csv"
    rows = csv.read_text().splitlines()
    for row in rows[3:]:
        (folder / row.split(";")[0]).unlink()
    csv.write_text("\n".join(rows[:3]) + "\n")


def write_tiny_imagenet(root: Path) -> None:
    """200 classes x 1 training image (0.5% of the set each, as the real 500 of 100,000)."""
    files.write_tiny_imagenet(root, train_per_class=1, n_val=40, seed=1)


def write_cifar10(root: Path) -> None:
    """10 classes, 8 images per batch file: 40 training images, 20 test images."""
    files.write_cifar10(root, per_batch=8, n_test=20, seed=1)


WRITERS = {"mnist": write_mnist, "gtsrb": write_gtsrb, "tiny_imagenet": write_tiny_imagenet, "cifar10": write_cifar10}
# The fixtures are the real format, not the real bytes: torchvision's md5 list refuses them.
FIXTURE = {"cifar10": ["dataset.verify_md5=false"]}


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    """dataset name -> a folder holding its files, written on first use (the loader's tensor
    cache under it then serves every later run)."""
    made: dict[str, Path] = {}

    def root(name: str) -> Path:
        if name not in made:
            made[name] = tmp_path_factory.mktemp(f"scale_{name}")
            WRITERS[name](made[name])
        return made[name]

    return root


# One tiny step: the attacks' own pre-training loops shrink to one pass (as trainer.epochs=1 does for the
# victim); every value that defines the trigger, the rates and the target rule stays the default.
TINY_STEP = {"input_aware": ["attack.mask_epochs=1"],
             "lira": ["attack.stage1_epochs=1"], "wb": ["attack.stage1_epochs=1"],
             "label_consistent": ["attack.surrogate_epochs=1", "attack.surrogate_adv_steps=2", "attack.pgd_steps=10"],
             "trojannn": ["attack.surrogate_epochs=1", "attack.trigger_steps=50"],
             # 5 surrogate epochs: after 1, DeepFool reaches the target on no image of the 200-class fixture
             "lf": ["attack.surrogate_epochs=5", "attack.max_passes=1", "attack.craft_images=10"],
             # one epoch of the networks, at the widths of the quick protocol
             "poison_ink": ["attack.epochs=1", "attack.stages=[[crop,flip]]", "attack.width=8", "attack.depth=2",
                            "attack.extractor_width=8", "attack.extractor_blocks=1"],
             "ssba": ["attack.epochs=1", "attack.width=8"],
             # the backdoor loss from the first batch (the default waits for 1,000 batches of clean loss)
             "blind": ["attack.loss_threshold=null"],
             # the paper's 0.003 payload and cover (protocol backdoorbench) poison none of these tens of images
             "adaptive_blend": ["attack.poison_rate=0.1", "attack.cover_rate=0.1"]}


def compose(compose_cfg, roots, dataset: str, attack: str, tmp_path: Path, *extra: str):
    return compose_cfg(f"dataset={dataset}", f"dataset.root={roots(dataset)}", *FIXTURE.get(dataset, []),
                       f"attack={attack}", "model=mnist_cnn", "model.hidden=32", "trainer.epochs=1",
                       "trainer.progress=false", "device=cpu", "cache=false", "logger=none", f"results_dir={tmp_path}",
                       *TINY_STEP.get(attack, []), *extra)


# ------------------------------------------------------------------------------------ one run

class StepRecorder:
    """Wraps the victim's training step (the pipeline's in-training hook) and keeps, per batch,
    the labels that went in and the labels the step scored."""

    def __init__(self) -> None:
        self.batches: list[tuple[torch.Tensor, torch.Tensor, float]] = []
        self.poisoned: list[tuple[torch.Tensor, torch.Tensor]] = []  # (labels in, labels out) of a poison hook

    def watch_poison(self, attack) -> None:
        """WaNet poisons the un-augmented batch in the trainer's `poison=` hook, before the step."""
        hook = attack.poison_step

        def recorded(x, y):
            x_out, y_out = hook(x, y)
            self.poisoned.append((y.detach().cpu(), y_out.detach().cpu()))
            return x_out, y_out

        attack.poison_step = recorded

    def __call__(self, step):
        def recorded(model, x, y):
            loss, logits, scored = step(model, x, y)
            self.batches.append((y.detach().cpu(), scored.detach().cpu(), float(loss.detach())))
            return loss, logits, scored

        return recorded


def rehearse(cfg, tmp_path: Path):
    """The pipeline's steps up to the attacked model's metrics (pipeline.run / obtain_victim)."""
    validate_config(cfg)
    torch.manual_seed(cfg.seed)
    data = build(cfg.dataset)
    spec = dataset_spec(cfg.dataset)
    assert (data.num_classes, data.image_shape) == (spec.num_classes, spec.image_shape)
    attack = build(cfg.attack, num_classes=data.num_classes, image_shape=data.image_shape)
    trainer = build(cfg.trainer, device=cfg.device, crop_padding=data.crop_padding, hflip=data.hflip)
    prepare_attack(attack, tmp_path / "prepare.pt", trainer=trainer, train=data.train,
                   generator=stream(cfg.seed, "attack"), build_model=lambda **kw: build_model(cfg, data, **kw))
    poisoned = attack.poison_dataset(data.train, stream(cfg.seed, "poison"))
    model = build_model(cfg, data)
    recorder = StepRecorder()
    if hasattr(attack, "poison_step"):
        recorder.watch_poison(attack)
    attack.train_victim(trainer, model, poisoned.split, stream(cfg.seed, "train"), wrap_step=recorder)
    metrics = evaluate(model, trainer, attack, data.test)
    return data, attack, poisoned, recorder, metrics


# ------------------------------------------------------------------------------------ the checks

def check_poisoning(attack, data, poisoned) -> None:
    """The count rule, who is eligible, what happens to labels, and that only the chosen (and an
    attack's documented extra label-keeping) images change."""
    y, n = data.train.labels, len(data.train)
    indices = poisoned.indices
    if isinstance(attack, TrainingAttack) or attack.name == "none":
        assert len(indices) == 0  # training-controlled: the training set itself stays clean
        assert torch.equal(poisoned.split.images, data.train.images) and torch.equal(poisoned.split.labels, y)
        return
    in_target = y == TARGET
    if attack.clean_label:  # a share of the target class (the default is all of it, half of it for CTRL), however rare
        assert len(indices) == round(attack.poison_rate * int(in_target.sum())) >= 1
        assert attack.poison_rate == (0.5 if attack.name == "ctrl" and int(in_target.sum()) > 1 else 1.0)
        assert bool(in_target[indices].all())
        assert torch.equal(poisoned.split.labels, y)
    else:  # a share of the whole set, drawn from every class, relabelled by the target rule
        assert len(indices) == round(attack.poison_rate * n)
        assert torch.equal(poisoned.split.labels[indices], attack.target_rule(y[indices]))
    untouched = torch.ones(n, dtype=torch.bool)
    untouched[indices] = False
    assert torch.equal(poisoned.split.labels[untouched], y[untouched])
    extra = {"bpp": "negative_indices", "adaptive_blend": "cover_indices"}.get(attack.name)
    if extra is not None:  # label-keeping extras: disjoint from the poisoned set, round(ratio * N) of it
        kept = getattr(attack, extra)
        ratio = attack.neg_ratio if attack.name == "bpp" else attack.cover_rate
        assert len(kept) == round(ratio * n) and not bool(torch.isin(kept, indices).any())
        untouched[kept] = False
    assert torch.equal(poisoned.split.images[untouched], data.train.images[untouched])
    changed = (poisoned.split.images[indices] != data.train.images[indices]).flatten(1).any(1)
    assert bool(changed.all()), f"{int((~changed).sum())} poisoned images were left as they were"


def check_training_steps(attack, recorder: StepRecorder) -> None:
    """The victim trained through the attack's own step, every loss finite; training-controlled
    attacks relabel their share of each batch by the target rule."""
    assert recorder.batches and all(math.isfinite(loss) for *_, loss in recorder.batches)
    for y, scored, _ in recorder.batches:
        if attack.name in ("lira", "wb"):  # clean rows, then the triggered copies of the first ones
            count = max(1, round(attack.poison_rate * len(y)))
            assert torch.equal(scored[: len(y)], y) and torch.equal(scored[len(y):], attack.target_rule(y[:count]))
        elif attack.name == "blind":  # the clean batch, then its copy with round(rate * B) rows triggered
            count = min(len(y), round(attack.poison_rate * len(y)))
            assert torch.equal(scored[: len(y)], y) and len(scored) == 2 * len(y)
            assert torch.equal(scored[len(y):], torch.cat([attack.target_rule(y[:count]), y[count:]]))
        elif attack.name == "wanet":  # poisoned before augmentation (the poison hook); plain CE in the step
            assert torch.equal(scored, y)
        elif attack.name == "input_aware":  # int(rate * B) rows go to the target rule (the official floor)
            moved = scored != y
            assert torch.equal(scored[moved], attack.target_rule(y[moved]))
            relabelled = scored == attack.target_rule(y)
            assert int(relabelled.sum()) >= int(attack.poison_rate * len(y))
        else:  # data poisoning: plain cross-entropy on the (already poisoned) labels
            assert torch.equal(scored, y)
    if attack.name == "wanet":
        assert recorder.poisoned
        for y, out in recorder.poisoned:  # int(rate * B) rows go to the target rule (the official floor)
            moved = out != y
            assert torch.equal(out[moved], attack.target_rule(y[moved]))
            assert int((out == attack.target_rule(y)).sum()) >= int(attack.poison_rate * len(y))


def check_trigger(attack, data, poisoned) -> None:
    """apply_trigger: same shape, in [0, 1], every test image changed, within the attack's budget."""
    x = data.test.float_images()[:16]
    with torch.no_grad():
        xt = attack.apply_trigger(x.clone())
    assert xt.shape == x.shape and xt.dtype == x.dtype
    assert float(xt.min()) >= 0 and float(xt.max()) <= 1
    diff = (xt - x).abs()
    if attack.name == "none":
        assert torch.equal(xt, x)
        return
    assert bool((diff.flatten(1).amax(1) > 0).all()), "the trigger left a test image unchanged"
    _, height, width = data.image_shape
    name = attack.name
    if name in ("badnets", "trojannn", "blind"):  # a patch: nothing outside it changes
        assert float(diff[..., ~attack.patch_mask()].max()) == 0
    elif name == "blended":
        assert torch.allclose(xt, (1 - attack.alpha) * x + attack.alpha * attack.pattern, atol=1e-6)
    elif name == "adaptive_blend":
        assert torch.allclose(xt, (1 - attack.test_alpha) * x + attack.test_alpha * attack.pattern, atol=1e-6)
    elif name == "sig":  # the column sinusoid at test_delta, the same in every row and channel
        assert float(diff.max()) <= attack.test_delta + 1e-6
        unclamped = (x > attack.test_delta) & (x < 1 - attack.test_delta)
        assert torch.allclose((xt - x)[unclamped], (attack.test_delta * attack.signal).expand_as(x)[unclamped], atol=1e-6)
    elif name == "bpp":  # squeeze_num levels per channel, dithered ones stored at 8 bits as the official code's
        levels = torch.tensor([j / (attack.squeeze_num - 1) for j in range(attack.squeeze_num)])
        if attack.dithering:
            levels = (levels * 255).round() / 255
        assert bool(((xt.reshape(-1, 1) - levels).abs().min(1).values < 1e-5).all())
    elif name == "label_consistent":  # the corner pattern only; the PGD budget is on the training images
        assert float(diff[..., attack.pattern == 0].max()) == 0
        hard = poisoned.split.float_images()[poisoned.indices]
        clean = data.train.float_images()[poisoned.indices]
        off_corners = (attack.pattern == 0).expand_as(hard)
        assert float((hard - clean).abs()[off_corners].max()) <= attack.eps + PIXEL
    elif name == "refool":  # a reflection blended in: changes spread over the image, not a patch
        assert float((diff.flatten(1) > 0).float().mean()) > 0.5
    elif name == "wanet":  # a smooth warp of at most s/2 * max|flow| px, sampling inside the image
        pixels = attack.displacement().abs() * (torch.tensor([width, height]) - 1) / 2
        assert 0 < float(pixels.max()) <= attack.s * float(attack.flow.abs().max()) / 2 + 1e-5
        assert float(attack.grid.abs().max()) <= 1
    elif name == "input_aware":  # x + m(x) * (p(x) - x): changes only where the mask is
        with torch.no_grad():
            masks = attack.masks(x)
        assert bool((diff <= masks + 1e-6).all())
    elif name == "lf":  # one smooth perturbation in [0, magnitude], added to every image and clipped
        assert float(attack.pattern.min()) >= 0 and float(attack.pattern.max()) <= attack.magnitude + 1e-6
        assert torch.allclose(xt, (x + attack.pattern).clamp(0, 1), atol=1e-6)
    elif name == "poison_ink":  # the injection network's image, 8-bit, the same for the same image
        assert torch.equal(xt, (xt * 255).round() / 255)
        with torch.no_grad():
            assert torch.equal(attack.apply_trigger(x.clone()), xt)
    elif name == "ssba":  # the encoded image: a change that differs from image to image (not one pattern)
        change = (xt - x).flatten(1)
        assert float((change - change.mean(0)).norm(dim=1).mean()) > 0.1 * float(change.mean(0).norm())
    elif name in ("lira", "wb"):  # eps-bounded noise (test_eps) in pixel units
        assert float(diff.max()) <= attack.test_eps + 1e-6
    elif name in ("ftrojan", "ctrl"):  # the change's spectrum peaks at the bumped coefficients of each tile
        from backdoorbench.attacks import frequency
        space = {"ftrojan": lambda v: frequency.rgb_to_ycrcb(v, False), "ctrl": frequency.rgb_to_yuv_kornia}[name]
        to_space = space if attack.yuv else (lambda v: v)
        change = frequency.block_dct(to_space(xt.double() * 255) - to_space(x.double() * 255), attack.window).abs()
        w = attack.window
        per_tile = change.reshape(*change.shape[:2], height // w, w, width // w, w).mean(dim=(0, 2, 4))  # (C, w, w)
        for channel in attack.channels:
            peak = divmod(int(per_tile[channel].argmax()), w)
            assert peak in attack.positions, (channel, peak, attack.positions)
    else:
        raise AssertionError(f"no defining property checked for attack {name!r}")


def check_protocol(cfg, dataset: str) -> None:
    """A real dataset resolves to BackdoorBench v2.2's recipe (docs/ledger/training-protocols.yaml):
    what the rehearsal shrinks is the epochs and the model, nothing else of the protocol."""
    assert cfg.protocol.name == "backdoorbench"
    trainer = cfg.trainer
    assert (trainer.batch_size, trainer.precision, trainer.optimizer.lr, trainer.optimizer.momentum) == (128, "tf32", 0.01, 0.9)
    # BackdoorBench's own schedule for these trains their victim only (conf/protocol_attack/backdoorbench/):
    # the defenses fine-tune with the protocol's
    own = cfg.attack._target_.rsplit(".", 1)[-1] in ("Bpp", "WaNet", "InputAware", "LIRA")
    assert trainer.schedule == ("plateau" if dataset == "tiny_imagenet" else "cosine")
    assert (cfg.victim_trainer.schedule == "multistep") if own else (cfg.victim_trainer.schedule is None)
    assert cfg.dataset.crop_padding == 4
    if cfg.attack._target_.endswith("Bpp"):
        assert cfg.attack.squeeze_num == 8


# ------------------------------------------------------------------------------------ the tests

def slow(dataset: str, attack: str) -> bool:
    return attack in SLOW or (dataset in ("tiny_imagenet", "cifar10") and attack not in QUICK_AT_64PX)


def test_the_cost_lists_are_read_from_the_classes():
    """SLOW is the attacks that learn their trigger; QUICK_AT_64PX one attack of each kind."""
    assert SLOW == {"label_consistent", "trojannn", "input_aware", "lira", "wb", "lf", "poison_ink", "ssba"}  # the eight that train networks
    assert len(QUICK_AT_64PX) == 3 and not QUICK_AT_64PX & SLOW
    assert CLEAN_LABEL == {"sig", "label_consistent", "refool", "ctrl"}  # read from the classes: the four clean-label papers


def rehearsal_params():
    return [pytest.param(dataset, attack, id=f"{dataset}-{attack}", marks=[pytest.mark.slow] if slow(dataset, attack) else [])
            for dataset in DATASETS for attack in ATTACKS]


@pytest.mark.parametrize("dataset, attack", rehearsal_params())
def test_default_attack_runs_and_keeps_its_property(dataset, attack, compose_cfg, roots, tmp_path):
    cfg = compose(compose_cfg, roots, dataset, attack, tmp_path)
    check_protocol(cfg, dataset)
    if attack == "ctrl" and dataset == "tiny_imagenet":
        # The fixture holds one image of the target class: half of it is none, refused in one line; all of it runs.
        with pytest.raises(ConfigError, match=r"^attack.poison_rate=0.5 poisons no sample of the 1 target-class images"):
            rehearse(cfg, tmp_path)
        cfg = compose(compose_cfg, roots, dataset, attack, tmp_path, "attack.poison_rate=1.0")
    data, attack_obj, poisoned, recorder, metrics = rehearse(cfg, tmp_path)
    expected = {"mnist": (10, (1, 28, 28)), "gtsrb": (43, (3, 32, 32)), "tiny_imagenet": (200, (3, 64, 64)),
                "cifar10": (10, (3, 32, 32))}[dataset]
    assert (data.num_classes, data.image_shape) == expected
    assert attack_obj.target_mode == "all2one" and attack_obj.target == TARGET
    check_poisoning(attack_obj, data, poisoned)
    check_training_steps(attack_obj, recorder)
    check_trigger(attack_obj, data, poisoned)
    assert all(0 <= metrics[key] <= 1 for key in ("clean_acc", "asr", "ra"))


@pytest.mark.slow
@pytest.mark.parametrize("dataset", DATASETS)
@pytest.mark.parametrize("attack", ATTACKS)
def test_default_attack_all2all(dataset, attack, compose_cfg, roots, tmp_path):
    """all2all: y -> (y + 1) mod C on every poisoned label; clean-label attacks refuse it in one line
    before any data loads."""
    cfg = compose(compose_cfg, roots, dataset, attack, tmp_path, "attack.target_mode=all2all")
    if attack in CLEAN_LABEL:
        with pytest.raises(ConfigError) as excinfo:
            validate_config(cfg)
        assert "\n" not in str(excinfo.value) and "all2all" in str(excinfo.value)
        return
    data, attack_obj, poisoned, recorder, _ = rehearse(cfg, tmp_path)
    rule = attack_obj.target_rule
    y = torch.arange(data.num_classes)
    assert torch.equal(rule(y), (y + 1) % data.num_classes)
    check_poisoning(attack_obj, data, poisoned)
    check_training_steps(attack_obj, recorder)
    check_trigger(attack_obj, data, poisoned)


@pytest.mark.parametrize("dataset", [pytest.param(d, marks=[pytest.mark.slow] if d != "cifar10" else [])
                                     for d in sorted(PAPER_SCALE)])
def test_a_paper_scale_run_writes_a_record_naming_its_protocol_and_precision(dataset, compose_cfg, roots, tmp_path):
    """The whole pipeline under the dataset's default protocol with its own model (PreActResNet-18,
    narrowed to width 16 for the CPU): one epoch, then the record. On the CPU tf32 is plain fp32,
    and the record says which ran."""
    from backdoorbench.pipeline import run

    cfg = compose_cfg(f"dataset={dataset}", f"dataset.root={roots(dataset)}", *FIXTURE.get(dataset, []),
                      "attack=badnets", "model.width=16", "trainer.epochs=1", "trainer.progress=false", "device=cpu",
                      "logger=none",
                      "eval.stealth_images=4", f"results_dir={tmp_path}")
    assert cfg.model._target_.endswith("PreActResNet18")
    record, path = run(cfg)
    assert path is not None and path.is_file()
    assert record.config["protocol"]["name"] == "backdoorbench"
    assert record.config["trainer"]["precision"] == "tf32" and record.env["precision"] == "fp32"
    assert record.config["trainer"]["schedule"] == ("plateau" if dataset == "tiny_imagenet" else "cosine")
