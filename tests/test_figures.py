"""Figures from records and artifacts of real short runs; absent data -> one skip line with the command."""

import shutil

from backdoorbench.figures import FIGURES, main, write_figures
from backdoorbench.records import save_record
from tests.test_records import make_record


def copy_runs(tiny_results, tmp_path):
    _, results = tiny_results
    shutil.copytree(results / "runs", tmp_path / "runs")
    return tmp_path


def test_every_figure_is_drawn_from_real_runs(tiny_results, tmp_path):
    results = copy_runs(tiny_results, tmp_path)
    skipped = []
    written = write_figures(results, report=skipped.append)
    assert skipped == []
    assert sorted(written) == [f.number for f in FIGURES] == [1, 2, 3, 4, 5, 6]
    for number, paths in written.items():
        assert sorted(p.suffix for p in paths) == [".pdf", ".png"], number
        png, pdf = sorted(paths, key=lambda p: p.suffix, reverse=True)
        assert png.parent == results / "figures" and png.name.startswith(f"mnist5k_{number}_")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5_000
        assert pdf.read_bytes()[:5] == b"%PDF-" and pdf.stat().st_size > 5_000
    assert not [p for p in (results / "figures").iterdir() if p.name.startswith(".")]  # no temp files left


def test_missing_data_gives_one_skip_line_per_figure_with_the_command(tmp_path, capsys):
    # one run without artifacts (e.g. written before they existed, or with eval.stealth_images=0)
    save_record(make_record(defense={"name": "none"},
                            metrics={"attacked": {"clean_acc": 0.9, "asr": 0.9, "ra": 0.1}, "defended": None, "der": None}),
                tmp_path / "runs" / "mnist5k" / "badnets_all2one" / "r.json")
    assert main([f"results_dir={tmp_path}"]) == 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 6 and all(line.startswith("skipped figure ") for line in lines)
    assert lines[2].endswith(f"make it with: python -m backdoorbench attack=<name> defense=neural_cleanse results_dir={tmp_path}")
    assert "attack.poison_rate=0.01,0.05,0.1" in lines[1] and "defense=strip" in lines[3] and "defense=fine_pruning" in lines[4]
    assert not any((tmp_path / "figures").iterdir())


def test_bad_arguments_are_one_line_errors(tmp_path, capsys):
    assert main([f"results_dir={tmp_path}"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: results_dir=")
    assert main(["residual_scale=big"]) == 2
    assert capsys.readouterr().err.strip() == "error: residual_scale='big' is not a number; use e.g. residual_scale=10"
    (tmp_path / "runs").mkdir()
    assert main([f"results_dir={tmp_path}", "residual_scale=0"]) == 2
    assert "residual_scale=0.0 is invalid" in capsys.readouterr().err
