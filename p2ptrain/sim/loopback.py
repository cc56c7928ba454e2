"""The real butterfly all-reduce between k members in one event loop, messages handed over in memory.

Each member runs the swarm's own :class:`~p2ptrain.net.allreduce.ButterflyRun` against its own
:class:`~p2ptrain.net.mailbox.Mailboxes`; a call to another member is delivered straight to that member's
handler (``part``, ``result``, ``getpart``), a streamed message's chunks passed through as they are
made. No libp2p, no framing: what is counted is the payload (encoded tensor bytes) each member puts in
its messages, the figure :class:`~p2ptrain.net.transport.ReduceResult.bytes_sent` reports. Used to check
the protocol model's byte counts (sim/protocol.py) against the code that runs in a real swarm; also
reports how many messages each member sent (the model's streams).

Also :func:`memory_swarm_bytes`: the same round through the in-memory transport (net/memory.py), which
computes its bytes from the butterfly formula instead of sending anything.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..collective.butterfly import MIN_CHUNK
from ..collective.codecs import get_codec
from ..faults import FaultPlan
from ..net.allreduce import ButterflyRun
from ..net.bandwidth import LinkMeter
from ..net.guard import Guard
from ..net.mailbox import Mailboxes
from ..net.memory import MemorySwarm
from ..net.streams import ChunkSource, Trailer
from ..net.transport import Group, PeerInfo, ReduceResult, RoundFailed

__all__ = ["LoopbackRound", "loopback_round", "memory_swarm_bytes"]


@dataclass
class LoopbackRound:
    """One loopback all-reduce: per member (group order) its result, the payload bytes its messages
    carried (counted at delivery), and how many messages it sent."""

    results: list[ReduceResult]  # (RoundFailed in place of a member whose run failed, when calls were cut)
    payload_sent: list[int]
    messages_sent: list[int]


def _vectors(k: int, numel: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(k)
    return [torch.randn(numel, generator=gen) for _ in range(k)]


async def loopback_round(k: int, numel: int, *, codec: str = "fp32", chunk: int = 1 << 18,
                         timeout: float = 30.0, cut: Callable[[str, str, str], bool] | None = None) -> LoopbackRound:
    """All-reduce ``k`` random fp32 vectors of ``numel`` values through the real butterfly, members
    ``peer00``…; RoundFailed if any member's run fails. Checks the result is the plain mean (fp32), unless
    ``cut(sender, receiver, kind)`` fails some calls (RoundFailed at the sender: a one-way link failure;
    the caller checks what the members ended with).
    ValueError for a ``chunk`` below the smallest a swarm allows (MIN_CHUNK)."""
    if chunk < MIN_CHUNK:
        raise ValueError(f"chunk must be at least {MIN_CHUNK} values, got {chunk}")
    members = tuple(f"peer{i:02d}" for i in range(k))
    group = Group("loopback", members, members[0], 0)
    guards = {m: Guard() for m in members}
    boxes = {m: Mailboxes(guards[m], max_numel=numel) for m in members}
    sent_bytes: Counter[str] = Counter()
    msgs: Counter[str] = Counter()

    def caller(me: str) -> Any:
        async def call(peer: str, kind: str, msg: dict[str, Any], *, timeout: float,
                       chunks: ChunkSource | None = None,
                       trailer: Trailer | None = None,
                       sent: Callable[[], None] | None = None) -> tuple[dict[str, Any], float]:
            handler = {"part": boxes[peer].accept_part, "result": boxes[peer].accept_result,
                       "getpart": boxes[peer].relay}.get(kind)
            if handler is None:
                raise RoundFailed(f"loopback: no handler for {kind!r}")
            if cut is not None and cut(me, peer, kind):
                raise RoundFailed(f"loopback: {kind} from {me} to {peer} cut")
            msg = dict(msg)
            msgs[me] += 1
            if isinstance(msg.get("data"), bytes):
                sent_bytes[me] += len(msg["data"])
            frames = None
            if chunks is not None:
                async def counted() -> AsyncGenerator[bytes, None]:
                    async for data in chunks():
                        sent_bytes[me] += len(data)
                        yield data

                frames = msg["_frames"] = counted()
                if msg.pop("trailer", None) and trailer is not None:
                    async def last() -> dict[str, Any]:
                        return trailer()

                    msg["_trailer"] = last
            try:
                reply = await asyncio.wait_for(handler(me, msg), timeout)
            finally:
                if frames is not None:
                    await frames.aclose()
            return reply, 0.0

        return call

    flats = _vectors(k, numel)
    c = get_codec(codec)

    async def one(i: int, m: str) -> ReduceResult:
        box = boxes[m].box(group.key, 0)
        run = ButterflyRun(group=group, phase=0, me=m, tensors=[flats[i]], weight=1.0, codec=c, timeout=timeout,
                           fingerprint=None, box=box, call=caller(m),
                           gone=lambda: boxes[m].unreachable(group.key, 0), guard=guards[m], links=LinkMeter(),
                           chunk=chunk, faults=FaultPlan())
        return await run.run()

    # (with calls cut, a member's run may fail: RoundFailed stands in its place)
    results = list(await asyncio.gather(*(one(i, m) for i, m in enumerate(members)), return_exceptions=cut is not None))
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, RoundFailed):
            raise r
    if codec == "fp32" and cut is None:
        mean = torch.stack(flats).mean(0)
        for r in results:
            if not torch.allclose(r.tensors[0], mean, atol=1e-5):
                raise RoundFailed("loopback: the result is not the mean")
    return LoopbackRound(results, [sent_bytes[m] for m in members], [msgs[m] for m in members])


async def memory_swarm_bytes(k: int, numel: int, *, codec: str = "fp32") -> list[int]:
    """``bytes_sent`` of each member after one all-reduce of ``numel`` values through net/memory.py."""
    swarm = MemorySwarm(join_window=0.1, ttl=60)
    ts = [swarm.transport(f"peer{i:02d}") for i in range(k)]
    for t in ts:
        await t.announce(PeerInfo(peer_id=t.peer_id))
    members = tuple(sorted(t.peer_id for t in ts))
    group = Group("memory", members, members[0], 0)
    flats = _vectors(k, numel)
    c = get_codec(codec)
    res = await asyncio.gather(*(t.allreduce(group, 0, [f], 1.0, c, timeout=30.0)
                                 for t, f in zip(ts, flats, strict=True)))
    return [r.bytes_sent for r in res]
