"""The regions testbed on a tiny case: two hosts in two regions, one shaped and delayed path between them."""

from __future__ import annotations

import subprocess

import pytest

from bench.testbed import (
    RegionSpec,
    Testbed,
    TestbedSpec,
    measure_flows,
    measure_rtt,
    measure_throughput,
    parse_region,
    unavailable_reason,
)

pytestmark = pytest.mark.net

RATE = 80e6  # bit/s on each region's uplink
DELAY = 20.0  # ms one way on each uplink: 40 ms between the regions


@pytest.fixture(scope="module")
def spec() -> TestbedSpec:
    if (reason := unavailable_reason()) is not None:
        pytest.skip(f"testbed unavailable: {reason}")
    return TestbedSpec(regions=(RegionSpec(name="a", uplink_rate=RATE, delay_ms=DELAY),
                                RegionSpec(name="b", uplink_rate=RATE, delay_ms=DELAY)))


def _namespaces() -> set[str]:
    return set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())


@pytest.mark.timeout(60)
def test_throughput_and_delay_follow_the_configuration(spec: TestbedSpec) -> None:
    assert spec.path_rate("a0", "b0") == RATE and spec.delay("a", "b") == 2 * DELAY
    with Testbed(spec) as tb:
        made = {n for n in _namespaces() if n.startswith(tb.tag)}
        assert len(made) == 5  # core, two gateways, two hosts
        sleeper = tb.run("a0", ["sleep", "60"])
        fwd = measure_throughput(tb, "a0", "b0", nbytes=6 << 20)
        back = measure_throughput(tb, "b0", "a0", nbytes=6 << 20)
        ping = measure_rtt(tb, "a0", "b0", count=15)
    for res in (fwd, back):
        assert res["bytes"] == 6 << 20
        assert 0.8 * RATE <= res["bits_per_s"] <= 1.2 * RATE, res
    assert 0.8 * 2 * DELAY <= 1000 * ping["one_way"] <= 1.2 * 2 * DELAY, ping
    # every small message took about 2 × 40 ms, none skipped the relay
    assert min(ping["rtts"]) >= 0.8 * 4 * DELAY / 1000, ping
    # teardown: the namespaces and the processes started inside them are gone
    assert not {n for n in _namespaces() if n.startswith(tb.tag)}
    assert sleeper.poll() is not None


@pytest.mark.timeout(60)
def test_flows_both_ways_share_each_uplink(spec: TestbedSpec) -> None:
    # Two flows a → b and one b → a at once: a's two share its uplink, so their sum (not each) is near the rate; each
    # direction has its own (full duplex). A rate per flow (about half of a's) instead of per region breaks it.
    with Testbed(spec) as tb:
        rates = measure_flows(tb, [("a0", "b0"), ("a0", "b0"), ("b0", "a0")], nbytes=4 << 20)
        alone = measure_throughput(tb, "a0", "b0", nbytes=4 << 20)["bits_per_s"]
    assert set(rates) == {"a", "b"}
    assert all(bits <= 1.2 * RATE for bits in rates.values()), rates
    # a's two flows together (each alone would be about half); b's one flow, short, on a loaded machine: looser
    # (its direction is its own: starved, it would be far below; 0.397 of the rate once in a full suite with a
    # simulator run beside it, the delay relay being a userspace process)
    assert rates["a"] >= 0.65 * RATE and rates["b"] >= 0.35 * RATE, rates
    assert rates["a"] <= 1.2 * alone, (rates, alone)


def test_without_delay_inside_a_region_and_bad_specs(spec: TestbedSpec) -> None:
    two = TestbedSpec(regions=(RegionSpec(name="us", hosts=2, host_rate=50e6),))
    with Testbed(two) as tb:
        ping = measure_rtt(tb, "us0", "us1", count=10)
        thr = measure_throughput(tb, "us1", "us0", nbytes=3 << 20)
    assert ping["one_way"] < 0.005  # no relay inside a region
    assert 0.8 * 50e6 <= thr["bits_per_s"] <= 1.2 * 50e6, thr
    with pytest.raises(ValueError, match="unique"):
        TestbedSpec(regions=(RegionSpec(name="a"), RegionSpec(name="a")))
    with pytest.raises(ValueError, match="hosts"):
        RegionSpec(name="a", hosts=0)


def test_region_strings() -> None:
    r = parse_region("us:2:1gbit:100mbit:25ms")
    assert (r.name, r.hosts, r.host_rate, r.uplink_rate, r.delay_ms) == ("us", 2, 1e9, 100e6, 25.0)
    r = parse_region("eu:1")
    assert (r.host_rate, r.uplink_rate, r.delay_ms) == (None, None, 0.0)
    with pytest.raises(ValueError, match="tc unit"):
        parse_region("us:1:fast")


def test_the_relay_ends_both_directions_when_one_fails() -> None:
    """The delay relay's two pumps (and its two directions) end together: a side that fails cancels the other
    instead of leaving it waiting, forever, on an event nobody sets (its task was garbage-collected pending)."""
    import asyncio

    from bench.testbed import _both

    async def go() -> None:
        cancelled: list[bool] = []

        async def fails() -> None:
            await asyncio.sleep(0.01)
            raise ConnectionResetError(104, "Connection reset by peer")

        async def waits() -> None:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.append(True)
                raise

        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(_both(waits(), fails()), 5)
        assert cancelled == [True]
        ended: list[int] = []

        async def ends(i: int) -> None:
            await asyncio.sleep(0.01 * i)
            ended.append(i)

        await asyncio.wait_for(_both(ends(2), ends(1)), 5)
        assert ended == [1, 2]
        assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []

    asyncio.run(go())
