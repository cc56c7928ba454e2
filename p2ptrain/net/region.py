"""A region measured from latency, for peers that do not name one (``--region auto``).

Hierarchical rounds (:mod:`p2ptrain.net.hierarchy`) group a round's members by the region each announces. A peer
that does not know its data centre measures the round-trip time to the live peers once it has joined, and takes
the region of the nearest peer within ``near`` seconds that announces one a user gave, else the smallest measured
name among the near peers. With neither it names a region of its own after the smallest id among itself and the
near peers, so that peers of one site that measure together pick the same name without talking about it. (Two
peers that measure at the same moment, each before the other announced its name, can still pick two names for one
site: their rounds are then hierarchical across the two, correct but with a cell more.)

RTTs here are what a request/response over the swarm's own streams takes (the minimum of a few tries): the network
path plus both peers' processing, which on a loaded host can reach milliseconds. ``near`` should sit well above
that and well below the RTT between regions (10 ms by default: a data centre's hosts are well under 1 ms apart,
regions of one continent 20 ms and more).
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["AUTO", "AUTO_PREFIX", "DEFAULT_NEAR", "pick_region"]

#: The region name that asks for a measured one.
AUTO = "auto"
#: Measured regions are named ``auto-`` and the last characters of a peer id.
AUTO_PREFIX = "auto-"
#: Seconds of round-trip time below which two peers count as one region.
DEFAULT_NEAR = 0.010


def pick_region(me: str, rtts: Mapping[str, float], regions: Mapping[str, str], near: float = DEFAULT_NEAR) -> str:
    """The region peer ``me`` announces, from its RTTs (seconds, by peer; peers it could not measure left out)
    and the regions the others announce ("" or :data:`AUTO`: none yet)."""
    if near <= 0:
        raise ValueError(f"near must be positive, got {near}")
    close = sorted((rtt, peer) for peer, rtt in rtts.items() if peer != me and 0 <= rtt <= near)
    labels = [regions.get(peer, "") for _, peer in close]
    given = [label for label in labels if label and label != AUTO and not label.startswith(AUTO_PREFIX)]
    if given:
        return given[0]  # the nearest peer's own name for the site
    measured = [label for label in labels if label.startswith(AUTO_PREFIX)]
    if measured:
        return min(measured)  # near peers that measured theirs: the smallest, so a site ends with one name
    return AUTO_PREFIX + min([me, *(peer for _, peer in close)])[-8:]
