"""A round's leader closes each group exactly once, however its members' joins interleave."""

from __future__ import annotations

import asyncio
import types
from collections.abc import Sequence

from p2ptrain.net.swarm import HivemindTransport, SwarmConfig
from p2ptrain.net.transport import Decision, JoinRequest


def test_a_group_is_closed_once_when_joins_interleave_with_the_live_view() -> None:
    """Each join waits for the DHT's view of who is live; two joins that both find everyone joined
    used to close the group one after the other, the second overwriting the first with a new decision
    (members then sent different fragments under one key: cocodc's slots barely synced on real peers)."""

    async def go() -> None:
        t = HivemindTransport(SwarmConfig(join_window=5.0), types.SimpleNamespace(peer_id="me"), None)

        async def live_ids(max_age: float = 1.0) -> list[str]:
            await asyncio.sleep(0.01)  # a DHT read: other joins run meanwhile
            return ["a", "b", "me"]

        t._live_ids = live_ids  # type: ignore[method-assign]
        calls: list[int] = []

        def decide(reqs: Sequence[JoinRequest]) -> Decision:
            calls.append(len(reqs))
            return Decision(len(calls) - 1)  # a leader's choice depends on what it assigned before

        deadline = asyncio.get_running_loop().time() + 10
        reqs = [JoinRequest(key="slot.L7", peer_id=p, weight=1.0, step=7) for p in ("a", "b", "me")]
        groups = await asyncio.wait_for(asyncio.gather(
            t._lead(reqs[0], None, deadline), t._lead(reqs[1], None, deadline), t._lead(reqs[2], decide, deadline)), 10)
        assert calls == [3]  # decided once, from all three requests
        assert all(g is groups[0] for g in groups) and groups[0].fragment == 0
        assert groups[0].members == ("a", "b", "me")

    asyncio.run(go())
