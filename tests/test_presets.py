"""Paper presets (conf/experiment/): each runs for one tiny step per dataset on real-format fixture
files, preflight expands the sweeps a preset defines, and bad values there are one-line errors."""

import shutil
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra

import backdoorbench
import backdoorbench.cli as cli
from backdoorbench.errors import ConfigError
from backdoorbench.records import load_record
from tests.conftest import run_cli
from tests.dataset_files import write_cifar10, write_gtsrb, write_mnist, write_tiny_imagenet

CONF = Path(backdoorbench.__file__).parent / "conf"
PRESETS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
# the presets that sweep datasets x attacks x target modes (LIRA's and WB's tables)
PAPER_SWEEPS = [name for name in PRESETS if "\n      paper:" in (CONF / "experiment" / f"{name}.yaml").read_text()]
# What keeps a run of the preset's attacks tiny; only the keys each attack has.
TINY_ATTACK = {"lira": ["attack.stage1_epochs=1", "attack.generator_width=4"],
               "wb": ["attack.stage1_epochs=1", "attack.generator_width=4"],
               "input_aware": ["attack.mask_epochs=1", "attack.channels=4"]}
# ResNets at width 8 (64 is the real one): a CPU runs ResNet-18 on 64 px images slowly even for 200 of them.
TINY_MODEL = {"lira/gtsrb": ["model.width=8"], "lira/tiny_imagenet": ["model.width=8"]}
TINY = ["trainer.epochs=1", "trainer.batch_size=64", "trainer.progress=false", "eval.stealth_images=4", "logger=none"]


def sweep_params(name):
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="backdoorbench.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"experiment={name}"], return_hydra_config=True)
    GlobalHydra.instance().clear()
    return {key: str(value).split(",") for key, value in cfg.hydra.sweeper.params.items()}


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    write_mnist(root)
    write_cifar10(root)
    write_gtsrb(root)
    write_tiny_imagenet(root)
    return root


def test_there_are_paper_presets():
    assert {"lira_iccv21", "wb_neurips21"} <= set(PRESETS)
    for name in PRESETS:
        text = (CONF / "experiment" / f"{name}.yaml").read_text()
        assert text.startswith("# @package _global_") and "python -m backdoorbench --multirun experiment=" in text


@pytest.mark.slow
@pytest.mark.parametrize("name", PAPER_SWEEPS)
def test_every_preset_runs_one_tiny_step_per_dataset(name, data_root, tmp_path, compose_cfg):
    from backdoorbench.pipeline import run

    params = sweep_params(name)
    papers, attacks, modes = params["paper"], params["attack"], params["attack.target_mode"]
    assert len(papers) == 4 and modes == ["all2one", "all2all"]
    # every attack once and every dataset at least once, the target modes alternating
    for i in range(max(len(papers), len(attacks))):
        paper, attack, mode = papers[i % len(papers)], attacks[i % len(attacks)], modes[i % 2]
        extra = ["dataset.verify_md5=false"] if paper.endswith("cifar10") else []
        cfg = compose_cfg(f"experiment={name}", f"paper={paper}", f"attack={attack}", f"attack.target_mode={mode}",
                          f"dataset.root={data_root}", f"results_dir={tmp_path}", *TINY, *TINY_ATTACK.get(attack, []), *TINY_MODEL.get(paper, []), *extra)
        record, path = run(cfg)
        assert load_record(path).attack["name"] == attack and record.attack["target_mode"] == mode
        assert record.dataset["name"] == paper.split("/")[1]
        # the paper setting's schedule is what ran, minus what the command line replaced
        assert record.config["trainer"]["schedule"] == "multistep" and record.config["trainer"]["epochs"] == 1
        assert record.config["trainer"]["optimizer"]["lr"] == 0.01


@pytest.mark.slow
def test_the_angular_margin_preset_runs_one_tiny_step_of_each_model(data_root, tmp_path, compose_cfg):
    from backdoorbench.pipeline import run

    params = sweep_params("angular_margin_xu2020")
    assert params == {"defense.penalty_weight": ["0", "1", "10", "100", "1000"], "seed": ["0", "1", "2"]}
    for lam in ("0", "100"):  # C and B; A is the victim of both, trained once (the cache)
        cfg = compose_cfg("experiment=angular_margin_xu2020", f"defense.penalty_weight={lam}", f"dataset.root={data_root}",
                          f"results_dir={tmp_path}", *TINY, "eval.pgd.images=8", "eval.pgd.steps=2")
        record, path = run(cfg)
        assert record.dataset["name"] == "mnist" and record.model["name"] == "rbc_mnist"
        assert record.victim["cache"] == ("miss" if lam == "0" else "hit")
        assert record.config["trainer"]["optimizer"]["_target_"] == "torch.optim.Adam"
        sources = {(r["loss"], r["source"]) for r in load_record(path).metrics["defended"]["pgd"]}
        assert sources == {("ce", "self"), ("cw", "self"), ("ce", "attacked"), ("cw", "attacked")}


def test_paper_settings_carry_the_released_values(compose_cfg):
    cfg = compose_cfg("paper=lira/cifar10", "attack=lira")  # the authors' latest command (khoadoan106 README)
    assert cfg.model._target_.endswith("VGG11") and cfg.trainer.epochs == 500 and cfg.attack.stage1_epochs == 50
    assert (cfg.attack.eps, cfg.attack.test_eps, cfg.attack.stage2_init) == (0.0226, 0.00226, "scratch")
    cfg = compose_cfg("paper=lira/mnist", "attack=wb")  # WB takes LIRA's values (no released code)
    assert cfg.model._target_.endswith("MnistCNN") and cfg.trainer.epochs == 50
    assert (cfg.attack.stage1_epochs, cfg.attack.eps, cfg.attack.test_eps) == (10, 0.05, 0.005)
    assert compose_cfg("paper=lira/gtsrb", "attack=input_aware").attack.mask_epochs == 25
    assert compose_cfg("paper=lira/cifar10", "model=preact_resnet18").model._target_.endswith("PreActResNet18")  # CLI wins
    assert "stage1_epochs" not in compose_cfg("paper=lira/cifar10", "attack=badnets").attack


# The LIRA authors' three CIFAR-10 commands: (trainer.epochs, eps, test_eps, stage2_init, generator) in our pixel
# units. Latest: khoadoan106/backdoor_attacks@bc6e262 README (ImageNet std); first release and PaddlePaddle:
# sunbelbd/invisible_backdoor_attacks@07f38cd / @f292e73 README (CIFAR-10's std). docs/fidelity.md#paper-presets.
LIRA_CIFAR10 = {"lira/cifar10": (500, 0.0226, 0.00226, "scratch", "unet"),
                "lira/cifar10_first_release": (250, 0.025, 0.025, "scratch", "unet"),
                "lira/cifar10_paddle": (250, 0.0025, 0.0025, "stage1", "autoencoder")}


@pytest.mark.parametrize("paper", sorted(LIRA_CIFAR10))
def test_each_released_lira_cifar10_command_is_a_named_preset(paper, compose_cfg):
    epochs, eps, test_eps, init, generator = LIRA_CIFAR10[paper]
    for attack in ("lira", "wb"):  # WB takes LIRA's values (no released code)
        cfg = compose_cfg(f"paper={paper}", f"attack={attack}")
        assert cfg.dataset._target_.endswith("load_cifar10") and cfg.model._target_.endswith("VGG11")
        assert cfg.trainer.epochs == epochs
        assert (cfg.attack.eps, cfg.attack.test_eps, cfg.attack.stage2_init, cfg.attack.generator) == (
            eps, test_eps, init, generator)
        assert cfg.attack.stage1_epochs == 50 and cfg.attack.generator_lr == 1e-4
    # the other attacks of the table get the same victim and augmentation in every variant
    for attack in ("wanet", "input_aware", "badnets"):
        base, variant = compose_cfg("paper=lira/cifar10", f"attack={attack}"), compose_cfg(f"paper={paper}", f"attack={attack}")
        assert variant.attack == base.attack and variant.dataset == base.dataset
        assert {k: v for k, v in variant.trainer.items() if k != "epochs"} == {
            k: v for k, v in base.trainer.items() if k != "epochs"}


def test_gtsrb_and_tiny_imagenet_presets_use_the_latest_codes_normalisation(compose_cfg):
    # khoadoan106/backdoor_attacks@bc6e262 python/utils/dataloader.py normalises both with ImageNet's std:
    # CIFAR-10's --eps 0.1 / --test_eps 0.01 are 0.0226 / 0.00226 px there (GTSRB was 0.1 px, unnormalised).
    for dataset in ("gtsrb", "tiny_imagenet"):
        cfg = compose_cfg(f"paper=lira/{dataset}", "attack=lira")
        assert (cfg.attack.eps, cfg.attack.test_eps, cfg.trainer.epochs) == (0.0226, 0.00226, 500)


@pytest.mark.slow
def test_the_multirun_sweeps_the_preset_and_the_command_line_replaces_its_keys(data_root, tmp_path):
    proc = run_cli("--multirun", "experiment=lira_iccv21", "paper=lira/mnist", "attack=badnets", f"dataset.root={data_root}",
                   f"results_dir={tmp_path}", *TINY)
    assert proc.returncode == 0, proc.stderr
    records = [load_record(p) for p in sorted((tmp_path / "runs").rglob("*.json"))]
    # paper and attack were given: only the preset's target-mode sweep is left, two runs
    assert sorted(r.attack["target_mode"] for r in records) == ["all2all", "all2one"]
    assert {r.dataset["name"] for r in records} == {"mnist"} and {r.attack["name"] for r in records} == {"badnets"}


@pytest.fixture
def conf_with(tmp_path, monkeypatch):
    """conf_with(name, yaml): a copy of the config tree with one more preset, used by preflight."""
    def add(name, text):
        package = tmp_path / "bbconf_presets"
        if not package.exists():
            shutil.copytree(CONF, package)
            monkeypatch.syspath_prepend(str(tmp_path))
            monkeypatch.setattr(cli, "CONFIG_MODULE", "bbconf_presets")
        (package / "experiment" / f"{name}.yaml").write_text(text)
    yield add
    sys.modules.pop("bbconf_presets", None)


def test_preflight_expands_a_presets_sweeps_and_reports_bad_values(conf_with):
    header = "# @package _global_\nhydra:\n  sweeper:\n    params:\n"
    conf_with("bad_attack", header + "      attack: badnets,nope\n")
    conf_with("bad_rate", header + "      attack.poison_rate: 0.1,1.5\n")
    conf_with("bad_paper", header + "      paper: lira/mnist,lira/svhn\n")
    with pytest.raises(ConfigError, match="^unknown attack 'nope'; choose one of: adaptive_blend, badnets, "):
        cli.preflight(["--multirun", "experiment=bad_attack"])
    with pytest.raises(ConfigError, match=r"^attack.poison_rate=1.5 is out of range"):
        cli.preflight(["--multirun", "experiment=bad_rate"])
    with pytest.raises(ConfigError, match="^unknown paper 'lira/svhn'; choose one of: angular_margin/mnist, lira/cifar10, "
                                          "lira/cifar10_first_release, lira/cifar10_paddle, lira/gtsrb, lira/mnist"):
        cli.preflight(["--multirun", "experiment=bad_paper"])
    cli.preflight(["--multirun", "experiment=bad_rate", "attack.poison_rate=0.2"])  # the command line replaces the sweep
    cli.preflight(["experiment=bad_rate"])  # without --multirun Hydra ignores the sweep, and so does preflight
