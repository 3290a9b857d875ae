"""The attacked-model cache: trained once, reused exactly, keyed by what determines the victim,
locked across processes, and never trusting the file it reads."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from backdoorbench.cache import VictimCache, victim_key
from backdoorbench.pipeline import run
from tests.conftest import ROOT

CHEAP = ("trainer.epochs=1", "trainer.progress=false", "eval.stealth_images=50")


def _run(compose_cfg, results_dir, *extra):
    return run(compose_cfg(*CHEAP, f"results_dir={results_dir}", *extra))


def _comparable(record):
    return {"metrics": record.metrics, "stealth": record.stealth, "attack": record.attack}


@pytest.mark.parametrize("attack", ["badnets", "wanet"])
def test_a_cached_victim_gives_the_record_of_the_run_that_trained_it(tmp_path, compose_cfg, monkeypatch, attack):
    # fine_tuning retrains from the victim with its own seeded stream and the global RNG: a hit must
    # restore everything that run would have seen, and a miss must draw exactly what cache=false draws.
    extra = (f"attack={attack}", "defense=fine_tuning", "defense.epochs=1")
    off, _ = _run(compose_cfg, tmp_path / "off", "cache=false", *extra)
    miss, _ = _run(compose_cfg, tmp_path / "on", *extra)
    prepared = []
    from backdoorbench.attacks import base

    original = base.Attack.prepare
    monkeypatch.setattr(base.Attack, "prepare", lambda self, **kw: prepared.append(1) or original(self, **kw))
    hit, path = _run(compose_cfg, tmp_path / "on", *extra)

    assert off.victim["cache"] == "off" and miss.victim["cache"] == "miss" and hit.victim["cache"] == "hit"
    assert _comparable(off) == _comparable(miss) == _comparable(hit)
    assert hit.victim["key"] == miss.victim["key"] and hit.victim["train_s"] == miss.victim["train_s"]
    # a hit names the code that trained its victim, which may be older than the code that loads it
    assert hit.victim["trained_by"] == {k: miss.env[k] for k in ("git_commit", "git_dirty")}
    assert hit.timings_s["train"] == 0.0 and "victim_cache_load" in hit.timings_s
    assert prepared == []  # the attack's prepare step (surrogates, pre-training) is not rerun on a hit
    assert json.loads(path.read_text())["victim"]["cache"] == "hit"
    assert not (tmp_path / "off" / "cache").exists()  # cache=false neither reads nor writes


def test_the_key_changes_with_what_trains_the_victim_and_nothing_else(compose_cfg, tmp_path):
    from omegaconf import OmegaConf

    def key(*overrides):
        cfg = compose_cfg(f"results_dir={tmp_path}", *overrides)
        return victim_key(OmegaConf.to_container(cfg, resolve=True), torch.device("cpu"))

    base = key()
    for same in ("defense=fine_tuning", "eval.stealth_images=7", "results_dir=/elsewhere", "trainer.progress=false",
                 "logger=none", "eval.pgd.enabled=true"):
        assert key(same) == base, same
    for other in ("seed=1", "attack=blended", "attack.poison_rate=0.2", "trainer.epochs=3", "model=vgg11",
                  "trainer/optimizer=adam"):
        assert key(other) != base, other
    cfg = OmegaConf.to_container(compose_cfg(f"results_dir={tmp_path}"), resolve=True)
    assert victim_key(cfg, torch.device("cuda")) != victim_key(cfg, torch.device("cpu"))


def test_a_learned_trigger_generator_round_trips(tmp_path, mnist5k):
    from backdoorbench.attacks.lira import LIRA
    from backdoorbench.models.base import Normalized
    from backdoorbench.models.mnist_cnn import MnistCNN
    from backdoorbench.attacks.base import PoisonedData

    trained = LIRA(target_mode="all2one", target=0, poison_rate=1.0, num_classes=10, image_shape=(1, 28, 28))
    with torch.no_grad():  # stands in for stage-I training: weights no fresh instance has
        for p in trained.trigger_net.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.1)
    model = Normalized(MnistCNN(in_channels=1, num_classes=10, image_size=28), mnist5k.mean, mnist5k.std)
    cache = VictimCache(tmp_path, "k")
    cache.save(model, trained, mnist5k.train, PoisonedData(mnist5k.train, torch.empty(0, dtype=torch.long)), 1.0, 0.5)

    fresh = LIRA(target_mode="all2one", target=0, poison_rate=1.0, num_classes=10, image_shape=(1, 28, 28))
    x = mnist5k.test.subset(torch.arange(8)).float_images()
    assert not torch.equal(fresh.apply_trigger(x), trained.apply_trigger(x))
    other = Normalized(MnistCNN(in_channels=1, num_classes=10, image_size=28), mnist5k.mean, mnist5k.std)
    hit = cache.load(other, fresh, mnist5k.train)
    assert hit is not None and hit.train_s == 1.0
    assert torch.equal(fresh.apply_trigger(x), trained.apply_trigger(x))
    assert (fresh.apply_trigger(x) - x).abs().max() <= fresh.eps + 1e-6
    for a, b in zip(model.state_dict().values(), other.state_dict().values()):
        assert torch.equal(a, b)


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['BB_MARKER']}",))


@pytest.mark.parametrize("content", ["garbage", "pickle"])
def test_a_corrupt_or_malicious_entry_is_refused_and_retrained(tmp_path, compose_cfg, caplog, monkeypatch, content):
    first, _ = _run(compose_cfg, tmp_path, "trainer.epochs=0")
    entry = tmp_path / "cache" / "victims" / f"{first.victim['key']}.pt"
    marker = tmp_path / "pwned"
    monkeypatch.setenv("BB_MARKER", str(marker))
    if content == "garbage":
        entry.write_bytes(b"PK\x03\x04 truncated")
    else:
        torch.save({"format": _Payload()}, entry)  # the zip form torch.load reads: code in its pickle
    with caplog.at_level(logging.WARNING, logger="backdoorbench.cache"):
        again, _ = _run(compose_cfg, tmp_path, "trainer.epochs=0")
    assert not marker.exists()  # the pickle's code never ran
    assert again.victim["cache"] == "miss"
    assert any("unusable" in r.message and "retraining" in r.message for r in caplog.records)
    assert again.metrics == first.metrics
    assert _run(compose_cfg, tmp_path, "trainer.epochs=0")[0].victim["cache"] == "hit"  # rewritten whole


@pytest.mark.slow
def test_two_processes_train_one_victim_once(tmp_path):
    args = [sys.executable, "-m", "backdoorbench", *CHEAP, f"results_dir={tmp_path}", "eval.stealth_images=0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen(args + [f"defense={d}"] + (["defense.epochs=1"] if d != "none" else []), cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for d in ("none", "fine_tuning")]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    records = [json.loads(p.read_text()) for p in (tmp_path / "runs").rglob("*.json")]
    assert sorted(r["victim"]["cache"] for r in records) == ["hit", "miss"]
    assert records[0]["metrics"]["attacked"] == records[1]["metrics"]["attacked"]
    assert len(list((tmp_path / "cache" / "victims").glob("*.pt"))) == 1
    assert not list((tmp_path / "cache" / "victims").glob(".*.tmp"))
