"""Any timm architecture as an ImageClassifier: `model=timm model.name=<timm model name>`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn

from backdoorbench.errors import ConfigError, DataError
from backdoorbench.fileio import torch_load
from backdoorbench.models.base import ImageClassifier


class TimmFeatures(nn.Module):
    """timm's `forward_features` then `forward_head(pre_logits=True)` (pooling, flatten, any
    pre-logits layers), then `feature_act`: the penultimate vector its head reads."""

    def __init__(self, body: nn.Module, feature_act: nn.Module) -> None:
        super().__init__()
        self.body = body
        self.feature_act = feature_act

    def forward(self, x: Tensor) -> Tensor:
        return self.feature_act(self.body.forward_head(self.body.forward_features(x), pre_logits=True))


class TimmClassifier(ImageClassifier):
    """A model from timm (Wightman, PyTorch Image Models), never with downloaded weights.

    `timm.create_model(name, pretrained=False, in_chans=..., num_classes=...)`, split at the
    pre-logits vector: `features` holds the whole timm network with its classifier replaced by
    an identity, `classifier` is timm's own classifier (or `head(num_features, num_classes)`
    when `head` is given). `weights` is an optional local file (.safetensors, or a torch state
    dict, possibly under a "state_dict" or "model" key) in timm's own key layout, loaded before
    the split. `norm_layer` / `act_layer` go to timm's constructor for models that take them
    (e.g. resnet); `kwargs` holds any other constructor argument. Vision transformers are built
    for the dataset's image size.
    """

    def __init__(
        self,
        name: str = "resnet18",
        in_channels: int = 3,
        num_classes: int = 10,
        image_size: int = 32,
        weights: str | None = None,
        norm_layer: Callable[..., nn.Module] | None = None,
        act_layer: Callable[..., nn.Module] | None = None,
        head: Callable[[int, int], nn.Module] | None = None,
        feature_act: Callable[[], nn.Module] | None = None,
        kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.name = f"timm_{name}"  # never confused with our own resnet18 in a record
        if isinstance(kwargs, DictConfig):
            kwargs = OmegaConf.to_container(kwargs, resolve=True)
        body = create_timm_model(name, in_channels, num_classes, image_size, norm_layer, act_layer, dict(kwargs or {}))
        if weights:
            load_timm_weights(body, weights, name)
        own_classifier = body.get_classifier()
        # The head's input width: timm's `head_hidden_size` where a pre-logits layer widens it
        # (e.g. MobileNetV3's conv_head), else `num_features`.
        num_features = getattr(body, "head_hidden_size", None) or body.num_features
        body.reset_classifier(0)  # the classifier moves out of `features` into `classifier`
        self.features = TimmFeatures(body, (feature_act or nn.Identity)())
        self.num_features = num_features
        self.classifier = head(num_features, num_classes) if head is not None else own_classifier


def create_timm_model(
    name: str,
    in_channels: int,
    num_classes: int,
    image_size: int,
    norm_layer: Callable[..., nn.Module] | None,
    act_layer: Callable[..., nn.Module] | None,
    kwargs: dict[str, Any],
) -> nn.Module:
    import timm

    if not timm.is_model(name):
        close = timm.list_models(f"*{name}*")[:8]
        hint = f"; similar names: {', '.join(close)}" if close else "; see timm.list_models()"
        raise ConfigError(f"model.name={name!r} is not a timm model{hint}")
    for key, value in (("norm_layer", norm_layer), ("act_layer", act_layer)):
        if value is not None:
            kwargs[key] = value

    def build(**extra: Any) -> nn.Module:
        try:
            return timm.create_model(name, pretrained=False, in_chans=in_channels, num_classes=num_classes,
                                     **kwargs, **extra)
        except TypeError as exc:
            raise ConfigError(f"timm model {name!r} rejects the arguments {sorted(kwargs)}: {exc}") from exc

    model = build()
    # A ViT's position embedding is sized at construction, so build it for the dataset's images.
    patch_embed = getattr(model, "patch_embed", None)
    if "img_size" not in kwargs and getattr(patch_embed, "img_size", None) not in (None, (image_size, image_size)):
        model = build(img_size=image_size)
    return model


def read_state_dict(path: str | Path) -> dict[str, Tensor]:
    """Tensors of a .safetensors file or a torch state dict (loaded with weights_only=True)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"model.weights={str(path)!r} does not exist; give the path of a local .safetensors or .pt file")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state: Any = load_file(str(path))
        else:
            state = torch_load(path, map_location="cpu")
    except Exception as exc:  # torch and safetensors raise many types for a bad file
        raise DataError(f"model.weights={str(path)!r} cannot be read as weights ({type(exc).__name__}: {exc})".splitlines()[0]) from exc
    for key in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise DataError(f"model.weights={str(path)!r} holds no state dict of tensors")
    return state


def load_timm_weights(model: nn.Module, path: str | Path, name: str) -> None:
    """Load a state dict that must fit `model` exactly (same keys, same shapes)."""
    state = read_state_dict(path)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = sorted(k for k in set(state) & set(expected) if state[k].shape != expected[k].shape)
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (e.g. {missing[0]})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (e.g. {unexpected[0]})")
        if wrong:
            k = wrong[0]
            parts.append(f"{len(wrong)} of another shape (e.g. {k}: {tuple(state[k].shape)} vs {tuple(expected[k].shape)})")
        raise DataError(f"model.weights={str(path)!r} does not fit timm model {name!r}: keys {'; '.join(parts)}")
    model.load_state_dict(state)
