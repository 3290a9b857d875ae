"""A researcher's own attack or defense, without a fork: by class path or by installed entry point.

`attack=my_pkg.my_module:MyAttack` / `defense=my_pkg.my_module:MyDefense` name any importable
subclass of the documented base; an installed package adds names (`defense=my_defense`) through
the entry point groups `backdoorbench.attacks` / `backdoorbench.defenses`. Hydra resolves a group
option to a config, so before it composes, `register` stores one in Hydra's ConfigStore for each
plugin the command line names: `_target_` plus the class's keyword arguments at their defaults,
so `defense.my_param=3` is an override like any built-in's. Hydra's launchers (joblib, submitit)
carry the ConfigStore to their workers, so a sweep's jobs compose the same. docs/extending.md.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.resources
import inspect
from collections.abc import Callable
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser

from backdoorbench.errors import ConfigError

KINDS = {"attacks": "attack", "defenses": "defense"}  # entry point group suffix -> config group
GROUPS = {group: kind for kind, group in KINDS.items()}
# Keyword arguments the pipeline passes itself (an attack is built for the run's data), never config keys.
PASSED_BY_PIPELINE = {"attacks": ("num_classes", "image_shape", "dataset"), "defenses": ()}


def _check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}; use one of: {', '.join(KINDS)}")
    return KINDS[kind]


def entry_point_names(kind: str) -> dict[str, str]:
    """The installed `backdoorbench.<kind>` entry points (kind "attacks" or "defenses"): name -> "module:Class"."""
    _check_kind(kind)
    found = importlib.metadata.entry_points(group=f"backdoorbench.{kind}")
    return {ep.name: f"{ep.module}:{ep.attr}" if ep.attr else ep.module for ep in sorted(found, key=lambda e: e.name)}


def _entry_point_owner(kind: str, name: str) -> str:
    """The distribution that declares entry point `name`, for messages ("the package my-defense")."""
    for ep in importlib.metadata.entry_points(group=f"backdoorbench.{kind}", name=name):
        dist = getattr(ep, "dist", None)
        if dist is not None:
            return f"the package {dist.name}"
    return "an installed package"


def builtin_names(kind: str) -> list[str]:
    """The built-in options of the kind's config group: the yaml files of conf/<group>/."""
    folder = importlib.resources.files("backdoorbench.conf") / _check_kind(kind)
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir()
                  if p.name.endswith(".yaml") and not p.name.startswith("_"))


def is_class_path(value: Any) -> bool:
    """Whether a group choice names a class by path (`pkg.mod:Cls`) rather than a config option."""
    return isinstance(value, str) and ":" in value


def _base(kind: str) -> type:
    # Imported when a class is checked, not with this module: the registry lists entry point names
    # through it, which must not load torch and every base class.
    if kind == "attacks":
        from backdoorbench.attacks.base import Attack

        return Attack
    from backdoorbench.defenses.base import Defense

    return Defense


def load_class(path: str, kind: str) -> type:
    """The class `path` ("module:Class") names, checked to follow the kind's contract; ConfigError otherwise."""
    group = _check_kind(kind)
    module_name, colon, attr = path.partition(":")
    if not colon or not module_name or not attr:
        raise ConfigError(f"{group}={path!r} is not a class path; write module:Class, e.g. "
                          f"{group}=my_pkg.my_module:My{group.capitalize()}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{group}={path!r}: module {module_name!r} cannot be imported ({exc}); put its folder "
                          "on PYTHONPATH or install its package") from None
    except Exception as exc:  # noqa: BLE001  (the plugin's own module fails while importing: say where)
        raise ConfigError(f"{group}={path!r}: importing {module_name!r} failed: {type(exc).__name__}: {exc}") from None
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            public = sorted(n for n, v in vars(module).items()
                            if inspect.isclass(v) and v.__module__ == module.__name__ and not n.startswith("_"))
            raise ConfigError(f"{group}={path!r}: module {module_name!r} has no attribute {attr!r}; its classes: "
                              f"{', '.join(public) or 'none'}")
        target = getattr(target, part)
    base = _base(kind)
    if not (inspect.isclass(target) and issubclass(target, base)):
        raise ConfigError(f"{group}={path!r} is not a subclass of {base.__module__}.{base.__name__}; "
                          f"derive it from {base.__name__} (docs/extending.md)")
    name = getattr(target, "name", base.name)
    if name == base.name or not isinstance(name, str) or not name:
        raise ConfigError(f"{group}={path!r} has no name of its own; set the class attribute name = \"...\" "
                          "(records and the leaderboard show it)")
    if name in builtin_names(kind) and not target.__module__.startswith("backdoorbench."):
        raise ConfigError(f"{group}={path!r} is named {name!r}, the name of a built-in {group}; give it another name")
    return target


def _as_config_value(value: Any) -> tuple[bool, Any]:
    """(True, value as YAML can hold it) for None, numbers, strings and their lists/dicts; (False, None) else."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True, value
    if isinstance(value, (list, tuple)):
        items = [_as_config_value(v) for v in value]
        return all(ok for ok, _ in items), [v for _, v in items]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        items = {k: _as_config_value(v) for k, v in value.items()}
        return all(ok for ok, _ in items.values()), {k: v for k, (_, v) in items.items()}
    return False, None


def config_node(cls: type, kind: str) -> dict[str, Any]:
    """The group config of a plugin class: `_target_` and every keyword argument of its `__init__`
    (and of its bases' while it takes **kwargs on to them) at its default; one without a default
    is `???`, which the command line must give. Defaults YAML cannot hold stay the class's own."""
    node: dict[str, Any] = {"_target_": f"{cls.__module__}.{cls.__qualname__}"}
    skip = set(PASSED_BY_PIPELINE[kind])
    for klass in cls.__mro__:
        if "__init__" not in vars(klass) or klass is object:
            continue
        params = inspect.signature(klass.__init__).parameters.values()
        for param in list(params)[1:]:  # past self
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD) or param.name in skip or param.name in node:
                continue
            if param.default is param.empty:
                node[param.name] = "???"
                continue
            ok, value = _as_config_value(param.default)
            if ok:
                node[param.name] = value
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    return node


def _named_choices(overrides: list[str]) -> dict[str, list[str]]:
    """The options the command line picks for the attack and defense groups (each value of a sweep)."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:  # noqa: BLE001  (the preflight reports a line Hydra cannot parse, with its fix)
        return {}
    named: dict[str, list[str]] = {group: [] for group in GROUPS}
    for override in parsed:
        if override.key_or_group not in GROUPS or override.package is not None or override.is_delete():
            continue
        # sweep_iterator: the values themselves (sweep_string_iterator escapes the colon, `a.b\\:C`)
        try:
            values = list(override.sweep_iterator()) if override.is_sweep_override() else [override.value()]
        except Exception:  # noqa: BLE001, S112  (a glob(...) picks among the config files: no plugin in it)
            continue
        named[override.key_or_group] += [v for v in values if isinstance(v, str)]
    return named


def register(overrides: list[str], reserved: Callable[[str], dict[str, str]] | None = None) -> list[str]:
    """Store a ConfigStore option for each plugin `overrides` name (class paths and installed entry
    points) before Hydra composes; returns the options stored. A bad path, or an installed entry
    point named like a built-in, is a ConfigError. `reserved(group)`: the built-ins' aliases (alias ->
    option, `registry.builtin_aliases`), which an entry point may not take either: `defense=nc` means
    Neural Cleanse, as the hints say. Asked only when an entry point is installed (it loads the classes)."""
    store = ConfigStore.instance()
    named = _named_choices(overrides)
    stored = []
    for kind, group in KINDS.items():
        installed = entry_point_names(kind)
        builtins = set(builtin_names(kind))
        taken = reserved(group) if reserved is not None and installed else {}
        for name in installed:
            if name in builtins or name in taken:
                what = f"the built-in {group} {name!r}" if name in builtins else \
                    f"the alias of the built-in {group} {taken[name]!r}"
                raise ConfigError(f"the {group} entry point {name!r} of {_entry_point_owner(kind, name)} clashes with "
                                  f"{what}; rename the entry point (backdoorbench.{kind})")
        for choice in dict.fromkeys(named.get(group, [])):
            if is_class_path(choice) or "." in choice:  # no option has a dot: a path missing its colon
                path = choice
            elif choice in installed:
                path = installed[choice]
            else:
                continue  # a built-in option, or a wrong name the preflight reports with the valid ones
            store.store(group=group, name=choice, node=config_node(load_class(path, kind), kind))
            stored.append(f"{group}={choice}")
    return stored
