"""Where a run's numbers came from: the code's commit, the versions, the device and processor, the command."""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy
import torch

import backdoorbench
from backdoorbench import distributed


@functools.lru_cache(maxsize=1)
def git_commit() -> dict[str, Any]:
    """The commit (and dirtiness) of the code when this process first asked: a multirun keeps
    running the modules it imported, so a commit made meanwhile must not be credited with its runs."""
    root = Path(backdoorbench.__file__).resolve().parent.parent
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None
    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"git_commit": commit, "git_dirty": bool(status) if status is not None else None}


def torchvision_version() -> str:
    """torchvision's `__version__` (with its local build tag, e.g. +cu130), read without importing it
    where no module has yet: its import pulls in torch._dynamo, seconds of every run's start-up."""
    module = sys.modules.get("torchvision")
    if module is not None:
        return module.__version__
    spec = importlib.util.find_spec("torchvision")
    if spec is not None and spec.origin:
        try:
            text = Path(spec.origin).with_name("version.py").read_text(encoding="utf-8")
        except OSError:
            text = ""
        match = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
        if match:
            return match.group(1)
    return importlib.metadata.version("torchvision")


def _program() -> str:
    name = Path(sys.argv[0]).name
    return "python -m backdoorbench" if name == "__main__.py" else name


def _cpu_model() -> str:
    """The processor's model name (Linux /proc/cpuinfo; elsewhere platform.processor()), or ""."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def environment(device: torch.device) -> dict[str, Any]:
    """The record's `env` block: versions, commit, device, threads, CPU and the command that ran."""
    name = str(device)
    if device.type == "cuda":
        name = f"{device} ({torch.cuda.get_device_name(device)})"
    return {
        "backdoorbench": backdoorbench.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision_version(),
        "numpy": numpy.__version__,
        **dict(git_commit()),
        "device": name,
        "torch_threads": torch.get_num_threads(),
        # the vector ISA torch's CPU kernels use (ATEN_CPU_CAPABILITY can lower it) and the processor:
        # CPU numbers repeat to the bit on the same ISA; another one rounds differently, and a chaotic
        # defense (NAD) then moves by points at the same seed (docs/fidelity.md#reproducibility)
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu": _cpu_model(),
        "world_size": distributed.world_size(),  # processes of a torchrun (DDP) run, else 1
        "platform": platform.platform(),
        "command": " ".join([_program(), *sys.argv[1:]]),
    }
