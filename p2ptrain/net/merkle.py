"""A Merkle tree over a payload's piece hashes (the shape of RFC 6962's): what a contributor signs names all its
pieces, and one piece is shown with ``log2(n)`` hashes beside it instead of all ``n`` (net/claims.py ``Slice``).

A leaf is ``SHA-256(0x00 ‖ piece hash)``, a node ``SHA-256(0x01 ‖ left ‖ right)`` (the prefixes keep a leaf from
passing for a node); a tree of ``n > 1`` leaves splits at the largest power of two below ``n``. At the scale the
project is for (a 1B model's fragment part of ~10^8 values, pieces of 8 Ki values) a list of every piece's hash
was ~0.5 MB per audited slice; a path is 14 hashes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

__all__ = ["MAX_DEPTH", "MerkleTree", "merkle_path", "merkle_paths", "merkle_root", "root_from_path"]

#: More levels than any payload has (2^48 pieces): a longer path is refused before any hashing.
MAX_DEPTH = 48


def _leaf(sha: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + sha).digest()


def _node(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def _split(n: int) -> int:
    """The largest power of two below ``n`` (n > 1): the size of the left subtree."""
    return 1 << ((n - 1).bit_length() - 1)


def merkle_root(shas: Sequence[bytes]) -> bytes:
    """The root over ``shas`` (the pieces' digests, in order); of none, SHA-256 of nothing."""
    return MerkleTree(shas).root


class MerkleTree:
    """Every level of the tree over a list of piece hashes, hashed once: its root, and any piece's path.

    Built level by level: each level pairs the nodes of the one below from the left, and an odd last node goes up
    as it is. That is the tree split at the largest power of two below ``n`` (a left subtree is always complete), in
    one pass of ``n − 1`` node hashes and no recursion: 2048 pieces took 6–7 ms recursively, a 1B model's part
    has thousands, and an owner shows its contributions' slices to every auditor (keep the tree: net/claims.py)."""

    def __init__(self, shas: Sequence[bytes]) -> None:
        level = [_leaf(s) for s in shas]
        self.levels = [level]
        while len(level) > 1:
            up = [_node(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
            if len(level) % 2:
                up.append(level[-1])
            self.levels.append(up)
            level = up
        self.size = len(shas)

    @property
    def root(self) -> bytes:
        return self.levels[-1][0] if self.size else hashlib.sha256(b"").digest()

    def path(self, index: int) -> list[bytes]:
        """The hashes that lead from piece ``index`` to the root, the leaf's sibling first."""
        if not 0 <= index < self.size:
            raise IndexError(f"piece {index} of {self.size}")
        path = []
        for level in self.levels[:-1]:
            sibling = index ^ 1
            if sibling < len(level):  # (an odd last node has none at this level: it goes up as it is)
                path.append(level[sibling])
            index //= 2
        return path

    def paths(self, indices: Iterable[int]) -> list[list[bytes]]:
        return [self.path(i) for i in indices]


def merkle_path(shas: Sequence[bytes], index: int) -> list[bytes]:
    """The hashes that lead from piece ``index`` to the root, the leaf's sibling first."""
    return merkle_paths(shas, [index])[0]


def merkle_paths(shas: Sequence[bytes], indices: Sequence[int]) -> list[list[bytes]]:
    """:func:`merkle_path` of each of ``indices``, hashing the tree once for all of them."""
    if any(not 0 <= i < len(shas) for i in indices):
        raise IndexError(f"pieces {list(indices)} of {len(shas)}")
    return MerkleTree(shas).paths(indices)


def root_from_path(sha: bytes, index: int, n: int, path: Sequence[bytes]) -> bytes:
    """The root that piece ``index`` of ``n`` (whose digest is ``sha``) and ``path`` lead to (ValueError when the
    path has not the length a tree of ``n`` leaves gives that piece)."""
    if not 0 <= index < n or len(path) > MAX_DEPTH:
        raise ValueError(f"piece {index} of {n} with a path of {len(path)}")
    sides: list[bool] = []  # from the root down: whether the piece is in the right subtree
    while n > 1:
        k = _split(n)
        sides.append(index >= k)
        index, n = (index - k, n - k) if index >= k else (index, k)
    if len(sides) != len(path):
        raise ValueError(f"a path of {len(path)} hashes where the tree has {len(sides)} levels above the piece")
    h = _leaf(sha)
    for right, sibling in zip(reversed(sides), path, strict=True):
        h = _node(sibling, h) if right else _node(h, sibling)
    return h
