"""D-BR and D-ST (Chen, Wu, Wang, NeurIPS 2022): the FCT is the official feature distance under the
official transformations, the poisoned samples are the sensitive ones on a small backdoored model, the
split takes the official ratios and thresholds, D-BR's unlearning removes the backdoor while relearning
keeps the clean accuracy, and D-ST's contrastive stage reads a label only where the official loss does."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from backdoorbench.datasets.base import Split
from backdoorbench.defenses.base import DefenseContext
from backdoorbench.defenses.contrastive_views import hsv_to_rgb, resized_crop_boxes, rgb_to_hsv, supcon_view
from backdoorbench.defenses.d_br import DBR, unlearn_relearn
from backdoorbench.defenses.d_st import DST, semi_supervised_contrastive_loss, supcon_lr
from backdoorbench.defenses.sensitivity_split import (center_similarity, feature_consistency, rotate_nearest, separate,
                                                      transform_batch, translate)
from backdoorbench.errors import ConfigError, DataError
from backdoorbench.metrics.detection import auroc
from backdoorbench.train import Trainer
from tests.tiny import make_model, one_thread  # noqa: F401  (autouse fixture)
from tests.tiny import ZOO

# ---------------------------------------------------------------------------------------------- FCT


def test_the_rotation_is_pils_and_the_shift_whole_pixels():
    rng = np.random.default_rng(0)
    for side in (8, 28, 32):
        image = rng.integers(1, 256, (side, side)).astype(np.uint8)
        x = torch.tensor(image, dtype=torch.float32)[None, None]
        for angle in (90.0, -45.0, 30.0, 137.5, 179.0):
            ours = rotate_nearest(x, torch.tensor([angle]))[0, 0].numpy().astype(np.uint8)
            assert np.array_equal(ours, np.array(Image.fromarray(image).rotate(angle, resample=Image.NEAREST)))
        assert torch.equal(rotate_nearest(x, torch.tensor([90.0])), torch.rot90(x, 1, (2, 3)))
    x = torch.rand(2, 1, 6, 6)
    moved = translate(x, torch.tensor([[1, -2], [0, 0]]))
    expected = torch.zeros_like(x)
    expected[0, :, 1:, :-2] = x[0, :, :-1, 2:]
    expected[1] = x[1]
    assert torch.equal(moved, expected)
    # RandomAffine(translate=(0.2, 0.2)) on 32 px: whole-pixel shifts within round(6.4) = 6
    g = torch.Generator().manual_seed(0)
    dot = torch.zeros(200, 1, 32, 32)
    dot[:, :, 16, 16] = 1
    where = transform_batch(dot, ["affine"], g).flatten(1).argmax(1)
    rows, cols = where // 32 - 16, where % 32 - 16
    assert rows.abs().max() == 6 and cols.abs().max() == 6 and len(set(rows.tolist())) == 13


class Pixels(nn.Module):
    """A 'model' whose penultimate features are its [0, 1] pixels, flattened."""
    def __init__(self):
        super().__init__()
        self.classifier = nn.Linear(4, 2)

    def features(self, x):
        return x.flatten(1)


def test_the_fct_of_a_hand_made_case_is_the_official_distance():
    # one 1x2x2 image [[0, 255], [51, 102]]; flipped: [[255, 0], [102, 51]]; the features are the pixels, so
    # mean((f1 - f2)^2) = ((0 - 1)^2 + (1 - 0)^2 + (0.2 - 0.4)^2 + (0.4 - 0.2)^2) / 4 = 0.52
    image = torch.tensor([[[[0, 255], [51, 102]]]], dtype=torch.uint8)
    fct = feature_consistency(Pixels(), image, ["flip"], torch.Generator(), torch.device("cpu"))
    assert fct.shape == (1,) and fct.item() == pytest.approx(0.52, abs=1e-6)
    # with the random pair, the same distance to the copy drawn from the same stream
    images = torch.randint(0, 256, (5, 1, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    fct = feature_consistency(Pixels(), images, ["rotate", "affine"], torch.Generator().manual_seed(2), torch.device("cpu"))
    x = images.float() / 255
    moved = transform_batch(x, ["rotate", "affine"], torch.Generator().manual_seed(2))
    assert torch.allclose(fct, ((x - moved) ** 2).flatten(1).mean(1))


def official_gamma_and_split(scores: np.ndarray, clean_ratio: float, poison_ratio: float):
    """A transcription of the official calculate_gamma.py and separate_samples.py's if/elif."""
    all_size = scores.shape[0]
    clean_size, poison_size = int(all_size * clean_ratio), int(all_size * poison_ratio)
    new_data = np.sort(scores)
    gamma_low, gamma_high = new_data[clean_size], new_data[all_size - poison_size]
    flags = [0 if s <= gamma_low else 2 if s >= gamma_high else 1 for s in scores]
    return gamma_low, gamma_high, np.array(flags)


@pytest.mark.parametrize(("n", "clean_ratio", "poison_ratio"), [(1000, 0.2, 0.05), (40, 0.2, 0.05), (333, 0.35, 0.1)])
def test_the_split_takes_the_official_ratios_and_thresholds(n, clean_ratio, poison_ratio):
    scores = torch.rand(n, generator=torch.Generator().manual_seed(n))
    split = separate(scores, clean_ratio, poison_ratio)
    low, high, flags = official_gamma_and_split(scores.double().numpy(), clean_ratio, poison_ratio)
    assert split.gamma_low == low and split.gamma_high == high
    assert torch.equal(split.flags(), torch.tensor(flags))
    # the lowest int(N alpha_c) + 1 are clean (the official <=), the highest int(N alpha_p) poisoned
    assert len(split.clean) == int(n * clean_ratio) + 1 and len(split.poisoned) == int(n * poison_ratio)
    order = torch.argsort(scores)
    assert set(split.clean.tolist()) == set(order[: len(split.clean)].tolist())
    assert set(split.poisoned.tolist()) == set(order[n - len(split.poisoned):].tolist())
    assert len(split.clean) + len(split.poisoned) + len(split.uncertain) == n


def test_a_ratio_that_takes_no_sample_is_one_line():
    with pytest.raises(DataError, match=r"defense.poison_ratio=0.01 of 40 training samples takes none as poisoned") as info:
        separate(torch.rand(40), 0.2, 0.01)
    assert "\n" not in str(info.value)


def test_l_intra_is_the_official_centre_similarity():
    g = torch.Generator().manual_seed(0)
    features = torch.randn(12, 5, generator=g)
    labels = torch.tensor([0, 0, 3, 3, 3, 1, 1, 5, 5, 5, 5, 3])  # classes 2 and 4 absent
    centers = []
    for j in range(6):  # the official loop (finetune_attack_noTrans.py)
        j_idx = torch.where(labels == j)[0]
        if j_idx.shape[0] == 0:
            continue
        centers.append(torch.mean(features[j_idx], dim=0))
    centers = F.normalize(torch.stack(centers, dim=0), dim=1)
    similarity = centers @ centers.T
    similarity[torch.eye(similarity.shape[0], dtype=torch.bool)] = 0.0
    assert center_similarity(features, labels).item() == pytest.approx(torch.mean(similarity).item(), abs=1e-6)


# ------------------------------------------------------- a small backdoored model on data where it shows


def brightness_data(n: int, rate: float, seed: int):
    """16x16 one-channel images whose class (4) is their brightness, a property a rotation or a shift
    keeps; `rate` of them (never class 0) carry a white 3x3 corner and the label 0 (BadNets)."""
    g = torch.Generator().manual_seed(seed)
    truth = torch.randint(0, 4, (n,), generator=g)
    x = (torch.rand(n, 1, 16, 16, generator=g) * 50 + 45 * truth.view(-1, 1, 1, 1).float() + 10).to(torch.uint8)
    others = torch.nonzero(truth != 0).flatten()
    poisoned = others[torch.randperm(len(others), generator=g)[: int(rate * n)]].sort().values
    x[poisoned, :, -3:, -3:] = 255
    labels = truth.clone()
    labels[poisoned] = 0
    return Split(x, labels), poisoned


def context(train: Split, poisoned, model=None, seed: int = 0) -> DefenseContext:
    trainer = Trainer(epochs=1, batch_size=32, augment=False, progress=False)
    return DefenseContext(model=model, poisoned_train=train, poisoned_indices=poisoned,
                          clean_subset=train.subset(torch.arange(0)), trainer=trainer, num_classes=4,
                          generator=torch.Generator().manual_seed(seed), build_model=lambda: make_model(0))


FAST_SD = dict(sd_epochs=5, sd_finetune_epochs=10, sd_lr=0.03, sd_batch_size=32)


def test_the_poisoned_samples_are_the_sensitive_ones_on_a_small_backdoored_model():
    train, poisoned = brightness_data(400, 0.1, seed=0)
    split, extras = DBR(**FAST_SD).split.run(context(train, poisoned))
    is_poisoned = torch.zeros(len(train), dtype=torch.bool)
    is_poisoned[poisoned] = True
    fct = split.scores
    assert extras["sd_train_acc"] > 0.9  # the SD model learned the backdoor with the task
    assert fct[is_poisoned].mean() > 20 * fct[~is_poisoned].mean()  # poisoned samples move far more
    assert auroc(fct, is_poisoned) > 0.95
    assert is_poisoned[split.poisoned].all() and not is_poisoned[split.clean].any()
    assert (len(split.clean), len(split.poisoned)) == (81, 20)


def backdoored(train: Split) -> nn.Module:
    model = make_model(0)
    Trainer(batch_size=32, augment=False, progress=False).fit(model, train, generator=torch.Generator().manual_seed(0),
                                                              epochs=5, lr=0.05)
    return model.eval()


def measure(model: nn.Module, test: Split) -> tuple[float, float]:
    """CA on `test`, ASR with the white corner on its images of classes 1-3."""
    predict = Trainer(progress=False).predict
    triggered = test.images.clone()
    triggered[:, :, -3:, -3:] = 255
    attackable = test.labels != 0
    return ((predict(model, test.images) == test.labels).float().mean().item(),
            (predict(model, triggered[attackable]) == 0).float().mean().item())


def loss_on(model: nn.Module, split: Split) -> float:
    with torch.no_grad():
        return F.cross_entropy(model.eval()(split.images.float() / 255), split.labels).item()


def test_unlearning_raises_the_loss_on_the_poisoned_part_and_relearning_keeps_the_clean_accuracy():
    train, poisoned = brightness_data(400, 0.1, seed=0)
    test, _ = brightness_data(400, 0.0, seed=1)
    victim = backdoored(train)
    ca, asr = measure(victim, test)
    assert ca > 0.95 and asr > 0.95
    clean = torch.tensor([i for i in range(len(train)) if i not in set(poisoned.tolist())][:80])
    poisoned_part, clean_part = train.subset(poisoned), train.subset(clean)
    model = copy.deepcopy(victim)
    rows = unlearn_relearn(model, Trainer(augment=False, progress=False), poisoned_part, clean_part,
                           generator=torch.Generator().manual_seed(1), epochs=20, lr=1e-4, weight_decay=5e-4,
                           batch_size=32)  # the official BR: 20 epochs at a constant lr 1e-4
    assert len(rows) == 20 and rows[-1]["unlearn_loss"] < 0  # -CE: the ascent's loss
    assert loss_on(model, poisoned_part) > 100 * loss_on(victim, poisoned_part)
    ca_after, asr_after = measure(model, test)
    assert ca_after >= ca - 0.02 and asr_after < 0.7 * asr


def test_d_br_finds_the_poisoned_part_and_repairs_the_attacked_model():
    train, poisoned = brightness_data(400, 0.1, seed=0)
    test, _ = brightness_data(400, 0.0, seed=1)
    victim = backdoored(train)
    before = {k: v.clone() for k, v in victim.state_dict().items()}
    defense = DBR(**FAST_SD, poison_ratio=0.1, epochs=20, batch_size=32)  # the 10% poisoned, all of them found
    result = defense.apply(context(train, poisoned, model=victim))
    assert all(torch.equal(v, before[k]) for k, v in victim.state_dict().items())  # the victim is left as it was
    assert result.extras["n_poisoned"] == 40 and result.extras["n_clean"] == 81
    assert set(torch.nonzero(result.artifacts["split"] == 2).flatten().tolist()) <= set(poisoned.tolist())
    ca, asr = measure(victim, test)
    ca_after, asr_after = measure(result.model, test)
    assert ca_after >= ca - 0.02 and asr_after < 0.7 * asr


# ---------------------------------------------------------------------------------------------- D-ST


def official_ss_ctl(features, labels, flags, temperature, base_temperature=0.07):
    """A transcription of the official SupConLoss_Consistency.forward (labels given, contrast_mode 'all')."""
    batch_size = features.shape[0]
    labels = labels.contiguous().view(-1, 1)
    mask = torch.eq(labels, labels.T).float()
    nonclean_idx = torch.where(flags != 0)[0]
    mask[nonclean_idx, :] = 0
    mask[nonclean_idx, nonclean_idx] = 1
    contrast_count = features.shape[1]
    contrast_feature = torch.cat(torch.unbind(features, dim=1), dim=0)
    anchor_feature, anchor_count = contrast_feature, contrast_count
    anchor_dot_contrast = torch.div(torch.matmul(anchor_feature, contrast_feature.T), temperature)
    logits_max, _ = torch.max(anchor_dot_contrast, dim=1, keepdim=True)
    logits = anchor_dot_contrast - logits_max.detach()
    mask = mask.repeat(anchor_count, contrast_count)
    logits_mask = torch.scatter(torch.ones_like(mask), 1, torch.arange(batch_size * anchor_count).view(-1, 1), 0)
    mask = mask * logits_mask
    exp_logits = torch.exp(logits) * logits_mask
    log_prob = logits - torch.log(exp_logits.sum(1, keepdim=True))
    mean_log_prob_pos = (mask * log_prob).sum(1) / mask.sum(1)
    loss = - (temperature / base_temperature) * mean_log_prob_pos
    return loss.view(anchor_count, batch_size).mean()


def views(batch: int, seed: int) -> torch.Tensor:
    return F.normalize(torch.randn(batch, 2, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64), dim=2)


def test_the_ss_ctl_loss_is_the_official_one():
    g = torch.Generator().manual_seed(0)
    for seed in range(3):
        features = views(10, seed)
        labels = torch.randint(0, 3, (10,), generator=g)
        flags = torch.randint(0, 3, (10,), generator=g)
        ours = semi_supervised_contrastive_loss(features, labels, flags, 0.1)
        assert ours.item() == pytest.approx(official_ss_ctl(features, labels, flags, 0.1).item(), rel=1e-9)


def test_the_contrastive_stage_reads_a_label_only_for_the_samples_flagged_clean():
    features = views(8, 1)
    labels = torch.tensor([0, 0, 1, 1, 2, 2, 0, 1])
    unflagged = torch.tensor([1, 2, 1, 2, 1, 2, 1, 2])  # nothing flagged clean: SimCLR, the labels unread
    loss = semi_supervised_contrastive_loss(features, labels, unflagged, 0.1)
    for relabelled in (torch.zeros(8, dtype=torch.long), torch.arange(8), torch.tensor([2, 1, 0, 2, 1, 0, 2, 1])):
        assert semi_supervised_contrastive_loss(features, relabelled, unflagged, 0.1).item() == pytest.approx(loss.item(), rel=1e-12)
    # and that SimCLR loss by hand: each view's positive is its sample's other view alone
    v = torch.cat(features.unbind(1), 0)
    z = v @ v.T / 0.1
    positive = torch.cat([torch.arange(8, 16), torch.arange(8)])
    log_prob = z[torch.arange(16), positive] - torch.logsumexp(z.masked_fill(torch.eye(16, dtype=torch.bool), -math.inf), 1)
    assert loss.item() == pytest.approx(-(0.1 / 0.07) * log_prob.mean().item(), rel=1e-9)
    # a sample flagged clean has its label-mates for positives: its label is read
    flags = unflagged.clone()
    flags[0] = 0
    with_label = semi_supervised_contrastive_loss(features, labels, flags, 0.1)
    relabelled = labels.clone()
    relabelled[0] = 2
    assert semi_supervised_contrastive_loss(features, relabelled, flags, 0.1).item() != pytest.approx(with_label.item())


def test_the_schedules_are_the_official_formulas():
    # adjust_learning_rate with --cosine: eta_min = lr * 0.1^3, at epoch e of E: eta_min + (lr - eta_min)(1 + cos(pi e / E)) / 2
    assert supcon_lr(0.5, 200, 200) == pytest.approx(5e-4)
    assert supcon_lr(0.5, 100, 200) == pytest.approx(5e-4 + (0.5 - 5e-4) / 2)
    assert DST().warmup_to() == pytest.approx(5e-4 + (0.5 - 5e-4) * (1 + math.cos(math.pi * 10 / 200)) / 2)
    assert DST(budget="cpu").contrastive_epochs == 20 and DST(budget="cpu").warmup_epochs == 2


def test_the_supcon_views_stay_images_and_the_colour_conversion_round_trips():
    g = torch.Generator().manual_seed(0)
    rgb = torch.rand(64, 3, 16, 16, generator=g)
    assert torch.allclose(hsv_to_rgb(rgb_to_hsv(rgb)), rgb, atol=1e-5)
    boxes = resized_crop_boxes(500, 32, 32, g)
    top, left, h, w = boxes.unbind(1)
    assert (top >= 0).all() and (left >= 0).all() and (top + h <= 32).all() and (left + w <= 32).all()
    share = (h * w).float() / 1024
    assert share.min() >= 0.15 and share.max() <= 1.0 and 0.5 < share.mean() < 0.65
    for x in (rgb, torch.rand(8, 1, 28, 28, generator=g)):
        a, b = supcon_view(x, g, True), supcon_view(x, g, False)
        assert a.shape == x.shape and 0 <= a.min() and a.max() <= 1 and not torch.equal(a, b)


def test_d_st_detects_with_its_split_and_trains_a_model_that_classifies():
    train, poisoned = brightness_data(400, 0.1, seed=0)
    test, _ = brightness_data(200, 0.0, seed=1)
    defense = DST(**FAST_SD, contrastive_epochs=3, warmup_epochs=1, contrastive_batch_size=128,
                  classifier_epochs=5, classifier_lr=1.0, classifier_batch_size=64)
    ctx = context(train, poisoned)
    detection = defense.apply(DefenseContext(**{**ctx.__dict__, "detection_only": True}))
    assert detection.model is None and detection.flagged.sum() == 20
    assert set(torch.nonzero(detection.flagged).flatten().tolist()) <= set(poisoned.tolist())
    assert torch.equal(detection.sample_scores, detection.sample_scores.float())
    result = defense.apply(context(train, poisoned))
    assert torch.equal(result.flagged, detection.flagged)  # the same seed: the same split
    assert result.model(test.images[:3].float() / 255).shape == (3, 4)
    ca, asr = measure(result.model, test)
    assert ca > 0.5 and asr < 0.5  # brightness survives the views; the corner, unsupervised, does not teach 0
    # the diagnostics of the linear stage: the frozen features' scale, the classifier's training accuracy
    model = result.model.eval()
    assert result.extras["feature_sq_norm"] > 0 and 0 <= result.extras["classifier_train_acc"] <= 1
    with torch.no_grad():
        own = float(model.features(train.images[:8].float() / 255).flatten(1).pow(2).sum(1).mean())
    assert DST.feature_sq_norm(model, train.images[:8], torch.device("cpu")) == pytest.approx(own, rel=1e-5)


# ----------------------------------------------------------------------------- the zoo, bad values


@pytest.mark.parametrize(("name", "shape", "classes", "kwargs"), ZOO, ids=[z[0] for z in ZOO])
def test_the_zoo(name, shape, classes, kwargs):
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    import backdoorbench
    from backdoorbench.models.base import Normalized

    node = OmegaConf.load(Path(backdoorbench.__file__).parent / "conf" / "model" / f"{name}.yaml")

    def build():
        torch.manual_seed(0)
        net = instantiate(node, in_channels=shape[0], num_classes=classes, image_size=shape[1], **kwargs)
        return Normalized(net, (0.5,) * shape[0], (0.25,) * shape[0])

    g = torch.Generator().manual_seed(0)
    data = Split(torch.randint(0, 256, (24, *shape), dtype=torch.uint8, generator=g), torch.randint(0, classes, (24,), generator=g))
    trainer = Trainer(epochs=1, batch_size=8, crop_padding=2, progress=False)
    ctx = DefenseContext(model=build().eval(), poisoned_train=data, poisoned_indices=torch.arange(0),
                         clean_subset=data.subset(torch.arange(0)), trainer=trainer, num_classes=classes, generator=g,
                         build_model=build)
    tiny = dict(sd_epochs=1, sd_finetune_epochs=1, sd_batch_size=8, clean_ratio=0.25, poison_ratio=0.25)
    for defense in (DBR(**tiny, epochs=1, batch_size=8),
                    DST(**tiny, contrastive_epochs=1, warmup_epochs=1, contrastive_batch_size=8, classifier_epochs=1,
                        classifier_batch_size=8)):
        defense.check_model(ctx.model)
        result = defense.apply(ctx)
        with torch.no_grad():
            out = result.model.eval()(data.images[:2].float() / 255)
        assert out.shape == (2, classes) and torch.isfinite(out).all()
        assert result.extras["n_poisoned"] == 6 and result.extras["n_clean"] == 7


@pytest.mark.parametrize(("make", "message"), [
    (lambda: DBR(poison_ratio=0), r"^defense.poison_ratio=0 is out of range; use a number in \(0, 1\)"),
    (lambda: DBR(clean_ratio=0.9, poison_ratio=0.2), r"^defense.clean_ratio=0.9 and defense.poison_ratio=0.2 leave no uncertain part"),
    (lambda: DBR(transforms=["rotate", "blur"]), r"^defense.transforms=\['rotate', 'blur'\] is invalid; use a non-empty list of: rotate"),
    (lambda: DBR(transforms="rotate"), r"^defense.transforms='rotate' is invalid"),
    (lambda: DBR(lr=0), r"^defense.lr=0 is invalid"),
    (lambda: DST(budget="gpu"), r"^defense.budget='gpu' is unknown for d_st; choose one of: official, cpu"),
    (lambda: DST(warmup_epochs=30, contrastive_epochs=20), r"^defense.warmup_epochs=30 is out of range"),
    (lambda: DST(temperature=0), r"^defense.temperature=0 is invalid"),
])
def test_bad_values_are_one_config_error(make, message):
    with pytest.raises(ConfigError, match=message) as info:
        make()
    assert "\n" not in str(info.value)


def test_a_model_without_penultimate_features_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"defense=d_st reads penultimate features: model 'Linear' has no .features") as info:
        DST().check_model(nn.Linear(2, 2))
    assert "\n" not in str(info.value)


def test_the_configs_are_the_official_values(compose_cfg):
    br, st = compose_cfg("defense=d_br").defense, compose_cfg("defense=d_st").defense
    assert (br.clean_ratio, br.poison_ratio, list(br.transforms), br.epochs, br.lr) == (0.2, 0.05, ["rotate", "affine"], 20, 1e-4)
    assert (st.budget, st.contrastive_lr, st.temperature, st.classifier_lr, st.poison_weight) == ("official", 0.5, 0.1, 5.0, 0.001)
    assert not DBR.meets_training_controlled_attacks and not DST.meets_training_controlled_attacks
    assert DBR.stage == "post_train" and DST.stage == "in_train" and DST.is_detector() and not DBR.is_detector()
