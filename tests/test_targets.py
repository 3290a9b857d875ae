import pytest
import torch

from backdoorbench.attacks.targets import All2All, All2One, make_target_rule
from backdoorbench.errors import ConfigError


def test_all2one_maps_every_label_to_target():
    y = torch.arange(10).repeat(3)
    assert torch.equal(All2One(4)(y), torch.full_like(y, 4))


def test_all2all_maps_y_to_y_plus_one_mod_c():
    y = torch.arange(10)
    assert All2All(10)(y).tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 0]
    # No label maps to itself, so every test image is attackable in all2all.
    assert (All2All(43)(torch.arange(43)) != torch.arange(43)).all()


def test_make_target_rule_builds_and_checks():
    assert make_target_rule("all2one", 3, 10)(torch.tensor([0, 9])).tolist() == [3, 3]
    assert make_target_rule("all2all", 0, 10)(torch.tensor([9])).tolist() == [0]


@pytest.mark.parametrize("mode,target", [("all2one", 10), ("all2one", -1), ("all2one", 1.5), ("all2one", True), ("nope", 0)])
def test_make_target_rule_rejects_bad_values(mode, target):
    with pytest.raises(ConfigError) as info:
        make_target_rule(mode, target, 10)
    assert "\n" not in str(info.value)
