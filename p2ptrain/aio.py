"""The event loop every p2ptrain command runs its network on: uvloop (a dependency), or asyncio's own where it
cannot be imported. Chosen here once, for the peer's network thread (``sync.NetLoop``) and for the commands
that run a loop of their own (``bootstrap``, ``status``).

Every such loop files the hivemind DHT's abandoned waiters at DEBUG (:func:`quiet_dht_waiters`): a DHT search
(``hivemind.dht.traverse``) waits on its "search finished" event in a task it creates afresh at every step and
never cancels; when the search itself is cancelled (every DHT call here is bounded by a timeout), those tasks are
left pending on an event nobody will set, and asyncio reports each one at ERROR as it is collected ("Task was
destroyed but it is pending!", ``coro=<Event.wait()>``). A churn run's peer logs held 11,500 of them (~2.6 per
timed-out announcement); they say nothing a peer's user can act on."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["new_event_loop", "quiet_dht_waiters", "run"]

log = logging.getLogger(__name__)

T = TypeVar("T")


def _factory() -> Callable[[], asyncio.AbstractEventLoop]:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.new_event_loop
    return uvloop.new_event_loop


_DESTROYED = "Task was destroyed but it is pending!"


def _abandoned_wait(context: dict[str, Any]) -> bool:
    """Whether ``context`` reports a task collected while it still waited on an ``asyncio.Event`` (see above)."""
    task = context.get("task")
    if context.get("message") != _DESTROYED or not isinstance(task, asyncio.Task):
        return False
    return getattr(task.get_coro(), "__qualname__", "") == "Event.wait"


def quiet_dht_waiters(loop: asyncio.AbstractEventLoop) -> asyncio.AbstractEventLoop:
    """``loop``, with abandoned ``Event.wait`` tasks (see the module docstring) logged at DEBUG; everything else its
    exception handler is given goes on to the one it had (asyncio's default, which logs it at ERROR)."""
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if _abandoned_wait(context):
            log.debug("event=abandoned_wait task=%s", context["task"].get_name())
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
    return loop


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new loop of the kind every command runs on."""
    return quiet_dht_waiters(_factory()())


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on that kind of loop."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)
