"""Experiment logging (``--log-to``): a run's curves, step by step, in TensorBoard or Weights & Biases.

``tensorboard:DIR`` writes TensorBoard event files under DIR (optional extra ``[tensorboard]``: the
``tensorboard`` package, written through ``torch.utils.tensorboard``); ``wandb`` or ``wandb:PROJECT`` logs
to Weights & Biases (extra ``[wandb]``; ``WANDB_MODE=offline`` logs to local files, with no network and no
account, for ``wandb sync`` later). The scalars, per inner step (only those a command has):

    loss/train, loss/validation                  nats per token (validation: of θ, when it is evaluated)
    throughput/tokens_per_second, throughput/compute_utilization
    network/sent_bytes, network/received_bytes   payload bytes so far; network/bandwidth_bytes_per_second
    rounds/complete, rounds/partial, rounds/failed   outer rounds so far, by outcome
    swarm/live_peers, swarm/rounds_in_flight

A swarm peer's come from its Prometheus registry (``metrics.PeerMetrics``), so the curves and the metrics
endpoint never disagree. Targets are parsed and their packages looked for before anything starts
(:func:`parse_targets`); a sink that cannot be opened fails the command before training.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

__all__ = ["EXTRAS", "ExperimentLog", "LogTarget", "open_log", "parse_targets", "peer_scalars"]

#: The optional extra that installs each kind's package, and that package's module.
EXTRAS = {"tensorboard": ('pip install -e ".[tensorboard]"', "tensorboard"),
          "wandb": ('pip install -e ".[wandb]"', "wandb")}

#: Prometheus sample -> scalar name (summed over labels); rounds are split by their ``outcome`` label.
_FROM_METRICS = {
    "p2ptrain_train_loss": "loss/train",
    "p2ptrain_tokens_per_second": "throughput/tokens_per_second",
    "p2ptrain_compute_utilization_ratio": "throughput/compute_utilization",
    "p2ptrain_sent_bytes_total": "network/sent_bytes",
    "p2ptrain_received_bytes_total": "network/received_bytes",
    "p2ptrain_bandwidth_bytes_per_second": "network/bandwidth_bytes_per_second",
    "p2ptrain_live_peers": "swarm/live_peers",
    "p2ptrain_rounds_in_flight": "swarm/rounds_in_flight",
}
OUTCOMES = ("complete", "partial", "failed")


@dataclass(frozen=True)
class LogTarget:
    """Where to log: ``kind`` tensorboard (``where``: the folder) or wandb (``where``: the project, or None)."""

    kind: str
    where: str | None


def parse_targets(specs: Iterable[str] | None) -> tuple[LogTarget, ...]:
    """``--log-to`` values (``tensorboard:DIR``, ``wandb``, ``wandb:PROJECT``; each may hold several separated
    by spaces or commas) as targets. ValueError naming the value: an unknown kind, a missing folder, or the
    package not installed (with the extra that installs it)."""
    out = []
    for spec in (s for value in specs or () for s in value.replace(",", " ").split()):
        kind, _, where = spec.partition(":")
        if kind not in EXTRAS:
            raise ValueError(f"--log-to {spec}: unknown target {kind!r}; give tensorboard:DIR, wandb or wandb:PROJECT")
        if kind == "tensorboard" and not where:
            raise ValueError(f"--log-to {spec}: give the folder of the event files, like tensorboard:runs/tb")
        extra, module = EXTRAS[kind]
        if importlib.util.find_spec(module) is None:
            raise ValueError(f"--log-to {kind} needs the {module} package, an optional extra: {extra}")
        out.append(LogTarget(kind, where or None))
    return tuple(out)


class Sink(Protocol):
    def log(self, step: int, values: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class _TensorBoard:
    """Event files in ``folder`` (torch's SummaryWriter: it needs the ``tensorboard`` package)."""

    def __init__(self, folder: Path, config: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(folder))
        self.writer.add_text("config", "  \n".join(f"{k}: {v}" for k, v in config.items()), 0)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.close()


class _WandB:
    """A Weights & Biases run (``WANDB_MODE=offline``: local files only)."""

    def __init__(self, project: str | None, name: str, group: str | None, config: Mapping[str, Any]) -> None:
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=project or "p2ptrain", name=name, group=group, config=dict(config))
        self.last = -1

    def log(self, step: int, values: Mapping[str, float]) -> None:
        # W&B keeps a step's values once it moved past it: a late value (an evaluation said after its step)
        # goes to the current step instead of being dropped.
        self.last = max(self.last, step)
        self.run.log(dict(values), step=self.last)

    def close(self) -> None:
        self.run.finish()


class ExperimentLog:
    """Every sink of a run; ``log`` writes a step's scalars to each. Closed once, by the command."""

    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = sinks

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for sink in self.sinks:
            sink.log(step, values)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def open_log(targets: Iterable[LogTarget], *, name: str, group: str | None = None, subdir: str | None = None,
             config: Mapping[str, Any] | None = None) -> ExperimentLog:
    """Open every target: TensorBoard under ``where`` (``where/subdir`` when given: one run per peer), W&B as
    run ``name`` in ``group``. ValueError naming the target when one cannot be opened (those opened before it
    are closed)."""
    sinks: list[Sink] = []
    try:
        for t in targets:
            try:
                if t.kind == "tensorboard":
                    assert t.where is not None
                    folder = Path(t.where) / subdir if subdir else Path(t.where)
                    sinks.append(_TensorBoard(folder, config or {}))
                else:
                    sinks.append(_WandB(t.where, name, group, config or {}))
            except Exception as e:  # an account, a network or a folder problem: said in one line
                raise ValueError(f"--log-to {t.kind}: cannot open it ({' '.join(str(e).split()) or type(e).__name__})"
                                 + ("; WANDB_MODE=offline logs locally without an account" if t.kind == "wandb"
                                    else "")) from None
    except ValueError:
        ExperimentLog(sinks).close()
        raise
    return ExperimentLog(sinks)


def peer_scalars(registry: Any) -> dict[str, float]:
    """A swarm peer's scalars now, read from its Prometheus ``registry`` (counters summed over labels; rounds
    and bytes 0 before the first round: a labelled counter has no sample until then)."""
    out = {f"rounds/{o}": 0.0 for o in OUTCOMES} | {"network/sent_bytes": 0.0, "network/received_bytes": 0.0}
    for family in registry.collect():
        for s in family.samples:
            if s.name == "p2ptrain_outer_rounds_total" and s.labels.get("outcome") in OUTCOMES:
                key = f"rounds/{s.labels['outcome']}"
            elif s.name in _FROM_METRICS:
                key = _FROM_METRICS[s.name]
            else:
                continue
            out[key] = out.get(key, 0.0) + float(s.value)
    return out
