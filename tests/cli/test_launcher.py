"""The stage launcher's per-stage ports and file names."""

from __future__ import annotations

from pathlib import Path

from p2ptrain.cli.launcher import offset_port, per_rank


def test_offset_port_moves_the_first_tcp_or_udp_port_and_keeps_zero() -> None:
    assert offset_port("/ip4/0.0.0.0/tcp/31400", 1) == "/ip4/0.0.0.0/tcp/31401"
    assert offset_port("/ip4/1.2.3.4/udp/5000/quic", 2) == "/ip4/1.2.3.4/udp/5002/quic"
    assert offset_port("/ip4/127.0.0.1/tcp/0", 3) == "/ip4/127.0.0.1/tcp/0"
    assert offset_port("/ip4/203.0.113.10/tcp/31400/p2p/QmX", 0) == "/ip4/203.0.113.10/tcp/31400/p2p/QmX"


def test_per_rank_names_each_stage_file() -> None:
    assert per_rank(None, 1, 2) is None
    assert per_rank(Path("out/peer.json"), 0, 1) == Path("out/peer.json")
    assert per_rank(Path("out/peer.json"), 1, 2) == Path("out/peer.rank1.json")
