"""Swarm peers: the compute loop of each kind, their replica state, and the run lifecycle they share.

============================  ==================================================================
module                        what
============================  ==================================================================
:mod:`.config`                ``PeerConfig``, ``PeerState``, ``PeerSummary``
:mod:`.base`                  ``PeerBase``: connect, pace, sync, loop, leave; heartbeat; metrics
:mod:`.outer`                 ``Peer``: an outer-loop method's compute loop (``OuterDriver``)
:mod:`.ddp`                   ``DDPPeer``: data parallel (``DDPDriver``)
:mod:`.collective`            ``SwarmCollective``: the driver's rounds on the network loop
:mod:`.replica`               ``ReplicaState``: versions of θ, state service, catch-up, repair
:mod:`.vitals`                the model check at join, the measured pacing, the sharing watch
============================  ==================================================================
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from ..algo.configs import DDPConfig, MethodConfig
from ..net.transport import Transport
from ..trainer import Trainer
from .base import PeerBase
from .config import PeerConfig, PeerState, PeerSummary
from .ddp import DDPPeer
from .outer import Peer

__all__ = ["DDPPeer", "Peer", "PeerBase", "PeerConfig", "PeerState", "PeerSummary", "make_peer"]


def make_peer(cfg: PeerConfig, method: MethodConfig, trainer: Trainer, transport: Callable[[], Awaitable[Transport]],
              **kwargs: Any) -> PeerBase:
    """The peer of ``method``'s kind: a :class:`DDPPeer` for ddp, else a :class:`Peer` (same arguments)."""
    kind = DDPPeer if isinstance(method, DDPConfig) else Peer
    return kind(cfg, method, trainer, transport, **kwargs)
