"""Multi-phase compressors for the outer all-reduce (pure math: torch and the stdlib only).

A compressor (:class:`Compressor`, :class:`Identity`, :class:`LowRank`) turns one peer's pseudo-gradients into
one or more all-reduce *phases*. Each phase's payload is a list of float32 tensors that the caller averages
across peers (through a wire codec, :mod:`p2ptrain.collective.codecs`) and hands back; the compressor then
produces the next phase or the final estimate of the peers' average pseudo-gradient.

Why it is long: :class:`LowRank` is one algorithm (a power-iteration step per round, error feedback, rank
adaptation, its checkpointed state) whose pieces share one round's scratch state; split up, each part would
need the others' internals.
"""

from __future__ import annotations

import hashlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

__all__ = ["Compressor", "Identity", "LowRank"]


def _match(averaged: list[torch.Tensor], shapes: list[torch.Size], devices: list[torch.device]) -> list[torch.Tensor]:
    """The averaged payload reshaped to ``shapes`` as float32 on ``devices``.

    The network layer may hand back flattened tensors, so only the element counts must match. ValueError when
    the number of tensors or any element count differs.
    """
    if len(averaged) != len(shapes):
        raise ValueError(f"expected {len(shapes)} averaged tensors, got {len(averaged)}")
    out = []
    for i, (t, shape, device) in enumerate(zip(averaged, shapes, devices, strict=True)):
        if t.numel() != math.prod(shape):
            raise ValueError(f"averaged tensor {i}: expected {math.prod(shape)} values, got {t.numel()}")
        out.append(t.detach().to(device=device, dtype=torch.float32).reshape(shape))
    return out


class Compressor(ABC):
    """Turns one peer's pseudo-gradient tensors into one or more all-reduce phases.

    ``stateless``: nothing carries from one round to the next, so every round may have its own instance
    (rounds of one fragment that overlap, e.g. two rounds of eager overlap, must not share one).

    Protocol for one round: ``payload = begin(tensors)``; then repeatedly average ``payload`` across peers and
    call ``payload = receive(averaged)`` until it returns None; then ``result()`` is the estimate of the peers'
    average pseudo-gradient. Every peer of a round must run the same compressor configuration and state, so that
    the phases line up. Calling ``begin`` again abandons an unfinished round (e.g. after a failed all-reduce)
    without keeping anything from it. ``receive`` outside a round and ``result`` before the round finished
    raise RuntimeError; an averaged list of the wrong length or element counts raises ValueError.
    """

    stateless = False
    #: One phase whose payload is the tensors' values, element by element (a part of the average is the average of
    #: those elements): a member whose share is missing from part of the average knows which of its values.
    elementwise = False
    #: ``begin`` is costly: a round defers it to :meth:`~p2ptrain.algo.rounds.Round.prepare`, run by whoever first
    #: needs the payload (a real peer's round runner, in a worker thread), not by the compute thread at the send
    deferred = False

    def expect_members(self, members: int) -> None:
        """The number of members the next round is expected to have (a compressor that mirrors the
        all-reduce's layout needs it); ignored by default."""
        return None

    @abstractmethod
    def begin(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Start a round; return the float32 tensors to all-reduce (average across peers) in phase 0."""

    @abstractmethod
    def receive(self, averaged: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Take the current phase's averaged payload; return the next phase's payload, or None when done."""

    @abstractmethod
    def result(self) -> list[torch.Tensor]:
        """The estimate of the peers' average, shaped like ``begin``'s input; valid once ``receive`` gave None."""

    @abstractmethod
    def abort(self) -> None:
        """Abandon an unfinished round (a failed all-reduce): nothing of it is kept."""

    def withdraw(self) -> bool:
        """The latest round arrived without this peer's own input in its average (its θ was outvoted): put back
        this peer's own state from before that round's :meth:`begin`, so that the progress it sent, kept in the
        local model, is sent again and counted once. True if that was done (a stateless compressor has nothing
        to put back); False if it cannot be (the caller must then drop that progress instead)."""
        return self.stateless

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint: tensors, ints, floats and lists only (an unfinished round is not included)."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()`` output (ValueError if it does not fit); abandons any unfinished round."""


class Identity(Compressor):
    """No compression: one phase whose payload is the tensors themselves (as float32 copies)."""

    stateless = True
    elementwise = True

    def __init__(self) -> None:
        self._shapes: list[torch.Size] | None = None
        self._devices: list[torch.device] = []
        self._result: list[torch.Tensor] | None = None

    def begin(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        self._shapes = [t.shape for t in tensors]
        self._devices = [t.device for t in tensors]
        self._result = None
        # Copies, so an all-reduce that works in place cannot touch the caller's tensors.
        return [t.detach().to(torch.float32, copy=True) for t in tensors]

    def receive(self, averaged: list[torch.Tensor]) -> list[torch.Tensor] | None:
        if self._shapes is None or self._result is not None:
            raise RuntimeError("receive() called without a round in progress")
        self._result = _match(averaged, self._shapes, self._devices)
        return None

    def result(self) -> list[torch.Tensor]:
        if self._result is None:
            raise RuntimeError("result() called before the round finished")
        return list(self._result)

    def abort(self) -> None:
        self._shapes, self._result = None, None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Identity keeps no state between rounds; this only abandons an unfinished round."""
        self._shapes, self._result = None, None


def _generator(seed: int, *parts: int) -> torch.Generator:
    """A CPU generator seeded from ``seed`` and ``parts``, identical on every peer and every run.

    Hashing (rather than ``hash()`` or arithmetic) keeps nearby seeds and indices statistically independent.
    """
    digest = hashlib.blake2b(":".join(str(p) for p in (seed, *parts)).encode(), digest_size=8).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest, "little") >> 1)


def _unit_columns(q: torch.Tensor) -> torch.Tensor:
    """``q`` (n x r) with every column scaled to unit length (a zero column stays zero)."""
    norms = q.norm(dim=0, keepdim=True)
    return q / torch.where(norms > 0, norms, torch.ones_like(norms))


@dataclass
class _Slot:
    """Per-matrix state of :class:`LowRank`. ``q`` is shared by all peers; ``error`` is this peer's own."""

    rows: int  # m
    cols: int  # n
    cap: int  # largest rank allowed: rank_max, and r*(m+n) < m*n so the factors stay smaller than the matrix
    rank: int  # current r
    q: torch.Tensor  # (n, r) f32, unit columns
    error: torch.Tensor | None  # (m, n) f32 error-feedback buffer, None until first needed or when disabled


@dataclass
class _Round:
    """Scratch state of the round in progress; dropped as a whole if the round is abandoned."""

    phase: int  # 0: waiting for the averaged P (or full tensors); 1: waiting for the averaged Q
    m: dict[int, torch.Tensor]  # slot index -> M_i = pseudo-gradient + error buffer, (m, n) f32, until phase 1
    p_hat: dict[int, torch.Tensor]  # slot index -> orthonormal basis of the averaged P, (m, r) f32
    new_error: dict[int, torch.Tensor]  # slot index -> M_i - P_hat Q_i^T, (m, n) f32, from phase 1 on
    devices: list[torch.device]  # device of each input tensor: results go back there
    results: list[torch.Tensor | None]
    proposals: dict[int, float] = field(default_factory=dict)  # slot index -> the peers' mean proposed rank


class LowRank(Compressor):
    """Rank-r factorisation of each matrix with error feedback and adaptive rank: two all-reduce phases.

    One step of subspace (power) iteration per round, as in PowerSGD (arXiv 1905.13727); DiLoCoX (arXiv
    2506.21263) compresses pseudo-gradients this way, with quantisation and error feedback. For each matrix
    M_i (m x n: this peer's pseudo-gradient plus its error buffer e_i; tensors with more than two dims are
    viewed as ``shape[0] x rest``):

    * phase 0 sends P_i = M_i Q (m x r). Q (n x r) is the same on every peer: first drawn from a generator seeded
      with ``seed`` and the tensor's index, afterwards warm-started from the previous round. The averaged P is
      orthonormalised (reduced QR) into P_hat, identical on every peer because the averaged P is;
    * phase 1 sends Q_i = M_i^T P_hat (n x r); with the averaged Q_bar the result is P_hat Q_bar^T, which is
      P_hat P_hat^T M_bar, the projection of the true average M_bar onto span(P_hat);
    * error feedback keeps what this peer did not transmit: e_i <- M_i - P_hat Q~_i^T, with Q~_i what the wire
      delivers of Q_i (``wire``: the codec's round trip), so the quantisation error is fed back too;
    * warm start: the next Q spans the same space as Q_bar (so the next P_hat would be the same), stored as its
      left singular vectors ordered by singular value; directions with (numerically) zero singular value are
      redrawn from a generator seeded with ``seed``, the index and the round, so the rank does not collapse;
    * adaptive rank, from each peer's *full* update: every peer proposes k_i + 1, with k_i the smallest rank
      whose leading singular values hold ``energy`` of ||M_i||^2 (estimated with a randomized range finder of
      cap + 8 columns, drawn the same on every peer; the cap when even that is not enough), one spare
      direction above it. The proposals ride along in phase 0 as one more small tensor, so the average is the
      same on every peer; the next round's rank is that average rounded, within rank_min and the cap (rank_max,
      and the largest rank that still saves bytes). The rank can so grow or shrink by any amount in one
      round. (A decision from the averaged, already projected update cannot see the energy outside the current
      r directions, and so could not grow.)

    Cost per round and matrix: r*m values in phase 0 plus r*n in phase 1, i.e. r(m+n) instead of m*n (and one value
    per matrix for the rank proposal); the proposal costs each peer one m x n x (cap + 8) product. Tensors
    with fewer than two dims, or where the initial rank gives r(m+n) >= m*n, are sent in full in phase 0; if no
    tensor is factorised the round has a single phase.

    Shared state (Q and the ranks) must be the same on all peers of a round: a joining peer loads it from
    ``state_dict()`` of a current member (its own error buffers may start empty). QR and SVD run in float64 on
    the CPU so that identical averaged inputs give identical P_hat, Q and ranks; peers on different hardware or
    math libraries may still differ in the last bits of P_hat (so of the result), and a rank decision sitting
    exactly on the ``energy`` threshold could then differ, which would break the next round's shapes.

    Accuracy: a matrix of rank <= r is recovered to float32 round-off, but one power-iteration step with
    r == rank(M) finds range(M) only to within (perturbation / smallest singular value of M Q), so shrinking
    the rank all the way to k leaves no oversampling margin.

    Failures: ValueError from the constructor for inconsistent settings, from ``begin`` when the tensor shapes
    differ from the first round's, and from ``receive``/``load_state_dict`` for mismatching data.
    """

    # A singular value at or below this fraction of the largest is treated as a collapsed direction: float32
    # round-off leaves about 1e-7 relative noise in directions the matrix does not have.
    _DEAD: ClassVar[float] = 1e-5

    def __init__(
        self,
        rank: int = 4,
        rank_min: int = 1,
        rank_max: int = 32,
        energy: float = 0.9,
        error_feedback: bool = True,
        seed: int = 0,
        wire: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        if not 1 <= rank_min <= rank <= rank_max:
            raise ValueError(f"need 1 <= rank_min <= rank <= rank_max, got {rank_min}, {rank}, {rank_max}")
        if not 0.0 < energy <= 1.0:
            raise ValueError(f"energy must be in (0, 1], got {energy}")
        self.rank, self.rank_min, self.rank_max = rank, rank_min, rank_max
        self.energy, self.error_feedback, self.seed = float(energy), bool(error_feedback), int(seed)
        self.wire = wire  # what a receiver sees of a payload tensor (the wire codec's round trip); None: exact
        self._shapes: list[torch.Size] | None = None
        self._slots: dict[int, _Slot] = {}
        self._rounds = 0  # completed rounds: salts the redrawn directions
        self._round: _Round | None = None
        self._done: list[torch.Tensor] | None = None

    # -- layout ------------------------------------------------------------------------------------------------

    def _layout(self, shapes: list[torch.Size]) -> dict[int, tuple[int, int, int]]:
        """Index -> (m, n, cap) of the tensors to factorise, decided by the shapes and the initial rank only."""
        out = {}
        for i, shape in enumerate(shapes):
            if len(shape) < 2:
                continue
            m, n = shape[0], math.prod(shape[1:])
            if self.rank * (m + n) >= m * n:  # no saving (also covers empty tensors)
                continue
            out[i] = (m, n, min(self.rank_max, (m * n - 1) // (m + n)))
        return out

    def _setup(self, shapes: list[torch.Size]) -> None:
        self._shapes = list(shapes)
        self._slots = {}
        for i, (m, n, cap) in self._layout(self._shapes).items():
            q = torch.randn(n, self.rank, generator=_generator(self.seed, i), dtype=torch.float32)
            self._slots[i] = _Slot(rows=m, cols=n, cap=cap, rank=self.rank, q=_unit_columns(q), error=None)

    def ranks(self) -> list[int]:
        """Current rank per input tensor, 0 for tensors sent in full; empty before the first round."""
        if self._shapes is None:
            return []
        return [self._slots[i].rank if i in self._slots else 0 for i in range(len(self._shapes))]

    # -- protocol ------------------------------------------------------------------------------------------

    def begin(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Phase 0: P_i = M_i Q for each factorised tensor, the tensor itself (a float32 copy) for the others.

        Without error feedback M_i may be a view of the caller's tensor: leave the inputs unchanged until the
        round ends. ValueError if the shapes differ from the first round's.
        """
        shapes = [t.shape for t in tensors]
        if self._shapes is None:
            self._setup(shapes)
        elif shapes != self._shapes:
            raise ValueError("tensor shapes differ from the first round's")
        self._done = None
        devices = [t.device for t in tensors]
        state = _Round(phase=0, m={}, p_hat={}, new_error={}, devices=devices, results=[None] * len(tensors))
        payload = []
        for i, t in enumerate(tensors):
            g = t.detach().to(torch.float32)
            slot = self._slots.get(i)
            if slot is None:
                payload.append(g.clone())  # sent in full; a copy so an in-place all-reduce cannot alias it
                continue
            m = g.reshape(slot.rows, slot.cols)  # (m, n) f32, may alias the caller's tensor
            if self.error_feedback:
                # A tensor of our own: phase 0 turns it into the new error buffer in place.
                m = m + slot.error.to(m.device) if slot.error is not None else m.clone()
            state.m[i] = m
            payload.append(m @ slot.q.to(m.device))  # P_i: (m, r)
        if self._slots:  # this peer's rank proposal per factorised matrix, from its full update
            payload.append(torch.tensor([float(self._propose(i, self._slots[i], state.m[i])) for i in sorted(self._slots)],
                                        dtype=torch.float32))
        self._round = state
        return payload

    def _propose(self, index: int, slot: _Slot, m: torch.Tensor) -> int:
        """k + 1 (capped), with k the smallest rank whose leading singular values of ``m`` (this peer's full
        update, m x n) hold ``energy`` of its squared norm; a randomized range finder of cap + 8 columns,
        drawn the same on every peer, estimates the singular values (slightly low, so k slightly high)."""
        total = float(m.double().pow(2).sum())
        if total <= 0:
            return self.rank_min
        width = min(slot.cap + 8, slot.rows, slot.cols)
        omega = torch.randn(slot.cols, width, generator=_generator(self.seed, index, self._rounds, 7),
                            dtype=torch.float32).to(m.device)
        basis = torch.linalg.qr((m @ omega).to("cpu", torch.float64), mode="reduced").Q  # (m, width)
        sigma = torch.linalg.svdvals(basis.T @ m.to("cpu", torch.float64))  # (width,) strongest first
        held = (sigma.square().cumsum(0) < self.energy * total).sum()
        k = int(held) + 1 if int(held) < sigma.numel() else slot.cap  # the energy needs more than we looked at
        return min(slot.cap, k + 1)

    def receive(self, averaged: list[torch.Tensor]) -> list[torch.Tensor] | None:
        state = self._round
        if state is None or self._shapes is None:
            raise RuntimeError("receive() called without a round in progress")
        return self._phase0(state, averaged) if state.phase == 0 else self._phase1(state, averaged)

    def _phase0(self, state: _Round, averaged: list[torch.Tensor]) -> list[torch.Tensor] | None:
        assert self._shapes is not None
        shapes = []
        for i, shape in enumerate(self._shapes):
            slot = self._slots.get(i)
            shapes.append(torch.Size((slot.rows, slot.rank)) if slot is not None else shape)
        if self._slots:
            shapes.append(torch.Size((len(self._slots),)))
        avg = _match(averaged, shapes, [*state.devices, torch.device("cpu")][: len(shapes)])
        if self._slots:
            props = avg.pop()
            state.proposals = {i: float(p) for i, p in zip(sorted(self._slots), props.tolist(), strict=True)}
        payload = []
        for i, a in enumerate(avg):
            if i not in self._slots:
                state.results[i] = a
                continue
            m = state.m[i]
            # Reduced QR of the averaged P in float64 on the CPU: the same input gives the same basis on every
            # peer, and float64 keeps the basis orthonormal even when P is badly conditioned. (m, r) f32.
            p_hat = torch.linalg.qr(a.to("cpu", torch.float64), mode="reduced").Q.to(m.device, torch.float32)
            q_own = m.T @ p_hat  # Q_i: (n, r)
            state.p_hat[i] = p_hat
            if self.error_feedback:
                # e_i = M_i - P_hat Q~_i^T, the part of M_i this peer does not transmit (Q~_i: what the wire
                # delivers of Q_i, so quantisation is counted too), computed in M_i's own buffer (M_i is not
                # needed any more): one m x n buffer per matrix during the round, not two.
                sent = q_own if self.wire is None else self.wire(q_own).to(q_own.device, torch.float32)
                state.new_error[i] = m.addmm_(p_hat, sent.T, alpha=-1.0)
                del state.m[i]
            payload.append(q_own)
        if not self._slots:
            self._finish(state)
            return None
        state.phase = 1
        return payload

    def _phase1(self, state: _Round, averaged: list[torch.Tensor]) -> None:
        order = sorted(self._slots)
        shapes = [torch.Size((self._slots[i].cols, self._slots[i].rank)) for i in order]
        avg = _match(averaged, shapes, [state.devices[i] for i in order])
        for i, q_bar in zip(order, avg, strict=True):
            state.results[i] = state.p_hat[i] @ q_bar.T  # (m, n) = P_hat P_hat^T M_bar
        # Commit only now, so an abandoned round leaves the error buffers, Q and the ranks untouched.
        for i, q_bar in zip(order, avg, strict=True):
            slot = self._slots[i]
            if self.error_feedback:
                slot.error = state.new_error[i]
            self._adapt(i, slot, q_bar, state.proposals.get(i))
        self._finish(state)

    def _finish(self, state: _Round) -> None:
        assert self._shapes is not None
        done = []
        for r, shape in zip(state.results, self._shapes, strict=True):
            assert r is not None  # every tensor got its result in phase 0 (full) or phase 1 (factorised)
            done.append(r.reshape(shape))
        self._done = done
        self._round = None
        self._rounds += 1

    def _adapt(self, index: int, slot: _Slot, q_bar: torch.Tensor, proposal: float | None) -> None:
        """The next rank (the peers' mean proposal, rounded, within rank_min and the cap) and Q warm-started from
        the averaged Q_bar (n x r); identical on every peer."""
        u, s, _ = torch.linalg.svd(q_bar.to("cpu", torch.float64), full_matrices=False)  # u (n, r), s (r,)
        r = slot.rank
        total = float(s.square().sum())
        new_rank = r if proposal is None else int(min(slot.cap, max(self.rank_min, math.floor(proposal + 0.5))))
        keep = min(r, new_rank)
        alive = s[:keep] > self._DEAD * float(s[0]) if total > 0 else torch.zeros(keep, dtype=torch.bool)
        q = u[:, :keep]  # (n, keep) f64, orthonormal, strongest direction first
        if keep < new_rank or not bool(alive.all()):
            # Redraws for collapsed directions and new columns, from a generator every peer seeds the same way.
            gen = _generator(self.seed, index, self._rounds + 1)
            fresh = _unit_columns(torch.randn(slot.cols, new_rank, generator=gen, dtype=torch.float64))
            q = torch.cat([torch.where(alive.unsqueeze(0), q, fresh[:, :keep]), fresh[:, keep:]], dim=1)
        slot.q = q.to(torch.float32)
        slot.rank = new_rank

    def result(self) -> list[torch.Tensor]:
        if self._done is None:
            raise RuntimeError("result() called before the round finished")
        return list(self._done)

    def abort(self) -> None:
        self._round = None

    # -- state ---------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state: ``shapes`` (the layout, [] before the first round), ``rounds``, and per
        factorised tensor (in ``index`` order) its ``rank`` and ``q`` (shared by all peers) and ``error`` (this
        peer's own; [] when error feedback is off). Tensors are CPU copies."""
        order = sorted(self._slots)
        errors: list[torch.Tensor] = []
        if self.error_feedback:
            for i in order:
                slot = self._slots[i]
                e = slot.error if slot.error is not None else torch.zeros(slot.rows, slot.cols)
                errors.append(e.detach().to("cpu", copy=True))
        return {
            "shapes": [list(s) for s in self._shapes] if self._shapes is not None else [],
            "rounds": self._rounds,
            "index": order,
            "rank": [self._slots[i].rank for i in order],
            "q": [self._slots[i].q.detach().to("cpu", copy=True) for i in order],
            "error": errors,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            shapes = [torch.Size(int(d) for d in s) for s in state["shapes"]]
            rounds, index, ranks = int(state["rounds"]), [int(i) for i in state["index"]], list(state["rank"])
            qs, errors = list(state["q"]), list(state["error"])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a LowRank state: {exc}") from None
        self._round, self._done = None, None
        if not shapes:
            self._shapes, self._slots, self._rounds = None, {}, rounds
            return
        layout = self._layout(shapes)
        if sorted(layout) != index or len(ranks) != len(index) or len(qs) != len(index):
            raise ValueError("state was saved with a different layout (shapes or initial rank differ)")
        if self.error_feedback and errors and len(errors) != len(index):
            raise ValueError("state has the wrong number of error buffers")
        slots = {}
        for j, i in enumerate(index):
            m, n, cap = layout[i]
            r = int(ranks[j])
            if not 1 <= r <= cap or tuple(qs[j].shape) != (n, r):
                raise ValueError(f"tensor {i}: rank {r} or Q shape {tuple(qs[j].shape)} does not fit a {m}x{n} matrix")
            error = None
            if self.error_feedback and errors:
                if tuple(errors[j].shape) != (m, n):
                    raise ValueError(f"tensor {i}: error buffer shape {tuple(errors[j].shape)} is not {(m, n)}")
                error = errors[j].detach().to(torch.float32, copy=True)
            q = qs[j].detach().to("cpu", torch.float32, copy=True)
            slots[i] = _Slot(rows=m, cols=n, cap=cap, rank=r, q=q, error=error)
        self._shapes, self._slots, self._rounds = shapes, slots, rounds
