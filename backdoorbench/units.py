"""Converting a value given in an official code's input normalisation into our pixel units.

Our images enter attacks as [0, 1] pixels (docs/architecture.md): every eps, strength and step is in those
units. An official code that normalises its inputs, x_n = (x - mean) / std, states its values in
x_n's units, so a perturbation of size v there is v * std in pixels. Each source normalises in its
own way, recorded here with where it does so; presets convert with `to_pixels`, and
tests/test_units.py checks every converted preset value against the official one.
"""

from __future__ import annotations

# The normalisation each official code applies before its eps is added: dataset -> per-channel std
# (None: the code feeds [0, 1] pixels, so its values are already pixels).
# LIRA, the authors' latest code (the presets' default, paper=lira/<dataset>):
# khoadoan106/backdoor_attacks@bc6e2629ce640885139303f0dad84d078d074919:python/utils/dataloader.py:52-55
# (get_transform: MNIST Normalize([0.5], [0.5]) = [-1, 1]; every other dataset, CIFAR-10, GTSRB and
# Tiny-ImageNet, ImageNet's mean/std). The noise is added after that transform
# (python/lira_trigger_generation.py:240-241: `noise = tgtmodel(data) * args.eps; atkdata = clip_image(data + noise)`).
LIRA_STD: dict[str, tuple[float, ...] | None] = {
    "mnist": (0.5,),
    "cifar10": (0.229, 0.224, 0.225),
    "gtsrb": (0.229, 0.224, 0.225),
    "tiny_imagenet": (0.229, 0.224, 0.225),
}
# LIRA's first release, sunbelbd/invisible_backdoor_attacks (PyTorch @202b4cb575e513450016e24edd9d9ab40b2a8cd0:
# pytorch/utils/dataloader.py:47-56, the same at @07f38cd77094e0e857f8b510b0ca382bd1027803:python/utils/dataloader.py;
# PaddlePaddle @f292e739dcd38a4a767a94a5acf21fd77643f4ab:paddle/utils/dataloader.py:43-50): MNIST [-1, 1];
# CIFAR-10 its own mean/std; GTSRB none; Tiny-ImageNet ImageNet's. The presets paper=lira/cifar10_first_release
# and lira/cifar10_paddle convert those commands' values with it.
LIRA_SUNBELBD_STD: dict[str, tuple[float, ...] | None] = {
    "mnist": (0.5,),
    "cifar10": (0.247, 0.243, 0.261),
    "gtsrb": None,
    "tiny_imagenet": (0.229, 0.224, 0.225),
}
# Input-aware: VinAIResearch/input-aware-backdoor-attack-release@1750e4ff0cc2371b243f1fd0ee18971f7e49fe78:dataloader.py
# (get_transform: CIFAR-10 its mean/std, MNIST Normalize([0.5], [0.5]), GTSRB none); its diversity loss
# (train.py `criterion_div`) measures distances between those normalised images. mnist5k holds MNIST
# images; Tiny-ImageNet is not in that code: we ASSUME ImageNet's std, as LIRA's code (above) uses for it.
INPUT_AWARE_STD: dict[str, tuple[float, ...] | None] = {
    "mnist": (0.5,),
    "mnist5k": (0.5,),
    "cifar10": (0.247, 0.243, 0.261),
    "gtsrb": None,
    "tiny_imagenet": (0.229, 0.224, 0.225),
}
SOURCES: dict[str, dict[str, tuple[float, ...] | None]] = {
    "lira": LIRA_STD, "lira_sunbelbd": LIRA_SUNBELBD_STD, "input_aware": INPUT_AWARE_STD}


def to_pixels(value: float, std: tuple[float, ...] | None) -> float:
    """`value` in a normalised input space (x - mean) / std as [0, 1] pixel units.

    Our eps is one number for all channels; a per-channel std gives a per-channel pixel bound
    value * std_c, and we take their mean (for CIFAR-10's stds the channels then differ from it
    by at most 4%)."""
    if std is None:
        return float(value)
    return float(value) * sum(std) / len(std)


def source_to_pixels(source: str, dataset: str, value: float) -> float:
    """`value` as the official code of `source` states it for `dataset`, in our pixel units."""
    try:
        std = SOURCES[source][dataset]
    except KeyError:
        raise KeyError(f"no recorded input normalisation for source {source!r} on dataset {dataset!r}") from None
    return to_pixels(value, std)
