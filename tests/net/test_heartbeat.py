"""The heartbeat keeps a peer in the others' view of who is live: its announcements must come every heartbeat even
when the DHT is slow (a loaded machine), never further apart than the ttl after which they expire."""

from __future__ import annotations

import asyncio

import pytest

from p2ptrain.net.transport import PeerInfo
from p2ptrain.peer.config import PeerConfig
from p2ptrain.peer.link import SwarmLink

pytestmark = [pytest.mark.timeout(60)]


class SlowDHT:
    """Every DHT operation takes ``latency`` seconds; announcements are timed."""

    def __init__(self, latency: float) -> None:
        self.latency = latency
        self.announced: list[float] = []

    async def announce(self, info: PeerInfo) -> None:
        self.announced.append(asyncio.get_running_loop().time())
        await asyncio.sleep(self.latency)

    async def peers(self) -> list[PeerInfo]:
        await asyncio.sleep(self.latency)
        return []


@pytest.mark.parametrize("latency", [0.05, 0.7, 3.0])
def test_announcements_keep_their_cadence_when_the_dht_is_slow(latency: float) -> None:
    """heartbeat 0.5 s, ttl 2 s. Before: announce, read the live peers, republish the pacing one after the other
    and pause a heartbeat: at 0.7 s per operation, announcements 2.6 s apart, longer than the ttl."""
    cfg = PeerConfig(run_id="hb", steps=1, heartbeat=0.5, ttl=2.0, step_seconds=0.1)
    link = SwarmLink(cfg, None, None, 10.0, None)  # type: ignore[arg-type]  # only the heartbeat runs here
    dht = SlowDHT(latency)
    link.transport = dht  # type: ignore[assignment]
    seen: list[int] = []

    async def go() -> None:
        beat = asyncio.ensure_future(link._heartbeat(lambda: PeerInfo(peer_id="me"), seen.append))
        await asyncio.sleep(6.0)
        beat.cancel()
        await asyncio.gather(beat, return_exceptions=True)

    asyncio.run(go())
    gaps = [b - a for a, b in zip(dht.announced, dht.announced[1:], strict=False)]
    assert len(dht.announced) >= 3, dht.announced
    # at most the heartbeat, or the announcement's own bound (2 × heartbeat) when the DHT takes longer
    assert max(gaps) <= min(max(cfg.heartbeat, latency), 2 * cfg.heartbeat) + 0.3, gaps
    assert max(gaps) < cfg.ttl
    if latency < 2 * cfg.heartbeat:
        assert seen, "the live count was never read"
