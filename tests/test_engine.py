"""The trainer: augmentation, batching, schedules, determinism, checkpoint/resume, compile wiring."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from hydra.errors import HydraException
from hydra.utils import instantiate
from omegaconf.errors import OmegaConfBaseException
from torch import nn

import backdoorbench.config  # noqa: F401  (registers the schemas)
from backdoorbench.datasets.base import Split
from backdoorbench.errors import ConfigError, DataError
from backdoorbench.train import Trainer, augment_batch, batch_bounds, cross_entropy_step, draw_rotation, rotate


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run fastest on one thread, and far faster on a busy shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_net(seed: int = 0) -> nn.Module:
    """Conv + batch norm + dropout: every kind of state a resume has to restore."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), nn.Flatten(), nn.Dropout(0.3), nn.Linear(6 * 6 * 6, 4)
    )


def tiny_split(n: int = 72, seed: int = 0) -> Split:
    g = torch.Generator().manual_seed(seed)
    return Split(torch.randint(0, 256, (n, 3, 8, 8), generator=g, dtype=torch.uint8), torch.randint(0, 4, (n,), generator=g))


def tiny_trainer(**kwargs) -> Trainer:
    defaults = dict(epochs=3, batch_size=16, optimizer=partial(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=5e-4),
                    crop_padding=2, hflip=True, progress=False, device="cpu")
    return Trainer(**{**defaults, **kwargs})


def without_time(history):
    return [{k: v for k, v in row.items() if k != "time_s"} for row in history]


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


# ----------------------------------------------------------------------------- augmentation


def crops_of(image: torch.Tensor, padding: int) -> list[tuple[int, int, torch.Tensor]]:
    """Every crop of the zero-padded image, with its offset."""
    padded = F.pad(image, (padding,) * 4)
    h, w = image.shape[-2:]
    return [(dy, dx, padded[:, dy : dy + h, dx : dx + w]) for dy in range(2 * padding + 1) for dx in range(2 * padding + 1)]


@pytest.mark.parametrize("padding", [1, 3])
def test_crop_only_shifts_by_at_most_padding_and_never_flips_when_off(padding):
    x = torch.rand(200, 2, 6, 7)  # continuous values: a crop matches at exactly one offset
    out = augment_batch(x, torch.Generator().manual_seed(0), padding, hflip=False)
    assert out.shape == x.shape
    seen = set()
    for image, result in zip(x, out):
        matches = [(dy, dx) for dy, dx, crop in crops_of(image, padding) if torch.equal(crop, result)]
        assert len(matches) == 1, "not a crop of the padded image (a flip or a larger shift)"
        seen.add(matches[0])
    # every shift in [-padding, padding]^2 is drawn, not just a few
    assert seen == {(dy, dx) for dy in range(2 * padding + 1) for dx in range(2 * padding + 1)}


def test_flips_happen_only_when_enabled():
    x = torch.rand(64, 3, 5, 5)
    same = augment_batch(x, torch.Generator().manual_seed(0), 0, hflip=False)
    assert torch.equal(same, x)
    out = augment_batch(x, torch.Generator().manual_seed(0), 0, hflip=True)
    flipped = torch.tensor([torch.equal(o, i.flip(2)) for o, i in zip(out, x)])
    kept = torch.tensor([torch.equal(o, i) for o, i in zip(out, x)])
    assert (flipped | kept).all()
    assert 10 < int(flipped.sum()) < 54  # about half, seeded


def test_crop_and_flip_together_are_a_flipped_or_plain_crop_and_work_on_uint8():
    x = torch.randint(1, 256, (40, 1, 6, 6), dtype=torch.uint8)  # no zero pixels: padding is visible
    out = augment_batch(x, torch.Generator().manual_seed(1), 2, hflip=True)
    assert out.dtype == torch.uint8
    for image, result in zip(x, out):
        crops = [c for _, _, c in crops_of(image, 2)]
        assert any(torch.equal(result, c) or torch.equal(result, c.flip(2)) for c in crops)


def test_augmentation_is_seeded():
    x = torch.rand(16, 3, 8, 8)
    a = augment_batch(x, torch.Generator().manual_seed(5), 2, True)
    b = augment_batch(x, torch.Generator().manual_seed(5), 2, True)
    c = augment_batch(x, torch.Generator().manual_seed(6), 2, True)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_rotation_draws_angles_within_the_range_for_a_share_p_of_the_images():
    angles = draw_rotation(4000, torch.Generator().manual_seed(0), 10, 0.5)
    rotated = angles != 0
    assert rotated.float().mean().item() == pytest.approx(0.5, abs=0.03)
    assert angles.abs().max() <= 10 and angles.max() > 9.5 and angles.min() < -9.5
    assert draw_rotation(10, torch.Generator(), 0, 0.5) is None and draw_rotation(10, torch.Generator(), 10, 0) is None
    assert draw_rotation(200, torch.Generator().manual_seed(0), 10, 1.0).ne(0).all()


def test_rotate_turns_images_about_their_centre_and_leaves_angle_zero_alone():
    x = torch.rand(3, 2, 7, 7)
    out = rotate(x, torch.tensor([90.0, 0.0, -90.0]))
    # a quarter turn maps pixel centres onto pixel centres: exactly a rot90, opposite ways for +-90
    quarter = [torch.allclose(out[0], x[0].rot90(k, dims=(1, 2)), atol=1e-5) for k in (1, -1)]
    assert sum(quarter) == 1
    assert torch.equal(out[1], x[1])
    assert torch.allclose(out[2], x[2].rot90(1 if quarter[1] else -1, dims=(1, 2)), atol=1e-5)
    small = rotate(torch.ones(1, 1, 9, 9), torch.tensor([10.0]))
    assert small[0, 0, 4, 4] == pytest.approx(1.0) and small[0, 0, 0, 0] < 1  # zeros come in at the corners


class Recorder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3 * 8 * 8, 4)
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.detach().clone())
        return self.linear(x.flatten(1))


@pytest.mark.parametrize("rotation, changed", [(0, False), (10, True)])
def test_the_trainer_rotates_its_batches_only_when_asked(rotation, changed):
    split = tiny_split(16)
    model = Recorder()
    trainer = tiny_trainer(epochs=1, crop_padding=0, hflip=False, rotation=rotation, rotation_p=1.0,
                           optimizer=partial(torch.optim.SGD, lr=0.0))
    trainer.fit(model, split, generator=torch.Generator().manual_seed(0))
    seen = torch.cat(model.seen)
    originals = split.float_images()
    as_is = [any(torch.equal(row, image) for image in originals) for row in seen]
    assert not any(as_is) if changed else all(as_is)


def test_rotation_is_off_by_default_and_checked(compose_trainer):
    cfg, trainer = compose_trainer()
    assert cfg.trainer.rotation == 0 and trainer.rotation == 0 and Trainer().rotation == 0
    with pytest.raises(ConfigError, match=r"trainer.rotation=200 is out of range"):
        Trainer(rotation=200)
    with pytest.raises(ConfigError, match=r"trainer.rotation_p=1.5 is out of range"):
        Trainer(rotation=10, rotation_p=1.5)


# ----------------------------------------------------------------------------- batching


def test_batch_bounds_cover_every_sample_once_and_never_leave_a_single_sample():
    assert batch_bounds(256, 128) == [(0, 128), (128, 256)]
    assert batch_bounds(257, 128) == [(0, 128), (128, 257)]
    assert batch_bounds(200, 128) == [(0, 128), (128, 200)]
    assert batch_bounds(1, 128) == [(0, 1)]
    assert batch_bounds(0, 128) == []
    for n in range(1, 60):
        bounds = batch_bounds(n, 8)
        assert [i for a, b in bounds for i in range(a, b)] == list(range(n))
        assert n == 1 or all(b - a > 1 for a, b in bounds)


def test_fit_with_batch_norm_survives_a_last_batch_of_one():
    history = tiny_trainer(epochs=1).fit(tiny_net(), tiny_split(33), generator=torch.Generator().manual_seed(0))
    assert len(history) == 1 and math.isfinite(history[0]["loss"])


# ----------------------------------------------------------------------------- schedules


@pytest.mark.parametrize(
    "schedule, expected",
    [
        ("cosine", [0.1 * 0.5 * (1 + math.cos(math.pi * e / 4)) for e in range(4)]),
        ("multistep", [0.1, 0.1, 0.01, 0.001]),  # milestones at 1/2 and 3/4 of the epochs
        ("constant", [0.1] * 4),
    ],
)
def test_learning_rate_follows_the_schedule_per_epoch(schedule, expected):
    trainer = tiny_trainer(epochs=4, schedule=schedule, optimizer=partial(torch.optim.SGD, lr=0.1), augment=False)
    history = trainer.fit(tiny_net(), tiny_split(32), generator=torch.Generator().manual_seed(0))
    assert [row["lr"] for row in history] == pytest.approx(expected, rel=1e-12)


def test_lr_argument_overrides_the_optimizer_lr_and_is_scheduled():
    trainer = tiny_trainer(epochs=2, schedule="cosine", augment=False)
    history = trainer.fit(tiny_net(), tiny_split(32), generator=torch.Generator().manual_seed(0), lr=0.02)
    assert [row["lr"] for row in history] == pytest.approx([0.02, 0.01])


@pytest.fixture
def compose_trainer(compose_cfg):
    def _compose(*overrides: str):
        cfg = compose_cfg(*overrides)
        return cfg, instantiate(cfg.trainer, device="cpu", crop_padding=2, hflip=False)

    return _compose


def test_adam_optimizer_and_compile_flag_from_the_command_line(compose_trainer):
    cfg, trainer = compose_trainer("trainer/optimizer=adam", "trainer.optimizer.lr=0.003", "trainer.compile=true")
    optimizer = trainer.optimizer([nn.Parameter(torch.zeros(2))])
    assert isinstance(optimizer, torch.optim.Adam)
    assert optimizer.param_groups[0]["lr"] == 0.003 and "momentum" not in cfg.trainer.optimizer
    assert trainer.compile is True
    _, default = compose_trainer()
    assert isinstance(default.optimizer([nn.Parameter(torch.zeros(2))]), torch.optim.SGD)
    assert default.compile is False


def test_compile_flag_is_type_checked(compose_trainer):
    with pytest.raises((HydraException, OmegaConfBaseException)):
        compose_trainer("trainer.compile=maybe")


# ----------------------------------------------------------------------------- determinism, resume


def test_two_fits_with_the_same_seeds_give_identical_weights():
    # tiny_net(seed) seeds the global RNG too (init and dropout), as the pipeline does per run.
    a = tiny_net(0)
    ha = tiny_trainer().fit(a, tiny_split(), generator=torch.Generator().manual_seed(3))
    b = tiny_net(0)
    hb = tiny_trainer().fit(b, tiny_split(), generator=torch.Generator().manual_seed(3))
    assert_same_state(a, b)
    assert without_time(ha) == without_time(hb)
    c = tiny_net(0)
    tiny_trainer().fit(c, tiny_split(), generator=torch.Generator().manual_seed(4))
    assert not torch.equal(a[0].weight, c[0].weight)  # the generator does drive the run


class Crash(Exception):
    pass


def test_resume_from_checkpoint_equals_an_uninterrupted_run_bit_for_bit(tmp_path):
    split = tiny_split()
    # An extra trained tensor (as a training-time attack's trigger would be) must be resumed too.
    def make_step(shift):
        def step(model, x, y):
            return cross_entropy_step(model, x + shift, y)
        return step

    torch.manual_seed(123)
    straight, shift_a = tiny_net(0), nn.Parameter(torch.zeros(1, 3, 1, 1))
    gen_a = torch.Generator().manual_seed(7)
    hist_a = tiny_trainer().fit(straight, split, generator=gen_a, step=make_step(shift_a), extra_params=[shift_a])
    rng_a = torch.get_rng_state()

    path = tmp_path / "ckpt" / "victim.pt"
    torch.manual_seed(123)
    crashed, shift_b = tiny_net(0), nn.Parameter(torch.zeros(1, 3, 1, 1))

    def crash_after_two(row):
        if row["epoch"] == 2:
            raise Crash

    with pytest.raises(Crash):
        tiny_trainer().fit(crashed, split, generator=torch.Generator().manual_seed(7), step=make_step(shift_b),
                           extra_params=[shift_b], checkpoint=path, on_epoch=crash_after_two)
    assert path.exists() and [p.name for p in path.parent.iterdir()] == ["victim.pt"]  # no temp file left

    # A new process: new model (other init), new trainer, fresh generator, other global RNG state.
    torch.manual_seed(999)
    resumed, shift_c = tiny_net(1), nn.Parameter(torch.ones(1, 3, 1, 1))
    gen_c = torch.Generator().manual_seed(0)
    calls = []

    def counting_step(model, x, y):
        calls.append(len(x))
        return make_step(shift_c)(model, x, y)

    hist_c = tiny_trainer().fit(resumed, split, generator=gen_c, step=counting_step, extra_params=[shift_c],
                                checkpoint=path)
    assert sum(calls) == len(split)  # only epoch 3 was trained
    assert_same_state(straight, resumed)
    assert torch.equal(shift_a, shift_c)
    assert without_time(hist_a) == without_time(hist_c)
    assert torch.equal(gen_a.get_state(), gen_c.get_state())
    assert torch.equal(rng_a, torch.get_rng_state())

    # A finished checkpoint: fitting again trains nothing and returns the same history.
    calls.clear()
    again = tiny_net(2)
    hist_d = tiny_trainer().fit(again, split, generator=torch.Generator(), step=counting_step, extra_params=[shift_c],
                                checkpoint=path)
    assert calls == [] and without_time(hist_d) == without_time(hist_a)
    assert_same_state(straight, again)


def fit_with(path, **kwargs):
    return tiny_trainer(epochs=1).fit(kwargs.pop("model", tiny_net()), tiny_split(), generator=torch.Generator(),
                                      checkpoint=path, **kwargs)


def assert_one_line_data_error(path, match, **kwargs):
    with pytest.raises(DataError, match=match) as info:
        fit_with(path, **kwargs)
    assert "\n" not in str(info.value)


def test_corrupt_or_foreign_checkpoints_are_one_line_data_errors(tmp_path):
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint at all")
    assert_one_line_data_error(garbage, "cannot be read")

    good = tmp_path / "good.pt"
    fit_with(good)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    assert_one_line_data_error(truncated, "cannot be read")

    other = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(3)}, other)
    assert_one_line_data_error(other, "not a trainer checkpoint")

    # Same fit, another architecture: the state dict does not fit.
    wider = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Dropout(0.3),
                          nn.Linear(8 * 6 * 6, 4))
    assert_one_line_data_error(good, "does not fit this model", model=wider)

    # Another fit (more epochs, other stage) wrote it.
    with pytest.raises(DataError, match="written by another fit"):
        tiny_trainer(epochs=2).fit(tiny_net(), tiny_split(), generator=torch.Generator(), checkpoint=good)
    assert_one_line_data_error(good, "written by another fit", desc="fine-tune")


# ----------------------------------------------------------------------------- compile


def test_compile_wraps_the_model_for_steps_but_leaves_the_callers_model_plain(monkeypatch):
    compiled = []

    class Wrapper(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    def fake_compile(model, **kwargs):
        compiled.append(model)
        return Wrapper(model)

    monkeypatch.setattr(torch, "compile", fake_compile)
    seen = []

    def step(model, x, y):
        seen.append(type(model))
        return cross_entropy_step(model, x, y)

    model = tiny_net()
    tiny_trainer(epochs=1).fit(model, tiny_split(32), generator=torch.Generator(), step=step)
    assert compiled == [] and set(seen) == {nn.Sequential}  # off by default

    trainer = tiny_trainer(epochs=1, compile=True)
    trainer.fit(model, tiny_split(32), generator=torch.Generator(), step=step)
    assert compiled == [model] and seen[-1] is Wrapper
    assert not any(key.startswith("inner.") for key in model.state_dict())
    trainer.predict(model, tiny_split(8).images)
    assert len(compiled) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.compile is meant for CUDA; CPU inductor is minutes")
def test_compiled_training_on_cuda_learns_like_eager():
    split = tiny_split(256)
    results = []
    for compile_flag in (False, True):
        model = tiny_net(0)
        trainer = tiny_trainer(epochs=3, device="cuda", compile=compile_flag, precision="fp32")
        history = trainer.fit(model, split, generator=torch.Generator().manual_seed(0))
        results.append((history[-1]["loss"], model.cpu()))
    (eager_loss, eager), (compiled_loss, compiled) = results
    assert compiled_loss == pytest.approx(eager_loss, rel=0.05)
    for key, value in eager.state_dict().items():
        if value.is_floating_point():
            assert torch.allclose(value, compiled.state_dict()[key], atol=1e-2), key
