"""Range checks of config values, each refusal one line that names the full key and what is valid.

    >>> number("attack", "poison_rate", 0, 0, 1, low_open=True)
    Traceback (most recent call last):
    ...
    backdoorbench.errors.ConfigError: attack.poison_rate=0 is out of range; use a number in (0, 1]

`group` is where the key sits (`attack`, `defense`, `trainer`, `eval.pgd`, ...; "" for a top-level
key such as `seed`). A value bounded on both sides is "out of range; use ... in [low, high]"; one
bounded below only is "invalid; use ... >= low". Bounds print as given, so pass 0.0 to show 0.0.

A bool is never a number here, though Python's True == 1: `poison_rate=true` is a slip, not 1.
NaN is never a number either (it passes no bound).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from backdoorbench.errors import ConfigError


def is_number(value: Any) -> bool:
    """An int or float, not a bool, not NaN; for the checks with a message of their own."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and not math.isnan(value)


def is_list(value: Any) -> bool:
    """A list as YAML gives it (a list, a tuple or OmegaConf's ListConfig), not a string."""
    return isinstance(value, Sequence) and not isinstance(value, str)


def is_integer(value: Any) -> bool:
    """An int, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def number(group: str, key: str, value: Any, low: float, high: float = math.inf, *, low_open: bool = False,
           high_open: bool = False, allow_none: bool = False, hint: str = "") -> float | None:
    """`value` as a float in [low, high] (open ends by flag), else a ConfigError naming `group.key`.

    An infinite `high` makes the bound one-sided (">= low"); `high_open` then also refuses inf.
    `allow_none` lets None through (returned as None); `hint` is added in parentheses.
    """
    if value is None and allow_none:
        return None
    if is_number(value) and (value > low if low_open else value >= low) and (value < high if high_open else value <= high):
        return float(value)
    if math.isinf(high):
        wanted = f"a {'finite ' if high_open else ''}number {'>' if low_open else '>='} {low}"
    else:
        wanted = f"a number in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    raise _refusal(group, key, value, wanted, not math.isinf(high), allow_none, hint)


def integer(group: str, key: str, value: Any, minimum: int, maximum: int | None = None, *,
            allow_none: bool = False, hint: str = "") -> int | None:
    """`value` if an int in [minimum, maximum] (no maximum: >= minimum), else a ConfigError naming
    `group.key`. `allow_none` lets None through; `hint` is added in parentheses."""
    if value is None and allow_none:
        return None
    if is_integer(value) and value >= minimum and (maximum is None or value <= maximum):
        return value
    wanted = f"an integer >= {minimum}" if maximum is None else f"an integer in [{minimum}, {maximum}]"
    raise _refusal(group, key, value, wanted, maximum is not None, allow_none, hint)


def _refusal(group: str, key: str, value: Any, wanted: str, bounded: bool, allow_none: bool, hint: str) -> ConfigError:
    name = f"{group}.{key}" if group else key
    verdict = "is out of range" if bounded else "is invalid"
    return ConfigError(
        f"{name}={value!r} {verdict}; use {wanted}{' or null' if allow_none else ''}{f' ({hint})' if hint else ''}"
    )
