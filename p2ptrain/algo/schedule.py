"""Which fragment is sent at which inner step, for the fixed schedules.

Steps are counted as inner steps *completed* (1, 2, ...). Streaming DiLoCo
(arXiv 2501.18512) sends fragment p every H steps at offset ``o_p = p·⌊H/P⌋``, so
the P fragments' syncs are spread evenly over the window and the peak bandwidth
drops by ~P. DiLoCo is the case P = 1 (every H steps).
"""

from __future__ import annotations

__all__ = ["streaming_offsets", "streaming_sends"]


def streaming_offsets(H: int, P: int) -> list[int]:
    """``o_p = p·⌊H/P⌋`` for p in 0..P−1."""
    if H < 1 or P < 1:
        raise ValueError(f"H ({H}) and P ({P}) must be positive")
    return [p * (H // P) for p in range(P)]


def streaming_sends(step: int, H: int, P: int) -> list[int]:
    """Fragments whose sync starts after inner step ``step`` (> 0): those with ``step ≡ o_p (mod H)``."""
    if step <= 0:
        return []
    return [p for p, o in enumerate(streaming_offsets(H, P)) if (step - o) % H == 0]
