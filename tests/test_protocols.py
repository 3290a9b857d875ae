"""The defense protocols: a defense's cost in passes and FLOPs, its benign false positives on a
clean victim, the clean-data budget figure and the sensitivity spread."""

from __future__ import annotations

import copy
import csv
import json

import pytest
import torch
from torch import nn

from backdoorbench.attacks.none import NoAttack
from backdoorbench.datasets.base import Split
from backdoorbench.defenses.base import Defense, DefenseContext, DefenseResult, InputDefense
from backdoorbench.defenses.fine_tuning import FineTuning
from backdoorbench.defenses.runner import benign_false_positives, run_defense
from backdoorbench.metrics.cost import PassCounter, cost_summary, forward_flops_per_image
from backdoorbench.models.base import ImageClassifier, Normalized
from backdoorbench.train import Trainer


class Tiny(ImageClassifier):
    """4 pixels -> 3 features -> 2 classes: 2*4*3 + 2*3*2 = 36 FLOPs per image forward."""

    name = "tiny"

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Flatten(), nn.Linear(4, 3), nn.ReLU())
        self.classifier = nn.Linear(3, 2)


def tiny_model() -> Normalized:
    torch.manual_seed(0)
    return Normalized(Tiny(), (0.5,), (0.25,))


def tiny_split(count: int, seed: int = 0) -> Split:
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (count, 1, 2, 2), generator=g, dtype=torch.uint8)
    return Split(images, (images.float().mean((1, 2, 3)) > 127).long())


def test_pass_counter_matches_a_hand_count_of_a_tiny_model():
    model = tiny_model()
    assert forward_flops_per_image(model, (1, 2, 2)) == 36
    counter = PassCounter()
    counter.watch(model)
    model(torch.rand(9, 1, 2, 2))  # before counting: not counted
    with counter.counting():
        copy.deepcopy(model)(torch.rand(5, 1, 2, 2)).sum().backward()  # a copy is counted too: 5 forward, 5 backward
        model.features(torch.rand(3, 1, 2, 2))  # features only (Spectral, AC): 3 forward, no backward
        with torch.no_grad():
            model(torch.rand(7, 1, 2, 2))  # 7 forward
        x = torch.rand(2, 1, 2, 2, requires_grad=True)  # frozen weights, a gradient to the input (NC)
        for p in model.parameters():
            p.requires_grad_(False)
        model(x).sum().backward()  # 2 forward, 2 backward
    model(torch.rand(4, 1, 2, 2))  # after: not counted
    assert (counter.forward_images, counter.backward_images) == (17, 7)
    cost = cost_summary(counter, n_train=10, flops_per_image=36)
    assert cost["passes_per_train_image"] == pytest.approx(24 / 10)
    assert cost["flops"] == 36 * (17 + 2 * 7)


def test_fine_tuning_costs_one_forward_and_one_backward_per_clean_image_and_epoch():
    clean, test = tiny_split(64), tiny_split(32, seed=1)
    trainer = Trainer(epochs=1, batch_size=16, device="cpu", progress=False, augment=False)
    ctx = DefenseContext(model=tiny_model(), poisoned_train=tiny_split(640, seed=2), poisoned_indices=torch.zeros(0, dtype=torch.long),
                         clean_subset=clean, trainer=trainer, num_classes=2, generator=torch.Generator().manual_seed(0))
    outcome = run_defense(FineTuning(epochs=3, lr=0.01), ctx, NoAttack(num_classes=2, image_shape=(1, 2, 2), target=0), test)
    # the test-set scoring after the defense is not the defense's cost
    assert outcome.cost["forward_images"] == outcome.cost["backward_images"] == 3 * 64
    assert outcome.cost["passes_per_train_image"] == pytest.approx(2 * 3 * 64 / 640)
    assert outcome.cost["flops"] == 36 * 3 * (3 * 64)


class FlagFirst(Defense):
    """A pre-training detector that flags the first `count` training samples."""

    name = "flag_first"
    stage = "pre_train"
    needs_clean_data = False

    def __init__(self, count: int) -> None:
        super().__init__(clean_fraction=0.0)
        self.count = count

    def apply(self, ctx: DefenseContext) -> DefenseResult:
        flagged = torch.zeros(len(ctx.poisoned_train), dtype=torch.bool)
        flagged[: self.count] = True
        return DefenseResult(sample_scores=flagged.float(), flagged=flagged)


class Silent(InputDefense):
    """An input detector that rejects nothing: the perfect detector of a clean test set."""

    name = "silent"
    threshold = 0.5

    def apply(self, ctx: DefenseContext) -> DefenseResult:
        return DefenseResult()

    def score_inputs(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        model(x)
        model(x)  # two passes per input: its price at inference
        return torch.zeros(len(x))


@pytest.mark.parametrize("count, expected", [(0, 0.0), (6, 0.1)])
def test_benign_false_positive_of_a_pre_training_detector_is_the_share_of_a_clean_set_removed(count, expected):
    train, test = tiny_split(60), tiny_split(20, seed=1)
    trainer = Trainer(epochs=1, batch_size=20, device="cpu", progress=False, augment=False)
    retrained = []
    ctx = DefenseContext(model=tiny_model(), poisoned_train=train, poisoned_indices=torch.zeros(0, dtype=torch.long),
                         clean_subset=tiny_split(0), trainer=trainer, num_classes=2, generator=torch.Generator(),
                         build_model=tiny_model,
                         train_victim=lambda model, train=None, wrap_step=None: retrained.append(len(train)) or
                         trainer.fit(model, train, generator=torch.Generator().manual_seed(0)))
    outcome = run_defense(FlagFirst(count), ctx, NoAttack(num_classes=2, image_shape=(1, 2, 2), target=0), test)
    benign = benign_false_positives(FlagFirst(count), outcome, len(train))
    assert benign["false_positive"] == expected and benign["n_flagged"] == count
    assert retrained == [60 - count]
    # the retraining on the kept data is the detector's cost: one epoch, forward and backward
    assert outcome.cost["backward_images"] == 60 - count


def test_benign_false_positive_of_a_perfect_input_detector_is_zero_and_its_inference_cost_is_counted():
    test = tiny_split(20, seed=1)
    trainer = Trainer(epochs=1, batch_size=20, device="cpu", progress=False)
    ctx = DefenseContext(model=tiny_model(), poisoned_train=tiny_split(40), poisoned_indices=torch.zeros(0, dtype=torch.long),
                         clean_subset=tiny_split(4), trainer=trainer, num_classes=2, generator=torch.Generator())
    outcome = run_defense(Silent(), ctx, NoAttack(num_classes=2, image_shape=(1, 2, 2), target=0), test)
    assert benign_false_positives(Silent(), outcome, 40)["false_positive"] == 0.0
    assert outcome.cost["per_input_forward_images"] == 2.0


def test_a_class_detector_flagging_a_clean_model_is_a_false_positive_and_a_repair_defense_has_none():
    from backdoorbench.defenses.runner import DefenseOutcome

    class ClassDetector(Defense):
        name, stage = "class_detector", "post_train"

    nothing = DefenseOutcome({}, None, {"flagged": []})
    some = DefenseOutcome({}, None, {"flagged": [3, 1]})
    assert benign_false_positives(ClassDetector(), nothing, 10)["false_positive"] == 0.0
    assert benign_false_positives(ClassDetector(), some, 10) == {
        "measure": "any class flagged on a clean model", "false_positive": 1.0, "flagged_classes": [3, 1]}
    assert benign_false_positives(FineTuning(epochs=1), DefenseOutcome({}, None, {"final_loss": 0.1}), 10) is None


# --- the leaderboard's cost, benign-FP and spread columns, figure 7 -------------------------------

def nc_config(attack="badnets", threshold=2.0, clean_fraction=0.1):
    return {"seed": 0, "trainer": {"epochs": 10}, "attack": {"_target_": f"backdoorbench.attacks.{attack}.X"},
            "defense": {"_target_": "backdoorbench.defenses.neural_cleanse.NeuralCleanse",
                        "anomaly_threshold": threshold, "clean_fraction": clean_fraction}}


def save_defense_run(runs, name, *, seed=0, attack="badnets", asr_after=0.1, ca_after=0.95, cfg=None, benign=None,
                     cost=None, defense="neural_cleanse", clean_fraction=None, reactivation=None):
    from backdoorbench.run_keys import config_hash
    from backdoorbench.records import save_record
    from tests.test_records import make_record

    cfg = cfg or nc_config(attack)
    defense_info = {"name": defense, **({"clean_fraction": clean_fraction} if clean_fraction is not None else {})}
    record = make_record(run_id=name, group_id=config_hash(cfg, ("seed",)), seed=seed, dataset={"name": "mnist5k"},
                         attack={"name": attack, "target_mode": "all2one", "target": 0, "poison_rate": 0.1,
                                 "n_poisoned": 400, "poisoned_indices_sha256": "0" * 64},
                         defense=defense_info, config={**cfg, "seed": seed},
                         metrics={"attacked": {"clean_acc": 0.97, "asr": 1.0, "ra": 0.0},
                                  "defended": {"clean_acc": ca_after, "asr": asr_after, "ra": 0.5}, "der": 0.9},
                         benign=benign, defense_cost=cost, reactivation=reactivation)
    save_record(record, runs / "mnist5k" / f"{attack}_all2one" / f"{name}.json")
    return record


def test_leaderboard_shows_cost_benign_fp_from_the_clean_victim_and_the_spread_over_the_sweep(tmp_path):
    from backdoorbench.leaderboard import write_leaderboard

    runs = tmp_path / "runs"
    cost = {"seconds": 12.5, "forward_images": 800, "backward_images": 400, "passes_per_train_image": 0.3,
            "flops": 1.0e9, "forward_flops_per_image": 1e6}
    save_defense_run(runs, "clean", attack="none", asr_after=0.02, cost=cost,
                     benign={"measure": "any class flagged on a clean model", "false_positive": 1.0, "ca_drop": 0.01})
    for threshold, asr in ((1.5, 0.05), (2.0, 0.10), (3.0, 0.60)):  # the sensitivity sweep of NC's threshold
        save_defense_run(runs, f"t{threshold}", asr_after=asr, cfg=nc_config(threshold=threshold), cost=cost)
    save_defense_run(runs, "other", asr_after=0.9, cfg=nc_config(clean_fraction=0.05))  # another key: not in the sweep
    rows = {(r["attack"], r["setting"]): r for r in csv.DictReader(write_leaderboard(tmp_path).csv["defenses"].open())}
    default = rows[("badnets", "")]  # the setting names only values off the defense's defaults
    assert float(default["asr_spread_mean"]) == pytest.approx(0.60 - 0.05)
    assert rows[("badnets", "anomaly_threshold=3")]["asr_spread_mean"] == ""
    assert float(default["cost_s_mean"]) == 12.5 and float(default["passes_per_img_mean"]) == pytest.approx(0.3)
    # the benign FP of a row comes from the same defense settings on attack=none
    assert float(default["benign_fp_mean"]) == 1.0 and float(rows[("none", "")]["benign_fp_mean"]) == 1.0
    assert rows[("badnets", "clean_fraction=0.05")]["benign_fp_mean"] == ""
    # of the sweep's rows, all with one seed, the canonical one is at the default threshold, not the newest
    (canonical,) = [r for r in rows.values() if r["attack"] == "badnets" and r["canonical"] == "true"]
    assert canonical["setting"] == ""
    page = (tmp_path / "leaderboard" / "leaderboard.md").read_text()
    assert "| cost s | passes/img | benign FP % | ASR spread |" in page


def test_a_sweep_run_after_the_table_gives_the_tables_older_3_seed_row_a_spread_of_its_own_seeds(tmp_path):
    from backdoorbench.leaderboard import write_leaderboard

    runs = tmp_path / "runs"
    # the defense table's row: an older trainer schema (amp on the CPU, no rotation), seeds 0-2
    old = nc_config()
    old["trainer"] = {"epochs": 10, "amp": True}
    for seed, asr in ((0, 0.10), (1, 0.30), (2, 0.50)):
        save_defense_run(runs, f"table{seed}", seed=seed, asr_after=asr, cfg=old)
    # the sweep, later, seed 0 only: today's trainer keys, the evaluation extras of a reactivation run
    for threshold, asr in ((1.5, 0.02), (2.0, 0.10), (3.0, 0.70)):
        new = nc_config(threshold=threshold)
        new["trainer"] = {"epochs": 10, "precision": "auto", "rotation": 0.0, "rotation_p": 0.5}
        new["eval"] = {"reactivation": {"enabled": threshold == 2.0}}
        save_defense_run(runs, f"sweep{threshold}", asr_after=asr, cfg=new)
    other = nc_config(threshold=3.0)
    other["trainer"] = {"epochs": 30, "precision": "auto", "rotation": 0.0, "rotation_p": 0.5}  # another training
    save_defense_run(runs, "other", asr_after=0.9, cfg=other)
    rows = list(csv.DictReader(write_leaderboard(tmp_path).csv["defenses"].open()))
    (table,) = [r for r in rows if r["n"] == "3"]
    assert table["canonical"] == "true"
    # seed 0 against seed 0: 70 - 2 points, not against the table's 3-seed mean (30%), and n = 1
    assert float(table["asr_spread_mean"]) == pytest.approx(0.70 - 0.02)
    assert table["asr_spread_n"] == "1"
    spreads = [r for r in rows if r["asr_spread_mean"] != ""]
    assert len(spreads) == 2  # the table's row and the sweep's own run at the default threshold


def test_the_table_row_shows_the_reactivation_and_cost_its_setting_measured_in_a_later_run(tmp_path):
    from backdoorbench.leaderboard import write_leaderboard

    runs = tmp_path / "runs"
    old = nc_config()
    old["trainer"] = {"epochs": 10, "amp": True}  # the defense table: an older schema, no cost counted
    for seed in (0, 1, 2):
        save_defense_run(runs, f"table{seed}", seed=seed, cfg=old)
    new = nc_config()
    new["trainer"] = {"epochs": 10, "precision": "auto", "rotation": 0.0, "rotation_p": 0.5}
    new["eval"] = {"reactivation": {"enabled": True}}
    cost = {"seconds": 80.0, "passes_per_train_image": 50.8}
    curve = {"steps": [0, 5], "ca": [0.95, 0.96], "asr": [0.29, 0.80]}
    save_defense_run(runs, "reactivated", cfg=new, cost=cost, reactivation={"defended": curve})
    other = nc_config(clean_fraction=0.05)  # another setting measures nothing for the table's row
    save_defense_run(runs, "other", cfg=other, cost={"seconds": 1.0, "passes_per_train_image": 9.0},
                     reactivation={"defended": {**curve, "asr": [0.1, 0.1]}})
    rows = list(csv.DictReader(write_leaderboard(tmp_path).csv["defenses"].open()))
    (table,) = [r for r in rows if r["n"] == "3"]
    assert float(table["asr_reactivated_mean"]) == pytest.approx(0.80) and table["asr_reactivated_n"] == "1"
    assert float(table["passes_per_img_mean"]) == pytest.approx(50.8) and table["passes_per_img_n"] == "1"
    assert table["cost_s_mean"] == ""  # seconds are not borrowed: they belong to a machine and a run
    page = (tmp_path / "leaderboard" / "leaderboard.md").read_text()
    assert "80.00 (n=1) †" in page


def test_the_protocol_tables_show_the_clean_budget_and_sensitivity_sweeps_and_the_reactivation_runs(tmp_path):
    from backdoorbench.leaderboard import write_leaderboard

    runs = tmp_path / "runs"
    for fraction, asr in ((0.01, 0.9), (0.05, 0.3), (0.1, 0.1)):  # a clean-budget sweep
        save_defense_run(runs, f"cb{fraction}", asr_after=asr, cfg=nc_config(clean_fraction=fraction))
    for threshold, asr in ((1.5, 0.2), (2.5, 0.4)):  # with the 10% run: NC's threshold at 1.5, 2, 2.5
        save_defense_run(runs, f"t{threshold}", asr_after=asr, cfg=nc_config(threshold=threshold))
    pair = nc_config(attack="blended", clean_fraction=0.05)  # two settings only: not drawn as a sweep
    save_defense_run(runs, "b1", attack="blended", cfg=pair)
    save_defense_run(runs, "b2", attack="blended", cfg=nc_config(attack="blended"))
    reactivated = nc_config()
    reactivated["eval"] = {"reactivation": {"enabled": True}}
    curve = {"steps": [0, 5], "ca": [0.95, 0.96], "asr": [0.1, 0.8], "probe": {"asr": 0.5, "asr_clean_model": 0.01}}
    save_defense_run(runs, "r", asr_after=0.1, cfg=reactivated, cost={"seconds": 79.4, "passes_per_train_image": 50.8},
                     reactivation={"defended": curve, "attacked": {**curve, "asr": [1.0, 0.99]}})
    text = write_leaderboard(tmp_path).protocols.read_text()
    budget = text.split("## Clean-data budget")[1].split("## Sensitivity")[0]
    assert "| defense | setting | seeds | 1% | 5% | 10% |" in budget
    assert "| neural_cleanse | – | 0 | 95.0 / 90.0 | 95.0 / 30.0 | 95.0 / 10.0 |" in budget
    assert "blended" not in budget
    sensitivity = text.split("## Sensitivity")[1]
    assert "| neural_cleanse | anomaly_threshold | 0 | 1.5: 20.0 / 95.0 · **2**: 10.0 / 95.0 · 2.5: 40.0 / 95.0 | 30.0 |" \
        in sensitivity
    reactivation = text.split("## Reactivation and cost")[1].split("## Clean-data budget")[0]
    # the overview: defense x attack, ASR after the defense -> after retuning, the victim's first
    assert "| defense | badnets all2one(0) |\n|---|---|\n| no defense (victim) | 100.0 -> 99.0 (n=1) |\n" \
           "| neural_cleanse | 10.0 -> 80.0 (n=1) |" in reactivation
    assert ("| neural_cleanse | – | 1 | 95.0 / 10.0 | 80.0 | 50.0 / 1.0 | 99.0 "
            "| 50.80 | 79 |") in reactivation


def test_the_reactivation_overview_averages_the_seeds_and_prefers_the_setting_run_with_most_seeds(tmp_path):
    from backdoorbench.leaderboard import write_leaderboard

    runs = tmp_path / "runs"
    reactivated = nc_config()
    reactivated["eval"] = {"reactivation": {"enabled": True}}
    for seed, (after, retuned, victim) in enumerate(((0.1, 0.2, 0.9), (0.3, 0.6, 0.7), (0.2, 0.4, 0.8))):
        curve = {"steps": [0, 5], "ca": [0.95, 0.96], "asr": [after, retuned]}
        save_defense_run(runs, f"r{seed}", seed=seed, asr_after=after, cfg=reactivated,
                         reactivation={"defended": curve, "attacked": {**curve, "asr": [1.0, victim]}})
    # another setting of the same cell, newer but one seed: the overview keeps the three seeds
    other = nc_config(threshold=3.0)
    other["eval"] = {"reactivation": {"enabled": True}}
    curve = {"steps": [0, 5], "ca": [0.95, 0.96], "asr": [0.9, 0.95]}
    save_defense_run(runs, "late", asr_after=0.9, cfg=other, reactivation={"defended": curve, "attacked": curve})
    text = write_leaderboard(tmp_path).protocols.read_text()
    overview = text.split("## Reactivation and cost")[1].split("\n### ")[1]
    assert "| neural_cleanse | 20.0 ± 10.0 -> 40.0 ± 20.0 (n=3) |" in overview, overview
    # the victim's reference most runs share: the three seeds' (1.0 each: no ±)
    assert "| no defense (victim) | 100.0 -> 80.0 ± 10.0 (n=3) |" in overview, overview
    # the per-attack table still lists both settings
    assert "| neural_cleanse | anomaly_threshold=3 | 1 |" in text and "| neural_cleanse | – | 3 |" in text, text


def test_a_one_seed_sweep_takes_its_default_from_the_seed_0_run_of_a_3_seed_row_made_with_its_kernels(tmp_path):
    import dataclasses

    from backdoorbench.leaderboard import write_leaderboard
    from backdoorbench.records import save_record

    runs = tmp_path / "runs"

    def save(name, seed, fraction, asr, kernels, **extra):
        cfg = {**nc_config(clean_fraction=fraction), **extra}
        record = save_defense_run(runs, name, seed=seed, asr_after=asr, cfg=cfg)
        if kernels:  # records made before the field existed name no kernels
            record = dataclasses.replace(record, env={**record.env, "cpu_capability": kernels})
            save_record(record, runs / "mnist5k" / "badnets_all2one" / f"{name}.json")

    for fraction, asr in ((0.01, 0.9), (0.1, 0.1)):  # the sweep, seed 0, AVX512
        save(f"s{fraction}", 0, fraction, asr, "AVX512")
    # the default (5%) ran three seeds twice: once with other kernels (newest), once naming none
    for seed, asr in enumerate((0.5, 0.6, 0.7)):
        save(f"other{seed}", seed, 0.05, asr, "AVX2", eval={"reactivation": {"enabled": True}})
    for seed, asr in enumerate((0.3, 0.2, 0.4)):
        save(f"old{seed}", seed, 0.05, asr, None)
    budget = write_leaderboard(tmp_path).protocols.read_text().split("## Clean-data budget")[1]
    # the 5% cell is the kernel-less row's seed-0 run (30.0), not a 3-seed mean, nor the AVX2 run (50.0)
    assert "| neural_cleanse | – | 0 | 95.0 / 90.0 | 95.0 / 30.0 | 95.0 / 10.0 |" in budget, budget


def test_the_command_marks_a_pairing_the_threat_model_excludes_n_a_in_the_reactivation_overview(tmp_path):
    import subprocess
    import sys

    from tests.conftest import ROOT

    runs = tmp_path / "runs"
    curve = {"steps": [0, 5], "ca": [0.95, 0.96], "asr": [0.1, 0.8]}
    abl = {"_target_": "backdoorbench.defenses.abl.ABL"}
    save_defense_run(runs, "r", defense="abl", cfg={**nc_config(), "defense": abl},
                     reactivation={"defended": curve, "attacked": curve})
    save_defense_run(runs, "w", defense="abl", attack="wanet", cfg={**nc_config("wanet"), "defense": abl})
    path = runs / "mnist5k" / "wanet_all2one" / "w.json"
    data = json.loads(path.read_text())
    data["defense"].update(applicable=False, not_applicable="ABL reads the poisoned training set")
    data["report"].update(applicable=False, not_applicable="ABL reads the poisoned training set")  # as the run writes it
    data["metrics"]["defended"] = data["metrics"]["der"] = None
    path.write_text(json.dumps(data))
    save_defense_run(runs, "n", attack="wanet", cfg=nc_config("wanet"), reactivation={"defended": curve})
    # as a user runs it: the command's module is __main__ there
    proc = subprocess.run([sys.executable, "-m", "backdoorbench.leaderboard", f"results_dir={tmp_path}"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "leaderboard" / "protocols.md").read_text()
    assert "| defense | badnets all2one(0) | wanet all2one(0) |" in text
    assert "| no defense (victim) | 10.0 -> 80.0 (n=1) | – |" in text  # WaNet's run retuned no reference
    assert "| abl | 10.0 -> 80.0 (n=1) | n/a |" in text and "| neural_cleanse | – | 10.0 -> 80.0 (n=1) |" in text


def test_old_records_without_cost_read_the_defense_time_and_stay_valid(tmp_path):
    from backdoorbench.leaderboard import write_leaderboard
    from backdoorbench.records import load_record

    record = save_defense_run(tmp_path / "runs", "old")
    path = next((tmp_path / "runs").rglob("old.json"))
    data = json.loads(path.read_text())
    del data["defense_cost"], data["benign"]  # as written before protocols 2 and 3: schema version 1
    data["schema_version"] = 1
    data["timings_s"] = {"defense": 7.0}
    path.write_text(json.dumps(data))
    assert load_record(path).defense_cost is None and record.run_id == "old"
    (row,) = csv.DictReader(write_leaderboard(tmp_path).csv["defenses"].open())
    assert float(row["cost_s_mean"]) == 7.0 and row["passes_per_img_mean"] == ""


def test_clean_budget_figure_draws_ca_and_asr_after_per_defense_on_a_log_axis(tmp_path, monkeypatch):
    from backdoorbench.report import fig_sweeps as figures
    from backdoorbench.report.plot import Run

    kept = []
    save = figures.save_figure
    monkeypatch.setattr(figures, "save_figure", lambda fig, out, stem: kept.append((fig, stem)) or save(fig, out, stem))
    runs = []
    for defense in ("neural_cleanse", "fine_tuning"):
        for fraction in (0.005, 0.01, 0.05):
            for seed in (0, 1):
                cfg = nc_config(clean_fraction=fraction)
                cfg["defense"]["_target_"] += defense
                record = save_defense_run(tmp_path / "runs", f"{defense}{fraction}{seed}", seed=seed, cfg=cfg,
                                          asr_after=0.5 - 4 * fraction + seed / 10, ca_after=0.9, defense=defense,
                                          clean_fraction=fraction)
                runs.append(Run(record, tmp_path / "x.json"))
    runs.append(Run(save_defense_run(tmp_path / "runs", "lone", cfg=nc_config(attack="blended"), attack="blended",
                                     clean_fraction=0.1), tmp_path / "y.json"))  # one budget only: no panel
    paths = figures.clean_budget_curves(runs, tmp_path)
    assert [p.name for p in paths] == ["mnist5k_9_clean_budget.png", "mnist5k_9_clean_budget.pdf"]
    ((fig, _),) = kept
    panels = [ax for ax in fig.axes if ax.get_visible() and ax.lines]
    assert len(panels) == 2 and all(ax.get_xscale() == "log" for ax in panels)
    assert [t.get_text() for t in panels[0].get_xticklabels()] == ["0.5%", "1%", "5%"]
    assert panels[0].get_title().startswith("fine_tuning\n")  # a panel per defense, a colour per attack
    assert fig._suptitle.get_text().endswith("(mean ± std over seeds)")
    asr = next(c for c in panels[0].containers if c.get_label() == "badnets all2one: ASR after")
    expected = [100 * (0.5 - 4 * f + 0.05) for f in (0.005, 0.01, 0.05)]  # the mean of the two seeds
    assert list(asr.lines[0].get_ydata()) == pytest.approx(expected)


def test_every_sweep_preset_varies_the_declared_keys_around_the_default(compose_cfg):
    from importlib import resources

    import yaml
    from omegaconf import OmegaConf

    from backdoorbench.protocols import CLEAN_BUDGET_DEFENSES, SENSITIVITY, defense_defaults

    folder = resources.files("backdoorbench.conf").joinpath("experiment")

    def sweep(name):
        params = OmegaConf.load(str(folder.joinpath(f"{name}.yaml"))).hydra.sweeper.params
        return {key: [yaml.safe_load(v) for v in str(value).split(",")]
                if not str(value).startswith("[") else value for key, value in params.items()}

    for defense, keys in SENSITIVITY.items():
        assert compose_cfg(f"experiment=sensitivity_{defense}").defense._target_ == defense_defaults(defense)["_target_"]
        params = sweep(f"sensitivity_{defense}")
        assert set(params) == {f"defense.{key}" for key in keys}
        for key in keys:  # the default is one of the swept values
            values = params[f"defense.{key}"]
            default = defense_defaults(defense)[key]
            assert (str(default).replace(" ", "") in values) if isinstance(values, str) else default in values
    presets = sorted(p.name[len("sensitivity_"):-len(".yaml")] for p in folder.iterdir()
                     if p.name.startswith("sensitivity_"))
    assert presets == sorted(SENSITIVITY), "a sensitivity_<defense>.yaml for each defense that declares `sensitivity`"
    assert OmegaConf.load(str(folder.joinpath("clean_budget.yaml"))).hydra.sweeper.params._get_node("defense")._value() \
        == "${clean_budget_defenses:}", "clean_budget.yaml's defenses come from the classes, not a typed list"
    assert all("clean_fraction" in defense_defaults(d) for d in CLEAN_BUDGET_DEFENSES)


def test_the_clean_budget_multirun_sweeps_every_defense_that_uses_clean_data(tmp_path):
    """Hydra's own sweeper and launcher, in process, over experiment=clean_budget: the defense list it
    expands is the classes' `needs_clean_data` declarations (the resolver). The command line pins the
    budget axis to one value (a sweeper param given there merges over the preset's), so that Hydra
    composes one job per defense, not five; the preset's five budgets are read from its params."""
    import backdoorbench.cli  # noqa: F401  (registers the clean_budget_defenses resolver)
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from hydra.types import RunMode
    from hydra.utils import get_object

    from backdoorbench import registry
    from backdoorbench.protocols import CLEAN_BUDGET_DEFENSES

    jobs = []
    with initialize_config_module(config_module="backdoorbench.conf", version_base=None):
        GlobalHydra.instance().hydra.multirun(
            config_name="config", task_function=lambda cfg: jobs.append((cfg.defense._target_, cfg.defense.clean_fraction)),
            overrides=["experiment=clean_budget", "attack=badnets", "hydra.sweeper.params={defense.clean_fraction:0.02}",
                       f"hydra.sweep.dir={tmp_path}",
                       "hydra/job_logging=none", "hydra/hydra_logging=none"])  # `disabled` disables every existing logger
        preset = GlobalHydra.instance().hydra.compose_config(
            "config", ["experiment=clean_budget"], run_mode=RunMode.MULTIRUN, with_log_configuration=False)
    swept = sorted((get_object(target).__name__, budget) for target, budget in jobs)
    expected = [registry.method_class("defense", name).__name__ for name in CLEAN_BUDGET_DEFENSES]
    assert swept == sorted((cls, 0.02) for cls in expected)
    assert len(jobs) == len(CLEAN_BUDGET_DEFENSES) and "strip" in CLEAN_BUDGET_DEFENSES
    assert preset.hydra.sweeper.params["defense.clean_fraction"] == "0.005,0.01,0.02,0.05,0.1"
    assert preset.hydra.sweeper.params["defense"] == ",".join(CLEAN_BUDGET_DEFENSES)


def test_the_sweeps_lists_are_the_defense_classes_declarations():
    """SENSITIVITY and CLEAN_BUDGET_DEFENSES are read from the classes, not typed: a new defense joins
    them by its `sensitivity` and `needs_clean_data` alone."""
    from backdoorbench import protocols, registry

    classes = registry.classes("defense", builtin_only=True)
    assert protocols.SENSITIVITY == {name: cls.sensitivity for name, cls in classes.items() if cls.sensitivity}
    assert set(protocols.SENSITIVITY) == set(classes)  # today every built-in declares its swept keys
    assert protocols.CLEAN_BUDGET_DEFENSES == tuple(name for name, cls in classes.items() if cls.needs_clean_data)
    assert "strip" in protocols.CLEAN_BUDGET_DEFENSES and "clp" not in protocols.CLEAN_BUDGET_DEFENSES  # data-free
    assert protocols.SENSITIVITY["nad"] == ("betas",)


@pytest.mark.slow
def test_every_protocol_preset_passes_preflight(tmp_path):
    import backdoorbench.cli as cli
    from backdoorbench.protocols import SENSITIVITY

    for name in ["benign", "clean_budget", *(f"sensitivity_{d}" for d in SENSITIVITY)]:
        cli.preflight(["--multirun", f"experiment={name}", f"results_dir={tmp_path}"])


def test_a_sweep_of_lists_passes_preflight_and_a_bad_swept_value_is_refused(tmp_path):
    import backdoorbench.cli as cli

    cli.preflight(["--multirun", "experiment=sensitivity_nad", f"results_dir={tmp_path}"])  # NAD's betas: lists
    with pytest.raises(Exception, match="anomaly_threshold"):  # refused before any data
        cli.preflight(["--multirun", "experiment=sensitivity_neural_cleanse", "defense.anomaly_threshold=-1,2",
                       f"results_dir={tmp_path}"])


def test_a_detector_on_a_clean_victim_records_its_benign_false_positives_and_its_cost(tmp_path, compose_cfg, mnist5k):
    from backdoorbench.pipeline import run
    from backdoorbench.records import load_record

    record, path = run(compose_cfg("attack=none", "defense=spectral", "trainer.epochs=0", "eval.stealth_images=0",
                                   f"results_dir={tmp_path}", "trainer.progress=false", "logger=none"))
    benign = load_record(path).benign
    # the official rule, the scores above each class's 85th percentile: 15% of every class of a clean set goes
    removed = record.metrics["detection"]["n_flagged"]
    assert sum(int(0.15 * (n - 1)) for n in torch.bincount(mnist5k.train.labels).tolist()) <= removed
    assert removed <= sum(-(-15 * n // 100) for n in torch.bincount(mnist5k.train.labels).tolist())
    assert benign["measure"] == "share of the clean training set removed"
    assert benign["false_positive"] == removed / 4000 == record.metrics["detection"]["fpr"]
    assert benign["n_flagged"] == removed
    assert benign["ca_drop"] == pytest.approx(record.metrics["attacked"]["clean_acc"] - record.metrics["defended"]["clean_acc"])
    cost = record.defense_cost
    # one pass over the 4,000 training images for the features; the retraining has no epoch
    assert (cost["forward_images"], cost["backward_images"]) == (4000, 0)
    assert cost["passes_per_train_image"] == 1.0 and cost["flops"] == 4000 * cost["forward_flops_per_image"] > 0


def test_the_protocol_columns_sort_and_explain_themselves_in_a_real_browser(tmp_path):
    from backdoorbench.leaderboard import write_leaderboard
    from tests.chromium import Chromium
    from tests.test_leaderboard import BROWSER, PAGE_STATE, center_of

    if BROWSER is None:
        pytest.skip("no Chromium on PATH")
    runs = tmp_path / "runs"
    for k, (threshold, asr, seconds) in enumerate(((1.5, 0.05, 30.0), (2.0, 0.10, 3.0), (3.0, 0.60, 12.0))):
        save_defense_run(runs, f"t{k}", asr_after=asr, cfg=nc_config(threshold=threshold),
                         cost={"seconds": seconds, "passes_per_train_image": seconds / 10})
    save_defense_run(runs, "clean", attack="none", cost={"seconds": 1.0, "passes_per_train_image": 0.1},
                     benign={"measure": "any class flagged on a clean model", "false_positive": 0.0})
    page = write_leaderboard(tmp_path).html
    with Chromium(BROWSER, width=1400, height=600) as browser:
        browser.open(page)
        (table,) = browser.evaluate(PAGE_STATE)
        headers = [h["text"] for h in table["headers"]]
        for header in ("cost s", "passes/img", "benign FP %", "ASR spread"):
            column = headers.index(header)
            assert table["headers"][column]["type"] == "number"
            browser.click(*center_of(browser, "table.sortable th", column))
            keys = [row[column] for row in browser.evaluate(PAGE_STATE)[0]["rows"]]
            present = [float(k) for k in keys if k != ""]
            assert present == sorted(present) and keys[len(present):] == [""] * (len(keys) - len(present))
        titles = browser.evaluate("Array.prototype.map.call(document.querySelectorAll('th'), function (th) "
                                  "{ return th.textContent + ': ' + th.title; })")
        assert any(t.startswith("ASR spread: ASR spread, in points") for t in titles)
        assert any(t.startswith("benign FP %: benign FP, in %") for t in titles)
        browser.click(*center_of(browser, "input[value=all]"))
        browser.screenshot(tmp_path / "page.png")
        assert browser.errors == []


@pytest.mark.slow
def test_a_sensitivity_multirun_gives_the_default_row_its_spread(tmp_path):
    from backdoorbench.leaderboard import write_leaderboard
    from tests.conftest import run_cli

    proc = run_cli("--multirun", "experiment=sensitivity_clp", "trainer.epochs=0", "eval.stealth_images=0",
                   "trainer.progress=false", "logger=none", f"results_dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    rows = list(csv.DictReader(write_leaderboard(tmp_path).csv["defenses"].open()))
    assert len(rows) == 5  # u = 2, 2.5, 3, 3.5, 4
    (default,) = [r for r in rows if r["asr_spread_mean"] != ""]
    # the setting names what differs from the defaults: nothing for the default u=3, u for the others
    assert default["setting"] == "" and default["canonical"] == "true"
    assert sorted(r["setting"] for r in rows if r is not default) == ["u=2", "u=2.5", "u=3.5", "u=4"]
    asr = [float(r["asr_after_mean"]) for r in rows]
    assert float(default["asr_spread_mean"]) == pytest.approx(max(asr) - min(asr))
    # CLP is data-free: with the official pairing (registration order) it makes no forward pass at all
    assert all(float(r["cost_s_mean"]) >= 0 and float(r["passes_per_img_mean"]) == 0 for r in rows), rows


def test_the_sensitivity_table_orders_list_values_by_number():
    from backdoorbench.report.protocol_tables import _sort_key

    settings = [((1000.0, 2000.0),), ((125.0, 250.0),), ((500.0, 1000.0),)]  # as text, "1000" sorts first
    assert sorted(settings, key=_sort_key) == [((125.0, 250.0),), ((500.0, 1000.0),), ((1000.0, 2000.0),)]
    assert sorted([("smaller",), ("relative_size",)], key=_sort_key) == [("relative_size",), ("smaller",)]
    assert sorted([(10.0,), (2.5,)], key=_sort_key) == [(2.5,), (10.0,)]
