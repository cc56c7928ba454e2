"""A swarm peer's checkpoints: everything needed to continue where it stopped.

One safetensors file per checkpoint (atomic: temp file, fsync, rename; the last K kept)
holding the trainer (model, inner AdamW, schedule step, data position), the full outer
state (per-fragment θ and momentum, counters, this peer's own method state: eager's
Δ_i, error feedback), the peer's counters and the torch RNG. A peer writes one every
``every`` applied rounds (data parallel: every ``every`` steps) and when it leaves.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any, Protocol

import torch

from .checkpoint import CheckpointDir, NonFiniteState, pack, tensor_bytes
from .faults import FaultPlan

__all__ = ["Checkpointable", "PeerCheckpoints", "resumable_digest", "state_digest"]

log = logging.getLogger(__name__)

KIND = "p2ptrain-peer"
COUNTERS = ("complete", "partial", "failed", "divergent", "bytes_sent", "bytes_received")


class Checkpointable(Protocol):
    """What a checkpoint takes from a peer and gives back (``p2ptrain.peer.PeerBase`` has it)."""

    cfg: Any
    method: Any
    trainer: Any
    lock: Any
    metrics: Any
    runner: Any
    has_outer_loop: bool

    @property
    def repairs(self) -> int: ...

    def checkpoint_state(self) -> dict[str, Any]: ...

    def restore(self, state: dict[str, Any]) -> None: ...


def state_digest(state: Any) -> str:
    """SHA-256 over a state tree: its structure, scalars, and every tensor's dtype, shape and bytes."""
    tree, tensors = pack(state)
    h = hashlib.sha256(json.dumps(tree, sort_keys=True).encode())
    for name in sorted(tensors, key=lambda n: int(n[1:])):
        t = tensors[name]
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(tensor_bytes(t))
    return h.hexdigest()


def resumable_digest(trainer: dict[str, Any], outer: dict[str, Any] | None) -> str:
    """Digest of what a resume must restore exactly: the trainer's state (model, AdamW, data position,
    counters; not its config, which flags may change) and the outer state."""
    return state_digest({"trainer": {k: v for k, v in trainer.items() if k != "trainer_config"}, "outer": outer})


class PeerCheckpoints:
    """Checkpoints of one peer in ``root`` (``every`` rounds between them, the last ``keep`` kept); ``faults``
    (default: what the environment asks for, see :mod:`p2ptrain.faults`) can kill a write half-way."""

    def __init__(self, root: str | Path, every: int = 10, keep: int = 3, faults: FaultPlan | None = None) -> None:
        if every < 1:
            raise ValueError("checkpoint_every must be at least 1")
        self.faults = FaultPlan.from_env() if faults is None else faults
        self.dir, self.every = CheckpointDir(root, keep, self.faults), every
        self.dir.remove_temporaries()  # left by a write that was killed half-way
        self.last_saved: float | None = None
        self._since = 0

    @staticmethod
    def state(peer: Checkpointable) -> dict[str, Any]:
        stats = peer.runner.stats if peer.runner is not None else None
        with peer.lock:
            own = peer.checkpoint_state()
            return {
                "kind": KIND,
                "run_id": peer.cfg.run_id,
                "method": peer.method.name,
                "trainer": peer.trainer.state_dict(),
                "outer": own["outer"],
                "peer": {"applied": own["applied"], "repairs": peer.repairs, "tokens_at_send": own["tokens_at_send"],
                         "bequests": own.get("bequests", []),
                         "rounds": {k: int(getattr(stats, k)) if stats else 0 for k in COUNTERS}},
                "rng": torch.get_rng_state(),
                "saved_at": time.time(),
            }

    def save(self, peer: Checkpointable, why: str) -> Path | None:
        """Write a checkpoint now; None (an error logged, the older checkpoints kept) if the state is not
        finite: a diverged peer must not rotate its good checkpoints out."""
        state = self.state(peer)
        self.faults.checkpoint_begins()
        try:
            path = self.dir.save(peer.trainer.step_count, state)
        except NonFiniteState as e:
            self._since = 0  # try again after `every` more rounds, not at every step
            log.error("event=checkpoint_refused why=%s step=%d reason=%s", why, peer.trainer.step_count, e)
            return None
        self.last_saved, self._since = time.time(), 0
        log.info("event=checkpoint why=%s step=%d path=%s", why, peer.trainer.step_count, path)
        if peer.metrics is not None:
            peer.metrics.checkpoint_time.set(self.last_saved)
        return path

    def count(self) -> None:
        """Count an applied round (or a data-parallel step)."""
        self._since += 1

    def save_if_due(self, peer: Checkpointable) -> None:
        """Save when ``every`` rounds were counted since the last checkpoint."""
        if self._since >= self.every:
            self.save(peer, "rounds")

    def latest(self) -> tuple[Path, dict[str, Any]] | None:
        """The newest readable checkpoint (CheckpointError if there are files but none reads back)."""
        return self.dir.latest()

    @staticmethod
    def restore(peer: Checkpointable, state: dict[str, Any]) -> None:
        """Put a checkpoint's state into a peer that has not started yet (the outer state is taken
        when the peer starts, after which the swarm's newer θ may replace the shared part)."""
        if state.get("kind") != KIND:
            raise ValueError("not a checkpoint of a swarm peer (a `p2ptrain train` checkpoint?)")
        if state["method"] != peer.method.name:
            raise ValueError(f"checkpoint is of method {state['method']!r}, this peer runs {peer.method.name!r}")
        if state["run_id"] != peer.cfg.run_id:
            log.warning("event=resume_other_run saved=%s now=%s", state["run_id"], peer.cfg.run_id)
        if (state["outer"] is None) == peer.has_outer_loop:
            raise ValueError("checkpoint and peer disagree on whether the method has an outer loop")
        peer.restore(state)
        torch.set_rng_state(state["rng"])
