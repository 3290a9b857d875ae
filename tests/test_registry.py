"""The registry: every option of conf/ is listed, names a class that declares its metadata, and is
built by name as a run builds it; a bad name is one line with the closest valid one."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

import pytest
import torch

import backdoorbench
from backdoorbench import factory, registry
from backdoorbench.attacks.base import Attack, TrainingAttack
from backdoorbench.defenses.base import Defense
from backdoorbench.errors import ConfigError, UserError
from backdoorbench.protocols import defense_defaults

STAGES = {"pre_train", "in_train", "post_train", "input"}
SNAKE = re.compile(r"^[a-z][a-z0-9_]*$")


def yaml_options(group: str) -> list[str]:
    folder = resources.files("backdoorbench.conf") / group
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml") and not p.name.startswith("_"))


@pytest.mark.parametrize("group", registry.GROUPS)
def test_every_conf_option_is_listed_sorted(group):
    listed = getattr(backdoorbench, f"list_{group}s")()
    assert listed == sorted(listed) and set(yaml_options(group)) <= set(listed)
    assert set(listed) - set(yaml_options(group)) == set(registry.plugin_names(group))


def test_the_public_api_is_the_registry():
    for name in backdoorbench.__all__:
        assert getattr(backdoorbench, name) is not None
    assert backdoorbench.create_attack is factory.create_attack and backdoorbench.list_models is registry.list_models
    with pytest.raises(AttributeError):
        backdoorbench.create_everything  # noqa: B018


@pytest.mark.parametrize("name", registry.builtin_names("attack"))
def test_every_attack_class_declares_its_metadata(name):
    cls = registry.method_class("attack", name)
    assert issubclass(cls, Attack) and cls.name == name and cls.__module__ == f"backdoorbench.attacks.{name}"
    assert SNAKE.match(vars(cls).get("family", "")), f"{cls.__name__} declares no family of its own"
    assert cls.kind == ("training_controlled" if issubclass(cls, TrainingAttack) else "data_poisoning")
    assert isinstance(vars(cls).get("aliases", ()), tuple)
    assert registry.metadata("attack", name)["learned_trigger"] is cls.learned_trigger


@pytest.mark.parametrize("name", sorted(registry.classes("defense", builtin_only=True)))
def test_every_defense_class_declares_its_metadata(name):
    cls = registry.method_class("defense", name)
    assert issubclass(cls, Defense) and cls.name == name and cls.__module__ == f"backdoorbench.defenses.{name}"
    assert SNAKE.match(vars(cls).get("family", "")), f"{cls.__name__} declares no family of its own"
    assert cls.stage in STAGES and isinstance(cls.needs_clean_data, bool)
    assert cls.excludes("wanet", registry.method_class("attack", "wanet")) is None or not cls.meets_training_controlled_attacks
    # the keys its sensitivity sweep varies are settings of its config, with a default to vary around
    assert cls.sensitivity and all(key in defense_defaults(name) for key in cls.sensitivity), cls.sensitivity
    if cls.needs_clean_data:  # the clean-budget sweep varies its clean subset
        assert "clean_fraction" in defense_defaults(name)


@pytest.mark.parametrize("group", registry.GROUPS)
def test_aliases_are_words_that_name_one_option_and_hide_none(group):
    options = registry.names(group)
    declared = [alias for name in options for alias in getattr(registry.method_class(group, name), "aliases", ())]
    assert len(declared) == len(set(declared)), "an alias names one option only"
    for alias, option in registry.aliases(group).items():
        assert option in options and alias not in options and SNAKE.match(alias), (alias, option)


def test_create_by_name_builds_what_the_run_builds():
    attack = backdoorbench.create_attack("badnets", poison_rate=0.05, patch_size=4)
    assert (attack.name, attack.poison_rate, attack.num_classes, attack.image_shape) == ("badnets", 0.05, 10, (1, 28, 28))
    x = torch.zeros(2, 1, 28, 28)
    assert attack.apply_trigger(x)[..., -4:, -4:].min() == 1  # the white 4x4 patch, bottom-right
    defense = backdoorbench.create_defense("fine_pruning", clean_fraction=0.1)
    assert (defense.name, defense.clean_fraction, defense.stage) == ("fine_pruning", 0.1, "post_train")
    net = backdoorbench.create_model("mnist_cnn", hidden=16)
    assert net(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    net = backdoorbench.create_model("mnist_cnn", hidden=16, in_channels=3, num_classes=4)  # the rest: mnist5k's
    assert net(torch.zeros(2, 3, 28, 28)).shape == (2, 4)


def test_a_bad_name_or_setting_is_one_line_naming_the_fix():
    cases = [(lambda: backdoorbench.create_attack("badnet"), "attack 'badnet' is unknown; did you mean 'badnets'?"),
             (lambda: backdoorbench.create_defense("nc"), "defense 'nc' is unknown; did you mean 'neural_cleanse'?"),
             (lambda: backdoorbench.create_dataset("cifr10"), "dataset 'cifr10' is unknown; did you mean 'cifar10'?"),
             (lambda: backdoorbench.create_model("badnets"), "model 'badnets' is unknown; choose one of: mnist_cnn"),
             (lambda: backdoorbench.create_attack("badnets", dataset="cifar"), "did you mean 'cifar10'?"),
             (lambda: backdoorbench.create_attack("badnets", patch=3),
              "attack.patch is not a setting of badnets; its settings: location, margin, patch_size")]
    for create, fragment in cases:
        with pytest.raises(UserError) as caught:
            create()
        assert isinstance(caught.value, ConfigError) and fragment in str(caught.value)
        assert "\n" not in str(caught.value)


def test_the_readme_tables_are_the_registrys():
    readme = Path(backdoorbench.__file__).parent.parent / "README.md"
    text = readme.read_text(encoding="utf-8")
    assert registry.with_method_tables(text) == text, "run: python -m backdoorbench.registry README.md"
    assert "| `neural_cleanse` | post-train | trigger inversion | yes | `anomaly_threshold` | yes | `nc` |" in text


@pytest.mark.slow
def test_every_option_is_created_by_name():
    """Each built-in attack, defense and model through create_*, for a gray and a colour dataset
    (models on the meta device: shapes only), and each dataset's config as its loader takes it."""
    import inspect

    built: dict[str, int] = {}
    for dataset in ("mnist5k", "cifar10"):
        for name in registry.builtin_names("attack"):
            assert backdoorbench.create_attack(name, dataset=dataset).name == name
        with torch.device("meta"):
            for name in registry.builtin_names("model"):
                try:
                    assert isinstance(backdoorbench.create_model(name, dataset=dataset), torch.nn.Module)
                    built[name] = built.get(name, 0) + 1
                except ConfigError as exc:  # a model may refuse a dataset's shape (VGG under 32 px): in one line
                    assert "\n" not in str(exc) and name.split("_")[0] in str(exc)
    assert set(built) == set(registry.builtin_names("model"))
    for name in registry.builtin_names("defense"):
        defense = backdoorbench.create_defense(name)
        assert (defense is None) == (name == "none") and (defense is None or defense.name == name)
    for name in registry.builtin_names("dataset"):
        node = factory.method_config("dataset", name, dataset=name)
        inspect.signature(registry.method_class("dataset", name)).bind(**{k: v for k, v in node.items() if k != "_target_"})
    assert backdoorbench.create_dataset("mnist5k", test_per_class=50).test.labels.bincount().tolist() == [50] * 10
    # the protocol's values for the dataset, as `python -m backdoorbench attack=bpp dataset=cifar10` composes them
    assert factory.method_config("attack", "bpp", dataset="cifar10")["squeeze_num"] == 8
    with pytest.raises(ConfigError, match="^defense=none builds nothing and takes no settings; remove lr$"):
        backdoorbench.create_defense("none", lr=0.1)


def test_a_plugin_class_path_is_created_and_checked_like_a_built_in(tmp_path, monkeypatch):
    (tmp_path / "h4_registry_plugin.py").write_text(
        "from backdoorbench.defenses.base import Defense, DefenseResult\n"
        "class Keep(Defense):\n"
        "    name, stage, family = 'keep_model', 'post_train', 'identity'\n"
        "    def __init__(self, *, scale: float = 1.0, clean_fraction: float = 0.05):\n"
        "        super().__init__(clean_fraction=clean_fraction)\n"
        "        self.scale = scale\n"
        "    def apply(self, ctx):\n"
        "        return DefenseResult(model=ctx.model)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    defense = backdoorbench.create_defense("h4_registry_plugin:Keep", scale=2.0)
    assert (defense.name, defense.scale, defense.clean_fraction) == ("keep_model", 2.0, 0.05)
    with pytest.raises(ConfigError, match=r"^defense.scal is not a setting of h4_registry_plugin:Keep; "
                                          r"its settings: clean_fraction, scale$"):
        backdoorbench.create_defense("h4_registry_plugin:Keep", scal=2.0)
