"""What a run tells the person watching it, besides its epoch lines and final table.

`track`: what a long stage is doing and how far along it is. On a terminal a tqdm bar shows the
count; when output goes to a file or a Slurm log (no bar), a line is logged every `every_s`
seconds instead. Both end with one line saying what was done and how long it took, which also
reaches Hydra's log file. Only rank 0 of a torchrun reports. `bar` is the trainer's epoch bar.
`warnings_as_log_lines`: each Python warning as one log line.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm.auto import tqdm

from backdoorbench import distributed

log = logging.getLogger("backdoorbench.progress")

T = TypeVar("T")

EVERY_S = 30.0  # off a terminal: one line per this many seconds


def on_terminal() -> bool:
    """Whether a bar can be drawn: tqdm writes to stderr."""
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def bar(total: int | None, desc: str, *, unit: str = "it", enabled: bool = True) -> tqdm:
    """A tqdm bar that stays off where no one watches it: not a terminal, not rank 0, or not `enabled`."""
    show = enabled and distributed.is_main() and on_terminal()
    return tqdm(total=total, desc=desc, unit=unit, leave=False, disable=not show, dynamic_ncols=True)


def track(items: Iterable[T], what: str, *, total: int | None = None, unit: str = "steps",
          every_s: float = EVERY_S) -> Iterator[T]:
    """Yield `items`, reporting `what` with a count of `unit` (plural) out of `total` (default len(items)).

    A loop that breaks early is reported as stopped at the count it reached."""
    total = len(items) if total is None and hasattr(items, "__len__") else total
    reporting = distributed.is_main()
    progress = bar(total, what, unit=unit, enabled=reporting)
    of = f"/{total}" if total is not None else ""
    started = last = time.perf_counter()
    done = 0
    try:
        for item in items:
            yield item
            done += 1
            progress.update()
            now = time.perf_counter()
            if reporting and progress.disable and now - last >= every_s:
                log.info("%s: %d%s %s, %.0f s", what, done, of, unit, now - started)
                last = now
    finally:
        progress.close()
        if reporting:
            ending = "done" if total is None or done >= total else "stopped"
            log.info("%s: %s, %d%s %s in %.1f s", what, ending, done, of, unit, time.perf_counter() - started)


def warnings_as_log_lines() -> None:
    """Show each Python warning as one log line (terminal and Hydra's log file), not the default
    two lines with the source line that raised it. Our own warnings are messages for people and
    go out as they are; a library's keeps its category and where it came from."""
    import warnings

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        source = category.__module__
        if source.split(".")[0] == "backdoorbench":
            logging.getLogger(source).warning("%s", message)
        else:
            logging.getLogger("py.warnings").warning("%s (%s, %s:%s)", message, category.__name__, filename, lineno)

    warnings.showwarning = show
