"""A peer's checkpoints by time as well as by rounds, written by a thread of their own: the state is the one
of the step the checkpoint was due at (copied then, not when the file is written), one write at a time, and a
write that fails stops the peer at its next step rather than being lost."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from p2ptrain.checkpoint import CheckpointDir, Snapshot
from p2ptrain.peer.config import PeerConfig
from p2ptrain.peer_checkpoint import PeerCheckpoints


class _Trainer:
    def __init__(self) -> None:
        self.w = torch.zeros(4)
        self.step_count = 0
        self.lock: threading.Lock | None = None  # the peer's: not held while the trainer's state is read
        self.read_under_lock = False

    def step(self) -> None:
        self.step_count += 1
        self.w += 1.0  # in place, as an optimizer step changes parameters

    def state_dict(self) -> dict[str, Any]:
        self.read_under_lock |= self.lock is not None and self.lock.locked()
        return {"step": self.step_count, "w": self.w}


class _Peer:
    """What PeerCheckpoints takes from a peer (p2ptrain.peer_checkpoint.Checkpointable)."""

    def __init__(self) -> None:
        self.cfg = SimpleNamespace(run_id="r")
        self.method = SimpleNamespace(name="streaming")
        self.trainer = _Trainer()
        self.lock = threading.Lock()
        self.trainer.lock = self.lock
        self.metrics = None
        self.runner = None
        self.has_outer_loop = True
        self.outer = {"theta": torch.zeros(2)}

    @property
    def repairs(self) -> int:
        return 0

    def checkpoint_state(self) -> dict[str, Any]:
        return {"outer": self.outer, "applied": 0, "tokens_at_send": [0]}


def _steps_saved(root: Path) -> list[int]:
    return [step for step, _ in CheckpointDir(root).paths()]


def test_a_checkpoint_is_due_every_seconds_of_training_as_well_as_every_rounds(tmp_path: Path) -> None:
    peer, ck = _Peer(), PeerCheckpoints(tmp_path, every=3, seconds=0.2)
    try:
        assert ck.due() is None
        ck.count()
        ck.count()
        assert ck.due() is None
        ck.count()
        assert ck.due() == "rounds"
        ck.save_if_due(peer)  # copied now: the cadences start again from here
        assert ck.due() is None
        time.sleep(0.25)
        assert ck.due() == "time"
        peer.trainer.step()
        ck.save_if_due(peer)
        ck.wait()
        assert _steps_saved(tmp_path) == [0, 1]
        assert ck.due() is None
    finally:
        ck.close()


def test_rounds_only_when_no_seconds_are_given(tmp_path: Path) -> None:
    ck = PeerCheckpoints(tmp_path, every=2, seconds=None)
    ck._copied -= 10_000.0  # as if the last one were hours ago
    assert ck.due() is None
    ck.count()
    ck.count()
    assert ck.due() == "rounds"
    with pytest.raises(ValueError, match="checkpoint_seconds"):
        PeerCheckpoints(tmp_path, seconds=0.0)
    with pytest.raises(ValueError, match="checkpoint_seconds"):
        PeerConfig(run_id="r", checkpoint_seconds=-1.0)


def test_the_state_written_is_the_one_of_the_step_it_was_due_at(tmp_path: Path) -> None:
    peer, ck = _Peer(), PeerCheckpoints(tmp_path, every=1, seconds=None)
    release, started = threading.Event(), threading.Event()
    write = ck.dir.save

    def slow_save(step: int, state: dict[str, Any] | Snapshot) -> Path:
        started.set()
        assert release.wait(10)
        return write(step, state)

    ck.dir.save = slow_save  # type: ignore[method-assign]
    try:
        peer.trainer.step()  # w = 1
        ck.count()
        ck.save_if_due(peer)  # returns once the state is copied
        assert started.wait(10)
        peer.trainer.step()  # w = 2 while the file is still being written
        peer.outer["theta"] += 5.0
        ck.count()
        ck.save_if_due(peer)  # due, but one write at a time: waits for a later step
        assert ck.due() == "rounds"
        release.set()
        ck.wait()
        _, state = ck.latest()  # type: ignore[misc]
        assert state["trainer"]["step"] == 1
        assert torch.equal(state["trainer"]["w"], torch.ones(4))
        assert torch.equal(state["outer"]["theta"], torch.zeros(2))
        ck.save_if_due(peer)  # the last write is done: the due one starts, at the state of now
        ck.wait()
        _, state = ck.latest()  # type: ignore[misc]
        assert state["trainer"]["step"] == 2 and torch.equal(state["trainer"]["w"], torch.full((4,), 2.0))
        assert torch.equal(state["outer"]["theta"], torch.full((2,), 5.0))
        # the trainer's state (most of the bytes) is copied without the lock the event loop takes to apply a round
        assert not peer.trainer.read_under_lock
    finally:
        release.set()
        ck.close()


def test_a_write_that_fails_is_raised_at_the_next_step_and_a_sync_save_waits_for_the_one_in_progress(
        tmp_path: Path) -> None:
    peer, ck = _Peer(), PeerCheckpoints(tmp_path, every=1, seconds=None)
    write = ck.dir.save

    def full_disk(step: int, state: dict[str, Any] | Snapshot) -> Path:
        raise OSError(28, "No space left on device")

    ck.dir.save = full_disk  # type: ignore[method-assign]
    try:
        ck.count()
        ck.save_if_due(peer)
        deadline = time.monotonic() + 10
        while ck._writing is not None and not ck._writing.done() and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(OSError, match="No space"):
            ck.save_if_due(peer)
        ck.dir.save = write  # type: ignore[method-assign]
        peer.trainer.step()
        ck.count()
        ck.save_if_due(peer)  # in the background
        assert ck.save(peer, "leave") is not None  # waits for it, then writes its own
        assert _steps_saved(tmp_path) == [1]
        assert ck._writing is None
    finally:
        ck.close()
    ck.close()  # idempotent
