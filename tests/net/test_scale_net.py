"""The network-only scale benchmark's core (bench/scale_net.py): 8 real libp2p peers in one process, 2 regions."""

from __future__ import annotations

import pytest

from bench.scale_net import NetScaleConfig, daemon_pids, run_net_sync

pytestmark = [pytest.mark.net, pytest.mark.timeout(90)]


def test_eight_peers_in_two_regions_agree_on_every_round() -> None:
    before = daemon_pids()
    cfg = NetScaleConfig(k=8, regions=2, rounds=2, numel=1 << 16, join_window=10.0, join_timeout=30.0,
                         round_timeout=30.0, settle_timeout=30.0)
    res = run_net_sync(cfg)
    assert "error" not in res, res.get("error")
    assert res["transports_started"] == 8 and res["daemons_seen"] >= 8
    assert res["rounds_run"] == 2 and res["failed"] == 0, [r["errors"] for r in res["rounds"]]
    assert res["modes"] == ["hierarchical"]  # 2 regions of 4: region by region (as sync.RoundRunner dispatches)
    assert res["agreement"]  # bitwise equal on every member, the float64 weighted mean within 1e-5
    for r in res["rounds"]:
        assert r["members_done"] == 8 and r["contributors"] == 8 and r["max_abs_error"] <= 1e-5
        assert r["bytes_sent_mean"] > 0
    assert res["daemons_left"] == [] and daemon_pids() == before  # every daemon it started is gone
