"""Build a dataset, model, attack or defense by name, from its config as a run composes it.

`create_*` composes `conf/` with Hydra exactly as `python -m backdoorbench <group>=<name>
dataset=<dataset>` does (the protocol's per-dataset values included), then builds the object with
`overrides` replacing config values. Attacks and models are built for a dataset's classes and image
shape, which the dataset's config states (datasets/spec.py): nothing is loaded. `build`,
`build_attack` and `build_model` are what a run uses on its composed config.

>>> import backdoorbench
>>> attack = backdoorbench.create_attack("badnets", poison_rate=0.05)       # for mnist5k, the default
>>> wanet = backdoorbench.create_attack("wanet", dataset="cifar10")         # the protocol's cifar10 values
>>> net = backdoorbench.create_model("preact_resnet18", dataset="cifar10")  # 3x32x32 in, 10 classes out
>>> defense = backdoorbench.create_defense("fine_pruning", clean_fraction=0.1)
"""

from __future__ import annotations

import copy
import functools
import inspect
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import OmegaConf

import backdoorbench.config  # noqa: F401  (registers the schemas and resolvers composition needs)
from backdoorbench import plugins, registry, suggest
from backdoorbench.datasets.spec import dataset_spec
from backdoorbench.errors import ConfigError, UserError
from backdoorbench.models.base import Normalized

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from backdoorbench.attacks.base import Attack
    from backdoorbench.datasets.base import ImageDataset
    from backdoorbench.defenses.base import Defense

CONFIG_MODULE = "backdoorbench.conf"
DEFAULT_DATASET = "mnist5k"  # the offline default of conf/config.yaml
MISSING = "???"


def build(node: Any, **kwargs: Any) -> Any:
    """hydra.utils.instantiate, but a UserError raised by the target surfaces as itself, so the
    command line can print its one line instead of Hydra's wrapped traceback."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as exc:
        cause = exc.__cause__
        while cause is not None and not isinstance(cause, UserError):
            cause = cause.__cause__
        if cause is not None:
            raise cause from None
        unknown = re.search(r"unexpected keyword argument '(\w+)'", str(exc.__cause__))
        if isinstance(exc.__cause__, TypeError) and unknown and OmegaConf.is_config(node) and unknown[1] in node:
            key = f"{node._get_full_key(None)}.{unknown[1]}"  # e.g. added with +trainer.foo=1
            raise ConfigError(f"{key} is not a setting of {node._target_}; remove it "
                              "(`python -m backdoorbench --cfg job` lists the settings)") from None
        raise


def build_attack(node: DictConfig, data: ImageDataset) -> Attack:
    """The attack for `data`: its classes, image shape and name (Input-aware's normaliser is per dataset)."""
    return build(node, num_classes=data.num_classes, image_shape=data.image_shape, dataset=data.name)


def build_model(cfg: DictConfig, data: ImageDataset, **overrides: Any) -> Normalized:
    """A fresh model of the configured architecture; `overrides` go to its constructor."""
    channels, height, _ = data.image_shape
    net = build(cfg.model, in_channels=channels, num_classes=data.num_classes, image_size=height, **overrides)
    return Normalized(net, data.mean, data.std)


def check_name(group: str, name: str) -> str:
    """`name` if it is an option of `group` (or, for attacks and defenses, a plugin's class path);
    else a ConfigError of one line naming the closest option and the valid ones."""
    if name in registry.names(group) or (group in registry.PLUGIN_KINDS and plugins.is_class_path(name)):
        return name
    valid = registry.names(group)
    match = suggest.closest(str(name), valid, registry.aliases(group))
    hint = f"did you mean {match!r}? " if match else ""
    raise ConfigError(f"{group} {name!r} is unknown; {hint}choose one of: {', '.join(valid)}")


@contextmanager
def _hydra() -> Iterator[None]:
    """Hydra initialised on conf/: a running app's (or a caller's) initialisation is reused as it is."""
    if GlobalHydra.instance().is_initialized():
        yield
        return
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        yield


@functools.lru_cache(maxsize=256)
def _composed(group: str, name: str, dataset: str, protocol: str | None) -> dict[str, Any]:
    """The resolved `group` and `dataset` nodes of the run config `group=name dataset=dataset`."""
    overrides = [f"dataset={dataset}"] + ([f"{group}={name}"] if group != "dataset" else [])
    overrides += [f"protocol={protocol}"] if protocol else []
    plugins.register(overrides, reserved=registry.builtin_aliases)  # a plugin class path or entry point becomes an option first
    with _hydra():
        cfg = compose(config_name="config", overrides=overrides)
    return {key: OmegaConf.to_container(cfg[key], resolve=True) if cfg[key] is not None else None
            for key in dict.fromkeys((group, "dataset"))}


def method_config(group: str, name: str, *, dataset: str = DEFAULT_DATASET,
                  protocol: str | None = None) -> dict[str, Any] | None:
    """The config of option `name` of `group` as a run on `dataset` (under `protocol`, default: the
    dataset's own) composes it, resolved; None for an option that builds nothing (defense=none)."""
    check_name(group, name)
    check_name("dataset", dataset)
    return copy.deepcopy(_composed(group, name, dataset, protocol)[group])


def _settings(target: Any) -> set[str] | None:
    """The keyword arguments `target` accepts (through `**kwargs` on to its bases'); None: any."""
    accepted: set[str] = set()
    for owner in target.__mro__ if inspect.isclass(target) else (target,):
        function = vars(owner).get("__init__") if inspect.isclass(owner) else owner
        if function is None or owner is object:
            continue
        params = list(inspect.signature(function).parameters.values())
        accepted |= {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            return accepted
    return None  # `**kwargs` all the way down: any key may be meant


def _create(group: str, name: str, dataset: str, protocol: str | None, overrides: dict[str, Any], /,
            **passed: Any) -> Any:
    """Option `name` of `group` as composed for `dataset`, `overrides` checked and applied, built with `passed`."""
    node = method_config(group, name, dataset=dataset, protocol=protocol)
    if node is None:
        if overrides:
            raise ConfigError(f"{group}={name} builds nothing and takes no settings; remove {', '.join(overrides)}")
        return None
    plugin = plugins.is_class_path(name)
    target = plugins.load_class(name, registry.PLUGIN_KINDS[group]) if plugin else registry.method_class(group, name)
    accepted = _settings(target)
    for key in overrides:
        if key.startswith("_") or (key not in node and accepted is not None and key not in accepted):
            settings = sorted(k for k in node if not k.startswith("_"))
            raise ConfigError(f"{group}.{key} is not a setting of {name}; its settings: {', '.join(settings) or 'none'}")
    node.update(overrides)
    missing = [key for key, value in node.items() if value == MISSING]
    if missing:
        raise ConfigError(f"{group} {name} needs a value for {', '.join(missing)}; pass {missing[0]}=...")
    return build(OmegaConf.create(node), **passed)


def _shape(dataset: str, protocol: str | None, num_classes: int | None,
           image_shape: tuple[int, int, int] | None) -> tuple[int, tuple[int, int, int]]:
    """Classes and (C, H, W) given, else the ones the dataset's config states."""
    if num_classes is None or image_shape is None:
        spec = dataset_spec(method_config("dataset", dataset, dataset=dataset, protocol=protocol))
        if spec is None:
            raise ConfigError(f"dataset {dataset!r} does not state its classes and image shape before loading; "
                              "pass num_classes= and image_shape=(C, H, W)")
        num_classes = spec.num_classes if num_classes is None else num_classes
        image_shape = spec.image_shape if image_shape is None else image_shape
    return int(num_classes), tuple(int(v) for v in image_shape)  # type: ignore[return-value]


def create_attack(name: str, /, *, dataset: str = DEFAULT_DATASET, protocol: str | None = None,
                  num_classes: int | None = None, image_shape: tuple[int, int, int] | None = None,
                  **overrides: Any) -> Attack:
    """The attack `attack=<name>` selects, for `dataset` (its config's classes and image shape unless
    `num_classes` / `image_shape` are given), with `overrides` replacing its config values."""
    classes, shape = _shape(dataset, protocol, num_classes, image_shape)
    return _create("attack", name, dataset, protocol, overrides, num_classes=classes, image_shape=shape, dataset=dataset)


def create_defense(name: str, /, *, dataset: str = DEFAULT_DATASET, protocol: str | None = None,
                   **overrides: Any) -> Defense | None:
    """The defense `defense=<name>` selects, with `overrides` replacing its config values; None for `none`."""
    return _create("defense", name, dataset, protocol, overrides)


def create_model(name: str, /, *, dataset: str = DEFAULT_DATASET, protocol: str | None = None,
                 num_classes: int | None = None, in_channels: int | None = None, image_size: int | None = None,
                 **overrides: Any) -> Any:
    """A fresh, untrained `model=<name>` for `dataset`'s classes and image shape (unless given), with
    `overrides` replacing its config values. The bare network: a run wraps it in `Normalized` with the
    loaded data's mean and std (`build_model`)."""
    given = None if in_channels is None or image_size is None else (in_channels, image_size, image_size)
    classes, (channels, height, _) = _shape(dataset, protocol, num_classes, given)
    channels = channels if in_channels is None else int(in_channels)  # one given, the other the dataset's
    height = height if image_size is None else int(image_size)
    return _create("model", name, dataset, protocol, overrides, in_channels=channels, num_classes=classes,
                   image_size=height)


def create_dataset(name: str, /, *, protocol: str | None = None, **overrides: Any) -> ImageDataset:
    """The dataset `dataset=<name>` loads, with `overrides` replacing its config values (e.g.
    `root=`, `download=True`): this reads (and may decode or fetch) its files."""
    return _create("dataset", name, name, protocol, overrides)
