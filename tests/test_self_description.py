"""The product speaks of itself: no docstring, comment, config or page names an issue or a work session
("issue 18", "session 9"), which a reader outside the team cannot look up. A result's provenance is its
commit, its command and its date."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# What a reader gets: the package's code and configs, the docs, the ledger and the result pages.
SCANNED = ("backdoorbench/**/*.py", "backdoorbench/**/*.yaml", "docs/*.md", "docs/ledger/*.yaml",
           "README.md", "results/README.md", "results/leaderboard/*.md")
TEAM_REFERENCE = re.compile(r"\b(issue|session)s? #?\d+", re.IGNORECASE)


def team_references(root: Path) -> list[str]:
    """`file:line: text` of every line under `root`'s scanned files that names an issue or a session."""
    hits = []
    for pattern in SCANNED:
        for path in sorted(root.glob(pattern)):
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
                if TEAM_REFERENCE.search(line):
                    hits.append(f"{path.relative_to(root)}:{number}: {line.strip()[:120]}")
    return hits


def test_the_pattern_catches_the_forms_in_use_and_spares_plain_words():
    for text in ("(issue 18, protocol 3)", "Session 9's machine", "issues 4 and 5", "sessions 6-8", "Issue #29"):
        assert TEAM_REFERENCE.search(text), text
    for text in ("an open issue", "the session's cache", "tissue 3", "reissue 2", "issue-free"):
        assert not TEAM_REFERENCE.search(text), text


def test_no_page_or_docstring_names_an_issue_or_a_session():
    assert (ROOT / "results" / "README.md").is_file()  # the scan runs on the checkout, not on nothing
    hits = team_references(ROOT)
    assert not hits, ("name the commit and/or the date instead of the issue or session:\n" + "\n".join(hits))
