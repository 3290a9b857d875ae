"""CA, ASR, RA and DER on hand-made predictions; AUROC and detection rates on hand-made scores."""

import pytest
import torch

from backdoorbench.attacks.targets import All2All, All2One
from backdoorbench.metrics import attack_success_rate, clean_accuracy, defense_effectiveness_rating, robust_accuracy
from backdoorbench.metrics.detection import auroc, detection_rates


def test_clean_accuracy():
    assert clean_accuracy(torch.tensor([0, 1, 2, 3]), torch.tensor([0, 1, 0, 3])) == 0.75


def test_asr_and_ra_all2one_skip_images_of_the_target_class():
    labels = torch.tensor([0, 0, 1, 2, 3, 4])
    # Triggered predictions: the two target-class images (label 0) are not counted at all.
    triggered = torch.tensor([5, 5, 0, 0, 3, 1])
    rule = All2One(0)
    assert attack_success_rate(triggered, labels, rule) == 2 / 4
    assert robust_accuracy(triggered, labels, rule) == 1 / 4


def test_asr_and_ra_all2all():
    labels = torch.tensor([0, 1, 2, 9])
    triggered = torch.tensor([1, 1, 3, 0])  # targets are 1, 2, 3, 0
    rule = All2All(10)
    assert attack_success_rate(triggered, labels, rule) == 3 / 4
    assert robust_accuracy(triggered, labels, rule) == 1 / 4


def test_asr_undefined_without_attackable_images():
    with pytest.raises(ValueError):
        attack_success_rate(torch.tensor([0]), torch.tensor([0]), All2One(0))


@pytest.mark.parametrize(
    "before,after,expected",
    [
        ({"clean_acc": 0.9, "asr": 1.0}, {"clean_acc": 0.9, "asr": 0.0}, 1.0),  # perfect removal
        ({"clean_acc": 0.9, "asr": 1.0}, {"clean_acc": 0.9, "asr": 1.0}, 0.5),  # nothing happens
        ({"clean_acc": 0.9, "asr": 1.0}, {"clean_acc": 0.1, "asr": 0.2}, 0.5),  # removal bought with CA
        ({"clean_acc": 0.9, "asr": 0.5}, {"clean_acc": 0.95, "asr": 0.9}, 0.5),  # gains are not rewarded
        ({"clean_acc": 0.9, "asr": 1.0}, {"clean_acc": 0.0, "asr": 1.0}, 0.05),
    ],
)
def test_der(before, after, expected):
    assert defense_effectiveness_rating(before, after) == pytest.approx(expected)


def test_auroc_against_hand_cases_and_sklearn():
    positive = torch.tensor([1, 1, 0, 0], dtype=torch.bool)
    assert auroc(torch.tensor([0.9, 0.8, 0.1, 0.2]), positive) == 1.0
    assert auroc(torch.tensor([0.1, 0.2, 0.9, 0.8]), positive) == 0.0
    assert auroc(torch.tensor([0.5, 0.5, 0.5, 0.5]), positive) == 0.5  # ties count one half
    assert auroc(torch.tensor([1.0, 2.0]), torch.tensor([True, True])) is None
    from sklearn.metrics import roc_auc_score

    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 20, (300,), generator=g).float()  # many ties
    labels = torch.rand(300, generator=g) < 0.3
    assert auroc(scores, labels) == pytest.approx(roc_auc_score(labels.numpy(), scores.numpy()), abs=1e-12)


def test_detection_rates():
    flagged = torch.tensor([1, 0, 1, 0, 0], dtype=torch.bool)
    positive = torch.tensor([1, 1, 0, 0, 0], dtype=torch.bool)
    assert detection_rates(flagged, positive) == {"tpr": 0.5, "fpr": 1 / 3, "f1": 0.5}  # TP 1, FP 1, FN 1


def test_detection_f1_is_sklearns_at_the_detectors_own_flags_and_none_only_for_0_over_0():
    from sklearn.metrics import f1_score

    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        positive = torch.rand(200, generator=g) < 0.1
        flagged = torch.rand(200, generator=g) < 0.15
        assert detection_rates(flagged, positive)["f1"] == pytest.approx(f1_score(positive.numpy(), flagged.numpy()))
    # a clean set: flagging anything is F1 0 (every flag is wrong); flagging nothing is undefined
    nothing = torch.zeros(10, dtype=torch.bool)
    assert detection_rates(torch.tensor([True] + [False] * 9), nothing) == {"tpr": None, "fpr": 0.1, "f1": 0.0}
    assert detection_rates(nothing, nothing)["f1"] is None
    assert detection_rates(nothing, ~nothing) == {"tpr": 0.0, "fpr": None, "f1": 0.0}  # missed every positive
