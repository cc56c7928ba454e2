"""Analytic compute utilization (CU) versus WAN bandwidth, without training.

Backs ``p2ptrain simulate --utilization-table``: for each method, the bandwidth needed to keep
the accelerators busy a given fraction of the time, in the setting of Table 4 of *Streaming
DiLoCo with overlapping communication* (arXiv 2501.18512, appendix "Compute utilization"), printed
next to that table's own figures (:data:`PAPER_TABLE4`).

The model
=========

Time is counted per *window*: the inner steps of compute between two consecutive syncs of the
method, ``W = n_w · t_step``. A round syncs the ``L`` layers (``N/L`` parameters each) as follows:

* ``ddp``: gradients of the whole model after every step (``n_w = 1``);
* ``diloco``: outer gradients of the whole model every ``H`` steps (``n_w = H``);
* ``streaming``: ``P = ⌈L / layers_per_fragment⌉`` strided fragments (fragment p holds layers
  p+1, p+1+P, ...), one every ``H/P`` steps (``n_w = H/P``), so each is synced every ``H`` steps;
* ``streaming-overlap``: as ``streaming``, a fragment being due only ``τ`` inner steps later;
* ``streaming-fp4``: as ``streaming-overlap`` with a 4-bit (E3M0) wire;
* ``eager``: the whole model every ``H`` steps, its all-reduce running through the whole next
  round (``τ = H`` steps of overlap; arXiv 2502.12996);
* ``cocodc``: an alias of ``streaming-fp4``. CoCoDC sends a fragment every ``H/P`` steps at the
  least, with ``τ`` steps of overlap and the e3m0 wire p2ptrain gives it by default; the extra
  sends of its adaptive transmission only fill bandwidth left idle, so the bandwidth it needs for
  a CU target is that of ``streaming-fp4``.

Bits per layer and sync (ring all-reduce over ``M`` peers: each sends ``2(M−1)/M`` payloads)::

    b_layer = N/L · bytes_per_param · 8 · 2(M−1)/M          (M = None: M → ∞, factor 2)

and on a link of ``b`` bits/s a layer's chunk takes ``c = b_layer / b`` seconds. Like the paper's
simulator, whose DAG has one node per layer for the forward pass, the backward pass and the
(outer) gradient reduction, a sync is a chain of per-layer chunks. With times relative to the end
of the backward pass of the step that produces the sync, backward lasting ``β·t_step`` (``β = 2/3``
from the 6N-FLOPs-per-token rule: 2N forward, 4N backward; the paper does not give the cost of
its nodes) and forward the rest:

* layer ℓ's chunk is ready at ``−(ℓ−1)/L · β·t_step`` (backward runs from layer L down to 1);
* the chunks leave one at a time in that order (``latency`` once, before the first);
* layer ℓ is due when the forward pass ``τ`` steps later reaches it:
  ``τ·t_step + (ℓ−1)/L · (1−β)·t_step`` (``τ = 0`` for the blocking methods);
* a late layer delays all that follows, so the sync's stall is its largest lateness, ``s``.

A whole-model sync is thus gated by layer 1, ready last and due first:
``s = max(c, L·c − (1 − 1/L)·β·t_step)`` when ``τ = 0``. A strided fragment whose lowest layer is
deep in the network has that much forward pass as slack. ``E`` is ``s`` averaged over the syncs of
a round, and the link's busy time per window (``latency`` + the ``k`` chunks of one sync, ``k``
its layers) bounds the period from below when transfers of consecutive windows would overlap
(``eager``, a large ``τ``)::

    period = max(W + E, latency + k·c)          CU(b) = W / period

``CU`` is non-decreasing in ``b``; :func:`required_bandwidth` bisects it. A blocking method never
reaches CU = 1 (``s ≥ c > 0``); an overlapped one does at a finite bandwidth when ``latency`` is
small enough.

Assumptions taken from arXiv 2501.18512
=======================================

* Wire precision: bf16 (2 bytes per parameter) for Data-Parallel gradients and for outer
  gradients. The paper never names the simulator's dtype, but its figures fix it: the
  "overlapped FP4 com." row needs ~4× less bandwidth than the "overlapped com." row (16 → 4 bits),
  and Table 1 has FP4 Streaming DiLoCo at H = 100 "exchanging in total 400× fewer bits" than
  Data-Parallel (100 steps × 16/4 bits).
* 4-bit wire: "a float with 4 bits (1 sign bit, 3 exponent bits, and 0 mantissa bit) called
  E3M0", i.e. 0.5 byte per parameter; the paper mentions no block scales and neither do we.
* Peers: "We use 2 DiLoCo replicas", so ``M = 2`` and the ring factor ``2(M−1)/M`` is 1.
* Overlap with the backward pass: "The simulation is a DAG with four different types of nodes
  [...] forward [...], backward w.r.t activations and parameters [...], (outer or not, for resp.
  DiLoCo and Data-Parallel) gradients reduction [...]. Each node represent a single layer." —
  the per-layer chunking above; and, for the next step's forward pass, "the strided pattern will
  never have multiple early layers to be synchronize together. Therefore, it is easier to overlap
  their communication with the first few layers' forward of the next step" — the per-layer due
  times above.
* τ: "In our main experiments, we used 1 step for simplicity" (and Table 1: "allow communication
  to be as long as a full compute step").
* Setting: "For all DiLoCo and Streaming DiLoCo-variants, we use H = 100. For all Streaming
  DiLoCo-variants, we use a fragment size of 3 layers." and step times "0.1s, 0.8s, and 4.9s
  based on each model scale flops profile, a reasonable amount of chips, and a MFU of 60%".
* Latency: the paper states none; ours defaults to 0.

Where we differ: the paper says "a fragment is synchronized every 11, 5, and 2 steps" for
8, 16 and 36 fragments; we use the exact ``H/P`` (12.5, 6.25, 2.78), which keeps every fragment
synced every ``H`` steps. The paper's figures are points of a logarithmic bandwidth sweep
(they fall on 50 points from 0.1 to 1000 Gbit/s, 20.7% apart — our reading, not stated), so
they are coarse to about ±20%.

Why it is long: the model is derived here, step by step, next to the code that computes it (most of the
length is that derivation), so that a reader can check one against the other.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "BACKWARD_FRACTION",
    "CU_TARGETS",
    "METHODS",
    "METHOD_ALIASES",
    "PAPER_METHODS",
    "PAPER_SETTINGS",
    "PAPER_TABLE4",
    "PaperSetting",
    "SyncPlan",
    "TableRow",
    "format_utilization_table",
    "paper_figure",
    "required_bandwidth",
    "sync_plan",
    "utilization",
    "utilization_table",
]

#: Fraction of an inner step spent in the backward pass (6N FLOPs per token: 2N forward, 4N backward).
BACKWARD_FRACTION: float = 2.0 / 3.0

#: The compute-utilization targets of Table 4.
CU_TARGETS: tuple[float, ...] = (0.5, 0.8, 0.9, 0.95, 0.99)

#: Methods this model knows, named as p2ptrain names them (``cocodc`` is an alias, see below).
METHODS: tuple[str, ...] = ("ddp", "diloco", "streaming", "streaming-overlap", "streaming-fp4", "eager", "cocodc")

#: Methods that are computed as another one (see the module docstring).
METHOD_ALIASES: dict[str, str] = {"cocodc": "streaming-fp4"}

#: The rows of Table 4, in its order, as p2ptrain methods.
PAPER_METHODS: tuple[str, ...] = ("ddp", "diloco", "streaming", "streaming-overlap", "streaming-fp4")

_BF16 = 2.0
_E3M0 = 0.5


@dataclass(frozen=True)
class PaperSetting:
    """One model scale of Table 4 (arXiv 2501.18512): parameters, layers, pure-compute step time (s)."""

    params: float
    layers: int
    step_time: float


#: Table 4's three scales: "1B / 24 layers / 0.1s", "10B / 48 / 0.8s", "100B / 108 / 4.9s".
PAPER_SETTINGS: dict[str, PaperSetting] = {
    "1B": PaperSetting(params=1e9, layers=24, step_time=0.1),
    "10B": PaperSetting(params=10e9, layers=48, step_time=0.8),
    "100B": PaperSetting(params=100e9, layers=108, step_time=4.9),
}


def _row(*gbps: float) -> dict[float, float | None]:
    return dict(zip(CU_TARGETS, gbps, strict=True))


# Table 4 of arXiv 2501.18512 (appendix, "Simulation"): "Gbit/s to reach a compute utilization
# CU = ?" for 50/80/90/95/99%, with H = 100 and fragments of 3 layers. Rows, as the paper names
# them: Data-Parallel (ddp), Vanilla DiLoCo (diloco), Streaming DiLoCo (streaming), Streaming
# DiLoCo w/ overlapped com. (streaming-overlap), Streaming DiLoCo w/ overlapped FP4 com.
# (streaming-fp4). The table has no eager row: (model, "eager") maps every target to None.
PAPER_TABLE4: dict[tuple[str, str], dict[float, float | None]] = {
    ("1B", "ddp"): _row(86.8, 152.6, 184.2, 222.3, 569.0),
    ("1B", "diloco"): _row(1.4, 6.2, 13.3, 23.3, 86.8),
    ("1B", "streaming"): _row(1.4, 5.2, 9.1, 16.0, 28.1),
    ("1B", "streaming-overlap"): _row(1.4, 4.3, 6.2, 9.1, 11.0),
    ("1B", "streaming-fp4"): _row(0.4, 0.9, 1.7, 2.0, 3.0),
    ("10B", "ddp"): _row(104.8, 222.3, 222.3, 268.3, 471.5),
    ("10B", "diloco"): _row(1.7, 7.5, 16.0, 33.9, 104.8),
    ("10B", "streaming"): _row(1.7, 5.2, 9.1, 13.3, 19.3),
    ("10B", "streaming-overlap"): _row(1.7, 3.6, 5.2, 6.2, 7.5),
    ("10B", "streaming-fp4"): _row(0.4, 0.9, 1.4, 1.4, 1.7),
    ("100B", "ddp"): _row(184.2, 323.8, 390.7, 390.7, 471.5),
    ("100B", "diloco"): _row(3.0, 11.0, 23.3, 49.4, 184.2),
    ("100B", "streaming"): _row(2.4, 6.2, 9.1, 11.0, 19.3),
    ("100B", "streaming-overlap"): _row(1.7, 3.6, 4.3, 5.2, 5.2),
    ("100B", "streaming-fp4"): _row(0.5, 0.9, 1.1, 1.1, 1.4),
    **{(model, "eager"): dict.fromkeys(CU_TARGETS) for model in PAPER_SETTINGS},
}


def paper_figure(model: str, method: str, cu: float) -> float | None:
    """Table 4's Gbit/s for ``model`` ("1B", "10B", "100B"), ``method`` and target ``cu``, or None."""
    return PAPER_TABLE4.get((model, method), {}).get(cu)


# --------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class SyncPlan:
    """How one method syncs, reduced to what the timing needs.

    Attributes:
        layers: transformer layers ``L`` (numbered 1..L from the input; the backward pass
            produces layer L's gradients first and layer 1's last).
        window_steps: inner steps of compute between two consecutive syncs (``n_w``).
        syncs: the layers of each sync of one round, in turn (one tuple for a whole-model sync;
            the strided fragments ``{p+1, p+1+P, ...}`` for streaming).
        overlap_steps: inner steps after its sync started at which a result is due (``τ``).
        layer_params: parameters per layer (``N / L``).
        bytes_per_param: wire bytes per parameter.
        ring_factor: ``2(M−1)/M``: how many payloads each peer sends in a ring all-reduce.
    """

    layers: int
    window_steps: float
    syncs: tuple[tuple[int, ...], ...]
    overlap_steps: float
    layer_params: float
    bytes_per_param: float
    ring_factor: float

    @property
    def layer_bits(self) -> float:
        """Bits one peer sends for one layer's share of a sync."""
        return self.layer_params * self.bytes_per_param * 8.0 * self.ring_factor

    @property
    def bits(self) -> float:
        """Bits one peer sends per sync, averaged over the syncs of a round."""
        return self.layer_bits * sum(len(s) for s in self.syncs) / len(self.syncs)


def _ring_factor(workers: int | None) -> float:
    if workers is None:
        return 2.0
    if workers < 2:
        raise ValueError(f"workers must be at least 2 (or None for M → ∞), got {workers}")
    return 2.0 * (workers - 1) / workers


def sync_plan(method: str, *, params: float, layers: int, H: int = 100, layers_per_fragment: int = 3,
              tau: float | None = None, workers: int | None = 2, bytes_per_param: float | None = None) -> SyncPlan:
    """The :class:`SyncPlan` of ``method`` (see the module docstring for each method's shape).

    ``tau`` defaults to 1 inner step for the overlapped streaming methods (the paper's main
    setting) and to ``H`` for ``eager``; it is ignored by the blocking methods. ``bytes_per_param``
    defaults to 2 (bf16), 0.5 (E3M0) for ``streaming-fp4``/``cocodc``.
    """
    name = METHOD_ALIASES.get(method, method)
    if name not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if params <= 0 or layers < 1 or H < 1 or layers_per_fragment < 1:
        raise ValueError("params, layers, H and layers_per_fragment must be positive")
    if tau is not None and tau < 0:
        raise ValueError(f"tau must be >= 0, got {tau}")
    if bytes_per_param is not None and bytes_per_param <= 0:
        raise ValueError(f"bytes_per_param must be positive, got {bytes_per_param}")
    ring = _ring_factor(workers)
    wire = bytes_per_param if bytes_per_param is not None else (_E3M0 if name == "streaming-fp4" else _BF16)
    whole = (tuple(range(1, layers + 1)),)
    per_layer = params / layers
    if name == "ddp":
        return SyncPlan(layers, 1.0, whole, 0.0, per_layer, wire, ring)
    if name == "diloco":
        return SyncPlan(layers, float(H), whole, 0.0, per_layer, wire, ring)
    if name == "eager":
        return SyncPlan(layers, float(H), whole, float(H if tau is None else tau), per_layer, wire, ring)
    fragments = math.ceil(layers / layers_per_fragment)
    strided = tuple(tuple(range(p + 1, layers + 1, fragments)) for p in range(fragments))
    overlap = 0.0 if name == "streaming" else float(1 if tau is None else tau)
    return SyncPlan(layers, H / fragments, strided, overlap, per_layer, wire, ring)


def _stall(plan: SyncPlan, sync: tuple[int, ...], chunk: float, *, step_time: float, latency: float,
           backward: float) -> float:
    """Seconds the compute waits for one sync whose per-layer chunks take ``chunk`` seconds each.

    Times are relative to the end of the backward pass of the step that produced the sync. Layer
    ℓ's chunk is ready at ``−(ℓ−1)/L · backward``; the chunks leave in that order, one at a time
    (``latency`` once, before the first); layer ℓ is due when the forward pass ``τ`` steps later
    reaches it: ``τ·t_step + (ℓ−1)/L · forward``. A late layer delays all that follows it, so the
    stall is the largest lateness.
    """
    L = plan.layers
    forward = step_time - backward
    free = -math.inf
    late = 0.0
    for n, layer in enumerate(sorted(sync, reverse=True)):
        ready = -(layer - 1) / L * backward
        free = max(free, ready + (latency if n == 0 else 0.0)) + chunk
        due = plan.overlap_steps * step_time + (layer - 1) / L * forward
        late = max(late, free - due)
    return late


def _timing(plan: SyncPlan, chunk: float, *, step_time: float, latency: float,
            backward_overlap: float) -> tuple[float, float, float]:
    """(window, mean stall, link busy time per window), in seconds, for ``chunk`` seconds per layer."""
    window = plan.window_steps * step_time
    backward = backward_overlap * step_time
    stalls = [_stall(plan, s, chunk, step_time=step_time, latency=latency, backward=backward) for s in plan.syncs]
    busy = latency + chunk * sum(len(s) for s in plan.syncs) / len(plan.syncs)
    return window, sum(stalls) / len(stalls), busy


def _cu_of_chunk(plan: SyncPlan, chunk: float, *, step_time: float, latency: float, backward_overlap: float) -> float:
    """CU when one layer's share of a sync takes ``chunk`` seconds on the link."""
    window, stall, busy = _timing(plan, chunk, step_time=step_time, latency=latency,
                                  backward_overlap=backward_overlap)
    return window / max(window + stall, busy)


def _check_timing(step_time: float, latency: float, backward_overlap: float) -> None:
    if step_time <= 0:
        raise ValueError(f"step_time must be positive, got {step_time}")
    if latency < 0:
        raise ValueError(f"latency must be >= 0, got {latency}")
    if not 0 <= backward_overlap < 1:
        raise ValueError(f"backward_overlap must be in [0, 1), got {backward_overlap}")


def utilization(method: str, bandwidth_bps: float, *, params: float, layers: int, step_time: float, H: int = 100,
                layers_per_fragment: int = 3, tau: float | None = None, workers: int | None = 2,
                bytes_per_param: float | None = None, latency: float = 0.0,
                backward_overlap: float = BACKWARD_FRACTION) -> float:
    """Compute utilization in [0, 1] of ``method`` on a link of ``bandwidth_bps`` bits/s.

    Args:
        method: one of :data:`METHODS`.
        bandwidth_bps: link bandwidth per peer, bits per second (``math.inf`` allowed).
        params: model parameters ``N``.
        layers: transformer layers ``L``.
        step_time: seconds of pure compute (forward + backward) per inner step.
        H: inner steps per round.
        layers_per_fragment: layers per streaming fragment.
        tau: overlap in inner steps (default: 1 for overlapped streaming, ``H`` for eager).
        workers: peers ``M`` of the ring all-reduce (None: M → ∞).
        bytes_per_param: wire bytes per parameter (default 2, or 0.5 for the 4-bit methods).
        latency: fixed seconds per sync, on top of serialization.
        backward_overlap: fraction of a step that is backward pass, over which a sync's
            per-layer chunks become ready (0: the whole sync is ready at the end of the step).
    """
    _check_timing(step_time, latency, backward_overlap)
    if math.isnan(bandwidth_bps) or bandwidth_bps < 0:
        raise ValueError(f"bandwidth must be >= 0, got {bandwidth_bps}")
    plan = sync_plan(method, params=params, layers=layers, H=H, layers_per_fragment=layers_per_fragment, tau=tau,
                     workers=workers, bytes_per_param=bytes_per_param)
    if bandwidth_bps == 0:
        return 0.0
    return _cu_of_chunk(plan, plan.layer_bits / bandwidth_bps, step_time=step_time, latency=latency,
                        backward_overlap=backward_overlap)


def required_bandwidth(method: str, *, params: float, layers: int, step_time: float, cu: float, H: int = 100,
                       layers_per_fragment: int = 3, tau: float | None = None, workers: int | None = 2,
                       bytes_per_param: float | None = None, latency: float = 0.0,
                       backward_overlap: float = BACKWARD_FRACTION) -> float:
    """The least bandwidth (bits/s) at which ``method`` reaches compute utilization ``cu``.

    Bisects the per-layer transfer time, on which CU is non-increasing, to a relative precision
    of 1e-12. Returns 0.0 when any bandwidth will do (``cu <= 0``) and ``math.inf`` when no finite
    bandwidth will (``cu > 1``; ``cu = 1`` for a blocking method; a latency that alone keeps CU
    below ``cu``). Other arguments as in :func:`utilization`.
    """
    _check_timing(step_time, latency, backward_overlap)
    if math.isnan(cu):
        raise ValueError("cu must be a number")
    plan = sync_plan(method, params=params, layers=layers, H=H, layers_per_fragment=layers_per_fragment, tau=tau,
                     workers=workers, bytes_per_param=bytes_per_param)
    if cu <= 0:
        return 0.0
    if cu > 1:
        return math.inf

    def meets(chunk: float) -> bool:  # window / max(window + stall, busy) >= cu, exact at cu = 1
        window, stall, busy = _timing(plan, chunk, step_time=step_time, latency=latency,
                                      backward_overlap=backward_overlap)
        return stall <= window * (1.0 / cu - 1.0) and busy <= window / cu

    if not meets(0.0):
        return math.inf
    hi = plan.window_steps * step_time + 1.0
    while meets(hi):  # CU → 0 as the transfer grows, so this ends
        hi *= 2.0
    lo = 0.0
    for _ in range(400):  # lo meets the target, hi does not
        if hi - lo <= 1e-12 * hi:
            break
        mid = 0.5 * (lo + hi)
        if meets(mid):
            lo = mid
        else:
            hi = mid
    if lo == 0.0:
        return math.inf  # met only by an instantaneous transfer
    return plan.layer_bits / lo


# --------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class TableRow:
    """One cell of the utilization table: our bandwidth for a (model, method, CU) next to the paper's.

    Attributes:
        model: "1B", "10B" or "100B".
        method: a p2ptrain method name.
        cu: the compute-utilization target.
        ours_gbps: our required bandwidth, Gbit/s (``math.inf`` if unreachable).
        paper_gbps: Table 4's figure, Gbit/s, or None where the table has none.
        ratio: ``ours_gbps / paper_gbps``, or None without a paper figure.
    """

    model: str
    method: str
    cu: float
    ours_gbps: float
    paper_gbps: float | None
    ratio: float | None


def utilization_table(*, methods: Sequence[str] = (*PAPER_METHODS, "eager"), targets: Iterable[float] = CU_TARGETS,
                      settings: dict[str, PaperSetting] | None = None, H: int = 100, layers_per_fragment: int = 3,
                      tau: float | None = None, workers: int | None = 2, latency: float = 0.0,
                      backward_overlap: float = BACKWARD_FRACTION) -> list[TableRow]:
    """Rows (model × method × target, in that order) of our bandwidths next to Table 4's.

    ``settings`` defaults to :data:`PAPER_SETTINGS`; each method uses its default wire precision.
    """
    targets = tuple(targets)
    rows: list[TableRow] = []
    for model, s in (PAPER_SETTINGS if settings is None else settings).items():
        for method in methods:
            for cu in targets:
                ours = required_bandwidth(method, params=s.params, layers=s.layers, step_time=s.step_time, cu=cu, H=H,
                                          layers_per_fragment=layers_per_fragment, tau=tau, workers=workers,
                                          latency=latency, backward_overlap=backward_overlap) / 1e9
                paper = paper_figure(model, method, cu)
                ratio = ours / paper if paper else None
                rows.append(TableRow(model, method, cu, ours, paper, ratio))
    return rows


def _fmt(x: float | None, spec: str) -> str:
    if x is None:
        return "—"
    if math.isinf(x):
        return "∞"
    return format(x, spec)


def format_utilization_table(rows: Sequence[TableRow]) -> str:
    """Plain-text table: one line per (model, method), ``ours / paper (ratio)`` per CU target."""
    targets: list[float] = []
    for r in rows:
        if r.cu not in targets:
            targets.append(r.cu)
    cells: dict[tuple[str, str], dict[float, TableRow]] = {}
    for r in rows:
        cells.setdefault((r.model, r.method), {})[r.cu] = r
    head = ["model", "method", *(f"CU {c:.0%}" for c in targets)]
    body = []
    for (model, method), by_cu in cells.items():
        line = [model, method]
        for c in targets:
            r = by_cu.get(c)
            if r is None:
                line.append("")
                continue
            ratio = "" if r.ratio is None else f" ({r.ratio:.2f}×)"
            line.append(f"{_fmt(r.ours_gbps, '.2f')} / {_fmt(r.paper_gbps, 'g')}{ratio}")
        body.append(line)
    widths = [max(len(str(x[i])) for x in (head, *body)) for i in range(len(head))]
    out = ["  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True)).rstrip() for line in (head, *body)]
    out.insert(1, "  ".join("-" * w for w in widths))
    out.append("Gbit/s: ours / Table 4 of arXiv 2501.18512 (ours ÷ paper); — where the paper has no figure.")
    return "\n".join(out)
