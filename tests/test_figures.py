"""Figures from records and artifacts of real short runs; absent data -> one skip line with the command.
Long figures split into pages with no blank band, row labels that don't collide, colour bars on the
heat maps, a log poison-rate axis, legends off the curves, titles that name attack and setting."""

import json
import shutil

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from PIL import Image

from backdoorbench.errors import ConfigError
from backdoorbench.report import fig_defenses, fig_detection, fig_examples, fig_robust, fig_sweeps, plot
from backdoorbench.report.figures import FIGURES, main, write_figures
from backdoorbench.report.plot import ROWS_PER_PAGE, Run
from backdoorbench.report.query import load_records_with_paths

DRAWING = (plot, fig_defenses, fig_sweeps, fig_robust, fig_detection)  # the modules that save a figure (plot: pages of one)
from backdoorbench.records import save_record
from tests.test_records import make_record


def copy_runs(tiny_results, tmp_path):
    _, results = tiny_results
    shutil.copytree(results / "runs", tmp_path / "runs")
    return tmp_path


def test_every_figure_is_drawn_from_real_runs(tiny_results, tmp_path):
    results = copy_runs(tiny_results, tmp_path)
    # the reactivation curves (eval.reactivation, off in the tiny runs): one record given a measured block
    source = next(path for record, path in load_records_with_paths(results) if record.defense["name"] == "fine_pruning")
    data = json.loads(source.read_text())
    data["reactivation"] = {"budget": {}, "defended": {"steps": [0, 1], "asr": [0.1, 0.5], "ca": [0.9, 0.9]},
                            "attacked": {"steps": [0, 1], "asr": [1.0, 1.0], "ca": [0.9, 0.9]}}
    source.write_text(json.dumps(data))
    skipped = []
    written = write_figures(results, report=skipped.append)
    assert skipped == []
    assert sorted(written) == [f.number for f in FIGURES] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    for number, paths in written.items():
        assert sorted(p.suffix for p in paths) == [".pdf", ".png"], number  # one attack: one page
        png, pdf = sorted(paths, key=lambda p: p.suffix, reverse=True)
        assert png.parent == results / "figures" and png.name.startswith(f"mnist5k_{number}_")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5_000
        assert pdf.read_bytes()[:5] == b"%PDF-" and pdf.stat().st_size > 5_000
    assert not [p for p in (results / "figures").iterdir() if p.name.startswith(".")]  # no temp files left


def test_missing_data_gives_one_skip_line_per_figure_with_the_command(tmp_path, capsys):
    # one run without artifacts (e.g. written before they existed, or with eval.stealth_images=0)
    save_record(make_record(defense={"name": "none"},
                            metrics={"attacked": {"clean_acc": 0.9, "asr": 0.9, "ra": 0.1, "pgd_acc": 0.0}, "defended": None,
                                     "der": None}),
                tmp_path / "runs" / "mnist5k" / "badnets_all2one" / "r.json")
    assert main([f"results_dir={tmp_path}"]) == 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 11 and all(line.startswith("skipped figure ") for line in lines)
    assert lines[10].endswith("defense=spectral,activation_clustering,strip eval.detection_only=true seed=0,1,2 "
                              f"results_dir={tmp_path}")
    # robust accuracy vs eps, and vs lambda: a record with the old single PGD number has no curve
    for line, number in zip(lines[6:8], (7, 8)):
        assert line.startswith(f"skipped figure {number} ")
        assert line.endswith(f"make it with: python -m backdoorbench --multirun experiment=angular_margin_xu2020 results_dir={tmp_path}")
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


ATTACKS = ["badnets", "blended", "label_consistent", "input_aware", "wanet", "adaptive_blend", "lira", "wb"]


def synthetic_runs(tmp_path, attacks=ATTACKS, modes=("all2one",)):
    """Runs with artifacts in memory: a square trigger, GradCAM maps; seeded."""
    g = np.random.default_rng(0)
    runs = []
    for k, (attack, mode) in enumerate((a, m) for a in attacks for m in modes):
        clean = g.random((4, 1, 28, 28)).astype(np.float32)
        poisoned = clean.copy()
        poisoned[:, :, -4:, -4:] = 1.0
        cams = {f"gradcam_{kind}": g.random((4, 28, 28)).astype(np.float32) for kind in ("clean", "poisoned")}
        record = make_record(run_id=f"r{k:08d}", group_id=f"g{k}", defense={"name": "none"}, artifacts="a.npz",
                             attack={"name": attack, "target_mode": mode, "target": 0, "poison_rate": 0.1,
                                     "n_poisoned": 400, "poisoned_indices_sha256": "0" * 64})
        runs.append(Run(record, tmp_path / f"{k}.json",
                        {"examples_clean": clean, "examples_poisoned": poisoned, **cams}))
    return runs


@pytest.fixture
def drawn(monkeypatch):
    """Every matplotlib figure saved, kept for inspection."""
    kept = []
    save = plot.save_figure

    def keep(fig, out_dir, stem):
        kept.append(fig)
        return save(fig, out_dir, stem)
    for module in DRAWING:
        monkeypatch.setattr(module, "save_figure", keep)
    return kept


def renderer_of(fig):
    """The figure drawn again on an Agg canvas (saving it closed it), for its elements' positions."""
    FigureCanvasAgg(fig).draw()
    return fig.canvas.get_renderer()


def longest_blank_band(png):
    pixels = np.asarray(Image.open(png).convert("L"))
    blank = (pixels > 250).all(axis=1)
    longest = run = 0
    for row_is_blank in blank:
        run = run + 1 if row_is_blank else 0
        longest = max(longest, run)
    return longest


@pytest.mark.parametrize("draw", [fig_examples.trigger_gallery, fig_examples.gradcam_heatmaps])
def test_gallery_and_gradcam_are_pages_of_six_rows_with_colour_bars_and_clear_labels(tmp_path, drawn, draw,
                                                                                   monkeypatch):
    monkeypatch.setattr(fig_examples, "EXAMPLES_SHOWN", 1)  # the rows are the point here; one example keeps it fast
    runs = synthetic_runs(tmp_path, ATTACKS[:7])  # 7 rows: 2 pages of 4 and 3
    paths = draw(runs, tmp_path)
    pngs = sorted(p for p in paths if p.suffix == ".png")
    assert [p.name.rsplit("_", 1)[1] for p in pngs] == ["page1.png", "page2.png"]
    rows = [[ax for ax in fig.axes if ax.get_ylabel() and ax.get_label() != "<colorbar>"] for fig in drawn]
    assert [len(r) for r in rows] == [4, 3]
    assert [len(page) for page in plot.pages_of(dict.fromkeys(range(24)))] == [6] * 4
    assert [len(page) for page in plot.pages_of(dict.fromkeys(range(16)))] == [6, 5, 5]
    assert ROWS_PER_PAGE == 6
    for fig, png, labelled in zip(drawn, pngs, rows):
        assert longest_blank_band(png) < 40  # no blank band under the title (it was 532 px)
        assert "page" in fig._suptitle.get_text()
        assert sum(ax.get_label() == "<colorbar>" for ax in fig.axes) == 1  # the residuals' / GradCAM's scale
        renderer = renderer_of(fig)
        labels = [ax.yaxis.label.get_window_extent(renderer) for ax in labelled]
        images = [ax.get_window_extent(renderer) for ax in labelled]
        for i, label in enumerate(labels):  # each row label beside its row, clear of the others and the images
            assert label.y0 >= images[i].y0 - 1 and label.y1 <= images[i].y1 + 1
            assert label.x1 <= images[i].x0
            assert not any(label.overlaps(other) for other in labels[i + 1:])
    assert "label_consistent\nall2one" in [ax.get_ylabel() for r in rows for ax in r]
    # fewer rows later: the pages of the earlier drawing are removed, not left beside the new one
    draw(runs[:3], tmp_path)
    stems = sorted(p.name for p in tmp_path.glob("*.png"))
    assert len(stems) == 1 and "page" not in stems[0]


def test_poison_rate_is_on_a_log_axis_with_no_empty_panel_and_a_legend_off_the_curves(tmp_path, drawn):
    runs = []
    for k, (attack, rate, asr) in enumerate([(a, r, min(1.0, 20 * r)) for a in ("badnets", "blended", "wanet", "sig")
                                             for r in (0.005, 0.01, 0.1)]):
        record = make_record(run_id=f"r{k}", group_id=f"g{k}", defense={"name": "none"},
                             attack={"name": attack, "target_mode": "all2one", "target": 0, "poison_rate": rate,
                                     "n_poisoned": 1, "poisoned_indices_sha256": "0" * 64},
                             metrics={"attacked": {"clean_acc": 0.98, "asr": asr, "ra": 0.0}, "defended": None, "der": None},
                             config={"seed": 0, "trainer": {"epochs": 10}, "attack": {"poison_rate": rate}})
        runs.append(Run(record, tmp_path / f"{k}.json"))
    fig_sweeps.poison_rate_curves(runs, tmp_path)
    (fig,) = drawn
    panels = [ax for ax in fig.axes if ax.get_visible() and ax.lines]
    assert len(panels) == 4 and all(ax.get_xscale() == "log" for ax in panels)
    assert [t.get_text() for t in panels[0].get_xticklabels()] == ["0.5%", "1%", "10%"]
    # 4 panels: 4 columns, no spare slot, the legend below them; never an empty panel, never a legend on one
    assert all(ax.get_legend() is None for ax in panels) and len(fig.legends) == 1
    assert [ax for ax in fig.axes if ax.get_visible() and not ax.lines and ax.get_legend() is None] == []
    renderer = renderer_of(fig)
    box = fig.legends[0].get_window_extent(renderer)
    assert not any(box.overlaps(ax.get_window_extent(renderer)) for ax in panels)
    assert panels[0].get_title() == "badnets all2one\n10 ep"


@pytest.mark.parametrize("count, columns, spare", [(2, 2, 0), (4, 4, 0), (5, 3, 1), (6, 3, 0), (7, 4, 1), (8, 3, 1)])
def test_panels_leave_at_most_the_legend_slot_free(count, columns, spare):
    assert plot.panel_columns(count) == columns and -count % columns == spare


def test_defense_panels_name_attack_and_setting_and_share_one_legend(tiny_results, tmp_path, drawn):
    results = copy_runs(tiny_results, tmp_path)
    runs = [Run(record, path) for record, path in load_records_with_paths(results)]
    for draw in (fig_defenses.neural_cleanse_anomaly, fig_defenses.strip_histograms, fig_defenses.fine_pruning_curves):
        assert draw(runs, tmp_path)
    for fig, number in zip(drawn, (3, 4, 5)):
        panels = [ax for ax in fig.axes if ax.get_visible() and (ax.lines or ax.patches)]
        titles = [ax.get_title() for ax in panels]
        assert titles == ["badnets all2one\npoison rate 10%, 0 ep, seed 0"], (number, titles)  # no run hash
        assert all(ax.get_legend() is None for ax in panels) and len(fig.legends) == 1, number
        renderer = renderer_of(fig)
        assert not fig.legends[0].get_window_extent(renderer).overlaps(panels[0].get_window_extent(renderer))


def test_attacks_chooses_the_rows(tiny_results, tmp_path, capsys):
    results = copy_runs(tiny_results, tmp_path)
    with pytest.raises(ConfigError, match="attacks=wanet: no record has attack wanet; the records have: badnets"):
        write_figures(results, attacks=["wanet"])
    assert not (results / "figures").exists()
    assert main([f"results_dir={results}", "attacks=badnets"]) == 0
    out = capsys.readouterr().out
    assert "figure 1:" in out and "mnist5k_1_trigger_gallery_badnets.png" in out
    assert not (results / "figures" / "mnist5k_1_trigger_gallery.png").exists()  # the subset has its own files


def test_a_model_keeps_its_colour_in_every_robust_accuracy_panel(tiny_results, tmp_path, monkeypatch):
    """The transfer panels hold only the defended models: each model must keep the colour the shared
    legend gives it (the colour cycle restarting per panel drew lambda 0 in the plain model's blue)."""
    drawn = []
    monkeypatch.setattr(fig_robust, "save_figure", lambda fig, out, stem: drawn.append(fig) or [])
    _, results = tiny_results
    runs = [Run(record, path) for record, path in load_records_with_paths(results) if record.defense["name"] == "angular_margin"]
    fig_robust.robust_accuracy_curves(runs, tmp_path)
    (fig,) = drawn
    colours: dict[str, set] = {}
    for ax in fig.axes:
        for container in ax.containers:
            line = container.lines[0]
            colours.setdefault(container.get_label().rsplit(" (n=", 1)[0], set()).add(line.get_color())
    transferred = [ax for ax in fig.axes if "transferred" in ax.get_title()]
    assert transferred and all(len(ax.containers) == 2 for ax in transferred)  # lambda 0 and 100, not the plain model
    assert set(colours) == {"attacked model (rbc_mnist, plain)", "angular_margin λ=0", "angular_margin λ=100"}
    assert all(len(c) == 1 for c in colours.values())  # one colour per model across the panels
    assert len({next(iter(c)) for c in colours.values()}) == 3  # and three different ones


def test_a_figure_shows_the_run_of_the_canonical_row_not_an_older_sweep(tmp_path):
    """An older single-seed setting whose run id sorts first must not stand for the attack in the
    gallery when the leaderboard's canonical row (3 seeds, the current defaults) has artifacts."""
    old, *_ = synthetic_runs(tmp_path / "old", attacks=["badnets"])
    old.record.run_id, old.record.group_id = "00000000", "g_old"
    old.record.config = {"attack": {"pattern": "checkerboard"}, "trainer": {"epochs": 10}}
    current = []
    for seed in (0, 1, 2):
        run, *_ = synthetic_runs(tmp_path / f"s{seed}", attacks=["badnets"])
        run.record.run_id, run.record.group_id, run.record.seed = f"ffff000{seed}", "g_now", seed
        run.record.config = {"attack": {"pattern": "white"}, "trainer": {"epochs": 10}}
        current.append(run)
    picked = plot.pick_per_attack([old, *current], ("examples_clean",))["mnist5k"]["badnets all2one"]
    assert picked is current[0]
    assert plot.pick_per_attack([old], ("examples_clean",))["mnist5k"]["badnets all2one"] is old


def test_every_defense_curve_of_the_reactivation_figure_has_its_own_colour():
    """12 curves (the victim and 11 defenses) drew two pairs in one colour with tab10 alone."""
    colours = [plot.distinct_colour(i) for i in range(19)]
    assert len(set(colours)) == 19


def test_a_seed_run_twice_at_one_swept_value_counts_once_its_newest_run(tmp_path, drawn):
    """Two records of one setting and seed (made under two schemas, alike once upgraded) are one
    measurement: the point is the mean over seeds of each seed's newest run, not over both."""
    runs = []
    for name, rate, seed, day, asr in (("old", 0.1, 0, 1, 0.2), ("new", 0.1, 0, 2, 0.4), ("s1", 0.1, 1, 1, 0.6),
                                       ("low", 0.01, 0, 1, 0.1)):
        record = make_record(run_id=name, group_id=f"g{rate}", seed=seed, created_at=f"2026-12-0{day}T00:00:00+00:00",
                             defense={"name": "none"},
                             attack={"name": "badnets", "target_mode": "all2one", "target": 0, "poison_rate": rate,
                                     "n_poisoned": 1, "poisoned_indices_sha256": "0" * 64},
                             metrics={"attacked": {"clean_acc": 0.98, "asr": asr, "ra": 0.0}, "defended": None, "der": None},
                             config={"seed": seed, "trainer": {"epochs": 10}, "attack": {"poison_rate": rate}})
        runs.append(Run(record, tmp_path / f"{name}.json"))
    by_value = fig_sweeps.one_per_seed(runs, lambda run: run.record.attack["poison_rate"])
    assert {x: [r.run_id for r in records] for x, records in by_value.items()} == {0.01: ["low"], 0.1: ["new", "s1"]}
    fig_sweeps.poison_rate_curves(runs, tmp_path)
    (fig,) = drawn
    asr = next(c for ax in fig.axes for c in ax.containers if c.get_label() == "ASR")
    assert list(asr.lines[0].get_ydata()) == pytest.approx([10.0, 50.0])


# ---- figure 11: ROC curves of the detectors ---------------------------------------------------------


def test_roc_points_count_ties_once_and_seeds_average_vertically():
    import torch

    from backdoorbench.metrics.detection import auroc

    perfect = fig_detection.roc_points(np.array([3.0, 2.0, 1.0, 0.0]), np.array([True, True, False, False]))
    assert [p.tolist() for p in perfect] == [[0, 0, 0, 0.5, 1], [0, 0.5, 1, 1, 1]]
    tied = fig_detection.roc_points(np.array([1.0, 1.0, 0.0, 0.0]), np.array([True, False, True, False]))
    assert [p.tolist() for p in tied] == [[0, 0.5, 1], [0, 0.5, 1]]  # one point per distinct score: the diagonal
    # the mean TPR at each FPR (at an FPR where a curve rises vertically, the top of the rise), not a mean of FPRs
    mean, std = fig_detection.vertical_average([perfect, tied], grid=np.array([0.0, 0.25, 0.5, 1.0]))
    assert mean.tolist() == pytest.approx([0.5, 0.625, 0.75, 1.0])
    assert std.tolist() == pytest.approx([np.sqrt(0.5), np.sqrt(2) * 0.375, np.sqrt(2) * 0.25, 0.0])
    # the area under a seed's points is its AUROC, ties one half
    assert fig_detection.area(*perfect) == 1.0 and fig_detection.area(*tied) == 0.5
    g = np.random.default_rng(3)
    scores, truth = g.integers(0, 5, 300).astype(float), g.random(300) < 0.3  # many ties
    assert fig_detection.area(*fig_detection.roc_points(scores, truth)) == pytest.approx(
        auroc(torch.from_numpy(scores), torch.from_numpy(truth)))
    alone, spread = fig_detection.vertical_average([tied])
    assert alone == pytest.approx(fig_detection.FPR_GRID) and not spread.any()


def test_detection_arrays_are_the_generic_ones_or_an_older_strip_records_entropies():
    generic = {"detection_scores": np.array([0.1, 0.9, 0.5]), "detection_truth": np.array([False, True, True]),
               "detection_threshold": np.array(0.4)}
    scores, truth, flagged = fig_detection.detection_arrays(generic)
    assert scores.tolist() == [0.1, 0.9, 0.5] and truth.tolist() == [False, True, True]
    assert flagged.tolist() == [False, True, True]  # above the threshold, as the runner flags
    scores, truth, flagged = fig_detection.detection_arrays(
        {**generic, "detection_flagged": np.array([True, False, False])})
    assert flagged.tolist() == [True, False, False]  # the run's own verdict wins
    # STRIP before the generic names: entropies, low = triggered; clean first
    scores, truth, flagged = fig_detection.detection_arrays({
        "strip_entropy_clean": np.array([2.0, 3.0]), "strip_entropy_poisoned": np.array([0.1]),
        "strip_entropy_threshold": np.array(1.0)})
    assert scores.tolist() == [-2.0, -3.0, -0.1] and truth.tolist() == [False, False, True]
    assert flagged.tolist() == [False, False, True]
    assert fig_detection.detection_arrays({"examples_clean": np.zeros(3)}) is None


def detector_run(tmp_path, name, *, defense, stage, attack, seed, scores=None, truth=None, group=None):
    """A run of `defense` with its detection in the record and, given `scores`, its saved arrays."""
    artifacts = {} if scores is None else {"detection_scores": scores, "detection_truth": truth,
                                           "detection_flagged": scores > 0.5}
    record = make_record(run_id=name, group_id=group or f"g-{defense}-{attack}", seed=seed,
                         defense={"name": defense, "stage": stage}, artifacts="a.npz" if artifacts else None,
                         attack={"name": attack, "target_mode": "all2one", "target": 0, "poison_rate": 0.1,
                                 "n_poisoned": int(truth.sum()) if truth is not None else 1,
                                 "poisoned_indices_sha256": "0" * 64},
                         metrics={"attacked": {"clean_acc": 0.9, "asr": 1.0, "ra": 0.0}, "defended": None, "der": None,
                                  "detection": {"tpr": 0.5, "fpr": 0.1, "f1": 0.5, "auroc": 0.8}},
                         config={"seed": seed, "trainer": {"epochs": 10},
                                 "defense": {"_target_": f"backdoorbench.defenses.{defense}.X"},
                                 "eval": {"detection_only": True}})
    return Run(record, tmp_path / f"{name}.json", artifacts)


def test_the_roc_figure_has_a_panel_per_attack_and_a_mean_curve_per_detector(tmp_path, drawn):
    g = np.random.default_rng(0)
    truth = np.arange(200) < 20
    runs, seeds = [], {}
    for attack in ("badnets", "blended"):
        for seed in (0, 1):
            scores = g.random(200) + truth * (0.5 if attack == "badnets" else 0.2)
            seeds[(attack, seed)] = scores
            runs.append(detector_run(tmp_path, f"s-{attack}-{seed}", defense="spectral", stage="pre_train",
                                     attack=attack, seed=seed, scores=scores, truth=truth))
        runs.append(detector_run(tmp_path, f"i-{attack}", defense="strip", stage="input", attack=attack, seed=0,
                                 scores=g.random(200) + truth, truth=truth))
    runs.append(detector_run(tmp_path, "ac", defense="activation_clustering", stage="pre_train", attack="badnets",
                             seed=0))  # no scores saved (a record from before): no curve, no error
    paths = fig_detection.detection_roc(runs, tmp_path)
    assert sorted({p.stem for p in paths}) == ["mnist5k_11_detection_roc_dataset", "mnist5k_11_detection_roc_input"]
    fig, fig_input = drawn  # a figure per level: the dataset-level one first
    assert "dataset-level" in fig._suptitle.get_text() and "input-level" in fig_input._suptitle.get_text()
    panels = [ax for ax in fig.axes if ax.get_visible() and ax.lines]
    assert [ax.get_title() for ax in panels] == ["badnets all2one\nvictim 10 ep", "blended all2one\nvictim 10 ep"]
    assert "mean over seeds" in fig._suptitle.get_text() and "vertical averaging" in fig._suptitle.get_text()
    labels = [text.get_text() for text in fig.legends[0].get_texts()]
    assert labels[0] == "spectral, n=2" and "strip" not in " ".join(labels)
    assert [text.get_text() for text in fig_input.legends[0].get_texts()][0] == "strip"
    badnets = panels[0]
    curves = [line for line in badnets.lines if len(line.get_xdata()) == len(fig_detection.FPR_GRID)]
    assert len(curves) == 1  # the input-level detector is not in the dataset-level figure
    expected, _ = fig_detection.vertical_average([fig_detection.roc_points(seeds[("badnets", s)], truth) for s in (0, 1)])
    assert curves[0].get_ydata() == pytest.approx(expected)
    # the operating point: the mean (FPR, TPR) over the seeds of the run's own flags
    marker = next(line for line in badnets.lines if line.get_marker() == "o" and line.get_color() == curves[0].get_color())
    points = [((seeds[("badnets", s)] > 0.5)[~truth].mean(), (seeds[("badnets", s)] > 0.5)[truth].mean()) for s in (0, 1)]
    assert (marker.get_xdata()[0], marker.get_ydata()[0]) == pytest.approx(tuple(np.mean(points, 0)))

    drawn.clear()
    fig_detection.detection_roc([r for r in runs if r.record.seed == 0], tmp_path)
    assert "(seed 0)" in drawn[0]._suptitle.get_text()
    assert fig_detection.detection_roc(runs[-1:], tmp_path) == []  # no saved scores anywhere: skipped
