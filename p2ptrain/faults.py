"""Fault injection for tests of real peers: a :class:`FaultPlan` says which faults one process injects.

A plan is built from environment variables (:meth:`FaultPlan.from_env`), so that tests can switch faults
on in peers they start as processes, and handed to what injects them (``SwarmConfig.faults``,
``PeerCheckpoints``, ``CheckpointDir``):

``P2PTRAIN_FAULT_KILL_IN_ALLREDUCE=N``: the process SIGKILLs itself in its N-th
all-reduce phase, right after its share has left for the part owners and before
it averages its own part (the worst moment for the others).

``P2PTRAIN_FAULT_KILL_IN_CHECKPOINT=N``: the process SIGKILLs itself in its N-th
checkpoint write, after half of the temporary file is on disk and before the rename.

``corrupt`` (set by tests only, no variable): the peer sends broken updates of that kind
(:data:`CORRUPTIONS`, made by the pure functions :func:`corrupt_update` and :func:`corrupt_payload`).

``lie`` (tests and bench/chaos.py): as a butterfly part's owner, the peer sends back a wrong average of that
kind (:data:`LIES`, made by :func:`lie_about`), to every member or (``lie_to_some``) to half of them;
``frame``: as a contributor, it sends wrong sketches of its contributions after the round, to get an honest
owner blamed.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["CORRUPTIONS", "ENV_KILL_IN_ALLREDUCE", "ENV_KILL_IN_CHECKPOINT", "LIES", "FaultPlan", "corrupt_payload",
           "corrupt_update", "lie_about"]

ENV_KILL_IN_ALLREDUCE = "P2PTRAIN_FAULT_KILL_IN_ALLREDUCE"
ENV_KILL_IN_CHECKPOINT = "P2PTRAIN_FAULT_KILL_IN_CHECKPOINT"
CORRUPTIONS = ("nan", "scale", "random", "shape", "truncate")
LIES = ("scale", "nan", "flip", "shift")


def _sigkill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _nth(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "")
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected the number of the call to die in") from None


@dataclass
class FaultPlan:
    """The faults one process injects, and how far it has got (the counters).

    Attributes:
        kill_in_allreduce: die in this all-reduce phase (1 is the first), or never.
        kill_in_checkpoint: die half-way through this checkpoint write (1 is the first), or never.
        kill_after_chunks: die once this many chunks of streamed parts are sent (mid-stream), or never.
        corrupt: send broken updates of this kind (:data:`CORRUPTIONS`), or honest ones.
        lie: as a part's owner, send back a wrong average of this kind (:data:`LIES`), or the true one;
            lie_to_some: only to every other member (the rest get the true one).
        frame: send wrong sketches of this peer's contributions in the round's checks.
        forge: a lying owner's claims pass its lie off as its own share (the sketches then add up).
        allreduces, checkpoints, chunks_sent: all-reduce phases, checkpoint writes and streamed chunks begun so far.
        armed: the checkpoint write under way is the one to die in.
        kill: what dying is (SIGKILL of this process; a test may record instead).
    """

    kill_in_allreduce: int | None = None
    kill_in_checkpoint: int | None = None
    kill_after_chunks: int | None = None
    corrupt: str | None = None
    lie: str | None = None
    lie_to_some: bool = False
    frame: bool = False
    forge: bool = False
    allreduces: int = 0
    chunks_sent: int = 0
    checkpoints: int = 0
    armed: bool = False
    kill: Callable[[], None] = field(default=_sigkill_self, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.corrupt is not None and self.corrupt not in CORRUPTIONS:
            raise ValueError(f"unknown corruption {self.corrupt!r}: choose one of {', '.join(CORRUPTIONS)}")
        if self.lie is not None and self.lie not in LIES:
            raise ValueError(f"unknown lie {self.lie!r}: choose one of {', '.join(LIES)}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> FaultPlan:
        """The plan the environment (``os.environ`` unless given) asks for; no faults if it asks for none.
        ValueError if a variable is set to something other than a number."""
        env = os.environ if env is None else env
        return cls(kill_in_allreduce=_nth(env, ENV_KILL_IN_ALLREDUCE),
                   kill_in_checkpoint=_nth(env, ENV_KILL_IN_CHECKPOINT))

    def in_allreduce(self) -> None:
        """Called once per all-reduce phase, with this peer's share sent: dies in the chosen one."""
        if self.kill_in_allreduce is None:
            return
        self.allreduces += 1
        if self.allreduces == self.kill_in_allreduce:
            self.kill()

    def in_stream(self, sent: int) -> None:
        """Called by a part's stream with one more chunk sent (``sent`` so far in it): dies at the chosen count,
        summed over every stream."""
        if self.kill_after_chunks is None:
            return
        self.chunks_sent += 1
        if self.chunks_sent == self.kill_after_chunks:
            self.kill()

    def checkpoint_begins(self) -> None:
        """Called once per checkpoint write, before it: arms :meth:`mid_write` if it is the chosen one."""
        if self.kill_in_checkpoint is None:
            return
        self.checkpoints += 1
        self.armed = self.checkpoints == self.kill_in_checkpoint

    def mid_write(self) -> None:
        """Called by the checkpoint writer with half the temporary file written: dies if armed."""
        if self.armed:
            self.kill()


def corrupt_update(flat: torch.Tensor, mode: str) -> torch.Tensor:
    """A broken or hostile peer's version of the update it sends (tests and fault-injection runs only):
    ``nan`` (some values NaN), ``scale`` (×100), ``random`` (noise 100× the update's norm), ``shape``
    (three extra values). ``truncate`` cuts the encoded payload instead: see the transports."""
    if mode == "nan":
        out = flat.clone()
        out[:: max(1, out.numel() // 7)] = float("nan")
        return out
    if mode == "scale":
        return flat * 100.0
    if mode == "random":
        noise = torch.randn_like(flat)
        return noise * (100.0 * float(flat.norm()) / max(1e-12, float(noise.norm())))
    if mode == "shape":
        return torch.cat([flat, torch.zeros(3, dtype=flat.dtype)])
    if mode == "truncate":
        return flat
    raise ValueError(f"unknown corruption {mode!r}: choose one of {', '.join(CORRUPTIONS)}")


def corrupt_payload(codec: Any, flat: torch.Tensor, mode: str) -> tuple[bytes, torch.Tensor]:
    """The encoded bytes a broken or hostile peer sends for ``flat``, and the tensor they claim to hold
    (codecs refuse to encode non-finite values, so ``nan`` is written as raw fp32 NaNs, or as 0xFF
    bytes for the other codecs)."""
    bad = corrupt_update(flat, mode)
    if mode == "nan":
        if codec.name == "fp32":
            return bad.float().numpy().tobytes(), bad
        return b"\xff" * codec.encoded_size(flat.numel()), flat
    data = codec.encode(bad)
    if mode == "truncate":
        data = data[: len(data) // 2]
    return data, bad


def lie_about(avg: torch.Tensor, mode: str) -> torch.Tensor:
    """A lying part owner's version of the average it sends back (tests and fault-injection runs only):
    ``scale`` (×100), ``nan`` (some values NaN), ``flip`` (sign-flipped), ``shift`` (moved by 10% of its
    norm, in a fixed random direction: a lie small enough to look plausible)."""
    if mode == "scale":
        return avg * 100.0
    if mode == "nan":
        return corrupt_update(avg, "nan")
    if mode == "flip":
        return -avg
    if mode == "shift":
        u = torch.randn(avg.numel(), generator=torch.Generator().manual_seed(7)).to(avg.dtype).view_as(avg)
        return avg + u * (0.1 * float(avg.norm()) / max(1e-30, float(u.norm())))
    raise ValueError(f"unknown lie {mode!r}: choose one of {', '.join(LIES)}")
