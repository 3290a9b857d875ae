"""Runs a defense of any stage and scores what it returns, the same way for every defense."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from backdoorbench.attacks.base import Attack
from backdoorbench.datasets.base import Split, to_float
from backdoorbench.defenses.base import Defense, DefenseContext, DefenseResult, InputDefense
from backdoorbench.errors import ConfigError
from backdoorbench.metrics.accuracy import evaluate
from backdoorbench.metrics.cost import PassCounter, cost_summary, forward_flops_per_image
from backdoorbench.metrics.detection import auroc, detection_rates
from backdoorbench.run_keys import DETECTION_FLAGGED, DETECTION_SCORES, DETECTION_THRESHOLD, DETECTION_TRUTH

# Why a detection-only run (`eval.detection_only`, `ctx.detection_only`) has no defended CA/ASR.
DETECTION_ONLY_REASON = ("detection only (eval.detection_only=true): the detector scored and flagged, "
                         "nothing was retrained or rejected, so there is no defended model to measure")


@dataclass
class DefenseOutcome:
    defended: dict[str, float] | None  # CA, ASR, RA of the defended system; None in a detection-only run
    detection: dict[str, Any] | None  # TPR, FPR, AUROC, F1 where the defense detects
    extras: dict[str, Any]
    model: nn.Module | None = None  # the repaired / retrained model, when the defense makes one
    artifacts: dict[str, Any] = field(default_factory=dict)  # arrays for figures, saved beside the record
    cost: dict[str, Any] | None = None  # the record's defense_cost: see metrics/cost.py


def run_defense(defense: Defense, ctx: DefenseContext, attack: Attack, test: Split) -> DefenseOutcome:
    """Apply `defense` to `ctx` and measure the defended model (or detector) on `test`.
    The defense's compute is counted (`outcome.cost`): `apply`, and the retraining on the kept
    data of a pre-training detector; not the scoring on the test set, except an input detector's
    own passes per test input (`per_input_forward_images`), its price at inference.
    With `ctx.detection_only` a detector is scored and nothing else: no retraining, no defended
    model, `outcome.defended` None (a ConfigError for a defense that does not detect)."""
    if ctx.detection_only and not defense.is_detector():
        raise ConfigError(f"eval.detection_only=true needs a defense that detects; {defense.name} "
                          f"({defense.stage.replace('_', '-')}) returns no detection")
    counter = PassCounter()
    counter.watch(ctx.model)
    with ctx.trainer.autocast():  # every forward of the defense stage in the run's precision
        flops = forward_flops_per_image(ctx.model, tuple(test.images.shape[1:]))
    if ctx.build_model is not None:
        build = ctx.build_model
        ctx = dataclasses.replace(ctx, build_model=lambda **kwargs: counter.watch(build(**kwargs)))
    # The defense runs, and is scored, in the run's precision (`trainer.autocast()`), the one the
    # victim was trained and its CA measured in.
    with counter.counting(), ctx.trainer.autocast():
        result = defense.apply(ctx)
    outcome = _score(defense, result, ctx, attack, test, counter)
    outcome.cost = {**cost_summary(counter, len(ctx.poisoned_train), flops), **(outcome.cost or {})}

    def measure(model: nn.Module) -> dict[str, float]:
        return evaluate(model, ctx.trainer, attack, test)

    outcome.artifacts = {**result.artifacts, **outcome.artifacts, **defense.test_artifacts(ctx, result, measure)}
    return outcome


def _score(defense: Defense, result: DefenseResult, ctx: DefenseContext, attack: Attack, test: Split,
           counter: PassCounter | None = None) -> DefenseOutcome:
    counter = counter or PassCounter()
    extras = dict(result.extras)
    trainer = ctx.trainer
    if defense.stage in ("post_train", "in_train"):
        detection, artifacts = None, {}
        if defense.stage == "in_train" and (result.sample_scores is not None or defense.detects):
            detection, artifacts = _score_samples(defense, result, ctx)  # e.g. ABL's isolation
        if ctx.detection_only:
            return DefenseOutcome(None, detection, extras, artifacts=artifacts)
        if result.model is None:
            raise RuntimeError(f"defense {defense.name} ({defense.stage}) returned no model")
        return DefenseOutcome(evaluate(result.model, trainer, attack, test), detection, extras, result.model,
                              artifacts=artifacts)

    if defense.stage == "pre_train":
        detection, artifacts = _score_samples(defense, result, ctx)
        if ctx.detection_only:  # the retraining on the kept samples, the expensive part, is skipped
            return DefenseOutcome(None, detection, extras, artifacts=artifacts)
        kept = torch.nonzero(~result.flagged.bool().cpu()).flatten()
        if len(kept) == 0:
            raise ConfigError(f"defense {defense.name} flagged every training sample; nothing is left to retrain on")
        with counter.counting():
            model = ctx.build_model()
            ctx.train_victim(counter.watch(model), train=ctx.poisoned_train.subset(kept))
        extras["n_kept"] = int(len(kept))
        return DefenseOutcome(evaluate(model, trainer, attack, test), detection, extras, model, artifacts=artifacts)

    if defense.stage == "input":
        assert isinstance(defense, InputDefense)
        outcome = _score_input_defense(defense, ctx.model, trainer, attack, test, extras, counter)
        if ctx.detection_only:  # the rejections are scored as a detection, not applied to the predictions
            outcome.defended = None
        return outcome
    raise ConfigError(f"defense {defense.name!r} has unknown stage {defense.stage!r}")


def _score_samples(defense: Defense, result: DefenseResult,
                   ctx: DefenseContext) -> tuple[dict[str, Any], dict[str, Any]]:
    """The detection of a dataset-level detector (TPR, FPR, F1 at its flags, AUROC of its scores,
    against the true poisoned indices) and its per-sample arrays for the artifacts."""
    n = len(ctx.poisoned_train)
    if result.sample_scores is None or result.flagged is None:
        raise RuntimeError(f"defense {defense.name} ({defense.stage}) must return sample_scores and flagged")
    scores, flagged = result.sample_scores.detach().float().flatten().cpu(), result.flagged.bool().flatten().cpu()
    if len(scores) != n or len(flagged) != n:
        raise RuntimeError(f"defense {defense.name} returned {len(scores)} sample_scores and {len(flagged)} flags "
                           f"for {n} training samples; give one of each per sample")
    is_poisoned = torch.zeros(n, dtype=torch.bool)
    is_poisoned[ctx.poisoned_indices] = True
    detection = {**detection_rates(flagged, is_poisoned), "auroc": auroc(scores, is_poisoned),
                 "n_flagged": int(flagged.sum())}
    return detection, {DETECTION_SCORES: scores, DETECTION_TRUTH: is_poisoned, DETECTION_FLAGGED: flagged}


@torch.no_grad()
def _score_input_defense(
    defense: InputDefense, model: nn.Module, trainer, attack: Attack, test: Split, extras: dict[str, Any],
    counter: PassCounter | None = None,
) -> DefenseOutcome:
    """Rejected inputs count as neither correct nor attacked: CA after = accepted and correct,
    ASR after = accepted and sent to the target, RA after = accepted and correct."""
    device = trainer.device
    model = trainer.prepare(model).eval()
    attackable = attack.target_rule(test.labels) != test.labels
    scoring = PassCounter()  # the detector's own passes, apart from the predictions it guards
    PassCounter.watch(model)

    def scores_and_predictions(images: torch.Tensor, triggered: bool):
        scores, predictions = [], []
        for start in range(0, len(images), trainer.eval_batch_size):
            x = to_float(images[start : start + trainer.eval_batch_size].to(device))
            if triggered:
                x = attack.apply_trigger(x)
            with scoring.counting():
                scores.append(defense.score_inputs(model, x).float().cpu())
            predictions.append(model(x).argmax(1).cpu())
        return torch.cat(scores), torch.cat(predictions)

    with trainer.autocast():  # the precision of the CA these scores are compared with
        clean_scores, clean_pred = scores_and_predictions(test.images, triggered=False)
        bad_scores, bad_pred = scores_and_predictions(test.images[attackable], triggered=True)
    labels = test.labels[attackable]
    targets = attack.target_rule(labels)
    clean_ok = clean_scores <= defense.threshold
    bad_ok = bad_scores <= defense.threshold
    is_bad = torch.cat([torch.zeros(len(clean_scores), dtype=torch.bool), torch.ones(len(bad_scores), dtype=torch.bool)])
    all_scores = torch.cat([clean_scores, bad_scores])
    detection = {
        **detection_rates(all_scores > defense.threshold, is_bad),
        "auroc": auroc(all_scores, is_bad),
        "threshold": float(defense.threshold),
    }
    defended = {
        "clean_acc": int(((clean_pred == test.labels) & clean_ok).sum()) / len(test.labels),
        "asr": int(((bad_pred == targets) & bad_ok).sum()) / len(labels),
        "ra": int(((bad_pred == labels) & bad_ok).sum()) / len(labels),
    }
    scored = len(clean_scores) + len(bad_scores)
    cost = {"per_input_forward_images": scoring.forward_images / scored if scored else None}
    artifacts = {DETECTION_SCORES: all_scores, DETECTION_TRUTH: is_bad,
                 DETECTION_FLAGGED: all_scores > defense.threshold,
                 DETECTION_THRESHOLD: torch.tensor(float(defense.threshold)),
                 **defense.score_artifacts(clean_scores, bad_scores)}
    return DefenseOutcome(defended, detection, extras, artifacts=artifacts, cost=cost)


def benign_false_positives(defense: Defense, outcome: DefenseOutcome, n_train: int) -> dict[str, Any] | None:
    """What a detector flags when there is nothing to find: run on a clean
    victim (attack=none), every flag is a false positive. `false_positive` in [0, 1] is
    - pre-training detectors (Spectral, AC): the share of the clean training set removed; an
      in-training one (ABL): the share it isolated;
    - input detectors (STRIP): the share of clean test inputs rejected at the calibrated threshold;
    - class detectors (Neural Cleanse, whose extras name the `flagged` classes): 1 if any class is
      flagged on the clean model, else 0, with the classes.
    None for a defense that only repairs (it flags nothing to be wrong about). A share that has no
    denominator (an empty training set) is null with the `reason`, never a 0 that reads as "flagged none"."""
    detection = outcome.detection or {}
    if defense.stage in ("pre_train", "in_train") and "n_flagged" in detection:
        measure = f"share of the clean training set {'removed' if defense.stage == 'pre_train' else 'isolated'}"
        if not n_train:
            return {"measure": measure, "false_positive": None,
                    "reason": "the training set is empty: there is no share to measure",
                    "n_flagged": int(detection["n_flagged"])}
        return {"measure": measure, "false_positive": detection["n_flagged"] / n_train,
                "n_flagged": int(detection["n_flagged"])}
    if defense.stage == "input" and detection.get("fpr") is not None:
        return {"measure": "share of clean test inputs rejected", "false_positive": float(detection["fpr"])}
    flagged = outcome.extras.get("flagged")
    if isinstance(flagged, list):
        return {"measure": "any class flagged on a clean model", "false_positive": float(bool(flagged)),
                "flagged_classes": [int(c) for c in flagged]}
    return None
