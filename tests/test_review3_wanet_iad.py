"""WaNet and Input-aware (since e1e0375) against their official code: the generator's
summed gradient, the epoch count that includes the mask pre-training, floored per-batch counts,
and one precision for the trigger in training and at test. Tiny images and nets, CPU."""

from __future__ import annotations

import logging
import math
from functools import partial

import pytest
import torch

from backdoorbench.attacks.input_aware import InputAware
from backdoorbench.attacks.wanet import WaNet
from backdoorbench.errors import ConfigError
from backdoorbench.train import Trainer
from tests.test_attacks_wanet_iad import Recorder, batch, calibrate, make_split, params, same
from tests.tiny import COMMON, Killed, kill_after_epoch, make_model, one_thread  # noqa: F401  (one_thread: autouse fixture)

SMALL = dict(channels=4, depth=2)


def iad(**overrides) -> InputAware:
    return InputAware(**{**COMMON, **SMALL, **overrides})


def trainer(epochs: int, **overrides) -> Trainer:
    return Trainer(**{"epochs": epochs, "batch_size": 16, "optimizer": partial(torch.optim.SGD, lr=0.05, momentum=0.9),
                      "device": "cpu", "progress": False, **overrides})


def generator_grads(attack: InputAware) -> list[torch.Tensor]:
    return [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
            for p in attack.pattern_generator.parameters()]


# ------------------------------------------------------------------ the generator's summed gradient


@pytest.mark.parametrize("summed", [True, False])
def test_iad_generator_steps_on_the_sum_of_every_batch_gradient_so_far(summed):
    # Official train.py: optimizerC.zero_grad() at the top of each batch, optimizerG.step() after the
    # backward, and no optimizerG.zero_grad() anywhere: step t of Adam sees g_1 + ... + g_t (the
    # default); sum_generator_grads=false: g_t alone.
    attack = iad(poison_rate=0.25, cross_rate=0.25, **({} if summed else {"sum_generator_grads": False}))
    attack.mask_generator.eval().requires_grad_(False)
    model = make_model()
    stepped = []
    real_step = None

    def record_step(*args, **kwargs):
        stepped.append(generator_grads(attack))
        return real_step(*args, **kwargs)

    batches = [batch(16, seed) for seed in (1, 2, 3)]
    total = None
    for i, (x, y) in enumerate(batches):
        loss, _, _ = attack.training_step(model, x, y)  # steps the generator on the previous batches first
        if i == 0:
            real_step = attack._optimizer.step
            attack._optimizer.step = record_step
        params_g = list(attack.pattern_generator.parameters())
        alone = torch.autograd.grad(loss, params_g, retain_graph=True)  # this batch's own gradient
        total = list(alone) if total is None or not summed else [t + a for t, a in zip(total, alone)]
        loss.backward()
        for have, want in zip(generator_grads(attack), total):
            assert torch.allclose(have, want, rtol=1e-5, atol=1e-7)
    attack._update_generator()
    assert len(stepped) == 3
    for have, want in zip(stepped[-1], total):  # the last step: the sum of all three batches (or the last)
        assert torch.allclose(have, want, rtol=1e-5, atol=1e-7)
    assert all(torch.allclose(a, b) for a, b in zip(stepped[-1], alone)) is not summed


def test_iad_a_new_victim_starts_from_a_zero_gradient_and_leaves_none():
    # A second training (a defense's retraining) repeats the attack as a new run: the first run's
    # summed gradient does not carry over, and none is left behind.
    attack = iad(mask_epochs=1)
    attack.prepare(trainer=trainer(1), train=make_split(32), generator=torch.Generator().manual_seed(0))
    trained = []
    for _ in range(2):
        attack.train_victim(trainer(2), make_model(), make_split(32), torch.Generator().manual_seed(1))
        assert all(p.grad is None for p in attack.pattern_generator.parameters())
        trained.append(params(attack.pattern_generator))
    assert same(*trained)


def test_iad_resumes_exactly_with_the_summed_gradient(tmp_path):
    split = make_split(32)

    def train(checkpoint=None, on_epoch=None):
        attack = iad(mask_epochs=1)
        attack.prepare(trainer=trainer(1), train=split, generator=torch.Generator().manual_seed(0))
        run = trainer(4)  # 1 mask + 3 victim epochs
        run.on_epoch = on_epoch
        model = make_model()
        attack.train_victim(run, model, split, torch.Generator().manual_seed(4), checkpoint=checkpoint)
        return params(model), params(attack.pattern_generator)

    whole = train()
    path = tmp_path / "victim.pt"
    with pytest.raises(Killed):
        train(path, kill_after_epoch(1))
    resumed = train(path)
    assert same(whole[0], resumed[0]) and same(whole[1], resumed[1])


# ------------------------------------------------------------- the epoch count includes the mask


def victim_run(attack: InputAware, run: Trainer) -> tuple[list[dict], list[float]]:
    """The victim's epoch rows and the generator's lr at each of its steps."""
    rows, lrs = [], []
    run.on_epoch = rows.append
    real = InputAware._update_generator

    def spy(self):
        pending = self._pending_update
        real(self)
        if pending:
            lrs.append(self._optimizer.param_groups[0]["lr"])

    attack.load_prepare_state(iad().prepare_state())  # an untrained mask will do
    InputAware._update_generator = spy
    try:
        attack.train_victim(run, make_model(), make_split(32), torch.Generator().manual_seed(0))
    finally:
        InputAware._update_generator = real
    return [r for r in rows if r["stage"] == "victim"], lrs


def test_iad_trains_the_official_joint_epochs_on_the_whole_runs_schedules():
    # Official train.py: epoch runs 1..25 in the mask loop, then the joint loop stops once epoch >
    # n_iters: n_iters - 25 joint epochs. Its MultiStepLRs step once per joint epoch, the
    # generator's milestones [200, 300, 400, 500] of n_iters 600 (our fractions of trainer.epochs).
    attack = iad(mask_epochs=2, generator_milestones=[0.5], generator_lr=0.01)
    rows, lrs = victim_run(attack, trainer(6, schedule="multistep", milestones=(0.5,)))
    assert [r["epoch"] for r in rows] == [1, 2, 3, 4]  # 6 - 2, not 6
    assert [r["lr"] for r in rows] == pytest.approx([0.05, 0.05, 0.05, 0.005])  # epoch e of a 6-epoch run
    steps = 2  # 32 images, batch 16
    assert lrs == pytest.approx([0.01] * 3 * steps + [0.001] * steps)  # decays at joint epoch 3 = 0.5 of 6


def test_iad_keeps_a_cosine_period_and_can_count_victim_epochs_alone():
    run = trainer(6, schedule="cosine", schedule_period=10)
    rows, _ = victim_run(iad(mask_epochs=2), run)
    cosine = [0.05 * (1 + math.cos(math.pi * e / 10)) / 2 for e in range(4)]
    assert [r["lr"] for r in rows] == pytest.approx(cosine)  # BackdoorBench's T_max over the joint epochs
    rows, lrs = victim_run(iad(mask_epochs=2, epochs_include_mask=False, generator_milestones=[0.5]), trainer(6))
    assert len(rows) == 6 and lrs == pytest.approx([0.01] * 6 + [0.001] * 6)


def test_iad_a_run_no_longer_than_the_mask_still_trains_one_victim_epoch(caplog):
    caplog.set_level(logging.WARNING)
    rows, _ = victim_run(iad(mask_epochs=3), trainer(2))
    assert len(rows) == 1  # the official joint loop runs once before it checks epoch > n_iters
    assert "trainer.epochs=2 counts the 3 mask pre-training epochs" in caplog.text
    assert "attack.epochs_include_mask=false" in caplog.text


@pytest.mark.parametrize("key", ["epochs_include_mask", "sum_generator_grads"])
def test_iad_refuses_a_non_boolean_switch(key):
    with pytest.raises(ConfigError, match=f"attack.{key}='yes' is invalid; use true"):
        iad(**{key: "yes"})


def test_the_config_follows_the_official_count_and_gradient(compose_cfg):
    for dataset in ("cifar10", "mnist"):
        attack = compose_cfg("attack=input_aware", f"dataset={dataset}").attack
        assert attack.epochs_include_mask is True and attack.sum_generator_grads is True


# --------------------------------------------------------------------------- floored batch counts


@pytest.mark.parametrize("size, attack_rows, cross_rows", [(128, 12, 12), (19, 1, 1), (9, 0, 0)])
def test_iad_floors_the_batch_counts_as_the_official_code(size, attack_rows, cross_rows):
    # train.py: num_bd = int(p_attack * bs), num_cross = int(p_cross * bs); round() gave 13 of 128
    plan = iad().plan_batch(size)
    assert (len(plan.attack), len(plan.cross)) == (attack_rows, cross_rows)


@pytest.mark.parametrize("size, warped, noisy", [(128, 12, 24), (19, 1, 2), (50, 5, 10)])
def test_wanet_floors_the_batch_counts_as_the_official_code(size, warped, noisy):
    # train.py:70-71: num_bd = int(bs * pc), num_cross = int(num_bd * cross_ratio); round() gave 13 and 26 of 128
    plan = WaNet(**COMMON).plan_batch(size)
    assert (len(plan.poisoned), len(plan.noisy)) == (warped, noisy)


# ------------------------------------------------------- one precision for the trigger, train and test


def test_iad_stamps_the_same_trigger_in_a_bf16_training_step_as_at_test():
    # The training step runs inside the run's autocast, Trainer.predict applies the trigger outside it:
    # both generators compute in fp32 either way.
    attack = iad(poison_rate=0.25, cross_rate=0.25)
    x, y = batch(16)
    calibrate(attack, x)  # eval mode: per-image batch norm, so the rows compare alone
    plan = attack.plan_batch(len(y))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        images, _, _ = attack.poison_batch(x, y, plan)
    test_time = attack.apply_trigger(x[plan.attack])
    assert torch.allclose(images[plan.attack], test_time, atol=1e-6)
    assert torch.allclose(images[plan.cross], attack.apply_cross(x[plan.cross], x[plan.sources]), atol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # and apply_trigger itself ignores an enclosing autocast
        assert torch.allclose(attack.apply_trigger(x[plan.attack]), test_time, atol=1e-6)


def test_iad_trigger_reaching_the_model_is_the_same_in_training_and_predict_under_bf16():
    attack = iad(poison_rate=0.5, cross_rate=0.0)
    split = make_split(16, seed=1)
    x, y = split.float_images(), split.labels
    calibrate(attack, x)
    run = trainer(1, precision="bf16")
    plan = attack.plan_batch(len(y))
    with run.autocast():  # as Trainer.fit runs the training step
        images, _, _ = attack.poison_batch(x, y, plan)
    recorder = Recorder()
    run.predict(recorder, split.images[plan.attack], transform=attack.apply_trigger)
    assert torch.allclose(recorder.seen, images[plan.attack], atol=1e-6)
    assert not torch.allclose(recorder.seen, x[plan.attack], atol=1e-3)  # a trigger was stamped
