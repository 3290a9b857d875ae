"""backdoorbench: a benchmark toolkit for backdoor attacks and defenses on image classifiers.

The registry by name: `list_attacks()`, `list_defenses()`, `list_models()`, `list_datasets()`, and
`create_attack(name, **overrides)`, `create_defense`, `create_model`, `create_dataset`.
"""

import importlib

__version__ = "0.1.0"

# name -> the module that defines it. Loaded on first use: every module of the package imports
# `backdoorbench` first, and loading the registry (Hydra, the method classes) eagerly would make
# each of those imports pay for it, and make the registry's own imports run in a circle.
_API = {
    **dict.fromkeys(("list_attacks", "list_defenses", "list_models", "list_datasets"), "registry"),
    **dict.fromkeys(("create_attack", "create_defense", "create_model", "create_dataset"), "factory"),
}
__all__ = [
    "__version__",
    "create_attack",
    "create_dataset",
    "create_defense",
    "create_model",
    "list_attacks",
    "list_datasets",
    "list_defenses",
    "list_models",
]


def __getattr__(name: str):
    if name in _API:
        return getattr(importlib.import_module(f"backdoorbench.{_API[name]}"), name)
    raise AttributeError(f"module 'backdoorbench' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})
