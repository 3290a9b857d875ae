"""Near-miss suggestions for the command line (backdoorbench.suggest). The CLI cases, one error line
and exit 2 each, are in the hostile-input catalogue (tests/test_hostile.py)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from backdoorbench import registry
from backdoorbench.suggest import ALIASES, bare_word_hint, closest, is_timm_model, key_hint, option_hint


def options(group: str) -> list[str]:
    return registry.names(group)


def test_aliases_are_the_classes_declarations() -> None:
    """Each group's table is its options' `aliases` (plus no/null for `none`), typed nowhere else."""
    assert sorted(ALIASES) == sorted(registry.GROUPS)
    for group in registry.GROUPS:
        declared = {alias: name for name in options(group)
                    for alias in getattr(registry.method_class(group, name), "aliases", ())}
        assert ALIASES[group] == {**declared, **({"no": "none", "null": "none"} if "none" in options(group) else {})}
    # the short names of papers and other toolkits, as a user types them
    for group, alias, option in [("defense", "nc", "neural_cleanse"), ("attack", "iad", "input_aware"),
                                 ("dataset", "cifar", "cifar10"), ("model", "cnn", "mnist_cnn"), ("defense", "no", "none")]:
        assert option_hint(group, alias, options(group)) == f"did you mean {group}={option}?"


@pytest.mark.parametrize("group", sorted(ALIASES))
def test_every_alias_names_an_existing_option(group: str) -> None:
    valid = options(group)
    assert valid, group
    for alias, option in ALIASES[group].items():
        assert option in valid, (group, alias, option)
        assert alias not in valid, (group, alias)  # an alias never hides a real option
        assert closest(alias, valid, ALIASES[group]) == option


@pytest.mark.parametrize("group", ["attack", "defense", "dataset", "model"])
def test_each_option_is_found_again_from_a_near_miss(group: str) -> None:
    valid = options(group)
    for option in valid:
        assert closest(option.upper(), valid, ALIASES.get(group)) == option
        assert closest(option.replace("_", "-").title(), valid, ALIASES.get(group)) == option
        if len(option) >= 6:  # one letter dropped from a long enough name
            typo = option[:2] + option[3:]
            assert closest(typo, valid, ALIASES.get(group)) == option, typo


@pytest.mark.parametrize("word", ["nope", "xyz", "banana", "q", "resnet50"])
def test_unrelated_words_get_no_suggestion(word: str) -> None:
    for group in ("attack", "defense", "dataset"):
        assert closest(word, options(group), ALIASES.get(group)) is None, (group, word)


def test_timm_names_point_to_model_timm_and_others_do_not() -> None:
    builtin = options("model")
    assert is_timm_model("resnet50") and is_timm_model("convnext_tiny") and not is_timm_model("badnets")
    assert option_hint("model", "resnet50", builtin) == "resnet50 is a timm model: write model=timm model.name=resnet50"
    assert option_hint("model", "VGG11", builtin) == "did you mean model=vgg11?"  # a built-in wins over timm's vgg11
    assert option_hint("attack", "resnet50", options("attack")) is None  # only model= takes a model name


def test_key_hint_finds_a_sibling_at_any_depth() -> None:
    cfg = OmegaConf.create({"seed": 0, "attack": {"poison_rate": 0.1, "target": 0, "_target_": "x"},
                            "eval": {"pgd": {"steps": 40, "enabled": False}}})
    assert key_hint("attack.poisonrate", cfg) == "did you mean attack.poison_rate?"
    assert key_hint("atack.poison_rate", cfg) == "did you mean attack.poison_rate?"
    assert key_hint("eval.pgd.step", cfg) == "did you mean eval.pgd.steps?"
    assert key_hint("attack.poison_rate", cfg) is None  # exists: nothing to suggest
    assert key_hint("attack.colour", cfg) is None  # nothing near it
    assert key_hint("attack.target_", cfg) == "did you mean attack.target?"  # `_target_` is internal


def test_bare_words_get_the_override_they_meant() -> None:
    groups = {"attack": ["badnets", "blended"], "defense": ["none", "strip"]}
    assert bare_word_hint(["attack=badnets", "seed=1", "~defense"], groups, ["seed"]) is None
    assert bare_word_hint(["attack", "blended"], groups) == "'attack' needs a value: write attack=blended"
    assert bare_word_hint(["strip"], groups) == "'strip' needs its group: write defense=strip"
    assert bare_word_hint(["seed=1", "results_dir", "/tmp/x"], groups, ["seed", "results_dir"]) == \
        "'results_dir' needs a value: write results_dir=/tmp/x"
    assert bare_word_hint(["attack"], groups) == "'attack' needs a value: write attack=<badnets|blended|...>"
    assert bare_word_hint(["hello", "world"], groups) == "'hello' is not an override; write key=value, e.g. attack=badnets"
