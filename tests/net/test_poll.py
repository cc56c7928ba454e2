"""Polling a peer for a round's shard (net/hierarchy.py ``_poll``): an answer that says "not yet" is asked again until
the deadline, but a peer that cannot be reached (it left) is given up after a few tries, so that the next carrier is
asked while the round still has time; and on real libp2p peers, a peer that left is reported as unreachable."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from p2ptrain.net.hierarchy import UNREACHABLE_TRIES, _poll
from p2ptrain.net.transport import RoundFailed, Unreachable

from .test_direct import _peers


class _Fake:
    def __init__(self, errors: list[BaseException], then: bytes | None = None) -> None:
        self.errors, self.then, self.calls = errors, then, 0

    async def fetch_state(self, peer: str, name: str, *, timeout: float) -> bytes:
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
        assert await _poll(late, "peer", "shard", time.monotonic() + 10) == b"x"  # type: ignore[arg-type]
        assert late.calls == 4
        # a peer that left: given up after UNREACHABLE_TRIES tries, long before the deadline
        gone = _Fake([Unreachable("dial failed")] * 10)
        t0 = time.monotonic()
        with pytest.raises(RoundFailed, match="cannot be reached"):
            await _poll(gone, "peer", "shard", t0 + 30)  # type: ignore[arg-type]
        assert gone.calls == UNREACHABLE_TRIES and time.monotonic() - t0 < 5
        # one that never offers it: asked until the deadline
        never = _Fake([])
        with pytest.raises(RoundFailed, match="did not offer it in time"):
            await _poll(never, "peer", "shard", time.monotonic() + 0.5)  # type: ignore[arg-type]
        assert never.calls > UNREACHABLE_TRIES

    asyncio.run(go())


@pytest.mark.net
@pytest.mark.timeout(120)
def test_a_peer_that_left_is_unreachable() -> None:
    async def go() -> None:
        ts: list[Any] = await _peers(2, lambda i: {})
        try:
            gone = ts[1].peer_id
            await ts[1].aclose()
            t0 = time.monotonic()
            with pytest.raises(Unreachable):
                await ts[0].fetch_state(gone, "hier/x/0/s0", timeout=30)
            assert time.monotonic() - t0 < 30
        finally:
            await asyncio.gather(*(t.aclose() for t in ts), return_exceptions=True)

    asyncio.run(go())
