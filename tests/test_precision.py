"""The run's precision (backdoorbench/precision.py): a faint trigger reaches the model intact in it,
and training, evaluation and input defenses (STRIP) all compute in that one precision.

A GPU run autocasts to bf16; the CPU's bf16 autocast rounds the same way, so these tests show on
the CPU what a CUDA run computes."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import nn

from backdoorbench.attacks.badnets import BadNets
from backdoorbench.attacks.lira import LIRA
from backdoorbench.attacks.wb import WB
from backdoorbench.datasets.base import Split
from backdoorbench.defenses.base import DefenseContext
from backdoorbench.defenses.runner import run_defense
from backdoorbench.defenses.strip import Strip
from backdoorbench.errors import ConfigError
from backdoorbench.metrics import evaluate
from backdoorbench.models.base import ImageClassifier, Normalized
from backdoorbench.models.preact_resnet import PreActResNet
from backdoorbench.precision import precision_context, resolve_precision
from backdoorbench.train import Trainer
from tests.tiny import one_thread  # noqa: F401  (autouse: one thread for these tiny nets)

CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.247, 0.243, 0.261)


def smooth_images(n: int, generator: torch.Generator) -> torch.Tensor:
    """CIFAR-shaped images in [0, 1] with natural-image smoothness (8x8 noise, upsampled)."""
    low = torch.rand(n, 3, 8, 8, generator=generator)
    return nn.functional.interpolate(low, size=32, mode="bilinear", align_corners=False).clamp(0, 1)


@pytest.fixture(scope="module")
def faint_setup():
    """A narrow preact ResNet with CIFAR-10 normalisation and batch-norm statistics of image-like
    inputs, 16 images and a signed perturbation pattern."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = Normalized(PreActResNet(in_channels=3, num_classes=10, blocks=(1, 1, 1, 1), width=16), CIFAR_MEAN, CIFAR_STD)
    model.train()
    with torch.no_grad():
        for _ in range(4):
            model(smooth_images(64, g))
    model.eval()
    x = smooth_images(16, g)
    sign = torch.randint(0, 2, x.shape, generator=g).float() * 2 - 1
    return model, x, sign


@torch.no_grad()
def logit_effect(model: nn.Module, x: torch.Tensor, perturbation: torch.Tensor) -> torch.Tensor:
    """f(x + delta) - f(x) per image, as float32."""
    return model((x + perturbation).clamp(0, 1)).float() - model(x).float()


def median_relative_error(effect: torch.Tensor, reference: torch.Tensor) -> float:
    return float(((effect - reference).norm(dim=1) / reference.norm(dim=1)).median())


@pytest.mark.parametrize("eps", [0.005, 0.0025])
def test_a_lira_scale_trigger_keeps_its_logit_effect_in_the_runs_precision(faint_setup, eps):
    """Under bf16 autocast (every CUDA forward pass before trainer.precision) rounding distorts a
    0.0025-0.005 px trigger's effect on the logits by far more than 10%; in the precision a LIRA or
    WB run resolves to on CUDA, inside the same enclosing autocast, the effect is fp32's."""
    model, x, sign = faint_setup
    delta = eps * sign
    reference = logit_effect(model, x, delta)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rounded = logit_effect(model, x, delta)
    assert median_relative_error(rounded, reference) > 0.1  # what bf16 does to such a trigger
    for attack in (LIRA, WB):
        precision = resolve_precision("auto", "cuda", attack.min_precision)
        assert precision == "fp32"
        with torch.autocast("cpu", dtype=torch.bfloat16), precision_context("cpu", precision):
            kept = logit_effect(model, x, delta)
        assert median_relative_error(kept, reference) < 0.02
        # the trainer's own context, used by fit, predict and the defense runner, is that one
        trainer = Trainer(device="cpu", precision="auto", min_precision=attack.min_precision, progress=False)
        with torch.autocast("cpu", dtype=torch.bfloat16), trainer.autocast():
            assert median_relative_error(logit_effect(model, x, delta), reference) < 0.02


def test_auto_is_fp32_on_the_cpu_and_the_attacks_precision_on_cuda():
    for min_precision in ("bf16", "fp32"):
        assert resolve_precision("auto", "cpu", min_precision) == "fp32"  # CPU runs compute as before
    assert BadNets.min_precision == "bf16" and resolve_precision("auto", "cuda", BadNets.min_precision) == "bf16"
    assert LIRA.min_precision == WB.min_precision == "fp32"
    assert resolve_precision("bf16", "cuda", "fp32") == "bf16"  # asked for explicitly: obeyed (the run warns)
    assert resolve_precision("fp32", "cuda", "bf16") == "fp32"
    with pytest.raises(ConfigError, match=r"^trainer.precision='fp16' is unknown; choose one of: auto, bf16, tf32, fp32$"):
        resolve_precision("fp16", "cpu")


def test_a_bad_precision_is_refused_before_any_data_loads(compose_cfg):
    from backdoorbench.validation import validate_config

    with pytest.raises(ConfigError, match=r"trainer.precision='half' is unknown"):
        validate_config(compose_cfg("trainer.precision=half"))  # checks without data


class Quadrants(ImageClassifier):
    name = "quadrants"

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(2), nn.Flatten())
        self.classifier = nn.Linear(32, 4)


class PrecisionSpy(nn.Module):
    """The model, noting for each forward pass whether it ran under autocast, and in which dtype."""

    name = "spy"

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.seen: list[tuple[bool, torch.dtype]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        enabled = torch.is_autocast_enabled("cpu")
        self.seen.append((enabled, torch.get_autocast_dtype("cpu") if enabled else torch.float32))
        return self.model(x)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_strip_calibrates_and_scores_in_the_precision_of_the_ca(precision):
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    images = (torch.rand(48, 1, 8, 8, generator=g) * 255).to(torch.uint8)
    data = Split(images, torch.arange(48) % 4)
    attack = BadNets(num_classes=4, image_shape=(1, 8, 8), patch_size=3)
    model = PrecisionSpy(Normalized(Quadrants(), (0.5,), (0.25,)))
    trainer = Trainer(batch_size=16, eval_batch_size=16, optimizer=partial(torch.optim.SGD, lr=0.01),
                      augment=False, progress=False, device="cpu", precision=precision)
    evaluate(model, trainer, attack, data)
    ca_precision = set(model.seen)
    assert ca_precision == {(True, torch.bfloat16) if precision == "bf16" else (False, torch.float32)}
    model.seen.clear()
    ctx = DefenseContext(model=model, poisoned_train=data, poisoned_indices=torch.zeros(0, dtype=torch.long),
                         clean_subset=data.subset(torch.arange(12)), trainer=trainer, num_classes=4,
                         generator=torch.Generator().manual_seed(1), build_model=None, train_victim=None)
    run_defense(Strip(num_superimpose=4, batch_size=8), ctx, attack, data)
    assert len(model.seen) > 3 and set(model.seen) == ca_precision  # calibration, scores and predictions


def test_the_record_names_the_precision_it_ran_in(tiny_results):
    runs, _ = tiny_results
    record, _ = runs["strip"]
    assert record.config["trainer"]["precision"] == "auto"
    assert record.env["precision"] == "fp32"  # auto on the CPU


def test_a_trigger_below_bf16s_step_warns_once_in_one_line():
    """bf16 rounds a bright pixel in steps of 1/256: a 0.0025 px trigger (LIRA's CIFAR-10 eps) is
    lost on many pixels there, and a run forced to bf16 says so; at fp32/tf32, or a trigger above
    the step, nothing is said."""
    from backdoorbench.precision import BF16_PIXEL_STEP, bf16_warning

    x = torch.linspace(0.5, 0.999, 1000)
    lost = (x + 0.0025).bfloat16() == x.bfloat16()
    assert float(lost.float().mean()) > 0.3  # the property the warning rests on
    assert not bool(((x + 2 * BF16_PIXEL_STEP).bfloat16() == x.bfloat16()).any())
    line = bf16_warning("lira", "bf16", "fp32", 0.0025)
    assert "\n" not in line and "0.0025 px" in line and "0.003906 px" in line and "fp32 or tf32" in line
    assert bf16_warning("lira", "fp32", "fp32", 0.0025) is None and bf16_warning("lira", "tf32", "fp32", 0.0025) is None
    assert "needs fp32" in bf16_warning("wb", "bf16", "fp32", 0.05)  # above the step, but declared fp32-only
    assert bf16_warning("badnets", "bf16", "bf16", None) is None
    assert bf16_warning("blended", "bf16", "bf16", 0.2) is None
