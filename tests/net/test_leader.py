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


def test_forming_closes_once_when_everyone_joined_or_the_window_expired() -> None:
    """The rules both transports use (groups.Forming): early close on a fresh view, close on the window's
    end otherwise, one group for every caller, a late join refused."""
    from p2ptrain.net.groups import Forming
    from p2ptrain.net.transport import RoundFailed

    async def go() -> None:
        fresh: list[bool] = []

        async def live(f: bool) -> list[str]:
            fresh.append(f)
            return ["a", "b"]

        f = Forming("k", window=5.0)
        f.join(JoinRequest(key="k", peer_id="a", weight=1.0, fragment=3))
        waiting = asyncio.create_task(f.until_closed(live, leader="a", poll=0.05))
        await asyncio.sleep(0.2)
        assert not waiting.done()  # b is live and has not joined: the window is still open
        f.join(JoinRequest(key="k", peer_id="b", weight=1.0, fragment=3))
        group = await asyncio.wait_for(waiting, 5)
        assert group.members == ("a", "b") and group.fragment == 3 and True in fresh
        assert await f.until_closed(live) is group and f.close("b") is group  # closed once
        try:
            f.join(JoinRequest(key="k", peer_id="c", weight=1.0))
            raise AssertionError("a late join was accepted")
        except RoundFailed:
            pass

        g = Forming("w", window=0.3)
        g.join(JoinRequest(key="w", peer_id="a", weight=1.0))
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        alone = await asyncio.wait_for(g.until_closed(live), 5)  # b never joins: closed when the window ends
        assert alone.members == ("a",) and 0.25 <= loop.time() - t0 < 2

    asyncio.run(go())
