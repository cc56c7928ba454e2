"""A graceful leave hands its unsent progress to a peer that stays (the math: :mod:`p2ptrain.algo.bequest`).

The leaver, after its flush and drain, serves its *will* (per fragment with unsent tokens: its displacement from θ
and those tokens) as the state ``bequest`` and asks a live peer to take it, its own region's first (the bytes stay
inside the region): the heir downloads it (chunked and hashed as any state download), checks it against its own
progress, and takes it into its next round of each fragment. Once one heir took it, the leaver's local model is
put back on θ with those tokens counted as sent, so its leave checkpoint does not hold that progress a second
time. An heir that was asked and did not answer may hold it: no other is asked then, and the leaver does not keep
it either (taken twice, it would be counted twice). No heir (none live, every one refused or unreachable): the
progress stays in the leave checkpoint, as before.

An heir refuses while it is leaving itself, before its outer loop runs, while behind its source's rounds, or when
a fragment's bequest breaks the bounds of :func:`p2ptrain.algo.bequest.problem` (it takes all or nothing). What it
holds until its next round of a fragment is saved with its checkpoints.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import torch

from ..algo.bequest import Bequest, displacement, problem
from ..algo.fragments import Fragment
from ..algo.outer_loop import OuterLoop
from ..checkpoint import CheckpointError, state_from_bytes, state_to_bytes
from ..driver import OuterDriver
from ..net.transport import PeerInfo, RoundFailed, Unreachable
from .config import PeerConfig
from .link import SwarmLink
from .replica import ReplicaState


class Peer(Protocol):
    """What a bequest needs of a swarm peer of an outer-loop method (:class:`p2ptrain.peer.outer.Peer`)."""

    cfg: PeerConfig
    method: Any  # its method's config: ``H``, ``name``
    trainer: Any  # p2ptrain.trainer.Trainer: snapshot, apply_outer, tokens_seen, step_count
    driver: OuterDriver | None
    outer: OuterLoop
    replica: ReplicaState
    frags: list[Fragment]
    lock: threading.Lock
    link: SwarmLink
    region: str
    estate: bytes | None  # its will while it leaves, served as the state NAME

    @property
    def stopping(self) -> bool: ...

__all__ = ["NAME", "Peer", "accept", "bequeath", "from_bytes", "heirs", "serve", "to_bytes"]

log = logging.getLogger(__name__)

NAME = "bequest"  # the state a leaver serves its will as
TRIES = 3  # heirs asked at most
PENDING = 4  # bequests an heir holds at most per fragment before its next round of it
CAP = 8.0  # an heir takes at most this many times the tokens it trains in H steps (or holds unsent): a
#: leaver whose rounds failed holds several windows of H steps (2240 tokens for 512 a window in the test of it)


def to_bytes(will: Sequence[Bequest]) -> bytes:
    return state_to_bytes({"bequests": [{"fragment": b.fragment, "tokens": b.tokens, "d": b.displacement}
                                        for b in will]}, finite=True)


def from_bytes(data: bytes, source: str) -> list[Bequest]:
    """The bequests in ``data`` (ValueError when malformed)."""
    try:
        state = state_from_bytes(data, "bequest")
        return [Bequest(int(b["fragment"]), [torch.as_tensor(t) for t in b["d"]], int(b["tokens"]), source)
                for b in state["bequests"]]
    except (CheckpointError, KeyError, TypeError, ValueError, AttributeError) as e:  # (a leaver's bytes)
        raise ValueError(f"malformed bequest: {type(e).__name__}: {e}") from None


def heirs(others: Sequence[PeerInfo], region: str, method: str) -> list[str]:
    """Who to ask, in order: live peers of the same method, this region's first, the most recently heard first."""
    same = [p for p in others if not method or not p.method or p.method == method]
    return [p.peer_id for p in sorted(same, key=lambda p: (p.region != region, p.last_seen))]


def accept(peer: Peer, sender: str, data: bytes) -> str | None:
    """The heir's side (a worker thread): None when it took the bequest, or why not."""
    d = peer.driver
    if d is None or peer.stopping or peer.trainer.step_count >= peer.cfg.steps or not peer.outer.initialized:
        return "leaving, or not training"
    if peer.replica.behind:
        return "behind its source's rounds"
    try:
        will = from_bytes(data, sender)
    except ValueError as e:
        return str(e)
    if not will or len({b.fragment for b in will}) != len(will):
        return "no fragments, or one twice"
    now = peer.trainer.tokens_seen
    per_h = now / max(1, peer.trainer.step_count) * peer.method.H
    for b in will:
        if not 0 <= b.fragment < len(peer.frags):
            return f"no fragment {b.fragment}"
        names = peer.frags[b.fragment].names
        with peer.lock:
            theta = list(peer.outer.theta(b.fragment))
            own = displacement(peer.trainer.snapshot(names), theta)
            held = len(d.bequests.get(b.fragment, []))
        own_tokens = now - d.tokens_at_send[b.fragment]
        if held >= PENDING:
            return f"fragment {b.fragment}: {held} bequests held already"
        ref = max(own_tokens, per_h)  # (its displacement holds its rounds in flight too: at least H steps' work)
        why = problem(b, [t.shape for t in theta], own, ref, CAP * ref)
        if why is not None:
            return f"fragment {b.fragment}: {why}"
    for b in will:
        d.inherit(b)
    log.info("event=inherited from=%s fragments=%s tokens=%d", sender[-8:], ",".join(str(b.fragment) for b in will),
             sum(b.tokens for b in will))
    return None


def bequeath(peer: Peer) -> None:
    """The leaver's side, after its drain: hand the will to the first heir that takes it (each ask bounded)."""
    d, link = peer.driver, peer.link
    if d is None or link.transport is None:
        return
    will = d.will()
    if not will:
        log.info("event=bequest_none unsent=%s in_flight=%s", ",".join(map(str, d.unsent())) or "none",
                 ",".join(r.key for r in d.in_flight if r.live) or "none")
        return
    tokens = sum(b.tokens for b in will)
    peer.estate = to_bytes(will)
    t0, tried = time.monotonic(), []
    try:
        candidates = heirs(link.others(), peer.region, peer.method.name)
    except (TimeoutError, RoundFailed, RuntimeError) as e:
        candidates = []
        log.info("event=bequest_unsent reason=no view of the swarm (%s)", e)
    for heir in candidates[:TRIES]:
        try:
            why = link.bequeath(heir, NAME)
        except Unreachable as e:  # (never asked: the next heir may take it)
            why = f"{type(e).__name__}: {e}"
        except (TimeoutError, RoundFailed, RuntimeError) as e:
            # Asked, and no answer: it may have taken it. Given to nobody else and not kept here either (the
            # leave checkpoint would bring it back into θ a second time): a leaver's progress counted twice is a
            # contribution the average holds twice; lost, it is work not done.
            _settled(peer, will)
            log.info("event=bequest_uncertain heir=%s tokens=%d reason=%s: %s", heir[-8:], tokens,
                     type(e).__name__, e)
            peer.estate = None
            return
        if why is None:
            _settled(peer, will)
            log.info("event=bequeathed heir=%s fragments=%s tokens=%d seconds=%.1f", heir[-8:],
                     ",".join(str(b.fragment) for b in will), tokens, time.monotonic() - t0)
            peer.estate = None
            return
        tried.append(f"{heir[-8:]}: {why}")
    peer.estate = None
    log.info("event=bequest_unsent tokens=%d reason=%s", tokens, "; ".join(tried) or "no other live peer")


def _settled(peer: Peer, will: Sequence[Bequest]) -> None:
    """An heir holds the will: the local model back on θ on those fragments, their tokens counted as sent."""
    d = peer.driver
    assert d is not None
    now = peer.trainer.tokens_seen
    with peer.lock:
        for b in will:
            peer.trainer.apply_outer(peer.frags[b.fragment].names, list(peer.outer.theta(b.fragment)))
            d.tokens_at_send[b.fragment] = now


def serve(peer: Peer) -> Callable[[str, bytes], Awaitable[str | None]]:
    """The heir's callback for the transport (on the loop: the checks run in a worker thread)."""

    async def take(sender: str, data: bytes) -> str | None:
        return await asyncio.to_thread(accept, peer, sender, data)

    return take
