"""LIRA and WB (since e1e0375): stage II's classifier starts from scratch (the authors' latest
command) or from stage I's (`stage2_init`), also across a resume; docs/fidelity.md#lira."""

from __future__ import annotations

import pytest
import torch

from backdoorbench.errors import ConfigError
from tests.test_attacks_lira_wb import make_attack, make_split, make_trainer, same, state
from tests.tiny import Killed, make_model, one_thread  # noqa: F401  (one_thread: autouse fixture)


def first_stage2_weights(kind: str, init: str) -> tuple[dict, dict, dict]:
    """(the model's initial weights, its weights at the end of stage I, those stage II's first step sees)."""
    attack, model, split, trainer = make_attack(kind, stage2_init=init), make_model(), make_split(), make_trainer()
    initial, seen = state(model), {}

    def spy(step):
        def wrapped(net, x, y):
            if step.__name__ == "stage2_step" and "stage2" not in seen:
                seen["stage2"] = state(net)
            return step(net, x, y)
        return wrapped

    def on_epoch(row):
        if row["stage"].endswith("stage I"):
            seen["stage1"] = state(model)  # the last one: stage I's classifier
    trainer.on_epoch = on_epoch
    attack.train_victim(trainer, model, split, torch.Generator().manual_seed(0), wrap_step=spy)
    return initial, seen["stage1"], seen["stage2"]


@pytest.mark.parametrize("kind", ["lira", "wb"])
def test_stage_two_trains_a_scratch_classifier_by_default(kind):
    # khoadoan106/backdoor_attacks@bc6e262 python/lira_backdoor_injection.py: get_model builds a new
    # classifier, and the README's commands do not pass --test_use_train_best, so none is loaded into it.
    assert make_attack(kind).stage2_init == "scratch"
    initial, stage1, stage2 = first_stage2_weights(kind, "scratch")
    assert not same(initial, stage1)  # stage I did train the classifier ...
    assert same(initial, stage2)  # ... and stage II starts from the weights stage I started from


def test_stage1_init_fine_tunes_stage_ones_classifier():
    # --test_use_train_best (the PaddlePaddle README's commands) and BackdoorBench's main2 load it.
    initial, stage1, stage2 = first_stage2_weights("lira", "stage1")
    assert same(stage1, stage2) and not same(initial, stage2)


def test_a_run_killed_in_stage_two_resumes_from_scratch_as_it_ran(tmp_path):
    def train(checkpoint, kill: bool):
        attack, model, trainer = make_attack("lira"), make_model(), make_trainer(epochs=2)

        def on_epoch(row):
            if kill and row["stage"] == "lira stage II":
                raise Killed  # after stage II's first epoch and its checkpoint
        trainer.on_epoch = on_epoch
        attack.train_victim(trainer, model, make_split(), torch.Generator().manual_seed(0), checkpoint=checkpoint)
        return state(model), state(attack.trigger_net)

    straight = train(tmp_path / "straight" / "victim.pt", kill=False)
    killed = tmp_path / "killed" / "victim.pt"
    with pytest.raises(Killed):
        train(killed, kill=True)
    assert killed.exists() and killed.with_suffix(".stage1.pt").exists()
    resumed = train(killed, kill=False)
    assert same(straight[0], resumed[0]) and same(straight[1], resumed[1])


def test_an_unknown_stage2_init_is_one_line():
    with pytest.raises(ConfigError, match=r"^attack.stage2_init='best' is unknown; choose scratch") as info:
        make_attack("lira", stage2_init="best")
    assert "\n" not in str(info.value)
