"""A replica's state for the rest of the swarm: versions of θ kept for others, the state service, catch-up,
repair, and the keep-progress rebase (written once, here).

The outer state is copy-on-write (:mod:`p2ptrain.algo.outer_loop`): θ^(p) and its momentum are replaced,
never written in place. So the versions other peers may ask for are kept as *references*: θ before a round
(``before:KEY``, for a divergent member's repair) and after it (``after:KEY``, for a joiner catching up on a
round that was in flight when it took the state), the last ``keep`` of each per fragment. Nothing is
serialised on the compute thread: the state service runs in the network loop's worker thread, takes the
references it needs under the lock (microseconds) and serialises them after releasing it.

Digests of θ after every applied round (the record of what this replica held, compared across peers by tests
and benchmarks) are computed by a worker thread this object owns.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..algo.fragments import Fragment
from ..algo.outer_loop import LocalParams, OuterLoop
from ..algo.rounds import Round
from ..algo.unseen import named_round, same_theta
from ..checkpoint import state_from_bytes, state_to_bytes
from ..net.groups import fingerprints_match, versioned
from ..net.transport import RoundFailed
from ..sync import fingerprint, theta_digest
from .overlap import while_training

__all__ = ["Download", "Fetch", "ReplicaState", "one_at_a_time", "rebase"]

log = logging.getLogger(__name__)

#: (peer id, state name) -> bytes; raises RoundFailed/TimeoutError when the peer has none or does not answer.
Fetch = Callable[[str, str], bytes]
#: (sources in order of preference, state name) -> (the source that delivered it, bytes); RoundFailed/TimeoutError
#: when none did (a peer's: several asked at once when the first are silent, :mod:`p2ptrain.net.hedged`).
Download = Callable[[list[str], str], tuple[str, bytes]]


def one_at_a_time(fetch: Fetch) -> Download:
    """A :data:`Download` that asks ``fetch``'s sources in turn (each one's whole timeout)."""
    def download(sources: list[str], name: str) -> tuple[str, bytes]:
        errors = []
        for peer in sources:
            try:
                return peer, fetch(peer, name)
            except (RoundFailed, TimeoutError) as e:
                errors.append(f"{peer[-8:]}: {e}")
        raise RoundFailed(f"state {name!r}: no source delivered it ({'; '.join(errors) or 'no sources'})")

    return download


@torch.no_grad()
def rebase(new: Sequence[torch.Tensor], local: Sequence[torch.Tensor],
           old: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Keep local progress across a change of θ: ``local ← θ_new + (local − θ_old)``."""
    return [n + (x - o) for n, x, o in zip(new, local, old, strict=True)]


def _applied_fields(rnd: Round) -> tuple[str, int, int, float, bool, float]:
    """What the ``applied`` line says of a round (key, fragment, members, tokens, divergent, own), taken when it
    is applied: the line is written later, and must not keep the round (its tensors) alive until then or after.
    ``own``: this peer's tokens in the average (0 when its Δ is in none: outvoted, its tokens go to the next round)."""
    tokens = rnd.weight / rnd.share if rnd.share > 0 else rnd.weight
    own = rnd.weight if rnd.counted and rnd.share > 0 else 0.0
    return rnd.key, rnd.fragment, len(rnd.contributors) or rnd.members, tokens, rnd.divergent, own


def _log_applied(fields: tuple[str, int, int, float, bool, float], digest: concurrent.futures.Future[str]) -> None:
    """One line per applied round, once θ's digest is computed: what benchmarks read to compare replicas across
    peers round by round (``tokens``: the round's total weight, the tokens of every contribution in it; ``own``:
    this peer's, so that a benchmark can follow each peer's trained tokens into θ)."""
    if digest.cancelled() or digest.exception() is not None:
        return
    key, fragment, members, tokens, divergent, own = fields
    log.info("event=applied key=%s fragment=%d members=%d tokens=%.0f divergent=%s digest=%s own=%.0f", key,
             fragment, members, tokens, divergent, digest.result()[:16], own)


class ReplicaState:
    """What one outer-loop peer keeps and serves of its replica (see the module docstring).

    Args:
        outer: the peer's outer loop; ``params`` its live model; ``frags`` its fragments.
        lock: the lock the compute thread holds while the outer state changes.
        in_flight: returns the rounds in flight now (read under the lock).
        keep: versions kept per fragment for ``before:``/``after:`` requests.
        keep_applied: also keep θ after each applied round (references; tests compare them).
    """

    def __init__(self, outer: OuterLoop, params: LocalParams, frags: Sequence[Fragment], lock: threading.Lock,
                 in_flight: Callable[[], Sequence[Round]], *, keep: int = 2, keep_applied: bool = False) -> None:
        self.outer, self.params, self.frags, self.lock, self._in_flight = outer, params, list(frags), lock, in_flight
        self.keep, self.keep_applied = keep, keep_applied
        # round key -> (fragment, θ, momentum, θ's version, the round that made that θ and its contributors) at its
        # send
        self.before: OrderedDict[str, tuple[int, list[torch.Tensor], list[torch.Tensor], int,
                                            tuple[str, tuple[str, ...]] | None]] = OrderedDict()
        # fragment -> (θ^(p) a round applied here made, the round's key, its contributors): what a θ served as
        # ``before:KEY`` says of the round last in it, while θ is still that object (copy-on-write)
        self.made: dict[int, tuple[list[torch.Tensor], str, tuple[str, ...]]] = {}
        self.after: OrderedDict[str, tuple[int, list[torch.Tensor], list[torch.Tensor], dict[str, Any]]] = OrderedDict()
        # θ^(p) after each applied round, by round key: its digest (and θ when keep_applied)
        self.applied_log: dict[str, tuple[concurrent.futures.Future[str], list[torch.Tensor]]] = {}
        self.history: list[tuple[str, tuple[str, ...], bool]] = []  # (key, contributors, repaired)
        self.served_digests: list[list[str]] = []  # digest of θ per fragment in every outer state served
        self.sent_at: dict[str, float] = {}  # round key -> unix time this peer sent it
        self.repairs = 0
        #: Fragments whose θ was taken without a round its source then had in flight (a joiner in its warm-up): the
        #: ``outer`` state is not served while any is left (it would not name those rounds as pending); a fragment
        #: leaves the set once caught up (:meth:`catch_up`) or once a round of it is applied here.
        self.behind: set[int] = set()
        self._digests = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="p2ptrain-digest")

    # ------------------------------------------------------------------ versions (compute thread, under the lock)
    def record_send(self, rnd: Round) -> None:
        self.sent_at.setdefault(rnd.key, time.time())
        made = self.made.get(rnd.fragment)
        last = (made[1], made[2]) if made is not None and same_theta(made[0], rnd.theta) else None
        self.before[rnd.key] = (rnd.fragment, rnd.theta, self.outer.momentum(rnd.fragment), rnd.based_on, last)
        self._prune_before(rnd.key)

    def record_apply(self, rnd: Round) -> None:
        f = rnd.fragment
        self.behind.discard(f)
        theta = self.outer.theta(f)
        self.after[rnd.key] = (f, theta, self.outer.momentum(f), self.outer.round_state(f))
        self.made[f] = (theta, rnd.key, tuple(rnd.contributors))
        self._prune(self.after)
        self._prune_before()
        digest = self._digests.submit(theta_digest, theta)
        # Not the round itself in the callback: a concurrent Future keeps its callbacks after running them and
        # applied_log keeps the Future for the whole run, so a Round held here (its snapshot, Δ, payload, average
        # and θ at send: several copies of the fragment) was never freed (about 1 MB a round with preset micro).
        fields = _applied_fields(rnd)
        digest.add_done_callback(lambda fut: _log_applied(fields, fut))
        self.applied_log[rnd.key] = (digest, list(theta) if self.keep_applied else [])
        self.history.append((rnd.key, tuple(c[-4:] for c in rnd.contributors), rnd.divergent))

    def _prune(self, versions: OrderedDict[str, Any]) -> None:
        """Keep the newest ``keep`` versions of each fragment."""
        seen: dict[int, int] = {}
        for key in reversed(list(versions)):
            f = versions[key][0]
            seen[f] = seen.get(f, 0) + 1
            if seen[f] > self.keep:
                del versions[key]

    def _prune_before(self, sending: str = "") -> None:
        """Keep θ before a round while the round is in flight or among the ``keep`` newest applied of its
        fragment: a divergent member asks for it when it applies, which can be long after the others did. Failed
        rounds must not push it out (a swarm without a quorum fails a round every step; a member 27 s late then
        found no ``before:KEY`` left and applied a θ it knew was divergent)."""
        live = {r.key for r in self._in_flight() if r.live} | {sending}
        for key in [k for k in self.before if k not in live and k not in self.after]:
            del self.before[key]

    def digests(self) -> dict[str, tuple[str, list[torch.Tensor]]]:
        """θ's digest after every applied round (waits for the ones still being computed)."""
        # A copy first (one C-level call: atomic for other Python threads): the compute thread adds rounds while a
        # monitor reads (a test saw "dictionary changed size during iteration").
        return {k: (fut.result(), thetas) for k, (fut, thetas) in dict(self.applied_log).items()}

    def theta_digests(self) -> list[str]:
        """Digest of θ^(p) per fragment now."""
        return [theta_digest(self.outer.theta(f.index)) for f in self.frags]

    def close(self) -> None:
        self._digests.shutdown(wait=True)

    # ------------------------------------------------------------------ the state service (network worker thread)
    def provide(self, name: str) -> bytes | None:
        """State other peers may ask for: ``outer`` (θ, momentum and counters of every fragment, and the
        rounds this θ does not include yet), ``before:KEY``, ``after:KEY``; None when unknown or not yet."""
        if name == "outer":
            with self.lock:  # references only: serialised below, after the compute thread may go on
                if not self.outer.initialized or self.behind:
                    return None  # still starting, or behind its source's rounds: nothing to give yet
                state = self.outer.shared_state()
                thetas = [self.outer.theta(f.index) for f in self.frags]
                # Rounds this θ does not include yet: the taker fetches θ after each ("after:KEY").
                state["pending"] = [[r.fragment, r.key] for r in list(self._in_flight()) if r.live]
                # The round last in each θ and whom it counted (a taker resumed with that round in flight learns
                # whether its Δ is in this θ: p2ptrain/algo/unseen.py)
                state["made"] = {str(f): [m[1], list(m[2])] for f, m in self.made.items()
                                 if same_theta(m[0], thetas[f])}
            self.served_digests.append([theta_digest(t) for t in thetas])
            return state_to_bytes(state)
        if name.startswith("before:"):
            with self.lock:
                kept = self.before.get(name[len("before:"):])
            if kept is None:
                return None
            # (the round last in that θ, and whom it counted: a member that saw that round fail learns from it
            # whether its Δ is in this θ, see p2ptrain/algo/unseen.py)
            made = {} if kept[4] is None else {"made": [kept[4][0], list(kept[4][1])]}
            return state_to_bytes({"theta": kept[1], "momentum": kept[2], "version": kept[3], **made})
        if name.startswith("after:"):
            key = name[len("after:"):]
            with self.lock:
                done = self.after.get(key)
                flying = any(r.key == key and r.live for r in list(self._in_flight()))
            if done is not None:
                return state_to_bytes({"theta": done[1], "momentum": done[2], "round": done[3]})
            if flying:
                return None  # not applied yet: ask again
            return state_to_bytes({"gone": True})  # failed or long gone: θ never included it
        return None

    # ------------------------------------------------------------------ taking others' state (compute thread)
    def take(self, state: dict[str, Any], keep_progress: bool,
             held: dict[int, list[torch.Tensor]] | None = None) -> None:
        """Take a downloaded ``outer`` state (ValueError/KEY error if it does not fit). ``keep_progress``:
        the local model keeps its progress since θ (rebased), and this peer's own per-fragment state (eager's
        Δ_i, error feedback) is kept where it still fits. ``held``: fragment -> the Δ of a round of ours that the
        state's θ already holds (UnseenRounds.counted_in): that much of the progress is not kept."""
        held = held or {}
        with self.lock:
            before = {f.index: self.outer.theta(f.index) for f in self.frags}
            mine = self.outer.state_dict() if keep_progress else None
            self.outer.load_state_dict(state)
            if mine is not None:
                self.outer.keep_own(mine)
            for frag in self.frags:
                new = self.outer.theta(frag.index)
                if keep_progress:
                    old = before[frag.index]
                    if frag.index in held:  # (θ minus that round's Δ: where its progress began)
                        old = [o - d for o, d in zip(old, held[frag.index], strict=True)]
                    new = rebase(new, self.params.snapshot(frag.names), old)
                self.params.apply_outer(frag.names, new)

    def catch_up(self, source: str, pending: Sequence[Sequence[Any]], keep_progress: bool, fetch: Fetch, *,
                 deadline: float, poll: float, idle: Callable[[], None] | None = None) -> None:
        """The state taken from ``source`` did not include its rounds then in flight: take θ after each of
        them once the source has applied it, or this peer would start one round behind the swarm on that
        fragment (bounded by ``deadline``, monotonic; a round the source never applies is left to repair).
        ``idle``: run between asks instead of sleeping ``poll`` s (an inner step), only with ``keep_progress``:
        its progress is then rebased onto θ after the round, as the progress made before it is (without, it would
        be overwritten)."""
        for fragment, key in pending:
            while time.monotonic() < deadline:
                try:
                    raw = fetch(source, f"after:{key}")
                except RoundFailed:  # not applied yet
                    if idle is not None and keep_progress:
                        idle()
                    else:
                        time.sleep(poll)
                    continue
                except TimeoutError:
                    return
                st = state_from_bytes(raw, f"θ after {key} from {source}")
                if st.get("gone"):
                    break
                f = int(fragment)
                names = self.frags[f].names
                with self.lock:
                    old = self.outer.theta(f)
                    self.outer.overwrite(f, st["theta"], st["momentum"])
                    if "round" in st:  # e.g. low-rank ranks adapted in that round: ours would not match the next
                        try:
                            self.outer.take_round_state(f, st["round"])
                        except (ValueError, KeyError, TypeError) as e:
                            log.warning("event=round_state_refused fragment=%s key=%s reason=%s", fragment, key, e)
                    new = self.outer.theta(f)
                    if keep_progress:
                        new = rebase(new, self.params.snapshot(names), old)
                    self.params.apply_outer(names, new)
                log.info("event=caught_up fragment=%s key=%s", fragment, key)
                break
        # Caught up (a round the source never applied, or not by the deadline, is left to repair, as before). A
        # catch-up cut short by a timeout above leaves its fragments behind until each applies a round of its own.
        self.behind.clear()

    def repair(self, rnd: Round, me: str, download: Download, taking: Callable[[], None] = lambda: None,
               idle: Callable[[], None] | None = None) -> bool:
        """Our θ^(p) disagreed with the round's majority: take theirs as it was before the round, from the
        contributors (``download``: the first that delivers; a peer's asks the next too when the first are
        silent), and only a θ whose fingerprint is the majority's (``rnd.agreed``, when the round said it): a
        contributor may itself have been outvoted (a hierarchical round's cell that lost the vote across regions)
        or may lie. ``taking()`` runs right before it replaces ours. ``idle``: an inner step, run on this thread
        while another one downloads (a source across a region cut costs its timeout: 60-70 s with the peer idle,
        in churn, when the first two were unreachable). True if repaired."""
        t0 = time.monotonic()
        got = self._fetch_majority(rnd, me, download) if idle is None else while_training(
            lambda: self._fetch_majority(rnd, me, download), idle)
        if got is None:
            return False
        peer, st = got
        seconds = time.monotonic() - t0
        taking()
        with self.lock:
            self.outer.overwrite(rnd.fragment, st["theta"], st["momentum"], int(st.get("version", 0)))
            self.params.apply_outer(self.frags[rnd.fragment].names, self.outer.theta(rnd.fragment))
        rnd.held_round = named_round(st.get("made"), me) or ""
        self.repairs += 1
        log.warning("event=repaired fragment=%d from=%s seconds=%.1f", rnd.fragment, peer, seconds)
        return True

    def _fetch_majority(self, rnd: Round, me: str, download: Download) -> tuple[str, dict[str, Any]] | None:
        """(source, state) of a contributor that serves the majority's θ from before ``rnd``, or None. A source
        whose θ is not the majority's is left out and the others asked again."""
        sources = [p for p in rnd.contributors if p != me]
        while sources:
            try:
                peer, raw = download(sources, f"before:{rnd.key}")
            except (RoundFailed, TimeoutError) as e:
                log.info("event=repair_failed key=%s reason=%s", rnd.key, e)
                return None
            sources.remove(peer)
            try:
                st = state_from_bytes(raw, f"θ from {peer}")
                version = int(st.get("version", 0))
                if rnd.agreed is not None and not fingerprints_match(versioned(version, fingerprint(list(st["theta"]))),
                                                                     rnd.agreed):
                    log.info("event=repair_refused peer=%s key=%s reason=not the majority's θ", peer, rnd.key)
                    continue
            except (ValueError, KeyError) as e:
                log.info("event=repair_refused peer=%s key=%s reason=%s", peer, rnd.key, e)
                continue
            return peer, st
        return None
