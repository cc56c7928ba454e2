"""A data-parallel swarm peer: gradients all-reduced after every inner step (the reference; no outer loop).

Every step is a blocking round (:class:`~p2ptrain.driver.DDPDriver`) over the same round runner the
outer-loop peers use. Every member's parameters' fingerprint rides along; a member whose parameters left the
majority (it missed a step's group) is excluded and takes the whole trainer state (parameters, AdamW moments,
step) from a member of the majority before stepping on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, ClassVar

from ..algo.rounds import ApplyReport, Round
from ..checkpoint import state_from_bytes, state_to_bytes
from ..driver import DDPDriver, DriverHooks, param_sums
from ..net.transport import RoundFailed
from .base import PeerBase

__all__ = ["DDPPeer"]

log = logging.getLogger(__name__)


class DDPPeer(PeerBase, DriverHooks):
    """One data-parallel peer of a swarm."""

    kind: ClassVar[str] = "ddp"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.driver: DDPDriver | None = None
        self._repairs = 0

    def _wait_limit(self) -> float:
        return self.cfg.join_timeout + self.method.timeout + 5  # one blocking round per step

    def _connected(self) -> None:
        assert self.collective is not None
        self.driver = DDPDriver(self.trainer, self.collective, hooks=self, lock=self.lock,
                                fingerprint=lambda: param_sums(self.trainer.params))

    def _round_label(self, rnd: Any) -> str:
        return "grad"

    @property
    def repairs(self) -> int:
        return self._repairs

    def restore(self, state: dict[str, Any]) -> None:
        super().restore(state)
        self._repairs = int(state["peer"]["repairs"])

    # ------------------------------------------------------------------ state for others, and from them
    def _provide(self, name: str) -> bytes | None:
        if name != "outer":
            return None
        with self.lock:  # references under the lock; serialised after it (parameters change only under it)
            state = {"params": {n: p.detach().clone() for n, p in self.trainer.params.items()},
                     "step": self.trainer.step_count, "optimizer": self.trainer.optimizer.state_dict()}
        return state_to_bytes(state)

    def _take_state(self, state: dict[str, Any], source: str, keep_progress: bool, catch_up: bool = True) -> None:
        with self.lock:
            names = list(self.trainer.params)
            self.trainer.apply_outer(names, [state["params"][n] for n in names])
            self.trainer.optimizer.load_state_dict(state["optimizer"])
            self.trainer.optimizer.zero_grad(set_to_none=True)
            self.trainer.step_count = int(state["step"])

    # ------------------------------------------------------------------ driver hooks
    def repair(self, rnd: Round, taking: Callable[[], None]) -> bool:
        taking()  # (a data-parallel peer keeps no progress of its own across a repair)
        sources = [p for p in rnd.contributors if p != self.peer_id]
        while sources:
            try:
                peer, raw = self.download(sources, "outer")
            except (RoundFailed, TimeoutError) as e:
                log.info("event=repair_failed reason=%s", e)
                return False
            sources.remove(peer)
            try:
                self._take_state(state_from_bytes(raw, f"state from {peer}"), peer, False)
            except (ValueError, KeyError) as e:
                log.info("event=repair_refused peer=%s reason=%s", peer, e)
                continue
            self._repairs += 1
            log.warning("event=repaired what=ddp_state from=%s", peer)
            return True
        return False

    def after_apply(self, rnd: Round, report: ApplyReport | None) -> None:
        if self.checkpoints is not None:
            self.checkpoints.count()
        if not rnd.arrived:
            log.info("event=ddp_step_missed step=%d", rnd.seq)

    # ------------------------------------------------------------------ the compute loop
    @property
    def lockstep(self) -> bool:
        return True  # every step is a round

    def step(self) -> None:
        assert self.driver is not None and self.collective is not None
        t0, stall0 = time.perf_counter(), self.collective.stall
        self.driver.advance(self.trainer.step_count + 1)
        waited = self.collective.stall - stall0
        self.record_step(self.driver.last_loss, self.driver.last_tokens, time.perf_counter() - t0 - waited)
        if self.checkpoints is not None:
            self.checkpoints.save_if_due(self)
