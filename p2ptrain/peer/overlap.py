"""Network work that would leave a peer idle, run beside its training: ``work()`` on a thread of its own while
the training thread takes inner steps. A resumed peer connects so (its progress is its own until it takes the
swarm's state), and an outvoted peer fetches the majority's θ so (a source across a region cut costs its whole
timeout); the steps are progress like any other, read when the result is taken."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["while_training"]

T = TypeVar("T")


def while_training(work: Callable[[], T], step: Callable[[], None], name: str = "p2ptrain-overlap") -> T:
    """``work()`` on a thread of its own while this thread calls ``step()`` (an inner step, or a short wait when
    none may be taken) until the work has ended; its result, or its exception raised here. ``work`` must bound its
    own waits (every network call has a timeout): this thread joins it."""
    result: list[T] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            result.append(work())
        except BaseException as e:  # (raised on the training thread)
            failed.append(e)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    while thread.is_alive():
        step()
    thread.join()
    if failed:
        raise failed[0]
    return result[0]
