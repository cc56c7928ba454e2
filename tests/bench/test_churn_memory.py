"""The churn benchmark's memory figure (bench/churn.py, ``memory_growth``): a process's warm-up is not growth, its
RSS's sawtooth is not growth, a steady climb after the warm-up is."""

from __future__ import annotations

import math
from typing import Any

import pytest

from bench.churn import WARMUP_S, memory_growth


def _phase(rss: list[tuple[float, float]], started: float = 0.0) -> dict[str, Any]:
    return {"window_s": [0.0, 1860.0],
            "peers": {"p": {"lives": [{"started": started}], "rss_mb": rss}}}


def _samples(mb_at: Any, every: float = 15.0, until: float = 1860.0) -> list[tuple[float, float]]:
    return [(t, mb_at(t)) for t in (i * every for i in range(int(until / every) + 1))]


def _warm_then(after: Any) -> Any:
    """A fresh peer's RSS: 340 → 545 MB over its first 6 minutes, then ``after(t)``; a ±10 MB sawtooth throughout."""
    def mb(t: float) -> float:
        saw = 10.0 * math.sin(2 * math.pi * t / 170.0)
        return (340.0 + 205.0 * t / 360.0 if t < 360 else after(t)) + saw
    return mb


def test_a_warm_up_to_a_plateau_with_a_sawtooth_is_flat() -> None:
    [g] = memory_growth(_phase(_samples(_warm_then(lambda t: 545.0))))
    assert g["growth_mb_per_min"] == pytest.approx(0.0, abs=0.1)
    # counted from minute 2 (the earlier figure), the same process read as growth
    [early] = memory_growth(_phase(_samples(_warm_then(lambda t: 545.0))), after_start=120.0)
    assert early["growth_mb_per_min"] > 0.5


def test_a_steady_climb_after_the_warm_up_is_growth() -> None:
    [g] = memory_growth(_phase(_samples(_warm_then(lambda t: 545.0 + (t - 360.0) / 60.0))))
    assert g["growth_mb_per_min"] == pytest.approx(1.0, abs=0.1)


def test_a_process_too_short_after_its_warm_up_is_not_counted() -> None:
    short = _samples(_warm_then(lambda t: 545.0 + t), until=WARMUP_S + 200.0)
    assert memory_growth(_phase(short)) == []
