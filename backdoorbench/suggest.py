"""Near misses on the command line: what the user probably meant, as a short hint for the error line.

Three kinds: a config-group option typed with another case, an abbreviation or a close spelling
(`attack=Badnets`, `defense=nc`); a key spelled nearly right (`attack.poisonrate`); and a word
without `=` (`attack badnets`). A timm model name given as `model=` points to `model=timm`.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Iterable

from backdoorbench import registry


def __getattr__(name: str):
    # ALIASES (group -> {alias: option}): the short names people use in papers and other toolkits for
    # our options, as each option's class declares them (`aliases`); read when first asked for.
    if name == "ALIASES":
        return {group: registry.aliases(group) for group in registry.GROUPS}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _folded(name: str) -> str:
    """Case, dashes and underscores ignored: `Neural-Cleanse` and `neuralcleanse` meet `neural_cleanse`."""
    return name.lower().replace("-", "").replace("_", "")


def closest(word: str, candidates: Iterable[str], aliases: dict[str, str] | None = None) -> str | None:
    """The one candidate `word` most likely meant, or None when none is close."""
    candidates = list(candidates)
    folded = {_folded(c): c for c in candidates}
    if _folded(word) in folded:
        return folded[_folded(word)]
    alias = (aliases or {}).get(word.lower().replace("-", "_"))
    if alias in candidates:
        return alias
    match = difflib.get_close_matches(word.lower(), candidates, n=1, cutoff=0.8)
    if match:
        return match[0]
    # a prefix long enough to mean one option only (`defense=neural`, `attack=label`)
    starts = [c for c in candidates if len(word) >= 3 and c.startswith(word.lower())]
    return starts[0] if len(starts) == 1 else None


@functools.lru_cache(maxsize=64)
def is_timm_model(name: str) -> bool:
    """Whether timm can build `name` (its registry is local: no download)."""
    try:
        import timm
    except ImportError:
        return False
    return bool(name) and timm.is_model(name)


def option_hint(group: str, value: str, valid: list[str]) -> str | None:
    """`did you mean ...?` for an unknown option of `group`, or None."""
    if group == "model" and value not in valid and "timm" in valid and is_timm_model(value):
        return f"{value} is a timm model: write model=timm model.name={value}"
    match = closest(value, valid, registry.aliases(group) if group in registry.GROUPS else None)
    return f"did you mean {group}={match}?" if match else None


# Keys that have another name now, so an old command line gets the new spelling (old key -> how to write it).
RENAMED_KEYS: dict[str, str] = {"eval.lpips_weights": "eval.lpips=<path> (or auto, off)"}


def key_hint(key: str, cfg) -> str | None:
    """`did you mean attack.poison_rate?` for a dotted key absent from the composed `cfg`, or None
    when the key exists or nothing near it does."""
    from omegaconf import DictConfig

    if key in RENAMED_KEYS:
        return f"it was renamed: write {RENAMED_KEYS[key]}"
    node, parts = cfg, key.split(".")
    for depth, part in enumerate(parts):
        if not isinstance(node, DictConfig):
            return None
        if part not in node:
            match = closest(part, [str(k) for k in node.keys() if not str(k).startswith("_")])
            return f"did you mean {'.'.join([*parts[:depth], match, *parts[depth + 1:]])}?" if match else None
        node = node._get_node(part)
    return None


def bare_word_hint(words: list[str], groups: dict[str, list[str]], keys: Iterable[str] = ()) -> str | None:
    """The fix for the first override written without `=` (`attack badnets` -> `write attack=badnets`),
    or None when every word has one. `groups` maps each config group to its options; `keys` are
    the config's top-level keys (`seed`, `results_dir`, ...)."""
    keys = set(keys)
    for i, word in enumerate(words):
        if "=" in word or word.startswith("~"):
            continue  # `~key` deletes a key and takes no value
        following = words[i + 1] if i + 1 < len(words) and "=" not in words[i + 1] else None
        if word in groups:
            value = following if following is not None else "<" + "|".join(groups[word][:4]) + "|...>"
            return f"{word!r} needs a value: write {word}={value}"
        owners = [group for group, options in groups.items() if word in options]
        if owners:
            return f"{word!r} needs its group: write {owners[0]}={word}"
        if following is not None and word.split(".")[0] in keys:
            return f"{word!r} needs a value: write {word}={following}"
        return f"{word!r} is not an override; write key=value, e.g. attack=badnets"
    return None
