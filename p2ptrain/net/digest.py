"""The digest of payload bytes: BLAKE3, 32 bytes.

A verified round hashes every byte it moves several times on every member: its own shares as they are sent (the
commitments, net/pieces.py), the contributions to its part as they arrive (to check their signed roots), every
result chunk as it arrives (the sketches' seeds, net/tally.py), a carried shard's offer (net/offers.py). At the
scale the project is for (a 1B model's fragment: ~1 GB of fp32 a round) that is gigabytes of hashing per round
per peer, on the CPU beside the transfer. SHA-256 ran at 1.1 GB/s on this machine's cores (with the SHA
extensions), BLAKE3 at 4–5 GB/s on pieces of 32 kB and up, and it lets go of the GIL as hashlib does.

Small metadata (a result's header, a commitment, Merkle nodes over piece digests) keeps SHA-256: its cost is per
message, not per byte.
"""

from __future__ import annotations

import blake3

__all__ = ["Hasher", "digest", "hasher", "hexdigest"]

Hasher = blake3.blake3


def digest(data: bytes | bytearray | memoryview) -> bytes:
    """The 32-byte digest of ``data``."""
    return blake3.blake3(data).digest()


def hexdigest(data: bytes | bytearray | memoryview) -> str:
    """The digest of ``data`` as 64 hex characters."""
    return blake3.blake3(data).hexdigest()


def hasher() -> Hasher:
    """An incremental digest: ``update`` it with consecutive byte ranges, then ``digest()``."""
    return blake3.blake3()
