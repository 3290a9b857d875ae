"""Files we load may come from someone else (a shared checkpoint folder, a downloaded weights file,
a data root on a cluster). A pickle in any of them that would run code is refused without running
it: every torch.load is weights_only=True, and a test proves it for each place we load from."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import backdoorbench
from backdoorbench.errors import DataError
from backdoorbench.train import CHECKPOINT_FORMAT, Trainer
from tests import dataset_files as files
from tests.conftest import run_cli


class RunsCode:
    """Unpickling this with full pickle creates the marker file (any code could run instead)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def write_malicious(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(payload, path)


def assert_really_malicious(path: Path, marker: Path) -> None:
    """The test's own control: full pickle does run the payload, so the refusal is what saved us."""
    assert not marker.exists()
    torch.load(path, weights_only=False)
    assert marker.exists()
    marker.unlink()


class Captured(Exception):
    pass


def test_a_malicious_trainer_checkpoint_is_refused_by_the_cli(tmp_path, compose_cfg, monkeypatch):
    from backdoorbench.pipeline import run

    overrides = ["trainer.epochs=2", "dataset.test_per_class=400", "eval.stealth_images=0", f"results_dir={tmp_path}"]
    # Where does this run keep its victim checkpoint? Ask the pipeline rather than rebuild its key.
    seen = []

    def capture(self, model, split, **kwargs):
        seen.append(kwargs.get("checkpoint"))
        raise Captured

    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "fit", capture)
        with pytest.raises(Captured):
            run(compose_cfg(*overrides))
    [checkpoint] = seen
    checkpoint = Path(checkpoint)

    marker = tmp_path / "pwned"
    write_malicious(checkpoint, {"format": CHECKPOINT_FORMAT, "meta": RunsCode(marker), "epoch": 1})
    proc = run_cli(*overrides)
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert lines[-1] == (f"error: checkpoint {str(checkpoint)!r} cannot be read (UnpicklingError); "
                         "delete it to train from scratch"), proc.stderr
    assert "Traceback" not in proc.stderr
    assert not marker.exists()
    assert not (tmp_path / "runs").exists()
    assert_really_malicious(checkpoint, marker)


def tiny_split():
    from backdoorbench.datasets.base import Split

    return Split(torch.zeros(4, 3, 2, 2, dtype=torch.uint8), torch.tensor([0, 1, 0, 1]))


def _fit_from(path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 2))
    Trainer(epochs=1, device="cpu", progress=False).fit(model, tiny_split(), generator=torch.Generator(), checkpoint=path)


def _read_model_weights(path: Path) -> None:
    from backdoorbench.models.timm_model import read_state_dict

    read_state_dict(path)


def _load_lpips(path: Path) -> None:
    from backdoorbench.metrics.stealth import load_lpips

    load_lpips(path)


# (file name, the payload's key holding the code, fixed keys, the loader, the error it must give)
WEIGHT_LOADERS = {
    "trainer checkpoint": ("victim.pt", "model", {"format": CHECKPOINT_FORMAT}, _fit_from,
                           r"cannot be read \(UnpicklingError\)"),
    "model weights": ("weights.pt", "conv.weight", {}, _read_model_weights,
                      r"model.weights=.* cannot be read as weights \(UnpicklingError"),
    "LPIPS weights": ("alexnet-owt-7be5be79.pth", "features.0.weight", {}, _load_lpips,
                      r"cannot be read as torchvision AlexNet weights \(UnpicklingError\)"),
}


@pytest.mark.parametrize("what", list(WEIGHT_LOADERS))
def test_a_malicious_weights_file_is_refused_in_one_line(tmp_path, what):
    name, key, fixed, load, error = WEIGHT_LOADERS[what]
    marker, path = tmp_path / "pwned", tmp_path / name
    write_malicious(path, {**fixed, key: RunsCode(marker)})
    with pytest.raises(DataError, match=error) as info:
        load(path)
    assert "\n" not in str(info.value) and not marker.exists()
    assert_really_malicious(path, marker)


def test_a_malicious_dataset_cache_is_not_run_but_rebuilt(tmp_path):
    from backdoorbench.datasets.mnist import load_mnist

    written = files.write_mnist(tmp_path, gz=False)
    load_mnist(root=str(tmp_path))
    [cache] = (tmp_path / ".cache").glob("*.pt")
    marker = tmp_path / "pwned"
    write_malicious(cache, {"train_images": RunsCode(marker)})
    data = load_mnist(root=str(tmp_path))  # the unreadable cache is decoded again from the source files
    assert not marker.exists()
    assert torch.equal(data.train.images[:, 0], torch.from_numpy(written["train"][0]))
    assert torch.load(cache, weights_only=True)["train_images"].shape == data.train.images.shape  # rewritten
    write_malicious(cache, {"train_images": RunsCode(marker)})
    assert_really_malicious(cache, marker)


def test_a_malicious_victim_cache_entry_is_not_run_but_retrained(tmp_path, compose_cfg, caplog):
    from backdoorbench.cache import ENTRY_FORMAT
    from backdoorbench.pipeline import run

    overrides = ["trainer.epochs=1", "dataset.test_per_class=450", "eval.stealth_images=0", "logger=none",
                 "trainer.progress=false", f"results_dir={tmp_path}"]
    first, _ = run(compose_cfg(*overrides))
    assert first.victim["cache"] == "miss"
    [entry] = (tmp_path / "cache").rglob("*.pt")  # where the cache keeps it is the cache's business
    marker = tmp_path / "pwned"
    write_malicious(entry, {"format": ENTRY_FORMAT, "model": RunsCode(marker)})
    with caplog.at_level("WARNING", logger="backdoorbench.cache"):
        second, _ = run(compose_cfg(*overrides))
    assert not marker.exists()
    assert any("UnpicklingError" in r.getMessage() and str(entry) in r.getMessage() for r in caplog.records)
    assert second.victim["cache"] == "miss" and second.metrics == first.metrics  # retrained, same victim
    write_malicious(entry, {"format": ENTRY_FORMAT, "model": RunsCode(marker)})  # the run replaced it
    assert_really_malicious(entry, marker)


def _calls(tree: ast.AST, dotted: str):
    owner, name = dotted.rsplit(".", 1)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == name:
            base = node.func.value
            if isinstance(base, ast.Name) and base.id == owner or isinstance(base, ast.Attribute) and base.attr == owner:
                yield node


def test_every_load_in_the_package_refuses_code():
    """A guard for code added later (e.g. a new cache): every torch.load passes weights_only=True,
    and nothing calls plain pickle.load(s) or numpy.load with allow_pickle other than False."""
    package = Path(backdoorbench.__file__).parent
    loads, offenders = 0, []
    for source in sorted(package.rglob("*.py")):
        tree = ast.parse(source.read_text(), filename=str(source))
        for call in _calls(tree, "torch.load"):
            loads += 1
            flags = {k.arg: k.value for k in call.keywords}
            if not (isinstance(flags.get("weights_only"), ast.Constant) and flags["weights_only"].value is True):
                offenders.append(f"{source.relative_to(package)}:{call.lineno} torch.load without weights_only=True")
        # fileio.torch_load: torch.load(weights_only=True) with termination signals held; it takes
        # no weights_only of its caller (a second one is a TypeError).
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "torch_load":
                loads += 1
                if any(k.arg == "weights_only" for k in node.keywords):
                    offenders.append(f"{source.relative_to(package)}:{node.lineno} torch_load(weights_only=...)")
        for dotted in ("pickle.load", "pickle.loads", "torch.jit.load"):
            offenders += [f"{source.relative_to(package)}:{c.lineno} {dotted}" for c in _calls(tree, dotted)]
        for dotted in ("np.load", "numpy.load"):
            for call in _calls(tree, dotted):
                flag = next((k.value for k in call.keywords if k.arg == "allow_pickle"), None)
                if flag is not None and not (isinstance(flag, ast.Constant) and flag.value is False):
                    offenders.append(f"{source.relative_to(package)}:{call.lineno} {dotted}(allow_pickle=...)")
    assert offenders == []
    assert loads >= 5  # trainer checkpoint, victim cache, dataset cache, timm and LPIPS weights: all seen
