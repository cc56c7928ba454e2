from __future__ import annotations

import pytest

from p2ptrain.net.bandwidth import LinkMeter, ThroughputEMA


def test_ema_hand_computed() -> None:
    e = ThroughputEMA(alpha=0.5, min_bytes=100)
    assert e.update(1000, 1.0) == 1000.0  # the first sample is taken as is
    assert e.update(3000, 1.0) == pytest.approx(2000.0)
    assert e.update(50, 0.001) == pytest.approx(2000.0)  # too small to say anything about bandwidth
    assert e.update(1000, 0.0) == pytest.approx(2000.0)


def test_link_meter_reports_the_slowest_link() -> None:
    m = LinkMeter(alpha=1.0)
    assert m.slowest() == 0.0
    m.update("a", 10**6, 1.0)
    m.update("b", 10**6, 4.0)
    assert m.rate("a") == 10**6 and m.slowest() == pytest.approx(2.5e5) and m.rate("c") == 0.0


def test_a_seeded_rate_counts_until_the_first_real_sample_replaces_it() -> None:
    m = LinkMeter(alpha=0.3)
    assert not m.known("a")
    m.seed("a", 512 * 1024, 2.0)  # a probe that crawled through slow start
    assert m.known("a") and m.slowest() == pytest.approx(262144.0)
    m.seed("a", 512 * 1024, 1.0)  # a later guess before any real sample replaces the first
    assert m.rate("a") == pytest.approx(524288.0)
    m.update("a", 10**7, 1.0)  # a real transfer: taken as is, not averaged with the guess
    assert m.rate("a") == pytest.approx(1e7)
    m.seed("a", 1, 1.0)  # a guess after real samples changes nothing
    assert m.rate("a") == pytest.approx(1e7)
    m.update("a", 10**7, 2.0)
    assert m.rate("a") == pytest.approx(0.7e7 + 0.3 * 5e6)
