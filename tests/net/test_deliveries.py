"""A member's all-reduce returns once it holds every part; what it still owes the others (its result, its claims,
its verdict) is delivered by the transport's task group, and a graceful close waits for those deliveries.

Two real peers on 127.0.0.1. ``b`` reads every result it receives 1.5 s late (a member slow to take it), and each
part (24 MB) is more than the sockets' buffers hold, so ``a`` holds both parts while its own result is still on
its way to ``b``, not yet all written. ``a``'s all-reduce must return before
that result is filed (the run no longer waits for the reply), and ``a`` closing at once must not cut it off: ``b``
ends the round with the exact mean, not a partial one. With verified aggregation as well: ``a`` judges ``b``'s part
from ``b``'s claim about it, which ``b`` sends as soon as its own result is filed (two members), not once it holds
every result (then ``a`` waited for ``b`` to file ``a``'s result).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch

from p2ptrain.collective.codecs import get_codec
from p2ptrain.net.swarm import HivemindTransport, SwarmConfig
from p2ptrain.net.transport import JoinRequest

from .peers import announce_and_wait

pytestmark = [pytest.mark.net, pytest.mark.timeout(120)]

LATE = 1.5  # seconds b takes to file a result


class _SlowToFile(HivemindTransport):
    """Reads every result it receives ``LATE`` seconds late; notes when it filed it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.filed: list[float] = []

    async def _on_result(self, sender: str, msg: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(LATE)
        reply = await super()._on_result(sender, msg)
        self.filed.append(time.monotonic())
        return reply


@pytest.mark.parametrize("verify", [False, True], ids=["plain", "verified"])
def test_a_member_returns_with_every_part_and_a_close_still_delivers_its_result(verify: bool) -> None:
    async def go() -> None:
        def cfg(**kw: Any) -> SwarmConfig:
            # (one audit of each part: what b fetches from a after a's run returned, which a's close must not cut off)
            return SwarmConfig(run_id="deliver", join_window=2.0, ttl=30, verify=verify, audit_rate=1.0, **kw)

        a = await HivemindTransport.create(cfg())
        b: _SlowToFile | None = None
        try:
            b = await _SlowToFile.create(cfg(initial_peers=await a.visible_maddrs()))
            await announce_and_wait([a, b], 2)
            groups = await asyncio.gather(*(t.form_group(JoinRequest(key="d", peer_id=t.peer_id, weight=w,
                                                                     fragment=0), None, timeout=20)
                                            for t, w in ((a, 1.0), (b, 3.0))))
            assert all(len(g.members) == 2 for g in groups)
            xa, xb = torch.randn(12_000_003), torch.randn(12_000_003)
            fp32 = get_codec("fp32")
            ra_task = asyncio.create_task(a.allreduce(groups[0], 0, [xa], 1.0, fp32, timeout=60))
            rb_task = asyncio.create_task(b.allreduce(groups[1], 0, [xb], 3.0, fp32, timeout=60))
            ra = await ra_task
            returned = time.monotonic()
            assert not b.filed or b.filed[0] > returned, "a waited for b to file its result"
            await a.aclose()  # at once: its result to b is still on its way
            rb = await rb_task
            want = ((xa.double() + 3 * xb.double()) / 4).float()
            for r in (ra, rb):
                assert not r.partial and set(r.contributors) == {a.peer_id, b.peer_id}
                assert torch.allclose(r.tensors[0], want, rtol=1e-6, atol=1e-6)
                assert not r.liars
            if verify:  # a judged b's part: it drew audits of it, and held b's claim before b filed a's result
                assert ra.verify_audits > 0 and ra.verify_tallied
            assert b.filed and b.filed[0] > returned  # filed after a had returned: delivered by a's close
        finally:
            await asyncio.gather(a.aclose(), *([b.aclose()] if b is not None else []), return_exceptions=True)

    asyncio.run(go())
