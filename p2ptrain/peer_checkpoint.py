"""A swarm peer's checkpoints: everything needed to continue where it stopped.

One safetensors file per checkpoint (atomic: temp file, fsync, rename; the last K kept)
holding the trainer (model, inner AdamW, schedule step, data position), the full outer
state (per-fragment θ and momentum, counters, this peer's own method state: eager's
Δ_i, error feedback), the peer's counters and the torch RNG. A peer writes one every
``every`` applied rounds (data parallel: every ``every`` steps), every ``seconds`` of training, and
when it leaves.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import torch

from .checkpoint import CheckpointDir, NonFiniteState, Snapshot, pack, tensor_bytes
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
    """Checkpoints of one peer in ``root``: every ``every`` applied rounds, and every ``seconds`` of training
    (None: rounds only) so that a peer killed while its rounds fail loses at most that much; the last
    ``keep`` kept. ``faults`` (default: what the environment asks for, see :mod:`p2ptrain.faults`) can kill
    a write half-way.

    The state is copied at a step boundary (its outer part under the peer's lock, see :meth:`copy`) and
    written by a thread of this object's own (``background``): serialising, checksumming and writing a
    1B-parameter peer's ~16 GB takes tens of seconds that its training goes on through; the copy is a
    memcpy. One write at a time: a checkpoint due while the last is still being written waits for the next
    step. :meth:`close` waits for the write in progress."""

    def __init__(self, root: str | Path, every: int = 10, keep: int = 3, faults: FaultPlan | None = None,
                 seconds: float | None = None) -> None:
        if every < 1:
            raise ValueError("checkpoint_every must be at least 1")
        if seconds is not None and not seconds > 0:
            raise ValueError("checkpoint_seconds must be positive (or None: by rounds only)")
        self.faults = FaultPlan.from_env() if faults is None else faults
        self.dir, self.every, self.seconds = CheckpointDir(root, keep, self.faults), every, seconds
        self.dir.remove_temporaries()  # left by a write that was killed half-way
        self.last_saved: float | None = None
        self._since = 0
        self._copied = time.monotonic()  # when the last checkpoint's state was taken (or we started)
        self._writer: ThreadPoolExecutor | None = None
        self._writing: Future[Path | None] | None = None

    @classmethod
    def state(cls, peer: Checkpointable) -> dict[str, Any]:
        """The peer's state, by reference (its tensors are the peer's own: copy before they move on)."""
        with peer.lock:
            return cls._state(peer)

    @staticmethod
    def _state(peer: Checkpointable, trainer: bool = True) -> dict[str, Any]:
        """:meth:`state`, the lock held by the caller (``trainer`` False: without the trainer's part)."""
        stats = peer.runner.stats if peer.runner is not None else None
        own = peer.checkpoint_state()
        return {
            "kind": KIND,
            "run_id": peer.cfg.run_id,
            "method": peer.method.name,
            **({"trainer": peer.trainer.state_dict()} if trainer else {}),
            "outer": own["outer"],
            "peer": {"applied": own["applied"], "repairs": peer.repairs, "tokens_at_send": own["tokens_at_send"],
                     "bequests": own.get("bequests", []), "unseen": own.get("unseen", {}),
                     "rounds": {k: int(getattr(stats, k)) if stats else 0 for k in COUNTERS}},
            "rng": torch.get_rng_state(),
            "saved_at": time.time(),
        }

    def copy(self, peer: Checkpointable) -> Snapshot:
        """The peer's state, copied now, by the training thread between two steps. The outer state (θ, momentum,
        the bequests held: the event loop's state service and a leaver's bequest take the peer's lock) and the
        counters are copied under that lock; the trainer's (model and AdamW, most of the bytes: ~12 GB for 1B
        parameters), which only this thread changes, after it, so that the event loop is not held for that copy."""
        tensors: dict[str, torch.Tensor] = {}
        with peer.lock:
            tree, _ = pack(self._state(peer, trainer=False), tensors)
        trainer, _ = pack(peer.trainer.state_dict(), tensors)
        return Snapshot({"__dict__": [*tree["__dict__"], ["trainer", trainer]]}, tensors)

    def save(self, peer: Checkpointable, why: str, background: bool = False) -> Path | None:
        """Write a checkpoint of the state as it is now; None (an error logged, the older checkpoints kept) if
        the state is not finite: a diverged peer must not rotate its good checkpoints out. ``background``:
        return once the state is copied (None), the write left to this object's thread; otherwise the write in
        progress, if any, is waited for first, and this one is written before returning."""
        if not background:
            self.wait()
        step = peer.trainer.step_count
        state = self.copy(peer)
        self._copied, self._since = time.monotonic(), 0
        self.faults.checkpoint_begins()
        if not background:
            return self._write(peer, step, state, why)
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._writing = self._writer.submit(self._write, peer, step, state, why)
        return None

    def _write(self, peer: Checkpointable, step: int, state: Snapshot, why: str) -> Path | None:
        t0 = time.perf_counter()
        try:
            path = self.dir.save(step, state)
        except NonFiniteState as e:
            log.error("event=checkpoint_refused why=%s step=%d reason=%s", why, step, e)
            return None
        self.last_saved = time.time()
        log.info("event=checkpoint why=%s step=%d path=%s seconds=%.2f", why, step, path, time.perf_counter() - t0)
        if peer.metrics is not None:
            peer.metrics.checkpoint_time.set(self.last_saved)
        return path

    def count(self) -> None:
        """Count an applied round (or a data-parallel step)."""
        self._since += 1

    def due(self) -> str | None:
        """Why a checkpoint is due now (``rounds`` or ``time``), or None."""
        if self._since >= self.every:
            return "rounds"
        if self.seconds is not None and time.monotonic() - self._copied >= self.seconds:
            return "time"
        return None

    def save_if_due(self, peer: Checkpointable) -> None:
        """Start a checkpoint in the background when one is due (``every`` rounds counted, or ``seconds``
        passed) and the last one is written. A write that failed is raised here, at the next call."""
        if self._writing is not None:
            if not self._writing.done():
                return
            writing, self._writing = self._writing, None
            writing.result()  # a disk that fails stops the peer, as a write in the training thread did
        if (why := self.due()) is not None:
            self.save(peer, why, background=True)

    def wait(self) -> None:
        """Wait for the write in progress, if any (its error raised)."""
        if self._writing is not None:
            writing, self._writing = self._writing, None
            writing.result()

    def close(self) -> None:
        """Wait for the write in progress and stop the writer's thread (idempotent)."""
        try:
            self.wait()
        finally:
            if self._writer is not None:
                self._writer.shutdown(wait=True)
                self._writer = None

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
