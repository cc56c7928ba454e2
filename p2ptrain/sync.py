"""The seam between the compute thread and the network, and the rounds in flight.

:class:`NetLoop` runs one (uv)loop in a background thread; it owns every network
object. The compute thread reaches it only through :meth:`NetLoop.submit` (fire
and keep the future) and :meth:`NetLoop.call` (wait, with a timeout). A blocking
``call`` made *from* the loop thread raises instead of deadlocking.

:class:`RoundRunner` drives fragment rounds on that loop: form the group, run the
compressor's phases through the transport, hand the average to the round
(ARRIVED) or abort it (ABORTED). Every round task is owned by one
``asyncio.TaskGroup``; closing the runner cancels and awaits them all.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from .aio import new_event_loop
from .algo.methods import Round
from .collective.codecs import Codec
from .net.bandwidth import ThroughputEMA
from .net.groups import versioned
from .net.hierarchy import allreduce, decline_round, plan_for
from .net.transport import Decide, Group, JoinRequest, ReduceResult, RoundFailed, StateMismatch, Transport
from .phase_timeout import PhaseTimeout

__all__ = ["NetLoop", "RoundRunner", "RoundStats", "fingerprint", "theta_digest"]

log = logging.getLogger(__name__)
T = TypeVar("T")


async def _prepare(rnd: Round) -> list[torch.Tensor] | Exception | None:
    """``rnd``'s first payload, begun in a worker thread (:meth:`~p2ptrain.algo.rounds.Round.prepare`); its error
    returned, not raised (a task of the runner's TaskGroup that raised would cancel every other round)."""
    try:
        return await asyncio.to_thread(rnd.prepare) if rnd.pending is not None else rnd.prepare()
    except Exception as e:
        return e


class NetLoop:
    """An event loop in a daemon thread (uvloop when installed). ``closed`` once :meth:`close` ran (a context
    manager: leaving the ``with`` block closes it); a closed loop refuses new work."""

    def __init__(self, name: str = "p2ptrain-net") -> None:
        self.closed = False
        self.loop: asyncio.AbstractEventLoop = new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def __enter__(self) -> NetLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; returns a thread-safe future (RuntimeError once closed)."""
        if self.closed:
            coro.close()
            raise RuntimeError("the network loop is closed")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        """Run ``coro`` on the loop and wait for it (compute thread only). ``timeout=None`` only for a
        coroutine that bounds every one of its own waits (e.g. a chunked download)."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("NetLoop.call() from the loop thread would deadlock; await the coroutine instead")
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"network call did not finish within {timeout} s") from None

    def close(self, timeout: float = 10.0) -> None:
        """Refuse new work, cancel what is left on the loop (awaiting the cancellations, again until nothing
        is left: a coroutine submitted just before the refusal), stop it and join the thread (idempotent).
        Nothing submitted is left unawaited."""
        if self.closed or not self.loop.is_running():
            self.closed = True
            return
        self.closed = True  # from now on submit() closes the coroutine it is given and raises

        async def _cancel_all() -> None:
            for _ in range(10):
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                if not tasks:
                    return
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

        if threading.current_thread() is self._thread:
            raise RuntimeError("NetLoop.close() from the loop thread would deadlock")
        try:
            asyncio.run_coroutine_threadsafe(_cancel_all(), self.loop).result(timeout)
        except (concurrent.futures.TimeoutError, RuntimeError):
            log.warning("event=netloop_close status=timeout")
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()


@torch.no_grad()
def fingerprint(tensors: list[torch.Tensor], chunks: int = 16) -> list[float]:
    """Chunk sums (float64) of a fragment's θ: equal on every peer that holds the same θ, cheap to send."""
    flat = torch.cat([t.reshape(-1) for t in tensors]).double().cpu()
    return [float(c.sum()) for c in flat.chunk(chunks)]


def theta_digest(tensors: list[torch.Tensor]) -> str:
    """sha256 of a fragment's θ bytes: equal only for bitwise-equal copies."""
    import hashlib

    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:32]


@dataclass
class RoundStats:
    """Totals the runner keeps (read by metrics and the status line)."""

    complete: int = 0
    partial: int = 0
    failed: int = 0
    divergent: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: list[float] = field(default_factory=list)  # each completed round's, from its start to its end
    group_seconds: list[float] = field(default_factory=list)  # of it, forming the group (waiting for the others)
    allreduce_seconds: list[float] = field(default_factory=list)  # of it, the all-reduces of its phases
    in_flight: int = 0
    bandwidth: float = 0.0  # bytes/s, EMA over transfers
    shared: int = 0  # rounds whose average held another peer's contribution too
    last_shared: float | None = None  # time.monotonic() of the last such round (None: never)


class RoundRunner:
    """Runs rounds on the transport; create and use it on the loop thread via :class:`NetLoop`.

    A phase's all-reduce may take the method's ``round_timeout``, stretched to what the link needs: a fixed
    timeout below a slow link's transfer time aborts every round half-way and sends it again, and the wire
    then carries several times the payload (:class:`~p2ptrain.phase_timeout.PhaseTimeout`).
    """

    def __init__(self, transport: Transport, codec: Codec, *, join_timeout: float, round_timeout: float,
                 ema: float = 0.3, on_result: Callable[[Round, ReduceResult | None], None] | None = None,
                 hierarchical: bool = True, max_group: int | None = None) -> None:
        self.transport, self.codec = transport, codec
        # Groups whose members announce several regions reduce region by region (net/hierarchy.py); not for
        # error-feedback codecs, whose buffers assume the flat butterfly's parts (algo/feedback.py).
        self.hierarchical = hierarchical and not codec.error_feedback
        self.max_group = max_group  # the largest cell of a round (net/hierarchy.py); None: a region is one cell
        self.join_timeout, self.round_timeout, self.ema = join_timeout, round_timeout, ema
        self.stats = RoundStats()
        self.needs_resync = threading.Event()  # a group said our round state differs from the swarm's
        self._meter = ThroughputEMA(alpha=ema, min_bytes=0)
        self.timeouts = PhaseTimeout(round_timeout, codec, self._link_rate)  # each phase's (phase_timeout.py)
        self.on_result = on_result
        self._group: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopped: asyncio.Event | None = None
        self._ready = threading.Event()

    async def serve(self) -> None:
        """Own the round tasks until :meth:`stop` (runs as a task on the loop)."""
        self._stopped = asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            self._group = tg
            self._ready.set()
            await self._stopped.wait()
            self._group = None
            for t in list(self._tasks):  # cancel rounds still in flight; the TaskGroup awaits them
                t.cancel()

    def wait_ready(self, timeout: float) -> None:
        if not self._ready.wait(timeout):
            raise TimeoutError("round runner did not start")

    async def stop(self) -> None:
        if self._stopped is not None:
            self._stopped.set()

    async def abstain(self, request: JoinRequest) -> None:
        """Tell a round's leader, in the background, that this peer sits the round out."""
        if self._group is None:
            return

        async def _go() -> None:
            try:
                await self.transport.form_group(request, None, timeout=self.join_timeout)
            except Exception as e:  # an abstention that fails only costs the leader its window
                log.debug("event=abstain_failed key=%s reason=%s", request.key, e)

        task = self._group.create_task(_go(), name=f"abstain-{request.key}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def negotiate(self, request: JoinRequest, decide: Decide | None) -> Group:
        """Form a group without a round yet (CoCoDC: the leader picks the fragment)."""
        return await self.transport.form_group(self._with_terms(request), decide, timeout=self.join_timeout)

    @property
    def timeout_scale(self) -> float:
        """The last phase's timeout over the method's (the peer's waits scale with it)."""
        return self.timeouts.scale

    def _with_terms(self, request: JoinRequest) -> JoinRequest:
        budget, rate = self.timeouts.terms()
        return dataclasses.replace(request, budget=budget, rate=rate)

    async def launch(self, rnd: Round, group: Group | JoinRequest, *, fingerprint: list[float] | None = None,
                     fingerprint_of: list[torch.Tensor] | None = None, done: threading.Event | None = None) -> None:
        """Start ``rnd`` in the background with a formed group, or a request to form one (the task belongs to
        the runner's TaskGroup). The members compare ``fingerprint``, or one taken here (in a worker thread,
        off the compute thread) of ``fingerprint_of`` (θ at send time: never written in place). ``done`` is set
        once the round is ARRIVED or ABORTED."""
        if self._group is None:
            rnd.abort()
            if done is not None:
                done.set()
            return
        self.stats.in_flight += 1
        task = self._group.create_task(self._drive(rnd, group, fingerprint, fingerprint_of, done),
                                       name=f"round-{rnd.key}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drive(self, rnd: Round, group_or_request: Group | JoinRequest, print_: list[float] | None,
                     print_of: list[torch.Tensor] | None, done: threading.Event | None) -> None:
        last: ReduceResult | None = None
        t0 = time.monotonic()
        try:
            # a deferred first payload (error feedback's codec round trip) is computed while the group forms
            # (a runner closing meanwhile has no TaskGroup left: the payload is then computed in turn)
            tasks = self._group
            prepared = tasks.create_task(_prepare(rnd), name=f"prepare-{rnd.key}") if tasks is not None else None
            if print_ is None and print_of is not None:
                print_ = versioned(rnd.based_on, await asyncio.to_thread(fingerprint, print_of))
            if isinstance(group_or_request, Group):
                group = group_or_request
            else:
                group = await self.transport.form_group(self._with_terms(group_or_request), None,
                                                        timeout=self.join_timeout)
            formed = time.monotonic()
            rnd.began = True  # (failed from here, its Δ may be in others' averages: p2ptrain/algo/unseen.py)
            reducing = 0.0
            phase, partial = 0, False
            payload = await (prepared if prepared is not None else _prepare(rnd))
            if isinstance(payload, Exception):
                raise payload
            plan = plan_for(group, self.transport.peer_id, self.max_group) if self.hierarchical else None
            while payload is not None:
                n0 = time.monotonic()
                # (hierarchical: a carrier's shards cross a link shared by fewer members; sized by the smallest
                # cell, so that every member of every cell has the same deadlines)
                timeout = self.timeouts.timeout_for(payload, len(group.members) if plan is None else plan.smallest, group)
                fp = print_ if phase == 0 else None
                try:
                    res = await allreduce(self.transport, group, plan, phase, payload, rnd.weight, self.codec,
                                          timeout=timeout, fingerprint=fp)
                except (RoundFailed, TimeoutError):
                    self.timeouts.took(time.monotonic() - n0, timeout, late=True)
                    raise
                took = time.monotonic() - n0
                self.timeouts.took(took, timeout, late=res.partial)
                self._account(res, took)
                reducing += took
                partial |= res.partial
                rnd.divergent = rnd.divergent or res.divergent
                if res.agreed is not None:
                    rnd.agreed = res.agreed
                rnd.contributors = res.contributors
                rnd.counted = self.transport.peer_id in res.contributors
                rnd.missing = res.missing  # (a compressor of one phase: where our Δ is in no average)
                payload = await asyncio.to_thread(rnd.receive, res.tensors, total_weight=res.total_weight,
                                                  members=len(res.contributors))
                phase += 1
                last = res
            if partial:
                self.stats.partial += 1
            else:
                self.stats.complete += 1
            if last is not None and len(last.contributors) > 1:
                self.stats.shared += 1
                self.stats.last_shared = time.monotonic()
            if rnd.divergent:
                self.stats.divergent += 1
            self.stats.seconds.append(time.monotonic() - t0)
            self.stats.group_seconds.append(formed - t0)
            self.stats.allreduce_seconds.append(reducing)
            log.debug("event=round_done key=%s members=%d partial=%s hierarchical=%s", rnd.key, len(group.members),
                      partial, plan is not None)
        except asyncio.CancelledError:
            rnd.abort()  # (a begin still running in its thread is undone when it ends: Round.prepare)
            raise
        except StateMismatch as e:
            self.stats.failed += 1
            rnd.abort()
            self.needs_resync.set()
            log.warning("event=round_failed key=%s reason=%s", rnd.key, e)
        except Exception as e:  # a round's failure must never take the TaskGroup (and other rounds) down
            self.stats.failed += 1
            rnd.abort()
            level = logging.INFO if isinstance(e, (RoundFailed, TimeoutError, ConnectionError, OSError)) else logging.WARNING
            log.log(level, "event=round_failed key=%s reason=%s: %s", rnd.key, type(e).__name__, e)
        finally:
            self.stats.in_flight -= 1
            if self.hierarchical:  # whatever we did not offer of it by now, we never will: say so to who asks
                decline_round(self.transport, group_or_request.key)
            try:
                if self.on_result is not None:
                    self.on_result(rnd, last)
            finally:
                if done is not None:
                    done.set()

    def _link_rate(self) -> float:
        """The slowest link's measured rate (bytes/s; the transport's per-link meters, else the rounds' own
        meter), 0 before any is measured."""
        links = getattr(self.transport, "links", None)
        rate = links.slowest() if links is not None else 0.0
        return rate if rate > 0 else max(0.0, self.stats.bandwidth)

    def _account(self, res: ReduceResult, seconds: float) -> None:
        self.stats.bytes_sent += res.bytes_sent
        self.stats.bytes_received += res.bytes_received
        links = getattr(self.transport, "links", None)
        if links is not None and links.slowest() > 0:
            self.stats.bandwidth = links.slowest()  # per-link EMAs: a round runs at its slowest link
        else:
            self._meter.update(res.bytes_received, seconds)
            self.stats.bandwidth = self._meter.rate
