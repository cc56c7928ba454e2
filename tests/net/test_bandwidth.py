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
