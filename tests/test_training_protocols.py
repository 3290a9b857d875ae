"""Training protocols (conf/protocol/, issue 29): `dataset=X` with no override resolves to the
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

import backdoorbench.config  # noqa: F401  (registers the schemas)
from backdoorbench.datasets.base import Split
from backdoorbench.leaderboard import build_rows, to_markdown
from backdoorbench.pipeline import run_config_hash
from backdoorbench.train import Trainer
from tests.conftest import ROOT

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
    # Of the attacks whose defaults issue 29 kept (the others' rows are rerun at their new defaults).
    kept = {"badnets", "blended", "sig", "none"}
    records = [r for r in (json.loads(path.read_text()) for path in files) if r["attack"].get("name") in kept]
    records = sorted(records, key=lambda r: r["created_at"])[-200::25]
    assert len(records) == 8
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
        trainer = resolved(f"dataset={dataset}", f"attack={attack}")["trainer"]
        assert (trainer["epochs"], trainer["schedule"], trainer["milestones"]) == (epochs, "multistep", milestones)
        factors = [0.1 ** sum(e / epochs >= m for m in milestones) for e in range(epochs)]
        assert factors == ([1.0] * 100 + [0.1] * 100 if dataset == "tiny_imagenet" else [1.0] * epochs)
    assert resolved("dataset=cifar10", f"attack={attack}", "trainer.epochs=5")["trainer"]["milestones"] == [20.0, 40.0, 60.0, 80.0]
    assert resolved("dataset=cifar10", f"attack={attack}", "protocol=quick")["trainer"]["schedule"] == "cosine"
    assert resolved("dataset=mnist5k", f"attack={attack}")["trainer"]["schedule"] == "cosine"  # quick: its own recipe
    assert resolved("dataset=cifar10", "attack=badnets")["trainer"]["schedule"] == "cosine"  # the prototype's
    assert resolved("dataset=cifar10", f"attack={attack}", "trainer.schedule=cosine")["trainer"]["schedule"] == "cosine"
