"""Error feedback's codec round trip leaves the compute thread: a send defers the compressor's begin to
Round.prepare (a real peer's round runner runs it in a worker thread), which runs it once; an abort before it
leaves the buffer as it was, an abort from another thread while it runs neither waits for it nor keeps it."""

from __future__ import annotations

import threading

import torch

from p2ptrain.algo.feedback import ErrorFeedback
from p2ptrain.algo.fragments import make_fragments
from p2ptrain.algo.methods import OuterLoop, StreamingConfig
from p2ptrain.algo.rounds import RoundState
from p2ptrain.collective.butterfly import parts_roundtrip
from p2ptrain.collective.codecs import get_codec
from tests.algo.test_methods import UNITS, FakePeer


def _loop(codec: str = "1bit") -> tuple[OuterLoop, FakePeer]:
    cfg = StreamingConfig(H=8, P=2, tau=1, codec=codec)
    outer = OuterLoop(cfg, make_fragments(UNITS, cfg.fragments, cfg.fragment_mode))
    peer = FakePeer(0)
    outer.init(peer)
    for _ in range(3):
        peer.step()
    return outer, peer


def test_a_send_leaves_the_round_trip_to_prepare_which_runs_it_once() -> None:
    outer, peer = _loop()
    rnd = outer.start(0, 3, peer)
    ef = rnd.compressor
    assert isinstance(ef, ErrorFeedback) and ef.deferred
    assert rnd.payload is None and rnd.pending is not None and ef.error is None  # nothing computed at the send
    payload = rnd.prepare()
    assert payload is not None and rnd.payload is payload and ef.error is not None
    # the payload is what the wire carries of Δ (the buffer was empty): Δ − e, and Δ = sent + e
    flat_delta = torch.cat([d.reshape(-1) for d in rnd.delta])
    flat_sent = torch.cat([p.reshape(-1) for p in payload])
    torch.testing.assert_close(flat_sent + ef.error, flat_delta)
    torch.testing.assert_close(flat_sent, parts_roundtrip(get_codec("1bit"), flat_delta, ef.members))
    error = ef.error.clone()
    assert rnd.prepare() is payload  # once: a second call returns the same payload, the buffer untouched
    torch.testing.assert_close(ef.error, error)


def test_a_stateless_compressor_still_begins_at_the_send() -> None:
    outer, peer = _loop("e3m0")
    rnd = outer.start(0, 3, peer)
    assert rnd.pending is None and rnd.payload is not None and rnd.prepare() is rnd.payload


def test_an_abort_before_prepare_keeps_the_buffer_and_the_next_round_begins_from_it() -> None:
    outer, peer = _loop()
    first = outer.start(0, 3, peer)
    first.prepare()
    assert first.receive(list(first.payload or []), total_weight=1.0, members=1) is None
    ef = first.compressor
    assert isinstance(ef, ErrorFeedback) and ef.error is not None
    kept = ef.error.clone()
    second = outer.start(0, 11, peer)
    second.abort()
    assert second.state is RoundState.ABORTED and second.prepare() is None
    torch.testing.assert_close(ef.error, kept)  # the aborted round never began: nothing to undo


def test_a_pending_begin_runs_before_the_next_round_of_its_compressor() -> None:
    """Rounds of one fragment share the compressor: a begin still pending when the next round starts (eager's
    rounds overlap) runs first, so the buffer sees the rounds in their order."""
    outer, peer = _loop()
    first = outer.start(0, 3, peer)
    second = outer.start(0, 11, peer)
    assert first.pending is None and first.payload is not None  # begun by the second start
    assert second.pending is not None


def test_an_abort_while_the_round_trip_runs_does_not_wait_and_undoes_it() -> None:
    entered, release = threading.Event(), threading.Event()
    codec = get_codec("1bit")

    def slow(flat: torch.Tensor, members: int) -> torch.Tensor:
        entered.set()
        assert release.wait(30)
        return parts_roundtrip(codec, flat, members)

    outer, peer = _loop()
    rnd = outer.start(0, 3, peer)
    ef = rnd.compressor
    assert isinstance(ef, ErrorFeedback)
    ef.roundtrip = slow
    out: list[list[torch.Tensor] | None] = []
    worker = threading.Thread(target=lambda: out.append(rnd.prepare()))
    worker.start()
    assert entered.wait(30)
    done = threading.Event()
    aborter = threading.Thread(target=lambda: (rnd.abort(), done.set()))
    aborter.start()
    assert done.wait(10)  # the abort returned while the begin still ran
    assert rnd.state is RoundState.ABORTED
    release.set()
    worker.join(30)
    aborter.join(30)
    assert out == [None] and rnd.payload is None
    assert ef.error is None  # the begin was undone: the buffer is what it was before the round (none yet)
