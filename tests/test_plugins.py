"""A researcher's own attack and defense, by class path and by entry point, run as the built-ins are.

The plugin package is the worked example of docs/extending.md itself: its code blocks are written
into a temporary folder, so the page cannot drift from what runs. The entry points come from a
`*.dist-info` folder beside it (what pip would install), read by importlib.metadata from sys.path.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from backdoorbench import plugins
from backdoorbench.errors import ConfigError
from tests.conftest import ROOT

PAGE = ROOT / "docs" / "extending.md"
TINY = ("trainer.epochs=0", "defense.epochs=1", "eval.stealth_images=0", "logger=none", "trainer.progress=false")


def page_examples() -> dict[str, str]:
    """The page's python blocks that open with `# my_methods/<file>.py`: path -> code."""
    blocks = re.findall(r"```python\n# (my_methods/\w+\.py)\n(.*?)```", PAGE.read_text(encoding="utf-8"), re.DOTALL)
    return dict(blocks)


def write_plugins(root: Path, entry_points: str | None = None) -> tuple[Path, Path]:
    """The page's package under root/plugins, and its entry points as root/site/*.dist-info."""
    package = root / "plugins" / "my_methods"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    for path, code in page_examples().items():
        (root / "plugins" / path).write_text(code)
    dist = root / "site" / "my_methods-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-methods\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(entry_points or (
        "[backdoorbench.attacks]\nframe = my_methods.frame:Frame\n\n"
        "[backdoorbench.defenses]\nhead_reset = my_methods.head_reset:HeadReset\n"))
    return root / "plugins", root / "site"


@pytest.fixture
def on_path(tmp_path, monkeypatch):
    """The plugin package and its entry points importable in this process; the ConfigStore
    options the test stores and the imported plugin modules are gone afterwards."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance().repo
    before = {group: set(store.get(group, {})) for group in ("attack", "defense")}
    folders = write_plugins(tmp_path)
    for folder in folders:
        monkeypatch.syspath_prepend(str(folder))
    yield folders
    for group, names in before.items():
        for name in set(store.get(group, {})) - names:
            del store[group][name]
    for module in [m for m in sys.modules if m == "my_methods" or m.startswith("my_methods.")]:
        del sys.modules[module]


def cli_env(*folders: Path) -> dict[str, str]:
    paths = [str(f) for f in folders] + [os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1"}


def run_cli(env: dict[str, str], *args: str, module: str = "backdoorbench") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600, check=False)


def records(results_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((results_dir / "runs").rglob("*.json"))]


def test_the_page_holds_an_attack_and_a_defense_of_about_30_lines():
    examples = page_examples()
    assert set(examples) == {"my_methods/frame.py", "my_methods/head_reset.py"}
    for code in examples.values():
        assert 20 <= len(code.strip().splitlines()) <= 45


def test_a_class_path_becomes_a_config_of_its_keyword_arguments(on_path):
    frame = plugins.load_class("my_methods.frame:Frame", "attacks")
    assert plugins.config_node(frame, "attacks") == {
        "_target_": "my_methods.frame.Frame", "width": 1, "value": 1.0,
        "target_mode": "all2one", "target": 0, "poison_rate": 0.1}  # the base's keys, through **common
    head_reset = plugins.load_class("my_methods.head_reset:HeadReset", "defenses")
    assert plugins.config_node(head_reset, "defenses") == {
        "_target_": "my_methods.head_reset.HeadReset", "epochs": 2, "lr": 0.01, "clean_fraction": 0.05}


def test_a_keyword_argument_without_default_is_a_required_key(on_path):
    (on_path[0] / "my_methods" / "strict.py").write_text(
        "from backdoorbench.defenses.base import Defense\n"
        "class Strict(Defense):\n    name = 'strict'\n    stage = 'post_train'\n"
        "    def __init__(self, *, level, scale=(1, 2), hook=object(), **rest):\n        super().__init__(**rest)\n")
    strict = plugins.load_class("my_methods.strict:Strict", "defenses")
    assert plugins.config_node(strict, "defenses") == {
        "_target_": "my_methods.strict.Strict", "level": "???", "scale": [1, 2], "clean_fraction": 0.05}


BAD_CLASSES = (
    "from backdoorbench.defenses.base import Defense\n"
    "class Nameless(Defense):\n    stage = 'post_train'\n"
    "class Clash(Defense):\n    name = 'fine_tuning'\n    stage = 'post_train'\n")


@pytest.mark.parametrize("path, message", [
    ("my_methods.head_reset", "is not a class path; write module:Class"),
    ("no_such_pkg.mod:Cls", "module 'no_such_pkg.mod' cannot be imported (No module named 'no_such_pkg')"),
    ("my_methods.head_reset:Nope", "module 'my_methods.head_reset' has no attribute 'Nope'; its classes: HeadReset"),
    ("my_methods.frame:Frame", "is not a subclass of backdoorbench.defenses.base.Defense"),
    ("my_methods.bad:Nameless", "has no name of its own"),
    ("my_methods.bad:Clash", "is named 'fine_tuning', the name of a built-in defense"),
])
def test_a_bad_class_path_is_one_line_naming_it(on_path, path, message):
    (on_path[0] / "my_methods" / "bad.py").write_text(BAD_CLASSES)
    with pytest.raises(ConfigError) as caught:
        plugins.load_class(path, "defenses")
    text = str(caught.value)
    assert text.startswith(f"defense={path!r}") and message in text and "\n" not in text


def test_installed_entry_points_are_named_methods(on_path):
    assert plugins.entry_point_names("attacks") == {"frame": "my_methods.frame:Frame"}
    assert plugins.entry_point_names("defenses") == {"head_reset": "my_methods.head_reset:HeadReset"}
    assert plugins.register(["attack=frame", "defense=head_reset,none", "seed=1"]) == ["attack=frame", "defense=head_reset"]


def test_an_entry_point_named_like_a_builtin_is_one_line(tmp_path, monkeypatch):
    _, site = write_plugins(tmp_path, "[backdoorbench.defenses]\nfine_tuning = my_methods.head_reset:HeadReset\n")
    monkeypatch.syspath_prepend(str(site))
    with pytest.raises(ConfigError, match=r"^the defense entry point 'fine_tuning' of the package my-methods clashes "
                                          r"with the built-in defense 'fine_tuning'; rename the entry point"):
        plugins.register(["defense=fine_tuning"])


def test_an_entry_point_named_like_a_builtins_alias_is_one_line(tmp_path, monkeypatch):
    from backdoorbench import registry

    assert registry.builtin_aliases("defense")["nc"] == "neural_cleanse"
    _, site = write_plugins(tmp_path, "[backdoorbench.defenses]\nnc = my_methods.head_reset:HeadReset\n")
    monkeypatch.syspath_prepend(str(site))
    with pytest.raises(ConfigError, match=r"^the defense entry point 'nc' of the package my-methods clashes with the "
                                          r"alias of the built-in defense 'neural_cleanse'; rename the entry point"):
        plugins.register(["defense=nc"], reserved=registry.builtin_aliases)


@pytest.mark.slow  # composes twice: seconds; the quick CLI run below covers the good path
def test_the_preflight_composes_a_plugin_with_its_overrides_and_its_own_checks(on_path, tmp_path, compose_cfg):
    from backdoorbench.cli import preflight

    given = ["attack=frame", "attack.width=2", "defense=my_methods.head_reset:HeadReset", "defense.lr=0.02",
             f"results_dir={tmp_path / 'out'}"]
    preflight(given)
    cfg = compose_cfg(*given)
    assert cfg.attack._target_ == "my_methods.frame.Frame" and cfg.attack.width == 2 and cfg.attack.poison_rate == 0.1
    assert cfg.defense._target_ == "my_methods.head_reset.HeadReset" and cfg.defense.lr == 0.02
    with pytest.raises(ConfigError, match=r"^defense.lr=-1 is invalid; use a number > 0$"):  # the class's own check
        preflight([*given, "defense.lr=-1"])


def test_a_bad_class_path_on_the_command_line_exits_2_before_anything_is_written(on_path, tmp_path, monkeypatch, capsys):
    from backdoorbench.__main__ import main

    out = tmp_path / "never"
    monkeypatch.setattr(sys, "argv", ["backdoorbench", "defense=my_methods.head_reset:HeadRest", f"results_dir={out}"])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    assert capsys.readouterr().err == ("error: defense='my_methods.head_reset:HeadRest': module 'my_methods.head_reset' "
                                       "has no attribute 'HeadRest'; its classes: HeadReset\n")
    assert not out.exists()


def test_a_plugin_run_by_path_and_by_entry_point_makes_a_record_and_a_leaderboard_row(tmp_path):
    env = cli_env(*write_plugins(tmp_path / "pkg"))
    out = tmp_path / "results"
    proc = run_cli(env, "attack=my_methods.frame:Frame", "attack.width=2", "defense=head_reset", *TINY,
                   f"results_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    [record] = records(out)
    assert record["config"]["attack"]["_target_"] == "my_methods.frame.Frame"
    assert record["config"]["defense"]["_target_"] == "my_methods.head_reset.HeadReset"
    assert (record["attack"]["name"], record["attack"]["width"], record["defense"]["name"]) == ("frame", 2, "head_reset")
    board = run_cli(env, f"results_dir={out}", module="backdoorbench.leaderboard")
    assert board.returncode == 0, board.stderr[-3000:]
    with (out / "leaderboard" / "defenses.csv").open(newline="") as handle:
        [row] = [r for r in csv.DictReader(handle) if r["defense"] == "head_reset"]
    assert (row["attack"], row["group_id"]) == ("frame", record["group_id"])
    assert "| head_reset |" in (out / "leaderboard" / "leaderboard.md").read_text()


def test_the_suite_grid_shows_the_sweeps_rows_the_victims_and_the_builtins_canonical_rows(tmp_path):
    from backdoorbench.defense_suite import suite_table

    head = "dataset,protocol,defense,model,attack,target_mode,setting,n,group_id,canonical,ca_after_mean,asr_after_mean"
    rows = ["mnist5k,quick,head_reset,mnist_cnn,badnets,all2one(0),,3,g1,true,0.9,0.05",
            "mnist5k,quick,fine_tuning,mnist_cnn,badnets,all2one(0),,3,g2,true,0.95,0.5",
            "mnist5k,quick,fine_tuning,mnist_cnn,badnets,all2one(0),lr=0.1,1,g3,false,0.5,0.5",  # not canonical
            "mnist5k,quick,abl,mnist_cnn,wanet,all2one(0),,3,g4,true,,",  # n/a: the threat model excludes it
            "cifar10,backdoorbench,fine_tuning,preact_resnet18,badnets,all2one(0),,3,g5,true,0.9,0.1"]  # another setting
    (tmp_path / "defenses.csv").write_text("\n".join([head, *rows]) + "\n")
    victims = [{"seed": seed, "metrics": {"attacked": {"clean_acc": 0.98, "asr": 1.0}}} for seed in (0, 1, 2)]
    text = suite_table(tmp_path, {"g1": victims}, ["badnets", "wanet"])
    assert text.splitlines()[3:7] == ["| defense | badnets |", "|---|---|",
                                      "| (attacked, no defense) | 98.0 / 100.0 (n=3) |",
                                      "| **head_reset** | 90.0 / 5.0 (n=3) |"]
    assert text.splitlines()[7] == "| fine_tuning | 95.0 / 50.0 (n=3) |" and "cifar10" not in text and "abl" not in text


@pytest.mark.slow
def test_a_multirun_over_a_plugin_and_a_builtin_shares_the_victim(tmp_path):
    env = cli_env(*write_plugins(tmp_path / "pkg"))
    out = tmp_path / "results"
    # ++: Hydra composes a defense sweep's primary config with the default defense, which has no epochs key
    tiny = [o if o != "defense.epochs=1" else "++defense.epochs=1" for o in TINY]
    proc = run_cli(env, "--multirun", "attack=frame", "defense=my_methods.head_reset:HeadReset,fine_tuning", *tiny,
                   f"results_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    made = {r["defense"]["name"]: r for r in records(out)}
    assert set(made) == {"head_reset", "fine_tuning"}
    assert sorted(r["victim"]["cache"] for r in made.values()) == ["hit", "miss"]  # one victim, trained once


@pytest.mark.slow
def test_submitit_jobs_compose_the_plugin_where_they_run(tmp_path):
    """submitit_local is submitit_slurm's machinery without a cluster: each job unpickles Hydra's
    ConfigStore and composes its own config from it, as a Slurm job does on its node."""
    env = cli_env(*write_plugins(tmp_path / "pkg"))
    out = tmp_path / "results"
    proc = run_cli(env, "--multirun", "hydra/launcher=submitit_local", "defense=my_methods.head_reset:HeadReset",
                   "seed=0,1", *TINY, f"results_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    made = records(out)
    assert sorted(r["seed"] for r in made) == [0, 1] and {r["defense"]["name"] for r in made} == {"head_reset"}


@pytest.mark.slow
def test_the_defense_suite_puts_a_plugin_beside_the_builtins(tmp_path):
    env = cli_env(*write_plugins(tmp_path / "pkg"))
    out = tmp_path / "results"
    builtin = run_cli(env, "--multirun", "attack=badnets,blended", "defense=fine_tuning", *TINY, f"results_dir={out}")
    assert builtin.returncode == 0, builtin.stderr[-3000:]
    proc = run_cli(env, "experiment=defense_suite", "defense=my_methods.head_reset:HeadReset", "attack=badnets,blended",
                   "seed=0", *TINY, f"results_dir={out}")  # no --multirun: the preset is a sweep itself
    assert proc.returncode == 0, proc.stderr[-3000:]
    suite = [r for r in records(out) if r["defense"]["name"] == "head_reset"]
    assert sorted(r["attack"]["name"] for r in suite) == ["badnets", "blended"]
    assert {r["victim"]["cache"] for r in suite} == {"hit"}  # the victims fine_tuning's runs trained
    lines = proc.stdout.splitlines()
    assert "| defense | badnets | blended |" in lines
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| defense |")]
    names = [row.split(" | ")[0] for row in rows]
    assert names[0] == "| (attacked, no defense)" and names[1].startswith("| **head_reset") and names[2:] == ["| fine_tuning"]
    assert all(row.count("(n=1)") == 2 for row in rows)  # a cell per attack in each row


@pytest.mark.slurm
def test_slurm_jobs_compose_and_run_the_plugin_on_their_node(slurm_cluster, tmp_path):
    from tests.slurm_cluster import PARTITION

    env = {**cli_env(*write_plugins(tmp_path / "pkg")), **slurm_cluster.env}
    out = tmp_path / "results"
    proc = run_cli(env, "--multirun", "hydra/launcher=submitit_slurm", f"hydra.launcher.partition={PARTITION}",
                   "hydra.launcher.gpus_per_node=0", "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=2",
                   "attack=frame", "defense=my_methods.head_reset:HeadReset", "seed=0,1", *TINY, f"results_dir={out}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    made = records(out)
    assert sorted(r["seed"] for r in made) == [0, 1]
    assert {(r["attack"]["name"], r["defense"]["name"]) for r in made} == {("frame", "head_reset")}
