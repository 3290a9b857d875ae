"""One run: dataset -> attack -> victim training -> defense -> evaluation -> record.

`run` tells the story; its helpers each have a module: the checks before any data (validation),
create-by-name (factory), the victim from the cache or trained (victim), PGD and its memo
(pgd_memo), the seeded streams and timers of the stages (stages), and where the numbers came
from (provenance).
"""

from __future__ import annotations

import copy
import logging
import time
from contextlib import suppress
from functools import partial
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from backdoorbench import distributed, interrupts
from backdoorbench.artifacts import example_artifacts, write_beside_record
from backdoorbench.attacks.base import Attack
from backdoorbench.config import protocol_name, run_config_hash, victim_overrides, victim_trainer_node
from backdoorbench.datasets.base import ImageDataset
from backdoorbench.defenses.base import Defense, DefenseContext, clean_subset_indices
from backdoorbench.defenses.runner import DETECTION_ONLY_REASON, benign_false_positives, run_defense
from backdoorbench.errors import StorageError
from backdoorbench.factory import build, build_attack, build_model
from backdoorbench.metrics import defense_effectiveness_rating, evaluate
from backdoorbench.metrics.cost import attack_cost_line
from backdoorbench.metrics.reactivation import measure_reactivation
from backdoorbench.metrics.robustness import transfer_accuracy
from backdoorbench.metrics.stealth import stealth_metrics
from backdoorbench.models.base import Normalized
from backdoorbench.pgd_memo import attacked_pgd, measure_pgd, pgd_images
from backdoorbench.precision import bf16_warning
from backdoorbench.provenance import environment, git_commit
from backdoorbench.records import RunRecord, next_repeat, repeat_path, save_record
from backdoorbench.run_facts import run_report
from backdoorbench.stages import stream, timed
from backdoorbench.validation import reactivation_budgets, validate_config
from backdoorbench.victim import exported_training_set, obtain_victim, remove_checkpoints

log = logging.getLogger(__name__)


@torch.no_grad()
def measure_stealth(attack: Attack, data: ImageDataset, eval_cfg: DictConfig, device: torch.device):
    """Stealth metrics of `apply_trigger` on a fixed, seeded set of test images, and a few
    clean/poisoned pairs for the logger's image grid."""
    count = min(eval_cfg.stealth_images, len(data.test))
    if count < 1 or getattr(attack, "triggerless", False):  # attack=none: nothing to measure
        return None, None
    pick = torch.randperm(len(data.test), generator=torch.Generator().manual_seed(eval_cfg.stealth_seed))[:count]
    clean = data.test.subset(pick.sort().values).float_images()
    poisoned = torch.cat([attack.apply_trigger(chunk.to(device)).cpu() for chunk in clean.split(1024)])
    stealth = stealth_metrics(clean, poisoned, lpips=eval_cfg.lpips, device=device)
    # the examples (logger grid, gallery, GradCAM): one test image of each class but the first target
    # in turn, in the seeded order, so the poisoned versions can show the backdoor's effect
    labels = data.test.labels[pick]
    target = getattr(attack, "target", None)
    examples, seen = [], set()
    for position, label in enumerate(labels.tolist()):
        if label != target and label not in seen:
            examples.append(position)
            seen.add(label)
        if len(examples) == 8:
            break
    for position in range(len(labels)):  # too few classes among the picks: fill up to 8 in order
        if len(examples) >= min(8, count):
            break
        if position not in examples:
            examples.append(position)
    rank = torch.argsort(pick.sort().indices)  # position in `pick` -> row of the sorted `clean`
    rows = rank[torch.tensor(examples, dtype=torch.long)] if examples else torch.arange(min(8, count))
    return stealth, torch.cat([clean[rows], poisoned[rows]])


@dataclass
class DefenseStage:
    """The defense's part of the record, and what the reactivation stage needs of it."""

    info: dict[str, Any]  # the record's `defense` block
    defended: dict[str, Any] | None = None  # CA/ASR/RA (and PGD) of what the defense returned
    defended_reason: str | None = None  # why `defended` is None although the defense ran (detection only)
    der: float | None = None
    detection: dict[str, Any] | None = None  # TPR/FPR/F1/AUROC of a detector
    benign: dict[str, Any] | None = None  # attack=none: what a detector flags is a false positive
    cost: dict[str, Any] | None = None
    repaired: Normalized | None = None  # the model the defense returned, if any
    victim_attack: Attack | None = None  # the attack as the victim was trained, when the defense retrains its trigger


def defend(cfg: DictConfig, defense: Defense | None, excluded: str | None, attack: Attack, data: ImageDataset, trainer,
           model: Normalized, poisoned, attacked: dict[str, Any], adversarial: dict, artifacts: dict[str, Any],
           timings: dict[str, float], exported=None) -> DefenseStage:
    """The defense on the attacked model, scored here as every defense is (CA/ASR/RA, DER, detection,
    PGD), or, where the threat models exclude the pair (`excluded`), not run at all. The defense's
    artifacts join `artifacts`. `exported`: the poisoned set a training-controlled attack handed
    over (victim.exported_training_set), given to a split-only defense in place of the clean split,
    and retrained on with the plain trainer, as a defender given a dataset would."""
    if defense is None:
        return DefenseStage(info={"name": "none"})
    if excluded is not None:  # decided before any defense work: nothing is run
        log.info("defense %s does not apply to %s: %s", defense.name, attack.name, excluded)
        return DefenseStage(info={**defense.describe(), "applicable": False, "not_applicable": excluded})
    seed = cfg.seed
    given = poisoned if exported is None else exported  # the training set the defender holds
    altered = torch.cat([given.indices, given.cover])
    if defense.needs_clean_data or defense.clean_fraction > 0:
        subset = clean_subset_indices(len(data.train), altered, defense.clean_fraction, stream(seed, "clean_subset"))
    else:  # data-free defenses (CLP) run with no clean sample at all
        subset = torch.zeros(0, dtype=torch.long)
    # on an exported set the poison is in the data: retraining is the plain trainer's, not the attacker's step
    retrain = attack.train_victim if exported is None else partial(Attack.train_victim, attack)

    def train_victim(net, wrap_step=None, train=None):
        retrain(trainer, net, given.split if train is None else train, stream(seed, "defense_train"), wrap_step=wrap_step)

    ctx = DefenseContext(
        model=model,
        poisoned_train=given.split,
        poisoned_indices=given.indices,
        clean_subset=given.split.subset(subset),
        trainer=trainer,
        num_classes=data.num_classes,
        generator=stream(seed, "defense"),
        build_model=lambda **kwargs: build_model(cfg, data, **kwargs),
        train_victim=train_victim,
        detection_only=bool(cfg.eval.detection_only),
    )
    # an in-training defense retrains the attack's learned trigger (Input-aware, LIRA, WB) with its
    # model: the reactivation stage retunes the victim with the trigger the victim was trained with
    victim_attack = copy.deepcopy(attack) if cfg.eval.reactivation.enabled and defense.stage == "in_train" else None
    with timed(timings, "defense"):
        outcome = run_defense(defense, ctx, attack, data.test)
    defended = outcome.defended
    artifacts.update(outcome.artifacts)
    if cfg.eval.pgd.enabled and outcome.model is not None:
        with timed(timings, "pgd_defended"):
            pgd_metrics, _ = measure_pgd(outcome.model, data, cfg.eval.pgd, trainer.device)
            if adversarial:  # transfer: the attacked model's adversarial images, on the defended model
                images, labels = pgd_images(data, cfg.eval.pgd)
                pgd_metrics["pgd"] += transfer_accuracy(outcome.model, images, labels, adversarial, source="attacked",
                                                        device=trainer.device)
            defended.update(pgd_metrics)
    benign = None
    if getattr(attack, "triggerless", False):  # attack=none: whatever a detector flags is a false positive
        benign = benign_false_positives(defense, outcome, len(poisoned.split))
        if benign is not None and defended is not None:
            benign["ca_drop"] = attacked["clean_acc"] - defended["clean_acc"]
    info = {**defense.describe(), "applicable": True, "clean_subset_size": int(len(subset)), "extras": outcome.extras}
    if ctx.detection_only:
        info["detection_only"] = True
    if exported is not None:
        info["exported_set"] = {"n_poisoned": int(len(exported.indices)), "n_cover": int(len(exported.cover)),
                                "poisoned_indices_sha256": exported.indices_sha256}
    der = defense_effectiveness_rating(attacked, defended) if defended is not None else None
    reason = None if defended is not None else DETECTION_ONLY_REASON
    return DefenseStage(info=info, defended=defended, defended_reason=reason, der=der, detection=outcome.detection,
                        benign=benign, cost=outcome.cost, repaired=outcome.model, victim_attack=victim_attack)


def run(cfg: DictConfig, overrides: list[str] | None = None) -> tuple[RunRecord, Path | None]:
    """Run one resolved config end to end; return the record and the path it was written to.
    Under torchrun every process runs it, and only rank 0 writes (the others get path None)."""
    validate_config(cfg)
    git_commit()  # read now: the commit this process's code came from, even if HEAD moves later
    config = OmegaConf.to_container(cfg, resolve=True)
    run_id = run_config_hash(config)
    group_id = run_config_hash(config, ("seed",))
    results_dir = Path(cfg.results_dir).expanduser()
    seed = cfg.seed
    timings: dict[str, float] = {}
    started = time.perf_counter()
    torch.manual_seed(seed)
    with timed(timings, "data"):
        data: ImageDataset = build(cfg.dataset)
    attack = build_attack(cfg.attack, data)
    defense: Defense | None = build(cfg.defense) if cfg.defense is not None else None
    trainer_kwargs = dict(device=cfg.device, crop_padding=data.crop_padding, hflip=data.hflip,
                          min_precision=attack.min_precision)
    trainer = build(cfg.trainer, **trainer_kwargs)  # the defenses', the clean control's and reactivation's
    victim_trainer = build(victim_trainer_node(cfg), **trainer_kwargs) if victim_overrides(cfg) else trainer
    # The logger starts (and may write, e.g. wandb's folder) once everything that can refuse the
    # run without training has.
    logger = build(cfg.logger) if cfg.logger is not None and distributed.is_main() else None
    if logger is not None:
        logger.start(run_id=run_id, group_id=group_id, config=config, results_dir=results_dir)
    trainer.on_epoch = victim_trainer.on_epoch = logger.log_epoch if logger is not None else None
    if warning := bf16_warning(attack.name, trainer.precision, attack.min_precision, getattr(attack, "test_eps", None)):
        log.warning("%s", warning)  # once, in one line
    excluded = defense.not_applicable(attack) if defense is not None else None  # the threat models' pairing
    protocol = protocol_name(cfg)
    log.info("run %s: %s on %s, attack %s (%s), defense %s, device %s, precision %s, protocol %s, %d epochs", run_id,
             cfg.model._target_.rsplit(".", 1)[-1], data.name, attack.name, attack.target_mode,
             defense.name if defense else "none", trainer.device, trainer.precision, protocol, victim_trainer.epochs)

    victim, poisoned, model, cost = obtain_victim(
        cfg, config, run_id, data, attack, victim_trainer, timings, results_dir,
        clean_model=lambda: clean_control(cfg, config, run_id, data, attack, trainer, results_dir))
    with timed(timings, "eval_attacked"):
        attacked = evaluate(model, trainer, attack, data.test)
    adversarial: dict = {}  # the attacked model's PGD images, kept for eval.pgd.transfer_from=attacked
    if cfg.eval.pgd.enabled:
        with timed(timings, "pgd_attacked"):
            pgd_metrics, adversarial, victim["pgd_memo"] = attacked_pgd(
                model, data, cfg.eval.pgd, trainer.device, victim,
                keep_examples=cfg.eval.pgd.get("transfer_from") == "attacked")
            attacked.update(pgd_metrics)
    with timed(timings, "stealth"):
        stealth, examples = measure_stealth(attack, data, cfg.eval, trainer.device)
    if logger is not None and examples is not None:
        logger.log_images("clean_vs_poisoned", examples)
    artifacts = example_artifacts(model, examples, trainer) if examples is not None else {}  # figures' data

    exported = None
    if defense is not None and excluded is None and defense.reads_exported_set(type(attack)):
        with timed(timings, "export"):  # before the defense: retraining moves a learned trigger
            exported = exported_training_set(attack, data.train, victim_trainer, seed)
    stage = defend(cfg, defense, excluded, attack, data, trainer, model, poisoned, attacked, adversarial, artifacts,
                   timings, exported)
    reactivation = None
    if cfg.eval.reactivation.enabled:
        with timed(timings, "reactivation"):
            reactivation = run_reactivation(cfg, config, run_id, data, attack, trainer, results_dir, model,
                                            stage.repaired if stage.defended is not None else None,
                                            stage.info if defense is not None else None, stage.victim_attack or attack)
    timings["total"] = round(time.perf_counter() - started, 4)

    record = RunRecord(
        run_id=run_id,
        group_id=group_id,
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        dataset={
            "name": data.name,
            "num_classes": data.num_classes,
            "image_shape": list(data.image_shape),
            "n_train": len(data.train),
            "n_test": len(data.test),
        },
        model={"name": model.name, "n_params": sum(p.numel() for p in model.parameters())},
        attack={
            **attack.describe(),
            "n_poisoned": int(len(poisoned.indices)),
            "poisoned_indices_sha256": poisoned.indices_sha256,
        },
        defense=stage.info,
        seed=seed,
        metrics={"attacked": attacked, "defended": stage.defended, "der": stage.der, "detection": stage.detection,
                 **({"defended_reason": stage.defended_reason} if stage.defended_reason else {})},
        stealth=stealth,
        victim=victim,
        timings_s=timings,
        env={**environment(trainer.device), "precision": trainer.precision},
        config=config,
        overrides=list(overrides or []),
        reactivation=reactivation,
        defense_cost=stage.cost,
        benign=stage.benign,
        attack_cost=cost,
    )
    record.report = run_report(record)  # what reporting reads, decided here (run_facts.py)
    if not distributed.is_main():
        return record, None
    # A requeue signal held during the record's write, or arriving after it, finds the run finished:
    # acting on it would run the job again into a second record.
    with interrupts.held():
        path = write_new_record(record, artifacts, results_dir / "runs" / data.name / f"{attack.name}_{attack.target_mode}")
        interrupts.finished()
    remove_checkpoints(results_dir / "checkpoints" / run_id)  # cache off: kept until the record is safe
    if logger is not None:
        logger.log_summary(record.to_dict())
        logger.finish(path)
    return record, path


def clean_victim(cfg: DictConfig, config: dict[str, Any], run_id: str, data: ImageDataset, attack: Attack,
                 trainer, results_dir: Path) -> Normalized:
    """The `attack=none` victim of the run's setting (same dataset, model, trainer, seed, target rule):
    from the victim cache, or trained here and cached, as `python -m backdoorbench attack=none` would."""
    return clean_control(cfg, config, run_id, data, attack, trainer, results_dir)[0]


def clean_control(cfg: DictConfig, config: dict[str, Any], run_id: str, data: ImageDataset, attack: Attack,
                  trainer, results_dir: Path) -> tuple[Normalized, dict[str, Any]]:
    """`clean_victim`, with its `victim` block (cache hit, miss or off; its key) for a record to cite."""
    clean_attack = {"_target_": "backdoorbench.attacks.none.NoAttack", "target_mode": attack.target_mode,
                    "target": cfg.attack.get("target", 0) if cfg.attack.get("target") is not None else 0,
                    "poison_rate": None}
    clean_config = {**config, "attack": clean_attack, "victim_trainer": None}  # attack=none trains with `trainer`
    clean_cfg = OmegaConf.create(clean_config)
    none = build(clean_cfg.attack, num_classes=data.num_classes, image_shape=data.image_shape)
    on_epoch, trainer.on_epoch = trainer.on_epoch, None  # its epochs are not this run's
    try:
        with torch.random.fork_rng(devices=[]):  # the run's own draws stay as without the probe
            block, _, model, _ = obtain_victim(clean_cfg, clean_config, f"{run_id}-clean", data, none, trainer, {}, results_dir)
    finally:
        trainer.on_epoch = on_epoch
    return model, block


def run_reactivation(cfg: DictConfig, config: dict[str, Any], run_id: str, data: ImageDataset, attack: Attack, trainer,
                     results_dir: Path, victim: Normalized, repaired, defense_info: dict[str, Any] | None,
                     victim_attack: Attack | None = None) -> dict[str, Any]:
    """The record's `reactivation` block (backdoorbench.metrics.reactivation): RA and QRA on the model
    the defense returned (on the victim when there is no defense), RA on the victim as the reference,
    with `victim_attack`'s trigger (the attack as the victim was trained, before an in-training
    defense retrained it; default `attack`)."""
    budget, probe = reactivation_budgets(cfg.eval.reactivation)
    if getattr(attack, "triggerless", False):  # attack=none: there is no trigger to re-learn
        return {"protocol": "skipped", "skipped": "attack=none has no trigger to reactivate"}
    if defense_info is None:
        subject, subject_is, reference = victim, "attacked", None
    elif repaired is not None:
        subject, subject_is = repaired, "defended"
        reference = victim if cfg.eval.reactivation.reference else None
    else:  # an input-level detector, or a defense that does not apply: the model is the victim itself
        why = defense_info.get("not_applicable") or f"defense {defense_info['name']} returns no model to retune"
        subject, subject_is, reference = victim, "attacked", None
        log.info("reactivation: %s; measured on the undefended victim only", why)
    block = measure_reactivation(
        subject=subject, subject_is=subject_is, reference=reference, trainer=trainer, attack=attack, train=data.train,
        test=data.test, budget=budget, probe=probe, generator=stream(cfg.seed, "reactivation"), reference_attack=victim_attack,
        clean_model=lambda: clean_victim(cfg, config, run_id, data, attack, trainer, results_dir))
    if subject_is == "attacked" and defense_info is not None:
        block["note"] = why
    return block


def write_new_record(record: RunRecord, artifacts: dict[str, Any], folder: Path) -> Path:
    """Write the record (and its artifacts first, so it never names a missing file) under the first
    free repeat of its run id in `folder`; return its path. Nothing of another run is replaced:
    a name taken meanwhile (the same config finishing at the same moment elsewhere) moves this
    run on to the next repeat."""
    while True:
        record.repeat = next_repeat(folder, record.run_id)
        path = repeat_path(folder, record.run_id, record.repeat)
        written = None
        try:
            record.artifacts = written = write_beside_record(path, artifacts)
            return save_record(record, path, exclusive=True)
        except FileExistsError:
            if written is not None:
                (folder / written).unlink(missing_ok=True)  # ours: the record that claimed the name is not
            continue
        except StorageError:  # the disk filled between the artifacts and the record: leave neither
            if written is not None:
                with suppress(OSError):
                    (folder / written).unlink(missing_ok=True)
            raise


def reactivation_lines(block: dict[str, Any] | None) -> list[str]:
    """The summary's lines for the reactivation stage: ASR before and after the retuning attack, per model."""
    if not block:
        return []
    if "skipped" in block:
        return [f"reactivation: skipped ({block['skipped']})"]
    budget = block["budget"]
    lines = [f"reactivation (retuning attack: {budget['poison_count']} poisoned of {budget['set_size']} samples, "
             f"{budget['steps']} steps, lr {budget['lr']:g}):"]
    for name in ("defended", "attacked"):
        curve = block.get(name)
        if curve is None:
            continue
        probe = curve.get("probe")
        extra = f"; query-based probe ASR {probe['asr']:.2%} (clean model {probe['asr_clean_model']:.2%})" if probe else ""
        lines.append(f"  {name}: ASR {curve['asr'][0]:.2%} -> {curve['asr'][-1]:.2%}, CA {curve['ca'][0]:.2%} -> "
                     f"{curve['ca'][-1]:.2%}{extra}")
    return lines


def detection_line(name: str, detection: dict[str, Any]) -> str:
    """`detection (spectral): TPR 92.50%, FPR 3.10%, F1 0.812, AUROC 0.981`; – where a rate is undefined."""
    def value(key: str, percent: bool) -> str:
        found = detection.get(key)
        return "–" if found is None else f"{found:.2%}" if percent else f"{found:.3f}"
    return (f"detection ({name}): TPR {value('tpr', True)}, FPR {value('fpr', True)}, F1 {value('f1', False)}, "
            f"AUROC {value('auroc', False)}")


def summary_table(record: RunRecord, path: Path) -> str:
    """The short table printed at the end of a run."""
    rows = [("attacked", record.metrics["attacked"])]
    if record.metrics["defended"] is not None:
        rows.append((f"defended ({record.defense['name']})", record.metrics["defended"]))
    width = max(len(name) for name, _ in rows)
    lines = [f"{'model':<{width}}  {'CA':>7}  {'ASR':>7}  {'RA':>7}"]
    for name, m in rows:
        lines.append(f"{name:<{width}}  {m['clean_acc']:>7.2%}  {m['asr']:>7.2%}  {m['ra']:>7.2%}")
    if record.metrics["der"] is not None:
        lines.append(f"DER {record.metrics['der']:.4f}")
    if record.metrics.get("detection"):
        lines.append(detection_line(record.defense["name"], record.metrics["detection"]))
    if record.metrics.get("defended_reason"):
        lines.append(f"defense {record.defense['name']}: no defended model, {record.metrics['defended_reason']}")
    if record.defense.get("applicable") is False:
        lines.append(f"defense {record.defense['name']}: not applicable ({record.defense['not_applicable']})")
    lines += reactivation_lines(record.reactivation)
    attack = record.attack
    target = f" target {attack['target']}" if attack["target"] is not None else ""
    # Data-poisoning attacks rewrite at least one training sample (a rate that poisons none is an
    # error); training-controlled ones (WaNet, IAD, LIRA, WB) rewrite none and poison a share of
    # each batch; attack=none has rate 0.
    per_batch = attack["n_poisoned"] == 0 and attack["poison_rate"] > 0
    share = "of each batch" if per_batch else f"({attack['n_poisoned']} samples)"
    protocol = protocol_name(record.config)
    lines.insert(0, f"{attack['name']} {attack['target_mode']}{target}, poison rate {attack['poison_rate']} "
                    f"{share} on {record.dataset['name']} / {record.model['name']}, seed {record.seed}, "
                    f"{protocol} protocol, {record.env.get('precision', 'fp32')}")
    victim = record.victim or {}
    if victim.get("cache") == "hit":
        trained = f"victim from the cache, trained before in {victim['train_s']:.1f} s"
    else:
        trained = f"train {record.timings_s['train']:.1f} s"
    lines.append(f"time {record.timings_s['total']:.1f} s ({trained}) on {record.env['device']}")
    if cost_line := attack_cost_line(record.attack_cost):
        lines.append(cost_line)
    lines.append(f"record: {path}")
    return "\n".join(lines)
