"""The committed tables are made from the committed records by the documented command, and nothing
else: regenerated into a temporary folder they match byte for byte. Reporting reads records only:
it imports no method class and reads no yaml of today's config."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

RESULTS = ROOT / "results"
COMMITTED = ("leaderboard.md", "leaderboard.html", "attacks.csv", "defenses.csv", "detection.csv", "protocols.md")
# What reporting must never load: the method classes, the code that runs them or reads conf/.
FORBIDDEN = ("backdoorbench.attacks", "backdoorbench.defenses", "backdoorbench.pipeline", "backdoorbench.registry",
             "backdoorbench.factory", "backdoorbench.protocols", "backdoorbench.run_facts", "backdoorbench.train",
             "backdoorbench.metrics", "backdoorbench.config", "hydra")


def test_the_documented_command_regenerates_the_committed_leaderboard_byte_for_byte(tmp_path):
    readme = (RESULTS / "README.md").read_text()
    command = "python -m backdoorbench.leaderboard results_dir=results"
    assert command in readme  # the command results/README.md gives for these files
    (tmp_path / "runs").symlink_to(RESULTS / "runs")
    shutil.copy(RESULTS / "README.md", tmp_path / "README.md")  # the page links to it, as it does in results/
    proc = subprocess.run([sys.executable, "-m", "backdoorbench.leaderboard", f"results_dir={tmp_path}"], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    for name in COMMITTED:
        made, committed = (tmp_path / "leaderboard" / name).read_bytes(), (RESULTS / "leaderboard" / name).read_bytes()
        assert made == committed, f"results/leaderboard/{name} differs from what {command} makes of results/runs"
    assert "another schema" not in (tmp_path / "leaderboard" / "leaderboard.md").read_text()


AUDIT = r"""
import json, sys
opened = []
sys.addaudithook(lambda event, args: opened.append(str(args[0]))
                 if event == "open" and str(args[0]).endswith((".yaml", ".yml")) else None)
from backdoorbench.figures import main as figures
from backdoorbench.leaderboard import main as leaderboard
codes = [leaderboard([f"results_dir={sys.argv[1]}"]), figures([f"results_dir={sys.argv[1]}"])]
print(json.dumps({"codes": codes, "opened": opened, "modules": sorted(sys.modules)}))
"""


def test_reporting_imports_no_method_class_and_reads_no_yaml(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    committed = sorted((RESULTS / "runs").rglob("*.json"))
    chosen = [p for p in committed if '"name": "neural_cleanse"' in p.read_text()][:2] + committed[:2]
    for path in chosen:  # records of an attack and of a defense, as committed (an older schema: upgraded on load)
        shutil.copy(path, runs / path.name)
    proc = subprocess.run([sys.executable, "-c", AUDIT, str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["codes"] == [0, 0] and (tmp_path / "leaderboard" / "leaderboard.md").is_file()
    assert seen["opened"] == []
    loaded = [m for m in seen["modules"] if m.startswith(FORBIDDEN)]
    assert loaded == [], f"reporting loaded {loaded}"


def test_no_report_module_imports_hydra_omegaconf_or_a_method_directly():
    for path in sorted((ROOT / "backdoorbench" / "report").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                # nor the config schema (Hydra's store): what reporting needs of a config is in the record
                assert not name.startswith(("hydra", "omegaconf", "backdoorbench.config", *FORBIDDEN)), \
                    f"{path.name} imports {name}"


def test_the_keys_that_change_no_result_are_the_runs_own():
    """Reporting and the run id leave out the same keys: one definition, in a module without Hydra."""
    from backdoorbench.config import NON_RESULT_KEYS
    from backdoorbench.report.query import NON_RESULT_KEYS as REPORTED

    assert REPORTED is NON_RESULT_KEYS


@pytest.mark.parametrize("module", ["backdoorbench.leaderboard", "backdoorbench.figures"])
def test_the_commands_keep_their_names(module):
    proc = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith(f"usage: python -m {module} ")
    assert not [p for p in Path(ROOT, "backdoorbench", "report").glob("*.py") if len(p.read_text().splitlines()) > 500]
