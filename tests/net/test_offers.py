"""What a peer offers beside its state (net/offers.py): an offer its cell still wants (a round's shard, wanted by the
cell's other members until the round's deadline) keeps a peer that leaves gracefully serving it until it was fetched
or the deadline passed, never longer; on real libp2p peers a whole transfer counts as one fetch."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import pytest

from p2ptrain.net.offers import Offers

from .test_direct import _peers


def test_an_offer_is_wanted_until_fetched_as_often_as_asked_or_its_deadline() -> None:
    o = Offers()
    now = time.monotonic()
    o.put("hier/k/0/s0", b"shard", ttl=300, wanted=2, needed_until=now + 60)
    o.put("hier/k/0/s0#sha", b"digest", ttl=300)  # not wanted: nothing waits for it
    assert o.pending_until() == pytest.approx(now + 60)
    o.fetched("hier/k/0/s0#sha")
    o.fetched("hier/k/0/s0")
    assert o.pending_until() is not None
    o.fetched("hier/k/0/s0")
    assert o.pending_until() is None
    # past its deadline nobody wants it any more; and an offer dropped (expired, or pushed out) is not waited for
    o.put("late", b"x", ttl=300, wanted=1, needed_until=time.monotonic() + 0.05)
    time.sleep(0.06)
    assert o.pending_until() is None
    small = Offers(keep=1)
    small.put("a", b"x", ttl=300, wanted=1, needed_until=time.monotonic() + 60)
    small.put("b", b"y", ttl=300)
    assert small.pending_until() is None


def test_names_of_a_round_that_ended_are_declined_unless_offered() -> None:
    o = Offers(keep=2)
    o.put("hier/k/0/s0", b"shard", ttl=300)
    o.end("hier/k/", ttl=0.2)
    assert not o.declines("hier/k/0/s0")  # offered: served as before
    assert o.declines("hier/k/0/s1") and o.declines("hier/k/0/s1#div")  # never offered: declined at once
    assert not o.declines("hier/k2/0/s1") and not o.declines("hier/other/0/s0")  # another round: "not yet"
    time.sleep(0.25)
    assert not o.declines("hier/k/0/s1")  # for ttl seconds only
    for k in ("a", "b", "c"):  # at most ``keep`` rounds are remembered, the oldest goes first
        o.end(f"hier/{k}/", ttl=300)
    assert not o.declines("hier/a/0/s0") and o.declines("hier/b/0/s0") and o.declines("hier/c/0/s0")


def test_serving_waits_for_the_fetch_or_the_deadline_or_the_limit() -> None:
    async def go() -> None:
        o = Offers()
        assert await o.served(10) < 0.05  # nothing wanted: no wait
        o.put("s", b"x", ttl=300, wanted=1, needed_until=time.monotonic() + 30)
        waiting = asyncio.create_task(o.served(30))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        o.fetched("s")
        assert 0.2 <= await asyncio.wait_for(waiting, 5) < 2  # waited for the fetch (its clock starts when it runs)
        o.put("t", b"x", ttl=300, wanted=1, needed_until=time.monotonic() + 0.5)
        assert 0.4 <= await o.served(30) < 2  # its round's deadline
        o.put("u", b"x", ttl=300, wanted=1, needed_until=time.monotonic() + 30)
        assert 0.2 <= await o.served(0.3) < 2  # the caller's limit

    asyncio.run(go())


@pytest.mark.net
@pytest.mark.timeout(120)
def test_a_leaving_peer_serves_its_wanted_shard_until_a_real_peer_fetched_it() -> None:
    """A shard of several state chunks (a multi-reply transfer) is one fetch; the leaving peer closes right after."""
    async def go() -> None:
        ts: list[Any] = await _peers(2, lambda i: {"state_chunk": 64 * 1024})
        try:
            shard = os.urandom(300_000)
            ts[1].offers.put("hier/x/0/s0", shard, ttl=300, wanted=1, needed_until=time.monotonic() + 60)
            leaving = asyncio.create_task(ts[1].serve_wanted(60))
            await asyncio.sleep(0.5)
            assert not leaving.done()
            assert await ts[0].fetch_state(ts[1].peer_id, "hier/x/0/s0", timeout=30) == shard
            assert await asyncio.wait_for(leaving, 10) < 30
        finally:
            await asyncio.gather(*(t.aclose() for t in ts), return_exceptions=True)

    asyncio.run(go())
