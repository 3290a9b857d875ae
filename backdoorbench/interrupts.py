"""Termination signals held back while a file is written, and a finished Slurm job that stays finished.

Slurm's warning signal (SIGUSR2 for submitit's time limit), SIGTERM and Ctrl-C run a Python handler
at the next bytecode of the main thread, which may be deep inside `torch.save` writing to a Python
file object. Submitit's handler requeues the job and calls `sys.exit`; the `SystemExit` then
unwinds through torch's zip writer, whose cleanup raises "unexpected pos ..." and masks the exit:
Slurm saw a failed job instead of a requeued one. `held()` defers those signals for the length of
a write or read (the kernel has already delivered them; their Python handlers run as soon as the
file is whole and in place), so a requeued job always finds a complete checkpoint.

`finished()` tells the process its result is safe: a requeue signal arriving later (while the
record's remaining lines print, while submitit pickles the result, or while the interpreter exits,
when Python has restored the default action and SIGUSR2 would kill a finished job) is ignored.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger(__name__)

HELD = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGUSR2", "SIGUSR1") if hasattr(signal, name))
REQUEUE = tuple(getattr(signal, name) for name in ("SIGUSR2", "SIGUSR1") if hasattr(signal, name))

_depth = 0
_pending: list[int] = []
_saved: dict[int, Any] = {}  # signal -> the handler to restore when the outermost hold ends


def _hold(signum: int, frame: object) -> None:
    if signum not in _pending:
        _pending.append(signum)


def pending() -> tuple[int, ...]:
    """The signals that arrived during the current hold and wait for its end."""
    return tuple(_pending)


@contextmanager
def held() -> Iterator[None]:
    """Defer SIGTERM, SIGINT, SIGUSR1 and SIGUSR2 to the end of the block; then restore their
    handlers and raise each signal that came, in order of arrival. Re-entrant; a no-op outside
    the main thread (only the main thread runs Python signal handlers)."""
    global _depth
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _depth == 0:
        for signum in HELD:
            handler = signal.getsignal(signum)
            if handler is None:  # installed by C code: Python cannot put it back, so leave it alone
                continue
            _saved[signum] = signal.signal(signum, _hold)
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            _release()


def _release() -> None:
    arrived = list(_pending)
    _pending.clear()
    for signum, handler in _saved.items():
        signal.signal(signum, handler)
    _saved.clear()
    for signum in arrived:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            log.info("%s arrived during a file write; handled now that the file is complete",
                     signal.Signals(signum).name)
            signal.raise_signal(signum)


def _is_submitit_handler(handler: object) -> bool:
    owner = getattr(handler, "__self__", None)
    return owner is not None and type(owner).__module__.startswith("submitit")


def finished() -> None:
    """The run's result is written: from now on a requeue signal that submitit would act on is
    ignored (with a log line if one is waiting), so a finished job is neither requeued into a
    second record nor killed while its interpreter exits. Does nothing outside a submitit job."""
    for signum in REQUEUE:
        current = _saved.get(signum) if signum in _saved else signal.getsignal(signum)
        if not _is_submitit_handler(current):
            continue
        if signum in _saved:
            _saved[signum] = signal.SIG_IGN
        elif threading.current_thread() is threading.main_thread():
            signal.signal(signum, signal.SIG_IGN)
        else:
            continue
        if signum in _pending:
            _pending.remove(signum)
            log.info("%s arrived while the record was written: the run is finished, so the job is not requeued",
                     signal.Signals(signum).name)
