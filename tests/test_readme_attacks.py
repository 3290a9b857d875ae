"""The README's "How each attack does on mnist5k" table against the committed leaderboard: every row's
numbers are a row of results/leaderboard/leaderboard.md, every attack has a row in both modes, and a
row under 90% ASR says why."""

from __future__ import annotations

import re
from pathlib import Path

import backdoorbench

ROOT = Path(__file__).resolve().parents[1]
HEADING = "### How each attack does on mnist5k"


def readme_rows() -> list[dict[str, str]]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("|---")]
    header = [cell.strip() for cell in lines[0].strip("|").split(" | ")]
    assert header == ["attack", "mode", "training", "setting", "CA %", "ASR %", "plants?"]
    return [dict(zip(header, (cell.strip() for cell in line.strip().strip("|").split(" | ", 6)))) for line in lines[1:]]


def leaderboard_lines() -> list[str]:
    return [line for line in (ROOT / "results" / "leaderboard" / "leaderboard.md").read_text(encoding="utf-8").splitlines()
            if line.startswith("| ")]


def test_every_number_of_the_readme_table_is_a_committed_leaderboard_row():
    lines = leaderboard_lines()
    rows = readme_rows()
    assert len(rows) >= 30
    for row in rows:
        cells = f"| {row['CA %']} | {row['ASR %']} |"
        paper = row["training"].startswith("`paper=")
        # the paper protocol's section names mode and training in its heading, the quick one in columns
        start = f"| {row['attack']} | {row['setting']} |" if paper else (
            f"| {row['attack']} | {row['mode']} | {row['training']} | {row['setting']} |")
        matches = [line for line in lines if line.startswith(start) and cells in line]
        assert matches, f"README row {row} is no row of results/leaderboard/leaderboard.md"


def test_every_attack_has_a_row_in_both_modes_and_a_shortfall_says_why():
    rows = readme_rows()
    attacks = set(backdoorbench.list_attacks()) - {"none"}
    for mode in ("all2one", "all2all"):
        assert attacks <= {row["attack"] for row in rows if row["mode"].startswith(mode)}, mode
    for row in rows:
        asr = float(re.match(r"[\d.]+", row["ASR %"]).group())
        verdict = row["plants?"]
        if asr >= 90:
            assert verdict.startswith("yes"), row
        else:
            assert not verdict.startswith("yes") and len(verdict) > 20, f"{row['attack']} {row['mode']}: say why not"
