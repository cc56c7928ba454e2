"""``eval_every``: a peer logs the validation loss of θ during its run, with the time, apart from compute."""

from __future__ import annotations

import pytest

from p2ptrain.algo.methods import method_config
from p2ptrain.data import Corpus, DataConfig
from p2ptrain.net.memory import MemorySwarm
from p2ptrain.net.transport import Transport
from p2ptrain.peer import PeerConfig, make_peer
from p2ptrain.trainer import TrainerConfig, make_trainer

from .peers import MODEL


@pytest.mark.parametrize("name,knobs", [("ddp", {}), ("diloco", {"H": 4})])
def test_eval_every_logs_theta_loss_at_start_and_every_n_steps(name: str, knobs: dict, corpus: Corpus) -> None:
    swarm = MemorySwarm(join_window=0.2, ttl=3.0)
    tr = make_trainer(MODEL, TrainerConfig(batch_size=2, warmup_steps=2, total_steps=10), DataConfig(), corpus=corpus)
    initial = tr.evaluate().loss  # θ = the seeded initial model on every method

    async def transport() -> Transport:
        return swarm.transport("p0")

    cfg = PeerConfig(run_id="t", steps=10, step_seconds=0.05, join_window=0.2, join_timeout=10, heartbeat=0.3,
                     ttl=3.0, drain_timeout=10, warmup=0.0, eval_every=5)
    peer = make_peer(cfg, method_config(name, timeout=10, **knobs), tr, transport)
    summary = peer.run()
    assert [s for _t, s, _l, _e in peer.val_log] == [0, 5, 10]
    assert peer.val_log[0][2] == pytest.approx(initial, abs=1e-6)
    times = [t for t, *_ in peer.val_log]
    assert times == sorted(times) and times[0] >= peer.loop_started
    assert summary.eval_seconds > 0 and peer.val_log[-1][3] == pytest.approx(summary.eval_seconds)
    assert summary.eval_seconds < summary.loop_seconds
    if name == "ddp":  # θ is the live model: the last entry is its loss at step 10
        assert peer.val_log[-1][2] == pytest.approx(tr.evaluate().loss, abs=1e-6)


def test_eval_every_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="eval_every"):
        PeerConfig(eval_every=-1)
