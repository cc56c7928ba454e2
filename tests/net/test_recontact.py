"""Dialing a peer again (after a split, or when a stream's dial fails) with the addresses it announced: they end
in ``/p2p/<id>``, which the daemon's connect refuses; they are now stripped of it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from p2ptrain.net.daemon import dial, dialable
from p2ptrain.net.swarm import HivemindTransport, SwarmConfig

PEER = "QmUhcQqXR6Dj8Cnzb3h9JGqgYhdWYrEdA8dXZQbDVXJ3bR"
RELAY = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


def test_dialable_strips_the_peers_own_suffix_only() -> None:
    assert dialable(PEER, [f"/ip4/1.2.3.4/tcp/5/p2p/{PEER}", "/ip4/1.2.3.4/tcp/6"]) == [
        "/ip4/1.2.3.4/tcp/5", "/ip4/1.2.3.4/tcp/6"]
    circuit = f"/ip4/5.6.7.8/tcp/9/p2p/{RELAY}/p2p-circuit"
    assert dialable(PEER, [f"{circuit}/p2p/{PEER}"]) == [circuit]  # the relay's id stays


def test_a_peer_is_dialed_again_at_its_announced_addresses() -> None:
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    async def go() -> None:
        ts: list[Any] = []
        try:
            ts.append(await HivemindTransport.create(SwarmConfig(run_id="recontact", ttl=10)))
            ts.append(await HivemindTransport.create(SwarmConfig(run_id="recontact", ttl=10)))
            a, b = ts
            announced = await b.visible_maddrs()
            assert announced and all(m.endswith(f"/p2p/{b.peer_id}") for m in announced)
            with pytest.raises(Exception):  # noqa: B017 (the daemon's own error type): what failed every time
                await asyncio.wait_for(a.p2p._client.connect(PeerID.from_base58(b.peer_id),
                                                             [Multiaddr(m) for m in announced]), 5)
            await dial(a.p2p, b.peer_id, announced)  # the fix: the same addresses, dialable
            peers = {str(p.peer_id) for p in await a.p2p.list_peers()}
            assert b.peer_id in peers
        finally:
            await asyncio.gather(*(t.aclose() for t in ts), return_exceptions=True)

    asyncio.run(asyncio.wait_for(go(), 90))
