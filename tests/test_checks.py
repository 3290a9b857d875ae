import math

import pytest

from backdoorbench import checks
from backdoorbench.errors import ConfigError


def refusal(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("value", [True, False, "0.5", [0.5], math.nan])
def test_bools_strings_lists_and_nan_are_not_numbers(value):
    assert not checks.is_number(value)
    refusal(checks.number, "attack", "alpha", value, 0, 1)


def test_bools_are_not_integers():
    assert checks.is_integer(3) and not checks.is_integer(True) and not checks.is_integer(3.0)
    assert refusal(checks.integer, "trainer", "epochs", True, 0) == "trainer.epochs=True is invalid; use an integer >= 0"


def test_number_returns_a_float_and_honours_open_and_closed_ends():
    assert checks.number("attack", "poison_rate", 1, 0, 1, low_open=True) == 1.0
    assert isinstance(checks.number("attack", "poison_rate", 1, 0, 1, low_open=True), float)
    assert checks.number("defense", "max_acc_drop", 0, 0, 1) == 0.0
    assert refusal(checks.number, "attack", "poison_rate", 0, 0, 1, low_open=True) == \
        "attack.poison_rate=0 is out of range; use a number in (0, 1]"
    assert refusal(checks.number, "defense", "frr", 1, 0, 1, low_open=True, high_open=True) == \
        "defense.frr=1 is out of range; use a number in (0, 1)"
    assert refusal(checks.number, "attack", "neg_ratio", 1.0, 0, 1, high_open=True) == \
        "attack.neg_ratio=1.0 is out of range; use a number in [0, 1)"


def test_bounds_print_as_given():
    assert refusal(checks.number, "attack", "eps", 2, 0.0, 1.0, low_open=True) == \
        "attack.eps=2 is out of range; use a number in (0.0, 1.0]"


def test_a_number_bounded_below_only():
    assert checks.number("defense", "lr", math.inf, 0, low_open=True) == math.inf
    assert refusal(checks.number, "defense", "lr", 0, 0, low_open=True) == "defense.lr=0 is invalid; use a number > 0"
    assert refusal(checks.number, "defense", "gamma", -1, 0) == "defense.gamma=-1 is invalid; use a number >= 0"
    assert refusal(checks.number, "defense", "scale", math.inf, 0, low_open=True, high_open=True) == \
        "defense.scale=inf is invalid; use a finite number > 0"


def test_allow_none_lets_none_through_and_says_so():
    assert checks.number("attack", "test_eps", None, 0, 1, allow_none=True) is None
    assert checks.integer("attack", "generator_width", None, 1, allow_none=True) is None
    refusal(checks.number, "attack", "test_eps", None, 0, 1)
    refusal(checks.integer, "attack", "generator_width", None, 1)
    assert refusal(checks.number, "attack", "test_eps", 1.5, 0, 1, low_open=True, allow_none=True) == \
        "attack.test_eps=1.5 is out of range; use a number in (0, 1] or null"
    assert refusal(checks.integer, "attack", "generator_width", 0, 1, allow_none=True) == \
        "attack.generator_width=0 is invalid; use an integer >= 1 or null"


def test_integer_range_and_hint():
    assert checks.integer("attack", "target", 9, 0, 9) == 9
    assert refusal(checks.integer, "attack", "target", 10, 0, 9) == \
        "attack.target=10 is out of range; use an integer in [0, 9]"
    assert refusal(checks.integer, "attack", "target", 1.0, 0, 9) == \
        "attack.target=1.0 is out of range; use an integer in [0, 9]"
    assert refusal(checks.integer, "attack", "squeeze_num", 1, 2, 255, hint="levels per channel") == \
        "attack.squeeze_num=1 is out of range; use an integer in [2, 255] (levels per channel)"


def test_the_message_names_the_full_key_or_a_top_level_one():
    assert refusal(checks.number, "eval.pgd", "eps", 8, 0, 1).startswith("eval.pgd.eps=8 is out of range")
    assert refusal(checks.integer, "", "seed", -1, 0) == "seed=-1 is invalid; use an integer >= 0"
    assert refusal(checks.number, "attack", "s", "big", 0, hint="the paper uses 0.5") == \
        "attack.s='big' is invalid; use a number >= 0 (the paper uses 0.5)"
