"""Addresses and identity files checked before anything starts; the multiaddr grammar is hivemind's."""

from __future__ import annotations

from pathlib import Path

import pytest
from hivemind.utils.multiaddr import Multiaddr

from p2ptrain.cli.netargs import check_identity, host_maddrs, initial_peers, parse_maddr
from p2ptrain.net.identity import Identity

ED = "12D3KooWAupgdBAYgxcu6EbnoP2EGJvaFrwAo795BwSsmnG11agR"
RSA = "QmUcCwXRJwDi6TxHmE181nq7Uidkn2HSwgRRBFiWnzMz9D"
VALID = [f"/ip4/127.0.0.1/tcp/31337/p2p/{ED}", f"/ip4/203.0.113.10/tcp/31337/p2p/{RSA}", "/ip4/0.0.0.0/tcp/0",
         "/ip6/::/tcp/31337", "/ip6/::1/udp/4001/quic", f"/dns4/boot.example.org/tcp/443/wss/p2p/{ED}",
         f"/dnsaddr/bootstrap.example.org/p2p/{RSA}", f"/ipfs/{RSA}", "/ip4/1.2.3.4/udp/5/quic-v1",
         f"/ip4/1.2.3.4/tcp/1/p2p/{ED}/p2p-circuit/p2p/{RSA}", "/ip4/1.2.3.4/tcp/1/", "/ip4/1.2.3.4", "/"]
INVALID = ["garbage", "", "ip4/1.2.3.4/tcp/1", "/ip4/999.1.1.1/tcp/1", "/ip4/1.2.3/tcp/1", "/ip6/nope/tcp/1",
           "/ip4/1.2.3.4/tcp/65536", "/ip4/1.2.3.4/tcp/-1", "/ip4/1.2.3.4/tcp/x", "/ip4/1.2.3.4/tcp",
           "/ip4//tcp/1", "/ipv4/1.2.3.4/tcp/1", f"/ip4/1.2.3.4/tcp/1/p2p/{ED[:-3]}", "/ip4/1.2.3.4/tcp/1/p2p/QmUhcQ",
           "/ip4/1.2.3.4/tcp/1/p2p/0OIl", "/ip4/1.2.3.4/tcp/1/noise"]


def _hivemind_parses(text: str) -> bool:
    try:
        Multiaddr(text)
    except Exception:  # its parse errors are ValueErrors, but some inputs raise others
        return False
    return True


@pytest.mark.parametrize("text", VALID + INVALID)
def test_the_grammar_is_hivemind_s(text: str) -> None:
    try:
        parse_maddr(text)
        ours = True
    except ValueError:
        ours = False
    assert ours == _hivemind_parses(text) == (text in VALID)


def test_what_each_flag_needs() -> None:
    assert initial_peers([f"/ip4/1.2.3.4/tcp/1/p2p/{ED},/ip4/1.2.3.5/tcp/1/p2p/{RSA}"]) == [
        f"/ip4/1.2.3.4/tcp/1/p2p/{ED}", f"/ip4/1.2.3.5/tcp/1/p2p/{RSA}"]
    with pytest.raises(ValueError, match="no /p2p/<peer id>"):
        initial_peers(["/ip4/1.2.3.4/tcp/1"])
    with pytest.raises(ValueError, match=r"--initial-peers garbage: a multiaddr begins with /"):
        initial_peers(["garbage"])
    assert host_maddrs(["/ip4/0.0.0.0/tcp/0"]) == ["/ip4/0.0.0.0/tcp/0"]  # listen on any free port: fine
    with pytest.raises(ValueError, match="no /tcp/PORT"):
        host_maddrs(["/ip4/0.0.0.0"])
    with pytest.raises(ValueError, match=r"--announce-maddrs /ip4/1\.2\.3\.4/tcp/0: port 0"):
        host_maddrs(["/ip4/1.2.3.4/tcp/0"], announce=True)
    assert host_maddrs(["/ip4/1.2.3.4/tcp/31337"], announce=True) == ["/ip4/1.2.3.4/tcp/31337"]


def test_identity_files(tmp_path: Path) -> None:
    check_identity(None)
    check_identity(tmp_path / "new.key")  # made at start
    good = tmp_path / "good.key"
    good.write_bytes(Identity.generate().private_pb())
    check_identity(good)
    bad = tmp_path / "bad.key"
    bad.write_bytes(b"garbage")
    with pytest.raises(ValueError, match=r"--identity .*bad.key: not a libp2p private key"):
        check_identity(bad)
    with pytest.raises(ValueError, match="does not exist"):
        check_identity(tmp_path / "no" / "k.key")
