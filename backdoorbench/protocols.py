"""The evaluation protocols over many records: which hyper-parameters a defense's
sensitivity sweep varies, and the defaults they vary around. The sweeps themselves are the
presets `conf/experiment/sensitivity_<defense>.yaml` and `clean_budget.yaml`; the ledger gives
the source of each choice (docs/fidelity.md#protocols)."""

from __future__ import annotations

import functools
from importlib import resources
from typing import Any

from omegaconf import OmegaConf

from backdoorbench import registry

# SENSITIVITY (defense -> the config keys, under `defense.`, its sensitivity sweep varies: the one or
# two values a user of the defense must choose and the paper or its code fixed) and
# CLEAN_BUDGET_DEFENSES (those that use the defender's clean subset: the clean-budget sweep's) are the
# defense classes' own declarations (`sensitivity`, `needs_clean_data`), read through the registry
# when first asked for, so that importing this module loads no defense.
_DERIVED = {"SENSITIVITY": registry.sensitivity, "CLEAN_BUDGET_DEFENSES": registry.clean_budget_defenses}
CLEAN_BUDGET_KEY = "clean_fraction"


def __getattr__(name: str) -> Any:
    if name in _DERIVED:
        return _DERIVED[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.lru_cache(maxsize=None)
def _group_defaults(group: str, name: str) -> dict[str, Any]:
    """The values of `conf/<group>/<name>.yaml` (`name` may name a subfolder: `sig/mnist/sig`); {} if none."""
    path = resources.files("backdoorbench.conf").joinpath(group, *f"{name}.yaml".split("/"))
    if not path.is_file():
        return {}
    node = OmegaConf.to_container(OmegaConf.create(path.read_text(encoding="utf-8")), resolve=False)
    return node if isinstance(node, dict) else {}


def paper_preset(overrides: list[str] | None) -> str | None:
    """The paper preset a run's command-line overrides chose (`paper=sig/mnist`), or None."""
    chosen = None
    for override in overrides or ():
        key, _, value = str(override).lstrip("+~").partition("=")
        if key == "paper":
            chosen = value if value not in ("", "null") else None
    return chosen


def defense_defaults(name: str) -> dict[str, Any]:
    """The values of `conf/defense/<name>.yaml` (the defaults a sweep is centred on); {} if none."""
    return _group_defaults("defense", name)


def at_defaults(defense_config: dict[str, Any] | None, name: str) -> bool:
    """Whether a record's `config.defense` has the default value of every key `name` sweeps."""
    defaults = defense_defaults(name)
    keys = registry.sensitivity().get(name, ())
    return bool(keys) and defense_config is not None and all(
        key in defaults and defense_config.get(key) == defaults[key] for key in keys)


def attack_defaults(name: str, paper: str | None = None) -> dict[str, Any]:
    """The values of `conf/attack/<name>.yaml`; {} if none. Under a paper preset, with the values its
    `conf/paper_attack/<paper>/<name>.yaml` sets on top: a preset's own setting is its attack's defaults."""
    defaults = _group_defaults("attack", name)
    if paper and defaults:
        preset = {key: value for key, value in _group_defaults("paper_attack", f"{paper}/{name}").items()
                  if key != "defaults"}
        defaults = {**defaults, **preset}
    return defaults


def attack_at_defaults(attack_config: dict[str, Any] | None, name: str,
                       protocol: dict[str, Any] | None = None, paper: str | None = None) -> bool:
    """Whether a record's `config.attack` holds the default of every key of `conf/attack/<name>.yaml`
    it has (the target mode aside: both modes are protocol settings); a key the record lacks (an older
    record) counts as default. A default the protocol sets (`${oc.select:protocol.methods...}`) is
    resolved against the record's `config.protocol` (its fallback where the record names none). Under
    a paper preset (`paper`) the preset's attack values are the defaults."""
    defaults = attack_defaults(name, paper)
    if attack_config is None or not defaults:
        return False
    defaults = OmegaConf.to_container(
        OmegaConf.create({"attack": defaults, "protocol": protocol or {}}), resolve=True)["attack"]
    return all(attack_config.get(key, value) == value for key, value in defaults.items()
               if key not in ("_target_", "target_mode"))
