"""`--help` pages: the app's own page (conf/hydra/help/backdoorbench.yaml), and the leaderboard's
and the figures' usage."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

import backdoorbench
from backdoorbench import figures, leaderboard
from backdoorbench.help_page import GROUPS
from tests.conftest import run_cli

CONF = Path(backdoorbench.__file__).parent / "conf"


def options_on_disk(group: str) -> list[str]:
    """A group's options read from the conf folder, internal (`_`) ones left out."""
    folder = CONF / group
    found = [p.stem for p in folder.glob("*.yaml") if not p.stem.startswith("_")]
    if group == "paper":
        found = [f"{p.parent.name}/{p.stem}" for p in folder.glob("*/*.yaml")]
    if group == "hydra/launcher":
        found.append("basic")  # Hydra's own launcher
    return sorted(found)


def section(text: str, title: str) -> list[str]:
    """The lines of a `== title ... ==` section, up to the next blank line."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"== {title}"))
    end = next(i for i in range(start + 1, len(lines)) if not lines[i].strip())
    return lines[start + 1 : end]


def listed_groups(text: str) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    current = None
    for line in section(text, "Config groups"):
        if not line.startswith(" " * 21):
            current = line.split()[0]
            groups[current] = []
        else:
            groups[current] += [o.strip() for o in line.split(",") if o.strip()]
    return groups


@pytest.fixture(scope="module")
def help_text() -> str:
    proc = run_cli("--help", "attack=wanet")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_help_says_what_the_tool_does_not_that_hydra_powers_it(help_text: str) -> None:
    assert help_text.startswith("backdoorbench: backdoor attacks and defenses on image classifiers.")
    assert "powered by Hydra" not in help_text and "== Config ==" not in help_text  # no config dump
    assert "usage: python -m backdoorbench [--multirun] [group=option ...] [key=value ...]" in help_text


def test_help_lists_every_group_with_its_options_and_no_internal_ones(help_text: str) -> None:
    listed = listed_groups(help_text)
    assert list(listed) == [group for group, _ in GROUPS]
    assert "paper_attack" not in help_text and "_for_" not in help_text and "_schema" not in help_text
    for group, shown in listed.items():
        names = [o.split("*")[0] for o in shown]
        assert names == options_on_disk(group), group
    starred = {group: [o.split("*")[0] for o in shown if "*" in o] for group, shown in listed.items()}
    # the command line's choice (attack=wanet) and the defaults of the rest, each marked once
    assert starred == {"dataset": ["mnist5k"], "model": ["mnist_cnn"], "attack": ["wanet"], "defense": ["none"],
                       "trainer": ["default"], "trainer/optimizer": ["sgd"], "logger": ["csv"], "protocol": ["default"], "paper": [],
                       "experiment": [], "hydra/launcher": ["basic"]}
    assert "mnist_cnn* (the dataset's usual one)" in listed["model"]


def test_help_shows_settings_with_their_values_now(help_text: str) -> None:
    settings = dict(line.split()[0].split("=", 1) for line in section(help_text, "Settings"))
    assert settings["seed"] == "0" and settings["trainer.epochs"] == "10" and settings["attack.target_mode"] == "all2one"
    assert settings["attack.poison_rate"] == "0.1" and settings["defense.clean_fraction"] == "..."  # defense=none


def test_each_of_the_five_examples_is_a_valid_command(help_text: str, tmp_path: Path) -> None:
    from backdoorbench.cli import preflight

    examples = [line.split("#")[0].strip() for line in section(help_text, "Examples")]
    assert len(examples) == 5 and all(e.startswith("python -m backdoorbench") for e in examples)
    assert len(set(examples)) == 5
    for example in examples:
        args = shlex.split(example)[3:]
        preflight([*args, f"results_dir={tmp_path / 'r'}"])  # raises ConfigError on a bad example
    tables = section(help_text, "Tables and figures")
    assert any(line.strip().startswith("python -m backdoorbench.leaderboard ") for line in tables)
    assert any(line.strip().startswith("python -m backdoorbench.figures ") for line in tables)


def test_help_with_a_wrong_choice_is_one_error_line() -> None:
    proc = run_cli("--help", "defense=nc")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("error: unknown defense 'nc'; did you mean defense=neural_cleanse?")


@pytest.mark.parametrize("module", [leaderboard, figures], ids=["leaderboard", "figures"])
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_leaderboard_and_figures_print_their_usage_and_exit_0(module, flag, capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # nothing may be written, even in the working folder
    assert module.main([flag]) == 0
    out = capsys.readouterr()
    assert out.out.startswith(module.USAGE) and out.err == ""
    assert list(tmp_path.iterdir()) == []
