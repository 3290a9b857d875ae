"""What the package offers, by name: the options of `conf/<group>/*.yaml` (and, for attacks and
defenses, installed plugins' entry points), the class behind each, and what each class declares
about itself. Everything that lists methods reads the lists here; none is typed twice.

A method's declaration is its class's attributes: `family` (the kind of trigger or of repair),
`aliases` (the short names people use for it), an attack's `kind` (data poisoning or training-
controlled) and `clean_label`, a defense's `stage`, `needs_clean_data` (it uses the defender's
clean subset: the clean-budget sweep's defenses), `sensitivity` (the keys its sensitivity sweep
varies) and its threat model (`excludes`). A dataset's loader function and a model class carry
`aliases` too. Building one by name is `backdoorbench.factory` (`create_attack`, ...).

>>> import backdoorbench
>>> backdoorbench.list_attacks()[:3]
['adaptive_blend', 'badnets', 'blended']
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Any

from hydra.utils import get_object
from omegaconf import OmegaConf

from backdoorbench import plugins
from backdoorbench.errors import ConfigError

GROUPS = ("attack", "defense", "model", "dataset")
PLUGIN_KINDS = {"attack": "attacks", "defense": "defenses"}  # groups an entry point may add to
# The option of a group that selects nothing (attack=none, defense=none) also answers to these.
NONE_ALIASES = ("no", "null")


def _check_group(group: str) -> str:
    if group not in GROUPS:
        raise ConfigError(f"group={group!r} has no registry; use one of: {', '.join(GROUPS)}")
    return group


def builtin_names(group: str) -> list[str]:
    """The package's own options of `group`: the yaml files of conf/<group>/, without `_` helpers."""
    folder = resources.files("backdoorbench.conf") / _check_group(group)
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir()
                  if p.name.endswith(".yaml") and not p.name.startswith("_"))


def plugin_names(group: str) -> dict[str, str]:
    """Installed entry points of `group` (attack or defense): name -> "module:Class"; {} for others."""
    kind = PLUGIN_KINDS.get(_check_group(group))
    return plugins.entry_point_names(kind) if kind else {}


def names(group: str) -> list[str]:
    """Every option of `group`, sorted: the built-in ones and the installed plugins'."""
    return sorted({*builtin_names(group), *plugin_names(group)})


def list_attacks() -> list[str]:
    """The attacks `attack=<name>` accepts, sorted (`none` is the clean control)."""
    return names("attack")


def list_defenses() -> list[str]:
    """The defenses `defense=<name>` accepts, sorted (`none` runs no defense)."""
    return names("defense")


def list_models() -> list[str]:
    """The models `model=<name>` accepts, sorted (`timm` takes any timm architecture by `model.name`)."""
    return names("model")


def list_datasets() -> list[str]:
    """The datasets `dataset=<name>` accepts, sorted."""
    return names("dataset")


@functools.cache
def _target(group: str, name: str) -> str | None:
    """The `_target_` of conf/<group>/<name>.yaml; None where the option builds nothing (defense=none)."""
    text = (resources.files("backdoorbench.conf") / group / f"{name}.yaml").read_text(encoding="utf-8")
    return OmegaConf.create(text).get("_target_")


def method_class(group: str, name: str) -> Any:
    """The class behind option `name` of `group` (a dataset's: its loader function), imported;
    None for an option that builds nothing (defense=none)."""
    if name in builtin_names(group):
        target = _target(group, name)
        return get_object(target) if target else None
    installed = plugin_names(group)
    if name in installed:
        return plugins.load_class(installed[name], PLUGIN_KINDS[group])
    raise ConfigError(f"{group}={name!r} is not an option; choose one of: {', '.join(names(group))}")


def classes(group: str, builtin_only: bool = False) -> dict[str, Any]:
    """name -> class for every option of `group` that builds something."""
    options = builtin_names(group) if builtin_only else names(group)
    found = {name: method_class(group, name) for name in options}
    return {name: cls for name, cls in found.items() if cls is not None}


def aliases(group: str, builtin_only: bool = False) -> dict[str, str]:
    """alias -> option for `group`, from each option's class (`aliases`) and the `none` rule."""
    table: dict[str, str] = {}
    for name in builtin_names(_check_group(group)) if builtin_only else names(_check_group(group)):
        declared = tuple(getattr(method_class(group, name), "aliases", ()))
        for alias in declared + (NONE_ALIASES if name == "none" else ()):
            table[alias] = name
    return table


def builtin_aliases(group: str) -> dict[str, str]:
    """alias -> option for the package's own options of `group`: names a plugin may not take."""
    return aliases(group, builtin_only=True)


def sensitivity() -> dict[str, tuple[str, ...]]:
    """defense -> the config keys (under `defense.`) its sensitivity sweep varies, for every built-in
    defense that declares them (its preset is conf/experiment/sensitivity_<defense>.yaml)."""
    return {name: tuple(cls.sensitivity) for name, cls in classes("defense", builtin_only=True).items()
            if getattr(cls, "sensitivity", ())}


def clean_budget_defenses() -> tuple[str, ...]:
    """The built-in defenses that use the defender's clean subset (`needs_clean_data`): the clean-budget sweep's."""
    return tuple(name for name, cls in classes("defense", builtin_only=True).items() if cls.needs_clean_data)


def metadata(group: str, name: str) -> dict[str, Any]:
    """What option `name`'s class declares about itself, as plain values (the README's tables)."""
    cls = method_class(group, name)
    info: dict[str, Any] = {"name": name, "aliases": tuple(getattr(cls, "aliases", ()))}
    if group == "attack":
        info.update(kind=cls.kind, family=cls.family, clean_label=bool(cls.clean_label),
                    learned_trigger=bool(cls.learned_trigger))
    elif group == "defense" and cls is not None:
        info.update(stage=cls.stage, family=cls.family, needs_clean_data=bool(cls.needs_clean_data),
                    sensitivity=tuple(getattr(cls, "sensitivity", ())),
                    meets_training_controlled_attacks=bool(cls.meets_training_controlled_attacks))
    return info


def _cell(values: tuple[str, ...] | str) -> str:
    values = (values,) if isinstance(values, str) else values
    return ", ".join(f"`{v}`" for v in values) or "-"


def method_table(group: str) -> str:
    """The Markdown table of the built-in attacks or defenses and their declarations (the README's)."""
    rows = [metadata(group, name) for name in builtin_names(group)]
    if group == "attack":
        lines = ["| attack | kind | trigger family | clean-label | also called |", "|---|---|---|---|---|"]
        lines += [f"| `{r['name']}` | {r['kind'].replace('_', ' ')} | {r['family'].replace('_', ' ')} | "
                  f"{'yes' if r['clean_label'] else 'no'} | {_cell(r['aliases'])} |" for r in rows]
    elif group == "defense":
        header = "| defense | stage | family | clean data | sensitivity sweep | meets training-controlled attacks | also called |"
        lines = [header, "|---|---|---|---|---|---|---|"]
        lines += [f"| `{r['name']}` | {r['stage'].replace('_', '-')} | {r['family'].replace('_', ' ')} | "
                  f"{'yes' if r['needs_clean_data'] else 'no'} | {_cell(r['sensitivity'])} | "
                  f"{'yes' if r['meets_training_controlled_attacks'] else 'through the set they export (WaNet, Input-aware)'} | "
                  f"{_cell(r['aliases'])} |"
                  for r in rows if "stage" in r]
    else:
        raise ConfigError(f"group={group!r} has no method table; use attack or defense")
    return "\n".join(lines) + "\n"


def with_method_tables(text: str) -> str:
    """`text` (the README) with the tables between `<!-- registry:attack -->` / `<!-- registry:defense -->`
    and `<!-- /registry -->` regenerated (`python -m backdoorbench.registry README.md` writes them)."""
    for group in ("attack", "defense"):
        start = f"<!-- registry:{group} -->\n"
        head, found, rest = text.partition(start)
        if not found or "<!-- /registry -->" not in rest:
            raise ConfigError(f"the text has no {start.strip()} ... <!-- /registry --> block to fill")
        text = head + start + method_table(group) + "<!-- /registry -->" + rest.partition("<!-- /registry -->")[2]
    return text


if __name__ == "__main__":
    import sys
    from pathlib import Path

    for readme in map(Path, sys.argv[1:]):
        readme.write_text(with_method_tables(readme.read_text(encoding="utf-8")), encoding="utf-8")
