"""The attacks' fidelity ledger (docs/fidelity.md, its Attacks part): each
attack's docstring points to its section, which holds the table and names its sources at a commit."""

import re
from pathlib import Path

import pytest
import backdoorbench
from backdoorbench import registry

ROOT = Path(backdoorbench.__file__).parent
LEDGER = ROOT.parent / "docs" / "fidelity.md"
COMMIT = re.compile(r"`([\w.-]+/[\w.-]+)@([0-9a-f]{40})(:[^`]+)?`")
ATTACKS = registry.builtin_names("attack")
POINTED = [name for name in ATTACKS if name != "none"]  # the clean control has no source to point to


def sections() -> dict[str, str]:
    parts = re.split(r"^### (.+)$", LEDGER.read_text(), flags=re.M)
    return {title.strip(): body for title, body in zip(parts[1::2], parts[2::2])}


@pytest.mark.parametrize("name", ATTACKS)
def test_every_attack_has_a_section_with_the_table_and_a_source_at_a_commit(name):
    body = sections().get(name.replace("_", "-"))
    assert body is not None, f"docs/fidelity.md has no section '### {name.replace('_', '-')}'"
    if name != "none":  # the clean control has nothing to compare
        assert "| parameter | paper | official code | ours | why |" in body
        assert COMMIT.search(body), "a section names its source as `owner/repo@<40-hex commit>:path`"


@pytest.mark.parametrize("name", POINTED)
def test_the_docstring_points_to_its_section(name):
    cls = registry.method_class("attack", name)
    anchor = re.search(r"docs/fidelity\.md#([\w-]+)", cls.__doc__ or "")
    assert anchor, f"{cls.__name__}'s docstring names no ledger section"
    assert anchor[1] in sections()


def test_every_cited_commit_is_one_of_the_listed_sources():
    ledger = LEDGER.read_text()
    text = ledger[ledger.index("## Attacks"):ledger.index("## Defenses")]  # the attacks' part lists its sources
    sources = set(re.findall(r"^\| [\w-]+ \| ([\w.-]+/[\w.-]+) \| ([0-9a-f]{40}) \|", text, flags=re.M))
    cited = {(repo, commit) for repo, commit, _ in COMMIT.findall(text)}
    assert cited and cited <= sources, cited - sources
