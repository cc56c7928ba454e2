"""Polling a peer for a round's shard (net/polling.py): an answer that says "not yet" is asked again until the
deadline, but a peer that cannot be reached (it left) is given up after a few tries, and one that declines (its round
ended without the shard) at once, so that the next carrier is asked while the round still has time; several carriers
are asked staggered, the next one while those asked are silent; and on real libp2p peers, a peer that left is
reported as unreachable and one whose round ended declines."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from p2ptrain.net.polling import UNREACHABLE_TRIES, first_of, poll
from p2ptrain.net.transport import Declined, RoundFailed, Unreachable

from .test_direct import _peers


class _Fake:
    def __init__(self, errors: list[BaseException], then: bytes | None = None) -> None:
        self.errors, self.then, self.calls = errors, then, 0

    async def fetch_state(self, peer: str, name: str, *, timeout: float, progress: Any = None) -> bytes:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        if self.then is None:
            raise RoundFailed("unknown state")
        return self.then


def test_a_peer_not_offering_it_yet_is_asked_again_and_an_unreachable_one_is_given_up() -> None:
    async def go() -> None:
        # "not yet", and an unreachable try between answers (a dial that failed once), then the offer: polled on
        late = _Fake([RoundFailed("unknown state"), Unreachable("dial"), RoundFailed("unknown state")], then=b"x")
        assert await poll(late, "peer", "shard", time.monotonic() + 10) == b"x"  # type: ignore[arg-type]
        assert late.calls == 4
        # a peer that left: given up after UNREACHABLE_TRIES tries, long before the deadline
        gone = _Fake([Unreachable("dial failed")] * 10)
        t0 = time.monotonic()
        with pytest.raises(RoundFailed, match="cannot be reached"):
            await poll(gone, "peer", "shard", t0 + 30)  # type: ignore[arg-type]
        assert gone.calls == UNREACHABLE_TRIES and time.monotonic() - t0 < 5
        # one that never offers it: asked until the deadline
        never = _Fake([])
        with pytest.raises(RoundFailed, match="did not offer it in time"):
            await poll(never, "peer", "shard", time.monotonic() + 0.5)  # type: ignore[arg-type]
        assert never.calls > UNREACHABLE_TRIES
        # one whose round ended without it: given up at its first answer
        ended = _Fake([Declined("ended here without it")] * 10)
        with pytest.raises(Declined):
            await poll(ended, "peer", "shard", time.monotonic() + 30)  # type: ignore[arg-type]
        assert ended.calls == 1

    asyncio.run(go())


class _Carriers:
    """Peers by name: "silent" never answers, "declines" declines, "late" offers after 0.3 s, "slow" after 1.5 s,
    "now" at once; the peers asked, in order, with when."""

    def __init__(self) -> None:
        self.t0, self.asked = time.monotonic(), []  # type: list[tuple[str, float]]

    async def fetch_state(self, peer: str, name: str, *, timeout: float, progress: Any = None) -> bytes:
        if peer not in (p for p, _ in self.asked):
            self.asked.append((peer, time.monotonic() - self.t0))
        if peer == "silent":
            await asyncio.sleep(timeout)
            raise TimeoutError
        if peer == "declines":
            raise Declined("ended")
        wait = {"late": 0.3, "slow": 1.5, "now": 0.0}[peer]
        if time.monotonic() - self.t0 < wait:
            raise RoundFailed("unknown state")
        return peer.encode()


def test_first_of_asks_the_next_carrier_once_the_ones_asked_decline_or_stay_silent() -> None:
    async def go() -> None:
        c = _Carriers()  # a carrier that declined: the next one is asked at once
        assert await first_of(c, ["declines", "now"], "s", time.monotonic() + 30, stagger=5) == ("now", b"now")  # type: ignore[arg-type]
        assert [p for p, _ in c.asked] == ["declines", "now"] and c.asked[1][1] < 1.0
        c = _Carriers()  # a silent one: the next after the stagger, not after the deadline
        assert await first_of(c, ["silent", "late"], "s", time.monotonic() + 30, stagger=0.5) == ("late", b"late")  # type: ignore[arg-type]
        assert 0.4 <= c.asked[1][1] < 3.0
        c = _Carriers()  # one that answers "not yet" is not dropped: the first to offer wins, the rest are cancelled
        got = await first_of(c, ["slow", "late"], "s", time.monotonic() + 30, stagger=0.2)  # type: ignore[arg-type]
        assert got == ("late", b"late") and [p for p, _ in c.asked] == ["slow", "late"]
        c = _Carriers()  # nobody delivers by the deadline
        with pytest.raises(RoundFailed, match="no carrier delivered it"):
            await first_of(c, ["silent", "declines"], "s", time.monotonic() + 0.6, stagger=0.2)  # type: ignore[arg-type]
        with pytest.raises(RoundFailed, match="nobody to ask"):
            await first_of(c, [], "s", time.monotonic() + 1)  # type: ignore[arg-type]

    asyncio.run(go())


@pytest.mark.net
@pytest.mark.timeout(120)
def test_a_peer_that_left_is_unreachable() -> None:
    async def go() -> None:
        ts: list[Any] = await _peers(3, lambda i: {})
        try:
            gone = ts[1].peer_id
            await ts[1].aclose()
            t0 = time.monotonic()
            with pytest.raises(Unreachable):
                await ts[0].fetch_state(gone, "hier/x/0/s0", timeout=30)
            assert time.monotonic() - t0 < 30
            # a live peer whose round ended without a name declines it; what it offers it still serves
            ts[0].offers.put("hier/y/0/s0", b"shard", ttl=60)
            ts[0].offers.end("hier/y/", ttl=60)
            assert await ts[2].fetch_state(ts[0].peer_id, "hier/y/0/s0", timeout=30) == b"shard"
            with pytest.raises(Declined):
                await ts[2].fetch_state(ts[0].peer_id, "hier/y/0/s1", timeout=30)
        finally:
            await asyncio.gather(*(t.aclose() for t in ts), return_exceptions=True)

    asyncio.run(go())
