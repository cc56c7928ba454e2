"""Error feedback in front of a lossy wire codec (pure math: torch and the stdlib only).

Each peer keeps what the wire did not carry of its pseudo-gradient and adds it to its next round's
(EF-SGD, arXiv 1901.09847; SparseLoCo, arXiv 2508.15706, with top-k and 2-bit values):
``m = Δ_i + β·e``, ``c = Q(m)``, ``e ← m − c``, send ``c``. Over rounds nothing is lost: the sum of what a peer
sent plus its buffer is the sum of its pseudo-gradients (with β = 1; β < 1 forgets old mass, as
SparseLoCo's decayed accumulator, which stands in for the outer momentum).

``Q`` is the wire's round trip of the fragment's flat vector laid out as the all-reduce lays it out (one part
per member, each part encoded on its own): the lossy codecs here are idempotent, so the owner of a part
decodes exactly ``c`` and the buffer holds exactly what was not sent. When a round's group is not the size
expected at send time, the parts start elsewhere and the wire re-encodes ``c``; what it drops then is not
fed back (a dropped peer's round, rare).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .compress import Compressor, _match

__all__ = ["ErrorFeedback"]

#: (flat fp32 vector, members) -> what the members receive of it.
RoundTrip = Callable[[torch.Tensor, int], torch.Tensor]
_F = TypeVar("_F", bound=Callable[..., Any])


def _locked(method: _F) -> _F:
    """Run ``method`` under the instance's lock (the buffer may change on a round runner's worker thread)."""
    @functools.wraps(method)
    def run(self: ErrorFeedback, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)
    return run  # type: ignore[return-value]


class ErrorFeedback(Compressor):
    """One all-reduce phase whose payload is ``Q(Δ_i + e)``; ``e`` keeps the rest (see the module docstring).

    The buffer is this peer's own (checkpointed; a joining peer starts from zero: it sent nothing yet). It is
    committed when the round begins; :meth:`abort` (a failed all-reduce, whose progress re-enters the next
    pseudo-gradient) puts back the buffer from before that round, unless a later round began meanwhile.
    :meth:`begin` (the codec's round trip of the whole fragment) is ``deferred``: a real peer runs it in a
    worker thread while its compute thread trains on, and may checkpoint meanwhile, so the buffer's changes
    are made under a lock.
    """

    stateless = False
    deferred = True

    def __init__(self, roundtrip: RoundTrip, decay: float = 1.0) -> None:
        if not 0 < decay <= 1:
            raise ValueError(f"error-feedback decay β must be in (0, 1], got {decay}")
        self.roundtrip, self.decay = roundtrip, float(decay)
        self.members = 1
        self._error: torch.Tensor | None = None  # (n,) f32 on the CPU, None until the first round
        self._before: torch.Tensor | None = None  # the buffer before the latest round
        self._open = 0  # rounds begun and not yet received or aborted (eager overlaps rounds)
        self._shapes: list[torch.Size] = []
        self._devices: list[torch.device] = []
        self._result: list[torch.Tensor] | None = None
        self._lock = threading.Lock()

    def expect_members(self, members: int) -> None:
        self.members = max(1, int(members))

    @property
    def error(self) -> torch.Tensor | None:
        """This peer's buffer (flat, float32), None before the first round."""
        return self._error

    @_locked
    def begin(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        flat = torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors]) if tensors \
            else torch.zeros(0)
        if self._error is not None and self._error.numel() != flat.numel():
            raise ValueError(f"error buffer holds {self._error.numel()} values, the round has {flat.numel()}")
        # (n,) f32, a new tensor either way
        m = flat if self._error is None else flat.add(self._error, alpha=self.decay)
        sent = self.roundtrip(m, self.members)  # (n,) f32: what the members decode
        self._before = self._error
        self._open += 1
        self._error = m.sub_(sent)  # what was not sent, in m's own buffer
        self._shapes, self._devices, self._result = [t.shape for t in tensors], [t.device for t in tensors], None
        out, offset = [], 0
        for t in tensors:
            out.append(sent[offset : offset + t.numel()].view(t.shape).to(t.device))
            offset += t.numel()
        return out

    @_locked
    def hand_over(self, share: float) -> list[torch.Tensor] | None:
        """Take ``share`` of the buffer out of it and return it shaped as the round's tensors (None before the
        first round or for share 0): the caller keeps that part of the unsent progress in the local model
        instead, where it re-enters the next ``Δ_i`` by itself (counted once: the buffer no longer holds it)."""
        if self._error is None or share == 0.0:
            return None
        if not 0 < share <= 1:
            raise ValueError(f"a share of the buffer must be in [0, 1], got {share}")
        taken = self._error * share  # (n,) f32
        self._error = self._error * (1.0 - share)  # a new tensor: _before (an abort's) stays as it was
        out, offset = [], 0
        for shape, device in zip(self._shapes, self._devices, strict=True):
            n = shape.numel()
            out.append(taken[offset : offset + n].view(shape).to(device))
            offset += n
        return out

    @_locked
    def receive(self, averaged: list[torch.Tensor]) -> list[torch.Tensor] | None:
        if self._open == 0:
            raise RuntimeError("receive() called without a round in progress")
        self._result = _match(averaged, self._shapes, self._devices)
        self._open -= 1
        return None

    def result(self) -> list[torch.Tensor]:
        if self._result is None:
            raise RuntimeError("result() called before the round finished")
        return list(self._result)

    @_locked
    def abort(self) -> None:
        if self._open == 1:  # the only open round is the latest: its buffer update is undone
            self._error = self._before
        self._open = max(0, self._open - 1)

    @_locked
    def withdraw(self) -> bool:
        """Put back the buffer from before the latest round, if no round is open (False otherwise). The round
        withdrawn must be the latest begun: true where it is used (rules whose rounds of one fragment never
        overlap: a fragment in flight is not sent again; eager, whose rounds do, keeps its progress otherwise)."""
        if self._open:
            return False
        self._error = self._before
        return True

    @_locked
    def state_dict(self) -> dict[str, Any]:
        """``error``: [the flat buffer] (a CPU copy), or [] before the first round."""
        return {"error": [] if self._error is None else [self._error.clone()]}

    @_locked
    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            errors = list(state["error"])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not an error-feedback state: {exc}") from None
        if len(errors) > 1 or (errors and errors[0].dim() != 1):
            raise ValueError("an error-feedback state holds at most one flat buffer")
        if errors and not bool(torch.isfinite(errors[0]).all()):
            raise ValueError("error-feedback buffer holds non-finite values")
        self._error = errors[0].detach().to("cpu", torch.float32, copy=True) if errors else None
        self._before, self._open, self._result = None, 0, None
