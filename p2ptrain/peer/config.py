"""A peer's configuration, its life's states, and the summary it leaves with."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Literal

import torch

__all__ = ["PeerConfig", "PeerState", "PeerSummary"]


class PeerState(enum.Enum):
    """NEW → CONNECTED (transport up, services running) → STARTED (paced, synced) → CLOSED."""

    NEW = "new"
    CONNECTED = "connected"
    STARTED = "started"
    CLOSED = "closed"


@dataclass(kw_only=True)
class PeerConfig:
    """A peer's place in a run.

    Attributes:
        run_id: the run's name; peers of one run find each other under it.
        region: a free-form label (announced, shown by ``status``); hierarchical rounds group members by it.
            ``auto``: measured once joined, from round-trip times to the live peers (:mod:`p2ptrain.net.region`).
        region_near: with ``region = "auto"``, seconds of round-trip time under which a peer is of one's region.
        steps: leave cleanly after this many inner steps.
        step_seconds: the swarm's logical step duration (round pacing). None: take the run's
            published value, or (first peer) measure the first inner steps and publish that.
        join_window: seconds a round's leader waits for live peers to join before it closes the group.
        join_timeout: seconds a peer waits for its group to form (and each wait of a state download).
        hedge: seconds a state download (a joiner's θ, a repair's majority θ) waits for a source's first chunk
            before it asks the next source too; the first to answer goes on alone (:mod:`p2ptrain.net.hedged`).
            Without it, a source across a region cut costs the whole ``join_timeout``.
        heartbeat: seconds between announcements; an announcement expires after ``ttl``.
        quorum_memory: seconds a peer seen live still counts toward a round's quorum after its announcement
            expired (SwarmConfig.quorum_memory): a cut-off minority waits instead of forking θ.
        sync_on_join: a peer that finds a live swarm downloads θ and the outer state first.
        train_while_connecting: a peer resumed from a checkpoint trains its model while it connects (its progress
            is its own until it takes the swarm's state, rebased onto it then); not with ``clock="steps"``.
        drain_timeout: seconds to wait for rounds still in flight when leaving.
        leave_flush: a leave by signal (SIGTERM, Ctrl-C) stays in the swarm's rounds, training on, until every
            fragment has sent the progress no round carries yet, at most this many seconds (0: leave after the
            drain, and that progress is lost); ``--steps`` reached leaves without it, and so does a staged peer
            (p2ptrain/staged.py drains its stage groups directly).
        min_step_seconds: pad every inner step to at least this long (emulates a slower device in
            tests and demos; the padding counts as compute).
        warmup: seconds after joining before taking part in rounds (None: three heartbeats), so that
            every peer's view of who is live includes us before a group can form without us.
        checkpoint_dir: where to write checkpoints (None: none); every ``checkpoint_every`` applied
            rounds (data parallel: steps), every ``checkpoint_seconds`` of training (None: by rounds only;
            a peer killed while its rounds fail then loses at most that much) and on leave, keeping the last
            ``keep_checkpoints``. Written by a thread of their own while training goes on.
        eval_every: evaluate θ on the validation set when the loop starts and every this many inner steps
            (0: never during the run), for loss-over-time curves (benchmarks' time to a target loss). The
            time it takes is counted apart (``eval_seconds``), not as compute.
        clock: ``wall`` (the default): rounds are paced by the swarm's shared clock (see
            :mod:`p2ptrain.peer`); ``steps``: by this peer's own inner steps, and a CoCoDC slot's decision is
            waited for before the next step. Every peer of a run must use the same; ``steps`` makes a swarm's
            schedule exactly the simulator's (the equivalence tests), at the price of peers waiting for the
            slowest at every round.
        flat_rounds: every round is one butterfly over all its members, even when they announce several
            regions or outnumber ``max_group`` (by default such a group reduces region by region, in cells of at
            most ``max_group`` peers: :mod:`p2ptrain.net.hierarchy`).
        max_group: the most peers one step of a round involves (G): a region with more members is split into
            cells of at most G, drawn afresh each round; every member still ends with the swarm's mean.
    """

    run_id: str = "p2ptrain"
    region: str = ""
    region_near: float = 0.010
    steps: int = 300
    step_seconds: float | None = None
    join_window: float = 2.0
    join_timeout: float = 30.0
    hedge: float = 5.0
    heartbeat: float = 2.0
    ttl: float = 8.0
    quorum_memory: float = 120.0
    sync_on_join: bool = True
    train_while_connecting: bool = True
    drain_timeout: float = 60.0
    leave_flush: float = 120.0
    min_step_seconds: float = 0.0
    warmup: float | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 10
    checkpoint_seconds: float | None = 300.0
    keep_checkpoints: int = 3
    eval_every: int = 0
    clock: Literal["wall", "steps"] = "wall"
    flat_rounds: bool = False
    max_group: int = 32

    def __post_init__(self) -> None:
        if self.clock not in ("wall", "steps"):
            raise ValueError(f"clock must be 'wall' or 'steps', got {self.clock!r}")
        if self.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0 (0: no evaluation during the run), got {self.eval_every}")
        if self.warmup is None:
            self.warmup = 3 * self.heartbeat
        if not self.run_id or any(c in self.run_id for c in " /"):
            raise ValueError(f"run id must be a non-empty word without spaces or '/', got {self.run_id!r}")
        if self.steps < 1:
            raise ValueError("steps must be at least 1")
        if self.step_seconds is not None and self.step_seconds <= 0:
            raise ValueError("step_seconds must be positive")
        if not self.region_near > 0:
            raise ValueError(f"region_near must be positive (seconds of round-trip time), got {self.region_near}")
        if self.checkpoint_seconds is not None and not self.checkpoint_seconds > 0:
            raise ValueError(f"checkpoint_seconds must be positive (or unset: by rounds only), got {self.checkpoint_seconds}")
        if self.quorum_memory < 0:
            raise ValueError(f"quorum_memory must be at least 0, got {self.quorum_memory}")
        for name in ("join_window", "join_timeout", "hedge", "heartbeat", "ttl", "drain_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if not self.leave_flush >= 0:
            raise ValueError(f"leave_flush must be at least 0 (0: no flush on leave), got {self.leave_flush}")
        if self.max_group < 2:
            raise ValueError(f"max_group must be at least 2 (a cell of one peer averages nothing), got {self.max_group}")
        if self.ttl <= self.heartbeat:
            raise ValueError("ttl must be longer than the heartbeat period")


@dataclass
class PeerSummary:
    peer_id: str
    steps: int
    wall_seconds: float
    compute_seconds: float
    stall_seconds: float
    rounds_complete: int
    rounds_partial: int
    rounds_failed: int
    rounds_applied: int
    repairs: int
    bytes_sent: int
    bytes_received: int
    final_train_loss: float
    val_loss: float = math.nan
    loop_seconds: float = 0.0  # the inner-step loop alone (no start-up, no final drain)
    drain_seconds: float = 0.0  # waiting for the rounds in flight when leaving
    stuck_rounds: int = 0  # rounds that outlived every timeout of their own and were aborted
    abandoned_rounds: int = 0  # rounds still within their own limits when the leave's drain limit ended
    eval_seconds: float = 0.0  # evaluations during the run (``eval_every``), inside loop_seconds
    outer_seconds: float = 0.0  # compute-thread time in the outer loop (sends, applies), waits excluded
    rounds_shared: int = 0  # rounds whose average held another peer's contribution (0: trained alone)
    outer_params: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    applied: dict[str, tuple[str, list[torch.Tensor]]] = field(default_factory=dict, repr=False)

    @property
    def utilization(self) -> float:
        return self.compute_seconds / self.wall_seconds if self.wall_seconds > 0 else 0.0
