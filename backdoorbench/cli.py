"""Command-line front of `python -m backdoorbench`: a preflight that turns bad input into one line.

Hydra reports an unknown option, key or type as a multi-line message with exit code 1. Before
Hydra starts (and writes anything), we compose every value of the command line once with
Hydra's compose API (its own `hydra...` overrides too, e.g. `hydra/launcher=joblib`) and report
the first problem as `error: ...`, exit code 2. The preflight leaves no folder behind, and a run
that fails a later check removes the files Hydra wrote for it, so bad input writes nothing.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path

from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

import backdoorbench.config  # noqa: F401  (registers the schemas)
from backdoorbench import help_page, plugins, registry
from backdoorbench.config import GROUPS, ignore_launcher_schema_match
from backdoorbench.errors import ConfigError, UserError
from backdoorbench.help_page import group_options
from backdoorbench.suggest import bare_word_hint, key_hint, option_hint

CONFIG_MODULE = "backdoorbench.conf"
VALUE_FLAGS = {"-c", "--cfg", "-p", "--package", "-cp", "--config-path", "-cn", "--config-name",
               "-cd", "--config-dir", "--experimental-rerun", "-sc", "--shell-completion"}
SKIP_FLAGS = {"-h", "--help", "--hydra-help", "--version", "-i", "--info", "-sc", "--shell-completion",
              "-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir", "--experimental-rerun"}

help_page.register()  # the config-group listing of --help (conf/hydra/help/backdoorbench.yaml)


def clean_budget_sweep() -> str:
    """`${clean_budget_defenses:}`, the defense sweep of conf/experiment/clean_budget.yaml: every built-in
    defense that declares `needs_clean_data`, in name order, as the comma list Hydra's sweeper reads
    (it resolves the value when it builds the sweeper, as the preflight does when it reads the sweeps)."""
    return ",".join(registry.clean_budget_defenses())


if not OmegaConf.has_resolver("clean_budget_defenses"):
    OmegaConf.register_new_resolver("clean_budget_defenses", clean_budget_sweep)


def split_overrides(argv: list[str]) -> tuple[list[str], bool]:
    """The override arguments of a Hydra command line, and whether preflight should be skipped."""
    overrides, skip, expect_value = [], False, False
    for arg in argv:
        if expect_value:
            expect_value = False
            continue
        flag = arg.split("=", 1)[0]
        if arg.startswith("-"):
            skip |= flag in SKIP_FLAGS
            expect_value = flag in VALUE_FLAGS and "=" not in arg
            continue
        overrides.append(arg)
    return overrides, skip


MAX_PRODUCT = 256  # group sweeps: compose every combination up to this many, else each value once


def _sum(choices: list[list[str]]) -> Iterator[list[str]]:
    """Each value of each sweep once, the other sweeps at their first value."""
    yield [c[0] for c in choices]
    for i, options in enumerate(choices):
        for value in options[1:]:
            yield [c[0] if j != i else value for j, c in enumerate(choices)]


def _combinations(overrides: list[str]) -> Iterator[list[str]]:
    """The combinations of the sweeps to compose: every combination of the config-group sweeps
    when there are at most MAX_PRODUCT (group choices interact, e.g. a paper setting's
    attack-specific file), and each value of the other sweeps once (sum, not product)."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    choices: list[list[str]] = []
    is_group: list[bool] = []
    for override in parsed:
        key = override.get_key_element()
        if override.is_sweep_override():
            choices.append([f"{key}={value}" for value in override.sweep_string_iterator()])
        else:
            choices.append([override.input_line])
        is_group.append(override.key_or_group in GROUPS and override.package is None)
    groups = [i for i, g in enumerate(is_group) if g]
    group_choices = [choices[i] for i in groups]
    if math.prod(len(c) for c in group_choices) <= MAX_PRODUCT:
        group_combinations = itertools.product(*group_choices)
    else:
        group_combinations = _sum(group_choices)
    firsts = [c[0] for c in choices]
    for combination in group_combinations:
        line = list(firsts)
        for i, value in zip(groups, combination):
            line[i] = value
        yield line
    for i, options in enumerate(choices):
        if not is_group[i]:
            for value in options[1:]:
                yield [c[0] if j != i else value for j, c in enumerate(choices)]


def _check_group_choices(overrides: list[str]) -> None:
    loader = GlobalHydra.instance().config_loader()
    for override in OverridesParser.create().parse_overrides(overrides):
        group = override.key_or_group  # e.g. attack, trainer/optimizer, hydra/launcher
        if group.split("/")[0] not in (*GROUPS, "hydra") or override.package is not None or override.is_delete():
            continue
        valid = sorted(o for o in group_options(loader, group) if not o.startswith("_"))
        # the values themselves: sweep_string_iterator escapes a class path's colon (`pkg.mod\\:Cls`)
        values = list(override.sweep_iterator()) if override.is_sweep_override() else [override.value()]
        for value in values:
            if not isinstance(value, str) or value not in valid:
                hint = option_hint(group, str(value), valid)
                options = f"one of: {', '.join(valid)}"
                if hint is None:
                    raise ConfigError(f"unknown {group} {value!r}; choose {options}")
                joined = f"{hint} Or choose" if hint.endswith("?") else f"{hint}, or choose"
                raise ConfigError(f"unknown {group} {value!r}; {joined} {options}")


SUBGROUPS = ("trainer/optimizer", "hydra/launcher")


def _check_bare_words(overrides: list[str]) -> None:
    """`attack badnets` (no `=`): Hydra's parser says "missing EQUAL at '<EOF>'"; say what to write."""
    if all("=" in word or word.startswith("~") for word in overrides):
        return
    loader = GlobalHydra.instance().config_loader()
    groups = {group: sorted(o for o in group_options(loader, group) if not o.startswith("_"))
              for group in (*GROUPS, *SUBGROUPS)}
    keys = compose(config_name="config", return_hydra_config=True).keys()
    hint = bare_word_hint(overrides, groups, keys)
    if hint:
        raise ConfigError(hint)


def _key_hint(overrides: list[str]) -> str | None:
    """For a key Hydra could not override: `X is not a setting of ...; did you mean Y?`, or None.
    Composes the command line's group choices alone (their first value) to see which keys exist."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    choices, keys = [], []
    for override in parsed:
        first = next(iter(override.sweep_string_iterator())) if override.is_sweep_override() else override.value()
        if override.key_or_group.split("/")[0] in (*GROUPS, "hydra") and "." not in override.key_or_group \
                and override.package is None and not override.is_delete():
            choices.append(f"{override.get_key_element()}={first}")
        elif not override.is_add() and not override.is_force_add() and not override.is_delete():
            keys.append(override.key_or_group)
    if not keys:
        return None
    cfg = compose(config_name="config", overrides=choices, return_hydra_config=True)
    for key in keys:
        hint = key_hint(key, cfg)
        if hint:
            head = key.split(".")[0]
            choice = cfg.hydra.runtime.choices.get(head)
            owner = f" of {head} {choice}" if choice is not None and head in GROUPS else ""
            return f"{key} is not a setting{owner}; {hint}"
    return None


def _one_line(exc: BaseException) -> str:
    """Hydra/OmegaConf messages are multi-line; keep the informative lines joined on one."""
    parts: list[str] = []
    while exc is not None:
        for line in str(exc).splitlines():
            line = line.strip()
            if line and not line.startswith(("object_type", "full_key", "reference_type", "To append")) and line not in parts:
                parts.append(line)
        exc = exc.__cause__
    return "; ".join(parts)


def _preset_multirun(overrides: list[str]) -> bool:
    """Whether a preset makes the command a sweep without --multirun (`hydra.mode: MULTIRUN`, e.g.
    experiment=defense_suite). Composes only when the command line picks an experiment."""
    if not any(o.split("=", 1)[0].lstrip("+~") == "experiment" for o in overrides):
        return False
    cfg = compose(config_name="config", overrides=next(_combinations(overrides)), return_hydra_config=True)
    return str(cfg.hydra.get("mode")).endswith("MULTIRUN")


def with_preset_sweeps(overrides: list[str]) -> list[str]:
    """`overrides` plus the sweeps an experiment preset sets in `hydra.sweeper.params` (Hydra's
    --multirun sweeps them too), except for keys the command line already sets (those win)."""
    first = next(_combinations(overrides))
    cfg = compose(config_name="config", overrides=first, return_hydra_config=True)
    params = cfg.hydra.sweeper.get("params") or {}
    given = {o.get_key_element().lstrip("+~") for o in OverridesParser.create().parse_overrides(overrides)}
    return overrides + [f"{key}={value}" for key, value in params.items() if key not in given]


def preflight(argv: list[str]) -> None:
    """Compose each distinct value of the command line and validate it; raise ConfigError."""
    # Here, not at the top: validation loads torch and the method classes (seconds), which the
    # help pages that return just below never need.
    from backdoorbench.validation import validate_config

    overrides, skip = split_overrides(argv)
    plugins.register(overrides, reserved=registry.builtin_aliases)  # `defense=pkg.mod:Cls` and entry points become options before Hydra composes
    if skip:
        if any(arg in ("-h", "--help") for arg in argv):
            _check_help_overrides(overrides)  # the page shows the choices: a wrong one is a line too
        return
    ignore_launcher_schema_match()  # again: a caller (e.g. pytest) may have reset the filters
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
            _check_bare_words(overrides)
            _check_group_choices(overrides)
            if any(arg in ("-m", "--multirun") for arg in argv) or _preset_multirun(overrides):
                overrides = with_preset_sweeps(overrides)
                _check_group_choices(overrides)
            for combination in _combinations(overrides):
                cfg = compose(config_name="config", overrides=combination, return_hydra_config=True)
                new_dirs = missing_dirs(cfg.results_dir)
                try:
                    validate_config(cfg)  # creates results_dir to prove it can be written
                finally:
                    remove_empty_dirs(new_dirs)
                NEW_DIRS.update(new_dirs)
    except UserError:
        raise
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        raise ConfigError(_near_miss(overrides) or _one_line(exc)) from exc
    finally:
        GlobalHydra.instance().clear()


def _check_help_overrides(overrides: list[str]) -> None:
    """The checks of names alone (no values, no folders) for `--help [overrides]`."""
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
            _check_bare_words(overrides)
            _check_group_choices(overrides)
    finally:
        GlobalHydra.instance().clear()


def _near_miss(overrides: list[str]) -> str | None:
    """A key spelled nearly right, named with its fix; None (keep Hydra's message) otherwise."""
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
            return _key_hint(overrides)
    except (HydraException, OmegaConfBaseException, ValueError):
        return None  # the group choices alone fail too: Hydra's own message says why


# Folders that did not exist before this process's preflight: a run that fails may remove them
# again once they are empty (a folder the user made stays, even when empty).
NEW_DIRS: set[Path] = set()


def missing_dirs(path: str | Path) -> list[Path]:
    """The folders of `path` that do not exist yet, deepest first."""
    path = Path(path).expanduser().absolute()
    missing = []
    for folder in (path, *path.parents):
        if folder.exists():
            break
        missing.append(folder)
    return missing


def remove_empty_dirs(folders: list[Path]) -> None:
    """rmdir each folder (deepest first) that exists and is empty; stop at the first that is not."""
    for folder in folders:
        try:
            folder.rmdir()
        except FileNotFoundError:
            continue
        except OSError:
            return


def discard_job_outputs(results_dir: str | Path) -> None:
    """Remove what Hydra wrote for the current job (its `.hydra/*.yaml` and the job log) and the
    folders left empty by that, up to `results_dir`: a run that failed leaves no trace of itself.
    Only Hydra's own files are deleted, by name, so an output dir pointed at a folder holding
    other files (e.g. hydra.run.dir=${results_dir}) keeps them."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
    output = Path(hydra_cfg.runtime.output_dir).absolute()
    files = [output / f"{hydra_cfg.job.name}.log"]
    if hydra_cfg.output_subdir is not None:
        subdir = output / str(hydra_cfg.output_subdir)
        files += [subdir / name for name in ("config.yaml", "hydra.yaml", "overrides.yaml")]
    for file in files:
        with suppress(OSError):
            file.unlink(missing_ok=True)
    results = Path(results_dir).expanduser().absolute()
    chain = [] if hydra_cfg.output_subdir is None else [output / str(hydra_cfg.output_subdir)]
    chain.append(output)
    chain += [folder for folder in output.parents if results in folder.parents]  # e.g. hydra/runs/<day>
    chain += [folder for folder in sorted(NEW_DIRS, key=lambda p: len(p.parts), reverse=True)
              if folder == results or folder in results.parents]
    remove_empty_dirs(chain)


def fail(exc: UserError) -> None:
    print(f"error: {exc}", file=sys.stderr)
    sys.exit(2)
