"""One peer's outer loop, for every method but ddp: θ^(p) and momentum per fragment, rounds, the outer step.

It never touches the network or a clock: a driver (:mod:`p2ptrain.driver`) asks it after each inner step what
to do (:meth:`OuterLoop.plan`), starts the rounds it names (:meth:`OuterLoop.start`), moves their payloads
through a collective and hands the arrived ones back (:meth:`OuterLoop.finish`). What differs between methods
is a :class:`~p2ptrain.algo.rules.Rules` chosen once from the config.

Outer state per fragment (never one optimizer over all fragments: a fragment that is not syncing must not
move) is **copy-on-write**: θ^(p) and its momentum are replaced by new tensors at every outer step, repair or
load, never written in place, so a reference taken at any moment (a round's θ at send time, the state a
joining peer downloads) stays that version without a copy.

Why it is long: the plan, both ends of a round (send, outer step and merge, the outvoted case) and the state a
checkpoint or a joiner takes read and replace the same per-fragment state; split, each part would pass it
around. The math they use is in :mod:`~p2ptrain.algo.outer` and :mod:`~p2ptrain.algo.rules`.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .compress import Compressor
from .configs import MethodConfig
from .feedback import ErrorFeedback
from .fragments import Fragment
from .outer import eager_estimate, nesterov_step, pseudo_gradient
from .priority import drift_score
from .rounds import Action, ApplyReport, Round, RoundState, StepPlan
from .rules import rules_for
from .slots import SlotGrid

__all__ = ["LocalParams", "OuterLoop"]


class LocalParams(Protocol):
    """What the outer loop needs of a peer's live model (``p2ptrain.trainer.Trainer`` has it). ``snapshot``
    returns fresh fp32 copies; ``apply_outer`` copies ``values`` into the live parameters."""

    def snapshot(self, names: Sequence[str]) -> list[torch.Tensor]: ...

    def apply_outer(self, names: Sequence[str], values: Sequence[torch.Tensor]) -> None: ...


@dataclass
class _FragmentState:
    theta: list[torch.Tensor]
    momentum: list[torch.Tensor]
    compressor: Compressor
    last_send: int | None = None
    seq: int = 0
    own: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # eager: Δ_i of recent rounds by seq
    last_round: weakref.ref[Round] | None = None  # (weak: a finished round's tensors are not kept for it)
    # θ's version: the send step of the last round applied into it (0: none). Rounds of a fragment carry it in their
    # fingerprint, so that a tie between two versions of θ goes to the one that took more of the swarm's rounds.
    version: int = 0


def _rebased(new: Sequence[torch.Tensor], keep: Sequence[tuple[int, int]], theta: Sequence[torch.Tensor],
             local: Sequence[torch.Tensor], before: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``new`` (the merged local fragment), except in the flat ranges ``keep`` of the concatenated tensors, where
    it is θ + (local − before): the local progress since ``before``, on the new θ."""
    out, offset = [], 0
    for n, t, x, o in zip(new, theta, local, before, strict=True):
        size = n.numel()
        flat = None
        for lo, hi in keep:
            a, b = max(lo, offset) - offset, min(hi, offset + size) - offset
            if a >= b:
                continue
            if flat is None:
                flat = n.detach().clone().reshape(-1)
            flat[a:b] = (t.reshape(-1)[a:b] + (x.reshape(-1)[a:b] - o.reshape(-1)[a:b])).to(flat.dtype)
        out.append(n if flat is None else flat.view(n.shape))
        offset += size
    return out


class OuterLoop:
    """One peer's outer loop for any method except ``ddp`` (see the module docstring).

    ``num_peers`` is the number of peers a round is expected to have when nothing better is known (eager's
    first rounds, before any average arrived, apply the peer's own share 1/M of its Δ_i); a driver passes the
    live count to :meth:`start`.
    """

    def __init__(self, cfg: MethodConfig, fragments: Sequence[Fragment], *, num_peers: int = 1,
                 seed: int = 0) -> None:
        self.rules = rules_for(cfg)
        if len(fragments) != cfg.fragments:
            raise ValueError(f"{cfg.name}: config wants P={cfg.fragments} fragments, got {len(fragments)}")
        if num_peers < 1:
            raise ValueError(f"num_peers must be at least 1, got {num_peers}")
        self.cfg = cfg
        self.fragments = list(fragments)
        self.num_peers = num_peers
        self.seed = seed
        self._state: list[_FragmentState] = []
        self.grid: SlotGrid | None = None
        if self.rules.negotiated:
            self.grid = SlotGrid(cfg.H, cfg.fragments, getattr(cfg, "sends_per_window", None))

    # -- set-up -------------------------------------------------------------------
    def init(self, params: LocalParams) -> None:
        """Take θ^(p) from the peer's current parameters (identical on every peer at start)."""
        self._state = []
        for frag in self.fragments:
            theta = params.snapshot(frag.names)
            self._state.append(_FragmentState(theta, [torch.zeros_like(t) for t in theta],
                                              self.rules.compressor(frag.index, self.seed)))

    @property
    def initialized(self) -> bool:
        return len(self._state) == len(self.fragments)

    # -- the method's rules, as the driver needs them ------------------------------
    @property
    def tau(self) -> int:
        return self.rules.tau

    @property
    def apply_first(self) -> bool:
        return self.rules.apply_first

    @property
    def restarts_each_round(self) -> bool:
        return self.rules.restarts_each_round

    @property
    def late_ok(self) -> bool:
        """Whether a round past its due step may be applied later instead of stalling."""
        return self.rules.late_ok

    @property
    def negotiated(self) -> bool:
        """Whether the swarm must agree on which fragment a slot sends (CoCoDC's adaptive choice)."""
        return self.rules.negotiated

    @property
    def shared_theta(self) -> bool:
        """Whether every peer holds the same θ (all but the eager rules, whose outer state is per peer):
        only then can replicas be compared and repaired."""
        return not self.rules.eager

    # -- outer state ----------------------------------------------------------------
    def theta(self, fragment: int) -> list[torch.Tensor]:
        """θ^(p): this peer's outer parameters of a fragment (this version is never modified)."""
        return self._state[fragment].theta

    def momentum(self, fragment: int) -> list[torch.Tensor]:
        """The outer Nesterov buffer of a fragment (this version is never modified)."""
        return self._state[fragment].momentum

    def signature(self, fragment: int) -> str:
        """The shape of what this peer sends for a fragment (low-rank: its ranks); peers of one round
        must agree on it."""
        ranks = getattr(self._state[fragment].compressor, "ranks", None)
        return ",".join(str(r) for r in ranks()) if callable(ranks) else ""

    @torch.no_grad()
    def overwrite(self, fragment: int, theta: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor],
                  version: int | None = None) -> None:
        """Replace a fragment's θ^(p) and momentum (repair from the swarm's majority), and its version when given
        (the one the θ taken had)."""
        st = self._state[fragment]
        if [t.shape for t in theta] != [t.shape for t in st.theta]:
            raise ValueError(f"fragment {fragment}: θ of other shapes")
        st.theta = [v.float().clone() for v in theta]
        st.momentum = [v.float().clone() for v in momentum]
        if version is not None:
            st.version = int(version)

    def version(self, fragment: int) -> int:
        """θ^(p)'s version: the send step of the last round applied into it (0: none yet)."""
        return self._state[fragment].version

    def outer_params(self) -> dict[str, torch.Tensor]:
        """All outer parameters θ by name (for evaluation)."""
        return {n: t for frag, st in zip(self.fragments, self._state, strict=True)
                for n, t in zip(frag.names, st.theta, strict=True)}

    def last_send(self, fragment: int) -> int | None:
        return self._state[fragment].last_send

    def last_sends(self) -> list[int]:
        """Step of each fragment's last send, −1 for never (a slot leader's view)."""
        return [-1 if st.last_send is None else st.last_send for st in self._state]

    # -- CoCoDC's slots (a no-op for the methods with fixed schedules) ----------------
    @property
    def sends_per_window(self) -> int | None:
        return None if self.grid is None else self.grid.sends_per_window

    @property
    def sends_changes(self) -> list[tuple[int, int]]:
        return [] if self.grid is None else self.grid.changes

    def set_sends_per_window(self, n: int) -> None:
        """N from now on, clamped to [P, H] (see ``priority.sends_per_window``)."""
        if self.grid is not None:
            self.grid.set(n)

    def schedule_sends(self, n: int, from_step: int) -> None:
        """N (clamped to [P, H]) from logical step ``from_step`` on, a window start (ValueError otherwise)."""
        if self.grid is not None:
            self.grid.schedule(n, from_step)

    def sends_at(self, step: int) -> int:
        """N in effect at ``step`` (P for the fixed schedules)."""
        return self.cfg.fragments if self.grid is None else self.grid.sends_at(step)

    def is_slot(self, step: int) -> bool:
        """Whether ``step`` is a send slot (every h = ⌊H/N⌋ steps from each window's start)."""
        return self.grid is not None and self.grid.is_slot(step)

    def needs_scores(self, step: int) -> bool:
        """Whether a slot's choice at ``step`` can need drift scores (every fragment was sent once)."""
        return (self.is_slot(step) and self.rules.choice == "drift"
                and all(st.last_send is not None for st in self._state))

    def drift_scores(self, params: LocalParams, step: int) -> list[float]:
        """This peer's ``R_p`` for every fragment (to be summed over peers)."""
        out = []
        for frag, st in zip(self.fragments, self._state, strict=True):
            since = step - st.last_send if st.last_send is not None else step
            out.append(drift_score(st.theta, params.snapshot(frag.names), since))
        return out

    @staticmethod
    def busy_fragments(in_flight: Sequence[Round]) -> list[int]:
        return sorted({r.fragment for r in in_flight if r.live})

    # -- scheduling -----------------------------------------------------------------
    def plan(self, step: int, in_flight: Sequence[Round], *,
             is_arrived: Callable[[Round], bool] | None = None) -> StepPlan:
        """What to do after inner step ``step`` given the rounds still in flight (not applied).

        ``is_arrived`` tells whether a round's result is here (default: its state); the simulator passes its
        virtual clock's view. Negotiated sends (CoCoDC's slots) are the driver's: a plan only applies them.
        """
        arrived = is_arrived or (lambda r: r.arrived)
        live = [r for r in in_flight if r.live]
        due = [r for r in live if r.due <= step]
        sends = [] if step <= 0 else [p for p in self.rules.fixed_sends(step) if self._state[p].last_send != step]
        wait = [r for r in due if not arrived(r) and (not self.late_ok or r.fragment in sends)]
        if wait:  # (a late round is waited for when its fragment is due to be sent again: one round a fragment)
            return StepPlan(wait=wait)
        # A late round that arrived after its due step is applied at the next step (the driver puts it before this
        # step's sends).
        applies = sorted((r for r in due if arrived(r)), key=lambda r: (r.send_step, r.fragment))
        apply_actions: list[tuple[Action, int | Round]] = [(Action.APPLY, r) for r in applies]
        send_actions: list[tuple[Action, int | Round]] = [(Action.SEND, p) for p in sends]
        return StepPlan(actions=apply_actions + send_actions if self.apply_first else send_actions + apply_actions)

    # -- the two ends of a round -------------------------------------------------
    @torch.no_grad()
    def start(self, fragment: int, step: int, params: LocalParams, weight: float = 1.0, *, name: str = "",
              members: int | None = None) -> Round:
        """Snapshot fragment p, compute Δ_i = θ^(p) − s_p and the first payload to all-reduce. ``members``:
        the peers the round is expected to have (default ``num_peers``)."""
        frag, st = self.fragments[fragment], self._state[fragment]
        snap = params.snapshot(frag.names)
        delta = pseudo_gradient(st.theta, snap)
        comp = self.rules.compressor(frag.index, self.seed) if st.compressor.stateless else st.compressor
        rnd = Round(fragment, st.seq, step, step + self.tau, snap, delta, float(weight), comp, name=name,
                    theta=st.theta, based_on=st.version)
        if st.last_round is not None and (prev := st.last_round()) is not None:
            prev.prepare()  # a deferred begin of this compressor runs before the next one (eager's rounds overlap)
        comp.expect_members(members or self.num_peers)
        if comp.deferred:
            rnd.pending = functools.partial(comp.begin, delta)
        else:
            rnd.payload = comp.begin(delta)
        st.last_round = weakref.ref(rnd)
        rnd.state = RoundState.AVERAGING
        k = self.tau // self.cfg.H
        if self.rules.eager and st.seq < k:
            # Warm-up of eager: no stale round arrives at the first k boundaries (Δ(t−k) = 0,
            # Δ_i(t−k) = 0), so Δ̃_i = share·Δ_i(t); later rounds subtract exactly this share again.
            share = 1.0 / max(1, members or self.num_peers)
            st.theta, st.momentum = nesterov_step(st.theta, st.momentum, [d * share for d in delta],
                                                  self.cfg.outer_lr, self.cfg.outer_momentum)
        if self.rules.eager:
            st.own[st.seq] = delta
            for old in [q for q in st.own if q < st.seq - k - 1]:
                del st.own[old]
        st.seq += 1
        st.last_send = step
        if self.restarts_each_round:
            params.apply_outer(frag.names, st.theta)
        return rnd

    @torch.no_grad()
    def preview(self, rnd: Round) -> list[torch.Tensor]:
        """θ̃^(p): what the outer step of an arrived round will make θ^(p), without taking it (an instrument
        compares merge rules against it)."""
        return self._stepped(rnd)[0]

    def _stepped(self, rnd: Round) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(θ̃, momentum) after the outer step with ``rnd``'s average; the state is not changed."""
        if not rnd.arrived or rnd.result is None:
            raise RuntimeError(f"round {rnd.key} cannot be applied: it is {rnd.state.value}")
        c, st = self.cfg, self._state[rnd.fragment]
        avg = rnd.result
        if self.rules.eager:
            # Δ̃_i = Δ(t−k) + share·(Δ_i(t) − Δ_i(t−k)); share = w_i/Σw (1/M for equal weights). Round
            # t−k pairs with round t, started at this same step; at the end of a run no round t exists
            # and Δ_i(t) = 0 (each round's own share was already applied when it started).
            k = self.tau // c.H
            fresh = st.own.get(rnd.seq + k) or [torch.zeros_like(d) for d in rnd.delta]
            avg = eager_estimate(avg, fresh, rnd.delta, rnd.share)
        return nesterov_step(st.theta, st.momentum, avg, c.outer_lr, c.outer_momentum)

    @torch.no_grad()
    def finish(self, rnd: Round, step: int, params: LocalParams, keep: Sequence[tuple[int, int]] = ()) -> ApplyReport:
        """Outer step on θ^(p) with the arrived average, then merge into the local fragment. ``keep``: [lo, hi)
        ranges of the fragment (its tensors flattened and concatenated) whose average does not hold this peer's Δ
        (a part or shard that left it out): there the local fragment keeps all of its progress since θ^(p) before
        the step, rebased on the new θ^(p) (as :meth:`finish_outvoted` does for the whole fragment), and it goes
        into the fragment's next round; merged, it would be lost. Only where :meth:`can_keep` says so
        (ValueError otherwise)."""
        if keep and not self.can_keep(rnd):
            raise ValueError(f"{self.cfg.name}: round {rnd.key}'s Δ cannot be kept in part")
        frag, st = self.fragments[rnd.fragment], self._state[rnd.fragment]
        before = st.theta
        st.theta, st.momentum = self._stepped(rnd)
        local = params.snapshot(frag.names)
        new, correction = self.rules.merge(st.theta, rnd.snapshot, local)
        if keep:
            new = _rebased(new, keep, st.theta, local, before)
        keep = self.rules.keeps_unsent
        kept = rnd.compressor.hand_over(keep) if keep and isinstance(rnd.compressor, ErrorFeedback) else None
        if kept is not None:  # the buffer's e is in Δ's sign (θ − local): the local model stands at −e from θ
            new = [n - k for n, k in zip(new, kept, strict=True)]
            if m := self.rules.sent_merge:
                # With α 1 the buffer was empty at the send, so what was sent put the peer alone at snapshot + e
                # (Δ = θ_before − snapshot, e = Δ − sent): keep m of that position's distance from the new θ.
                new = [n + m * (s + k - t) for n, s, k, t in zip(new, rnd.snapshot, kept, st.theta, strict=True)]
        params.apply_outer(frag.names, new)
        rnd.state = RoundState.APPLIED
        st.version = rnd.send_step
        return ApplyReport(rnd.fragment, rnd.seq, step - rnd.send_step, correction, rnd.members)

    def progress_kept(self, fragment: int) -> bool:
        """Whether the local fragment keeps the progress a round of it sent until the round is applied, with θ^(p)
        the swarm's and nothing carried from round to round by the compressor: a round's Δ can then be taken out
        of that progress later (:mod:`.unseen`), as an outvoted round's progress is kept (:meth:`finish_outvoted`).
        Not the rules that restart from θ^(p) each round or hold a θ of their own (eager), nor error feedback (its
        buffer takes an aborted round back)."""
        return (self.shared_theta and not self.restarts_each_round and not self.rules.eager
                and self._state[fragment].compressor.stateless)

    def can_keep(self, rnd: Round) -> bool:
        """Whether :meth:`finish` can keep this peer's progress where ``rnd``'s average left its Δ out: its Δ was
        sent element by element (an ``elementwise`` compressor), its θ was the round's (not divergent: a repaired
        θ is no base for progress), and its local model still holds what it sent (not the rules that restart
        from θ each round or hold a θ of their own, as for :meth:`finish_outvoted`)."""
        return (rnd.compressor.elementwise and not rnd.divergent and not self.rules.restarts_each_round
                and not self.rules.eager)

    @torch.no_grad()
    def finish_outvoted(self, rnd: Round, step: int, params: LocalParams, theta_before: Sequence[torch.Tensor],
                        local_before: Sequence[torch.Tensor]) -> ApplyReport:
        """Apply a round whose average does not hold this peer's Δ (its θ^(p) was outvoted and has just been
        replaced by the majority's): the outer step on θ^(p), and the local fragment keeps all of its progress
        since ``theta_before`` (θ^(p) before the replacement; ``local_before`` the local fragment then), rebased
        on the new θ^(p). That progress, the Δ this peer sent included, is in no average yet: it goes into the
        fragment's next round, as an aborted round's progress does. The caller has withdrawn the round from the
        compressor (:meth:`~p2ptrain.algo.compress.Compressor.withdraw`). Not for the rules that restart from
        θ^(p) each round or hold a θ of their own (eager): their local model no longer holds what they sent."""
        if self.rules.restarts_each_round or self.rules.eager:
            raise ValueError(f"{self.cfg.name}: its local model does not keep the progress it sent")
        frag, st = self.fragments[rnd.fragment], self._state[rnd.fragment]
        st.theta, st.momentum = self._stepped(rnd)
        params.apply_outer(frag.names, [t + (x - o) for t, x, o in zip(st.theta, local_before, theta_before,
                                                                         strict=True)])
        rnd.state = RoundState.APPLIED
        st.version = rnd.send_step
        return ApplyReport(rnd.fragment, rnd.seq, step - rnd.send_step, 0.0, rnd.members)

    # -- state ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Per-fragment θ, momentum, counters and compressor state (in-flight rounds are not kept:
        on resume their progress is still in θ − θ_i and enters the next round)."""
        return {
            "method": self.cfg.to_dict(),
            **(self.grid.state_dict() if self.grid is not None else {"sends_per_window": None, "sends_changes": []}),
            "fragments": [
                {"theta": st.theta, "momentum": st.momentum, "last_send": st.last_send, "seq": st.seq,
                 "own": st.own, "compressor": st.compressor.state_dict(), "version": st.version}
                for st in self._state
            ],
        }

    def shared_state(self) -> dict[str, Any]:
        """What a joining peer takes from a live one: θ, momentum, counters and the compressor's shared
        part (error feedback and eager's own Δ_i are per peer and left out)."""
        state = self.state_dict()
        for frag in state["fragments"]:
            frag["own"] = {}
            if "error" in frag["compressor"]:
                frag["compressor"] = {**frag["compressor"], "error": []}
        return state

    def round_state(self, fragment: int) -> dict[str, Any]:
        """A fragment's shared round state (its round counter and the compressor's shared part, e.g.
        low-rank ranks and warm-start bases): what a peer catching up on a round takes along with θ."""
        st = self._state[fragment]
        comp = st.compressor.state_dict()
        if "error" in comp:
            comp = {**comp, "error": []}
        return {"seq": st.seq, "compressor": comp, "version": st.version}

    def take_round_state(self, fragment: int, state: dict[str, Any]) -> None:
        """Take another peer's :meth:`round_state` of a fragment (ValueError if it does not fit). This
        peer's error feedback is kept where the layout and ranks still match; a round of this fragment
        still in flight here keeps the compressor it started with."""
        st = self._state[fragment]
        new = dict(state["compressor"])
        mine = st.compressor.state_dict()
        if mine.get("error") and mine.get("index") == new.get("index") and mine.get("rank") == new.get("rank"):
            new["error"] = mine["error"]
        comp = self.rules.compressor(self.fragments[fragment].index, self.seed)
        comp.load_state_dict(new)
        st.compressor, st.seq = comp, int(state["seq"])
        st.version = int(state.get("version", st.version))

    def keep_own(self, saved: dict[str, Any]) -> int:
        """After taking a shared state (:meth:`shared_state` of another peer), put back this peer's own
        per-fragment state from ``saved`` (its :meth:`state_dict` from before) where it still fits:
        eager's Δ_i when the fragment's round counter is unchanged, error feedback when the
        compressor's layout and ranks are. Returns the number of fragments that kept something."""
        kept = 0
        for st, old in zip(self._state, saved["fragments"], strict=True):
            took = False
            if old["own"] and int(old["seq"]) == st.seq:
                st.own = {int(k): v for k, v in old["own"].items()}
                took = True
            error = old["compressor"].get("error")
            if error:
                cur = st.compressor.state_dict()
                if cur.get("index") == old["compressor"].get("index") and cur.get("rank") == old["compressor"].get("rank"):
                    try:
                        st.compressor.load_state_dict({**cur, "error": error})
                        took = True
                    except ValueError:
                        pass
            kept += took
        return kept

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["method"]["method"] != self.cfg.name:
            raise ValueError(f"outer state is for method {state['method']['method']!r}, not {self.cfg.name!r}")
        frags = state["fragments"]
        if len(frags) != len(self.fragments):
            raise ValueError(f"outer state has {len(frags)} fragments, this run has {len(self.fragments)}")
        loaded = []  # built aside and swapped in whole: a refused state leaves the old one as it was
        for frag, s in zip(self.fragments, frags, strict=True):
            if [tuple(t.shape) for t in s["theta"]] != frag.shapes or len(s["momentum"]) != len(frag.shapes):
                raise ValueError(f"outer state of fragment {frag.index} does not match the model's shapes")
            comp = self.rules.compressor(frag.index, self.seed)
            comp.load_state_dict(s["compressor"])
            theta = [t.float().clone() for t in s["theta"]]
            own = {int(k): v for k, v in s["own"].items()}  # checkpoints store keys as text
            loaded.append(_FragmentState(theta, [m.float().clone() for m in s["momentum"]], comp,
                                         s["last_send"], int(s["seq"]), own, version=int(s.get("version", 0))))
        self._state = loaded
        if self.grid is not None:
            self.grid.load_state_dict(state)
