"""Every model config: shapes, the features/classifier split, swappable layers, known sizes, timm."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from torch import nn

import backdoorbench
from backdoorbench.errors import ConfigError, DataError
from backdoorbench.models.base import ImageClassifier
from backdoorbench.models.timm_model import TimmClassifier

# Every `model=<name>` option; `_`-prefixed files are per-dataset aliases of these, not options.
MODEL_CONFS = sorted(
    p.stem for p in (Path(backdoorbench.__file__).parent / "conf" / "model").glob("*.yaml") if not p.stem.startswith("_")
)
# (channels, size) each architecture is meant for; a new config is tested at 3x32x32 on the day it lands.
SHAPES = {
    "mnist_cnn": [(1, 28), (3, 32)],
    "preact_resnet18": [(3, 32), (1, 28)],
    "resnet18": [(3, 64), (3, 32)],
    "vgg11": [(3, 32), (3, 64)],
    "vgg16_bn": [(3, 32), (3, 64)],
    "timm": [(3, 32)],
}
CASES = [(name, shape) for name in MODEL_CONFS for shape in SHAPES.get(name, [(3, 32)])]
NUM_CLASSES = 7  # not 10, so a hard-coded head size shows


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_cfgs():
    """The composed `model` node of every option, as `python -m backdoorbench model=<name>` gets it."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    import backdoorbench.config  # noqa: F401

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="backdoorbench.conf", version_base="1.3"):
        cfgs = {name: compose(config_name="config", overrides=[f"model={name}"]).model for name in MODEL_CONFS}
    GlobalHydra.instance().clear()
    return cfgs


@pytest.fixture
def build(model_cfgs):
    def _build(name: str, channels: int, size: int, seed: int = 0, num_classes: int = NUM_CLASSES,
               **overrides) -> ImageClassifier:
        torch.manual_seed(seed)
        model = instantiate(model_cfgs[name], in_channels=channels, num_classes=num_classes, image_size=size, **overrides)
        return model.eval()

    return _build


def batch(channels: int, size: int) -> torch.Tensor:
    return torch.rand(2, channels, size, size, generator=torch.Generator().manual_seed(0))


def last_conv(model: ImageClassifier) -> nn.Conv2d:
    convs = [m for m in model.features.modules() if isinstance(m, nn.Conv2d)]
    assert convs, "no nn.Conv2d inside `features`"
    return convs[-1]


@pytest.mark.parametrize("name, shape", CASES, ids=[f"{n}-{c}x{s}x{s}" for n, (c, s) in CASES])
@torch.no_grad()
def test_forward_is_classifier_of_features_and_last_conv_feeds_them(build, name, shape):
    channels, size = shape
    model = build(name, channels, size)
    assert isinstance(model, ImageClassifier)
    x = batch(channels, size)
    seen = []
    hook = last_conv(model).register_forward_hook(lambda mod, inp, out: seen.append(out.shape))
    logits = model(x)
    hook.remove()
    assert logits.shape == (2, NUM_CLASSES)
    features = model.features(x)
    assert features.dim() == 2 and features.shape[0] == 2
    torch.testing.assert_close(model.classifier(features), logits)
    assert len(seen) == 1, "the last conv of `features` must run once per forward"
    # Fine-pruning prunes the last conv's channels: where they are the features (no hidden linear
    # layer between; rbc_mnist has one), each must map to a block of feature entries.
    if not any(isinstance(m, nn.Linear) for m in model.features.modules()):
        assert features.shape[1] % seen[0][1] == 0


def first_case(name):
    return SHAPES.get(name, [(3, 32)])[0]


class MarkedNorm(nn.BatchNorm2d):
    pass


class MarkedAct(nn.ReLU):
    pass


class ZeroAct(nn.Module):
    calls = 0

    def forward(self, x):
        ZeroAct.calls += 1
        return torch.zeros_like(x)


@pytest.mark.parametrize("name", MODEL_CONFS)
@torch.no_grad()
def test_head_feature_act_and_norm_layer_are_honoured(build, name):
    channels, size = first_case(name)
    x = batch(channels, size)

    plain = build(name, channels, size)
    assert torch.count_nonzero(plain.features(x)) > 0

    # A bias-free head, as the angular-margin penalty needs; norm_layer / act_layer replace every
    # norm / activation (ANP passes a noisy batch norm).
    marked = build(name, channels, size, head=partial(nn.Linear, bias=False), norm_layer=MarkedNorm, act_layer=MarkedAct)
    assert isinstance(marked.classifier, nn.Linear) and marked.classifier.bias is None
    norms = [m for m in marked.modules() if isinstance(m, nn.BatchNorm2d)]
    assert norms and all(type(m) is MarkedNorm for m in norms)
    assert len(norms) == sum(isinstance(m, nn.BatchNorm2d) for m in plain.modules())
    assert not any(type(m) is nn.ReLU for m in marked.modules())

    # Any head factory gets (penultimate width, num_classes); feature_act is the last thing before
    # the head: if it outputs zeros, so do the features.
    calls = []

    def head(in_features, num_classes):
        calls.append((in_features, num_classes))
        return nn.Sequential(nn.BatchNorm1d(in_features), nn.Tanh(), nn.Linear(in_features, num_classes, bias=False))

    ZeroAct.calls = 0
    custom = build(name, channels, size, head=head, feature_act=ZeroAct).eval()
    features = custom.features(x)
    assert calls == [(features.shape[1], NUM_CLASSES)] and custom(x).shape == (2, NUM_CLASSES)
    assert torch.count_nonzero(features) == 0 and ZeroAct.calls == 2


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_known_parameter_counts(build):
    # PreAct ResNet-18 of the WaNet/LIRA code, 10 classes: 11,171,146 parameters.
    assert n_params(build("preact_resnet18", 3, 32, num_classes=10)) == 11_171_146
    # torchvision's ResNet-18 with its 7x7 stem swapped for a 3x3 one (LIRA's TinyImageNet victim).
    import torchvision

    reference = torchvision.models.resnet18(weights=None, num_classes=200)
    stem = reference.conv1.weight.numel()
    assert n_params(build("resnet18", 3, 64, num_classes=200)) == n_params(reference) - stem + 3 * 3 * 3 * 64
    # The CIFAR VGGs of pytorch-cifar (9,231,114 and 14,728,266) less the conv biases a norm makes redundant.
    assert n_params(build("vgg11", 3, 32, num_classes=10)) == 9_231_114 - (64 + 128 + 2 * 256 + 4 * 512)
    assert n_params(build("vgg16_bn", 3, 32, num_classes=10)) == 14_728_266 - (2 * 64 + 2 * 128 + 3 * 256 + 6 * 512)
    # VGG at 64 px flattens 2x2 maps: 2048 features, as in LIRA's TinyImageNet VGG.
    assert build("vgg11", 3, 64).classifier.in_features == 2048


def test_vgg_without_norm_and_too_small_images(build):
    bare = build("vgg11", 3, 32, norm_layer=None)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in bare.modules())
    assert all(m.bias is not None for m in bare.modules() if isinstance(m, nn.Conv2d))
    # Called directly: the pipeline unwraps Hydra's InstantiationException to this one line.
    from backdoorbench.models.preact_resnet import PreActResNet18
    from backdoorbench.models.vgg import VGG11

    from backdoorbench.models.vgg import VGG16BN

    with pytest.raises(ConfigError, match="^model vgg11 needs images of at least 32 px"):
        VGG11(in_channels=1, image_size=28)
    with pytest.raises(ConfigError, match="^model vgg16_bn needs"):  # the option's name, not its layout's
        VGG16BN(in_channels=1, image_size=28)
    with pytest.raises(ConfigError, match="at least 8 px"):
        PreActResNet18(image_size=4)


# ----------------------------------------------------------------------------- timm


def raw_timm(name: str, seed: int = 0, **kwargs) -> nn.Module:
    import timm

    torch.manual_seed(seed)
    return timm.create_model(name, pretrained=False, in_chans=3, num_classes=NUM_CLASSES, **kwargs).eval()


@torch.no_grad()
def test_timm_wrapper_computes_what_timm_computes():
    torch.manual_seed(0)
    wrapped = TimmClassifier(name="test_resnet", num_classes=NUM_CLASSES).eval()
    x = batch(3, 32)
    torch.testing.assert_close(wrapped(x), raw_timm("test_resnet", 0)(x))
    assert wrapped.name == "timm_test_resnet"
    # timm's classifier left `features`: no parameter is shared or counted twice.
    assert not set(map(id, wrapped.features.parameters())) & set(map(id, wrapped.classifier.parameters()))


@torch.no_grad()
def test_timm_vit_is_built_for_the_dataset_image_size():
    model = TimmClassifier(name="test_vit", num_classes=NUM_CLASSES, image_size=32).eval()
    assert model(batch(3, 32)).shape == (2, NUM_CLASSES)


@pytest.mark.parametrize("fmt", ["pt", "nested_pt", "safetensors"])
@torch.no_grad()
def test_timm_loads_local_weights(tmp_path, fmt):
    reference = raw_timm("test_resnet", seed=42)
    state = reference.state_dict()
    path = tmp_path / f"w.{'safetensors' if fmt == 'safetensors' else 'pt'}"
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    else:
        torch.save({"state_dict": state} if fmt == "nested_pt" else state, path)
    torch.manual_seed(0)  # another init: the weights must come from the file
    loaded = TimmClassifier(name="test_resnet", num_classes=NUM_CLASSES, weights=str(path)).eval()
    x = batch(3, 32)
    torch.testing.assert_close(loaded(x), reference(x))


def test_timm_bad_names_and_files_are_one_line_errors(tmp_path):
    def one_line(error_type, match, **kwargs):
        with pytest.raises(error_type, match=match) as info:
            TimmClassifier(**{"num_classes": NUM_CLASSES, **kwargs})
        assert "\n" not in str(info.value)

    one_line(ConfigError, "is not a timm model", name="resnet_does_not_exist")
    one_line(ConfigError, "does not exist", name="test_resnet", weights=str(tmp_path / "missing.pt"))
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"\x00not weights")
    one_line(DataError, "cannot be read", name="test_resnet", weights=str(garbage))
    other = tmp_path / "convnext.pt"
    torch.save(raw_timm("test_convnext").state_dict(), other)
    one_line(DataError, "does not fit timm model 'test_resnet'", name="test_resnet", weights=str(other))
    # Weights of a head for another number of classes.
    seven = tmp_path / "seven_classes.pt"
    torch.save(raw_timm("test_resnet").state_dict(), seven)
    one_line(DataError, "another shape", name="test_resnet", weights=str(seven), num_classes=3)
