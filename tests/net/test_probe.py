"""Link probes before a first round (net/probe.py): on real libp2p peers on 127.0.0.1 (the direct path's), a probe
seeds the meter of each link not measured yet, once; an oversized probe is refused."""

from __future__ import annotations

import asyncio

import pytest

from p2ptrain.net.probe import PROBE_BYTES, on_probe

from .test_direct import _peers


def test_a_probe_answer_refuses_what_is_not_a_small_payload() -> None:
    assert asyncio.run(on_probe("x", {"data": bytes(10)})) == {"ok": True}
    assert "error" in asyncio.run(on_probe("x", {"data": bytes(PROBE_BYTES + 1)}))
    assert "error" in asyncio.run(on_probe("x", {"data": "text"}))


@pytest.mark.net
@pytest.mark.timeout(120)
def test_probes_seed_the_links_not_measured_yet_once() -> None:
    async def go() -> None:
        ts = await _peers(3, lambda i: {"direct": i != 2})  # peer 2 has no direct path: probed over libp2p
        try:
            a = ts[0]
            members = [t.peer_id for t in ts]
            assert a.links.slowest() == 0.0
            assert await a.probe(members, timeout=20) == 2  # the two others, not itself
            assert all(a.links.known(p) for p in members[1:]) and not a.links.known(a.peer_id)
            assert a.links.slowest() > 0
            direct = a.streams.direct
            assert direct is not None and direct.opened >= 2  # peer 1's probes went over the direct path
            assert await a.probe(members, timeout=20) == 0  # known now: no second probe
            # the receivers saw only well-formed probes: nobody was struck
            assert all(not t.guard.strikes for t in ts)
        finally:
            await asyncio.gather(*(t.aclose() for t in ts), return_exceptions=True)

    asyncio.run(go())
