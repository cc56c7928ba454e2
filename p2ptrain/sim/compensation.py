"""The compensation instrument: how close each merge rule puts the local fragment to where it should be.

When fragment p's average arrives τ' inner steps after its send (snapshot ``s``), the peer has moved on to
``x`` (its overlap progress ``g = s − x``) and the outer step gives ``θ̃``. A merge rule says what the local
fragment becomes. The **ideal** is what the peer would hold had the overlap started from θ̃: the instrument
saves the peer's whole trainer (parameters, AdamW state, data position) at every send, and at the apply it
replays those τ' inner steps in a scratch trainer from that state with fragment p set to θ̃ — the same
batches, the same optimizer state, the same writes to the other fragments at the same steps — and reads
fragment p. Every candidate rule is then measured against it (none of them changes the run, which goes on
with the method's own rule):

* ``distance``: ‖rule − ideal‖ / ‖θ̃ − ideal‖ (so ``take`` θ̃ is 1; lower is better);
* ``cosine``: of the rule's correction to the delta rule (rule − (θ̃ − g)) with the delta rule's true error
  (ideal − (θ̃ − g)); the delta rule itself has none.

Candidates (``D = θ̃ − s``; ``n`` the inner steps of the overlap, ``lr`` the inner learning rate, ``v̂`` AdamW's
bias-corrected second moment of the fragment's parameters):

=====================  ===========================================================================
``take``               θ̃
``alpha``              α·x + (1−α)·θ̃ (Streaming DiLoCo, α = 0.5)
``delta``              θ̃ − g (keep the overlap's progress, rebased on θ̃)
``taylor-normalized``  θ̃ − g − λ·g⊙g⊙D with λ = λ0·‖g‖/‖g⊙g⊙D‖ (the rule once coded; λ0 = 0.2)
``taylor-constant``    θ̃ − g − λ·g⊙g⊙D (DC-ASGD's term with g the overlap's progress)
``taylor-adam``        θ̃ − g − λ·n·lr·√v̂⊙D (the Fisher diagonal v̂ as the Hessian, as DC-ASGD's g⊙g
                       estimates it, through AdamW's preconditioner: a step from θ̃ moves by
                       lr·H·D/√v̂ ≈ lr·√v̂·D more than from s)
``shrink``             θ̃ − β·g (keep part of the overlap's progress)
``pullback``           θ̃ − g − k·D (the delta rule, with part of the outer step held back locally)
=====================  ===========================================================================
"""

from __future__ import annotations

import copy
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..algo.delay import taylor_compensate
from ..algo.fragments import make_fragments, model_units
from ..algo.outer_loop import OuterLoop
from ..algo.rounds import Round
from ..driver import DriverHooks
from ..trainer import Trainer, lr_at

__all__ = ["CANDIDATES", "CompensationProbe", "Context", "Probe", "Recorder", "probe_run", "summarize"]


@dataclass
class Context:
    """What a merge rule may look at, for one fragment's apply."""

    theta: list[torch.Tensor]  # θ̃
    snapshot: list[torch.Tensor]  # s
    local: list[torch.Tensor]  # x, now
    steps: int  # n, inner steps since the send
    lr: float  # the inner learning rate now
    v_hat: list[torch.Tensor]  # AdamW's bias-corrected second moment of these parameters (zeros if none yet)


Rule = Callable[[Context], list[torch.Tensor]]


def _taylor_adam(lam: float) -> Rule:
    def rule(c: Context) -> list[torch.Tensor]:
        return [t - (s - x) - lam * c.steps * c.lr * v.sqrt() * (t - s)
                for t, s, x, v in zip(c.theta, c.snapshot, c.local, c.v_hat, strict=True)]
    return rule


def _taylor_constant(lam: float) -> Rule:
    def rule(c: Context) -> list[torch.Tensor]:
        return taylor_compensate(c.theta, c.snapshot, c.local, lam)[0]
    return rule


def _taylor_normalized(c: Context, lambda0: float) -> list[torch.Tensor]:
    """The rule once coded: λ = λ0·‖g‖/‖g⊙g⊙D‖ per tensor, so every correction is λ0·‖g‖ long."""
    out = []
    for t, s, x in zip(c.theta, c.snapshot, c.local, strict=True):
        g = s - x
        u = g * g * (t - s)
        out.append(t - g - lambda0 * float(g.norm()) / (float(u.norm()) + 1e-12) * u)
    return out


def _shrink(beta: float) -> Rule:
    def rule(c: Context) -> list[torch.Tensor]:
        return [t - beta * (s - x) for t, s, x in zip(c.theta, c.snapshot, c.local, strict=True)]
    return rule


def _pullback(k: float) -> Rule:
    def rule(c: Context) -> list[torch.Tensor]:
        return [t - (s - x) - k * (t - s) for t, s, x in zip(c.theta, c.snapshot, c.local, strict=True)]
    return rule


#: Every candidate the instrument measures, by name.
CANDIDATES: dict[str, Rule] = {
    "take": lambda c: list(c.theta),
    "alpha": lambda c: [0.5 * x + 0.5 * t for t, x in zip(c.theta, c.local, strict=True)],
    "delta": lambda c: [t - (s - x) for t, s, x in zip(c.theta, c.snapshot, c.local, strict=True)],
    "taylor-normalized": lambda c: _taylor_normalized(c, 0.2),
    **{f"taylor-constant-{lam:g}": _taylor_constant(lam) for lam in (1e2, 1e3, 1e4)},
    **{f"taylor-adam-{lam:g}": _taylor_adam(lam) for lam in (1.0, 10.0, 100.0, 1000.0)},
    **{f"shrink-{b:g}": _shrink(b) for b in (0.9, 0.8)},
    **{f"pullback-{k:g}": _pullback(k) for k in (0.05, 0.1, 0.2)},
}


class Recorder:
    """A peer's model as the outer loop sees it, logging every write to it (step, names, values) so that a
    replay can make the same writes at the same steps."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.writes: list[tuple[int, list[str], list[torch.Tensor]]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.trainer, name)

    def snapshot(self, names: Sequence[str]) -> list[torch.Tensor]:
        return self.trainer.snapshot(names)

    def apply_outer(self, names: Sequence[str], values: Sequence[torch.Tensor]) -> None:
        self.writes.append((self.trainer.step_count, list(names), [v.detach().clone() for v in values]))
        self.trainer.apply_outer(names, values)


def _adam_v_hat(trainer: Trainer, names: Sequence[str]) -> list[torch.Tensor]:
    beta2 = trainer.cfg.betas[1]
    out = []
    for n in names:
        st = trainer.optimizer.state.get(trainer.params[n], {})
        if "exp_avg_sq" not in st:
            out.append(torch.zeros_like(trainer.params[n], dtype=torch.float32))
            continue
        step = float(st["step"])
        out.append((st["exp_avg_sq"].float() / (1.0 - beta2**step)).cpu())
    return out


def _norm(ts: Sequence[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in ts))


def _dot(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    return sum(float((x.double() * y.double()).sum()) for x, y in zip(a, b, strict=True))


@dataclass
class Probe:
    """One apply, measured."""

    fragment: int
    steps: int
    distance: dict[str, float] = field(default_factory=dict)
    cosine: dict[str, float] = field(default_factory=dict)
    progress_norm: float = 0.0  # ‖g‖
    delay_norm: float = 0.0  # ‖D‖


class CompensationProbe(DriverHooks):
    """Driver hooks of one virtual peer that measure every candidate rule at each of its applies (see the
    module docstring). ``peer`` is the peer's :class:`Recorder`; ``scratch`` a trainer of the same model
    and data rank (its state is overwritten at every replay)."""

    def __init__(self, peer: Recorder, scratch: Trainer, outer: OuterLoop,
                 candidates: dict[str, Rule] | None = None) -> None:
        self.peer, self.scratch, self.outer = peer, scratch, outer
        self.candidates = candidates or CANDIDATES
        self.saved: dict[str, tuple[int, dict[str, Any]]] = {}
        self.probes: list[Probe] = []

    def after_send(self, rnd: Round) -> None:
        tr = self.peer.trainer
        self.saved[rnd.key] = (tr.step_count, copy.deepcopy(tr.state_dict()))

    def before_apply(self, rnd: Round) -> None:
        sent = self.saved.pop(rnd.key, None)
        if sent is None:
            return
        start, state = sent
        tr, names = self.peer.trainer, self.outer.fragments[rnd.fragment].names
        if tr.step_count == start:
            return  # applied at its send step (the end of a run): no overlap to compensate
        theta = self.outer.preview(rnd)
        local = tr.snapshot(names)
        ideal = self._replay(start, state, names, theta)
        ctx = Context(theta, rnd.snapshot, local, tr.step_count - start, lr_at(max(0, tr.step_count - 1), tr.cfg),
                      _adam_v_hat(tr, names))
        delta = self.candidates["delta"](ctx) if "delta" in self.candidates else CANDIDATES["delta"](ctx)
        err = [i - d for i, d in zip(ideal, delta, strict=True)]
        base = _norm([t - i for t, i in zip(theta, ideal, strict=True)]) or 1.0
        p = Probe(rnd.fragment, ctx.steps, progress_norm=_norm([s - x for s, x in zip(rnd.snapshot, local,
                                                                                         strict=True)]),
                  delay_norm=_norm([t - s for t, s in zip(theta, rnd.snapshot, strict=True)]))
        for name, rule in self.candidates.items():
            x = rule(ctx)
            p.distance[name] = _norm([a - i for a, i in zip(x, ideal, strict=True)]) / base
            corr = [a - d for a, d in zip(x, delta, strict=True)]
            cn, en = _norm(corr), _norm(err)
            if cn > 0 and en > 0:
                p.cosine[name] = _dot(corr, err) / (cn * en)
        self.probes.append(p)

    def _replay(self, start: int, state: dict[str, Any], names: Sequence[str],
                theta: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The fragment ``names`` had the overlap since step ``start`` begun from ``theta``."""
        sc, end = self.scratch, self.peer.trainer.step_count
        sc.load_state_dict(copy.deepcopy(state))
        sc.apply_outer(names, theta)
        mine = set(names)
        writes = [w for w in self.peer.writes if start <= w[0] < end]
        for step in range(start, end):
            for at, ns, vs in writes:  # the other fragments' merges, at the steps they happened
                if at == step and not mine & set(ns):
                    sc.apply_outer(ns, vs)
            sc.step()
        for at, ns, vs in writes:
            if at == end and not mine & set(ns):
                sc.apply_outer(ns, vs)
        return sc.snapshot(names)


def summarize(probes: Sequence[Probe]) -> dict[str, dict[str, float]]:
    """Per candidate: the median and quartiles of the distance over all applies, and the median cosine."""
    out: dict[str, dict[str, float]] = {}
    if not probes:
        return out
    for name in probes[0].distance:
        d = sorted(p.distance[name] for p in probes)
        cos = [p.cosine[name] for p in probes if name in p.cosine]
        q = statistics.quantiles(d, n=4) if len(d) > 1 else [d[0]] * 3
        out[name] = {"distance_median": statistics.median(d), "distance_q1": q[0], "distance_q3": q[2],
                     "cosine_median": statistics.median(cos) if cos else math.nan, "applies": len(d)}
    return out


def probe_run(sim: Any, model_cfg: Any, trainer_cfg: Any, data_cfg: Any, corpus: Any, method: Any,
              candidates: dict[str, Rule] | None = None) -> tuple[Any, list[Probe]]:
    """Run ``method`` in the simulator (``sim``: a SimConfig) with peer 0 probed at every apply; the run's
    result and the probes."""
    from ..trainer import make_trainer
    from .network import Network, Region
    from .runner import OuterRun, RunResult

    m = sim.num_peers
    trainers = [make_trainer(model_cfg, trainer_cfg, data_cfg, rank=i, world=m, corpus=corpus) for i in range(m)]
    scratch = make_trainer(model_cfg, trainer_cfg, data_cfg, rank=0, world=m, corpus=corpus)
    peer0 = Recorder(trainers[0])
    frags = make_fragments(model_units(trainers[0].model), method.fragments, method.fragment_mode)
    net = Network(sim.region_list() if sim.regions else [Region("local", m, sim.region_list()[0].bandwidth)],
                  rtt=sim.rtt, intra_latency=sim.intra_latency)
    res = RunResult(method.name, method.name, m, method.to_dict())
    run = OuterRun(sim, method, [peer0, *trainers[1:]], net, res, None, frags)
    probe = CompensationProbe(peer0, scratch, run.outers[0], candidates)
    run.drivers[0].hooks = probe
    run.run()
    return res, probe.probes
