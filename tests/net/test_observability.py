"""The swarm seen from outside: `p2ptrain status --json` and a real Prometheus server scraping live peers."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from p2ptrain.procs import free_port

from .procs import join, kill_all, wait_file, write_recipe

pytestmark = [pytest.mark.net, pytest.mark.timeout(240)]

REGIONS = ("us", "eu", "asia")


@dataclass
class LiveSwarm:
    tmp: Path
    maddrs: list[str]
    metrics_ports: list[int]
    procs: list[subprocess.Popen[bytes]]


def _scrape_steps(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("p2ptrain_inner_steps_total"))


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveSwarm]:
    """Three `p2ptrain join` processes in three regions, training until the tests are done with them."""
    tmp = tmp_path_factory.mktemp("observed")
    write_recipe(tmp, "observed")
    ports = [free_port() for _ in REGIONS]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(join(tmp, "p0", 100_000, [], metrics_port=ports[0], region=REGIONS[0]))
        maddrs = wait_file(tmp / "p0.maddrs", 90)
        for i in (1, 2):
            procs.append(join(tmp, f"p{i}", 100_000, maddrs, metrics_port=ports[i], region=REGIONS[i]))
        deadline = time.monotonic() + 120
        for i, port in enumerate(ports):  # every peer is past start-up and stepping
            while True:
                assert procs[i].poll() is None, (tmp / f"p{i}.log").read_text()[-2000:]
                assert time.monotonic() < deadline, f"peer {i} did not start training"
                try:
                    if _scrape_steps(port) >= 5:
                        break
                except OSError:
                    pass
                time.sleep(0.5)
        yield LiveSwarm(tmp, maddrs, ports, procs)
    finally:
        kill_all(procs)


def test_status_json_lists_all_three_peers_with_plausible_numbers(swarm: LiveSwarm) -> None:
    cmd = [sys.executable, "-m", "p2ptrain", "status", "--run-id", "observed", "--json"]
    for m in swarm.maddrs:
        cmd += ["--initial-peers", m]
    peers: list[dict] = []
    for _ in range(10):  # announcements refresh every heartbeat; allow a few reads for all three to show
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr[-2000:]
        peers = json.loads(res.stdout)
        if len(peers) == 3 and all(p["step"] > 0 for p in peers):
            break
        time.sleep(1.0)
    assert sorted(p["region"] for p in peers) == sorted(REGIONS), peers
    assert len({p["peer_id"] for p in peers}) == 3
    for p in peers:
        assert p["method"] == "streaming"
        assert p["step"] > 0
        assert p["tokens_per_second"] > 0
        assert math.isfinite(p["loss"]) and 0.0 < p["loss"] < 8.0  # byte-level: starts near ln 256 ≈ 5.5
        assert 0.0 <= p["last_seen_seconds"] < 10.0


@pytest.mark.skipif(shutil.which("prometheus") is None,
                    reason="no prometheus binary (Debian package `prometheus`; .ci/run installs it where it can)")
def test_a_real_prometheus_server_scrapes_two_peers(swarm: LiveSwarm, tmp_path: Path) -> None:
    targets = [f"127.0.0.1:{p}" for p in swarm.metrics_ports[:2]]
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        f"scrape_configs:\n  - job_name: p2ptrain\n    static_configs:\n      - targets: {json.dumps(targets)}\n")
    port = free_port()
    with open(tmp_path / "prometheus.log", "wb") as log:
        server = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                                   f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                   f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        query = urllib.parse.urlencode({"query": "p2ptrain_inner_steps_total"})
        found: dict[str, float] = {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(found) < 2:
            assert server.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
            try:
                body = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/query?{query}", timeout=5))
                assert body["status"] == "success", body
                found = {r["metric"]["instance"]: float(r["value"][1]) for r in body["data"]["result"]}
            except OSError:
                pass
            time.sleep(1.0)
        assert set(found) == set(targets), found
        assert all(v > 0 for v in found.values()), found
    finally:
        server.terminate()
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(5)
