"""Run by tests/test_distributed.py under `torchrun --nproc_per_node=2` (gloo, CPU); also importable,
so the test runs the same fits in one process to compare.

`python tests/ddp_worker.py OUT` trains (1) a batch-norm-free net with an extra trained tensor and
a side-optimized tensor (as a trigger generator is) on 69 images in batches of 16, so the last
batch's shares are unequal (3 and 2), with a trainer checkpoint; (2) every training-controlled
attack's victim on tiny data. Rank 0 alone writes OUT/result.pt; the fingerprints of each
process's weights are gathered first, so the test can tell whether all processes agree.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from backdoorbench import distributed
from backdoorbench.datasets.base import Split
from backdoorbench.errors import ConfigError
from backdoorbench.models.base import Normalized
from backdoorbench.models.mnist_cnn import MnistCNN
from backdoorbench.train import Trainer, cross_entropy_step


def plain_fit(checkpoint: Path | None = None) -> dict:
    """No batch norm, no dropout: one process and N processes compute the same gradients."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 6, 3), nn.ReLU(), nn.Flatten(), nn.Linear(6 * 6 * 6, 4))
    g = torch.Generator().manual_seed(0)
    split = Split(torch.randint(0, 256, (69, 3, 8, 8), generator=g, dtype=torch.uint8), torch.randint(0, 4, (69,), generator=g))
    shift = nn.Parameter(torch.zeros(1, 3, 1, 1))  # trained by the trainer's optimizer
    scale = nn.Parameter(torch.ones(1, 3, 1, 1))  # trained by its own optimizer, like a trigger generator
    side = torch.optim.SGD([scale], lr=0.1)

    def step(model, x, y):
        if scale.grad is not None:  # the previous batch's gradient, as Input-aware's generator step
            distributed.average_gradients([scale])
            side.step()
            side.zero_grad(set_to_none=True)
        return cross_entropy_step(model, x * scale + shift, y)

    trainer = Trainer(epochs=2, batch_size=16, optimizer=partial(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=5e-4),
                      crop_padding=2, hflip=True, progress=False, device="cpu")
    history = trainer.fit(net, split, generator=torch.Generator().manual_seed(3), step=step, extra_params=[shift],
                          checkpoint=checkpoint)
    return {"state": {k: v.clone() for k, v in net.state_dict().items()}, "shift": shift.detach().clone(),
            "scale": scale.detach().clone(), "history": [{k: v for k, v in r.items() if k != "time_s"} for r in history]}


def attack_fits() -> dict[str, dict]:
    """Each training-controlled attack's victim (and trigger), on 48 tiny 16x16 images."""
    from backdoorbench.attacks.input_aware import InputAware
    from backdoorbench.attacks.lira import LIRA
    from backdoorbench.attacks.wanet import WaNet
    from backdoorbench.attacks.wb import WB

    common = dict(num_classes=4, image_shape=(1, 16, 16), target=0)
    learned = dict(generator_width=2, stage1_epochs=1, generator_lr=1e-2, eps=0.1, test_eps=0.05)
    attacks = {
        "wanet": lambda: WaNet(**common),
        "input_aware": lambda: InputAware(**common, channels=4, depth=2, mask_epochs=1),
        "lira": lambda: LIRA(**common, **learned, lookahead=False),
        "lira_lookahead": lambda: LIRA(**common, **learned, lookahead=True),
        "wb": lambda: WB(**common, **learned, lookahead=False),
    }
    g = torch.Generator().manual_seed(1)
    split = Split(torch.randint(0, 256, (48, 1, 16, 16), generator=g, dtype=torch.uint8), torch.arange(48) % 4)
    out = {}
    for name, make in attacks.items():
        torch.manual_seed(0)
        attack = make()
        model = Normalized(MnistCNN(in_channels=1, num_classes=4, image_size=16, hidden=16), (0.5,), (0.25,))
        trainer = Trainer(epochs=1, batch_size=16, optimizer=partial(torch.optim.SGD, lr=0.05, momentum=0.9),
                          device="cpu", progress=False)
        attack.prepare(trainer=trainer, train=split, generator=torch.Generator().manual_seed(2),
                       build_model=lambda **kw: None)
        attack.train_victim(trainer, model, split, torch.Generator().manual_seed(3))
        tensors = [*model.state_dict().values(), *(v for v in _flat(attack.state_dict()))]
        out[name] = {"fingerprint": torch.stack([t.double().sum() for t in tensors if t.is_floating_point()]),
                     "triggered": attack.apply_trigger(split.images[:4].float() / 255).sum().item()}
    return out


def _flat(state):
    if isinstance(state, dict):
        for value in state.values():
            yield from _flat(value)
    elif isinstance(state, torch.Tensor):
        yield state


def main(out: Path) -> None:
    torch.set_num_threads(1)
    plain = plain_fit(checkpoint=out / "ckpt" / "plain.pt")  # its Trainer joins the process group
    result = {"world_size": distributed.world_size(), "plain": plain}
    try:  # 3 images per batch cannot give each of 2 processes two
        Trainer(epochs=1, batch_size=3, progress=False).fit(nn.Linear(4, 2), Split(torch.zeros(8, 1, 2, 2, dtype=torch.uint8),
                                                                                  torch.zeros(8, dtype=torch.long)),
                                                           generator=torch.Generator())
        result["small_batch_error"] = None
    except ConfigError as exc:
        result["small_batch_error"] = str(exc)
    attacks = attack_fits()
    gathered = [None] * distributed.world_size()
    dist.all_gather_object(gathered, {name: a["fingerprint"] for name, a in attacks.items()})
    result["attacks_agree"] = {name: all(torch.equal(g[name], gathered[0][name]) for g in gathered) for name in attacks}
    if distributed.is_main():
        torch.save(result, out / "result.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
