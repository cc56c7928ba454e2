"""The outer loop, written once: plan, send, wait, apply, drain, and CoCoDC's slot negotiation.

An :class:`OuterDriver` runs one peer's :class:`~p2ptrain.algo.outer_loop.OuterLoop` against a
:class:`Collective`: the simulator plugs in a virtual-clock one (:mod:`p2ptrain.sim.collective`), a swarm peer
the real round runner (:mod:`p2ptrain.peer.collective`). Both go through the same plan, the same token
weighting, the same slot decision (:class:`~p2ptrain.algo.slots.SlotLeader`), so what the simulator measures is
what real peers do. :class:`DDPDriver` is the same for data parallel: one gradient round per inner step.

A collective either blocks until what the driver needs is there (a real swarm: a thread waits) or says "not
yet" (the simulator: the other virtual peers must act first). So :meth:`OuterDriver.advance` returns False
when it is blocked and may be called again for the same step: it is idempotent (a fragment is never sent twice
at one step, an applied round leaves the rounds in flight).

Why it is long: the plan, the sends, the applies (with their repair and ordering rules) and the drain share one
object's state (the rounds in flight, their token marks, the lock the replica serves under), and splitting them
would pass that state around; the pure rules they follow live in algo/ (outer_loop, rules, slots).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .algo.bequest import Bequest, blend, displacement
from .algo.compress import Identity
from .algo.outer_loop import LocalParams, OuterLoop
from .algo.rounds import Action, ApplyReport, Round, RoundState
from .algo.slots import SlotLeader
from .algo.unseen import Unseen, UnseenRounds

__all__ = ["Collective", "DDPDriver", "DriverHooks", "OuterDriver", "Pending", "RoundRequest", "SlotOutcome",
           "SlotRequest"]

log = logging.getLogger(__name__)


@dataclass
class RoundRequest:
    """How a round meets its peers: its swarm-wide key, the fragment, the logical step, the shape of what
    this peer sends (``signature``), a slot's already formed group (negotiated sends), and what proves this
    peer's state: ``fingerprint`` given, or taken of the round's θ at send time when ``check_theta``."""

    key: str
    fragment: int
    step: int
    signature: str = ""
    group: Any = None
    check_theta: bool = False
    fingerprint: list[float] | None = None


@dataclass
class SlotRequest:
    """One member's view of a CoCoDC slot, for its leader (see :class:`~p2ptrain.algo.slots.SlotView`)."""

    key: str
    step: int
    scores: list[float] | None
    busy: list[int]
    last_sent: list[int]
    sends: int | None


@dataclass
class SlotOutcome:
    """A slot's decision: the fragment (None: nothing to send), a change of N ``(N, from_step)`` if any, and
    the group it formed (handed back with the send)."""

    fragment: int | None
    schedule: tuple[int, int] | None = None
    group: Any = None
    leader: str = ""
    members: int = 0


class Pending(Protocol):
    """A slot negotiation in progress."""

    def done(self) -> bool: ...

    def result(self) -> SlotOutcome: ...  # raises when the negotiation failed


class Collective(Protocol):
    """What a driver needs of the rounds' transport: start, tell, wait, negotiate."""

    def launch(self, rnd: Round, request: RoundRequest) -> None:
        """Start ``rnd``'s all-reduce in the background (it ends ARRIVED or ABORTED)."""

    def arrived(self, rnd: Round) -> bool:
        """Whether ``rnd``'s result is here for this peer now."""

    def wait(self, rounds: Sequence[Round]) -> bool:
        """Wait until every round is finished (arrived or aborted) and return True; or return False at once
        when that cannot happen before other peers act (a virtual clock)."""

    def negotiate(self, request: SlotRequest, leader: SlotLeader) -> Pending:
        """Join slot ``request.key``; whoever leads it decides with its own ``leader``."""

    def settle(self, pending: Pending) -> bool:
        """Wait for a negotiation to end (True), or False at once if it cannot end before others act."""

    def expected_members(self) -> int:
        """How many peers a round is expected to have (the live view)."""

    def proposed_sends(self, H: int, P: int, numels: Sequence[int]) -> int | None:
        """CoCoDC's N that this peer's link can carry, or None when nothing is measured yet."""


class DriverHooks:
    """What a peer adds around the loop (replica state, repair, metrics, checkpoints). No-ops here."""

    def after_send(self, rnd: Round) -> None:
        """``rnd`` was just started (under the driver's lock)."""

    def repair(self, rnd: Round, taking: Callable[[], None]) -> bool:
        """``rnd`` says this peer's state left the majority's: take theirs before applying it. False when it could
        not be taken: the round is then not applied here (applied to a θ known to be another one, it would make a
        replica that differs from the majority's, and one a joiner could be served). ``taking()`` is called right
        before the majority's θ replaces ours (the driver reads our progress then: a repair may train while it
        fetches, and those steps are progress too)."""
        taking()
        return True

    def before_apply(self, rnd: Round) -> None:
        """``rnd`` arrived and is about to be applied (after any repair): an instrument's moment to look."""

    def after_apply(self, rnd: Round, report: ApplyReport | None) -> None:
        """``rnd`` was applied (under the driver's lock); ``report`` is None for a data-parallel step."""


@dataclass
class _Stats:
    max_delay: int = 0
    corrections: list[float] = field(default_factory=list)
    history: list[tuple[int, str, int]] = field(default_factory=list)  # (step, "send"/"apply", fragment)


class OuterDriver:
    """One peer's outer loop over a collective (see the module docstring).

    Args:
        outer: the method's outer loop (initialised).
        params: the peer's live model (snapshots, writes, and ``tokens_seen`` for token weighting).
        collective: where rounds run.
        hooks: the peer's additions around sends and applies.
        lock: held while the outer state changes (a state provider on another thread reads it under it).
        negotiate_at_slot: wait for a slot's decision before the next inner step (the simulator, and tests that
            need a deterministic schedule); otherwise a slot's send starts whenever its decision is in.
        slot_lag: logical steps after a slot by which every member holds its decision (a change of N starts
            no earlier); see :class:`~p2ptrain.algo.slots.SlotLeader`.
        tokens: tokens trained so far (default ``params.tokens_seen``): a round's weight is those since the
            fragment's last round that was not aborted (an aborted round's progress goes into the next one's Δ).
    """

    def __init__(self, outer: OuterLoop, params: LocalParams, collective: Collective, *,
                 hooks: DriverHooks | None = None, lock: contextlib.AbstractContextManager[Any] | None = None,
                 negotiate_at_slot: bool = False, slot_lag: int = 1,
                 tokens: Callable[[], int] | None = None) -> None:
        if not outer.initialized:
            raise ValueError("the outer loop must be initialised (OuterLoop.init) before it is driven")
        self.outer, self.params, self.collective = outer, params, collective
        self.hooks = hooks or DriverHooks()
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self.negotiate_at_slot = negotiate_at_slot
        self.leader = SlotLeader(outer.cfg.H, slot_lag, outer.rules.choice or "drift") if outer.negotiated else None
        self._tokens = tokens or (lambda: int(params.tokens_seen))  # type: ignore[attr-defined]
        self.tokens_at_send = [0] * len(outer.fragments)
        # round key -> (fragment, tokens mark before its send, mark it set): an aborted round gives its tokens
        # back to the fragment's next send (its progress stays in θ − θ_i and goes into that round's Δ)
        self._marks: dict[str, tuple[int, int, int]] = {}
        self.bequests: dict[int, list[Bequest]] = {}  # fragment -> leavers' progress for its next send (inherit)
        self.unseen = UnseenRounds()  # rounds whose outcome we did not see, until θ says whether they counted us
        self.in_flight: list[Round] = []
        self.pending: list[tuple[int, Pending]] = []  # CoCoDC negotiations: (slot, decision to come)
        self.last_slot = -1
        self.applied = 0
        self.stats = _Stats()

    # ------------------------------------------------------------------ one step
    def advance(self, step: int) -> bool:
        """Do what the method does after logical step ``step``; False when blocked (call again)."""
        if not self._plan(step):
            return False
        o = self.outer
        if o.negotiated and step > self.last_slot and o.is_slot(step):
            self.last_slot = step  # once per slot: a step seen again (blocked, or a faster inner loop) is not
            self._negotiate(step)
        if self.negotiate_at_slot and not all(self.collective.settle(p) for _, p in self.pending):
            return False
        if self._start_negotiated(step):
            return self._plan(step)  # a round due at once (τ = 0) is applied within its step
        return True

    def _plan(self, step: int) -> bool:
        for _ in range(1000):
            self._drop_finished()
            plan = self.outer.plan(step, self.in_flight, is_arrived=self.collective.arrived)
            if plan.wait:
                if not self.collective.wait(plan.wait):
                    return False
                continue
            if not plan.actions:
                return True
            for action, x in self._in_order(plan.actions, step):
                if action is Action.SEND:
                    assert isinstance(x, int)
                    self._send(x, step, RoundRequest(key=f"f{x}.L{step}", fragment=x, step=step,
                                                     signature=self.outer.signature(x)))
                else:
                    assert isinstance(x, Round)
                    self._apply(x, step)
        raise RuntimeError(f"outer loop made no progress at step {step}")

    def _in_order(self, actions: list[tuple[Action, int | Round]], step: int) -> list[tuple[Action, int | Round]]:
        """The plan's actions, a round overdue (due before ``step``: the steps between were skipped, the peer had
        fallen behind the swarm's clock) applied before this step's sends, where its due step would have put it.
        Sent first, a round of its fragment would snapshot and fingerprint θ from before that apply and then be
        stepped from θ after it: peers that did not skip sent the θ after it, and whichever side the vote took,
        a repaired member stepped from another θ than the majority did. Not for the rules that restart from θ
        each round: their round is due at the fragment's next send, which must snapshot first (their plan's
        order)."""
        if self.outer.restarts_each_round:
            return actions
        return sorted(actions, key=lambda a: not (a[0] is Action.APPLY and isinstance(a[1], Round)
                                                  and a[1].due < step))

    def unsent(self) -> list[int]:
        """The fragments holding tokens that no live or applied round carries: trained since the fragment's
        last send, or given back by a round that was aborted or outvoted (a leave sends these first)."""
        self._drop_finished()
        now = self._tokens()
        return [f for f, mark in enumerate(self.tokens_at_send) if mark < now]

    def _drop_finished(self) -> None:
        """Forget rounds that are no longer live; an aborted one's tokens count toward its fragment's next send
        (unless a later send of the fragment already moved the mark on)."""
        for r in self.in_flight:
            if r.state is RoundState.ABORTED:
                mark = self._marks.get(r.key)
                if r.began and mark is not None and self.outer.progress_kept(r.fragment):
                    self.unseen.failed(r.fragment, Unseen(r.key, list(r.theta), list(r.delta), mark[2]))
                self._give_back(r.key)
        self.in_flight = [r for r in self.in_flight if r.live]

    def counted(self, fragment: int, unseen: Unseen, by: str) -> None:
        """``unseen``'s Δ is in θ after all: its tokens are counted (not given to the fragment's next round)."""
        self.tokens_at_send[fragment] = max(self.tokens_at_send[fragment], unseen.after)
        log.info("event=counted_after_all key=%s fragment=%d by=%s", unseen.key or "after-checkpoint", fragment, by)

    def unseen_record(self) -> dict[str, Any]:
        """What a checkpoint keeps of the rounds whose outcome a peer resumed from it will not see (its rounds in
        flight now, and those held): key, fragment, Δ and tokens marks; and the keys it sent (see
        :meth:`resume_unseen`)."""
        rounds = [{"key": u.key, "fragment": f, "delta": u.delta, "before": u.after, "after": u.after}
                  for f, u in self.unseen.held.items()]
        for r in self.in_flight:
            if r.live and (mark := self._marks.get(r.key)) is not None and self.outer.progress_kept(r.fragment):
                rounds.append({"key": r.key, "fragment": r.fragment, "delta": list(r.delta), "before": mark[1],
                               "after": mark[2]})
        return {"rounds": rounds, "sent": {str(f): list(k) for f, k in self.unseen.sent.items()}}

    def resume_unseen(self, record: dict[str, Any], local: Callable[[int], list[torch.Tensor]], tokens: int) -> None:
        """Resumed from a checkpoint (its :meth:`unseen_record`; ``local``: its local fragment; ``tokens``: the
        tokens it had trained): its rounds in flight are gone here, so their tokens go back to the fragment's next
        round, and they are held with the progress the checkpoint held, until a state taken says whether they
        counted."""
        held = []
        for r in record.get("rounds", []):
            f, before, after = int(r["fragment"]), int(r["before"]), int(r["after"])
            if self.tokens_at_send[f] == after:
                self.tokens_at_send[f] = before
            held.append((f, Unseen(str(r["key"]), list(self.outer.theta(f)), list(r["delta"]), after)))
        since = {}
        for frag in self.outer.fragments:
            if self.outer.progress_kept(frag.index):
                theta = list(self.outer.theta(frag.index))
                since[frag.index] = Unseen("", theta, [t - x.to(t.device, t.dtype) for t, x in
                                                       zip(theta, local(frag.index), strict=True)], tokens)
        self.unseen.resumed(held, {int(f): [str(k) for k in keys] for f, keys in record.get("sent", {}).items()},
                            since)

    def inherit(self, bequest: Bequest) -> None:
        """Take a leaving peer's unsent progress on a fragment into this peer's next round of it (any thread;
        checked by the caller, :func:`p2ptrain.algo.bequest.problem`)."""
        with self.lock:
            self.bequests.setdefault(bequest.fragment, []).append(bequest)

    def will(self) -> list[Bequest]:
        """This peer's unsent progress, per fragment that holds any: its displacement from θ and the tokens
        behind it (after :meth:`drain`: what no applied or live round carries; a fragment with a round still in
        flight is left out; what it inherited and has not sent yet is passed on, taken into its own first)."""
        out = []
        now = self._tokens()
        busy = {r.fragment for r in self.in_flight if r.live}  # (a drain cut short: x − θ holds what it carries)
        for f in [f for f in self.unsent() if f not in busy]:
            names = self.outer.fragments[f].names
            with self.lock:
                theta = list(self.outer.theta(f))
                inherited = self.bequests.pop(f, [])
                local = self.params.snapshot(names)
            own = max(0, now - self.tokens_at_send[f])
            if inherited:  # (its own progress and what it holds for others, as one)
                local = blend(local, theta, own, inherited)
            tokens = own + sum(b.tokens for b in inherited)
            if tokens > 0:
                out.append(Bequest(f, displacement(local, theta), tokens))
        return out

    def _send(self, fragment: int, step: int, request: RoundRequest) -> Round:
        tokens = self._tokens()
        before = self.tokens_at_send[fragment]
        with self.lock:
            inherited = self.bequests.pop(fragment, [])
            if inherited:  # a leaver's progress joins ours in this round's Δ (algo/bequest.py)
                names = self.outer.fragments[fragment].names
                self.params.apply_outer(names, blend(self.params.snapshot(names), self.outer.theta(fragment),
                                                     max(0, tokens - before), inherited))
                before -= sum(b.tokens for b in inherited)  # (given back with ours if the round is aborted)
                log.info("event=inherited_sent key=%s fragment=%d tokens=%d from=%s", request.key, fragment,
                         sum(b.tokens for b in inherited), ",".join(f"{b.source[-8:]}:{b.tokens}" for b in inherited))
        # The tokens since this fragment's last round that was not aborted: Δ holds their progress too.
        weight = max(1, tokens - before)
        self.tokens_at_send[fragment] = tokens
        self._marks[request.key] = (fragment, before, tokens)
        self.unseen.sent_round(fragment, request.key)
        request.check_theta = self.outer.shared_theta
        with self.lock:  # a state provider on another thread sees the round in flight with the state it left
            rnd = self.outer.start(fragment, step, self.params, weight=weight, name=request.key,
                                   members=self.collective.expected_members())
            self.in_flight.append(rnd)
            self.hooks.after_send(rnd)
        self.stats.history.append((step, "send", fragment))
        self.collective.launch(rnd, request)
        return rnd

    def _apply(self, rnd: Round, step: int) -> None:
        mine = None  # (θ^(p), local fragment) of an outvoted round: read as the majority's θ comes to replace ours

        def taking() -> None:
            nonlocal mine
            mine = self._own_progress(rnd)

        if rnd.divergent and not self.hooks.repair(rnd, taking):
            self._refuse(rnd, "divergent θ, no repair")
            return
        if not rnd.divergent and self._replaced(rnd):
            self._refuse(rnd, "θ replaced since the round was sent")
            return
        self.hooks.before_apply(rnd)
        with self.lock:
            if mine is not None and rnd.compressor.withdraw():
                # Outvoted: our Δ is in no average. Our progress is kept on the majority's θ, and its tokens go
                # into the fragment's next round with it (a repair used to drop both: a peer cut off for a minute
                # lost that minute's work on every fragment).
                theta_before, local = mine
                # Unless the majority's θ holds the Δ of a round we saw fail (its contributors name us): that much
                # of our progress is in θ already, and only what we trained since that round's send is kept (kept
                # whole, it was averaged twice: once there and again in the next round).
                held = self.unseen.outvoted(rnd.fragment, rnd.held_round, theta_before)
                if held is not None:  # (θ before minus that round's Δ: the local fragment at its send)
                    theta_before = [t - d for t, d in zip(theta_before, held.delta, strict=True)]
                rep = self.outer.finish_outvoted(rnd, step, self.params, theta_before, local)
                self._give_back(rnd.key)
                if held is not None:
                    self.counted(rnd.fragment, held, rnd.key)
            else:
                self.unseen.applied(rnd.fragment)
                # Where the average left our Δ out (a part or a shard without it), our progress stays for the next
                # round: merged, it was lost (a cell whose carrier failed a shard lost that shard's work).
                keep = rnd.missing if rnd.missing and self.outer.can_keep(rnd) else ()
                if keep:
                    log.info("event=kept_unaveraged key=%s values=%d", rnd.key, sum(hi - lo for lo, hi in keep))
                rep = self.outer.finish(rnd, step, self.params, keep=keep)
                if keep and not rnd.counted:
                    self._give_back(rnd.key)  # no contributor of it: its tokens ride on the next round, as kept
                else:
                    self._marks.pop(rnd.key, None)
            self.in_flight.remove(rnd)
            self.hooks.after_apply(rnd, rep)
        self.applied += 1
        self.stats.history.append((step, "apply", rnd.fragment))
        self.stats.max_delay = max(self.stats.max_delay, rep.delay)
        if rep.correction_norm:
            self.stats.corrections.append(rep.correction_norm)

    def _own_progress(self, rnd: Round) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """(θ^(p), local fragment) now, for a round that arrived without our Δ (outvoted) under rules whose local
        model still holds what it sent; None otherwise."""
        o = self.outer
        if not rnd.divergent or rnd.counted or o.restarts_each_round or not o.shared_theta:
            return None
        with self.lock:
            return list(o.theta(rnd.fragment)), self.params.snapshot(o.fragments[rnd.fragment].names)

    def _give_back(self, key: str) -> None:
        """The tokens a round was sent with go into its fragment's next round (unless a later send of the
        fragment already moved the mark on)."""
        if (mark := self._marks.pop(key, None)) is not None:
            fragment, before, after = mark
            if self.tokens_at_send[fragment] == after:
                self.tokens_at_send[fragment] = before

    def _refuse(self, rnd: Round, reason: str) -> None:
        log.warning("event=apply_refused key=%s fragment=%d reason=%s", rnd.key, rnd.fragment, reason)
        rnd.abort()  # our progress stays in θ − θ_i; the next round of the fragment flags us if we differ
        self._drop_finished()

    def _replaced(self, rnd: Round) -> bool:
        """Whether the fragment's θ is no longer the one ``rnd`` was sent from (θ is copy-on-write: only a new
        version is another object), for rules whose θ stays put between a round's send and its apply. The round's
        vote was about θ at send, and a repaired member steps from that θ (``before:KEY``): stepped from another
        one (a resync or a catch-up took the swarm's, which may already hold this round), it would make a replica
        nobody voted for."""
        o = self.outer
        if not o.shared_theta or o.restarts_each_round or not rnd.theta:
            return False
        return any(a is not b for a, b in zip(o.theta(rnd.fragment), rnd.theta, strict=True))

    # ------------------------------------------------------------------ CoCoDC's slots
    def _negotiate(self, slot: int) -> None:
        o = self.outer
        assert self.leader is not None
        with self.lock:
            scores = o.drift_scores(self.params, slot) if o.needs_scores(slot) else None
        proposal = None
        if o.rules.links_set_n:  # N follows the links unless the config fixes it
            proposal = self.collective.proposed_sends(o.cfg.H, len(o.fragments), [f.numel for f in o.fragments])
        req = SlotRequest(key=f"slot.L{slot}", step=slot, scores=scores, busy=o.busy_fragments(self.in_flight),
                          last_sent=o.last_sends(), sends=proposal)
        self.pending.append((slot, self.collective.negotiate(req, self.leader)))

    def _start_negotiated(self, step: int) -> bool:
        """Send what the slots decided whose decision is in; True if anything was sent."""
        keep, sent = [], False
        for slot, pending in self.pending:
            if not pending.done():
                keep.append((slot, pending))
                continue
            try:
                out = pending.result()
            except Exception as e:  # a slot that formed no group: its fragment waits for a later slot
                log.info("event=slot_skipped slot=%d reason=%s", slot, e)
                continue
            if out.schedule is not None:
                n, start = out.schedule
                if start <= step:
                    log.warning("event=schedule_late slot=%d start=%d step=%d", slot, start, step)
                try:
                    with self.lock:
                        self.outer.schedule_sends(n, start)
                except ValueError as e:  # a leader that does not follow the rule: keep our N
                    log.warning("event=schedule_refused slot=%d leader=%s reason=%s", slot, out.leader, e)
            busy = {r.fragment for r in self.in_flight if r.live}
            if out.fragment is None or out.fragment in busy:
                log.info("event=slot_skipped slot=%d leader=%s reason=%s", slot, out.leader[-8:],
                         "nothing to send" if out.fragment is None else f"fragment {out.fragment} busy here")
                continue
            log.info("event=slot_send slot=%d fragment=%d leader=%s members=%d schedule=%s", slot, out.fragment,
                     out.leader[-8:], out.members, out.schedule)
            self._send(out.fragment, step, RoundRequest(key=f"slot.L{slot}", fragment=out.fragment, step=step,
                                                        signature=self.outer.signature(out.fragment),
                                                        group=out.group))
            sent = True
        self.pending = keep
        return sent

    # ------------------------------------------------------------------ the end
    def drain(self, step: int) -> bool:
        """Apply every round still in flight, waiting for each (so θ holds all the work); False when blocked.
        A round that ends aborted is dropped (its progress stays in θ − θ_i)."""
        for rnd in sorted([r for r in self.in_flight if r.live], key=lambda r: (r.send_step, r.fragment)):
            if not self.collective.wait([rnd]):
                return False
            if rnd.arrived:
                self._apply(rnd, step)
        self._drop_finished()
        self.pending = []
        return True


class DDPDriver:
    """Data parallel, written once: forward/backward, a one-phase round of the gradients weighted by tokens,
    then the optimizer step on the average. A step whose round failed drops its gradient (a lone update would
    fork the replicas); a divergent peer repairs (``hooks.repair``) instead of stepping."""

    def __init__(self, trainer: Any, collective: Collective, *, hooks: DriverHooks | None = None,
                 lock: contextlib.AbstractContextManager[Any] | None = None,
                 fingerprint: Callable[[], list[float]] | None = None) -> None:
        self.trainer, self.collective = trainer, collective
        self.hooks = hooks or DriverHooks()
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self.fingerprint = fingerprint
        self.round: Round | None = None
        self.last_loss = float("nan")
        self.last_tokens = 0

    def advance(self, step: int) -> bool:
        """One data-parallel step (``step``: the step being taken, 1-based); False when blocked (call again:
        the gradients are not computed twice)."""
        tr = self.trainer
        if self.round is None:
            tr.model.train()
            self.last_loss, self.last_tokens = tr.forward_backward()
            tr.tokens_seen += self.last_tokens
            grads = list(tr.gradients())
            rnd = Round(0, step, step, step, [], grads, float(self.last_tokens), Identity(), name=f"g{step}")
            rnd.payload = rnd.compressor.begin(grads)
            rnd.state = RoundState.AVERAGING
            self.round = rnd
            print_ = None
            if self.fingerprint is not None:
                with self.lock:
                    print_ = self.fingerprint()
            self.collective.launch(rnd, RoundRequest(key=rnd.name, fragment=0, step=step, fingerprint=print_))
        if not self.collective.wait([self.round]):
            return False
        rnd, self.round = self.round, None
        if rnd.arrived and rnd.divergent:
            self.hooks.repair(rnd, lambda: None)  # (a data-parallel step keeps no progress of its own)
            return True
        with self.lock:  # a state provider must not read half-updated parameters
            if rnd.arrived and rnd.result is not None:
                for g, a in zip(tr.gradients(), rnd.result, strict=True):
                    g.copy_(a)
                tr.optimizer_step()
            else:
                # We missed this step's group: drop the gradient; the next step's fingerprint shows whether
                # we must take the swarm's state.
                tr.optimizer.zero_grad(set_to_none=True)
                tr.step_count += 1
            self.hooks.after_apply(rnd, None)
        return True


def param_sums(params: dict[str, torch.Tensor]) -> list[float]:
    """A data-parallel peer's fingerprint: float64 sums of its parameters, one per tensor."""
    return [float(p.detach().double().sum()) for p in params.values()]
