"""Does the angular-margin penalty raise PGD accuracy, as Xu, Li, Yang (arXiv 2010.03844) claim?

Trains mnist_cnn on clean mnist5k twice with the toolkit's Trainer and the default trainer
settings (SGD 0.01, momentum 0.9, weight decay 5e-4, cosine, crop padding 2; `--optimizer adam`
for Adam 0.001, closer to the authors' Adam): plainly, and with
the defense's head (BN -> tanh -> bias-free linear) and loss CE + lambda ||W W^T - s^2 G||_F.
Prints clean accuracy and L_inf PGD accuracy (random start, CE ascent; the authors evaluate
MNIST with 100 steps of eps/30, foolbox `rel_stepsize`) at several radii. A CPU-sized run:

    python benchmarks/angular_margin_pgd.py --epochs 10 --steps 20 --rel-step 0.125 --n-test 500
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch
from torch import nn

from backdoorbench.datasets.base import to_float
from backdoorbench.datasets.mnist5k import load_mnist5k
from backdoorbench.defenses.angular_margin import AngularMargin, SimplexHead, head_weight, weight_geometry
from backdoorbench.metrics.robustness import pgd_accuracy
from backdoorbench.models.base import Normalized
from backdoorbench.models.mnist_cnn import MnistCNN
from backdoorbench.train import Trainer, cross_entropy_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd",
                        help="sgd: the toolkit default (momentum 0.9, wd 5e-4); adam: as conf/trainer/optimizer/adam")
    parser.add_argument("--lr", type=float, default=None, help="default 0.01 for sgd, 0.001 for adam")
    parser.add_argument("--eps", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.3])
    parser.add_argument("--steps", type=int, default=100, help="PGD steps (the authors' MNIST evaluation: 100)")
    parser.add_argument("--rel-step", type=float, default=1 / 30, help="PGD step as a fraction of eps (authors: 1/30)")
    parser.add_argument("--n-test", type=int, default=1000, help="test images attacked (of 1,000)")
    parser.add_argument("--penalty-weight", type=float, default=100.0)
    parser.add_argument("--scale", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()

    data = load_mnist5k()
    if args.optimizer == "sgd":
        optimizer = partial(torch.optim.SGD, lr=args.lr or 0.01, momentum=0.9, weight_decay=5e-4)
    else:
        optimizer = partial(torch.optim.Adam, lr=args.lr or 0.001)
    trainer = Trainer(epochs=args.epochs, optimizer=optimizer,
                      crop_padding=data.crop_padding, hflip=data.hflip, progress=False, device=args.device)
    test_x = to_float(data.test.images[: args.n_test])
    test_y = data.test.labels[: args.n_test]
    defense = AngularMargin(penalty_weight=args.penalty_weight, scale=args.scale)
    variants = {
        "plain": ({}, cross_entropy_step),
        "angular_margin": ({"head": SimplexHead, "feature_act": nn.Identity}, defense.wrap_step(cross_entropy_step)),
    }
    print(f"mnist5k, mnist_cnn, {args.epochs} epochs of {args.optimizer}, seed {args.seed}; PGD L_inf {args.steps} steps of {args.rel_step:.3g} eps, "
          f"random start, on {len(test_y)} test images; device {trainer.device}")
    print(f"{'model':<15} {'CA':>7} " + " ".join(f"{'eps=' + format(e, 'g'):>9}" for e in args.eps) + "   notes")
    for name, (kwargs, step) in variants.items():
        torch.manual_seed(args.seed)
        net = MnistCNN(in_channels=1, num_classes=10, image_size=28, **kwargs)
        model = Normalized(net, data.mean, data.std)
        started = time.perf_counter()
        trainer.fit(model, data.train, generator=torch.Generator().manual_seed(args.seed), step=step, desc=name)
        trained_s = time.perf_counter() - started
        clean = pgd_accuracy(model, test_x, test_y, eps=0.0, device=trainer.device)
        robust = [pgd_accuracy(model, test_x, test_y, eps=eps, steps=args.steps, step_size=eps * args.rel_step,
                               generator=torch.Generator().manual_seed(args.seed), device=trainer.device)
                  for eps in args.eps]
        notes = f"train {trained_s:.0f} s, total {time.perf_counter() - started:.0f} s"
        if name == "angular_margin":
            geometry = weight_geometry(head_weight(model), args.scale)
            notes += (f"; penalty {geometry['penalty_final']:.4f}, |w| {geometry['row_norm_mean']:.3f}, "
                      f"max cos {geometry['max_pairwise_cosine']:.3f} (simplex -0.111)")
        print(f"{name:<15} {clean:>7.2%} " + " ".join(f"{r:>9.2%}" for r in robust) + f"   {notes}", flush=True)


if __name__ == "__main__":
    main()
