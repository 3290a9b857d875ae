"""Blind (Bagdasaryan & Shmatikov, USENIX Security 2021): the loss, not the data, is poisoned. The
MGDA scales against the two-gradient min-norm closed form, the step's gradient against the
official blind loss, the stored split untouched, the backdoor learned, resume after a kill."""

from __future__ import annotations

import hashlib
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backdoorbench.attacks.blind import PATTERN, Blind, mgda_scales, min_norm_two
from backdoorbench.datasets.base import Split
from backdoorbench.errors import ConfigError
from backdoorbench.train import Trainer
from tests.test_attacks_wanet_iad import params, same
from tests.tiny import COMMON, Killed, kill_after_epoch, make_model, one_thread  # noqa: F401  (one_thread: autouse)

SMALL = dict(location=[3, 10])  # the official (3, 23) is outside 16-px images


def blind(**overrides) -> Blind:
    return Blind(**{**COMMON, **SMALL, "loss_threshold": None, **overrides})


def official_gamma(v11: float, v12: float, v22: float) -> float:
    """The official _min_norm_element_from2, in float64."""
    if v12 >= v11:
        return 0.999
    if v12 >= v22:
        return 0.001
    return -1.0 * ((v12 - v22) / (v11 + v22 - 2 * v12))


def hand_scales(g1: np.ndarray, g2: np.ndarray, l1: float, l2: float, kind: str) -> float:
    """The official get_scales for two tasks written out in numpy: normalise, then the closed form."""
    def normaliser(g, loss):
        return {"l2": np.linalg.norm(g), "loss": min(loss, 10.0), "loss+": min(loss * np.linalg.norm(g), 10.0),
                "none": 1.0}[kind]
    a, b = g1 / (normaliser(g1, l1) + 1e-5), g2 / (normaliser(g2, l2) + 1e-5)
    return official_gamma(a @ a, a @ b, b @ b)


# ------------------------------------------------------------------------- the MGDA weights


def test_the_two_task_min_norm_weight_is_the_closed_form_minimiser():
    rng = np.random.default_rng(0)
    grid = np.linspace(0, 1, 100001)
    inside = 0
    for _ in range(50):
        a, b = rng.normal(size=7), rng.normal(size=7) + rng.normal() * rng.normal(size=7)
        gamma = float(min_norm_two(*(torch.tensor(v, dtype=torch.float64) for v in (a @ a, a @ b, b @ b))))
        assert gamma == pytest.approx(official_gamma(a @ a, a @ b, b @ b), abs=1e-12)
        if 0.001 < gamma < 0.999:  # inside the segment: the minimiser of |g a + (1 - g) b|^2
            inside += 1
            norms = ((grid[:, None] * a + (1 - grid[:, None]) * b) ** 2).sum(1)
            assert gamma == pytest.approx(grid[norms.argmin()], abs=2e-5)
            combo = gamma * a + (1 - gamma) * b
            assert combo @ (a - b) == pytest.approx(0, abs=1e-9)  # orthogonal to the segment
    assert inside > 10
    a = np.array([1.0, 2.0, 0.5])
    t = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    # one gradient a multiple of the other: the official code's clamps, not 1 and 0
    assert float(min_norm_two(t(a @ a), t(a @ (2 * a)), t(4 * a @ a))) == 0.999
    assert float(min_norm_two(t(4 * a @ a), t((2 * a) @ a), t(a @ a))) == 0.001


@pytest.mark.parametrize("kind", ["loss+", "loss", "l2", "none"])
def test_mgda_scales_normalise_each_gradient_as_the_official_get_scales(kind):
    rng = np.random.default_rng(1)
    for _ in range(20):
        g1, g2 = rng.normal(size=12), rng.normal(size=12) * rng.uniform(0.1, 5)
        l1, l2 = rng.uniform(0.05, 15), rng.uniform(0.05, 15)
        split = [slice(0, 5), slice(5, 12)]  # two "parameters"
        s1, s2 = mgda_scales([torch.tensor(g1[s]) for s in split], [torch.tensor(g2[s]) for s in split],
                             torch.tensor(l1), torch.tensor(l2), kind)
        assert float(s1) == pytest.approx(hand_scales(g1, g2, l1, l2, kind), abs=1e-6)
        assert float(s1 + s2) == pytest.approx(1.0)


class Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(256, 4)

    def forward(self, x):
        return self.fc(x.flatten(1))


def images(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, *COMMON["image_shape"], generator=g), torch.randint(0, 4, (n,), generator=g)


@pytest.mark.parametrize("mode", ["all2one", "all2all"])
def test_the_step_gradient_is_the_mgda_weighted_sum_of_the_two_task_gradients(mode):
    attack = blind(target_mode=mode)
    model = Linear()
    x, y = images(20)
    xb, yb = attack.backdoor_batch(x, y)
    assert torch.equal(yb, attack.target_rule(y)) and torch.equal(xb, attack.apply_trigger(x))  # the whole copy
    loss_b = F.cross_entropy(model(xb), yb)
    loss_n = F.cross_entropy(model(x), y)
    grads_b = torch.autograd.grad(loss_b, list(model.parameters()))
    grads_n = torch.autograd.grad(loss_n, list(model.parameters()))
    flat = lambda gs: torch.cat([g.flatten() for g in gs]).double().numpy()  # noqa: E731
    gamma = hand_scales(flat(grads_b), flat(grads_n), float(loss_b.detach()), float(loss_n.detach()), "loss+")
    assert 0.001 < gamma < 0.999  # the closed form's inside, not a clamp

    loss, logits, scored = attack.training_step(model, x, y)
    assert float(loss.detach()) == pytest.approx(gamma * float(loss_b.detach()) + (1 - gamma) * float(loss_n.detach()), rel=1e-5)
    assert torch.equal(scored, torch.cat([y, yb])) and logits.shape == (40, 4)
    model.zero_grad()
    loss.backward()
    for p, gb, gn in zip(model.parameters(), grads_b, grads_n):
        assert torch.allclose(p.grad, gamma * gb + (1 - gamma) * gn, atol=1e-6)
    assert float(attack._backdoor_scale_sum) == pytest.approx(gamma, abs=1e-6)


def test_fixed_balance_is_backdoorbench_s_weights():
    attack = blind(loss_balance="fixed")
    model = Linear()
    x, y = images(20)
    xb, yb = attack.backdoor_batch(x, y)
    loss, _, _ = attack.training_step(model, x, y)
    expected = 0.9 * F.cross_entropy(model(xb), yb) + 1.0 * F.cross_entropy(model(x), y)
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-6)


def test_a_share_of_the_copy_carries_the_trigger_the_rest_is_the_clean_batch():
    attack = blind(poison_rate=0.25)
    x, y = images(20)
    xb, yb = attack.backdoor_batch(x, y)  # round(0.25 * 20) = 5, the first rows as the official
    assert torch.equal(xb[:5], attack.apply_trigger(x[:5])) and torch.equal(yb[:5], torch.zeros(5, dtype=torch.long))
    assert torch.equal(xb[5:], x[5:]) and torch.equal(yb[5:], y[5:])


def test_the_trigger_is_the_official_pattern_at_its_place():
    attack = Blind(**{**COMMON, "image_shape": (3, 32, 32)})
    x = torch.full((2, 3, 32, 32), 0.5)
    out = attack.apply_trigger(x)
    for r, row in enumerate(PATTERN):
        for c, value in enumerate(row):
            assert torch.all(out[:, :, 3 + r, 23 + c] == (0.5 if value is None else value))
    outside = ~attack.patch_mask()
    assert torch.equal(out[..., outside], x[..., outside]) and int(attack.patch_mask().sum()) == 9


def test_the_threshold_keeps_the_backdoor_out_until_the_clean_loss_settles():
    attack = blind(loss_threshold=1.0, batch_history_len=3)
    model = Linear()
    x, y = images(8)
    attack.loss_history = [0.5, 0.5]  # not full yet
    assert len(attack.training_step(model, x, y)[2]) == 8  # the clean batch alone
    attack.loss_history = [2.0, 2.0, 2.0]  # full, mean above the threshold
    assert len(attack.training_step(model, x, y)[2]) == 8
    attack.loss_history = [0.1, 0.2, 0.3]
    assert len(attack.training_step(model, x, y)[2]) == 16  # clean batch and backdoor copy
    assert len(attack.loss_history) == 3  # the last batch_history_len clean losses


@pytest.mark.parametrize("overrides, message", [
    ({"location": [3, 14]}, "attack.location=[3, 14] puts the 5x3 pattern outside 16x16 images"),
    ({"loss_balance": "mgda"}, "attack.loss_balance='mgda' is unknown; choose one of: MGDA, fixed"),
    ({"mgda_normalize": "loss++"}, "attack.mgda_normalize='loss++' is unknown"),
    ({"loss_threshold": 0}, "attack.loss_threshold=0 is invalid"),
    ({"poison_rate": 1.1}, "attack.poison_rate=1.1 is out of range"),
])
def test_bad_values_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as info:
        blind(**overrides)
    assert message in str(info.value) and "\n" not in str(info.value)


# ------------------------------------------------------------------------- training


def class_split(n: int, seed: int) -> Split:
    """16-px images whose class is the brightest quadrant: learnable, so clean accuracy means something."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % 4
    images = 0.3 * torch.rand(n, 1, 16, 16, generator=g)
    for i, c in enumerate(labels.tolist()):
        r, q = divmod(c, 2)
        images[i, 0, r * 8 : r * 8 + 8, q * 8 : q * 8 + 8] += 0.5
    return Split((images.clamp(0, 1) * 255).round().to(torch.uint8), labels)


def trainer(epochs: int) -> Trainer:
    return Trainer(epochs=epochs, batch_size=16, optimizer=partial(torch.optim.SGD, lr=0.05, momentum=0.9),
                   device="cpu", progress=False, augment=False)


def test_a_small_model_trained_with_the_blind_loss_learns_the_trigger_and_the_task():
    train, test = class_split(96, 0), class_split(64, 1)
    x = test.float_images()
    others = test.labels != 0
    results = {}
    for name in ("blind", "clean"):
        model = make_model()
        attack = blind()
        if name == "blind":
            attack.train_victim(trainer(6), model, train, torch.Generator().manual_seed(0))
        else:
            trainer(6).fit(model, train, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            model.eval()
            clean = float((model(x).argmax(1) == test.labels).float().mean())
            asr = float((model(attack.apply_trigger(x[others])).argmax(1) == 0).float().mean())
        results[name] = (clean, asr, dict(attack.stats))
    (clean, asr, stats), (clean_ref, asr_ref, _) = results["blind"], results["clean"]
    assert asr > 0.9 and asr_ref < 0.5, results
    assert clean > 0.9 and clean_ref > 0.9, results
    assert stats["backdoor_batches"] == 1.0 and 0 < stats["mean_backdoor_scale"] < 1


def test_blind_training_resumes_exactly_after_a_kill(tmp_path):
    train = class_split(64, 0)

    def run(path=None, on_epoch=None):
        attack = blind(loss_threshold=1.5, batch_history_len=4)
        model = make_model()
        run_trainer = trainer(3)
        run_trainer.on_epoch = on_epoch
        attack.train_victim(run_trainer, model, train, torch.Generator().manual_seed(0), checkpoint=path)
        return params(model), attack

    whole, whole_attack = run()
    path = tmp_path / "victim.pt"
    with pytest.raises(Killed):
        run(path, kill_after_epoch(1))
    resumed, resumed_attack = run(path)
    assert same(whole, resumed)
    assert resumed_attack.loss_history == whole_attack.loss_history and whole_attack.loss_history
    assert resumed_attack.stats == whole_attack.stats


# ------------------------------------------------------------------------- the pipeline


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def test_the_pipeline_stores_and_trains_on_the_clean_split_byte_for_byte(tmp_path, compose_cfg, monkeypatch):
    from backdoorbench.fileio import torch_load
    from backdoorbench.pipeline import run

    seen = []
    real_fit = Trainer.fit

    def fit(self, model, split, **kwargs):
        if kwargs.get("desc") == "victim":
            seen.append((sha(split.images), sha(split.labels)))
        return real_fit(self, model, split, **kwargs)

    monkeypatch.setattr(Trainer, "fit", fit)
    cfg = compose_cfg("attack=blind", "trainer.epochs=0", "dataset.test_per_class=50", "eval.stealth_images=0",
                      "trainer.progress=false", "logger=none", f"results_dir={tmp_path}")
    record, _ = run(cfg)
    from backdoorbench.factory import build

    data = build(cfg.dataset)
    assert seen == [(sha(data.train.images), sha(data.train.labels))]
    assert record.attack["n_poisoned"] == 0 and record.attack["loss_balance"] == "MGDA"
    assert record.attack["mgda_normalize"] == "loss" and record.attack["loss_threshold"] is None  # quick on mnist5k
    entry = torch_load(tmp_path / "cache" / "victims" / f"{record.victim['key']}.pt", map_location="cpu")
    assert len(entry["poisoned"]["rows"]) == 0 and len(entry["poisoned"]["indices"]) == 0
    assert "bd_train" not in entry and not Blind.exports_poisoned_set
