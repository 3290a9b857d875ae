"""Training protocols (conf/protocol/): `dataset=X` with no override resolves to the
paper-scale recipe (BackdoorBench v2.2's prototype for the dataset, fp32), mnist5k keeps the quick
CPU recipe, `protocol=` picks either anywhere; the two schedules BackdoorBench's prototypes need
(CosineAnnealingLR with a fixed T_max, ReduceLROnPlateau on the training loss); the record names
its protocol, the leaderboard never compares two protocols, and the run ids made before protocols
existed stay what they were."""

from __future__ import annotations

import json
import math
from functools import partial
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from backdoorbench.config import run_config_hash
from backdoorbench.datasets.base import Split
from backdoorbench.leaderboard import build_rows, to_markdown
from backdoorbench.train import Trainer
from tests.conftest import ROOT
from tests.tiny import RecordingTrainer

# BackdoorBench v2.2, SCLBD/BackdoorBench@f02e353:config/attack/prototype/<file>.yaml: every
# prototype trains PreActResNet-18 with SGD (lr 0.01, momentum 0.9, weight decay 5e-4), batch 128,
# amp False; cifar10 and gtsrb step CosineAnnealingLR(T_max=100) for 100 and 50 epochs, tiny steps
# ReduceLROnPlateau for 200. MNIST has no prototype: its scripts' default, cifar10.yaml.
PROTOTYPES = {
    "cifar10": ("cifar10.yaml", 100, "cosine", 100, "PreActResNet18"),
    "gtsrb": ("gtsrb.yaml", 50, "cosine", 100, "PreActResNet18"),
    "tiny_imagenet": ("tiny.yaml", 200, "plateau", None, "PreActResNet18"),
    "mnist": ("cifar10.yaml", 100, "cosine", 100, "MnistCNN"),
}


def victim(cfg: dict) -> dict:
    """The trainer keys the victim trains with: `trainer` under what `victim_trainer` sets."""
    return {**cfg["trainer"], **{k: v for k, v in cfg["victim_trainer"].items() if v not in (None, [])}}


def resolved(*overrides: str) -> dict:
    """The config `python -m backdoorbench --cfg job --resolve <overrides>` prints."""
    with initialize_config_module(config_module="backdoorbench.conf", version_base="1.3"):
        return OmegaConf.to_container(compose("config", overrides=list(overrides)), resolve=True)


@pytest.mark.parametrize("dataset", sorted(PROTOTYPES))
def test_a_real_dataset_resolves_to_backdoorbench_v2_2s_recipe_at_fp32(dataset):
    file, epochs, schedule, period, model = PROTOTYPES[dataset]
    cfg = resolved(f"dataset={dataset}")
    assert cfg["protocol"]["name"] == "backdoorbench"
    assert cfg["protocol"]["source"] == f"SCLBD/BackdoorBench@f02e353:config/attack/prototype/{file}"
    trainer = cfg["trainer"]
    assert (trainer["epochs"], trainer["schedule"], trainer["schedule_period"]) == (epochs, schedule, period)
    assert trainer["precision"] == "tf32" and trainer["batch_size"] == 128  # fp32, TF32 convolutions as PyTorch's default
    optimizer = trainer["optimizer"]
    assert optimizer["_target_"] == "torch.optim.SGD"
    assert (optimizer["lr"], optimizer["momentum"], optimizer["weight_decay"]) == (0.01, 0.9, 0.0005)
    assert cfg["model"]["_target_"].endswith(model)
    assert cfg["dataset"]["crop_padding"] == 4  # get_transform's RandomCrop(padding=4) for every dataset
    if dataset == "tiny_imagenet":  # BackdoorBench flips CIFAR-10 only
        assert cfg["dataset"]["hflip"] is False and trainer["plateau_patience"] == 10 and trainer["gamma"] == 0.1


def test_mnist5k_keeps_the_quick_recipe_and_protocol_picks_either_anywhere():
    quick = resolved()
    assert quick["protocol"]["name"] == "quick"
    assert (quick["trainer"]["epochs"], quick["trainer"]["precision"], quick["trainer"]["schedule_period"]) == (10, "auto", None)
    cifar_quick = resolved("dataset=cifar10", "protocol=quick")
    assert cifar_quick["protocol"]["name"] == "quick" and cifar_quick["trainer"]["epochs"] == 10
    mnist5k_paper = resolved("protocol=backdoorbench")
    assert mnist5k_paper["protocol"]["name"] == "backdoorbench" and mnist5k_paper["trainer"]["epochs"] == 100
    assert resolved("dataset=cifar10", "trainer.epochs=3")["trainer"]["epochs"] == 3  # the command line wins


def test_bpp_squeezes_to_the_official_8_levels_except_on_mnist5k_under_quick():
    # RU-System-Software-and-Security/BppAttack@f6b6580:config.py:29 and SCLBD/BackdoorBench@f02e353:
    # config/attack/bpp/default.yaml: squeeze_num 8. mnist5k's near-binary digits need 2 (quick's value).
    assert resolved("dataset=cifar10", "attack=bpp")["attack"]["squeeze_num"] == 8
    assert resolved("dataset=gtsrb", "attack=bpp", "protocol=quick")["attack"]["squeeze_num"] == 8
    assert resolved("attack=bpp")["attack"]["squeeze_num"] == 2
    assert resolved("attack=bpp", "protocol=backdoorbench")["attack"]["squeeze_num"] == 8
    assert resolved("dataset=cifar10", "attack=bpp", "attack.squeeze_num=4")["attack"]["squeeze_num"] == 4


def lrs(trainer: Trainer, epochs: int | None = None) -> list[float]:
    g = torch.Generator().manual_seed(0)
    split = Split(torch.randint(0, 256, (16, 1, 4, 4), dtype=torch.uint8, generator=g), torch.randint(0, 2, (16,), generator=g))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 2))
    return [row["lr"] for row in trainer.fit(model, split, generator=torch.Generator().manual_seed(1), epochs=epochs)]


def tiny(**kwargs) -> Trainer:
    return Trainer(batch_size=8, optimizer=partial(torch.optim.SGD, lr=0.01), augment=False, progress=False,
                   device="cpu", **kwargs)


def test_cosine_with_a_period_steps_as_cosine_annealing_lr_with_that_t_max():
    # GTSRB's recipe: T_max 100 over 50 epochs, so the lr ends near half its start.
    trainer = tiny(epochs=6, schedule="cosine", schedule_period=12)
    reference_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.01)
    reference = torch.optim.lr_scheduler.CosineAnnealingLR(reference_opt, T_max=12)
    expected = []
    for _ in range(6):
        expected.append(reference_opt.param_groups[0]["lr"])
        reference_opt.step()
        reference.step()
    assert lrs(trainer) == pytest.approx(expected, rel=1e-12)
    assert lrs(trainer)[-1] > 0.5 * 0.01  # not annealed to 0 over the 6 epochs
    # A fit with its own epochs (a defense's fine-tuning) schedules over those, not the period,
    # and multistep milestones stay fractions of the run (paper presets set them so).
    assert lrs(trainer, epochs=2) == pytest.approx([0.01, 0.01 * 0.5 * (1 + math.cos(math.pi / 2))])
    steps = tiny(epochs=4, schedule="multistep", milestones=(0.5,), gamma=0.1, schedule_period=100)
    assert lrs(steps) == pytest.approx([0.01, 0.01, 0.001, 0.001])


def test_plateau_drops_the_lr_by_gamma_after_patience_epochs_without_a_lower_training_loss():
    trainer = tiny(epochs=6, schedule="plateau", gamma=0.1, plateau_patience=1)
    # A loss that never decreases (the learning rate times zero gradient): ReduceLROnPlateau's rule
    # with patience 1 lowers the lr after every second epoch without improvement.
    g = torch.Generator().manual_seed(0)
    split = Split(torch.randint(0, 256, (16, 1, 4, 4), dtype=torch.uint8, generator=g), torch.randint(0, 2, (16,), generator=g))
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 2))

    def flat_step(net, x, y):
        logits = net(x)
        return (logits * 0).sum() + 1.0, logits, y

    history = trainer.fit(model, split, generator=torch.Generator().manual_seed(1), step=flat_step)
    reference_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.01)
    reference = torch.optim.lr_scheduler.ReduceLROnPlateau(reference_opt, factor=0.1, patience=1)
    expected = []
    for _ in range(6):
        expected.append(reference_opt.param_groups[0]["lr"])
        reference.step(1.0)
    assert [row["lr"] for row in history] == pytest.approx(expected)
    assert expected[-1] < expected[0]  # the rule did fire


def test_a_plateau_fit_resumes_from_its_checkpoint_with_the_schedulers_state(tmp_path):
    g = torch.Generator().manual_seed(0)
    split = Split(torch.randint(0, 256, (16, 1, 4, 4), dtype=torch.uint8, generator=g), torch.randint(0, 2, (16,), generator=g))

    def fit(checkpoint=None, on_epoch=None):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 2))
        trainer = tiny(epochs=5, schedule="plateau", plateau_patience=0)
        return trainer.fit(model, split, generator=torch.Generator().manual_seed(1), checkpoint=checkpoint,
                           on_epoch=on_epoch), model

    straight, straight_model = fit()

    class Stop(Exception):
        pass

    def stop_at_3(row):
        if row["epoch"] == 3:
            raise Stop

    with pytest.raises(Stop):
        fit(tmp_path / "victim.pt", stop_at_3)
    resumed, resumed_model = fit(tmp_path / "victim.pt")
    assert [r["lr"] for r in resumed] == [r["lr"] for r in straight]
    assert all(torch.equal(a, b) for a, b in zip(straight_model.state_dict().values(), resumed_model.state_dict().values()))


def test_runs_made_before_protocols_existed_keep_their_run_ids():
    # The protocol block and the new trainer keys at their inert defaults are not in the run id: the
    # committed mnist5k records recompose (from their own overrides) to the ids they carry.
    files = sorted((ROOT / "results" / "runs" / "mnist5k").glob("*/*.json"))
    assert files, "the committed records are part of the repository"
    # Of the attacks whose defaults the training protocols (e325bc0, e1e0375) kept (the others' rows are rerun at their new defaults).
    kept = {"badnets", "blended", "sig", "none"}
    # and of the defenses whose defaults have not moved since (the others' new defaults give new ids)
    kept_defenses = {"none", "angular_margin", "activation_clustering"}
    records = [r for r in (json.loads(path.read_text()) for path in files)
               if r["attack"].get("name") in kept and r["defense"].get("name") in kept_defenses]
    # Records made before 2026-12-02T03 carry ids of an older composition (of the record schema's upgrade);
    # the sample is of those up to 2026-12-04, so that records added later leave it as it is.
    records = sorted((r for r in records if "2026-12-02T03" <= r["created_at"] < "2026-12-04"),
                     key=lambda r: r["created_at"])[::12]
    assert len(records) == 7
    for record in records:
        config = resolved(*record["overrides"])
        assert run_config_hash(config) == record["run_id"], record["overrides"]


def test_the_record_names_its_protocol_and_the_leaderboard_keeps_protocols_apart():
    from tests.test_leaderboard import config as leaderboard_config
    from tests.test_records import make_record

    def record(name: str, protocol: str | None, epochs: int):
        cfg = leaderboard_config(epochs=epochs)
        if protocol is not None:
            cfg["protocol"] = {"name": protocol}
        return make_record(run_id=name, group_id=name, seed=0, dataset={"name": "cifar10"}, model={"name": "preact_resnet18"},
                           attack={"name": "badnets", "target_mode": "all2one", "target": 0, "poison_rate": 0.1,
                                   "n_poisoned": 5000, "poisoned_indices_sha256": "0" * 64},
                           defense={"name": "none"}, config=cfg, created_at="2026-12-03T00:00:00+00:00",
                           overrides=["attack=badnets", "seed=0"], env={"torch": "x", "git_commit": None})

    rows = build_rows([record("a", "backdoorbench", 100), record("b", None, 10)])
    assert sorted(r.protocol for r in rows) == ["backdoorbench", "quick"]  # no name: made before protocols (quick)
    text = to_markdown(rows)
    assert "## cifar10, backdoorbench protocol" in text and "## cifar10, quick protocol" in text
    # each its own canonical row: two protocols never compete for one attack's place
    assert all(r.canonical for r in rows)


def test_tf32_is_fp32_with_pytorchs_default_tf32_policy_and_plain_fp32_on_the_cpu():
    from backdoorbench.precision import precision_context, resolve_precision

    assert resolve_precision("tf32", "cpu") == "fp32" and resolve_precision("tf32", "cuda") == "tf32"
    assert resolve_precision("tf32", "cuda", min_precision="fp32") == "fp32"  # LIRA, WB: TF32 would round their trigger
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
        with precision_context("cuda", "tf32"):  # the flags only: no GPU needed to set them
            assert (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) == (True, False)
        with precision_context("cuda", "fp32"):
            assert (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) == (False, False)
        assert (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) == (True, True)  # restored
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize("attack", ["bpp", "wanet"])
def test_an_attack_whose_backdoorbench_run_has_its_own_scheduler_gets_it(attack):
    """SCLBD/BackdoorBench@f02e353:config/attack/{bpp,wanet}/default.yaml replace the prototype's
    scheduler with MultiStepLR at epochs 100/200/300/400: constant over CIFAR-10's 100 epochs and
    GTSRB's 50, x0.1 from epoch 100 of Tiny-ImageNet's 200 (conf/protocol_attack/)."""
    for dataset, epochs, milestones in (("cifar10", 100, [1.0, 2.0, 3.0, 4.0]), ("gtsrb", 50, [2.0, 4.0, 6.0, 8.0]),
                                        ("tiny_imagenet", 200, [0.5, 1.0, 1.5, 2.0])):
        trainer = victim(resolved(f"dataset={dataset}", f"attack={attack}"))
        assert (trainer["epochs"], trainer["schedule"], trainer["milestones"]) == (epochs, "multistep", milestones)
        factors = [0.1 ** sum(e / epochs >= m for m in milestones) for e in range(epochs)]
        assert factors == ([1.0] * 100 + [0.1] * 100 if dataset == "tiny_imagenet" else [1.0] * epochs)
    assert victim(resolved("dataset=cifar10", f"attack={attack}", "trainer.epochs=5"))["milestones"] == [20.0, 40.0, 60.0, 80.0]
    assert victim(resolved("dataset=cifar10", f"attack={attack}", "protocol=quick"))["schedule"] == "cosine"
    assert victim(resolved("dataset=mnist5k", f"attack={attack}"))["schedule"] == "cosine"  # quick: its own recipe
    assert victim(resolved("dataset=cifar10", "attack=badnets"))["schedule"] == "cosine"  # the prototype's
    assert victim(resolved("dataset=cifar10", f"attack={attack}", "victim_trainer.schedule=cosine"))["schedule"] == "cosine"


# Under protocol=backdoorbench each attack trains as BackdoorBench v2.2 trains it, where its attack config
# overrides the prototype (SCLBD/BackdoorBench@f02e353:config/attack/<attack>/*.yaml and attack/<attack>.py;
# conf/protocol_attack/backdoorbench/, docs/ledger/<attack>.yaml): one dataset per attack. The quick protocol's
# values (no such file) are held to the ledger by tests/test_ledger.py on mnist5k.
BACKDOORBENCH_RUNS = {
    # bpp/default.yaml:17 `dithering: False`
    "bpp": ("cifar10", {"attack.dithering": False}),
    # wanet/default.yaml:6-7 and its PostTensorTransform: crop 5, rotation 10 (the authors' quarter of the images)
    "wanet": ("gtsrb", {"attack.augment.crop_padding": 5, "attack.augment.rotation": 10, "attack.augment.rotation_p": 0.25}),
    # inputaware: MultiStepLR at joint epochs 100..400 (x0.1 from joint epoch 100 of tiny's 175); the
    # generator's 200..500 lie past every run's end
    "input_aware": ("tiny_imagenet", {"victim_trainer.schedule": "multistep", "victim_trainer.milestones": [0.5, 1.0, 1.5, 2.0],
                                      "attack.generator_milestones": []}),
    # lira/cifar10.yaml: 50 joint epochs of 300, eps 0.01 on CIFAR-10's std, lr_atk 1e-4, stage II fine-tunes
    # stage I's f with MultiStepLR at 50, 100, 150, 200 of its 250 epochs
    "lira": ("cifar10", {"attack.stage1_epochs": 50, "victim_trainer.epochs": 250, "attack.eps": 0.0025033,
                         "attack.generator_lr": 1e-4, "attack.stage2_init": "stage1", "victim_trainer.schedule": "multistep",
                         "victim_trainer.milestones": [0.2, 0.4, 0.6, 0.8], "trainer.schedule": "cosine",
                         # lira/default.yaml:1-2 and its PostTensorTransform in both stages: crop 5, rotation 10, every batch
                         "attack.augment.crop_padding": 5, "attack.augment.rotation": 10, "attack.augment.rotation_p": 1.0}),
    # lc trains its victim as BadNets does, on the prototype: the protocol's trainer, nothing of its own
    "label_consistent": ("cifar10", {"trainer.epochs": 100, "trainer.schedule": "cosine", "trainer.schedule_period": 100,
                                     "trainer.milestones": [0.5, 0.75]}),
}


def value_at(cfg: dict, key: str):
    node = cfg
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


@pytest.mark.parametrize("attack", sorted(BACKDOORBENCH_RUNS))
def test_an_attack_trains_under_backdoorbench_as_backdoorbench_trains_it(attack):
    dataset, expected = BACKDOORBENCH_RUNS[attack]
    cfg = resolved(f"attack={attack}", f"dataset={dataset}")  # the dataset's default protocol: backdoorbench
    assert cfg["protocol"]["name"] == "backdoorbench"
    assert {key: value_at(cfg, key) for key in expected} == pytest.approx(expected, rel=1e-4)


def test_wanet_trains_its_victim_with_attack_augment_and_leaves_the_trainer_alone():
    from backdoorbench.attacks.wanet import WaNet
    from backdoorbench.errors import ConfigError

    g = torch.Generator().manual_seed(0)
    split = Split(torch.randint(0, 256, (8, 3, 8, 8), dtype=torch.uint8, generator=g), torch.arange(8) % 4)
    for augment, expected in ((None, (2, 0.0, 0.5)), ({"crop_padding": 5, "rotation": 10, "rotation_p": 0.25}, (5, 10.0, 0.25)),
                              ({"crop_padding": None, "rotation": 10}, (2, 10.0, 0.5))):
        seen: list = []
        trainer = RecordingTrainer(seen)
        WaNet(num_classes=4, image_shape=(3, 8, 8), augment=augment).train_victim(
            trainer, torch.nn.Identity(), split, torch.Generator().manual_seed(0))
        assert seen == [expected]
        assert (trainer.crop_padding, trainer.rotation, trainer.rotation_p) == (2, 0.0, 0.5)  # untouched
    with pytest.raises(ConfigError, match=r"attack.augment.rotation_p=2 is out of range.*the official 0.25"):
        WaNet(num_classes=4, image_shape=(3, 8, 8), augment={"rotation_p": 2})


def test_lira_trains_both_stages_with_attack_augment_and_leaves_the_trainer_alone(monkeypatch):
    """BackdoorBench's lira crops and rotates every batch of stage I and stage II (its PostTensorTransform):
    `attack.augment` reaches both stages' trainers, and the trainer the defenses use stays as it was."""
    from backdoorbench.attacks import lira as lira_module
    from backdoorbench.attacks.lira import LIRA

    monkeypatch.setattr(lira_module, "recipe", lambda trainer, **kwargs: trainer)  # stage I's own SGD: not under test
    g = torch.Generator().manual_seed(0)
    split = Split(torch.randint(0, 256, (8, 1, 16, 16), dtype=torch.uint8, generator=g), torch.arange(8) % 4)
    official = lira_module.OFFICIAL_AUGMENT
    for augment, expected in ((None, (2, 0.0, 0.5)), (official, (5, 10.0, 1.0)), ({"rotation": 10}, (2, 10.0, 0.5))):
        seen: list = []
        trainer = RecordingTrainer(seen)
        trainer.device = torch.device("cpu")
        LIRA(num_classes=4, image_shape=(1, 16, 16), generator_width=4, augment=augment).train_victim(
            trainer, torch.nn.Identity(), split, torch.Generator().manual_seed(0))
        assert seen == [expected, expected]  # stage I, then stage II
        assert (trainer.crop_padding, trainer.rotation, trainer.rotation_p) == (2, 0.0, 0.5)  # untouched


@pytest.mark.parametrize("attack", ["bpp", "wanet", "input_aware", "lira"])
def test_an_attacks_own_schedule_trains_its_victim_only(compose_cfg, attack):
    """BackdoorBench's per-attack schedules (conf/protocol_attack/) reach the victim's trainer only:
    the defenses fine-tune with the protocol's trainer, as BackdoorBench's defenses run their own
    cosine whatever the attack was."""
    from backdoorbench.config import victim_overrides, victim_trainer_node

    cfg = compose_cfg("dataset=cifar10", f"attack={attack}", "defense=fine_tuning")
    assert cfg.trainer.schedule == "cosine" and list(cfg.trainer.milestones) == [0.5, 0.75]
    victim = victim_trainer_node(cfg)
    assert victim.schedule == "multistep" and victim.gamma == 0.1
    epochs = victim.epochs
    first = {"lira": 50}.get(attack, 100)  # LIRA's stage II steps at its 50th epoch, the others at the 100th
    assert victim.milestones[0] == pytest.approx(first / epochs)
    assert set(victim_overrides(cfg)) <= {"schedule", "milestones", "gamma", "epochs"}
    assert victim.lr if "lr" in victim else True  # the optimizer stays the trainer's
    assert victim.optimizer == cfg.trainer.optimizer


def test_no_victim_trainer_keeps_the_run_id_and_the_victim_key(compose_cfg):
    """An unset `victim_trainer` is left out of the run id and the victim cache key, so the runs
    made before it existed keep their ids and their cached victims."""
    from omegaconf import OmegaConf

    from backdoorbench.cache import victim_key
    from backdoorbench.config import run_config_hash

    config = OmegaConf.to_container(compose_cfg(), resolve=True)
    without = {key: value for key, value in config.items() if key != "victim_trainer"}
    assert run_config_hash(config) == run_config_hash(without)
    assert victim_key(config, torch.device("cpu")) == victim_key(without, torch.device("cpu"))
    config["victim_trainer"]["schedule"] = "constant"
    assert run_config_hash(config) != run_config_hash(without)
    assert victim_key(config, torch.device("cpu")) != victim_key(without, torch.device("cpu"))


def test_the_pipeline_trains_the_victim_with_victim_trainer_and_defends_with_trainer(compose_cfg, tmp_path, monkeypatch):
    from backdoorbench import pipeline

    seen = {}
    obtain, defend = pipeline.obtain_victim, pipeline.defend

    def spy_obtain(cfg, config, run_id, data, attack, trainer, *rest, **kwargs):
        seen["victim"] = (trainer.schedule_name, trainer.epochs)
        return obtain(cfg, config, run_id, data, attack, trainer, *rest, **kwargs)

    def spy_defend(cfg, defense, excluded, attack, data, trainer, *rest):
        seen["defense"] = (trainer.schedule_name, trainer.epochs)
        return defend(cfg, defense, excluded, attack, data, trainer, *rest)

    monkeypatch.setattr(pipeline, "obtain_victim", spy_obtain)
    monkeypatch.setattr(pipeline, "defend", spy_defend)
    record, _ = pipeline.run(compose_cfg(
        "trainer.epochs=0", "victim_trainer.schedule=constant", "victim_trainer.epochs=1", "defense=fine_tuning",
        "defense.epochs=1", "eval.stealth_images=0", "trainer.progress=false", "cache=false", f"results_dir={tmp_path}"))
    assert seen == {"victim": ("constant", 1), "defense": ("cosine", 0)}
    assert record.config["victim_trainer"]["schedule"] == "constant"


@pytest.mark.parametrize("override, message", [
    ("victim_trainer.epochz=3", "error: victim_trainer.epochz is not a setting; did you mean victim_trainer.epochs?\n"),
    ("victim_trainer.epochs=-1", "error: victim_trainer.epochs=-1 is invalid; use an integer >= 0\n"),
])
def test_a_wrong_victim_trainer_key_or_value_is_one_line_and_exit_2(override, message, tmp_path, monkeypatch, capsys):
    import sys

    from backdoorbench.__main__ import main

    out = tmp_path / "never"
    monkeypatch.setattr(sys, "argv", ["backdoorbench", override, f"results_dir={out}"])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2 and capsys.readouterr().err == message and not out.exists()
