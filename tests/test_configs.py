"""Every option of every config group composes, and attack/defense configs match their classes."""

import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import backdoorbench
from backdoorbench.attacks.base import Attack, TrainingAttack
from backdoorbench.defenses.base import Defense, InputDefense

CONF = Path(backdoorbench.__file__).parent / "conf"


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def classes_in(package: str, base: type) -> dict[str, type]:
    """name -> class for every concrete subclass of `base` defined in the package's modules: one that
    names itself (a shared base such as defenses.pre_activation's declares no `name` of its own)."""
    found = {}
    pkg = importlib.import_module(package)
    for info in pkgutil.iter_modules(pkg.__path__):
        module = importlib.import_module(f"{package}.{info.name}")
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if (issubclass(obj, base) and obj.__module__ == module.__name__ and "name" in vars(obj)
                    and obj not in (Attack, TrainingAttack, Defense, InputDefense)):
                found[obj.name] = obj
    return found


@pytest.mark.parametrize("group", ["dataset", "model", "attack", "defense", "trainer", "logger"])
def test_every_option_composes(group, compose_cfg):
    for option in options(group):
        cfg = compose_cfg(f"{group}={option}")
        assert cfg.seed == 0


def test_attack_configs_equal_attack_classes():
    classes = classes_in("backdoorbench.attacks", Attack)
    assert set(options("attack")) == set(classes)
    for name, cls in classes.items():
        assert cls.__module__ == f"backdoorbench.attacks.{name}", "one name in three places"


def test_defense_configs_equal_defense_classes():
    classes = classes_in("backdoorbench.defenses", Defense)
    assert set(options("defense")) - {"none"} == set(classes)
    for name, cls in classes.items():
        assert cls.__module__ == f"backdoorbench.defenses.{name}", "one name in three places"


@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32)])
def test_every_attack_config_instantiates_in_both_modes(shape, compose_cfg):
    from hydra.utils import instantiate

    from backdoorbench.errors import ConfigError

    for name in options("attack"):
        for mode in ("all2one", "all2all"):
            cfg = compose_cfg(f"attack={name}", f"attack.target_mode={mode}")
            try:
                attack = instantiate(cfg.attack, num_classes=10, image_shape=shape)
            except Exception as exc:  # a clean-label attack may refuse all2all with a clear ConfigError
                cause = exc.__cause__ or exc
                assert isinstance(cause, ConfigError) and mode == "all2all" and "\n" not in str(cause), (name, mode, exc)
                continue
            assert attack.name == name and attack.target_mode == mode


def test_every_defense_config_instantiates(compose_cfg):
    from hydra.utils import instantiate

    for name in options("defense"):
        cfg = compose_cfg(f"defense={name}")
        if cfg.defense is None:
            assert name == "none"
            continue
        defense = instantiate(cfg.defense)
        assert defense.name == name and defense.stage in ("pre_train", "in_train", "post_train", "input")
