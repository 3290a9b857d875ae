"""The fidelity ledger (docs/fidelity.md) covers every defense, and each docstring points to its section."""

import re
from pathlib import Path

import pytest
import backdoorbench
from backdoorbench import registry

ROOT = Path(backdoorbench.__file__).parent
LEDGER = ROOT.parent / "docs" / "fidelity.md"
DEFENSES = sorted(registry.classes("defense", builtin_only=True))  # defense=none builds nothing
COMMIT = re.compile(r"`[\w.-]+/[\w.-]+@[0-9a-f]{40}(:[^`]+)?`")


def sections() -> dict[str, str]:
    text = LEDGER.read_text()
    parts = re.split(r"^### (.+)$", text, flags=re.M)
    return {title.strip(): body for title, body in zip(parts[1::2], parts[2::2])}


@pytest.mark.parametrize("name", DEFENSES)
def test_every_defense_has_a_ledger_section_its_docstring_points_to(name):
    cls = registry.method_class("defense", name)
    anchor = re.search(r"docs/fidelity\.md#([\w-]+)", cls.__doc__ or "")
    assert anchor, f"{cls.__name__}'s docstring names no ledger section"
    body = sections().get(anchor[1])
    assert body is not None, f"docs/fidelity.md has no section '### {anchor[1]}'"
    assert "| parameter | paper | official code | ours | why |" in body
    assert COMMIT.search(body), "a section names the official code as owner/repo@<40-hex commit>"


def test_the_ledger_keeps_a_place_for_the_attacks_and_the_readme_links_it():
    assert "## Attacks" in LEDGER.read_text()
    assert "docs/fidelity.md" in (ROOT.parent / "README.md").read_text()
