"""STRIP's superimposition option, I-BAU's L2 projection and the official code's unbounded delta, and the
silent fallback of the benign false-positive rate made loud."""

import torch
from torch import nn

from backdoorbench.defenses.i_bau import ImplicitBackdoorAdversarialUnlearning
from backdoorbench.defenses.runner import DefenseOutcome, benign_false_positives
from backdoorbench.defenses.strip import Strip, superimpose


def test_superimpose_is_the_official_plain_sum_unless_saturated():
    x, overlays = torch.full((1, 1, 2, 2), 0.7), torch.full((1, 3, 1, 2, 2), 0.5)
    assert torch.allclose(superimpose(x, overlays), torch.full((1, 3, 1, 2, 2), 1.2))
    assert torch.equal(superimpose(x, overlays, saturate=True), torch.ones(1, 3, 1, 2, 2))
    assert Strip().saturate is True and Strip(saturate=False).saturate is False


def test_i_bau_perturbation_is_bounded_by_default_and_unbounded_as_the_official_code_on_request():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 2))
    with torch.no_grad():
        model[1].weight.mul_(50)
    batches = [torch.rand(8, 1, 4, 4)]
    free = ImplicitBackdoorAdversarialUnlearning(perturbation_steps=5, perturbation_lr=1e4,
                                                 perturbation_norm=None).universal_perturbation(model, batches)
    bound = ImplicitBackdoorAdversarialUnlearning(perturbation_steps=5, perturbation_lr=1e4)
    assert float(free.norm()) > 10.0
    assert float(bound.universal_perturbation(model, batches).norm()) <= 10.0 + 1e-4


class _PreTrain:
    stage = "pre_train"


def test_benign_false_positive_of_an_empty_training_set_is_null_with_a_reason():
    outcome = DefenseOutcome(defended={}, detection={"n_flagged": 0}, extras={})
    benign = benign_false_positives(_PreTrain(), outcome, 0)
    assert benign["false_positive"] is None and benign["reason"]

