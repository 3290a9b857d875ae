"""AGPD: the gradients of each training sample's label logit with respect to conv activations,
compared by their angles with a class's clean reference gradient; the class whose angles disperse
most is the target, and its samples are taken in, nearest the poison first, until the taking
settles (pre-training detection)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from scipy.spatial.distance import jensenshannon
from torch import Tensor, nn

from backdoorbench import checks
from backdoorbench.datasets.base import Split, to_float
from backdoorbench.defenses.base import Defense, DefenseContext, DefenseResult
from backdoorbench.errors import ConfigError

MAD_NORMAL = 1.4826  # the anomaly index's consistency constant (the official `mad`)
FALLBACK_LAYERS = slice(-4, -1)  # the official fallback reads the 4th, 3rd and 2nd last candidate layers
JS_BINS = np.linspace(0, 1, 100)  # the official histogram of closeness rates (`np.linspace(0, 1, 100)`)
WINDOW_STD_WEIGHT = 5.0  # a window's score: mean + 5 std of its JS values (the official)


def candidate_layers(model: nn.Module) -> list[tuple[str, nn.Conv2d]]:
    """The conv layers whose activation gradients AGPD reads, in registration order: every nn.Conv2d
    with a kernel larger than 1 x 1; in a network with 1 x 1 convs (a ResNet's shortcuts) its first
    conv, the stem, is left out too. A (PreAct-)ResNet-18 gives its 16 block convs, a VGG all its
    convs: the official lists for those."""
    convs = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    wide = [(name, m) for name, m in convs if tuple(m.kernel_size) != (1, 1)]
    if len(wide) > 1 and len(wide) < len(convs):
        wide = wide[1:]
    return wide


def activation_gradients(model: nn.Module, layers: list[nn.Module], images: Tensor, labels: Tensor,
                         device: torch.device | str, batch_size: int) -> list[np.ndarray]:
    """Per layer, (N, C) float32: the gradient of each sample's logit at its label with respect to the
    layer's output, averaged over the spatial positions (the official `get_all_gradient` with
    `cross_entropy=False`). One forward and backward pass serves every layer; in eval mode the samples
    of a batch do not interact, so the gradient of the batch's summed logits is each sample's own."""
    taps: list[Tensor] = []

    def keep(_module, _inputs, output):
        taps.append(output)
        return output.clone()  # a later in-place op (a residual `out += shortcut`) changes the clone only

    handles = [layer.register_forward_hook(keep) for layer in layers]
    was_training = model.training
    model.eval()
    out: list[list[np.ndarray]] = [[] for _ in layers]
    try:
        for s in range(0, len(images), batch_size):
            taps.clear()
            x = to_float(images[s:s + batch_size].to(device)).requires_grad_(True)
            y = labels[s:s + batch_size].to(device)
            logits = model(x)
            grads = torch.autograd.grad(logits.gather(1, y[:, None]).sum(), taps)
            for i, g in enumerate(grads):
                out[i].append(g.mean((2, 3)).float().cpu().numpy())
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    return [np.concatenate(chunks) if chunks else np.zeros((0, 0), np.float32) for chunks in out]


def cosine(rows: np.ndarray, vector: np.ndarray) -> np.ndarray:
    """Cosine similarity of each row with `vector` (0 where either is zero; the official's scipy
    `pdist` gives nan there)."""
    norms = np.linalg.norm(rows, axis=1) * np.linalg.norm(vector)
    dots = rows @ vector
    sim = np.divide(dots, norms, out=np.zeros_like(dots, dtype=np.float64), where=norms > 0)
    return np.clip(sim, -1.0, 1.0)  # rounding must not carry a rate outside the histogram's [0, 1]


def basic_sample(grads: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """The indices of the sample(s) least similar to the clean reference (ties all kept): the second
    vector of the basic pair (the official `get_unsimilar_sample_idx(..., 1)`)."""
    sim = cosine(grads, reference)
    return np.flatnonzero(sim == sim.min())


def dispersion(grads: np.ndarray, reference: np.ndarray) -> float:
    """A class's GCD dispersion: over the samples other than the basic sample b,
    || cos(g, ref) - cos(g, g_b) ||_2 / sqrt(n) (the official `compute_change` / sqrt(len)). The
    gradients of a clean class sit near its reference, far from its odd one out, alike; a target
    class's poisoned half sits near the basic sample (a poisoned one) and its clean half near the
    reference, so the differences spread."""
    if len(grads) < 2:
        return 0.0
    seed = basic_sample(grads, reference)
    rest = np.setdiff1d(np.arange(len(grads)), seed)
    diff = cosine(grads[rest], reference) - cosine(grads[rest], grads[seed].mean(0))
    return float(np.linalg.norm(diff) / math.sqrt(len(grads)))


def anomaly_index(gaps: np.ndarray) -> np.ndarray:
    """The official one-sided J*: (J - median) / 1.4826 / (MAD + 1e-6), 0 below the median."""
    gaps = np.asarray(gaps, dtype=np.float64)
    median = np.median(gaps)
    index = np.abs(gaps - median) / MAD_NORMAL / (np.median(np.abs(gaps - median)) + 1e-6)
    index[gaps - median < 0] = 0.0
    return index


def closeness_rates(grads: np.ndarray, poison_mean: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """d_p / (d_p + d_c), the cosine distances to the poison set's mean gradient and to the clean
    reference: near 0 = close to the poison (the official `rate`)."""
    d_p = 1 - cosine(grads, poison_mean)
    d_c = 1 - cosine(grads, reference)
    total = d_p + d_c
    return np.divide(d_p, total, out=np.full_like(total, 0.5), where=total > 0)


def js_divergence(before: np.ndarray, after: np.ndarray) -> float:
    """The Jensen-Shannon distance (scipy's, base e) between the 100-bin histograms of two rate sets;
    1 when either is empty (the official)."""
    if len(before) == 0 or len(after) == 0:
        return 1.0
    p, _ = np.histogram(before, bins=JS_BINS, density=True)
    q, _ = np.histogram(after, bins=JS_BINS, density=True)
    value = float(jensenshannon(p, q))
    return value if math.isfinite(value) else 1.0


@dataclass
class Absorption:
    rounds: np.ndarray  # per sample of the class, the round that took it in (the basic sample: 0)
    js: list[float] = field(default_factory=list)  # JS between successive rounds' rate histograms
    nearness: np.ndarray | None = None  # per sample, its normalised rate in the round that took it (0 = nearest)


def absorb(grads: np.ndarray, reference: np.ndarray, tau: float) -> Absorption:
    """The official filtering loop (`stage1_new`): from the basic sample, every round takes in the
    remaining samples whose closeness rate to the taken set's mean, min-max normalised over the
    remaining, is at most tau, until none remains; the JS distance between the rate histograms of the
    remaining samples before and after each round is recorded."""
    n = len(grads)
    rounds = np.full(n, -1)
    nearness = np.zeros(n)
    taken = np.zeros(n, dtype=bool)
    seed = basic_sample(grads, reference)
    taken[seed], rounds[seed] = True, 0
    before = closeness_rates(grads[~taken], grads[taken].mean(0), reference)
    result = Absorption(rounds, nearness=nearness)
    step = 0
    while not taken.all():
        step += 1
        remaining = np.flatnonzero(~taken)
        rates = closeness_rates(grads[remaining], grads[taken].mean(0), reference)
        spread = rates.max() - rates.min()
        if spread > 0:
            norm = (rates - rates.min()) / spread
            take = norm <= tau
        else:  # all alike: the official takes them all (a rate above tau) or those at most tau (all)
            norm = np.zeros_like(rates)
            take = np.ones(len(rates), dtype=bool) if rates.min() > tau else rates <= tau
        taken[remaining[take]] = True
        rounds[remaining[take]] = step
        nearness[remaining[take]] = norm[take]
        after = rates[~take]
        result.js.append(js_divergence(before, after))
        before = after
    return result


def window_start(js: list[float], window: int) -> int:
    """The start of the `window` successive JS values with the smallest mean + 5 std (first on ties):
    the taking has settled there, so the rounds before it took the poison (the official
    `find_small_and_smooth_window_start`). Fewer values than `window`: one window over all (start 0)."""
    width = min(window, len(js))
    if width == 0:
        return 0
    values = np.asarray(js, dtype=np.float64)
    scores = [values[s:s + width].mean() + WINDOW_STD_WEIGHT * values[s:s + width].std()
              for s in range(len(values) - width + 1)]
    return int(np.argmin(scores))


def choose_targets(gaps: np.ndarray, indices: np.ndarray, anomaly_threshold: float,
                   fallback_gap: float) -> tuple[int | None, list[int]]:
    """(layer, target classes) from the (layers, classes) dispersions and anomaly indices: the layer
    with the largest index when it reaches e^2, its classes above e^2; else, among the 4th to 2nd last
    layers, the one with the most classes of dispersion above 0.3 (none: no target, a clean model)."""
    best = indices.max(1)
    if best.max() >= anomaly_threshold:
        layer = int(np.argmax(best))
        return layer, [int(c) for c in np.flatnonzero(indices[layer] > anomaly_threshold)]
    positions = list(range(len(gaps)))[FALLBACK_LAYERS]
    counts = [int((gaps[p] > fallback_gap).sum()) for p in positions]
    if not counts or sum(counts) == 0:
        return None, []
    layer = positions[int(np.argmax(counts))]
    return layer, [int(c) for c in np.flatnonzero(gaps[layer] > fallback_gap)]


def clean_references(model: nn.Module, layers: list[nn.Module], clean: Split, num_classes: int, per_class: int,
                     generator: torch.Generator, device, batch_size: int) -> tuple[list[np.ndarray], list[bool]]:
    """Per layer, a (classes, C) array of the mean activation gradient of up to `per_class` clean
    samples per class that the model classifies correctly (drawn with `generator`; all of them where
    fewer), and which classes have one (the official `test_clean_samples`)."""
    with torch.no_grad():
        model.eval()
        preds = torch.cat([model(to_float(clean.images[s:s + batch_size].to(device))).argmax(1).cpu()
                           for s in range(0, len(clean.images), batch_size)]) if len(clean.images) else torch.zeros(0)
    chosen, has = [], []
    for cls in range(num_classes):
        right = torch.nonzero((clean.labels == cls) & (preds == cls)).flatten()
        pick = right[torch.randperm(len(right), generator=generator)[:per_class]].sort().values
        chosen.append(pick)
        has.append(len(pick) > 0)
    every = torch.cat(chosen)
    grads = activation_gradients(model, layers, clean.images[every], clean.labels[every], device, batch_size)
    refs = []
    for g in grads:
        per = np.zeros((num_classes, g.shape[1]), dtype=np.float64)
        start = 0
        for cls, pick in enumerate(chosen):
            if len(pick):
                per[cls] = g[start:start + len(pick)].astype(np.float64).mean(0)
            start += len(pick)
        refs.append(per)
    return refs, has


class AGPD(Defense):
    """AGPD (Yuan, Zhang, Wei, Liu, Wu, "Activation Gradient based Poisoned Sample Detection Against
    Backdoor Attacks", ICLR 2025; arXiv 2312.06230), as BackdoorBench's `detection_pretrain/agpd.py`,
    the authors' code.

    For every training sample and candidate conv layer, the gradient of its logit at its (possibly
    poisoned) label with respect to the layer's output, averaged over positions. A class's clean
    reference is the mean of that gradient over 10 correctly classified clean samples of the class.
    Its gradient circular distribution (GCD) is the angles of its samples' gradients against the
    basic pair (the reference and the sample least like it); the backdoored model maps poisoned and
    clean samples of the target class to similar activations by different routes, so there the angles
    disperse. Dispersion: || cos(g, ref) - cos(g, g_b) || / sqrt(n); per layer a one-sided MAD anomaly
    index over classes; the layer with the largest index, if it reaches e^2, gives the targets (its
    classes above e^2), else the 4th to 2nd last layers' classes of dispersion above 0.3 do. Within a
    target class, from the basic sample, each round takes in the samples whose closeness rate
    d_p / (d_p + d_c) to the taken set's mean gradient, min-max normalised, is at most tau; the
    Jensen-Shannon distance between the rate histograms of successive rounds settles once the poison
    is in: the rounds before the 10-round window of smallest mean + 5 std are flagged.
    Ledger: docs/fidelity.md#agpd.

    Score (higher = more suspicious): in a target class, (s - r - nearness / 2) / (R + 1), with r the
    round that took the sample, s the flagging window's start and R the last round, so score > 0 is
    exactly the verdict and earlier rounds rank higher (within a round, the nearer normalised rate);
    in any other class -2 + (1 - cos(g, ref)) / 2, in [-2, -1], below every target-class sample
    (AGPD believes them clean; the cosine to the class reference orders them).

    Departures: the clean samples come from the defender's clean subset (a share of the training set),
    not the test set; they are drawn once, where the official draws again per layer and for the final
    stage. A class with no correctly classified clean sample has no reference: dispersion 0, never a
    target (the official stops with an error). Fewer than 10 JS values in a target class (the official
    stops with an error): one window over all, which starts at 0, so none of that class is flagged.
    Layers are chosen generically (`candidate_layers`), the official's lists on its models. All layers'
    gradients come from one backward pass (the official runs one per layer: the same values).
    Limit (measured, mnist5k, seed 0): on mnist_cnn's two convs no layer reaches e^2, and in the target
    class the sample least like the clean reference is a clean one, so the rounds take the clean samples
    first: nothing poisoned is flagged against BadNets or Blended (docs/fidelity.md#agpd).
    """

    name = "agpd"
    family = "latent_separation"
    sensitivity = ("tau",)  # swept by conf/experiment/sensitivity_agpd.yaml
    stage = "pre_train"
    needs_clean_data = True
    meets_training_controlled_attacks = False

    def __init__(self, *, tau: float = 0.05, clean_per_class: int = 10, anomaly_threshold: float = math.exp(2),
                 fallback_gap: float = 0.3, window: int = 10, clean_fraction: float = 0.05) -> None:
        super().__init__(clean_fraction=clean_fraction)
        checks.number("defense", "tau", tau, 0, 1, high_open=True,
                      hint="the share of the normalised closeness range taken in per round")
        checks.integer("defense", "clean_per_class", clean_per_class, 1, hint="the official: 10 (clean_sample_num / classes)")
        checks.number("defense", "anomaly_threshold", anomaly_threshold, 0, low_open=True, hint="the official: e^2 = 7.389")
        checks.number("defense", "fallback_gap", fallback_gap, 0, low_open=True, hint="the official: 0.3")
        checks.integer("defense", "window", window, 1, hint="the official JS window: 10")
        self.tau = float(tau)
        self.clean_per_class = int(clean_per_class)
        self.anomaly_threshold = float(anomaly_threshold)
        self.fallback_gap = float(fallback_gap)
        self.window = int(window)

    def check_model(self, model: nn.Module) -> None:
        if not candidate_layers(model):
            raise ConfigError(f"defense=agpd reads activation gradients of conv layers, but "
                              f"{getattr(model, 'name', type(model).__name__)!r} has no nn.Conv2d wider than 1x1; "
                              "choose a convolutional model")

    def apply(self, ctx: DefenseContext) -> DefenseResult:
        device = torch.device(ctx.trainer.device)
        batch = int(ctx.trainer.eval_batch_size)
        model = ctx.model.to(device)
        train = ctx.poisoned_train
        named = candidate_layers(model)
        layers = [m for _, m in named]
        refs, has_ref = clean_references(model, layers, ctx.clean_subset, ctx.num_classes, self.clean_per_class,
                                         ctx.generator, device, batch)
        grads = activation_gradients(model, layers, train.images, train.labels, device, batch)
        labels = train.labels.numpy()
        members = [np.flatnonzero(labels == c) for c in range(ctx.num_classes)]

        gaps = np.zeros((len(layers), ctx.num_classes))
        for li, g in enumerate(grads):
            for cls, idx in enumerate(members):
                if has_ref[cls] and len(idx):
                    gaps[li, cls] = dispersion(g[idx].astype(np.float64), refs[li][cls])
        indices = np.stack([anomaly_index(row) for row in gaps])
        layer, targets = choose_targets(gaps, indices, self.anomaly_threshold, self.fallback_gap)
        scored = layer if layer is not None else int(np.argmax(indices.max(1)))

        scores = torch.zeros(len(labels))
        flagged = torch.zeros(len(labels), dtype=torch.bool)
        g = grads[scored]
        for cls, idx in enumerate(members):
            if len(idx) and cls not in targets:
                sim = cosine(g[idx].astype(np.float64), refs[scored][cls]) if has_ref[cls] else np.ones(len(idx))
                scores[idx] = torch.from_numpy(-2 + (1 - sim) / 2).float()
        starts, last_rounds = {}, {}
        for cls in targets:
            idx = members[cls]
            taken = absorb(g[idx].astype(np.float64), refs[scored][cls], self.tau)
            start = window_start(taken.js, self.window)
            last = int(taken.rounds.max())
            scores[idx] = torch.from_numpy((start - taken.rounds - taken.nearness / 2) / (last + 1)).float()
            flagged[idx[taken.rounds < start]] = True
            starts[str(cls)], last_rounds[str(cls)] = start, last
        extras = {"layer": named[scored][0], "targets": targets, "clean_model": layer is None,
                  "window_start": starts, "rounds": last_rounds,
                  "max_anomaly_index": float(indices.max()),
                  "anomaly_index": {str(c): float(v) for c, v in enumerate(indices[scored])},
                  "dispersion": {str(c): float(v) for c, v in enumerate(gaps[scored])},
                  "unreferenced_classes": [c for c, ok in enumerate(has_ref) if not ok]}
        return DefenseResult(sample_scores=scores, flagged=flagged, extras=extras,
                             artifacts={"agpd_dispersion": gaps, "agpd_anomaly_index": indices})

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "tau": self.tau, "clean_per_class": self.clean_per_class,
                "anomaly_threshold": self.anomaly_threshold, "fallback_gap": self.fallback_gap, "window": self.window}
