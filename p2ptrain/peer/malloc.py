"""Large C-heap buffers on mappings of their own, so that a long-running peer's resident memory stays flat.

glibc serves a request of at least ``M_MMAP_THRESHOLD`` bytes with a mapping of its own, given back to the system
when it is freed. By default the threshold starts at 128 KiB and rises to the size of every mapped block freed (up
to 32 MiB): once a peer's first rounds have freed their parts, results and encoded payloads, later buffers of those
sizes are carved from the heap instead, and what they leave free between live chunks is never given back. In the
churn benchmark the heap's free part grew from 6 to 71 MB in 12 minutes on one peer while its live part stayed
flat; ``malloc_trim`` could not return it. Pinning the threshold (``mallopt``, which also stops it from rising)
keeps those buffers mapped: with it pinned at 128 KiB the median peer grew +0.52 MB/min instead of +1.14.

A threshold below the inner step's activations maps them and faults them in, zeroed, anew at every step: at
128 KiB the tiny preset's step on CPU took 1.76× as long, and at 1 MiB (the default before) the small preset's
(batch 2: activations of 0.5–2.9 MB) took 1.22× as long alone and about 1.75× with four peers sharing two
cores, whose page faults contend in the kernel. At 4 MiB both took as long as with glibc's own rule
(bench/results/README.md, "Memory"), so the default pins 4 MiB: a round's chunks (≤ 1 MiB) live in the heap, whose
threshold no longer rises, and whole parts and fragments of a real model (tens of MB) are mapped. ``P2PTRAIN_MMAP_THRESHOLD`` sets another threshold in bytes (0: glibc's own rule), and a
``MALLOC_MMAP_THRESHOLD_`` the user exported is left alone (glibc has applied it already).
"""

from __future__ import annotations

import ctypes
import logging
import os

__all__ = ["DEFAULT", "ENV", "M_MMAP_THRESHOLD", "mmap_threshold", "pin_mmap_threshold"]

log = logging.getLogger(__name__)
ENV = "P2PTRAIN_MMAP_THRESHOLD"
DEFAULT = 4 << 20
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
_GLIBC_MAX = 32 << 20  # HEAP_MAX / 2 on 64-bit: glibc refuses a larger threshold


def mmap_threshold(env: dict[str, str] | None = None) -> int:
    """The threshold to pin, in bytes, from ``P2PTRAIN_MMAP_THRESHOLD`` (default 4 MiB; 0: none). ValueError for a
    value that is not a whole number of bytes from 0 to 32 MiB."""
    raw = (os.environ if env is None else env).get(ENV, "").strip()
    if not raw:
        return DEFAULT
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{ENV} must be a whole number of bytes, got {raw!r}") from None
    if not 0 <= value <= _GLIBC_MAX:
        raise ValueError(f"{ENV} must be from 0 to {_GLIBC_MAX} bytes (32 MiB), got {raw!r}")
    return value


def pin_mmap_threshold(nbytes: int, env: dict[str, str] | None = None) -> bool:
    """Pin glibc's mmap threshold at ``nbytes`` for this process; whether it was pinned (not with ``nbytes`` 0,
    a ``MALLOC_MMAP_THRESHOLD_`` in the environment, or a C library without ``mallopt``)."""
    if nbytes <= 0 or "MALLOC_MMAP_THRESHOLD_" in (os.environ if env is None else env):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = bool(libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(nbytes)))
    except (OSError, AttributeError):
        return False
    if ok:
        log.debug("event=mmap_threshold bytes=%d", nbytes)
    return ok
