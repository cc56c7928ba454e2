"""A private swarm (shared swarm key): peers without the key, or with another, get nothing accepted."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from p2ptrain.collective.codecs import get_codec
from p2ptrain.net.auth import SwarmKey, generate_key_file
from p2ptrain.net.transport import JoinRequest, PeerInfo, RoundFailed

SECRET = b"0123456789abcdef0123456789abcdef-private-swarm"


def test_keys_are_checked_and_never_shown(tmp_path: Path) -> None:
    key = SwarmKey(SECRET)
    msg = key.seal({"a": 1, "b": b"x"}, "peer", "part", "run")
    assert key.verify(msg, "peer", "part", "run")
    assert not key.verify(msg, "other", "part", "run")  # bound to its sender ...
    assert not key.verify(msg, "peer", "join", "run")  # ... its protocol ...
    assert not key.verify({**msg, "a": 2}, "peer", "part", "run")  # ... and its content
    assert not SwarmKey(SECRET[::-1]).verify(msg, "peer", "part", "run")
    assert not key.verify({"a": 1}, "peer", "part", "run")
    assert SECRET.decode() not in repr(key) + str(key)
    made = generate_key_file(tmp_path / "k")
    assert (tmp_path / "k").stat().st_mode & 0o077 == 0  # owner-only
    assert SwarmKey.load(tmp_path / "k").fingerprint == made.fingerprint
    with pytest.raises(FileExistsError):
        generate_key_file(tmp_path / "k")
    (tmp_path / "short").write_text("abc")
    with pytest.raises(ValueError, match="too short"):
        SwarmKey.load(tmp_path / "short")


@pytest.mark.net
@pytest.mark.timeout(120)
def test_an_unkeyed_peer_gets_nothing_accepted(caplog: pytest.LogCaptureFixture) -> None:
    from p2ptrain.net.swarm import HivemindTransport, SwarmConfig

    caplog.set_level(logging.DEBUG, logger="p2ptrain")

    async def go() -> None:
        key = SwarmKey(SECRET)
        ts: list[Any] = []
        try:
            a = await HivemindTransport.create(SwarmConfig(run_id="priv", join_window=1.0, swarm_key=key))
            ts.append(a)
            maddrs = await a.visible_maddrs()
            b = await HivemindTransport.create(SwarmConfig(run_id="priv", initial_peers=maddrs, join_window=1.0,
                                                           swarm_key=key))
            open_peer = await HivemindTransport.create(SwarmConfig(run_id="priv", initial_peers=maddrs))
            wrong = await HivemindTransport.create(SwarmConfig(run_id="priv", initial_peers=maddrs,
                                                               swarm_key=SwarmKey(SECRET[::-1])))
            ts += [b, open_peer, wrong]
            for t in ts:
                await t.announce(PeerInfo(peer_id=t.peer_id))
            for _ in range(50):
                if len(await a.peers()) == 2 and len(await b.peers()) == 2:
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)
            # Announcements: the keyed peers see each other only.
            for t in (a, b):
                assert {p.peer_id for p in await t.peers()} == {a.peer_id, b.peer_id}
            # The outsiders are told, once, that the run refuses them and why; the open one no longer takes the
            # keyed peers for members (it used to, and saw only "stream closed mid-frame").
            assert {p.peer_id for p in await open_peer.peers()} <= {open_peer.peer_id}
            assert {p.peer_id for p in await wrong.peers()} <= {wrong.peer_id}
            assert open_peer.outsider_said and wrong.outsider_said and not a.outsider_said
            # Streams: a join request or a tensor from outside is refused (no reply at all).
            for outsider in (open_peer, wrong):
                req = JoinRequest(key="r", peer_id=outsider.peer_id, weight=1.0, fragment=0)
                with pytest.raises(RoundFailed):
                    await outsider._call(a.peer_id, "join", req.to_wire(), timeout=3)
                part = {"key": "r", "phase": 0, "part": 0, "weight": 1.0, "fp": None, "codec": "fp32", "numel": 4,
                        "data": get_codec("fp32").encode(torch.full((4,), 1e6))}
                with pytest.raises(RoundFailed):
                    await outsider._call(a.peer_id, "part", part, timeout=3)
                assert outsider.peer_id in a.guard.strikes
            assert ("r", 0) not in a._mail or not a._mail[("r", 0)].contribs
            # The keyed peers still average, exactly, among themselves.

            async def one(t: Any, v: float) -> torch.Tensor:
                g = await t.form_group(JoinRequest(key="ok", peer_id=t.peer_id, weight=1.0, fragment=0), None,
                                       timeout=10)
                assert set(g.members) == {a.peer_id, b.peer_id}
                return (await t.allreduce(g, 0, [torch.full((8,), v)], 1.0, get_codec("fp32"), timeout=8)).tensors[0]

            out = await asyncio.gather(one(a, 1.0), one(b, 3.0))
            assert all(torch.equal(o, torch.full((8,), 2.0)) for o in out)
        finally:
            await asyncio.gather(*(t.aclose() for t in ts), return_exceptions=True)

    asyncio.run(go())
    text = caplog.text
    assert SECRET.decode() not in text and SECRET[::-1].decode() not in text
    assert "the run is private (its records carry a swarm key's tag): join with --swarm-key" in text
    assert f"not tagged with this peer's swarm key (fingerprint {SwarmKey(SECRET[::-1]).fingerprint})" in text
    assert SwarmKey(SECRET).fingerprint not in text  # the swarm's own key is not hinted at either
