"""The simulator's collective: M virtual peers' rounds on one virtual clock.

A :class:`VirtualSwarm` holds what the peers share (the network, every open round and slot, arrival times,
the run's byte accounting); each peer's :class:`~p2ptrain.driver.OuterDriver` talks to its own view of it,
a :class:`VirtualCollective`. A round starts when every peer has sent it and every member's link is free,
each phase costs what :class:`~p2ptrain.sim.network.Network` says, and its average is what a butterfly
all-reduce of those payloads delivers (:func:`~p2ptrain.collective.butterfly.butterfly_mean`). A slot is
decided when every peer has joined it, by the smallest peer's :class:`~p2ptrain.algo.slots.SlotLeader`, from
all views, as on a swarm. A peer that needs a result before its arrival time stalls until then (counted).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..algo.priority import sends_per_window
from ..algo.rounds import Round
from ..algo.slots import SlotLeader
from ..collective.butterfly import butterfly_mean, ring_factor
from ..collective.codecs import Codec
from ..driver import RoundRequest, SlotOutcome, SlotRequest
from .network import Network

__all__ = ["VirtualCollective", "VirtualSwarm"]


@dataclass
class _Open:
    rounds: dict[int, Round] = field(default_factory=dict)
    ready: float = 0.0


@dataclass
class _Slot:
    requests: dict[int, SlotRequest] = field(default_factory=dict)
    leaders: dict[int, SlotLeader] = field(default_factory=dict)
    outcome: SlotOutcome | None = None


class _SlotPending:
    def __init__(self, slot: _Slot) -> None:
        self.slot = slot

    def done(self) -> bool:
        return self.slot.outcome is not None

    def result(self) -> SlotOutcome:
        if self.slot.outcome is None:
            raise RuntimeError("slot not decided yet")
        return self.slot.outcome


@dataclass
class Accounting:
    """What the swarm moved: bytes per peer, syncs, and each round's trace for replays."""

    bytes_sent_per_peer: float = 0.0
    peak_bytes_per_sync: float = 0.0
    syncs: int = 0
    # (send step, due step, may apply late, encoded bytes of each phase)
    trace: list[tuple[int, int, bool, list[int]]] = field(default_factory=list)


class VirtualSwarm:
    """The state M virtual peers share (see the module docstring)."""

    def __init__(self, peers: int, network: Network, codec: Codec, *, step_time: float, late_ok: bool = False) -> None:
        self.m, self.net, self.codec, self.step_time, self.late_ok = peers, network, codec, step_time, late_ok
        self.clock = [0.0] * peers
        self.compute = [0.0] * peers
        self.stall = [0.0] * peers
        self.open: dict[str, _Open] = {}
        self.slots: dict[str, _Slot] = {}
        self.arrival: dict[Round, float] = {}
        self.acct = Accounting()
        self.events = 0  # rounds sent, slots joined, waits that ended: a pass that changes none is stuck

    def view(self, i: int) -> VirtualCollective:
        return VirtualCollective(self, i)

    def tick(self, i: int, seconds: float) -> None:
        """Peer ``i`` computed for ``seconds``."""
        self.clock[i] += seconds
        self.compute[i] += seconds

    def complete(self) -> bool:
        """Run every round all peers have sent; True if any ran."""
        done = [k for k, c in self.open.items() if len(c.rounds) == self.m]
        members = list(range(self.m))
        for key in done:
            col = self.open.pop(key)
            rounds = [col.rounds[i] for i in members]
            weights = [r.weight for r in rounds]
            ready, sent, phase_bytes = col.ready, 0.0, []
            while rounds[0].payload is not None:
                avg, nbytes = _mean([r.payload for r in rounds], weights, self.codec)  # type: ignore[misc]
                phase_bytes.append(nbytes)
                ready = self.net.transfer(members, nbytes, ready)
                sent += ring_factor(self.m) * nbytes
                for r in rounds:
                    r.receive([a.clone() for a in avg], total_weight=sum(weights), members=self.m)
            for r in rounds:
                self.arrival[r] = ready
            self.acct.trace.append((rounds[0].send_step, rounds[0].due, self.late_ok, phase_bytes))
            self.acct.bytes_sent_per_peer += sent
            self.acct.peak_bytes_per_sync = max(self.acct.peak_bytes_per_sync, sent)
            self.acct.syncs += 1
        return bool(done)


class VirtualCollective:
    """Peer ``i``'s view of a :class:`VirtualSwarm` (a :class:`~p2ptrain.driver.Collective`)."""

    def __init__(self, swarm: VirtualSwarm, i: int) -> None:
        self.swarm, self.i = swarm, i

    def launch(self, rnd: Round, request: RoundRequest) -> None:
        rnd.prepare()  # one thread here: a deferred begin runs at the send, as it did on the compute thread
        self.swarm.events += 1
        col = self.swarm.open.setdefault(request.key, _Open())
        col.rounds[self.i] = rnd
        col.ready = max(col.ready, self.swarm.clock[self.i])

    def arrived(self, rnd: Round) -> bool:
        t = self.swarm.arrival.get(rnd)
        return t is not None and t <= self.swarm.clock[self.i]

    def wait(self, rounds: Sequence[Round]) -> bool:
        sw = self.swarm
        if not all(r in sw.arrival for r in rounds):
            return False  # the other peers have not sent it yet
        sw.events += 1
        t = max(sw.arrival[r] for r in rounds)
        sw.stall[self.i] += max(0.0, t - sw.clock[self.i])
        sw.clock[self.i] = max(sw.clock[self.i], t)
        return True

    def negotiate(self, request: SlotRequest, leader: SlotLeader) -> _SlotPending:
        self.swarm.events += 1
        slot = self.swarm.slots.setdefault(request.key, _Slot())
        slot.requests[self.i] = request
        slot.leaders[self.i] = leader
        if len(slot.requests) == self.swarm.m and slot.outcome is None:
            first = min(slot.requests)
            views = [slot.requests[j] for j in sorted(slot.requests)]
            fragment, schedule = slot.leaders[first].decide(views)
            slot.outcome = SlotOutcome(fragment, schedule, None, f"peer{first}", self.swarm.m)
            self.swarm.slots.pop(request.key)
        return _SlotPending(slot)

    def settle(self, pending: Any) -> bool:
        return bool(pending.done())

    def expected_members(self) -> int:
        return self.swarm.m

    def proposed_sends(self, H: int, P: int, numels: Sequence[int]) -> int | None:
        sw = self.swarm
        frag_bytes = max(sw.codec.encoded_size(n) for n in numels) * ring_factor(sw.m)
        return sends_per_window(H=H, P=P, step_time=sw.step_time, fragment_bytes=frag_bytes,
                                bandwidth=min(sw.net.bandwidth) / 8.0, latency=sw.net.latency(range(sw.m)))


def _mean(payloads: Sequence[Sequence[torch.Tensor]], weights: Sequence[float], codec: Codec
          ) -> tuple[list[torch.Tensor], int]:
    """The peers' weighted mean as a butterfly all-reduce delivers it (shapes of the first peer's tensors),
    and the encoded size of one peer's vector in bytes (what a ring moves ``2(M−1)/M`` times)."""
    flats = [torch.cat([t.reshape(-1).float().cpu() for t in ts]) if ts else torch.zeros(0) for ts in payloads]
    out = butterfly_mean(flats, weights, codec)
    pieces, offset = [], 0
    for t in payloads[0]:
        pieces.append(out[offset : offset + t.numel()].view(t.shape).to(t.device))
        offset += t.numel()
    return pieces, codec.encoded_size(out.numel())
