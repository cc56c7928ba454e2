"""A round is stepped from the θ its fingerprint vote was about, on every member that applies it.

Seen on a loaded machine (streaming, τ = 2): two peers that fell behind the swarm's clock skipped to the next send
step while their previous round of the fragment was still in flight. Sends came before applies at that step, so
they sent the new round with θ from before the overdue apply (that is what they fingerprinted and kept as
``before:KEY``), then applied the old round, and stepped the new one from θ after it. Their stale θ won the vote;
the others, flagged divergent, repaired onto it (``before:KEY``) and stepped from it: a fork, both sides sure they
held the majority's θ.

Here three drivers run real outer loops and replicas over a collective that votes as an owner does
(:func:`~p2ptrain.net.parts.select_contributions`), deterministically, with no network.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Sequence
from typing import Any

import torch

from p2ptrain.algo.fragments import make_fragments
from p2ptrain.algo.methods import OuterLoop, method_config
from p2ptrain.algo.rounds import Round
from p2ptrain.driver import OuterDriver
from p2ptrain.net.parts import flatten, select_contributions, unflatten
from p2ptrain.net.transport import RoundFailed
from p2ptrain.peer.outer import _Hooks
from p2ptrain.peer.replica import ReplicaState
from p2ptrain.sync import fingerprint

from .algo.test_methods import UNITS, FakePeer
from .test_driver_tokens import Scripted


class Voting:
    """Rounds of ``n`` drivers: a round arrives once all have sent it, averaged over the members whose fingerprint
    of θ at send is the majority's; the others are told they diverged."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.open: dict[str, dict[str, Round]] = {}

    def view(self, me: str) -> Any:
        return types.SimpleNamespace(launch=lambda rnd, request: self.launch(me, rnd, request.key),
                                     arrived=lambda rnd: rnd.arrived,
                                     wait=lambda rounds: all(r.finished for r in rounds),
                                     expected_members=lambda: self.n, proposed_sends=lambda *a: None)

    def launch(self, me: str, rnd: Round, key: str) -> None:
        sent = self.open.setdefault(key, {})
        sent[me] = rnd
        if len(sent) < self.n:
            return
        members = sorted(sent)
        contribs = {p: (0, flatten(r.payload or []), r.weight, fingerprint(r.theta)) for p, r in sent.items()}
        sel = select_contributions(contribs, members, 0, contribs[members[0]][1].numel())
        total = sum(w for _, w in sel.use.values())
        avg = sum(v * (w / total) for v, w in sel.use.values())
        assert isinstance(avg, torch.Tensor)
        for p, r in sent.items():
            r.divergent, r.agreed, r.contributors = p not in sel.agree, sel.agreed, tuple(sorted(sel.use))
            r.receive(unflatten(avg.clone(), r.payload or []), total_weight=total, members=len(sel.use))


class Alone(Scripted):
    """Every round arrives at once, whatever its number of phases (low-rank rounds have two)."""

    def launch(self, rnd: Round, request: Any) -> None:
        while rnd.payload is not None:
            rnd.receive(list(rnd.payload), total_weight=rnd.weight, members=1)


class Swarm:
    """``n`` peers: fake inner loops, outer loops, drivers with the swarm peer's hooks and replicas."""

    def __init__(self, n: int) -> None:
        method = method_config("streaming", H=8, P=2, tau=2, codec="fp32")
        net = Voting(n)
        self.ids = [f"peer{i}" for i in range(n)]
        self.fakes = [FakePeer(i) for i in range(n)]
        self.replicas: dict[str, ReplicaState] = {}
        self.drivers: list[OuterDriver] = []
        for me, fake in zip(self.ids, self.fakes, strict=True):
            frags = make_fragments(UNITS, 2)
            outer = OuterLoop(method, frags)
            outer.init(fake)
            lock = threading.Lock()
            i = len(self.drivers)
            replica = ReplicaState(outer, fake, frags, lock, lambda i=i: list(self.drivers[i].in_flight))
            peer = types.SimpleNamespace(replica=replica, peer_id=me, fetch=self.fetch, checkpoints=None, metrics=None)
            driver = OuterDriver(outer, fake, net.view(me), hooks=_Hooks(peer), lock=lock)  # type: ignore[arg-type]
            self.replicas[me] = replica
            self.drivers.append(driver)

    def fetch(self, peer: str, name: str) -> bytes:
        raw = self.replicas[peer].provide(name)
        if raw is None:
            raise RoundFailed(f"{peer} has no {name}")
        return raw

    def advance(self, peers: Sequence[int], steps: Sequence[int]) -> None:
        """Each of ``peers`` trains one inner step per logical step in ``steps``; the steps between are skipped."""
        for s in steps:
            for i in peers:
                self.fakes[i].step()
                assert self.drivers[i].advance(s)

    def digests(self, key: str) -> dict[str, str]:
        """θ's digest after round ``key`` on every peer that applied it."""
        out = {}
        for me, rep in self.replicas.items():
            got = rep.digests().get(key)
            if got is not None:
                out[me] = got[0]
        return out

    def close(self) -> None:
        for rep in self.replicas.values():
            rep.close()


def test_peers_that_skipped_to_a_send_step_step_the_round_from_the_theta_they_sent() -> None:
    swarm = Swarm(3)
    try:
        swarm.advance([0, 1, 2], range(1, 17))  # f0 sends at 8 and 16 (due 10 and 18), f1 at 4 and 12
        swarm.advance([0], [17, 18])  # peer0 applies f0.L16 at its due step
        swarm.advance([1, 2], [24])  # peers 1 and 2 fell behind: they skip 17-23, f0.L16 still in flight
        swarm.advance([0], [24])
        assert not any(r.divergent for d in swarm.drivers for r in d.in_flight)  # one θ in the vote
        swarm.advance([0, 1, 2], [25, 26])  # f0.L24 is due at 26
        after = swarm.digests("f0.L24")
        assert len(after) == 3 and len(set(after.values())) == 1, after
        assert len(set(swarm.digests("f0.L16").values())) == 1
    finally:
        swarm.close()


def test_a_round_whose_theta_was_replaced_in_flight_is_not_applied() -> None:
    """Between a round's send and its apply something replaced the fragment's θ (a resync took the swarm's state,
    which may already hold the round): stepped from that θ, the round would make a replica nobody voted for. It is
    not applied; its progress stays in θ − θ_i, as an aborted round's does."""
    peer = FakePeer(0)
    outer = OuterLoop(method_config("streaming", H=8, P=2, tau=2, codec="fp32"), make_fragments(UNITS, 2))
    outer.init(peer)
    driver = OuterDriver(outer, peer, Scripted())  # type: ignore[arg-type]
    for s in range(1, 9):
        peer.step()
        assert driver.advance(s)
    taken = [t + 1.0 for t in outer.theta(0)]  # f0.L8 is in flight; another θ of fragment 0 comes in
    outer.overwrite(0, taken, outer.momentum(0))
    applied = driver.applied
    for s in (9, 10):
        peer.step()
        assert driver.advance(s)
    assert driver.applied == applied and driver.in_flight == []
    assert all(torch.equal(a, b) for a, b in zip(outer.theta(0), taken, strict=True))


def test_a_theta_replaced_in_flight_by_design_is_still_stepped() -> None:
    """Rules whose rounds restart from θ and apply after the next send (DiLoCoX's naive start, eager) step a round
    from θ after the previous one by design: their rounds are applied as before."""
    peer = FakePeer(0)
    cfg = method_config("dilocox", H=4, rank=2, start_rule="naive", codec="fp32")
    outer = OuterLoop(cfg, make_fragments(UNITS, 1))
    outer.init(peer)
    driver = OuterDriver(outer, peer, Alone())  # type: ignore[arg-type]
    for s in range(1, 13):
        peer.step()
        assert driver.advance(s)
    assert driver.applied == 2  # the rounds of steps 4 and 8, each applied after the next send
