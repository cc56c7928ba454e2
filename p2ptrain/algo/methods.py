"""The outer-loop methods behind one interface: the names a driver, a test or a benchmark imports.

A method is a config (:mod:`.configs`), its rules (:mod:`.rules`) and the per-peer :class:`OuterLoop` that
applies them (:mod:`.outer_loop`); rounds and step plans are in :mod:`.rounds`, CoCoDC's slots in
:mod:`.slots`. The loop that drives them, on a virtual clock or on a real swarm, is
:class:`p2ptrain.driver.OuterDriver`.

=========  ====  ======  ===================  =======================================
method     P     τ       merge on apply       outer update
=========  ====  ======  ===================  =======================================
diloco     1     0       θ_i ← θ              Nesterov(Δ)
streaming  P     τ<H     α-merge              Nesterov(Δ) per fragment
eager      1     k·H     θ_i ← θ^(i)          Nesterov(Δ̃_i) (eager) or Nesterov(Δ(t−k)) (naive)
cocodc     P     τ       Taylor compensation  Nesterov(Δ) per fragment, negotiated choice of p
dilocox    1     H       naive/eager/delta    Nesterov on low-rank + quantized Δ(t−1)
=========  ====  ======  ===================  =======================================
"""

from __future__ import annotations

from .configs import (
    METHODS,
    CoCoDCConfig,
    DDPConfig,
    DiLoCoConfig,
    DiLoCoXConfig,
    EagerConfig,
    MethodConfig,
    StreamingConfig,
    method_config,
)
from .outer_loop import LocalParams, OuterLoop
from .rounds import Action, ApplyReport, Round, RoundState, StepPlan
from .rules import Rules, rules_for
from .slots import MAX_SEND_CHANGES, SlotGrid, SlotLeader

__all__ = [
    "MAX_SEND_CHANGES",
    "METHODS",
    "Action",
    "ApplyReport",
    "CoCoDCConfig",
    "DDPConfig",
    "DiLoCoConfig",
    "DiLoCoXConfig",
    "EagerConfig",
    "LocalParams",
    "MethodConfig",
    "OuterLoop",
    "Round",
    "RoundState",
    "Rules",
    "SlotGrid",
    "SlotLeader",
    "StepPlan",
    "StreamingConfig",
    "method_config",
    "rules_for",
]
