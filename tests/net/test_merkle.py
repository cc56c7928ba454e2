"""The Merkle tree over a payload's piece hashes (net/merkle.py): roots against trees built by hand, every path of
trees of 1 to 17 leaves, larger trees against RFC 6962's recursive definition, and paths that are bent, short, long
or for another piece."""

from __future__ import annotations

import hashlib

import pytest

from p2ptrain.net.merkle import MerkleTree, merkle_path, merkle_paths, merkle_root, root_from_path


def _h(b: bytes) -> bytes:
    return hashlib.sha256(b).digest()


def _leaf(s: bytes) -> bytes:
    return _h(b"\x00" + s)


def _node(a: bytes, b: bytes) -> bytes:
    return _h(b"\x01" + a + b)


SHAS = [_h(bytes([i])) for i in range(17)]


def test_roots_are_the_trees_built_by_hand() -> None:
    s = SHAS
    l0, l1, l2, l3, l4 = (_leaf(x) for x in s[:5])
    assert merkle_root([]) == _h(b"")
    assert merkle_root(s[:1]) == l0
    assert merkle_root(s[:2]) == _node(l0, l1)
    assert merkle_root(s[:3]) == _node(_node(l0, l1), l2)
    assert merkle_root(s[:4]) == _node(_node(l0, l1), _node(l2, l3))
    assert merkle_root(s[:5]) == _node(_node(_node(l0, l1), _node(l2, l3)), l4)
    # a leaf cannot pass for a node: the same hashes one level up give another root
    assert merkle_root([_node(l0, l1), _node(l2, l3)]) != merkle_root(s[:4])


@pytest.mark.parametrize("n", range(1, 18))
def test_every_piece_leads_to_the_root_along_its_path(n: int) -> None:
    shas, top = SHAS[:n], merkle_root(SHAS[:n])
    for i in range(n):
        path = merkle_path(shas, i)
        assert len(path) <= (n - 1).bit_length()
        assert root_from_path(shas[i], i, n, path) == top
        if n > 1:
            other = (i + 1) % n
            assert root_from_path(shas[other], i, n, path) != top  # another piece at this place
            bent = [bytes(32), *path[1:]]
            assert root_from_path(shas[i], i, n, bent) != top
            with pytest.raises(ValueError):
                root_from_path(shas[i], i, n, path[:-1])
        with pytest.raises(ValueError):
            root_from_path(shas[i], i, n, [*path, bytes(32)])
    assert merkle_paths(shas, range(n)) == [merkle_path(shas, i) for i in range(n)]  # one tree for several paths


def test_a_path_is_checked_against_the_grid() -> None:
    path = merkle_path(SHAS[:5], 4)
    assert len(path) == 1  # the fifth leaf hangs one level below the root
    with pytest.raises(ValueError):
        root_from_path(SHAS[4], 5, 5, path)  # no piece 5 of 5
    with pytest.raises(IndexError):
        merkle_path(SHAS[:5], 5)
    with pytest.raises(ValueError):
        root_from_path(SHAS[0], 0, 1 << 60, [bytes(32)] * 60)  # deeper than any payload


def _rfc_root(leaves: list[bytes]) -> bytes:
    """RFC 6962's definition, recursively: split at the largest power of two below n."""
    if len(leaves) == 1:
        return leaves[0]
    k = 1 << ((len(leaves) - 1).bit_length() - 1)
    return _node(_rfc_root(leaves[:k]), _rfc_root(leaves[k:]))


@pytest.mark.parametrize("n", [*range(18, 70), 1000, 1025, 2049])
def test_the_tree_built_level_by_level_is_the_split_tree(n: int) -> None:
    """MerkleTree pairs each level from the left and lifts an odd last node: the root and every path are those of
    the tree split at the largest power of two (root_from_path walks that one)."""
    shas = [_h(i.to_bytes(4, "big")) for i in range(n)]
    tree = MerkleTree(shas)
    assert tree.root == _rfc_root([_leaf(s) for s in shas]) == merkle_root(shas)
    for i in sorted({0, 1, n // 3, n // 2, n - 2, n - 1}):
        assert root_from_path(shas[i], i, n, tree.path(i)) == tree.root
    with pytest.raises(IndexError):
        tree.path(n)
