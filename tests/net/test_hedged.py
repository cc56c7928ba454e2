"""A state downloaded from the first of several sources that answers (p2ptrain/net/hedged.py): a silent source costs
``hedge`` seconds, not its timeout, and the state crosses the wire once."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from p2ptrain.net.hedged import Progress, hedged_download
from p2ptrain.net.memory import MemorySwarm
from p2ptrain.net.transport import RoundFailed


class Sources:
    """Fake sources: ``silent`` never answer until their timeout; ``slow`` answer their first chunk after a
    delay; ``broken`` fail after their first chunk. Records who was asked, who was cancelled, and chunks sent."""

    def __init__(self, *, timeout: float = 5.0, silent: set[str] = frozenset(), slow: dict[str, float] | None = None,
                 broken: set[str] = frozenset(), chunks: int = 3) -> None:
        self.timeout, self.silent, self.slow, self.broken, self.chunks = timeout, silent, slow or {}, broken, chunks
        self.asked: list[str] = []
        self.cancelled: list[str] = []
        self.sent: dict[str, int] = {}

    async def fetch(self, peer: str, progress: Progress) -> bytes:
        self.asked.append(peer)
        try:
            if peer in self.silent:
                await asyncio.sleep(self.timeout)
                raise RoundFailed(f"{peer} did not answer")
            await asyncio.sleep(self.slow.get(peer, 0.0))
            for i in range(self.chunks):
                self.sent[peer] = self.sent.get(peer, 0) + 1
                progress(i + 1, self.chunks)
                if peer in self.broken:
                    raise RoundFailed(f"{peer} died mid-transfer")
                await asyncio.sleep(0.02)
            return peer.encode()
        except asyncio.CancelledError:
            self.cancelled.append(peer)
            raise


def _run(src: Sources, order: list[str], hedge: float | None,
         progress: Progress | None = None) -> tuple[str, bytes, float]:
    async def go() -> tuple[str, bytes, float]:
        t0 = time.monotonic()
        peer, data = await hedged_download(src.fetch, order, hedge=hedge, failure=RoundFailed, progress=progress)
        return peer, data, time.monotonic() - t0

    return asyncio.run(go())


def test_a_silent_source_costs_the_hedge_not_its_timeout_and_is_dropped(caplog: pytest.LogCaptureFixture) -> None:
    src = Sources(silent={"cut1", "cut2"}, timeout=5.0)
    with caplog.at_level(logging.INFO, logger="p2ptrain.net.hedged"):
        peer, data, took = _run(src, ["cut1", "cut2", "good", "spare"], hedge=0.1)
    assert (peer, data) == ("good", b"good")
    assert took < 2.0  # (about 0.2 s of hedges and 0.06 s of chunks; asked in turn: 10 s)
    assert src.asked == ["cut1", "cut2", "good"]  # the spare was never needed
    assert sorted(src.cancelled) == ["cut1", "cut2"]  # dropped once "good" answered, not left running
    hedges = [r.getMessage() for r in caplog.records if "event=download_hedged" in r.getMessage()]
    assert hedges == ["event=download_hedged what=state silent=cut1 next=cut2",
                      "event=download_hedged what=state silent=cut1,cut2 next=good"]  # each hedge, said once


def test_without_a_hedge_the_sources_are_asked_in_turn() -> None:
    src = Sources(silent={"cut"}, timeout=0.3)
    peer, _, took = _run(src, ["cut", "good"], hedge=None)
    assert peer == "good" and src.asked == ["cut", "good"] and src.cancelled == []
    assert took >= 0.3  # the silent one's whole timeout first


def test_the_first_to_answer_goes_on_alone_and_the_state_crosses_once() -> None:
    """The preferred source answers late (after two hedges): the one that answered first wins; the others still
    silent at that moment are dropped, so only one source sends its chunks beyond the first."""
    src = Sources(slow={"first": 0.5, "second": 0.15, "third": 0.5})
    got: list[tuple[int, int]] = []
    peer, _, _ = _run(src, ["first", "second", "third"], hedge=0.1, progress=lambda d, t: got.append((d, t)))
    assert peer == "second"
    assert src.asked == ["first", "second", "third"]
    assert sorted(src.cancelled) == ["first", "third"] and set(src.sent) == {"second"}
    assert got == [(1, 3), (2, 3), (3, 3)]  # progress follows the source that answered


def test_a_source_that_fails_mid_transfer_hands_the_download_to_the_next() -> None:
    src = Sources(broken={"flaky"})
    got: list[tuple[int, int]] = []
    peer, _, _ = _run(src, ["flaky", "good"], hedge=0.1, progress=lambda d, t: got.append((d, t)))
    assert peer == "good" and src.asked == ["flaky", "good"]
    assert got[-1] == (3, 3) and got.count((1, 3)) == 2  # the broken one's first chunk, then the good one's


def test_no_source_delivers_names_every_error() -> None:
    src = Sources(silent={"a"}, broken={"b"}, timeout=0.2)
    with pytest.raises(RoundFailed, match="no source delivered it") as err:
        _run(src, ["a", "b"], hedge=0.05)
    assert "a did not answer" in str(err.value) and "b died mid-transfer" in str(err.value)
    with pytest.raises(RoundFailed, match="no sources"):
        _run(src, [], hedge=0.05)


def test_a_hedge_must_be_positive() -> None:
    with pytest.raises(ValueError, match="hedge"):
        _run(Sources(), ["a"], hedge=0.0)


def test_a_transport_download_across_a_cut_asks_the_next_source_after_the_hedge() -> None:
    """Through a transport's ``download_state`` (the in-process swarm: a peer on the other side of a partition
    never answers): the reachable source's state comes after about one hedge, not the 5 s timeout."""

    async def go() -> tuple[str, bytes, float]:
        sw = MemorySwarm()
        me, far, near = sw.transport("me"), sw.transport("far"), sw.transport("near")
        far.serve_state(lambda name: b"far's" if name == "x" else None)
        near.serve_state(lambda name: b"near's" if name == "x" else None)
        sw.partition(["me", "near"], ["far"])
        t0 = time.monotonic()
        peer, data = await me.download_state(["far", "near"], "x", timeout=5.0, hedge=0.2)
        return peer, data, time.monotonic() - t0

    peer, data, took = asyncio.run(go())
    assert (peer, data) == ("near", b"near's") and took < 2.5
