"""A region measured from latency (``--region auto``, p2ptrain/net/region.py): the rule, the RTT a real libp2p
transport measures, and peers on the testbed's two regions that name their sites apart."""

from __future__ import annotations

import asyncio
import os
import re
import sys
import time
from pathlib import Path

import pytest

from p2ptrain.net.region import pick_region

from .procs import wait_file, write_recipe

MS = 0.001


def test_a_peer_takes_the_region_of_the_nearest_near_peer() -> None:
    rtts = {"b": 0.4 * MS, "c": 0.9 * MS, "far": 80 * MS}
    regions = {"b": "auto-bbbb", "c": "us-east", "far": "eu"}
    assert pick_region("a", rtts, regions) == "us-east"  # a name a user gave wins over a measured one
    assert pick_region("a", rtts, {"b": "auto-zz", "c": "auto-yy", "far": "eu"}) == "auto-yy"  # one name a site
    assert pick_region("a", {"far": 80 * MS}, regions) == "auto-a"  # nobody near: a region of its own
    assert pick_region("zzz", {"b": 0.5 * MS, "c": 0.7 * MS}, {}) == "auto-b"  # near, no names yet: smallest id
    assert pick_region("b", {"zzz": 0.5 * MS, "c": 0.7 * MS}, {}) == "auto-b"  # ... the same on each of them
    assert pick_region("a", {}, {}) == "auto-a"  # the first peer of a run
    assert pick_region("a", {"b": 3 * MS}, {"b": "x"}, near=2 * MS) == "auto-a"  # the threshold is the caller's
    assert pick_region("a", {"b": 0.5 * MS, "a": 0.0}, {"a": "x"}) == "auto-a"  # itself is never a neighbour
    with pytest.raises(ValueError, match="near"):
        pick_region("a", {}, {}, near=0.0)


@pytest.mark.net
@pytest.mark.timeout(120)
def test_a_libp2p_transport_measures_the_round_trip_to_a_peer() -> None:
    from .test_leader import real_swarm

    async def go() -> None:
        async with real_swarm(2, "rtt", 1.0) as (a, b):
            rtt = await a.rtt(b.peer_id, tries=3, timeout=10)
            assert rtt is not None and 0 < rtt < 2.0  # loopback: the two daemons' and our processing
            assert await a.rtt("12D3KooWNoSuchPeerNoSuchPeerNoSuchPeerNoSuchPeer1", timeout=2) is None

    asyncio.run(go())


_MEASURED = re.compile(r"event=region_measured region=(\S+)")


@pytest.mark.net
@pytest.mark.timeout(180)
def test_peers_of_two_testbed_regions_measure_two_regions(tmp_path: Path) -> None:
    """2 regions × 2 `p2ptrain join --region auto` peers on the testbed, 25 ms one way on each region's uplink
    (50 ms between them, nothing inside a region): each region's peers end with one name, the two names differ,
    and the swarm's rounds then run region by region (one name a region: the hierarchy's cells)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench.testbed import RegionSpec, Testbed, TestbedSpec, unavailable_reason

    from .test_churn_faults import _start, _stop

    if (reason := unavailable_reason()) is not None:
        pytest.skip(f"testbed unavailable: {reason}")
    recipe = write_recipe(tmp_path, f"auto{os.getpid()}")
    spec = TestbedSpec(regions=(RegionSpec(name="us", hosts=2, delay_ms=25.0),
                                RegionSpec(name="eu", hosts=2, delay_ms=25.0)))
    procs = []
    with Testbed(spec) as tb:
        try:
            first: list[str] = []
            for host in ("us0", "eu0", "us1", "eu1"):  # alternate: a peer's nearest is not always the last one
                listen, announce = tb.maddrs(host)
                procs.append(_start(tmp_path, host, first, ["--host-maddrs", listen[0], "--announce-maddrs",
                                                            announce[0], "--region", "auto"], recipe,
                                    netns=tb.ns(host)))
                log = tmp_path / f"{host}.log"
                deadline = time.monotonic() + 60
                while not _MEASURED.search(log.read_text(errors="replace") if log.exists() else ""):
                    assert procs[-1].poll() is None, log.read_text(errors="replace")[-3000:]
                    assert time.monotonic() < deadline, f"{host} measured no region"
                    time.sleep(0.2)
                if not first:
                    first = [m for m in wait_file(tmp_path / "us0.maddrs", 60, procs[0]) if "/ip4/10.200." in m]
            named = {h: _MEASURED.findall((tmp_path / f"{h}.log").read_text(errors="replace"))[-1]
                     for h in ("us0", "us1", "eu0", "eu1")}
            assert named["us0"] == named["us1"] and named["eu0"] == named["eu1"], named
            assert named["us0"] != named["eu0"], named
        finally:
            _stop(procs)


def test_region_near_must_be_positive() -> None:
    from p2ptrain.peer import PeerConfig

    assert PeerConfig(region="auto", region_near=0.02).region_near == 0.02
    with pytest.raises(ValueError, match="region_near"):
        PeerConfig(region="auto", region_near=0.0)
