"""The TCP congestion control of the direct path's connections (net/direct.py), when a peer asks for one.

On the testbed's 20 Mbit/s links between regions (a tbf with a 50 ms queue), the machine's default (BBR) retransmitted
6–10% of the direct path's bytes with several connections crossing at once (bench/results/README.md, "Where the wire
bytes go"); which one to run is a measurement of the links a swarm has, so it is a setting, not a constant.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

__all__ = ["DEFAULT_CONGESTION", "set_congestion", "usable_congestion"]

log = logging.getLogger(__name__)

_OFFERED = "/proc/sys/net/ipv4/tcp_available_congestion_control"
#: The direct path's default. Measured against BBR (this machine's default) on the testbed, the two in turn:
#: `python bench/link.py --systems p2ptrain-bbr,p2ptrain-cubic --peers 2,4 --sizes 4,16,64 --repeats 5 --wan-sizes 64`
#: gave CUBIC the higher median of the 100 Mbit/s rate in 5 of 7 rows (4 × 64 MB: 0.836 against 0.667; 100 ms WAN
#: 0.830 against 0.847; every range overlapping), and at 20 Mbit/s between regions it retransmitted ~1% of the
#: direct path's bytes where BBR retransmitted 6–10% (bench/results/README.md, "Where the wire bytes go").
DEFAULT_CONGESTION = "cubic"


def usable_congestion(name: str | None) -> str | None:
    """``name`` if this host offers that TCP congestion control (Linux), else None: the system's (a warning when
    one other than the default was asked for)."""
    if name is None:
        return None
    try:
        with open(_OFFERED) as f:
            offered = f.read().split()
    except OSError:
        offered = []
    if name not in offered or not hasattr(socket, "TCP_CONGESTION"):
        say = log.info if name == DEFAULT_CONGESTION else log.warning
        say("event=congestion_unavailable algorithm=%s offered=%s", name, ",".join(offered) or "-")
        return None
    return name


def set_congestion(writer: Any, name: str | None) -> None:
    """Set the congestion control of ``writer``'s socket to ``name`` (None: leave the system's; a failure is logged)."""
    sock = writer.get_extra_info("socket")
    if name is None or sock is None:
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
    except OSError as e:
        log.info("event=congestion_unset algorithm=%s reason=%s", name, e)
