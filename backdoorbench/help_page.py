"""The config-group listing of `python -m backdoorbench --help` (conf/hydra/help/backdoorbench.yaml).

Hydra's own `$APP_CONFIG_GROUPS` lists every option, internal ones too (`model=_for_cifar10`,
`trainer=_schema`) and groups a user never picks (`paper_attack`). The help template asks these
resolvers instead: `${backdoorbench_groups:}` lists the groups a user sets, their options without
internal ones, and marks the option the command line (or the default) chose;
`${backdoorbench_settings:}` lists the settings most runs change, with their values now.
The command line (backdoorbench.cli) registers them; importing this module registers nothing.
"""

from __future__ import annotations

import textwrap
from importlib.resources import files

from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

RESOLVERS = ("backdoorbench_groups", "backdoorbench_settings")

# (group, what it picks): the order of the help page; paper_attack follows `paper`, not the user.
GROUPS = (
    ("dataset", "the data (MNIST, CIFAR-10, GTSRB, TinyImageNet)"),
    ("model", "the architecture; model=timm model.name=<any timm model>"),
    ("attack", "the backdoor attack"),
    ("defense", "the defense applied to the attacked model"),
    ("trainer", "the training loop"),
    ("trainer/optimizer", "the optimizer"),
    ("logger", "where per-epoch metrics go"),
    ("protocol", "the training recipe; default = the dataset's own (backdoorbench or quick)"),
    ("paper", "a paper's per-dataset setting, e.g. paper=lira/cifar10"),
    ("experiment", "a preset sweep, run with --multirun"),
    ("hydra/launcher", "how a --multirun sweep runs its jobs"),
)

# (key, what it sets), shown with the value the command line (or the default) gives it.
SETTINGS = (
    ("seed", "the run's seed (poisoned samples, training, defense)"),
    ("device", "auto (CUDA when present, else the CPU), cpu, cuda, cuda:N"),
    ("results_dir", "records, logs, the victim cache and Hydra's outputs go under it"),
    ("trainer.epochs", "also trainer.batch_size, trainer.optimizer.lr, trainer.schedule"),
    ("attack.poison_rate", "the poisoned fraction of the training set"),
    ("attack.target_mode", "all2one (every poisoned sample to attack.target) or all2all (y -> y+1 mod C)"),
    ("attack.target", "the target class of all2one"),
    ("defense.clean_fraction", "the clean share of the training set a defense may use"),
)

WIDTH = 100


def group_options(loader, group: str) -> list[str]:
    """Options of `group`, those in its subfolders as `sub/option` (e.g. paper=lira/mnist)."""
    options = list(loader.get_group_options(group))
    for sub in loader.list_groups(group):
        options += [f"{sub}/{option}" for option in group_options(loader, f"{group}/{sub}")]
    return options


def _options(group: str) -> list[str]:
    loader = GlobalHydra.instance().config_loader()
    # paper's options live in subfolders (paper=lira/cifar10); trainer's subfolder is its own group
    options = group_options(loader, group) if group == "paper" else loader.get_group_options(group)
    return sorted(o for o in options if not o.startswith("_"))


def _usual_model(choice: str) -> str | None:
    """The model that conf/model/_for_<dataset>.yaml picks through its defaults list."""
    try:
        defaults = OmegaConf.create(files("backdoorbench.conf").joinpath("model", f"{choice}.yaml").read_text())
        return str(defaults.defaults[0])
    except (OSError, AttributeError, IndexError, KeyError):
        return None


def group_listing(_root_=None) -> str:
    """Each group with its options, `*` on the chosen one, wrapped to the page width."""
    choices = dict(_root_.hydra.runtime.choices) if _root_ is not None else {}
    lines = []
    for group, what in GROUPS:
        chosen = choices.get(group)
        marked = [f"{o}*" if o == chosen else o for o in _options(group)]
        if group == "model" and str(chosen).startswith("_for_"):  # the dataset's usual model
            usual = _usual_model(str(chosen))
            marked = [f"{o}* (the dataset's usual one)" if o == usual else o for o in marked]
        head = f"  {group:<18} {what}"
        body = textwrap.fill(", ".join(marked) if marked else "(none)", WIDTH, initial_indent=" " * 21,
                             subsequent_indent=" " * 21, break_on_hyphens=False)
        lines += [head, body]
    return "\n".join(lines)


def settings_listing(_root_=None) -> str:
    """The settings most runs change, each with its value now (or a placeholder where the chosen
    option has no such key, e.g. defense.clean_fraction with defense=none)."""
    rows = []
    for key, what in SETTINGS:
        value = OmegaConf.select(_root_, key, default=None) if _root_ is not None else None
        rows.append((f"{key}={value}" if value is not None else f"{key}=...", what))
    width = max(len(left) for left, _ in rows) + 2
    return "\n".join(f"  {left:<{width}}{what}" for left, what in rows)


def register() -> None:
    """Make `${backdoorbench_groups:}` and `${backdoorbench_settings:}` resolvable (idempotent)."""
    for name, function in zip(RESOLVERS, (group_listing, settings_listing)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, function)
