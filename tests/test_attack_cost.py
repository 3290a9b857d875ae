"""What mounting an attack costs (record.attack_cost): images through networks counted at the outermost
module call (backdoorbench/train/passes.py), forward and backward apart, per training image; a fixed
trigger costs no pass, networks trained in `prepare` count theirs, a training-controlled attack's
victim training shows its extra passes; the victim cache and the attack's own network cache give
back the cost counted when they were filled; records without the field still load and render."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backdoorbench.fileio import atomic_torch_save, torch_load
from backdoorbench.records import RecordError, load_record, validate_record
from backdoorbench.train.passes import CallCounter
from tests.conftest import ROOT
from tests.test_records import make_record
from tests.tiny import make_model, one_thread  # noqa: F401  (autouse)

QUICK = ("trainer.epochs=0", "dataset.test_per_class=50", "eval.stealth_images=0", "trainer.progress=false",
         "logger=none")
N = 4500  # mnist5k's training images with test_per_class=50
# Poison Ink's networks, as small as its tests make them: one stage of one epoch on 64 images
POISON_INK = ("attack=poison_ink", "attack.epochs=1", "attack.train_images=64", "attack.batch_size=16", "attack.width=8",
              "attack.depth=1", "attack.extractor_width=8", "attack.extractor_blocks=0", "attack.stages=[[]]")


def run(compose_cfg, tmp_path: Path, *overrides: str):
    from backdoorbench.pipeline import run as run_pipeline

    return run_pipeline(compose_cfg(*QUICK, f"results_dir={tmp_path}", *overrides))


class Wrapper(nn.Module):
    """A module that calls a whole classifier: one outermost call."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = make_model()

    def forward(self, x):
        return self.inner(x) * 2


def test_the_outermost_call_counts_a_nested_model_once_and_backward_apart():
    from backdoorbench.train.trainer import _StepModule

    model, counter = Wrapper(), CallCounter()
    x = torch.rand(5, 1, 16, 16)
    with counter.counting():
        F.cross_entropy(model(x), torch.zeros(5, dtype=torch.long)).backward()  # 5 forward, 5 backward
        with torch.no_grad():
            model(x[:3])  # forward only
        nn.CrossEntropyLoss()(torch.randn(4, 3, requires_grad=True), torch.zeros(4, dtype=torch.long))  # no network
        probe = x[:2].clone().requires_grad_(True)
        torch.autograd.grad(model.inner(probe).sum(), probe)  # a gradient to the input is a backward pass too
        step = _StepModule(model.inner, lambda net, a, b: (net(a), net(a.flip(-1))), [])
        step(x[:4], None)  # a transparent wrapper: the two classifier calls inside it count
        with counter.paused():
            model(x)
    assert (counter.forward_images, counter.backward_images) == (5 + 3 + 2 + 8, 5 + 2)
    model(x).sum().backward()  # after counting: nothing
    assert (counter.forward_images, counter.backward_images) == (18, 7)
    assert counter.seconds >= 0


def test_a_fixed_trigger_costs_no_network_pass_and_an_older_cache_entry_gives_its_seconds(compose_cfg, tmp_path):
    from backdoorbench.pipeline import summary_table

    record, path = run(compose_cfg, tmp_path, "attack=badnets")
    cost = record.attack_cost
    assert cost["training_images"] == N and cost["seconds"] >= 0
    assert cost["seconds_per_training_image"] == pytest.approx(cost["seconds"] / N)
    assert (cost["forward_images"], cost["backward_images"]) == (0, 0)
    assert cost["passes"] == {"forward": 0.0, "backward": 0.0}
    assert not cost["cached"] and cost["prepare_cost"] == "measured" and cost["victim_training"] is None
    assert "attack cost: " in summary_table(record, path) and "0.00 forward / 0.00 backward passes" in summary_table(record, path)
    assert load_record(path).attack_cost == cost
    # a victim cached before attack costs were kept: the hit reads, with the seconds the victim's poison stage took
    entry_path = Path(record.victim["path"])
    entry = torch_load(entry_path, map_location="cpu")
    del entry["attack_cost"]
    atomic_torch_save(entry, entry_path)
    again, _ = run(compose_cfg, tmp_path, "attack=badnets")
    assert again.victim["cache"] == "hit" and again.attack_cost["passes"] is None
    assert again.attack_cost["seconds"] == round(entry["poison_s"], 4)


def test_networks_trained_in_prepare_count_their_passes_and_both_caches_give_them_back(compose_cfg, tmp_path):
    record, _ = run(compose_cfg, tmp_path, *POISON_INK)
    cost, attack = record.attack_cost, record.attack
    # each training image of a batch goes once through the injection network and twice through the
    # extraction network (the injected and the clean image), forward and backward; the poisoning
    # then injects the poisoned images, forward only
    trained = 3 * attack["network_epochs"] * attack["train_images"]
    assert (attack["network_forward_images"], attack["network_backward_images"]) == (trained, trained)
    assert cost["forward_images"] == trained + attack["n_poisoned"] and cost["backward_images"] == trained
    assert cost["passes"]["forward"] == pytest.approx((trained + 450) / N) and cost["passes"]["backward"] > 0
    assert not cost["cached"] and cost["prepare_cost"] == "measured" and cost["seconds"] >= attack["networks_s"]
    # the same victim from the victim cache: the cost counted when it was made
    hit, _ = run(compose_cfg, tmp_path, *POISON_INK)
    assert hit.victim["cache"] == "hit" and hit.attack_cost == cost
    # another victim, the same networks from the attack's cache: the cost recorded when they were trained
    other, _ = run(compose_cfg, tmp_path, *POISON_INK, "attack.poison_rate=0.05")
    assert other.victim["cache"] == "miss" and other.attack["networks"] == "cache_hit"
    assert other.attack["prepare_cost"] == {"cached": True, "seconds": attack["networks_s"], "forward_images": trained,
                                            "backward_images": trained}
    assert other.attack_cost["cached"] and other.attack_cost["prepare_cost"] == "recorded"
    assert (other.attack_cost["forward_images"], other.attack_cost["backward_images"]) == (trained + 225, trained)
    assert other.attack_cost["seconds"] >= attack["networks_s"]
    # networks cached before their passes were kept: cached, the cost unknown, this run's share only
    networks = Path(attack["networks_path"])
    entry = torch_load(networks, map_location="cpu")
    entry["stats"] = {k: v for k, v in entry["stats"].items() if not k.startswith("network_")}
    atomic_torch_save(entry, networks)
    older, _ = run(compose_cfg, tmp_path, *POISON_INK, "attack.poison_rate=0.02")
    assert older.attack_cost["cached"] and older.attack_cost["prepare_cost"] == "unknown"
    assert (older.attack_cost["forward_images"], older.attack_cost["backward_images"]) == (90, 0)


def test_a_training_controlled_attack_shows_its_extra_passes_per_epoch(compose_cfg, tmp_path):
    record, path = run(compose_cfg, tmp_path, "attack=blind", "trainer.epochs=1")
    training = record.attack_cost["victim_training"]
    assert training["images"] == N and training["epochs"] == 1
    # the clean batch and its triggered copy, each forward and differentiated (MGDA): twice a clean training's
    assert training["passes_per_epoch"]["forward"] > 1 and training["passes_per_epoch"]["backward"] > 1
    assert training["passes_per_epoch"] == {"forward": 2.0, "backward": 2.0}
    assert record.attack_cost["passes"] == {"forward": 0.0, "backward": 0.0}  # the trigger is a fixed pattern
    from backdoorbench.pipeline import summary_table

    assert "victim training 2.00 forward / 2.00 backward per image per epoch" in summary_table(record, path)


def test_a_record_without_the_field_still_loads_and_renders(tmp_path):
    from backdoorbench.leaderboard import main as leaderboard
    from backdoorbench.pipeline import summary_table

    data = make_record(env={"device": "cpu"}).to_dict()
    assert data["attack_cost"] is None
    del data["attack_cost"]
    validate_record(data)
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    old = load_record(path)
    assert old.attack_cost is None and "attack cost" not in summary_table(old, path)
    with pytest.raises(RecordError, match=r"attack_cost.passes.forward must be a number >= 0 or null"):
        validate_record({**data, "attack_cost": {"seconds": 1.0, "passes": {"forward": -1.0, "backward": 0.0}}})
    # the leaderboard from committed records (none of which has the field) beside one that has it
    runs = tmp_path / "results" / "runs"
    runs.mkdir(parents=True)
    committed = sorted((ROOT / "results" / "runs" / "mnist5k" / "badnets_all2one").glob("*.json"))[:2]
    for source in committed:
        shutil.copy(source, runs / source.name)
    newer = json.loads(committed[0].read_text())
    newer.update(run_id="f" * 16, attack_cost={"training_images": 4000, "seconds": 0.5, "passes": None})
    (runs / "newer.json").write_text(json.dumps(newer))
    assert load_record(runs / "newer.json").attack_cost["seconds"] == 0.5
    assert leaderboard([f"results_dir={tmp_path / 'results'}"]) == 0
    assert (tmp_path / "results" / "leaderboard" / "leaderboard.md").is_file()
