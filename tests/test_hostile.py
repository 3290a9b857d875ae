"""The catalogue of hostile or broken input. Each case is a real `python -m backdoorbench` call that
must print exactly one line on stderr, `error: ...` naming the problem, exit with code 2, and
write nothing: no record, no Hydra output folder, no cache entry or lock file, not even the
results folder it was given.

Every value that can be checked without data is refused by the preflight, before Hydra starts,
before any data loads or any model trains (`test_refused_before_any_data_or_training` proves it
with loaders and trainer that fail when called). Only what is in the data files (DATA_CASES) or
in training itself (the loss turning NaN) is refused later; those runs clean up what Hydra had
already written for them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from backdoorbench import registry
from tests import dataset_files as files
from tests.conftest import run_cli

# The defenses eval.detection_only accepts, as the preflight lists them: every detecting built-in.
DETECTORS = ", ".join(sorted(name for name in registry.builtin_names("defense")
                             if name != "none" and registry.method_class("defense", name).is_detector()))

Setup = Callable[[Path], list[str]]


def fixed(*args: str) -> Setup:
    return lambda tmp: list(args)


def text_file_as_pattern(tmp: Path) -> list[str]:
    (tmp / "pattern.png").write_text("not an image, whatever the name says")
    return ["attack=blended", f"attack.pattern={tmp / 'pattern.png'}"]


def lf_resource_of_another_dataset(tmp: Path) -> list[str]:
    """BackdoorBench's CIFAR-10 LF perturbation (uint8, 32x32x3) given for 28x28x1 MNIST."""
    np.save(tmp / "cifar10_preactresnet18_0_255.npy", np.zeros((32, 32, 3), dtype=np.uint8))
    return ["attack=lf", f"attack.resource={tmp / 'cifar10_preactresnet18_0_255.npy'}"]


def mnist_root_with(tmp: Path, *, images: np.ndarray | None = None, labels: np.ndarray | None = None) -> list[str]:
    """A tiny MNIST in the real IDX format whose train images or labels are then replaced."""
    root = tmp / "data"
    files.write_mnist(root, gz=False)
    raw = root / "MNIST" / "raw"
    if images is not None:
        (raw / "train-images-idx3-ubyte").write_bytes(files.idx_bytes(images))
    if labels is not None:
        (raw / "train-labels-idx1-ubyte").write_bytes(files.idx_bytes(labels))
    return ["dataset=mnist", f"dataset.root={root}", "model=mnist_cnn"]


def mnist_wrong_shape(tmp: Path) -> list[str]:
    return mnist_root_with(tmp, images=np.zeros((40, 27, 27), dtype=np.uint8))


def mnist_label_out_of_range(tmp: Path) -> list[str]:
    return mnist_root_with(tmp, labels=np.array([3, 12] * 20, dtype=np.uint8))  # digits go to 9


# (id, setup -> extra CLI arguments, a fragment the error line must contain)
CASES: list[tuple[str, Setup, str]] = [
    # unknown names: config keys, group options (ours and Hydra's own)
    ("unknown key", fixed("trainer.epochz=3"), "trainer.epochz is not a setting of trainer default; did you mean trainer.epochs?"),
    ("added key the target does not take", fixed("+trainer.foo=1"),
     "trainer.foo is not a setting of backdoorbench.train.Trainer"),
    ("unknown attack", fixed("attack=nope"), "unknown attack 'nope'; choose one of: adaptive_blend, badnets, blended"),
    ("unknown optimizer", fixed("trainer/optimizer=nope"), "unknown trainer/optimizer 'nope'; choose one of: adam, sgd"),
    ("unknown value in a sweep", fixed("--multirun", "attack=badnets,nope"), "unknown attack 'nope'"),
    ("unknown launcher", fixed("--multirun", "hydra/launcher=nope"),
     "unknown hydra/launcher 'nope'; choose one of: basic, gpu_pack, joblib, submitit_local, submitit_slurm"),
    ("unknown target mode", fixed("attack.target_mode=some2some"),
     "attack.target_mode='some2some' is unknown; choose one of: all2one, all2all"),
    # near misses: the line names what was probably meant
    ("attack name in another case", fixed("attack=Badnets"), "unknown attack 'Badnets'; did you mean attack=badnets?"),
    ("defense abbreviation", fixed("defense=nc"), "unknown defense 'nc'; did you mean defense=neural_cleanse?"),
    ("key spelled without its underscore", fixed("attack.poisonrate=0.1"),
     "attack.poisonrate is not a setting of attack badnets; did you mean attack.poison_rate?"),
    ("timm model name as a model", fixed("model=resnet50"),
     "unknown model 'resnet50'; resnet50 is a timm model: write model=timm model.name=resnet50, or choose one of:"),
    ("group and option without =", fixed("attack", "badnets"), "'attack' needs a value: write attack=badnets"),
    # wrong types
    ("seed not an int", fixed("seed=abc"), "seed=abc"),
    ("flag not a bool", fixed("trainer.augment=maybe"), "Value 'maybe' is not a valid bool"),
    ("poison rate not a number", fixed("attack.poison_rate=abc"), "attack.poison_rate='abc' is out of range"),
    # numbers out of range
    ("poison rate 0", fixed("attack.poison_rate=0"), "attack.poison_rate=0 is out of range; use a number in (0, 1]"),
    ("target = num classes", fixed("attack.target=10"), "attack.target=10 is out of range; use an integer in [0, 9]"),
    ("negative epochs", fixed("trainer.epochs=-1"), "trainer.epochs=-1 is invalid"),
    ("clean fraction 0", fixed("defense=fine_tuning", "defense.clean_fraction=0"), "defense.clean_fraction=0 is out of range"),
    ("lira eps above 1", fixed("attack=lira", "attack.eps=2"), "attack.eps=2 is out of range; use a number in (0.0, 1.0]"),
    ("lira test eps", fixed("attack=lira", "attack.test_eps=1.5"), "attack.test_eps=1.5 is out of range"),
    ("wb eps negative", fixed("attack=wb", "attack.eps=-0.1"), "attack.eps=-0.1 is out of range"),
    ("blind pattern outside the image", fixed("attack=blind", "attack.location=[3,26]"),
     "attack.location=[3, 26] puts the 5x3 pattern outside 28x28 images; use a row in [0, 23] and a column in [0, 25]"),
    ("pgd eps negative", fixed("eval.pgd.enabled=true", "eval.pgd.eps=-1"), "eval.pgd.eps=-1.0 is out of range"),
    ("ep bin width 0", fixed("defense=ep", "defense.step=0"), "defense.step=0 is invalid; use a number > 0"),
    ("detection only of a repair", fixed("defense=fine_tuning", "eval.detection_only=true"),
     "eval.detection_only=true needs a detecting defense; defense=fine_tuning (post-train) repairs and detects "
     f"nothing; choose one of: {DETECTORS}"),
    ("bnp without clean data", fixed("defense=bnp", "defense.clean_fraction=0"), "defense.clean_fraction=0 is out of range"),
    ("ft_sam rho 0", fixed("defense=ft_sam", "defense.rho=0"), "defense.rho=0 is invalid; use a number > 0"),
    ("ft_sam label smoothing 1", fixed("defense=ft_sam", "defense.label_smoothing=1"),
     "defense.label_smoothing=1 is out of range; use a number in [0, 1)"),
    ("npd radius 0", fixed("defense=npd", "defense.eps=0"), "defense.eps=0 is invalid; use a number > 0"),
    ("scale_up standardised without clean data", fixed("defense=scale_up", "defense.standardize=true"),
     "defense.standardize=true standardises with the clean subset's SPC; defense.clean_fraction=0 holds none"),
    ("scale_up no scales", fixed("defense=scale_up", "defense.scales=[]"), "defense.scales=[] is invalid"),
    ("ibd_psc scale 1", fixed("defense=ibd_psc", "defense.scale=1"), "defense.scale=1 is invalid; use a number > 1"),
    ("spectre alpha 0", fixed("defense=spectre", "defense.alpha=0"), "defense.alpha=0 is invalid; use a number > 0"),
    ("beatrix order 0", fixed("defense=beatrix", "defense.orders=[0,2]"), "defense.orders=[0, 2] is invalid"),
    ("beatrix without clean data", fixed("defense=beatrix", "defense.clean_fraction=0"), "defense.clean_fraction=0 is out of range"),
    ("cd steps 0", fixed("defense=cd", "defense.steps=0"), "defense.steps=0 is invalid; use an integer >= 1"),
    ("cd budget unknown", fixed("defense=cd", "defense.budget=gpu"), "defense.budget='gpu' is unknown for cd; choose one of: official, cpu"),
    ("scan threshold 0", fixed("defense=scan", "defense.threshold=0"), "defense.threshold=0 is invalid; use a finite number > 0"),
    ("scan without clean data", fixed("defense=scan", "defense.clean_fraction=0"), "defense.clean_fraction=0 is out of range"),
    ("agpd tau 1", fixed("defense=agpd", "defense.tau=1"), "defense.tau=1 is out of range; use a number in [0, 1)"),
    ("agpd window 0", fixed("defense=agpd", "defense.window=0"), "defense.window=0 is invalid"),
    ("asset outlyingness 0", fixed("defense=asset", "defense.outlyingness=0"), "defense.outlyingness=0 is invalid; use a number > 0"),
    ("asset tail eps 1", fixed("defense=asset", "defense.tail_eps=1"), "defense.tail_eps=1 is out of range"),
    ("teco frost", fixed("defense=teco", "defense.corruptions=[frost,snow]"), "frost is left out"),
    ("teco severity 6", fixed("defense=teco", "defense.severities=[1,6]"), "defense.severities=[1, 6] is invalid"),
    ("sentinet rule", fixed("defense=sentinet", "defense.rule=curve"),
     "defense.rule='curve' is invalid; use one of: confidence, boundary"),
    ("npd on a vision transformer", fixed("defense=npd", "model=timm", "model.name=vit_tiny_patch16_224"),
     "model 'timm_vit_tiny_patch16_224' has no nn.Conv2d after its stem"),
    ("sau pgd bound 0", fixed("defense=sau", "defense.eps=0"), "defense.eps=0 is invalid; use a number > 0"),
    ("sau norm as BackdoorBench spells it", fixed("defense=sau", "defense.norm=L_inf"),
     "defense.norm='L_inf' is unknown; choose one of: linf, l2, l1"),
    ("d_br ratios leaving no uncertain part", fixed("defense=d_br", "defense.clean_ratio=0.9", "defense.poison_ratio=0.2"),
     "defense.clean_ratio=0.9 and defense.poison_ratio=0.2 leave no uncertain part"),
    ("d_st transformation not offered", fixed("defense=d_st", "defense.transforms=[rotate,blur]"),
     "defense.transforms=['rotate', 'blur'] is invalid; use a non-empty list of: rotate, affine, flip, crop"),
    ("dbd epsilon 1", fixed("defense=dbd", "defense.epsilon=1"), "defense.epsilon=1 is out of range; use a number in (0, 1)"),
    ("dbd budget unknown", fixed("defense=dbd", "defense.budget=gpu"), "defense.budget='gpu' is unknown for dbd; choose one of: official, cpu"),
    ("mcr t above 1", fixed("defense=mcr", "defense.t=1.5"), "defense.t=1.5 is out of range"),
    ("mcr unknown curve", fixed("defense=mcr", "defense.curve=spline"), "defense.curve='spline' is unknown; choose one of: bezier, polychain"),
    ("nab flags nothing", fixed("defense=nab", "defense.isolation_ratio=0"), "defense.isolation_ratio=0 is out of range"),
    ("nab stamp value a word", fixed("defense=nab", "defense.stamp_value=zero"),
     "defense.stamp_value='zero' is invalid; use mean"),
    ("rnp stop rule above 1", fixed("defense=rnp", "defense.clean_threshold=1.5"), "defense.clean_threshold=1.5 is out of range"),
    ("rnp milestones decreasing", fixed("defense=rnp", "defense.unlearning_milestones=[20,10]"),
     "defense.unlearning_milestones=[20, 10] is invalid"),
    # names
    ("timm model name", fixed("model=timm", "model.name=no_such_model"), "model.name='no_such_model' is not a timm model"),
    # files
    ("pattern file missing", fixed("attack=blended", "attack.pattern=/no/such/file.png"),
     "pattern '/no/such/file.png' is neither"),
    ("pattern file not an image", text_file_as_pattern, "pattern.png' is not a readable image"),
    ("lf perturbation of another dataset", lf_resource_of_another_dataset,
     "cifar10_preactresnet18_0_255.npy' has shape (32, 32, 3); expected (28, 28, 1)"),
    ("dataset of the wrong shape", mnist_wrong_shape, "images are 27x27, expected 28x28"),
    ("dataset labels out of range", mnist_label_out_of_range, "train labels span [3, 12], expected [0, 9]"),
    # training
    ("NaN loss", fixed("trainer.epochs=1", "dataset.test_per_class=400", "trainer.optimizer.lr=1e30"),
     "victim: the training loss became nan at epoch 1; lower the learning rate"),
]


# More values of the same kinds, refused by the same preflight code as a CLI case above: checked
# in-process (a CLI call costs seconds, most of it importing torch), with the same one-line message.
# Refused by the data itself (its files) or by training: the only cases allowed past the preflight.
DATA_CASES = {"dataset of the wrong shape", "dataset labels out of range"}
TRAINING_CASES = {"NaN loss"}

PREFLIGHT_CASES: list[tuple[list[str], str]] = [
    (["nosuchkey=1"], "Could not override 'nosuchkey'"),
    (["defense=nope"], "unknown defense 'nope'; choose one of: "),
    (["dataset=nope"], "unknown dataset 'nope'; choose one of: "),
    (["model=nope"], "unknown model 'nope'; choose one of: "),
    (["trainer.epochs=ten"], "Value 'ten' of type 'str' could not be converted to Integer"),
    (["attack.poison_rate=-0.1"], "attack.poison_rate=-0.1 is out of range"),
    (["attack.poison_rate=1.5"], "attack.poison_rate=1.5 is out of range"),
    (["attack.target=-1"], "attack.target=-1 is out of range"),
    (["--multirun", "hydra/launcher=joblib", "hydra.launcher.n_jobs=two"], "hydra.launcher.n_jobs=two"),
    (["eval.pgd.steps=0"], "eval.pgd.steps=0 is invalid; use an integer >= 1"),
    (["eval.pgd.step_size=0"], "eval.pgd.step_size=0.0 is invalid"),
    (["device=gpu"], "device='gpu' is not a device; use auto, cpu, cuda or cuda:N"),
    (["dataset.test_per_class=500"], "dataset.test_per_class=500 is out of range; use an integer in [1, 499]"),
    (["dataset=cifar10", "attack=wanet", "attack.k=33"], "attack.k=33 is out of range; use an integer in [2, 32]"),
    (["dataset=tiny_imagenet", "attack.target=200"], "attack.target=200 is out of range; use an integer in [0, 199]"),
    (["attack=input_aware", "attack.depth=3"], "attack.depth=3 does not fit 28x28 images"),
    (["attack=blind", "attack.mgda_normalize=L2"], "attack.mgda_normalize='L2' is unknown; choose one of: loss+, loss, l2, none"),
    (["attack=lf", "attack.sigma=0"], "attack.sigma=0 is invalid; use a number > 0"),
    (["attack=lf", "attack.resource=/no/such/lf.npy"], "attack.resource='/no/such/lf.npy' does not exist"),
    (["attack=poison_ink", "attack.colour=[80,160]"], "attack.colour=[80, 160] is invalid; use three 0-255 levels"),
    (["attack=poison_ink", "attack.resource=/no/such/netH.pth"], "attack.resource='/no/such/netH.pth' does not exist"),
    (["attack=ssba", "attack.code_bits=4"], "attack.code_bits=4 is invalid; use an integer >= 8"),
    (["attack=ssba", "attack.resource=/no/such/ssba"], "attack.resource='/no/such/ssba' does not exist"),
    (["model=timm", "model.name=resnet18", "model.weights=/no/such/weights.pt"], "model.weights='/no/such/weights.pt' does not exist"),
    (["trainer.batch_size=0"], "trainer.batch_size=0 is invalid"),
    (["eval.detection_only=maybe"], "Value 'maybe' is not a valid bool"),
    (["eval.detection_only=true"], "eval.detection_only=true needs a detecting defense, and defense is none; "
                                   f"choose one of: {DETECTORS}"),
    (["defense=nad", "eval.detection_only=true"], "defense=nad (post-train) repairs and detects nothing"),
    # near misses (the suggestion code's own cases are in tests/test_suggest.py)
    (["defense=fp"], "unknown defense 'fp'; did you mean defense=fine_pruning? Or choose one of: abl, "),
    (["defense=Neural-Cleanse"], "did you mean defense=neural_cleanse?"),
    (["attack=iad"], "did you mean attack=input_aware?"),
    (["--multirun", "attack=badnets,Blended"], "unknown attack 'Blended'; did you mean attack=blended?"),
    (["model=vit_tiny_patch16_224"], "write model=timm model.name=vit_tiny_patch16_224, or choose one of: "),
    (["trainer/optimizer=Adam"], "did you mean trainer/optimizer=adam?"),
    (["defense=fine_tuning", "defense.epoch=2"], "defense.epoch is not a setting of defense fine_tuning; did you mean defense.epochs?"),
    (["atack.poison_rate=0.1"], "atack.poison_rate is not a setting; did you mean attack.poison_rate?"),
    (["seeds=1"], "seeds is not a setting; did you mean seed?"),
    (["badnets"], "'badnets' needs its group: write attack=badnets"),
    (["--multirun", "seed", "0,1"], "'seed' needs a value: write seed=0,1"),
    (["dataset"], "'dataset' needs a value: write dataset=<cifar10|gtsrb|mnist|mnist5k|...>"),
    (["hello"], "'hello' is not an override; write key=value, e.g. attack=badnets"),
]


@pytest.mark.parametrize("args,fragment", PREFLIGHT_CASES, ids=[" ".join(a) for a, _ in PREFLIGHT_CASES])
def test_more_hostile_values_are_refused_by_the_preflight(tmp_path, args, fragment):
    from backdoorbench.cli import preflight
    from backdoorbench.errors import ConfigError

    results = tmp_path / "results"
    with pytest.raises(ConfigError) as info:
        preflight(["trainer.epochs=0", *args, f"results_dir={results}"])
    assert fragment in str(info.value) and "\n" not in str(info.value)
    assert not results.exists()


def assert_refused(proc, fragment: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert fragment in lines[0], lines[0]
    return lines[0]


# The cases run as a real `python -m backdoorbench` process (seconds each, most of it importing torch):
# those refused past the preflight (by the data files, by training), and one of each kind the
# preflight refuses. The other cases run the same command line in this process (`__main__.main`,
# below), which is the same code from the preflight to the exit; these prove that nothing else the
# process prints (an import's warning, Hydra's own output) adds a line to stderr.
SUBPROCESS_CASES = DATA_CASES | TRAINING_CASES | {
    "unknown key", "unknown value in a sweep", "group and option without =", "seed not an int", "lira eps above 1",
    "pattern file not an image"}
assert SUBPROCESS_CASES <= {c[0] for c in CASES}


@pytest.mark.parametrize("setup,fragment", [c[1:] for c in CASES if c[0] in SUBPROCESS_CASES],
                         ids=[c[0] for c in CASES if c[0] in SUBPROCESS_CASES])
def test_hostile_input_is_one_line_exit_2_and_writes_nothing(tmp_path, setup, fragment, request):
    results = tmp_path / "results"  # does not exist yet: a refused run must not even create it
    proc = run_cli("trainer.epochs=0", "eval.stealth_images=0", *setup(tmp_path), f"results_dir={results}")
    assert_refused(proc, fragment)
    left = sorted(str(p.relative_to(results)) for p in results.rglob("*")) if results.exists() else []
    if request.node.callspec.id in TRAINING_CASES:
        # The one exception: a run that got as far as training holds the victim cache's lock, and
        # its empty lock file (cache/victims/<key>.lock) stays by design: deleting one while another
        # process waits on it would let a third lock a new file and train the same victim in parallel.
        left = [p for p in left if p not in ("cache", "cache/victims") and not (
            p.startswith("cache/victims/") and p.endswith(".lock") and (results / p).stat().st_size == 0)]
    assert left == [], left


BEFORE_DATA = [c for c in CASES if c[0] not in DATA_CASES | TRAINING_CASES]


@pytest.fixture
def no_data_no_training(monkeypatch):
    """Every dataset loader, the trainer and the attacks' preparation fail loudly when called."""
    import importlib

    from backdoorbench.attacks.base import Attack
    from backdoorbench.datasets.spec import SPECS
    from backdoorbench.train import Trainer

    def forbidden(*args, **kwargs):
        raise AssertionError("data loaded or a model trained before the input was checked")

    for target in SPECS:
        module, name = target.rsplit(".", 1)
        monkeypatch.setattr(importlib.import_module(module), name, forbidden)
    for cls, method in ((Trainer, "fit"), (Attack, "prepare"), (Attack, "poison_dataset")):
        monkeypatch.setattr(cls, method, forbidden)


@pytest.mark.parametrize("setup,fragment", [c[1:] for c in BEFORE_DATA], ids=[c[0] for c in BEFORE_DATA])
def test_refused_before_any_data_or_training(tmp_path, setup, fragment, no_data_no_training, compose_cfg, monkeypatch,
                                            capsys):
    from backdoorbench.__main__ import main
    from backdoorbench.cli import preflight
    from backdoorbench.errors import UserError
    from backdoorbench.pipeline import run

    results = tmp_path / "results"
    args = ["trainer.epochs=0", "eval.stealth_images=0", *setup(tmp_path), f"results_dir={results}"]
    # The command line, in this process: one line on stderr, exit 2, nothing written.
    monkeypatch.setattr("sys.argv", ["backdoorbench", *args])
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], err
    assert not results.exists()
    with pytest.raises(UserError) as info:  # the command line's check, before Hydra starts
        preflight(args)
    assert fragment in str(info.value)
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        cfg = compose_cfg(*[a for a in args if not a.startswith("-")])
    except (HydraException, OmegaConfBaseException):
        cfg = None  # Hydra itself refuses it: no run can start
    if cfg is not None:  # a run handed such a config (e.g. by a launcher) refuses it first thing too
        with pytest.raises(UserError) as info:
            run(cfg)
        assert fragment in str(info.value)
    assert not results.exists()


def test_results_dir_under_a_file_cannot_be_written(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file, not a folder")
    proc = run_cli("trainer.epochs=0", f"results_dir={blocker}/sub")
    line = assert_refused(proc, f"results_dir='{blocker}/sub' cannot be written")
    assert line.endswith("choose a folder you can write to")
    assert blocker.read_text() == "a file, not a folder" and sorted(tmp_path.iterdir()) == [blocker]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a 0o500 folder anyway; the file case above covers root")
def test_results_dir_without_write_permission(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        proc = run_cli("trainer.epochs=0", f"results_dir={locked}/sub")
        assert_refused(proc, f"results_dir='{locked}/sub' cannot be written")
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o700)


def test_a_failed_run_keeps_the_users_empty_results_folder(tmp_path):
    # A folder that existed before the run is the user's: only folders the run made are removed.
    proc = run_cli("trainer.epochs=0", "attack=lira", "attack.eps=2", f"results_dir={tmp_path}")
    assert_refused(proc, "attack.eps=2 is out of range")
    assert tmp_path.is_dir() and list(tmp_path.iterdir()) == []
