"""Multiaddrs given on the command line, split and checked before anything starts.

A list flag is repeatable, and its ``P2PTRAIN_*`` variable holds the values separated by spaces; commas
separate them too (``P2PTRAIN_INITIAL_PEERS=/ip4/…/p2p/A,/ip4/…/p2p/B``), since no multiaddr holds one.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["split_list"]


def split_list(values: Iterable[str] | None) -> list[str]:
    """Every value of a list flag, each split on commas and whitespace, empty ones dropped."""
    return [v for value in values or () for v in value.replace(",", " ").split()]
