"""The object census (peer/census.py): its setting, and the types it reports as grown."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

import pytest

from p2ptrain.peer.census import (
    ENV,
    census_every,
    count_types,
    grown,
    heap_mb,
    run_census,
)


class Kept:
    pass


def test_census_setting_is_off_by_default_and_refuses_nonsense() -> None:
    assert census_every({}) == 0.0 and census_every({ENV: " "}) == 0.0
    assert census_every({ENV: "120"}) == 120.0
    for bad in ("soon", "-1", "nan"):
        with pytest.raises(ValueError, match=ENV):
            census_every({ENV: bad})


def test_grown_reports_the_largest_changes_first() -> None:
    first = Counter({"a": 10, "b": 5, "c": 3})
    now = Counter({"a": 10, "b": 105, "c": 1, "d": 7})
    assert grown(first, now) == [("b", 100), ("d", 7), ("c", -2)]
    assert grown(first, now, top=1) == [("b", 100)]


def test_a_type_that_is_kept_shows_in_the_census(caplog: pytest.LogCaptureFixture) -> None:
    name = f"{__name__}.Kept"
    kept: list[Kept] = []
    before = count_types()[name]
    kept.extend(Kept() for _ in range(500))
    assert count_types()[name] == before + 500

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if "event=census" in r.getMessage()]

    async def go() -> None:
        task = asyncio.create_task(run_census(0.01))
        for _ in range(1000):  # the first census (the baseline) may take a while on a loaded machine
            if lines():
                break
            await asyncio.sleep(0.01)
        kept.extend(Kept() for _ in range(1000))
        for _ in range(1000):
            if f"{name}:+1000" in lines()[-1]:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with caplog.at_level(logging.INFO, logger="p2ptrain.peer.census"):
        asyncio.run(go())
    seen = lines()
    assert len(seen) >= 2 and f"{name}:+1000" in seen[-1] and "rss_mb=" in seen[-1], seen[-3:]

def test_heap_figures_see_a_large_allocation() -> None:
    first = heap_mb()
    if first is None:
        pytest.skip("no glibc mallinfo2 here")
    rss, used, free = first
    assert rss > 0 and used > 0 and free >= 0
    block = bytearray(64 * 1024 * 1024)  # 64 MB: glibc maps it, counted as handed out
    after = heap_mb()
    assert after is not None and after[1] - used >= 60
    del block

