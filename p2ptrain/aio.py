"""The event loop every p2ptrain command runs its network on: uvloop (a dependency), or asyncio's own where it
cannot be imported. Chosen here once, for the peer's network thread (``sync.NetLoop``) and for the commands
that run a loop of their own (``bootstrap``, ``status``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["new_event_loop", "run"]

T = TypeVar("T")


def _factory() -> Callable[[], asyncio.AbstractEventLoop]:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new loop of the kind every command runs on."""
    return _factory()()


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on that kind of loop."""
    with asyncio.Runner(loop_factory=_factory()) as runner:
        return runner.run(main)
