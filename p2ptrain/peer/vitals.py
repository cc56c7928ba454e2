"""What a peer checks about itself and its swarm, and says when it is wrong: the model it joins, the pacing it
measured, and whether it shares any round with another peer."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterable
from typing import Any

from ..net.transport import PeerInfo

__all__ = ["PACING_MAX_SECONDS", "PACING_WARN_SECONDS", "JoinRefused", "SharingWatch", "check_model",
           "measured_pacing", "model_fingerprint"]

log = logging.getLogger(__name__)

#: A measured pacing above this is suspicious (a loaded machine, a first step that compiles): say so.
PACING_WARN_SECONDS = 10.0
#: ... and above this it is clamped: one peer's bad measurement must not pace a whole swarm at minutes per step.
PACING_MAX_SECONDS = 60.0
#: The shortest silence (no round shared) worth saying, whatever the method's round length.
SHARING_MIN_SECONDS = 30.0


def measured_pacing(times: list[float]) -> tuple[float, str]:
    """The step time to publish from a few timed inner steps: the first is left out (it warms caches and
    compiles kernels) and the median of the rest taken (a busy moment does not count), at least 0.01 s and at
    most :data:`PACING_MAX_SECONDS`; and a warning when it is that slow that a loaded machine is the likelier
    cause (empty when not)."""
    rest = sorted(times[1:] or times)
    seconds = round(max(0.01, rest[len(rest) // 2]), 3)
    if seconds > PACING_MAX_SECONDS:
        return PACING_MAX_SECONDS, (f"measured {seconds} s per step, clamped to {PACING_MAX_SECONDS} s: "
                                    "set the swarm's pacing with --step-seconds")
    if seconds > PACING_WARN_SECONDS:
        return seconds, ("a slow first measurement paces the whole swarm (a loaded machine?): "
                         "set it with --step-seconds")
    return seconds, ""


class JoinRefused(RuntimeError):
    """The run this peer tried to join trains something it cannot take part in (another model)."""


def model_fingerprint(model: Any) -> str:
    """What peers of one run must share: every parameter's name and shape (not dtype or device), hashed
    (``model``: anything with ``named_parameters()``, a pipeline stage's view too)."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)};".encode())
    return h.hexdigest()[:16]


def check_model(mine: str, others: Iterable[PeerInfo], run_id: str) -> None:
    """Raise :class:`JoinRefused` when the live peers of ``run_id`` announce models and none is ``mine``: their
    state could never load here, and rounds with them would mix unrelated tensors."""
    theirs: dict[str, int] = {}
    for info in others:
        if fp := info.extra.get("model"):
            theirs[str(fp)] = theirs.get(str(fp), 0) + 1
    if theirs and mine not in theirs:
        fp, n = max(theirs.items(), key=lambda kv: kv[1])
        raise JoinRefused(f"run {run_id!r} trains another model (fingerprint {fp}, announced by {n} peer(s)); "
                          f"this peer's is {mine}: join with the run's --preset / --init-from")


class SharingWatch:
    """How long a peer has shared no round with another, and saying so: once past the limit, then again each
    time the silence doubles (a warning when other peers are live: something keeps them apart)."""

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        """The loop starts now: a silence counts from here until the first shared round."""
        self.since, self.said = time.monotonic(), 0.0

    def quiet(self, last_shared: float | None, round_seconds: float) -> float:
        """Seconds without a shared round (``last_shared``: monotonic time of the last, None: never), once
        longer than ``round_seconds`` (every fragment syncing twice) and :data:`SHARING_MIN_SECONDS`; else 0."""
        quiet = time.monotonic() - (last_shared if last_shared is not None else self.since)
        return quiet if quiet > max(SHARING_MIN_SECONDS, round_seconds) else 0.0

    def say(self, quiet: float, live: int, stats: Any) -> None:
        """Log the silence ``quiet`` (0: sharing again) with ``live`` peers seen and the runner's ``stats``."""
        if not quiet:
            self.said = 0.0
        elif quiet >= self.said:
            self.said = 2 * quiet
            log.log(logging.WARNING if live > 1 else logging.INFO,
                    "event=sharing_nothing seconds=%.0f live_peers=%d rounds=%d rounds_shared=%d", quiet, live,
                    stats.complete + stats.partial, stats.shared)
