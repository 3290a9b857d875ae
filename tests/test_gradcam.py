"""GradCAM: shape and range, and that the map lands on the region the prediction depends on."""

import pytest
import torch
from torch import nn

from backdoorbench.metrics.gradcam import gradcam
from backdoorbench.models.base import ImageClassifier, Normalized
from backdoorbench.models.mnist_cnn import MnistCNN
from backdoorbench.models.preact_resnet import PreActResNet18


class PatchDetector(ImageClassifier):
    """Channel 0 answers a checkerboard texture, channel 1 flat brightness; class 1's logit reads
    channel 0 only, so its probability depends only on where a checkerboard is."""

    name = "patch_detector"

    def __init__(self):
        super().__init__()
        conv = nn.Conv2d(1, 2, 2, bias=False)
        with torch.no_grad():
            conv.weight[0, 0] = torch.tensor([[1.0, -1.0], [-1.0, 1.0]])
            conv.weight[1, 0] = torch.full((2, 2), 0.25)
        self.features = nn.Sequential(conv, nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classifier = nn.Linear(2, 2, bias=False)
        with torch.no_grad():
            self.classifier.weight.copy_(torch.tensor([[0.0, 0.0], [5.0, 0.0]]))


def planted(patch_at, distractor_at, size=32, seed=0):
    """Faint noise, a 4x4 checkerboard patch and, elsewhere, a smooth bright blob (brighter than
    the patch on average, with no checkerboard texture)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(2, 1, size, size, generator=g) * 0.05
    r, c = patch_at
    checker = (torch.arange(4).view(-1, 1) + torch.arange(4)) % 2
    x[:, 0, r : r + 4, c : c + 4] = checker.float()
    r, c = distractor_at
    rows, cols = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    x[:, 0] += torch.exp(-((rows - r - 3) ** 2 + (cols - c - 3) ** 2) / (2 * 3.0**2))
    return x.clamp(0, 1)


@pytest.mark.parametrize("patch_at,distractor_at", [((26, 26), (2, 2)), ((2, 3), (20, 18))])
def test_heatmap_concentrates_on_the_region_the_class_depends_on(patch_at, distractor_at):
    model = PatchDetector()
    x = planted(patch_at, distractor_at)
    cam = gradcam(model, x, classes=torch.tensor([1, 1]))
    assert cam.shape == (2, 32, 32) and cam.min() >= 0 and cam.amax() == pytest.approx(1.0)
    r, c = patch_at
    inside = torch.zeros(32, 32, dtype=torch.bool)
    inside[max(r - 1, 0) : r + 5, max(c - 1, 0) : c + 5] = True  # the patch, one pixel of conv/upsampling blur around it
    assert not (cam[:, ~inside] > 0.2).any()  # every hot pixel lies on the patch
    ratio = cam[:, inside].mean(1) / cam[:, ~inside].mean(1)
    assert (ratio > 10).all(), ratio  # the patch is 36 of 1,024 pixels
    # the bright blob, which class 1 ignores, stays dark
    dr, dc = distractor_at
    assert cam[:, dr : dr + 7, dc : dc + 7].max() < 0.1
    # a class whose logit depends on nothing has an all-zero map (not a made-up one)
    assert gradcam(model, x, classes=torch.tensor([0, 0])).abs().max() == 0


@pytest.mark.parametrize("net,shape", [(MnistCNN(), (1, 28, 28)), (PreActResNet18(num_classes=10), (3, 32, 32))])
def test_heatmaps_of_real_models_have_the_image_shape_and_leave_the_model_alone(net, shape):
    torch.manual_seed(0)
    model = Normalized(net, (0.5,) * shape[0], (0.25,) * shape[0]).train()
    x = torch.rand(3, *shape)
    cam = gradcam(model, x)
    assert cam.shape == (3, *shape[1:]) and cam.dtype == torch.float32
    assert cam.min() >= 0 and cam.max() <= 1 and torch.isfinite(cam).all()
    assert model.training  # mode restored
    assert all(p.grad is None for p in model.parameters())  # no gradient left on the weights
