"""A peer that resumes from its checkpoint into a swarm that moved on meanwhile: it takes the swarm's θ
and keeps its own inner state (AdamW, step, data position)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import types
from pathlib import Path

import pytest
import torch

from p2ptrain.algo.methods import method_config
from p2ptrain.data import Corpus, DataConfig
from p2ptrain.net.memory import MemorySwarm
from p2ptrain.peer import Peer, PeerConfig
from p2ptrain.peer_checkpoint import PeerCheckpoints
from p2ptrain.sync import NetLoop
from p2ptrain.trainer import TrainerConfig, make_trainer

from .peers import MODEL


def _stop_all(peers: list[Peer], threads: list[threading.Thread], net: NetLoop) -> list[str]:
    """Stop the peers and wait for their threads before the network loop closes: a peer still stepping on a
    closed loop fails in a later test's time (the suite beside a benchmark: two such threads, 220 steps not done
    within the join's 60 s). The names of the threads still running (none, or the test fails)."""
    for p in peers:
        p.request_stop()
    for t in threads:
        t.join(60)
    alive = [t.name for t in threads if t.is_alive()]
    net.close()
    return alive


def test_resume_takes_the_swarms_theta_and_keeps_its_own_inner_state(corpus: Corpus, tmp_path: Path) -> None:
    net, swarm = NetLoop(), MemorySwarm(join_window=0.3, ttl=3.0)
    method = method_config("streaming", H=8, P=2, tau=2, codec="fp32", timeout=10)

    def peer(name: str, steps: int, rank: int, ckdir: Path | None = None) -> Peer:
        tr = make_trainer(MODEL, TrainerConfig(batch_size=2, warmup_steps=2, total_steps=300), DataConfig(),
                          rank=rank, world=4, corpus=corpus)
        # (the inner state exactly as saved: no steps while it connects, see the test below)
        cfg = PeerConfig(run_id="r", steps=steps, step_seconds=0.03, join_window=0.3, join_timeout=10, heartbeat=0.2,
                         ttl=3.0, drain_timeout=10, min_step_seconds=0.03, train_while_connecting=False,
                         checkpoint_dir=str(ckdir) if ckdir else None, checkpoint_every=2)

        async def make() -> object:
            return swarm.transport(name)

        return Peer(cfg, method, tr, make, net=net)  # type: ignore[arg-type]

    threads: list[threading.Thread] = []
    try:
        a, b = peer("a", 220, 0), peer("b", 220, 1)
        c = peer("c", 40, 2, tmp_path / "c")
        for p in (a, b, c):
            p.start()
        threads += [threading.Thread(target=p.run, daemon=True) for p in (a, b, c)]
        for t in threads:
            t.start()
        threads[2].join(60)  # c leaves after 40 steps, writing a checkpoint
        assert not threads[2].is_alive()
        _, saved = PeerCheckpoints(tmp_path / "c").latest()  # type: ignore[misc]
        assert saved["trainer"]["step"] == 40
        # ... the swarm moves on without c (four more rounds), then c comes back from its checkpoint
        target = a.applied + 4
        while a.applied < target and threads[0].is_alive():
            threads[0].join(0.1)
        assert a.applied >= target
        back = peer("c", 80, 2, tmp_path / "c")
        PeerCheckpoints.restore(back, saved)
        back.start()
        assert back.synced_from in {a.peer_id, b.peer_id}
        source = a if back.synced_from == a.peer_id else b
        held = {d for served in source.served_digests for d in served} | {d for d, _ in source.applied_log.values()}
        assert all(d in held for d in back.start_digests)  # the swarm's θ, not the checkpoint's
        saved_theta = torch.cat([t.flatten() for f in saved["outer"]["fragments"] for t in f["theta"]])
        now_theta = torch.cat([t.flatten() for f in back.frags for t in back.outer.theta(f.index)])  # type: ignore[union-attr]
        assert not torch.equal(saved_theta, now_theta)
        # its own inner state is the checkpoint's: step, tokens, data position, AdamW moments
        assert back.trainer.step_count == 40 and back.trainer.tokens_seen == saved["trainer"]["tokens_seen"]
        assert back.trainer.stream.state_dict() == saved["trainer"]["stream"]
        opt = back.trainer.optimizer.state_dict()["state"]
        for i, st in saved["trainer"]["optimizer"]["state"].items():
            assert torch.equal(opt[i]["exp_avg"], st["exp_avg"]) and torch.equal(opt[i]["exp_avg_sq"], st["exp_avg_sq"])
        summary = back.run()  # and it trains on with the swarm
        assert summary.steps == 80 and summary.rounds_complete > 0
    finally:
        alive = _stop_all([a, b, c], threads, net)
    assert not alive, f"peer threads still running after their stop: {alive}"



def test_a_resumed_peer_trains_while_it_connects_and_keeps_that_progress(corpus: Corpus, tmp_path: Path) -> None:
    """Its connect takes a second (a daemon and a DHT on a loaded machine take 10-20 s): the resumed peer trains its
    checkpoint's model meanwhile. Those steps are its own: the step, the tokens and AdamW move on from the
    checkpoint's, the swarm's θ is taken with that progress kept on top of it, and their tokens go into the next
    rounds (the tokens marks are the checkpoint's)."""
    net, swarm = NetLoop(), MemorySwarm(join_window=0.3, ttl=3.0)
    method = method_config("streaming", H=8, P=2, tau=2, codec="fp32", timeout=10)

    def peer(name: str, steps: int, rank: int, ckdir: Path, delay: float = 0.0) -> Peer:
        tr = make_trainer(MODEL, TrainerConfig(batch_size=2, warmup_steps=2, total_steps=300), DataConfig(),
                          rank=rank, world=2, corpus=corpus)
        cfg = PeerConfig(run_id="r", steps=steps, step_seconds=0.03, join_window=0.3, join_timeout=10, heartbeat=0.2,
                         ttl=3.0, drain_timeout=10, min_step_seconds=0.03, checkpoint_dir=str(ckdir),
                         checkpoint_every=2)

        async def make() -> object:
            await asyncio.sleep(delay)
            return swarm.transport(name)

        return Peer(cfg, method, tr, make, net=net)  # type: ignore[arg-type]

    threads: list[threading.Thread] = []
    try:
        a, c = peer("a", 400, 0, tmp_path / "a"), peer("c", 30, 1, tmp_path / "c")
        for p in (a, c):
            p.start()
        threads += [threading.Thread(target=p.run, daemon=True) for p in (a, c)]
        for t in threads:
            t.start()
        threads[1].join(60)
        assert not threads[1].is_alive()
        _, saved = PeerCheckpoints(tmp_path / "c").latest()  # type: ignore[misc]
        back = peer("c", 200, 1, tmp_path / "c", delay=1.0)
        PeerCheckpoints.restore(back, saved)
        back.start()
        k = back.connect_steps
        assert k >= 5, k  # a second of 0.03 s steps (loaded machine: a few at least)
        per_step = saved["trainer"]["tokens_seen"] // saved["trainer"]["step"]
        assert back.trainer.step_count == saved["trainer"]["step"] + k
        assert back.trainer.tokens_seen == saved["trainer"]["tokens_seen"] + k * per_step
        assert back.driver is not None and back.driver.tokens_at_send == saved["peer"]["tokens_at_send"]
        held = {d for served in a.served_digests for d in served} | {d for d, _ in a.applied_log.values()}
        assert all(d in held for d in back.start_digests)  # θ is the swarm's ...
        for f in back.frags:  # ... and the local model holds progress beyond it on every fragment
            local = back.trainer.snapshot(f.names)
            assert any(not torch.equal(x, t) for x, t in zip(local, back.outer.theta(f.index), strict=True))
        back.close()
    finally:
        alive = _stop_all([a, c], threads, net)
    assert not alive, f"peer threads still running after their stop: {alive}"


def _lone(corpus: Corpus, swarm: MemorySwarm, net: NetLoop) -> Peer:
    """A streaming peer (P 2) alone in a memory swarm, started: its driver and outer loop exist."""
    method = method_config("streaming", H=8, P=2, tau=2, codec="fp32", timeout=10)
    tr = make_trainer(MODEL, TrainerConfig(batch_size=2, warmup_steps=2, total_steps=300), DataConfig(),
                      rank=0, world=1, corpus=corpus)
    cfg = PeerConfig(run_id="r", steps=10, step_seconds=0.03, join_window=0.3, join_timeout=5, heartbeat=0.2,
                     ttl=3.0, drain_timeout=5, min_step_seconds=0.03)

    async def make() -> object:
        return swarm.transport("heir")

    return Peer(cfg, method, tr, make, net=net)  # type: ignore[arg-type]


def test_a_bequest_held_for_the_next_round_is_in_the_checkpoint(corpus: Corpus, tmp_path: Path) -> None:
    """What an heir holds of a leaver's progress until its next round of the fragment is saved with its checkpoint
    and held again after a resume (a crash in between loses it no more than the heir's own progress)."""
    from p2ptrain.algo.bequest import Bequest
    from p2ptrain.checkpoint import state_from_bytes, state_to_bytes

    net, swarm = NetLoop(), MemorySwarm(join_window=0.3, ttl=3.0)
    try:
        heir = _lone(corpus, swarm, net)
        heir.start()
        assert heir.driver is not None
        g = torch.Generator().manual_seed(3)
        d = [torch.randn(t.shape, generator=g) for t in heir.outer.theta(1)]
        heir.driver.inherit(Bequest(1, d, 123, "leaver-id"))
        saved = state_from_bytes(state_to_bytes(PeerCheckpoints.state(heir)))  # as written and read back
        heir.close()
        back = _lone(corpus, swarm, net)
        PeerCheckpoints.restore(back, saved)
        back.start()
        assert back.driver is not None and list(back.driver.bequests) == [1]
        (b,) = back.driver.bequests[1]
        assert (b.fragment, b.tokens, b.source) == (1, 123, "leaver-id")
        assert all(torch.equal(x, y) for x, y in zip(b.displacement, d, strict=True))
        back.close()
    finally:
        net.close()


def test_an_heir_takes_a_sound_bequest_and_refuses_what_it_cannot_hold(corpus: Corpus) -> None:
    """The heir's side on a started peer: bytes that are no bequest, a fragment it has not, one twice, a norm far
    beyond its own, and more than it holds per fragment are refused with the reason; a sound one is held."""
    from p2ptrain.algo.bequest import Bequest, displacement
    from p2ptrain.peer import bequest

    net, swarm = NetLoop(), MemorySwarm(join_window=0.3, ttl=3.0)
    try:
        heir = _lone(corpus, swarm, net)
        heir.start()
        d = heir.driver
        assert d is not None
        for _ in range(3):
            heir.trainer.step()  # some progress of its own to hold a bequest to
        frag = heir.frags[0]
        own = displacement(heir.trainer.snapshot(frag.names), heir.outer.theta(0))
        sound = [x * 0.5 for x in own]
        tokens = heir.trainer.tokens_seen
        assert bequest.accept(heir, "l", b"not a bequest") is not None
        from p2ptrain.checkpoint import state_to_bytes as pack

        for bad in ({"bequests": 3}, {"bequests": [{"fragment": "x", "tokens": 1, "d": []}]},
                    {"bequests": [{"fragment": 0, "tokens": 1, "d": ["not a tensor"]}]}, {"other": 1}):
            assert "malformed bequest" in (bequest.accept(heir, "l", pack(bad)) or ""), bad
        assert "no fragment 7" in (bequest.accept(heir, "l", bequest.to_bytes([Bequest(7, sound, tokens)])) or "")
        twice = bequest.to_bytes([Bequest(0, sound, tokens), Bequest(0, sound, tokens)])
        assert "twice" in (bequest.accept(heir, "l", twice) or "")
        far = bequest.to_bytes([Bequest(0, [x * 1000 for x in own], tokens)])
        assert "norm" in (bequest.accept(heir, "l", far) or "")
        assert d.bequests == {}
        for _ in range(bequest.PENDING):
            assert bequest.accept(heir, "leaver", bequest.to_bytes([Bequest(0, sound, tokens)])) is None
        assert "held already" in (bequest.accept(heir, "l", bequest.to_bytes([Bequest(0, sound, tokens)])) or "")
        held = d.bequests[0]
        assert len(held) == bequest.PENDING and held[0].source == "leaver" and held[0].tokens == tokens
        assert all(torch.allclose(a, b) for a, b in zip(held[0].displacement, sound, strict=True))
        heir.request_stop()
        assert bequest.accept(heir, "l", bequest.to_bytes([Bequest(1, sound, tokens)])) == "leaving, or not training"
        heir.close()
    finally:
        net.close()


def test_a_leave_trains_while_its_last_round_is_in_flight_and_not_after(corpus: Corpus,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A leave's drain (``Peer._train_while_in_flight``) takes inner steps while a round it sent has not ended,
    and none once it has, past the drain's deadline or at ``--steps``; their progress stays in the local model
    (what the leave's bequest hands on). Not for a peer whose steps drive its clock (``clock="steps"``)."""
    net, swarm = NetLoop(), MemorySwarm(join_window=0.3, ttl=3.0)
    heir = _lone(corpus, swarm, net)
    try:
        heir.start()
        assert heir.driver is not None and heir.collective is not None
        heir.cfg.steps = 10_000
        flying = types.SimpleNamespace(live=True)  # a round of ours still in flight
        heir.driver.in_flight.append(flying)  # type: ignore[arg-type]
        start = heir.trainer.step_count
        heir.collective.ended = lambda r: r is not flying or heir.trainer.step_count >= start + 5  # type: ignore[method-assign]
        before = heir.trainer.snapshot(heir.frags[0].names)
        with caplog.at_level(logging.INFO, logger="p2ptrain.peer.outer"):
            heir._train_while_in_flight(time.perf_counter() + 60)
        assert heir.trainer.step_count == start + 5  # it trained until the round ended, and not a step more
        assert "event=trained_while_draining steps=5" in caplog.text
        after = heir.trainer.snapshot(heir.frags[0].names)
        assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))  # progress, in the model

        heir.collective.ended = lambda r: False  # type: ignore[method-assign]  # a round that never ends ...
        t0, start = time.perf_counter(), heir.trainer.step_count
        heir._train_while_in_flight(t0 + 0.5)
        assert heir.trainer.step_count > start and time.perf_counter() - t0 < 0.5 + 5  # ... ends at the deadline
        heir.cfg.steps = heir.trainer.step_count + 2
        heir._train_while_in_flight(time.perf_counter() + 60)
        assert heir.trainer.step_count == heir.cfg.steps  # ... or at --steps
        heir.cfg.steps, heir.cfg.clock = 10_000, "steps"
        start = heir.trainer.step_count
        heir._train_while_in_flight(time.perf_counter() + 60)
        assert heir.trainer.step_count == start  # lockstep: its steps are the swarm's clock, none taken here
        heir.driver.in_flight.remove(flying)  # type: ignore[arg-type]
    finally:
        heir.close()
        net.close()
