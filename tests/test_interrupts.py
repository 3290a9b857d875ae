"""Signal-safe writes and file-system faults in one line.

A termination signal (Slurm's SIGUSR2 warning, SIGTERM, Ctrl-C) that arrives while a checkpoint is
being written is handled once the file is whole and in place; a finished submitit job ignores a
late requeue signal; a write the file system refuses (full disk, read-only, permission) is one
StorageError line naming the path, and leaves no temp file."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from backdoorbench import fileio, interrupts
from backdoorbench.errors import StorageError, UserError
from tests.conftest import ROOT


class Requeued(SystemExit):
    """What submitit's handler raises after `scontrol requeue` (sys.exit(-1))."""


@pytest.fixture
def usr2_handler():
    """A SIGUSR2 handler that records its calls and exits as submitit's does; restored after the test."""
    calls: list[int] = []

    def handler(signum, frame):
        calls.append(signum)
        raise Requeued(-1)

    previous = signal.signal(signal.SIGUSR2, handler)
    yield calls
    signal.signal(signal.SIGUSR2, previous)


class SignalMidWrite:
    """torch.save's target: after the first `after` bytes, the signal is sent to this process,
    as Slurm would send it, and writing goes on."""

    def __init__(self, handle, signum: int, after: int = 64) -> None:
        self.handle, self.signum, self.after, self.written, self.sent = handle, signum, after, 0, False

    def write(self, data) -> int:
        n = self.handle.write(data)
        self.written += len(data)
        if not self.sent and self.written >= self.after:
            self.sent = True
            os.kill(os.getpid(), self.signum)  # its Python handler would run at the next bytecode
        return n

    def flush(self) -> None:
        self.handle.flush()


def test_a_signal_during_a_checkpoint_write_is_handled_after_the_complete_file_is_in_place(
        tmp_path, monkeypatch, usr2_handler):
    path = tmp_path / "victim.pt"
    fileio.atomic_torch_save({"epoch": 1, "w": torch.zeros(10)}, path)
    state = {"epoch": 2, "w": torch.arange(100_000, dtype=torch.float32)}
    original = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, handle: original(obj, SignalMidWrite(handle, signal.SIGUSR2)))
    # Before the signals were held, the handler's SystemExit unwound through torch's zip writer,
    # which raised RuntimeError('... unexpected pos ...') in its place: a failed job, not a requeue.
    with pytest.raises(Requeued):
        fileio.atomic_torch_save(state, path)
    assert usr2_handler == [signal.SIGUSR2]  # handled once, after the write
    saved = torch.load(path, weights_only=True)
    assert saved["epoch"] == 2 and torch.equal(saved["w"], state["w"])  # the whole new checkpoint
    assert [p.name for p in tmp_path.iterdir()] == ["victim.pt"]  # no temp file left
    assert signal.getsignal(signal.SIGUSR2) is not interrupts._hold  # the handler is back


def test_signals_wait_for_the_end_of_the_outermost_hold_and_come_in_order_of_arrival():
    seen: list[str] = []
    previous = {s: signal.signal(s, lambda signum, frame: seen.append(signal.Signals(signum).name))
                for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)}
    try:
        with interrupts.held():
            signal.raise_signal(signal.SIGUSR2)
            with interrupts.held():
                signal.raise_signal(signal.SIGTERM)
                signal.raise_signal(signal.SIGUSR2)  # twice: handled once
            assert seen == [] and interrupts.pending() == (signal.SIGUSR2, signal.SIGTERM)
            seen.append("inner hold ended")
        assert seen == ["inner hold ended", "SIGUSR2", "SIGTERM"]
        assert interrupts.pending() == ()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def test_ctrl_c_during_a_write_still_interrupts_once_the_file_is_written(tmp_path, monkeypatch):
    path = tmp_path / "record.json"
    real_write = fileio.os.fsync

    def fsync_then_ctrl_c(fd):
        real_write(fd)
        signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(fileio.os, "fsync", fsync_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        fileio.atomic_write_text(path, "{}\n")
    assert path.read_text() == "{}\n"


class FakeSubmititHandler:
    """Stands for submitit's SignalHandler: interrupts.finished() recognises handlers of submitit's module."""

    def __init__(self) -> None:
        self.calls = 0

    def checkpoint_and_try_requeue(self, signum, frame):
        self.calls += 1


FakeSubmititHandler.__module__ = "submitit.core.job_environment"


def test_a_finished_job_ignores_a_later_requeue_signal_even_while_its_interpreter_exits():
    fake = FakeSubmititHandler()
    previous = signal.signal(signal.SIGUSR2, fake.checkpoint_and_try_requeue)
    try:
        with interrupts.held():
            signal.raise_signal(signal.SIGUSR2)  # lands while the record is written
            interrupts.finished()
        assert fake.calls == 0 and signal.getsignal(signal.SIGUSR2) is signal.SIG_IGN
        signal.raise_signal(signal.SIGUSR2)  # later: ignored, not a requeue
        assert fake.calls == 0
    finally:
        signal.signal(signal.SIGUSR2, previous)
    # Outside submitit, finished() leaves the handler alone.
    own = signal.signal(signal.SIGUSR2, lambda signum, frame: None)
    try:
        interrupts.finished()
        assert signal.getsignal(signal.SIGUSR2) is not signal.SIG_IGN
    finally:
        signal.signal(signal.SIGUSR2, own)


def test_sig_ign_survives_interpreter_exit_where_python_restores_the_default_action(tmp_path):
    # Python resets its handlers to SIG_DFL at exit, except SIG_IGN: a SIGUSR2 then no longer kills
    # the finished process (Slurm had called such a job FAILED, "User defined signal 2").
    script = ("import os, signal, atexit\n"
              "signal.signal(signal.SIGUSR2, signal.SIG_IGN)\n"
              "import threading\n"
              "def late():\n"
              "    import time; time.sleep(0.3); os.kill(os.getpid(), signal.SIGUSR2)\n"
              "t = threading.Thread(target=late, daemon=True); t.start()\n"
              "atexit.register(lambda: __import__('time').sleep(0.6))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, (proc.returncode, proc.stderr)
    default = subprocess.run([sys.executable, "-c", script.replace("signal.SIG_IGN", "signal.SIG_DFL")],
                             capture_output=True, text=True, timeout=60)
    assert default.returncode == -signal.SIGUSR2  # the control: without SIG_IGN the late signal kills it


def full_disk_temp(monkeypatch, tmp_path):
    """Writes go to /dev/full (ENOSPC from the kernel on every write), as on a full disk."""
    real = tempfile.mkstemp

    def mkstemp(dir=None, prefix=None, suffix=None):
        fd, name = real(dir=dir, prefix=prefix, suffix=suffix)
        os.close(fd)
        return os.open("/dev/full", os.O_WRONLY), name

    monkeypatch.setattr(fileio.tempfile, "mkstemp", mkstemp)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("writer", ["torch", "bytes"])
def test_a_full_disk_is_one_line_with_the_path_and_the_bytes_it_needed(tmp_path, monkeypatch, writer):
    full_disk_temp(monkeypatch, tmp_path)
    path = tmp_path / "checkpoints" / "victim.pt"
    if writer == "torch":
        obj = {"w": torch.zeros(50_000)}
        with pytest.raises(StorageError) as info:
            fileio.atomic_torch_save(obj, path)
        needed = fileio._torch_size(obj)
    else:
        with pytest.raises(StorageError) as info:
            fileio.atomic_write_bytes(path, b"x" * 250_000)
        needed = 250_000
    message = str(info.value)
    assert message.startswith(f"no space left on device writing {path} (it needs {fileio.human_bytes(needed)}, ")
    assert "\n" not in message and isinstance(info.value, UserError)  # the command line: one line, exit 2
    assert list(path.parent.iterdir()) == []  # no temp file, no partial file


@pytest.mark.parametrize(("code", "says"), [(errno.EROFS, "the file system is read-only"),
                                            (errno.EACCES, "permission denied"),
                                            (errno.EDQUOT, "disk quota exceeded")])
def test_a_folder_made_read_only_or_unwritable_mid_run_is_one_line(tmp_path, monkeypatch, code, says):
    def refused(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fileio.tempfile, "mkstemp", refused)
    path = tmp_path / "runs" / "r.json"
    with pytest.raises(StorageError, match=rf"writing {path}|cannot write {path}") as info:
        fileio.atomic_write_text(path, "{}")
    assert says in str(info.value) and "\n" not in str(info.value)


def test_an_existing_record_is_still_file_exists_not_a_storage_error(tmp_path):
    path = tmp_path / "r.json"
    fileio.write_new_bytes(path, b"1")
    with pytest.raises(FileExistsError):
        fileio.write_new_bytes(path, b"2")
    assert path.read_bytes() == b"1"


def test_human_bytes():
    assert [fileio.human_bytes(n) for n in (0, 999, 1536, 4_700_000, 3 * 10**12)] == \
        ["0 bytes", "999 bytes", "1.5 kB", "4.7 MB", "3.0 TB"]


@contextmanager
def tmpfs(folder: Path, size: str):
    """A real small file system at `folder` for the test's length (skipped where it can't be mounted)."""
    folder.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"a small tmpfs cannot be mounted here ({proc.stderr.strip() or proc.returncode}): "
                    "this test needs root and mount permission")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=False)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="mounts a tmpfs")
def test_a_run_on_a_full_results_dir_fails_in_one_line_naming_the_checkpoint_and_its_size(tmp_path):
    with tmpfs(tmp_path / "small", "200k") as small:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        proc = subprocess.run([sys.executable, "-m", "backdoorbench", f"results_dir={small / 'r'}", "trainer.epochs=1",
                               "logger=none", "trainer.progress=false", "eval.stealth_images=0"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert errors[0].startswith(f"error: no space left on device writing {small / 'r' / 'checkpoints'}")
        assert "victim.pt (it needs " in errors[0] and " free there)" in errors[0]
        left = [p for p in (small / "r").rglob("*") if p.is_file() and not p.name.endswith(".lock")]
        assert left == [], left  # nothing partial: no temp file, no record, no Hydra job files


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="mounts a tmpfs")
def test_a_results_dir_made_read_only_mid_training_is_one_line(tmp_path):
    from functools import partial

    from backdoorbench.datasets.base import Split
    from backdoorbench.train import Trainer

    with tmpfs(tmp_path / "ro", "64m") as folder:
        g = torch.Generator().manual_seed(0)
        split = Split(torch.randint(0, 256, (64, 3, 8, 8), dtype=torch.uint8, generator=g),
                      torch.randint(0, 4, (64,), generator=g))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 4))
        trainer = Trainer(epochs=3, batch_size=32, optimizer=partial(torch.optim.SGD, lr=0.05), augment=False,
                          progress=False, device="cpu")

        def read_only_after_first(row):
            if row["epoch"] == 1:
                subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)

        path = folder / "checkpoints" / "victim.pt"
        with pytest.raises(StorageError, match=rf"^cannot write {path}: the file system is read-only; "):
            trainer.fit(model, split, generator=torch.Generator().manual_seed(1), checkpoint=path,
                        on_epoch=read_only_after_first)
        assert [p.name for p in path.parent.iterdir()] == ["victim.pt"]  # epoch 1's, whole
        assert torch.load(path, weights_only=True)["epoch"] == 1
