"""One command that proves the GPU path: throughput, host syncs, precision, compile, packing, DDP.

    python benchmarks/gpu_check.py --out gpu_check.json                  # the GPU it finds, about 8 min
    python benchmarks/gpu_check.py --device cpu --tiny --out /tmp/g.json # every section, tiny, on the CPU
    python benchmarks/gpu_check.py --sections throughput,compile --out t.json   # a subset

Eight sections, each in its own process under a time guard (a section that fails or runs out of
time is recorded with its error and whatever numbers it had; the others still run):
  1 environment   device, memory, torch/CUDA/cuDNN versions, the peak bf16 TFLOP/s assumed for it
  2 throughput    images/s of one epoch, our Trainer against a torchvision Dataset + DataLoader
                  (4 and 8 workers), preact_resnet18 on CIFAR-shaped data (50,000 x 3x32x32) and
                  mnist_cnn on mnist5k, batch 128 and 512; the ratio; model FLOP utilisation (MFU)
                  from torch.utils.flop_counter counts and the assumed peak
  3 host_syncs    synchronisations per training step under torch.cuda.set_sync_debug_mode("warn")
  4 default_job   `python -m backdoorbench device=...` twice with one seed (and twice more with
                  torch.use_deterministic_algorithms on CUDA): wall time, CA, ASR, identical?
  5 precision     LIRA at test_eps 0.0025 and 0.005 px: the trigger's logit effect and the ASR
                  under bf16 autocast against fp32, and how much of the trigger bf16 inputs keep
  6 compile       trainer.compile=true against eager: step time and compile time
  7 packing       1, 2, 4, 8 concurrent mnist5k runs as one joblib sweep on one device: runs/hour
  8 ddp           torchrun (NCCL on CUDA, gloo on the CPU) with 1 process and one per GPU: the
                  record's metrics against one process
Standing targets, reported pass/fail: mnist_cnn >= 5x the DataLoader pipeline, preact_resnet18
>= 40% MFU at batch 512, zero host syncs per step. The JSON (`--out`, written atomically, never
over an existing file) holds every number; the table is printed at the end.
With --tiny on the CPU: host_syncs is skipped (no CUDA), compile is skipped (inductor's cold C++
build of mnist_cnn took 87 s on the 2-core test box), the rest run at tiny sizes (packing N=1,2
without training; DDP gloo with 1 process; precision under CPU bf16 autocast). The targets are GPU
targets: on a CPU their values are shown but not judged.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

FORMAT = "backdoorbench.gpu_check.v1"
ROOT = Path(__file__).resolve().parent.parent
SECTION_NAMES = ("environment", "throughput", "host_syncs", "default_job", "precision", "compile", "packing", "ddp")
# The order they run in: short and telling first, so that if the budget runs out it is the long
# sweep of packing (whose finished parts are kept) that is cut, not ddp or the sync count.
RUN_ORDER = ("environment", "host_syncs", "default_job", "ddp", "throughput", "precision", "compile", "packing")
# Seconds each section may take on one H100/H200-class GPU; their sum exceeds the overall budget,
# because most finish well inside theirs (see the README's GPU section for the plan).
GUARD_S = {"environment": 60, "throughput": 150, "host_syncs": 60, "default_job": 150, "precision": 120,
           "compile": 150, "packing": 240, "ddp": 120}
TINY_GUARD_S = 300  # generous: the tiny sizes finish in seconds, but a shared CPU box may be loaded
RESERVE_S = 15  # kept back for every later section, so one slow section cannot starve the rest

# Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's datasheets, TFLOP/s, matched in order
# against torch.cuda.get_device_name (more specific names first: "L40S" before "L40" before "L4").
PEAK_BF16_TFLOPS: tuple[tuple[str, float | None, str], ...] = (
    ("GH200", 989.4, "H100/H200 SXM datasheet, dense bf16"),
    ("H200", 989.4, "H200 SXM datasheet, dense bf16 (the NVL part is lower: pass --peak-tflops)"),
    ("H100 PCIe", 756.0, "H100 PCIe datasheet, dense bf16"),
    ("H100 NVL", 835.0, "H100 NVL datasheet, dense bf16"),
    ("H100", 989.4, "H100 SXM datasheet, dense bf16"),
    ("B200", 2250.0, "B200 datasheet, dense bf16"),
    ("A100", 312.0, "A100 datasheet, dense bf16"),
    ("L40S", 362.1, "L40S datasheet, dense bf16"),
    ("L40", 181.0, "L40 datasheet, dense bf16"),
    ("L4", 121.0, "L4 datasheet, dense bf16"),
    ("A10G", None, "no datasheet bf16 figure known for the A10G; pass --peak-tflops"),
    ("A10", 125.0, "A10 datasheet, dense bf16"),
    ("RTX 4090", 165.2, "RTX 4090 (Ada) whitepaper, dense bf16 with fp32 accumulate"),
    ("RTX A6000", 154.8, "RTX A6000 datasheet, dense bf16"),
    ("V100", None, "Volta has no bf16 tensor cores"),
    ("T4", None, "Turing has no bf16 tensor cores"),
)
TARGETS = {"mnist_cnn_ratio": 5.0, "preact_resnet18_mfu": 0.40, "syncs_per_step": 0.0}


class UsageError(Exception):
    """Bad command-line input: one line, exit 2, nothing written."""


# ----------------------------------------------------------------------------------- pure helpers


def assumed_peak_bf16_tflops(device_name: str | None, override: float | None = None) -> tuple[float | None, str]:
    """(peak dense bf16 TFLOP/s, where it comes from); (None, why) when none can be assumed."""
    if override is not None:
        return float(override), "given with --peak-tflops"
    if device_name is None:
        return None, "no peak is assumed for a CPU"
    for pattern, value, source in PEAK_BF16_TFLOPS:
        if pattern.lower() in device_name.lower():
            return value, source
    return None, f"{device_name!r} is not in the table of known GPUs; pass --peak-tflops"


def mfu(flops_per_image: float, images_per_s: float, peak_tflops: float | None) -> float | None:
    """Model FLOP utilisation: the model's counted training FLOPs per second over the peak."""
    if peak_tflops is None or peak_tflops <= 0:
        return None
    return flops_per_image * images_per_s / (peak_tflops * 1e12)


def is_sync_warning(message: str) -> bool:
    """The warning torch.cuda.set_sync_debug_mode("warn") gives for each synchronising call."""
    return "called a synchronizing CUDA operation" in message


def per_step_count(count_a: int, steps_a: int, count_b: int, steps_b: int) -> tuple[float, float]:
    """From two fits of different lengths, (events per step, events per fit outside the steps):
    count = per_step * steps + per_fit."""
    if steps_a == steps_b:
        raise ValueError("two fits of different lengths are needed to separate the two counts")
    per_step = (count_b - count_a) / (steps_b - steps_a)
    return per_step, count_a - per_step * steps_a


def runs_per_hour(runs: int, seconds: float) -> float:
    return 3600.0 * runs / seconds


def max_abs_difference(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    """Largest |a[k] - b[k]| over the numeric keys both have; None when they share none."""
    diffs = [abs(a[k] - b[k]) for k in a.keys() & b.keys()
             if isinstance(a[k], (int, float)) and isinstance(b[k], (int, float))]
    return max(diffs) if diffs else None


def nondeterministic_ops(stderr: str) -> list[str]:
    """Operations that torch.use_deterministic_algorithms(warn_only=True) warned about."""
    return sorted(set(re.findall(r"(\S+) does not have a deterministic implementation", stderr)))


def effect_agreement(fp32, bf16) -> dict[str, float]:
    """How a trigger's logit effect (f(T(x)) - f(x), one row per image) computed under bf16
    autocast compares with the fp32 one: mean norms, median relative error, mean cosine."""
    import torch

    norm32, norm16 = fp32.norm(dim=1), bf16.norm(dim=1)
    relative = (bf16 - fp32).norm(dim=1) / norm32.clamp_min(1e-12)
    cosine = torch.nn.functional.cosine_similarity(fp32, bf16, dim=1)
    return {"mean_norm_fp32": float(norm32.mean()), "mean_norm_bf16": float(norm16.mean()),
            "median_relative_error": float(relative.median()), "mean_cosine": float(cosine.mean())}


def bf16_kept_fraction(clean, triggered) -> dict[str, float]:
    """What rounding the model's (normalised) input to bf16, as autocast does before the first
    convolution, leaves of a trigger: the L1 mass of the difference after rounding over before
    (can exceed 1: rounding also enlarges some differences), and the share of changed values
    whose change rounds away entirely."""
    import torch

    before = (triggered - clean).abs()
    after = (triggered.to(torch.bfloat16).float() - clean.to(torch.bfloat16).float()).abs()
    changed = before > 0
    return {"l1_ratio": float(after.sum() / before.sum().clamp_min(1e-12)),
            "rounded_away": float((after[changed] == 0).float().mean()) if changed.any() else 0.0}


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__


def last_lines(text: str, count: int) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[-count:])[-600:]


def has_numbers(node: Any) -> bool:
    """Whether a section's result holds at least one measured number (not only errors)."""
    if isinstance(node, bool):
        return False
    if isinstance(node, (int, float)):
        return math.isfinite(node)
    if isinstance(node, dict):
        return any(has_numbers(v) for k, v in node.items() if k != "error")
    if isinstance(node, list):
        return any(has_numbers(v) for v in node)
    return False


def targets(sections: dict[str, Any], device: str = "cuda") -> list[dict[str, Any]]:
    """The standing targets, each with its measured value and pass/fail (None: not measured, or
    measured on a CPU: they are GPU targets)."""
    out = []
    rows = sections.get("throughput", {}).get("result", {})
    for key, row in sorted(rows.items()):
        if not isinstance(row, dict) or "error" in row:
            continue
        if row.get("model") == "mnist_cnn":
            value = row.get("ratio_to_best_dataloader")
            out.append({"name": f"mnist_cnn ours / best DataLoader, batch {row['batch_size']}", "value": value,
                        "threshold": f">= {TARGETS['mnist_cnn_ratio']}",
                        "pass": None if value is None else value >= TARGETS["mnist_cnn_ratio"]})
        if row.get("model") == "preact_resnet18" and row.get("batch_size") == 512:
            value = row.get("ours_mfu")
            out.append({"name": "preact_resnet18 MFU of ours, batch 512", "value": value,
                        "threshold": f">= {TARGETS['preact_resnet18_mfu']}",
                        "pass": None if value is None else value >= TARGETS["preact_resnet18_mfu"]})
    for model, row in sorted(sections.get("host_syncs", {}).get("result", {}).items()):
        if isinstance(row, dict) and "syncs_per_step" in row:
            value = row["syncs_per_step"]
            out.append({"name": f"host syncs per step, {model}", "value": value, "threshold": "== 0",
                        "pass": value == TARGETS["syncs_per_step"]})
    if device != "cuda":
        for t in out:
            t["pass"] = None
    return out


def fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _rows_environment(r: dict[str, Any]) -> list[tuple[str, str]]:
    memory = f", {r['memory_gib']} GiB" if r.get("memory_gib") else ""
    return [("device", f"{r['device']}: {r.get('device_name')}{memory}"),
            ("torch / CUDA / cuDNN", f"{r['torch']} / {r.get('cuda')} / {r.get('cudnn')}"),
            ("peak bf16 TFLOP/s assumed", f"{fmt(r.get('peak_bf16_tflops'))} ({r.get('peak_source')})")]


def _rows_throughput(r: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    for row in (v for v in r.values() if isinstance(v, dict) and "model" in v):
        loaders = " / ".join(f"{v:.0f}" for v in row["dataloader_images_per_s"].values())
        rows.append((f"{row['model']} batch {row['batch_size']}: img/s ours / DataLoader w{'/w'.join(map(str, r['workers']))}",
                     f"{row['ours_images_per_s']:.0f} / {loaders}; {row['ratio_to_best_dataloader']:.2f}x; MFU {pct(row['ours_mfu'])}"))
    return rows


def _rows_host_syncs(r: dict[str, Any]) -> list[tuple[str, str]]:
    return [(f"{model}: syncs per step (per fit)", f"{fmt(row['syncs_per_step'])} ({fmt(row['syncs_per_fit'])})")
            for model, row in r.items() if isinstance(row, dict) and "syncs_per_step" in row]


def _rows_default_job(r: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    for mode, entry in r.items():
        if isinstance(entry, dict) and "skipped" in entry:
            rows.append((f"{mode}: the same seed twice", f"skipped: {entry['skipped']}"))
        if not isinstance(entry, dict) or "runs" not in entry:
            continue
        runs = [f"{run['wall_s']:.1f} s, CA {pct(run['metrics']['clean_acc'])}, ASR {pct(run['metrics']['asr'])}"
                for run in entry["runs"] if "metrics" in run]
        same = {True: "identical", False: f"differ by up to {fmt(entry.get('max_abs_difference'))}"}.get(entry.get("identical"), "-")
        rows.append((f"{mode}: the same seed twice", f"{'; '.join(runs)}; {same}"))
    return rows


def _rows_precision(r: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    for row in (v for v in r.values() if isinstance(v, dict) and "test_eps" in v):
        effect, rounding = row["logit_effect"], row["bf16_input"]
        rows.append((f"LIRA test_eps {row['test_eps']}, trained {row['trained_under']}: ASR autocast / fp32",
                     f"{pct(row['eval_autocast']['asr'])} / {pct(row['eval_fp32']['asr'])}; logit effect bf16 vs fp32: "
                     f"rel. error {effect['median_relative_error']:.3g}, cosine {effect['mean_cosine']:.3f}; "
                     f"bf16 input rounds away {pct(rounding['rounded_away'])} of the changed values"))
    return rows


def _rows_compile(r: dict[str, Any]) -> list[tuple[str, str]]:
    eager, compiled = r.get("eager", {}), r.get("compiled", {})
    return [(f"{r.get('model')} batch {r.get('batch_size')}: step ms eager / compiled",
             f"{fmt(eager.get('step_ms'))} / {fmt(compiled.get('step_ms'))}; speed-up {fmt(r.get('speedup'))}; "
             f"compile {fmt(r.get('compile_s'))} s")]


def _rows_packing(r: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [(f"n_jobs {row['jobs']}: runs per hour", f"{row['runs_per_hour']:.0f} ({row['jobs']} run(s) in {row['wall_s']:.1f} s)")
            for row in r.values() if isinstance(row, dict) and "runs_per_hour" in row]
    if "setting" in r:
        rows.append(("best", r["setting"]))
    return rows


def _rows_ddp(r: dict[str, Any]) -> list[tuple[str, str]]:
    return [(f"{r['backend']}, {row['nproc_per_node']} process(es): CA / ASR",
             f"{pct(row['metrics']['clean_acc'])} / {pct(row['metrics']['asr'])}; "
             f"vs one process: max difference {fmt(row.get('max_abs_difference_to_one_process'))}")
            for row in r.values() if isinstance(row, dict) and "nproc_per_node" in row]


SUMMARIES = {"environment": _rows_environment, "throughput": _rows_throughput, "host_syncs": _rows_host_syncs,
             "default_job": _rows_default_job, "precision": _rows_precision, "compile": _rows_compile,
             "packing": _rows_packing, "ddp": _rows_ddp}


def errors_in(node: Any, prefix: str = "") -> list[tuple[str, str]]:
    """(where, error) of every part of a section that failed."""
    if not isinstance(node, dict):
        return []
    found = [(prefix or "section", str(node["error"]))] if "error" in node else []
    for key, value in node.items():
        found += errors_in(value, f"{prefix}.{key}" if prefix else str(key))
    return found


def table(report: dict[str, Any]) -> str:
    """The printed summary, one row per measurement (every number is in the JSON), then the targets."""
    rows: list[tuple[str, str, str]] = []
    for name, section in report["sections"].items():
        label = f"{name} ({section.get('seconds', 0):.0f} s)" if "seconds" in section else name
        if section["status"] == "skipped":
            rows.append((label, "skipped", section["reason"]))
            continue
        if section["status"] != "ok":
            rows.append((label, section["status"], section.get("error", "")))
        result = section.get("result", {})
        try:
            measured = SUMMARIES[name](result)
        except (KeyError, TypeError, ValueError):  # a part missing: the partial result as it is
            measured = [("(partial)", json.dumps(result)[:160])]
        measured += [(f"{where}: error", error) for where, error in errors_in(result)]
        rows += [(label if i == 0 and section["status"] == "ok" else "", what, value) for i, (what, value) in enumerate(measured)]
    for t in report["targets"]:
        verdict = {True: "PASS", False: "FAIL", None: "not judged (a GPU target)" if report["device"] != "cuda"
                   else "not measured"}[t["pass"]]
        rows.append(("target", f"{t['name']} {t['threshold']}", f"{fmt(t['value'])}: {verdict}"))
    if not report["targets"]:
        rows.append(("target", "none measured", "-"))
    first = max(len(r[0]) for r in rows)
    second = max(len(r[1]) for r in rows)
    head = f"gpu_check on {report['device']}{', tiny' if report['tiny'] else ''}, {report['wall_s']:.0f} s"
    return "\n".join([head] + [f"{a:<{first}}  {b:<{second}}  {c}" for a, b, c in rows])


# ----------------------------------------------------------------------------------- orchestration


def run_guarded(name: str, args: argparse.Namespace, workdir: Path, guard_s: float) -> dict[str, Any]:
    """One section in its own process (isolated debug modes, determinism flags and compile
    caches), killed with everything it started when `guard_s` runs out."""
    argv = [sys.executable, "-m", "benchmarks.gpu_sections", "--section", name, "--workdir", str(workdir),
            "--device", args.device, "--guard", str(guard_s)]
    argv += ["--tiny"] if args.tiny else []
    argv += ["--peak-tflops", str(args.peak_tflops)] if args.peak_tflops is not None else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    if name == "compile":  # a user's first compile is a cold one: inductor's on-disk caches would hide it
        env["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"
    log = workdir / f"{name}.log"
    started = time.monotonic()
    with open(log, "w") as handle:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=guard_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the section's own process group: it and its children
            proc.wait()
            timed_out = True
    seconds = round(time.monotonic() - started, 2)
    saved = workdir / f"{name}.json"
    result = json.loads(saved.read_text()) if saved.exists() else {}
    entry: dict[str, Any] = {"status": "ok", "seconds": seconds, "result": result}
    if timed_out:
        entry.update(status="timeout", error=f"stopped by its {guard_s:.3g} s guard")
    elif proc.returncode != 0:
        entry.update(status="error", error=f"exit {proc.returncode}: {last_lines(log.read_text(), 2)}")
    elif not has_numbers(result):
        entry.update(status="error", error="no numbers: " + (last_lines(log.read_text(), 2) or "nothing measured"))
    return entry


def skip_reason(name: str, device: str, tiny: bool) -> str | None:
    if name == "host_syncs" and device != "cuda":
        return "no CUDA"
    if name == "compile" and device != "cuda" and tiny:
        return "no CUDA; inductor's C++ build of mnist_cnn takes minutes on a CPU (run without --tiny for it)"
    return None


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_check.json", help="the JSON report (never overwritten)")
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cuda or cpu")
    parser.add_argument("--tiny", action="store_true", help="every section at a tiny size (the CPU test)")
    parser.add_argument("--sections", default=",".join(SECTION_NAMES), help="comma-separated subset to run")
    parser.add_argument("--budget", type=float, default=None, help="overall seconds (default 480; 900 with --tiny)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's peak bf16 TFLOP/s, if not in the table")
    # internal: the arguments of one section's process (python -m benchmarks.gpu_sections), which parses them here
    parser.add_argument("--section", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--guard", type=float, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> tuple[str, list[str], Path]:
    """The device, the sections and the output path, or one UsageError line, before anything runs."""
    import torch

    if args.device not in ("auto", "cuda", "cpu"):
        raise UsageError(f"--device {args.device!r} is unknown; use auto, cuda or cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda asked for CUDA but no GPU is visible; use --device auto or cpu")
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    if args.device == "auto" and device == "cpu" and not args.tiny:
        raise UsageError("no GPU is visible and the full sizes are meant for one (hours on a CPU); "
                         "add --tiny for every section at a tiny size, or --device cpu to insist")
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTION_NAMES]
    if unknown or not sections:
        raise UsageError(f"--sections {args.sections!r} names no known section ({', '.join(unknown)}); "
                         f"choose from: {', '.join(SECTION_NAMES)}")
    if args.budget is not None and args.budget <= 0:
        raise UsageError(f"--budget {args.budget} must be a positive number of seconds")
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        raise UsageError(f"--peak-tflops {args.peak_tflops} must be a positive TFLOP/s figure")
    out = Path(args.out).expanduser()
    if out.exists():
        raise UsageError(f"--out {str(out)!r} exists and a report is never overwritten; give a new path")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out.parent):
            pass
    except OSError as exc:
        raise UsageError(f"--out {str(out)!r} cannot be written ({exc.strerror or exc}); choose a folder you can write to")
    return device, sections, out


def run_all(args: argparse.Namespace) -> int:
    from backdoorbench.fileio import atomic_write_text

    device, names, out = check_args(args)
    args.device = device
    budget = args.budget or (900.0 if args.tiny else 480.0)
    started = time.monotonic()
    report: dict[str, Any] = {
        "format": FORMAT, "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/gpu_check.py", *sys.argv[1:]]), "device": device,
        "tiny": args.tiny, "budget_s": budget, "sections": {},
    }
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        workdir = Path(tmp)

        def lane(names_in_lane: list[str], count_later: bool) -> None:
            for i, name in enumerate(names_in_lane):
                reason = skip_reason(name, device, args.tiny)
                later = len(names_in_lane) - i - 1 if count_later else 0
                left = budget - (time.monotonic() - started) - RESERVE_S * later
                if reason is None and left < 10:
                    reason = f"the overall budget of {budget:.0f} s was spent (--budget)"
                if reason is not None:
                    entry = {"status": "skipped", "reason": reason}
                else:
                    entry = run_guarded(name, args, workdir, min(TINY_GUARD_S if args.tiny else GUARD_S[name], left))
                report["sections"][name] = entry
                print(f"{name}: {entry['status']} ({entry.get('seconds', 0):.0f} s)"
                      + (f" {entry.get('error') or entry.get('reason')}" if entry["status"] != "ok" else ""),
                      file=sys.stderr, flush=True)

        if args.tiny:
            # Tiny numbers mean nothing, so two sections run at a time (half the wall time on two
            # cores); ddp follows default_job in one lane, as it reuses that run's metrics. The
            # full check runs one section after another, so that no timing shares the machine.
            first = [n for n in names if n in ("environment", "default_job", "ddp")]
            with ThreadPoolExecutor(max_workers=2) as pool:
                for future in [pool.submit(lane, first, False), pool.submit(lane, [n for n in names if n not in first], False)]:
                    future.result()
            report["sections"] = {n: report["sections"][n] for n in names}
        else:
            lane(sorted(names, key=RUN_ORDER.index), True)
            report["sections"] = {n: report["sections"][n] for n in names}
    report["wall_s"] = round(time.monotonic() - started, 2)
    report["targets"] = targets(report["sections"], device)
    atomic_write_text(out, json.dumps(report, indent=1) + "\n")
    print(table(report))
    print(f"report: {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return run_all(args)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
