"""The numeric precision of a run's forward passes: chosen once, used by training, evaluation and defenses.

bf16 autocast keeps 8 significant bits, so every convolution's input (and every later layer's
activations) is rounded to about 0.4% of its own magnitude. A trigger whose pixel change is
smaller than that rounding (LIRA and WB at the papers' 0.0025-0.005 px) loses a large part of its
effect on the logits: 66% RMS at 0.005 px on a preact_resnet18 (CIFAR-10 normalisation); running
only the first convolution in fp32 does not help (65%), because the next layer rounds the
activations again (docs/fidelity.md, shared rules, "precision"). So such attacks run in fp32 and
every other attack keeps bf16's speed:

- `trainer.precision=auto` (the default): fp32 on the CPU (no autocast, as always); on CUDA, bf16
  unless the attack declares `min_precision = "fp32"` (LIRA, WB).
- `bf16` or `fp32`: that precision, whatever the attack (bf16 on the CPU uses the CPU's bf16
  autocast: slow, but it shows on a CPU what a GPU run computes).
- `tf32`: fp32 as PyTorch runs it by default, and so as the official code ran: on CUDA, cuDNN's
  convolutions may use TF32 and matmuls stay fp32 (torch.backends.cudnn.allow_tf32 = True,
  torch.backends.cuda.matmul.allow_tf32 = False). The `backdoorbench` protocol's precision. On the
  CPU it is fp32, and records say fp32; for LIRA and WB (min_precision fp32) it is fp32 without TF32.

fp32 on CUDA also switches TF32 off for convolutions and matmuls while it is in force: TF32
rounds their inputs to 11 significant bits, which distorts such a trigger's effect by about 7%.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from backdoorbench.errors import ConfigError

PRECISIONS = ("auto", "bf16", "tf32", "fp32")
# bf16's spacing on [0.5, 1): a bright pixel moves in steps of 1/256, and a trigger of a smaller
# L_inf is rounded away there (and, normalised, in the first convolution's input alike).
BF16_PIXEL_STEP = 2.0 ** -8
ATTACK_PRECISIONS = ("bf16", "fp32")  # what an attack may declare as its min_precision


def resolve_precision(requested: str, device_type: str, min_precision: str = "bf16") -> str:
    """The precision a run computes in: `requested` (trainer.precision) itself, or for `auto` fp32
    on the CPU and `min_precision` (the attack's) on CUDA."""
    if requested not in PRECISIONS:
        raise ConfigError(f"trainer.precision={requested!r} is unknown; choose one of: {', '.join(PRECISIONS)}")
    if min_precision not in ATTACK_PRECISIONS:
        raise ValueError(f"an attack's min_precision must be one of {ATTACK_PRECISIONS}, not {min_precision!r}")
    if requested == "tf32":
        # no TF32 on the CPU (the same numbers as fp32); nor for an attack whose faint trigger TF32's
        # 11-bit inputs would round (LIRA, WB declare min_precision fp32)
        return "tf32" if device_type == "cuda" and min_precision != "fp32" else "fp32"
    if requested != "auto":
        return requested
    return min_precision if device_type == "cuda" else "fp32"


def bf16_warning(attack: str, precision: str, min_precision: str, trigger_linf: float | None) -> str | None:
    """The one line a run logs when bf16 rounds its attack's trigger, else None: a test-time trigger
    bounded below bf16's step at the image's scale (LIRA and WB at the papers' small eps), or an
    attack that declares it needs fp32."""
    if precision != "bf16":
        return None
    if trigger_linf is not None and 0 < trigger_linf < BF16_PIXEL_STEP:
        return (f"trainer.precision=bf16 rounds {attack}'s trigger: its L_inf of {trigger_linf:.4g} px is below bf16's "
                f"step of {BF16_PIXEL_STEP:.4g} px on bright pixels; use trainer.precision=fp32 or tf32 for faithful numbers")
    if min_precision == "fp32":
        return (f"trainer.precision=bf16 rounds {attack}'s faint trigger (it needs fp32); use trainer.precision=auto "
                f"or fp32 for faithful numbers")
    return None


@contextmanager
def precision_context(device_type: str, precision: str) -> Iterator[None]:
    """Forward passes inside run in `precision`: bf16 autocast, or fp32 with autocast off (an
    enclosing autocast too) and, on CUDA, no TF32 (fp32) or TF32 convolutions only (tf32)."""
    if precision == "bf16":
        with torch.autocast(device_type, dtype=torch.bfloat16):
            yield
        return
    if precision not in ("fp32", "tf32"):
        raise ValueError(f"precision must be bf16, tf32 or fp32 once resolved, not {precision!r}")
    with torch.autocast(device_type, enabled=False):
        if device_type != "cuda":
            yield
            return
        saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
        # fp32: no TF32 anywhere; tf32: PyTorch's defaults (TF32 convolutions, fp32 matmuls)
        torch.backends.cudnn.allow_tf32 = precision == "tf32"
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            yield
        finally:
            torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
