"""benchmarks/gpu_check.py: its pure arithmetic, its bad-input lines, and its tiny CPU mode end to end
(so the GPU check cannot rot while no GPU runs it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from benchmarks import gpu_check as gc
from tests.conftest import ROOT

# ----------------------------------------------------------------------------- pure helpers


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989.4),
    ("NVIDIA H100 PCIe", 756.0),
    ("NVIDIA H200", 989.4),
    ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA L40S", 362.1),  # not the L40's or the L4's figure, though both names are inside it
    ("NVIDIA L4", 121.0),
    ("NVIDIA A10", 125.0),
])
def test_peak_table_matches_the_most_specific_name(name, peak):
    value, source = gc.assumed_peak_bf16_tflops(name)
    assert value == peak and "dense bf16" in source


def test_peak_is_null_with_a_reason_where_none_can_be_assumed():
    assert gc.assumed_peak_bf16_tflops("Tesla V100-SXM2-16GB") == (None, "Volta has no bf16 tensor cores")
    value, reason = gc.assumed_peak_bf16_tflops("Some Future GPU")
    assert value is None and "not in the table" in reason and "--peak-tflops" in reason
    assert gc.assumed_peak_bf16_tflops(None) == (None, "no peak is assumed for a CPU")
    assert gc.assumed_peak_bf16_tflops("Some Future GPU", 500) == (500.0, "given with --peak-tflops")


def test_mfu_is_counted_flops_per_second_over_the_peak():
    # 3.3 GFLOP per image at 100,000 images/s is 330 TFLOP/s: a third of a 990 TFLOP/s peak
    assert gc.mfu(3.3e9, 1e5, 990.0) == pytest.approx(1 / 3)
    assert gc.mfu(3.3e9, 1e5, None) is None


def test_per_step_count_separates_steps_from_the_fit():
    # 2 syncs per step and 3 per fit (the epoch's .item() calls): 11 in 4 steps, 27 in 12
    assert gc.per_step_count(11, 4, 27, 12) == (2.0, 3.0)
    assert gc.per_step_count(3, 4, 3, 12) == (0.0, 3.0)
    with pytest.raises(ValueError):
        gc.per_step_count(1, 4, 2, 4)


def test_sync_and_determinism_warnings_are_recognised():
    assert gc.is_sync_warning("called a synchronizing CUDA operation (Triggered internally at ...)")
    assert not gc.is_sync_warning("TypedStorage is deprecated")
    stderr = ("x.py:3: UserWarning: scatter_add_cuda_kernel does not have a deterministic implementation, but ...\n"
              "y.py:9: UserWarning: upsample_bilinear2d_backward_out_cuda does not have a deterministic implementation\n"
              "x.py:3: UserWarning: scatter_add_cuda_kernel does not have a deterministic implementation, but ...\n")
    assert gc.nondeterministic_ops(stderr) == ["scatter_add_cuda_kernel", "upsample_bilinear2d_backward_out_cuda"]


def test_bf16_rounding_erases_a_faint_trigger_on_large_inputs_only():
    # bf16 keeps 8 significant bits: values in [2, 4) are 2**-6 apart, values near 0.01 about 6e-5
    delta = 1e-3
    large = torch.full((1000,), 2.5)
    small = torch.full((1000,), 0.01)
    assert gc.bf16_kept_fraction(large, large + delta)["rounded_away"] == 1.0
    kept = gc.bf16_kept_fraction(small, small + delta)
    assert kept["rounded_away"] == 0.0 and kept["l1_ratio"] == pytest.approx(1.0, abs=0.05)


def test_effect_agreement_of_equal_and_of_opposite_effects():
    effect = torch.randn(50, 10, generator=torch.Generator().manual_seed(0))
    same = gc.effect_agreement(effect, effect.clone())
    assert same["median_relative_error"] == 0.0 and same["mean_cosine"] == pytest.approx(1.0)
    flipped = gc.effect_agreement(effect, -effect)
    assert flipped["median_relative_error"] == pytest.approx(2.0) and flipped["mean_cosine"] == pytest.approx(-1.0)


def test_targets_pass_fail_and_not_measured():
    sections = {
        "throughput": {"result": {
            "mnist_cnn_batch128": {"model": "mnist_cnn", "batch_size": 128, "ratio_to_best_dataloader": 6.0},
            "mnist_cnn_batch512": {"model": "mnist_cnn", "batch_size": 512, "ratio_to_best_dataloader": 4.9},
            "preact_resnet18_batch512": {"model": "preact_resnet18", "batch_size": 512, "ours_mfu": None},
            "preact_resnet18_batch128": {"error": "OutOfMemoryError: CUDA out of memory"},
        }},
        "host_syncs": {"result": {"mnist_cnn": {"syncs_per_step": 0.0}, "preact_resnet18": {"syncs_per_step": 1.0}}},
    }
    verdicts = {t["name"]: t["pass"] for t in gc.targets(sections)}
    assert verdicts == {
        "mnist_cnn ours / best DataLoader, batch 128": True,
        "mnist_cnn ours / best DataLoader, batch 512": False,
        "preact_resnet18 MFU of ours, batch 512": None,
        "host syncs per step, mnist_cnn": True,
        "host syncs per step, preact_resnet18": False,
    }
    assert {t["pass"] for t in gc.targets(sections, device="cpu")} == {None}  # GPU targets, not judged on a CPU


def test_has_numbers_ignores_errors_and_flags():
    assert gc.has_numbers({"a": {"b": [1.5]}})
    assert not gc.has_numbers({"a": {"error": "boom"}, "ok": True, "x": float("nan")})


def test_gpu_pack_is_the_joblib_launcher_with_its_own_n_jobs():
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from backdoorbench.config import ignore_launcher_schema_match

    ignore_launcher_schema_match()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module="backdoorbench.conf", version_base="1.3"):
            pack = compose(config_name="config", overrides=["hydra/launcher=gpu_pack"], return_hydra_config=True)
            joblib = compose(config_name="config", overrides=["hydra/launcher=joblib"], return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()
    assert pack.hydra.launcher.n_jobs == 4
    assert {**pack.hydra.launcher, "n_jobs": None} == {**joblib.hydra.launcher, "n_jobs": None}


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("args, message", [
    (["--sections", "throughput,speed"], "--sections 'throughput,speed' names no known section (speed); choose from:"),
    (["--device", "tpu"], "--device 'tpu' is unknown; use auto, cuda or cpu"),
    (["--budget", "-5"], "--budget -5.0 must be a positive number of seconds"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, args, message):
    out = tmp_path / "report.json"
    device = [] if "--device" in args else ["--device", "cpu"]
    assert gc.main(["--out", str(out), *device, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_an_existing_report_is_never_overwritten(tmp_path, capsys):
    out = tmp_path / "report.json"
    out.write_text("{}")
    assert gc.main(["--device", "cpu", "--out", str(out)]) == 2
    assert "exists and a report is never overwritten" in capsys.readouterr().err
    assert out.read_text() == "{}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU this would start the full check")
def test_without_a_gpu_the_full_sizes_need_tiny_or_an_explicit_cpu(tmp_path, capsys):
    assert gc.main(["--out", str(tmp_path / "report.json")]) == 2
    assert "add --tiny for every section at a tiny size, or --device cpu to insist" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- the guard


def guard_args(device: str = "cpu"):
    return gc.parse_args(["--device", device, "--tiny"])


def test_a_section_past_its_guard_is_killed_and_recorded(tmp_path):
    entry = gc.run_guarded("environment", guard_args(), tmp_path, guard_s=0.5)
    assert entry["status"] == "timeout" and entry["error"] == "stopped by its 0.5 s guard"
    assert entry["seconds"] < 10 and entry["result"] == {}


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA to make the section fail")
def test_a_failing_section_is_recorded_with_its_last_lines(tmp_path):
    entry = gc.run_guarded("environment", guard_args("cuda"), tmp_path, guard_s=120)
    assert entry["status"] == "error" and entry["error"].startswith("exit 1: ")
    assert "Error" in entry["error"]  # the exception's last line, e.g. torch's "no NVIDIA driver"


# ----------------------------------------------------------------------------- the tiny CPU mode


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check") / "report.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--tiny",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout, out


@pytest.mark.slow
def test_tiny_cpu_mode_runs_every_section_or_says_why_not(tiny_report):
    report, stdout, out = tiny_report
    assert report["format"] == gc.FORMAT and report["device"] == "cpu" and report["tiny"] is True
    assert list(report["sections"]) == list(gc.SECTION_NAMES)
    for name, section in report["sections"].items():
        assert section["status"] in ("ok", "skipped"), (name, section)
        if section["status"] == "skipped":
            assert section["reason"], name
        else:
            assert gc.has_numbers(section["result"]), name
    assert report["sections"]["host_syncs"] == {"status": "skipped", "reason": "no CUDA"}
    assert "host_syncs" in stdout and "no CUDA" in stdout and f"report: {out}" in stdout
    assert "not judged (a GPU target)" in stdout
    assert [p.name for p in out.parent.iterdir()] == ["report.json"]  # written atomically: no temp file left


@pytest.mark.slow
def test_tiny_cpu_mode_measures_what_each_section_promises(tiny_report):
    sections = tiny_report[0]["sections"]
    env = sections["environment"]["result"]
    assert env["torch"] == torch.__version__ and env["peak_bf16_tflops"] is None and "CPU" in env["peak_source"]
    rows = [r for r in sections["throughput"]["result"].values() if isinstance(r, dict)]
    assert {r["model"] for r in rows} == {"preact_resnet18", "mnist_cnn"}
    for row in rows:
        assert row["ours_images_per_s"] > 0 and min(row["dataloader_images_per_s"].values()) > 0
        assert row["ratio_to_best_dataloader"] == pytest.approx(
            row["ours_images_per_s"] / max(row["dataloader_images_per_s"].values()))
        assert row["ours_mfu"] is None  # no peak assumed for a CPU: null, not a made-up number
    # the same seed twice on the CPU gives the same metrics, and one gloo process gives them too
    plain = sections["default_job"]["result"]["plain"]
    assert plain["identical"] is True and len(plain["runs"]) == 2
    ddp = sections["ddp"]["result"]
    assert ddp["backend"] == "gloo" and ddp["nproc_1"]["world_size"] == 1
    assert ddp["nproc_1"]["metrics"] == plain["runs"][0]["metrics"]
    precision = sections["precision"]["result"]
    assert set(precision) == {"test_eps_0.0025_trained_fp32", "test_eps_0.005_trained_fp32"}
    for row in precision.values():
        assert {"eval_autocast", "eval_fp32", "logit_effect", "bf16_input"} <= set(row)
    packing = sections["packing"]["result"]
    assert packing["n_jobs_1"]["jobs"] == 1 and packing["n_jobs_2"]["jobs"] == 2 and packing["best_n_jobs"] in (1, 2)
