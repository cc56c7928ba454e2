"""Cancelling a member's all-reduce mid-flight cancels and awaits every task the run started.

Three real peers on 127.0.0.1. One of them takes a message of the all-reduce and never answers it (a stalled
member), so the member under test has a send in flight and is waiting; then its caller cancels the all-reduce.
Every task created from inside that all-reduce (tracked with a context variable that the loop's task factory
reads when a task is created) must be done when the cancelled call returns: none keeps running behind the
caller's back. Tasks the run did not create (the transports' background tasks, the stalled peer's stream
handler) are allowed.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine
from typing import Any

import pytest
import torch

from p2ptrain.collective.codecs import get_codec
from p2ptrain.net.swarm import HivemindTransport, SwarmConfig
from p2ptrain.net.transport import JoinRequest

from .peers import announce_and_wait

pytestmark = [pytest.mark.net, pytest.mark.timeout(120)]

TIMEOUT = 6.0  # of the all-reduce: contributions are awaited for 3 s, results until 4.8 s
_IN_RUN: contextvars.ContextVar[bool] = contextvars.ContextVar("in_run", default=False)


class _Stalled(HivemindTransport):
    """A member that reads the header of every message of kind ``stall`` and then never answers it
    (until ``release`` is set, or 60 s pass)."""

    stall = "part"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reached, self.release = asyncio.Event(), asyncio.Event()

    async def _hold(self) -> dict[str, Any]:
        self.reached.set()
        try:
            await asyncio.wait_for(self.release.wait(), 60)
        except TimeoutError:
            pass
        return {"error": "stalled"}

    async def _on_part(self, sender: str, msg: dict[str, Any]) -> dict[str, Any]:
        return await self._hold() if self.stall == "part" else await super()._on_part(sender, msg)

    async def _on_result(self, sender: str, msg: dict[str, Any]) -> dict[str, Any]:
        return await self._hold() if self.stall == "result" else await super()._on_result(sender, msg)


async def _swarm(stall: str) -> list[Any]:
    ts: list[Any] = []

    def cfg(**kw: Any) -> SwarmConfig:
        return SwarmConfig(run_id="cancel", join_window=2.0, ttl=30, chunk_values=1024, **kw)

    try:
        ts.append(await HivemindTransport.create(cfg()))
        maddrs = await ts[0].visible_maddrs()
        ts.append(await HivemindTransport.create(cfg(initial_peers=maddrs)))
        stalled = await _Stalled.create(cfg(initial_peers=maddrs))
        stalled.stall = stall
        ts.append(stalled)
        await announce_and_wait(ts, 3)
        return ts
    except BaseException:
        await asyncio.gather(*(t.aclose() for t in ts), return_exceptions=True)
        raise


@pytest.mark.parametrize("stall", ["part", "result"])
def test_cancelling_an_allreduce_leaves_no_task_behind(stall: str) -> None:
    async def go() -> None:
        ts = await _swarm(stall)
        a, stalled = ts[0], ts[2]
        loop = asyncio.get_running_loop()
        created: list[asyncio.Task[Any]] = []

        def factory(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], **kw: Any) -> asyncio.Task[Any]:
            task = asyncio.Task(coro, loop=loop, **kw)
            if _IN_RUN.get():  # created from inside the all-reduce under test (contexts are inherited)
                created.append(task)
            return task

        try:
            groups = await asyncio.gather(*(t.form_group(JoinRequest(key="c", peer_id=t.peer_id, weight=1.0,
                                                                     fragment=0), None, timeout=20) for t in ts))
            assert all(len(g.members) == 3 for g in groups)
            x = torch.randn(10_007)  # parts of ~3336 values: streamed in chunks of 1024

            async def run() -> Any:
                _IN_RUN.set(True)  # this task's own context: what the all-reduce creates inherits it
                return await a.allreduce(groups[0], 0, [x], 1.0, get_codec("fp32"), timeout=TIMEOUT)

            loop.set_task_factory(factory)
            before = asyncio.all_tasks()
            task = asyncio.create_task(run())
            # The stalled member has our part (or our averaged part): that send is in flight; we wait on.
            await asyncio.wait_for(stalled.reached.wait(), 20)
            await asyncio.sleep(0.2)
            assert not task.done()
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=10)
            assert task in done and task.cancelled()  # the cancellation reached the caller, in bounded time

            assert created, "the all-reduce started no task: the test would check nothing"
            left = [t for t in created if not t.done()]
            assert not left, f"{len(left)} of {len(created)} tasks of the run still pending: {left}"
            new = asyncio.all_tasks() - before - {asyncio.current_task()}
            assert not new & set(created)  # whatever else is new (others' stream handlers) is not the run's
            box = a._mail.get(("c", 0))
            assert box is not None and box.finished is not None and not box.contribs  # its mailbox was closed
        finally:
            loop.set_task_factory(None)
            stalled.release.set()
            await asyncio.gather(*(t.aclose() for t in ts), return_exceptions=True)

    asyncio.run(go())
