"""The eight measurements of benchmarks/gpu_check.py, one function per section.

Each runs in its own process (`python -m benchmarks.gpu_sections --section NAME`, started by
gpu_check.py, which enforces the time guard; this module imports gpu_check, never the other way),
gets a `Section` context and fills `section.result`; `section.save()` writes what is known so far,
so a section killed by its guard still hands back the numbers it had. Sizes depend on `--tiny`.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from backdoorbench.fileio import atomic_write_text
from benchmarks import gpu_check as gc

ROOT = Path(__file__).resolve().parent.parent
SGD = partial(torch.optim.SGD, lr=0.01, momentum=0.9, weight_decay=5e-4)


@dataclass
class Section:
    name: str
    device: torch.device
    tiny: bool
    workdir: Path
    deadline: float  # time.monotonic() at which the parent kills this process
    peak_tflops: float | None = None
    result: dict[str, Any] = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        atomic_write_text(self.workdir / f"{self.name}.json", json.dumps(self.result, indent=1))

    def scratch(self, prefix: str) -> tempfile.TemporaryDirectory:
        """A results folder for one command, inside the parent's work folder, so that it is
        removed even when the guard kills this process before its own cleanup runs."""
        return tempfile.TemporaryDirectory(prefix=prefix, dir=self.workdir)

    def item(self, key: str, measure: Callable[[], Any]) -> None:
        """result[key] = measure(), or the error it raised (one line); saved either way, so one
        failing part (an out-of-memory batch size, a missing kernel) does not hide the others."""
        try:
            self.result[key] = measure()
        except Exception as exc:  # a first GPU run must report what failed and go on
            self.result[key] = {"error": gc.one_line(exc)}
            traceback.print_exc()
        self.save()


# ----------------------------------------------------------------------------------- helpers


def cli_env() -> dict[str, str]:
    """Child processes import this checkout's backdoorbench, whatever is installed."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def run_command(argv: list[str], timeout: float, env: dict[str, str] | None = None,
                results_dir: str | None = None) -> dict[str, Any]:
    """Run a command as a user would; its wall time, exit code, the records it wrote (those under
    `results_dir`, else those its `record: <path>` lines name) and, when it failed, its last lines."""
    started = time.perf_counter()
    try:
        proc = subprocess.run(argv, cwd=ROOT, env=env or cli_env(), capture_output=True, text=True,
                              timeout=max(timeout, 1.0))
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "command": " ".join(argv)}
    wall = time.perf_counter() - started
    out = {"wall_s": round(wall, 3), "returncode": proc.returncode}
    paths = re.findall(r"^record: (.+\.json)$", proc.stdout, flags=re.M)
    if results_dir is not None:  # a sweep's workers may print elsewhere; the folder is the truth
        paths = sorted(str(p) for p in (Path(results_dir) / "runs").rglob("*.json"))
    out["records"] = [json.loads(Path(p).read_text()) for p in paths if Path(p).exists()]
    if proc.returncode != 0:
        out["error"] = gc.last_lines(proc.stderr or proc.stdout, 3)
    warns = gc.nondeterministic_ops(proc.stderr)
    if warns:
        out["nondeterministic_ops"] = warns
    return out


def metrics_of(record: dict[str, Any]) -> dict[str, float]:
    return dict(record["metrics"]["attacked"])


def cli(*overrides: str) -> list[str]:
    return [sys.executable, "-m", "backdoorbench", *overrides]


def default_job_overrides(section: Section, results_dir: str, epochs: int = 1) -> list[str]:
    """The default job on this device in a fresh folder; with --tiny, `epochs` epochs and no
    stealth metrics or logger."""
    tiny = [f"trainer.epochs={epochs}", "eval.stealth_images=0", "logger=none"] if section.tiny else []
    return [f"device={section.device.type}", f"results_dir={results_dir}", *tiny]


def train_subset(data, count: int | None, test_count: int | None = None):
    """`data` with `count` training (and `test_count` test) images, a seeded choice (None: all)."""
    g = torch.Generator().manual_seed(0)
    if count is not None and count < len(data.train):
        data = replace(data, train=data.train.subset(torch.randperm(len(data.train), generator=g)[:count].sort().values))
    if test_count is not None and test_count < len(data.test):
        data = replace(data, test=data.test.subset(torch.randperm(len(data.test), generator=g)[:test_count].sort().values))
    return data


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def training_flops_per_image(net: torch.nn.Module, image_shape: tuple[int, ...], num_classes: int) -> float:
    """FLOPs of one training step (forward + backward) per image, as torch.utils.flop_counter
    counts them (matrix multiplies and convolutions, 2 per multiply-add; no elementwise work)."""
    from torch.utils.flop_counter import FlopCounterMode

    net = copy.deepcopy(net).cpu().float().train()
    batch = 4
    x = torch.rand(batch, *image_shape)
    y = torch.arange(batch) % num_classes
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(net(x), y).backward()
    return counter.get_total_flops() / batch


def trainer_for(section: Section, data, batch_size: int, epochs: int = 1, **kwargs):
    from backdoorbench.train import Trainer

    return Trainer(epochs=epochs, batch_size=batch_size, optimizer=SGD, schedule="constant",
                   crop_padding=data.crop_padding, hflip=data.hflip, progress=False, device=section.device, **kwargs)


# ----------------------------------------------------------------------------------- 1


def environment(section: Section) -> None:
    import torchvision

    r = section.result
    r.update(python=platform.python_version(), torch=torch.__version__, torchvision=torchvision.__version__,
             cuda=torch.version.cuda, cpu_count=os.cpu_count(), device=str(section.device),
             gpus_visible=torch.cuda.device_count() if torch.cuda.is_available() else 0)
    section.save()  # the versions, even if the device cannot be queried
    if section.cuda:
        props = torch.cuda.get_device_properties(section.device)
        r.update(device_name=props.name, memory_gib=round(props.total_memory / 2**30, 2),
                 compute_capability=f"{props.major}.{props.minor}", multiprocessors=props.multi_processor_count,
                 cudnn=torch.backends.cudnn.version(), bf16_supported=torch.cuda.is_bf16_supported())
    else:
        r.update(device_name=platform.processor() or platform.machine(), cudnn=None)
    peak, reason = gc.assumed_peak_bf16_tflops(r["device_name"] if section.cuda else None, section.peak_tflops)
    r["peak_bf16_tflops"] = peak
    r["peak_source"] = reason
    section.save()


# ----------------------------------------------------------------------------------- 2


THROUGHPUT_PLANS = {  # model -> (data, images, batch sizes); --tiny sizes second
    "preact_resnet18": (("cifar-shaped", 50_000, (128, 512)), ("cifar-shaped", 8, (4, 8))),
    "mnist_cnn": (("mnist5k", None, (128, 512)), ("mnist5k", 256, (128, 256))),
}


def throughput(section: Section) -> None:
    from backdoorbench.models.base import Normalized
    from benchmarks.engine import baseline_epoch, baseline_loader, build_net, load_data

    workers = (0, 2) if section.tiny else (4, 8)
    warm_steps = 1 if section.tiny else 4
    peak = gc.assumed_peak_bf16_tflops(
        torch.cuda.get_device_name(section.device) if section.cuda else None, section.peak_tflops)[0]
    section.result.update(workers=list(workers), peak_bf16_tflops=peak, rounds=1)
    for model_name, plans in THROUGHPUT_PLANS.items():
        data_name, size, batches = plans[1] if section.tiny else plans[0]
        data = load_data(data_name, size or 0, seed=0)
        data = train_subset(data, size)
        n = len(data.train)
        torch.manual_seed(0)
        initial = build_net(model_name, data)
        flops = training_flops_per_image(initial, tuple(data.image_shape), data.num_classes)
        for batch in batches:
            def measure(batch=batch):
                trainer = trainer_for(section, data, batch)
                ours = Normalized(copy.deepcopy(initial), data.mean, data.std)
                warm = data.train.subset(torch.arange(min(n, warm_steps * batch)))
                g = torch.Generator().manual_seed(2)
                trainer.fit(ours, warm, generator=g)  # kernels chosen, allocator warm
                ours_s = timed(lambda: trainer.fit(ours, data.train, generator=g), section.device)
                row = {"model": model_name, "data": data_name, "images": n, "batch_size": batch,
                       "flops_per_image": flops, "ours_images_per_s": n / ours_s,
                       "ours_mfu": gc.mfu(flops, n / ours_s, peak), "dataloader_images_per_s": {}}
                for w in workers:
                    loader = baseline_loader(data, batch, w, section.device)
                    net = copy.deepcopy(initial).to(section.device, memory_format=trainer.memory_format)
                    sgd = SGD(net.parameters())
                    run = partial(baseline_epoch, net, loader, sgd, section.device, trainer.precision == "bf16", trainer.memory_format)
                    run(max_steps=warm_steps)
                    row["dataloader_images_per_s"][str(w)] = n / timed(run, section.device)
                    del loader  # its persistent workers exit
                best = max(row["dataloader_images_per_s"].values())
                row["ratio_to_best_dataloader"] = row["ours_images_per_s"] / best
                row["dataloader_mfu"] = gc.mfu(flops, best, peak)
                return row
            section.item(f"{model_name}_batch{batch}", measure)


# ----------------------------------------------------------------------------------- 3


def host_syncs(section: Section) -> None:
    """Synchronisations per training step of Trainer.fit under set_sync_debug_mode("warn"):
    two fits of different lengths separate the per-step count from the per-epoch one."""
    from backdoorbench.models.base import Normalized
    from benchmarks.engine import build_net, load_data

    for model_name, data_name, size in (("mnist_cnn", "mnist5k", None), ("preact_resnet18", "cifar-shaped", 2048)):
        def measure(model_name=model_name, data_name=data_name, size=size):
            data = load_data(data_name, size or 0, seed=0)
            torch.manual_seed(0)
            model = Normalized(build_net(model_name, data), data.mean, data.std)
            batch = 128
            trainer = trainer_for(section, data, batch)
            g = torch.Generator().manual_seed(0)
            trainer.fit(model, data.train.subset(torch.arange(2 * batch)), generator=g)  # warm-up, not counted
            counts, places = [], Counter()
            for steps in (4, 12):
                part = data.train.subset(torch.arange(steps * batch))
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        trainer.fit(model, part, generator=g)
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                syncs = [w for w in caught if gc.is_sync_warning(str(w.message))]
                counts.append((len(syncs), steps))
                places.update(f"{Path(w.filename).name}:{w.lineno}" for w in syncs)
            per_step, per_fit = gc.per_step_count(*counts[0], *counts[1])
            return {"model": model_name, "batch_size": batch, "syncs_per_step": per_step, "syncs_per_fit": per_fit,
                    "counts": [{"steps": s, "syncs": c} for c, s in counts], "where": dict(places.most_common(10))}
        section.item(model_name, measure)


# ----------------------------------------------------------------------------------- 4


def default_job(section: Section) -> None:
    """`python -m backdoorbench device=...` twice with the same seed (and on CUDA twice more with
    torch.use_deterministic_algorithms), each in a fresh results folder."""
    plain = []
    deterministic = [
        sys.executable, "-c",
        "import sys, runpy, torch; torch.use_deterministic_algorithms(True, warn_only=True); "
        "sys.argv[0] = 'backdoorbench'; runpy.run_module('backdoorbench', run_name='__main__', alter_sys=True)",
    ]
    modes = [("plain", cli())] + ([("deterministic", deterministic)] if section.cuda else [])
    for mode, argv in modes:
        runs = []
        for i in range(2):
            with section.scratch("gpu_check_job_") as tmp:
                env = {**cli_env(), "CUBLAS_WORKSPACE_CONFIG": ":4096:8"} if mode == "deterministic" else None
                out = run_command(argv + default_job_overrides(section, tmp), section.remaining() - 5, env)
            runs.append(out)
            if "error" in out:
                break
        entry: dict[str, Any] = {"runs": []}
        for out in runs:
            row = {k: v for k, v in out.items() if k not in ("records",)}
            if out.get("records"):
                rec = out["records"][0]
                row.update(metrics=metrics_of(rec), timings_s=rec["timings_s"], run_id=rec["run_id"],
                           device=rec["env"]["device"])
            entry["runs"].append(row)
        done = [r for r in entry["runs"] if "metrics" in r]
        if len(done) == 2:
            entry["identical"] = done[0]["metrics"] == done[1]["metrics"]
            entry["max_abs_difference"] = gc.max_abs_difference(done[0]["metrics"], done[1]["metrics"])
        section.result[mode] = entry
        section.save()
    if not section.cuda:
        section.result["deterministic"] = {"skipped": "on the CPU the plain pair is the check (kept short for --tiny)"}
        section.save()


# ----------------------------------------------------------------------------------- 5


def compose(*overrides: str):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    import backdoorbench.config  # noqa: F401  (registers the schemas)

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="backdoorbench.conf", version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


@torch.no_grad()
def logit_effect(model, attack, images: torch.Tensor, device: torch.device, autocast: bool) -> torch.Tensor:
    """f(T(x)) - f(x) per image, computed under bf16 autocast or in fp32 (T itself in fp32, as
    apply_trigger runs it)."""
    model.eval()
    out = []
    for chunk in images.split(500):
        x = chunk.to(device).float() / 255
        x_trig = attack.apply_trigger(x)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            out.append((model(x_trig).float() - model(x).float()).cpu())
    return torch.cat(out)


def precision(section: Section) -> None:
    """LIRA at test_eps 0.0025 and 0.005 px: how much of the trigger bf16 autocast keeps."""
    from backdoorbench.metrics import evaluate
    from backdoorbench.factory import build, build_model
    from backdoorbench.stages import stream

    # Small victims: four of them must fit the section's guard on a GPU.
    epochs = ["trainer.epochs=1", "attack.stage1_epochs=1"] if section.tiny else ["trainer.epochs=4"]
    # Victims trained under bf16 autocast (trainer.precision=bf16, what CUDA ran for every attack
    # before trainer.precision=auto chose fp32 for LIRA) and in fp32 (auto's choice); on the CPU
    # bf16 training is slow, so there only the fp32 victim is trained and both are evaluated.
    train_modes = ("autocast", "fp32") if section.cuda else ("fp32",)
    for test_eps in (0.0025, 0.005):
        for train_mode in train_modes:
            def measure(test_eps=test_eps, train_mode=train_mode):
                cfg = compose("attack=lira", f"attack.test_eps={test_eps}", f"device={section.device.type}",
                              f"trainer.precision={'bf16' if train_mode == 'autocast' else 'fp32'}", "trainer.progress=false", *epochs)
                data = build(cfg.dataset)
                if section.tiny:
                    data = train_subset(data, 128, test_count=200)
                attack = build(cfg.attack, num_classes=data.num_classes, image_shape=data.image_shape)
                trainer = build(cfg.trainer, device=cfg.device, crop_padding=data.crop_padding, hflip=data.hflip)
                attack.prepare(trainer=trainer, train=data.train, generator=stream(0, "attack"),
                               build_model=lambda **kw: build_model(cfg, data, **kw))
                poisoned = attack.poison_dataset(data.train, stream(0, "poison"))
                model = build_model(cfg, data)
                started = time.perf_counter()
                attack.train_victim(trainer, model, poisoned.split, stream(0, "train"))
                row: dict[str, Any] = {"test_eps": test_eps, "trained_under": train_mode,
                                       "train_s": round(time.perf_counter() - started, 3)}
                # Evaluated both ways: the trainer's precision bf16 (on the CPU too) and fp32.
                for mode, precision in (("autocast", "bf16"), ("fp32", "fp32")):
                    trainer.precision = precision
                    row[f"eval_{mode}"] = evaluate(model, trainer, attack, data.test)
                attackable = data.test.images[attack.target_rule(data.test.labels) != data.test.labels][:1000]
                fp32 = logit_effect(model, attack, attackable, section.device, autocast=False)
                bf16 = logit_effect(model, attack, attackable, section.device, autocast=True)
                row["logit_effect"] = gc.effect_agreement(fp32, bf16)
                x = attackable[:200].to(section.device).float() / 255
                row["bf16_input"] = gc.bf16_kept_fraction(model.normalize(x),
                                                                          model.normalize(attack.apply_trigger(x)))
                return row
            section.item(f"test_eps_{test_eps}_trained_{train_mode}", measure)


# ----------------------------------------------------------------------------------- 6


def compile_vs_eager(section: Section) -> None:
    from backdoorbench.models.base import Normalized
    from benchmarks.engine import build_net, load_data

    if section.cuda:
        model_name, data_name, batch, steps = "preact_resnet18", "cifar-shaped", 512, 16
    else:
        model_name, data_name, batch, steps = "mnist_cnn", "mnist5k", 64, 4
    data = train_subset(load_data(data_name, batch * steps, seed=0), batch * steps)
    epochs = 3
    section.result.update(model=model_name, batch_size=batch, steps_per_epoch=steps, epochs=epochs)
    for mode in ("eager", "compiled"):
        def measure(mode=mode):
            torch.manual_seed(0)
            model = Normalized(build_net(model_name, data), data.mean, data.std)
            trainer = trainer_for(section, data, batch, epochs=epochs, compile=mode == "compiled")
            history = trainer.fit(model, data.train, generator=torch.Generator().manual_seed(0))
            seconds = [row["time_s"] for row in history]
            steady = statistics.median(seconds[1:])
            return {"epoch_s": seconds, "step_ms": 1000 * steady / steps,
                    "first_epoch_extra_s": seconds[0] - steady}
        section.item(mode, measure)
    eager, compiled = section.result.get("eager", {}), section.result.get("compiled", {})
    if "step_ms" in eager and "step_ms" in compiled:
        section.result["speedup"] = eager["step_ms"] / compiled["step_ms"]
        section.result["compile_s"] = compiled["first_epoch_extra_s"] - eager["first_epoch_extra_s"]
        section.save()


# ----------------------------------------------------------------------------------- 7


def packing(section: Section) -> None:
    """N seeds of the mnist5k default job as one joblib sweep with n_jobs=N, every job on this
    device, as a user would launch it; runs per hour from the sweep's wall time."""
    counts = (1, 2) if section.tiny else (1, 2, 4, 8)
    if section.tiny:
        section.result["note"] = "--tiny: 0 training epochs, the launch path only; runs/hour mean nothing here"
    for n in counts:
        def measure(n=n):
            with section.scratch("gpu_check_pack_") as tmp:
                argv = cli("--multirun", "hydra/launcher=gpu_pack", f"hydra.launcher.n_jobs={n}",
                           "seed=" + ",".join(str(s) for s in range(n)), *default_job_overrides(section, tmp, epochs=0))
                out = run_command(argv, section.remaining() - 5, results_dir=tmp)
            if "error" in out:
                return {"error": out["error"]}
            records = out["records"]
            if len(records) != n:
                return {"error": f"{len(records)} records from {n} jobs"}
            return {"jobs": n, "wall_s": out["wall_s"], "runs_per_hour": gc.runs_per_hour(n, out["wall_s"]),
                    "mean_train_s": statistics.mean(r["timings_s"]["train"] for r in records),
                    "mean_ca": statistics.mean(r["metrics"]["attacked"]["clean_acc"] for r in records)}
        section.item(f"n_jobs_{n}", measure)
    rates = {int(k.removeprefix("n_jobs_")): v["runs_per_hour"] for k, v in section.result.items()
             if isinstance(v, dict) and "runs_per_hour" in v}
    if rates:
        best = max(rates, key=rates.get)
        section.result["best_n_jobs"] = best
        section.result["setting"] = f"hydra/launcher=gpu_pack hydra.launcher.n_jobs={best}"
        section.save()


# ----------------------------------------------------------------------------------- 8


def ddp(section: Section) -> None:
    """torchrun on the default job (NCCL on CUDA, gloo on the CPU), 1 process and one per GPU,
    its record's metrics against the one-process run of section 4 (or one run here)."""
    reference = None
    previous = section.workdir / "default_job.json"
    if previous.exists():
        runs = json.loads(previous.read_text()).get("plain", {}).get("runs", [])
        reference = next((r["metrics"] for r in runs if "metrics" in r), None)
    if reference is None:
        with section.scratch("gpu_check_ddp_") as tmp:
            out = run_command(cli(*default_job_overrides(section, tmp)), section.remaining() - 5)
        reference = metrics_of(out["records"][0]) if out.get("records") else None
    section.result["one_process_metrics"] = reference
    section.result["backend"] = "nccl" if section.cuda else "gloo"
    gpus = torch.cuda.device_count() if section.cuda else 1
    for nproc in sorted({1, gpus}):
        def measure(nproc=nproc):
            with section.scratch("gpu_check_ddp_") as tmp:
                argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                        "-m", "backdoorbench", *default_job_overrides(section, tmp)]
                out = run_command(argv, section.remaining() - 5)
            if "error" in out:
                return {"error": out["error"]}
            rec = out["records"][0]
            row = {"nproc_per_node": nproc, "wall_s": out["wall_s"], "world_size": rec["env"]["world_size"],
                   "metrics": metrics_of(rec)}
            if reference is not None:
                row["max_abs_difference_to_one_process"] = gc.max_abs_difference(reference, row["metrics"])
                row["identical_to_one_process"] = reference == row["metrics"]
            return row
        section.item(f"nproc_{nproc}", measure)


SECTIONS: dict[str, Callable[[Section], None]] = {
    "environment": environment,
    "throughput": throughput,
    "host_syncs": host_syncs,
    "default_job": default_job,
    "precision": precision,
    "compile": compile_vs_eager,
    "packing": packing,
    "ddp": ddp,
}


def main(argv: list[str] | None = None) -> int:
    """Run one section in this process (gpu_check.run_guarded starts it, with gpu_check's arguments)."""
    args = gc.parse_args(sys.argv[1:] if argv is None else argv)
    torch.manual_seed(0)
    guard = args.guard or gc.TINY_GUARD_S
    section = Section(args.section, torch.device(args.device), args.tiny, Path(args.workdir),
                      deadline=time.monotonic() + guard, peak_tflops=args.peak_tflops)
    SECTIONS[args.section](section)
    section.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
