"""A peer's link to its swarm: the transport, the round runner, the services on the network loop (heartbeat,
state service), the shared pacing, and state downloads.

The compute thread calls it; every call crosses the thread seam through :class:`~p2ptrain.sync.NetLoop` with a
bounded wait. It knows nothing of the model: what to announce, serve and do with a finished round are the
peer's callbacks.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ..checkpoint import state_from_bytes
from ..collective.codecs import Codec
from ..net.region import DEFAULT_NEAR, pick_region
from ..net.transport import Inherit, PeerInfo, ReduceResult, RoundFailed, StateProvider, Transport
from ..sync import NetLoop, RoundRunner
from .census import census_every, run_census
from .config import PeerConfig

__all__ = ["SwarmLink"]

log = logging.getLogger(__name__)
#: Seconds a peer that leaves gracefully may keep serving the shards its cell still wants (Transport.serve_wanted).
LINGER = 120.0


class SwarmLink:
    """The network side of one peer (see the module docstring). ``step_seconds`` is the swarm's pacing once
    agreed (:meth:`agree_pacing`); every announcement carries it (``extra["pacing"]``: one DHT store a heartbeat,
    where a record of its own took a second one: ~30% of a peer's DHT bytes, measured on loopback)."""

    def __init__(self, cfg: PeerConfig, net: NetLoop, codec: Codec, round_timeout: float,
                 factory: Callable[[], Awaitable[Transport]]) -> None:
        self.cfg, self.net, self.codec, self.round_timeout, self.factory = cfg, net, codec, round_timeout, factory
        self.transport: Transport | None = None
        self.runner: RoundRunner | None = None
        self.step_seconds = cfg.step_seconds
        self.pacing_since = 0.0  # when the swarm's pacing was first published (wall clock; the first wins)
        self._service: Any = None
        self._stopping: asyncio.Event | None = None
        self._info: Callable[[], PeerInfo] | None = None

    def connect(self, *, provide: StateProvider, on_round: Callable[[Any, ReduceResult | None], None],
                info: Callable[[], PeerInfo], on_live: Callable[[int], None]) -> None:
        """Make the transport (retrying is its job), serve state with ``provide``, start the round runner
        (``on_round`` after each round) and the heartbeat (announces ``info()``, reports the live count)."""
        self.transport = self.net.call(self.factory(), timeout=self.cfg.join_timeout + 60)
        self.transport.serve_state(provide)
        self.runner = RoundRunner(self.transport, self.codec, join_timeout=self.cfg.join_timeout,
                                  round_timeout=self.round_timeout, on_result=on_round,
                                  hierarchical=not self.cfg.flat_rounds, max_group=self.cfg.max_group)
        self._info = info
        self._service = self.net.submit(self._serve(info, on_live))
        self.runner.wait_ready(10)

    async def _serve(self, info: Callable[[], PeerInfo], on_live: Callable[[int], None]) -> None:
        assert self.runner is not None
        self._stopping = asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.runner.serve())
            hb = tg.create_task(self._heartbeat(info, on_live))
            every = census_every()
            census = tg.create_task(run_census(every)) if every > 0 else None
            await self._stopping.wait()
            hb.cancel()
            if census is not None:
                census.cancel()
            await self.runner.stop()

    async def _heartbeat(self, info: Callable[[], PeerInfo], on_live: Callable[[int], None]) -> None:
        """Announce this peer every ``heartbeat`` seconds, on a fixed cadence whatever the DHT's latency: the
        announcement is what keeps it in the others' view of who is live, and it expires ``ttl`` seconds after
        it was stored (the pacing rides on it). Reading who is live runs beside it (bounded as the
        announcement is) and never holds the next one back: one after the other, with a pause after them, a
        slow DHT (a loaded machine) spread announcements up to 3 × 2 × heartbeat + heartbeat apart, longer than
        the ttl, and a live peer fell out of the others' views (bench/churn.py: its joins then came after its
        rounds' groups had closed)."""
        assert self.transport is not None
        transport, limit = self.transport, self.cfg.heartbeat * 2
        loop = asyncio.get_running_loop()

        async def bounded(what: str, aw: Awaitable[Any]) -> Any:
            try:
                return await asyncio.wait_for(aw, limit)
            except (TimeoutError, OSError, RoundFailed) as e:
                log.info("event=heartbeat_failed what=%s reason=%s", what, str(e) or type(e).__name__)
                return None

        async def look() -> None:  # (bounded() swallows what the DHT raises: the TaskGroup never sees it fail)
            live = await bounded("peers", transport.peers())
            if live is not None:
                on_live(len(live))

        async with asyncio.TaskGroup() as tg:  # owns the side look; cancelled with the heartbeat
            side: asyncio.Task[None] | None = None
            while True:
                t0 = loop.time()
                await bounded("announce", transport.announce(self.paced(info())))
                if side is None or side.done():
                    side = tg.create_task(look())
                await asyncio.sleep(max(0.0, self.cfg.heartbeat - (loop.time() - t0)))

    def paced(self, info: PeerInfo) -> PeerInfo:
        """``info`` with the pacing this peer runs at and since when, once it has one."""
        if self.step_seconds is not None:
            info.extra = {**info.extra, "pacing": [self.step_seconds, self.pacing_since]}
        return info

    def announce_now(self, info: PeerInfo) -> None:
        assert self.transport is not None
        try:
            self.net.call(self.transport.announce(self.paced(info)), timeout=self.cfg.join_timeout)
        except (TimeoutError, OSError, RoundFailed) as e:
            log.warning("event=announce_failed reason=%s", e)

    # ------------------------------------------------------------------ pacing
    def swarm_pacing(self) -> tuple[float, float] | None:
        """The pacing this namespace runs at and since when: of the values the live peers announce (``pacing``:
        seconds and since when), the first published (earliest ``since``, then smallest peer id), or None."""
        assert self.transport is not None
        found = []
        for p in self.net.call(self.transport.peers(), timeout=self.cfg.join_timeout):
            pacing = p.extra.get("pacing")
            try:
                step, since = float(pacing[0]), float(pacing[1])  # type: ignore[index]
            except (TypeError, ValueError, IndexError, KeyError):
                continue  # none announced yet (or not a pair of numbers)
            if math.isfinite(step) and step > 0 and math.isfinite(since):
                found.append((since, p.peer_id, step))
        found.sort()
        return (found[0][2], found[0][0]) if found else None

    def published_step_seconds(self) -> float | None:
        """The pacing this namespace published (see :meth:`swarm_pacing`), or None."""
        found = self.swarm_pacing()
        return found[0] if found else None

    def _publish_pacing(self) -> None:
        """Announce now (the pacing rides on the announcement), not at the next heartbeat."""
        assert self._info is not None
        self.announce_now(self._info())

    def agree_pacing(self, *, fixed: bool, measure: Callable[[], float], settle: float | None = None) -> float:
        """All peers must share ``step_seconds``: the first published value (see :meth:`swarm_pacing`), else
        ours (``fixed``: ours as given, unasked), else ``measure()``d; then published. A peer that published
        its own value looks again ``settle`` seconds later (default: one heartbeat) and takes the first
        published one, so that peers started at the same moment, which all found nothing and all published,
        end on one value: the first publisher's."""
        assert self.transport is not None
        found = None if fixed and self.step_seconds is not None else self.swarm_pacing()
        if found is not None:
            if self.step_seconds is not None and abs(found[0] - self.step_seconds) > 1e-9:
                log.warning("event=pacing_override mine=%s swarm=%s", self.step_seconds, found[0])
            self.step_seconds, self.pacing_since = found
            self._publish_pacing()
            return self.step_seconds
        if self.step_seconds is None:
            self.step_seconds = measure()
        self.pacing_since = time.time()
        self._publish_pacing()
        if not fixed:
            time.sleep(self.cfg.heartbeat if settle is None else settle)
            first = self.swarm_pacing()
            if first is not None and (first[0], first[1]) != (self.step_seconds, self.pacing_since):
                log.warning("event=pacing_override mine=%s swarm=%s reason=a peer that started at the same "
                            "time published first", self.step_seconds, first[0])
                self.step_seconds, self.pacing_since = first
                self._publish_pacing()
        return self.step_seconds

    # ------------------------------------------------------------------ state from others
    def others(self) -> list[PeerInfo]:
        """The other live peers' announcements."""
        assert self.transport is not None
        me = self.transport.peer_id
        return [p for p in self.net.call(self.transport.peers(), self.cfg.join_timeout) if p.peer_id != me]

    def measure_region(self, near: float = DEFAULT_NEAR, *, most: int = 32) -> str:
        """The region this peer announces when it names none (see :mod:`p2ptrain.net.region`): RTTs to up to
        ``most`` live peers, measured together, each bounded: the fastest of 8 requests 50 ms apart, so that a
        busy moment of either host does not count (3 requests back to back: 15.9 ms between two hosts of one
        testbed region, a suite and simulator runs beside them, and the peer named a region of its own)."""
        assert self.transport is not None
        transport = self.transport
        others = self.others()[:most]

        async def measure() -> list[float | None]:
            return list(await asyncio.gather(*(transport.rtt(i.peer_id, tries=8, gap=0.05, timeout=5.0)
                                               for i in others)))

        rtts = self.net.call(measure(), 15.0) if others else []
        measured = {i.peer_id: r for i, r in zip(others, rtts, strict=True) if r is not None}
        if others and not measured:
            log.warning("event=region_unmeasured reason=no live peer answered (or the transport cannot tell): "
                        "no region, flat rounds")
            return ""
        region = pick_region(transport.peer_id, measured, {i.peer_id: i.region for i in others}, near)
        log.info("event=region_measured region=%s rtts_ms=%s", region,
                 ",".join(f"{p[-8:]}:{r * 1000:.1f}" for p, r in sorted(measured.items(), key=lambda x: x[1])))
        return region

    def sources(self) -> list[str]:
        """The other live peers, most advanced first (they hold the newest θ), then by id so joiners agree."""
        return [i.peer_id for i in sorted(self.others(), key=lambda i: (-i.step, i.peer_id))]

    def download(self, sources: list[str], name: str) -> tuple[str, bytes]:
        """State ``name`` from the first of ``sources`` that delivers it whole (chunked, hash-verified; the next
        source is asked too after ``cfg.hedge`` s without a first chunk); RoundFailed when none does. Progress is
        logged every 2 s."""
        assert self.transport is not None
        last = [0.0]

        def progress(done: int, total: int) -> None:
            if time.monotonic() - last[0] > 2.0 or done == total:
                last[0] = time.monotonic()
                log.info("event=state_download bytes=%d total=%d", done, total)

        return self.net.call(self.transport.download_state(sources, name, timeout=self.cfg.join_timeout,
                                                           progress=progress, hedge=self.cfg.hedge), None)

    def take_state(self, name: str, take: Callable[[dict[str, Any], str], None]) -> str | None:
        """Download state ``name`` from the other live peers, most advanced first, and hand it to
        ``take(state, source)``; a verified download that ``take`` refuses (ValueError/KeyError) moves on to
        the next source. The source taken from, or None (nobody else, or nobody delivered)."""
        sources = self.sources()
        while sources:
            try:
                source, raw = self.download(sources, name)
                take(state_from_bytes(raw, f"state from {source}"), source)
            except (RoundFailed, TimeoutError) as e:
                log.warning("event=sync_failed reason=%s", e)
                return None
            except (ValueError, KeyError) as e:  # a verified download that does not fit: try the others
                log.warning("event=sync_rejected peer=%s reason=%s", source, e)
                sources = sources[sources.index(source) + 1:]
                continue
            log.info("event=synced_from peer=%s", source)
            return source
        return None

    def serve_bequests(self, accept: Inherit) -> None:
        """Take what leaving peers bequeath to this one with ``accept`` (Transport.serve_bequests)."""
        assert self.transport is not None
        self.transport.serve_bequests(accept)

    def bequeath(self, peer: str, name: str) -> str | None:
        """Ask ``peer`` to take our state ``name`` as its bequest: None when it did, or why not (RoundFailed,
        TimeoutError: unreachable or silent). Bounded by two state downloads' timeouts."""
        assert self.transport is not None
        limit = 2 * self.cfg.join_timeout + 10
        return self.net.call(self.transport.bequeath(peer, name, timeout=limit), limit + 5)

    def fetch(self, peer: str, name: str) -> bytes:
        """State ``name`` from ``peer`` (RoundFailed/TimeoutError when it has none or is gone)."""
        assert self.transport is not None
        return self.net.call(self.transport.fetch_state(peer, name, timeout=self.cfg.join_timeout),
                             self.cfg.join_timeout + 5)

    def close(self) -> None:
        """Leave the swarm (a departure record), stop the services and close the transport (idempotent)."""
        if self.transport is not None:
            try:
                self.net.call(self.transport.leave(), timeout=5)
            except (TimeoutError, OSError, RoundFailed, RuntimeError):
                pass
        if self._stopping is not None:
            try:
                self.net.loop.call_soon_threadsafe(self._stopping.set)
                self._service.result(timeout=15)
            except Exception as e:  # (RuntimeError: the loop's owner closed it first; the services went with it)
                log.warning("event=service_stop reason=%s", e)
            self._stopping = None
        if self.transport is not None:
            try:  # the shards we carried in our last round, until our cell fetched them (net/offers.py)
                waited = self.net.call(self.transport.serve_wanted(LINGER), timeout=LINGER + 5)
                if waited > 0.1:
                    log.info("event=left_serving seconds=%.1f", waited)
            except (TimeoutError, RuntimeError) as e:
                log.warning("event=left_serving reason=%s", e)
            try:
                self.net.call(self.transport.aclose(), timeout=15)
            except (TimeoutError, RuntimeError) as e:
                log.warning("event=transport_close reason=%s", e)
