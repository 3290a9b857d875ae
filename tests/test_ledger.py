"""The fidelity ledger as data (docs/ledger/*.yaml): docs/fidelity.md is rendered from it,
every row names its source at a commit and line, every departure from the official value gives a
reason, every key of a method's config has a row, and the config resolves, method x dataset x
protocol as `python -m backdoorbench --cfg job --resolve` does, to the ledger's `ours`. The quick
suite resolves mnist5k under quick and cifar10 under backdoorbench (each dataset's default); the
slow suite every protocol on every dataset."""

from __future__ import annotations

import itertools
import re
from functools import lru_cache
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

import backdoorbench.config  # noqa: F401  (registers the schemas)
from backdoorbench import ledger

CONF = Path(backdoorbench.config.__file__).parent / "conf"
ATTACKS = sorted(p.stem for p in (CONF / "attack").glob("*.yaml"))
DEFENSES = sorted(p.stem for p in (CONF / "defense").glob("*.yaml"))
SECTIONS = ledger.section_names()
# Attacks whose protocol sets trainer values of their own (conf/protocol_attack/<protocol>/<dataset>/<attack>.yaml):
# the trainer then differs from the protocol's, so a defense's section is not checked beside them.
OWN_TRAINER = {p.stem for p in (CONF / "protocol_attack").rglob("*.yaml") if not p.stem.startswith("_")}
LISTED = re.compile(r"\| ([0-9a-f]{40}) \|")


def method_of(section: str) -> tuple[str, str] | None:
    """(group, name) of the method a section is about, None for the other sections."""
    name = section.replace("-", "_")
    for group, names in (("attack", ATTACKS), ("defense", DEFENSES)):
        if name in names:
            return group, name
    return None


def overrides_for(section: str) -> tuple[str, ...]:
    """One attack and one defense per composition: attack i rides with defense i, halving the cost
    (a defense rides with badnets where attack i has trainer values of its own)."""
    method = method_of(section)
    if method is None:
        return ()
    group, name = method
    index = (ATTACKS if group == "attack" else DEFENSES).index(name)
    attack = ATTACKS[index] if index < len(ATTACKS) and ATTACKS[index] not in OWN_TRAINER else "badnets"
    defense = DEFENSES[index] if index < len(DEFENSES) else "none"
    return (f"attack={name if group == 'attack' else attack}", f"defense={name if group == 'defense' else defense}")


@lru_cache(maxsize=None)
def resolved(overrides: tuple[str, ...], protocol: str, dataset: str) -> dict:
    with initialize_config_module(config_module="backdoorbench.conf", version_base="1.3"):
        config = compose("config", overrides=[*overrides, f"dataset={dataset}", f"protocol={protocol}"])
    return OmegaConf.to_container(config, resolve=True)


def test_every_method_and_the_training_protocols_have_a_ledger_file():
    """Every attack, every defense and the protocols: the section is data, rendered into docs/fidelity.md."""
    text = ledger.FIDELITY.read_text()
    methods = [name.replace("_", "-") for name in ATTACKS + [d for d in DEFENSES if d != "none"]]
    assert [m for m in methods + ["training-protocols"] if m not in SECTIONS] == []
    assert all(f"### {s}\n" in text for s in SECTIONS)


@pytest.mark.parametrize("section", SECTIONS)
def test_the_section_in_fidelity_md_is_what_its_yaml_renders(section):
    assert section not in ledger.stale(), (
        f"docs/fidelity.md's section {section} differs from docs/ledger/{section}.yaml: edit the YAML and run "
        f"python -m backdoorbench.ledger --write {section}")


@pytest.mark.parametrize("section", SECTIONS)
def test_every_row_names_its_source_and_every_departure_its_reason(section):
    assert ledger.static_problems(section) == []


@pytest.mark.parametrize("section", SECTIONS)
def test_every_cited_commit_is_a_listed_source(section):
    listed = set(LISTED.findall(ledger.FIDELITY.read_text().split("### sources", 1)[1].split("\n### ", 1)[0]))
    text = ledger.FIDELITY.read_text()
    for row in ledger.rows(section):
        for source in ledger.sources(row):
            commit = source.split("@", 1)[1].split(":", 1)[0]
            assert commit in listed or text.count(commit) > 1, f"{row.where}: commit {commit} is not in ### sources"


@pytest.mark.parametrize("section", [s for s in SECTIONS if method_of(s)])
def test_every_key_of_the_methods_config_has_a_row(section):
    group, name = method_of(section)
    node = OmegaConf.to_container(OmegaConf.load(CONF / group / f"{name}.yaml"))
    keys = [k for k in ledger.leaf_keys(node, group) if k != f"{group}._target_"]
    stated = {row.key for row in ledger.rows(section)}
    assert [k for k in keys if k not in stated] == [], f"docs/ledger/{section}.yaml has no row for these keys"


def test_every_value_a_protocol_sets_has_a_training_protocols_row():
    if "training-protocols" not in SECTIONS:
        pytest.skip("training-protocols is not converted yet")
    stated = {row.key for row in ledger.rows("training-protocols")}
    for path in sorted((CONF / "protocol_dataset" / "backdoorbench").glob("*.yaml")):
        node = yaml.safe_load(path.read_text())
        keys = [k for top, value in node.items() if top not in ("protocol", "defaults")
                for k in ledger.leaf_keys(value, top)]
        assert [k for k in keys if k not in stated] == [], f"{path.name} sets values with no ledger row"


DEFAULTS = [("quick", "mnist5k"), ("backdoorbench", "cifar10")]
EVERY = [pair for pair in itertools.product(ledger.PROTOCOLS, ledger.DATASETS) if pair not in DEFAULTS]


def check(section: str, protocol: str, dataset: str) -> None:
    config = resolved(overrides_for(section), protocol, dataset)
    assert config["protocol"]["name"] == protocol
    assert ledger.config_problems(section, config, protocol, dataset) == []


@pytest.mark.parametrize("section", SECTIONS)
@pytest.mark.parametrize(("protocol", "dataset"), DEFAULTS)
def test_the_config_resolves_to_the_ledgers_values(section, protocol, dataset):
    check(section, protocol, dataset)


@pytest.mark.slow
@pytest.mark.parametrize("section", SECTIONS)
@pytest.mark.parametrize(("protocol", "dataset"), EVERY)
def test_the_config_resolves_to_the_ledgers_values_under_every_protocol(section, protocol, dataset):
    check(section, protocol, dataset)


# The checker itself, on rows made for the purpose.
ROW = {"parameter": "rate", "key": "attack.poison_rate", "paper": "0.1", "official": {"cifar10": 0.1},
       "source": "SCLBD/BackdoorBench@f02e3534645f0ee63d6848653062cd6c0d6c400d:config/attack/badnet/default.yaml:9",
       "ours": {"*": 0.1, "quick/mnist5k": 0.2}, "why": "same"}


def test_a_departure_without_a_reason_and_a_drifted_value_are_caught(tmp_path, monkeypatch):
    monkeypatch.setattr(ledger, "LEDGER_DIR", tmp_path)
    (tmp_path / "x.yaml").write_text(yaml.safe_dump({"section": "x", "rows": [ROW]}))
    assert ledger.static_problems("x") == []  # quick on mnist5k departs, but mnist5k has no official value
    (tmp_path / "x.yaml").write_text(yaml.safe_dump({"section": "x", "rows": [
        {**ROW, "ours": {"*": 0.1, "quick/cifar10": 0.2}}]}))
    [problem] = ledger.static_problems("x")
    assert "quick/cifar10" in problem and "no reason" in problem
    config = {"attack": {"poison_rate": 0.1000001}}
    assert ledger.config_problems("x", config, "backdoorbench", "cifar10") == []  # 4 significant digits
    [drift] = ledger.config_problems("x", {"attack": {"poison_rate": 0.05}}, "backdoorbench", "cifar10")
    assert "resolves to 0.05" in drift and "says 0.1" in drift
    [gone] = ledger.config_problems("x", {"attack": {}}, "backdoorbench", "cifar10")
    assert "has no key attack.poison_rate" in gone


def test_a_source_without_a_line_or_a_commit_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(ledger, "LEDGER_DIR", tmp_path)
    (tmp_path / "x.yaml").write_text(yaml.safe_dump({"section": "x", "rows": [
        {**ROW, "source": "SCLBD/BackdoorBench@f02e353:config/attack/badnet/default.yaml"}]}))
    [problem] = ledger.static_problems("x")
    assert "is not owner/repo@<40-hex commit>:path:line" in problem
    (tmp_path / "y.yaml").write_text(yaml.safe_dump({"section": "y", "rows": [{**ROW, "oficial": 1}]}))
    with pytest.raises(ledger.LedgerError, match=r"row 1 \(rate\): unknown field\(s\) \['oficial'\]"):
        ledger.load("y")


def test_writing_replaces_a_handwritten_section_and_then_only_its_block(tmp_path, monkeypatch):
    monkeypatch.setattr(ledger, "LEDGER_DIR", tmp_path)
    monkeypatch.setattr(ledger, "FIDELITY", tmp_path / "fidelity.md")
    (tmp_path / "x.yaml").write_text(yaml.safe_dump({"section": "x", "text": "Intro.", "rows": [ROW]}))
    (tmp_path / "fidelity.md").write_text("# L\n\n### x\n\nold table\n\n### y\n\nkept\n")
    assert ledger.stale() == ["x"]
    assert ledger.write(["x"]) == ["x"]
    text = (tmp_path / "fidelity.md").read_text()
    assert "old table" not in text and text.endswith("### y\n\nkept\n") and ledger.stale() == []
    assert "| rate (`attack.poison_rate`) | 0.1 | cifar10 `0.1` at `SCLBD/BackdoorBench@" in text
    assert "| `0.1`; quick on mnist5k `0.2` | same |" in text
    assert ledger.write(["x"]) == []
    (tmp_path / "fidelity.md").write_text(text.replace("Intro.", "Edited by hand."))
    assert ledger.stale() == ["x"]
