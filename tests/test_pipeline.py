"""The pipeline in-process: determinism on the CPU, the run id, and the trainer's hooks."""

import torch

from backdoorbench.config import config_hash
from backdoorbench.pipeline import run


def test_same_seed_same_numbers_and_other_seed_other_numbers(tmp_path, compose_cfg):
    def metrics(seed, sub):
        cfg = compose_cfg("trainer.epochs=1", f"seed={seed}", f"results_dir={tmp_path / sub}", "trainer.progress=false",
                          "eval.stealth_images=100")
        record, _ = run(cfg)
        return record

    first, again, other = metrics(0, "a"), metrics(0, "b"), metrics(1, "c")
    assert first.metrics == again.metrics
    assert first.run_id == again.run_id  # results_dir does not change the run id
    assert first.attack["poisoned_indices_sha256"] == again.attack["poisoned_indices_sha256"]
    assert other.attack["poisoned_indices_sha256"] != first.attack["poisoned_indices_sha256"]
    assert other.group_id == first.group_id and other.run_id != first.run_id


def test_config_hash_ignores_only_the_named_keys():
    base = {"seed": 0, "trainer": {"epochs": 1, "progress": True}, "results_dir": "a"}
    moved = {**base, "results_dir": "b", "trainer": {"epochs": 1, "progress": False}}
    drop = ("results_dir", "trainer.progress")
    assert config_hash(base, drop) == config_hash(moved, drop)
    assert config_hash(base, drop) != config_hash({**base, "seed": 1}, drop)


def test_defense_changes_do_not_change_the_poisoned_set(tmp_path, compose_cfg):
    a, _ = run(compose_cfg("trainer.epochs=0", f"results_dir={tmp_path}"))
    b, _ = run(compose_cfg("trainer.epochs=0", "defense=fine_tuning", "defense.epochs=1", f"results_dir={tmp_path}",
                           "eval.pgd.enabled=true", "eval.pgd.images=50", "eval.pgd.steps=2", "eval.pgd.eps=0.5"))
    assert a.attack["poisoned_indices_sha256"] == b.attack["poisoned_indices_sha256"]
    pgd_acc = b.metrics["attacked"].pop("pgd_acc")
    # one eps (the old config): the single number, and the same as the one row of the table
    assert b.metrics["attacked"].pop("pgd") == [{"loss": "ce", "eps": 0.5, "acc": pgd_acc, "source": "self"}]
    assert a.metrics["attacked"] == b.metrics["attacked"]
    # PGD accuracy is recorded for the attacked and the defended model when eval.pgd is enabled.
    assert 0 <= pgd_acc <= 1 and 0 <= b.metrics["defended"]["pgd_acc"] <= 1
    assert "pgd_acc" not in a.metrics["attacked"]


def test_training_step_hook_replaces_the_loss(mnist5k):
    from backdoorbench.models.base import Normalized
    from backdoorbench.models.mnist_cnn import MnistCNN
    from backdoorbench.train import Trainer

    calls = []

    def step(model, x, y):
        calls.append(len(y))
        logits = model(x)
        return torch.nn.functional.cross_entropy(logits, y), logits, y

    trainer = Trainer(epochs=1, batch_size=500, device="cpu", progress=False)
    model = Normalized(MnistCNN(), mnist5k.mean, mnist5k.std)
    history = trainer.fit(model, mnist5k.train, generator=torch.Generator().manual_seed(0), step=step)
    assert sum(calls) == 4000 and len(history) == 1 and history[0]["loss"] > 0


def test_summary_names_the_poisoned_samples_or_the_share_of_each_batch(tmp_path):
    from backdoorbench.pipeline import summary_table
    from tests.test_records import make_record

    poisoning = summary_table(make_record(env={"device": "cpu"}), tmp_path / "r.json").splitlines()[0]
    assert poisoning.startswith("badnets all2one target 0, poison rate 0.1 (400 samples) on mnist5k")
    per_batch = make_record(attack={"name": "wanet", "target_mode": "all2one", "target": 0, "poison_rate": 0.1,
                                    "n_poisoned": 0, "poisoned_indices_sha256": "0" * 64}, env={"device": "cpu"})
    line = summary_table(per_batch, tmp_path / "r.json").splitlines()[0]
    assert line.startswith("wanet all2one target 0, poison rate 0.1 of each batch on mnist5k") and "0 samples" not in line
    clean = make_record(attack={"name": "none", "target_mode": "all2one", "target": 0, "poison_rate": 0.0,
                                "n_poisoned": 0, "poisoned_indices_sha256": "0" * 64}, env={"device": "cpu"})
    assert summary_table(clean, tmp_path / "r.json").startswith("none all2one target 0, poison rate 0.0 (0 samples)")
