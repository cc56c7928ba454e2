"""Terminal output: progress bars and summary tables (rich)."""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

__all__ = ["StatusLine", "console", "progress_bar", "setup_logging", "table"]

console = Console(stderr=True, width=None if sys.stderr.isatty() else 200)
out = Console(width=None if sys.stdout.isatty() else 200)


def setup_logging(level: str | None = None) -> None:
    """``key=value`` logs to stderr; level from the flag, else ``P2PTRAIN_LOG_LEVEL``, else WARNING."""
    name = (level or os.environ.get("P2PTRAIN_LOG_LEVEL") or "WARNING").upper()
    if name not in logging.getLevelNamesMapping():
        raise ValueError(f"unknown log level {name!r}")
    handler: logging.Handler
    if sys.stderr.isatty():
        handler = RichHandler(console=console, show_path=False, markup=False)
        handler.setFormatter(logging.Formatter("%(name)s %(message)s"))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s"))
    root = logging.getLogger("p2ptrain")
    root.handlers[:] = [handler]
    root.setLevel(name)
    root.propagate = False


class StatusLine:
    """A swarm peer's live status from its status dicts (step, loss, tokens_per_second, rounds, failed,
    in_flight, sharing_nothing): in place on a terminal, a bar like ``train``'s (step N of ``total``, loss,
    tokens/s, rounds, ETA); elsewhere (a log file, ``docker logs``) one line every ``every`` seconds; nothing
    when ``quiet``. A context manager: the bar is drawn from entering to leaving. ``update`` is called from
    the compute thread; rich redraws from its own."""

    def __init__(self, total: int | None, quiet: bool, *, every: float = 10.0, live: bool | None = None) -> None:
        self.total, self.quiet, self.every = total, quiet, every
        self.live = console.is_terminal if live is None else live
        self._progress: Progress | None = None
        self._last = -math.inf  # the first update is said: monotonic() starts near 0 after a boot

    def __enter__(self) -> StatusLine:
        if self.live and not self.quiet:
            self._progress = Progress(TextColumn("[bold]join"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[extra]}"),
                                      TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                      console=console, transient=False)
            self._progress.start()
            self._progress.add_task("join", total=self.total, loss="-", extra="")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    @staticmethod
    def text(s: dict[str, Any]) -> str:
        """The status after step and loss: throughput, rounds, what is in flight, and a warning when sharing
        nothing (rich markup)."""
        alone = (f"  [bold yellow]nothing shared with another peer for {s['sharing_nothing']:.0f} s[/]"
                 if s.get("sharing_nothing") else "")
        return (f"{s['tokens_per_second']:,.0f} tok/s  rounds {s['rounds']} (failed {s['failed']})  "
                f"in flight {s['in_flight']}{alone}")

    def update(self, s: dict[str, Any]) -> None:
        if self.quiet:
            return
        if self._progress is not None:
            self._progress.update(self._progress.task_ids[0], completed=s["step"], loss=f"{s['loss']:.3f}",
                                  extra=self.text(s))
            return
        if time.monotonic() - self._last < self.every:
            return
        self._last = time.monotonic()
        console.print(f"step {s['step']:>6}  loss {s['loss']:.3f}  {self.text(s)}", highlight=False)


@contextmanager
def progress_bar(total: int, description: str = "train", *, disable: bool = False) -> Iterator[Progress]:
    """A bar showing step N/M, the fields ``loss`` and ``tok_s`` of the task, elapsed and ETA."""
    columns = [
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[extra]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    ]
    with Progress(*columns, console=console, disable=disable, transient=False) as prog:
        prog.add_task(description, total=total, loss="-", extra="")
        yield prog


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Table:
    t = Table(title=title)
    for c in columns:
        t.add_column(c, justify="right" if c != columns[0] else "left")
    for r in rows:
        t.add_row(*(_fmt(v) for v in r))
    return t


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v != v:
            return "-"
        if abs(v) >= 1e4 or (abs(v) < 1e-3 and v != 0):
            return f"{v:.3g}"
        return f"{v:.4g}"
    return str(v)
