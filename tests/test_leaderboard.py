"""The leaderboard is built from records only: grouping over seeds, mean/std/n, broken records skipped."""

import csv
import statistics

import pytest

from backdoorbench.leaderboard import main, write_leaderboard
from backdoorbench.records import save_record
from tests.test_records import make_record


def write_runs(results_dir):
    runs = results_dir / "runs"
    for seed, ca, asr in [(0, 0.97, 1.0), (1, 0.95, 0.98), (2, 0.96, 0.99)]:
        save_record(make_record(run_id=f"a{seed}", group_id="ga", seed=seed, defense={"name": "none"},
                                metrics={"attacked": {"clean_acc": ca, "asr": asr, "ra": 0.0}, "defended": None, "der": None}),
                    runs / f"a{seed}.json")
    save_record(make_record(run_id="b0", group_id="gb"), runs / "b0.json")


def test_rows_are_means_over_seeds(tmp_path):
    write_runs(tmp_path)
    md, csv_path, n_rows = write_leaderboard(tmp_path)
    assert n_rows == 2
    rows = list(csv.DictReader(csv_path.open()))
    none_row = next(r for r in rows if r["defense"] == "none")
    assert int(none_row["n"]) == 3 and none_row["seeds"] == "0 1 2"
    assert float(none_row["attacked_clean_acc_mean"]) == pytest.approx(0.96)
    assert float(none_row["attacked_clean_acc_std"]) == pytest.approx(statistics.stdev([0.97, 0.95, 0.96]))
    assert none_row["der_mean"] == ""
    ft_row = next(r for r in rows if r["defense"] == "fine_tuning")
    assert float(ft_row["der_mean"]) == pytest.approx(0.945)
    text = md.read_text()
    assert "96.00 ± 1.00" in text and "| fine_tuning |" in text


def test_broken_records_are_skipped_with_a_warning(tmp_path):
    write_runs(tmp_path)
    (tmp_path / "runs" / "corrupt.json").write_text("{oops")
    (tmp_path / "runs" / "old.json").write_text('{"schema_version": 0}')
    with pytest.warns(UserWarning) as caught:
        _, _, n_rows = write_leaderboard(tmp_path)
    assert n_rows == 2
    messages = " ".join(str(w.message) for w in caught)
    assert "corrupt.json" in messages and "old.json" in messages


def test_cli_rejects_unknown_arguments(capsys, tmp_path):
    assert main(["nonsense=1"]) == 2
    assert "unknown argument" in capsys.readouterr().err
    write_runs(tmp_path)
    assert main([f"results_dir={tmp_path}"]) == 0
    assert (tmp_path / "leaderboard.md").exists()
