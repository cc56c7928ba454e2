"""Entry points: our bootstrap node (stable identity), a stock hivemind-dht node, and life after the bootstrap dies."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from p2ptrain.collective.codecs import get_codec
from p2ptrain.net.swarm import HivemindTransport, SwarmConfig
from p2ptrain.net.transport import JoinRequest, PeerInfo
from p2ptrain.procs import free_port

pytestmark = [pytest.mark.net, pytest.mark.timeout(180)]


def _bootstrap(tmp: Path, port: int, identity: Path) -> tuple[subprocess.Popen[bytes], list[str]]:
    out = tmp / f"boot-{time.monotonic_ns()}.maddrs"
    proc = subprocess.Popen([sys.executable, "-m", "p2ptrain", "bootstrap", "--host-maddrs",
                             f"/ip4/127.0.0.1/tcp/{port}", "--identity", str(identity), "--maddrs-file", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if out.exists() and out.read_text().strip():
            return proc, out.read_text().split()
        if proc.poll() is not None:
            raise RuntimeError(f"bootstrap exited with {proc.returncode}")
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError("bootstrap did not start")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


async def _pair_round(initial: list[str], run: str) -> list[HivemindTransport]:
    """Two transports join through ``initial``, see each other, and average a tensor."""
    ts = [await HivemindTransport.create(SwarmConfig(run_id=run, initial_peers=initial, join_window=1.0))
          for _ in range(2)]
    for t in ts:
        await t.announce(PeerInfo(peer_id=t.peer_id))
    for _ in range(50):
        seen = [len(await t.peers()) for t in ts]
        if seen == [2, 2]:
            break
        await asyncio.sleep(0.1)

    async def one(t: HivemindTransport, v: float) -> torch.Tensor:
        g = await t.form_group(JoinRequest(key="r", peer_id=t.peer_id, weight=1.0, fragment=0), None, timeout=10)
        assert len(g.members) == 2
        return (await t.allreduce(g, 0, [torch.full((10,), v)], 1.0, get_codec("fp32"), timeout=10)).tensors[0]

    out = await asyncio.gather(one(ts[0], 1.0), one(ts[1], 3.0))
    assert all(torch.equal(o, torch.full((10,), 2.0)) for o in out)
    return ts


def test_bootstrap_identity_gives_a_stable_address(tmp_path: Path) -> None:
    port, key = free_port(), tmp_path / "boot.key"
    proc, first = _bootstrap(tmp_path, port, key)
    _stop(proc)
    assert key.exists()
    proc, second = _bootstrap(tmp_path, port, key)
    try:
        assert first == second and first[0].startswith(f"/ip4/127.0.0.1/tcp/{port}/p2p/")
    finally:
        _stop(proc)


def test_peers_meet_through_our_bootstrap_and_survive_its_death(tmp_path: Path) -> None:
    proc, maddrs = _bootstrap(tmp_path, free_port(), tmp_path / "k")

    async def go() -> None:
        ts = await _pair_round(maddrs, "viaboot")
        try:
            proc.kill()  # the entry point dies (SIGKILL); the swarm knows itself
            proc.wait(10)
            live = await ts[0].visible_maddrs()
            late = await HivemindTransport.create(SwarmConfig(run_id="viaboot", initial_peers=live))
            ts.append(late)
            await late.announce(PeerInfo(peer_id=late.peer_id))
            # (a wall-clock bound, not a count of tries: beside the churn and link benchmarks the late peer read no
            # record at all, not even its own, for 50 tries of 0.2 s; the swarm knowing itself is the claim, not how
            # soon on a loaded machine)
            deadline = time.monotonic() + 30.0
            while time.monotonic() < deadline:
                if len(await late.peers()) >= 2:
                    break
                await asyncio.sleep(0.2)
            assert {p.peer_id for p in await late.peers()} >= {ts[0].peer_id, ts[1].peer_id}
        finally:
            await asyncio.gather(*(t.aclose() for t in ts), return_exceptions=True)

    try:
        asyncio.run(go())
    finally:
        _stop(proc)


@pytest.mark.skipif(shutil.which("hivemind-dht") is None and not Path(sys.executable).with_name("hivemind-dht").exists(),
                    reason="hivemind-dht console script not installed")
def test_a_stock_hivemind_dht_node_works_as_bootstrap(tmp_path: Path) -> None:
    exe = shutil.which("hivemind-dht") or str(Path(sys.executable).with_name("hivemind-dht"))
    proc = subprocess.Popen([exe, "--host_maddrs", f"/ip4/127.0.0.1/tcp/{free_port()}"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        maddr = None
        deadline = time.monotonic() + 60
        while maddr is None and time.monotonic() < deadline:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            m = re.search(r"(/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+)", line)
            maddr = m.group(1) if m else None
        assert maddr, "hivemind-dht printed no multiaddr"

        async def go() -> None:
            ts = await _pair_round([maddr], "stock")
            await asyncio.gather(*(t.aclose() for t in ts), return_exceptions=True)

        asyncio.run(go())
    finally:
        _stop(proc)


def test_a_peer_started_again_with_its_key_file_is_the_same_peer(tmp_path: Path) -> None:
    """A key file that does not exist yet (in a folder not made yet: a new checkpoint folder) is made at start, an
    ed25519 key (12D3KooW… ids, as drawn keys are; the daemon would make RSA), owner-readable only; started again
    with it, the peer has the same id: a restart with ``--resume`` leaves no ghost id that the others count live."""
    from p2ptrain.net.identity import Identity

    key = tmp_path / "ck" / "identity.key"

    async def once() -> str:
        t = await HivemindTransport.create(SwarmConfig(run_id="same", identity_path=str(key)))
        try:
            return t.peer_id
        finally:
            await t.aclose()

    first = asyncio.run(once())
    assert first.startswith("12D3KooW") and Identity.load(key).peer_id == first
    assert key.stat().st_mode & 0o077 == 0
    assert asyncio.run(once()) == first
