"""A peer configured by ``P2PTRAIN_*`` variables only (as under docker, systemd or Kubernetes) joins a real swarm."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .procs import join, kill_all, wait_file, write_recipe

pytestmark = [pytest.mark.net, pytest.mark.timeout(240)]


def test_a_peer_configured_by_environment_only_joins_and_shares_rounds(tmp_path: Path) -> None:
    write_recipe(tmp_path, "envjoin")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(join(tmp_path, "a", 100_000, [], region="us"))  # the swarm: one peer, configured by flags
        maddrs = wait_file(tmp_path / "a.maddrs", 90)
        env = {k: v for k, v in os.environ.items() if not k.startswith("P2PTRAIN_")}
        env |= {"OMP_NUM_THREADS": "1", "P2PTRAIN_CONFIG": str(tmp_path / "recipe.toml"),
                "P2PTRAIN_INITIAL_PEERS": ",".join(maddrs), "P2PTRAIN_RUN_ID": "envjoin", "P2PTRAIN_REGION": "eu",
                "P2PTRAIN_STEPS": "40", "P2PTRAIN_JSON": str(tmp_path / "b.json"),
                "P2PTRAIN_MADDRS_FILE": str(tmp_path / "b.maddrs"), "P2PTRAIN_QUIET": "1",
                "P2PTRAIN_METRICS_PORT": "0", "P2PTRAIN_LOG_LEVEL": "INFO",
                "P2PTRAIN_HOST_MADDRS": "/ip4/127.0.0.1/tcp/0"}
        with open(tmp_path / "b.log", "wb") as log:
            b = subprocess.Popen([sys.executable, "-m", "p2ptrain", "join"], stdout=log, stderr=subprocess.STDOUT,
                                 env=env)
        procs.append(b)
        assert b.wait(150) == 0, (tmp_path / "b.log").read_text()[-3000:]
        summary = json.loads((tmp_path / "b.json").read_text())
        assert summary["steps"] == 40
        assert summary["rounds_shared"] >= 1  # it met the swarm: rounds with the peer it was pointed at
        assert (tmp_path / "b.maddrs").read_text().strip().startswith("/ip4/127.0.0.1/tcp/")
        assert "run envjoin" in (tmp_path / "b.log").read_text()
    finally:
        kill_all(procs)
