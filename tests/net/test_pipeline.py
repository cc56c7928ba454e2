"""Pipeline-parallel peers: a 2-stage gloo pipeline against the unsplit model, and a 2-stage peer
next to a 1-stage peer in one real swarm (hivemind DHT, libp2p on 127.0.0.1)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from p2ptrain.data import DataConfig
from p2ptrain.model import GPT, ModelConfig
from p2ptrain.pipeline import PipelineConfig, StageEnv
from p2ptrain.procs import free_port, wait_lines
from p2ptrain.stages import StagePlan
from p2ptrain.trainer import Trainer, TrainerConfig

from .procs import join

MODEL = ModelConfig(d_model=32, n_layers=4, n_heads=2, seq_len=16, tie_embeddings=False)
# A small clip so that clipping is active: the global norm across stages must match the unsplit one.
TRAINER = TrainerConfig(batch_size=4, warmup_steps=0, total_steps=10, grad_clip=0.05, lr=1e-2, device="cpu")


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, MODEL.vocab_size, (TRAINER.batch_size, MODEL.seq_len), generator=g)
    y = torch.randint(0, MODEL.vocab_size, (TRAINER.batch_size, MODEL.seq_len), generator=g)
    return x, y


def _stage_worker(rank: int, world: int, port: int, out: str, schedule: str, device_type: str = "cpu") -> None:
    torch.set_num_threads(1)
    from p2ptrain.pipeline import init_stage_group, make_stage_trainer, stage_device

    env = StageEnv(rank, world, rank, "127.0.0.1", port)
    device = stage_device("auto" if device_type == "cuda" else "cpu", rank)  # cuda:RANK, nccl
    init_stage_group(env, device, timeout=60)
    try:
        plan = StagePlan.of(MODEL, world)
        tr = make_stage_trainer(MODEL, TRAINER, DataConfig(), PipelineConfig(stages=world, microbatches=2,
                                                                             schedule=schedule, timeout=60),
                                plan, env, device)
        x, y = _batch()
        loss = tr.forward_backward_batch(x, y)
        grads = {n: p.grad.to("cpu", copy=True) for n, p in tr.params.items()}
        _, norm = tr.optimizer_step(loss)
        torch.save({"loss": tr.last_loss, "norm": norm, "grads": grads,
                    "params": {n: p.detach().to("cpu", copy=True) for n, p in tr.params.items()}}, f"{out}/rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.net
@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["1f1b", pytest.param("gpipe", marks=pytest.mark.slow)])
def test_two_stage_pipeline_matches_unsplit_model(tmp_path: Path, schedule: str) -> None:
    """Loss, every parameter's gradient, the clipped global norm and the parameters after one AdamW step of
    a 2-stage gloo pipeline (2 micro-batches) equal the unsplit model's within 1e-5 relative."""
    mp.start_processes(_stage_worker, args=(2, free_port(), str(tmp_path), schedule), nprocs=2, join=True,
                       start_method="spawn")
    stages = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TRAINER.seed)
        ref = Trainer(GPT(MODEL), TRAINER, stream=None, val_set=[])  # type: ignore[arg-type]
    x, y = _batch()
    loss = ref.model.loss(x, y)
    loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in ref.params.items()}
    _, ref_norm = ref.optimizer_step()

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    assert ref_norm > TRAINER.grad_clip  # clipping is active, so the global norm matters
    for st in stages:
        assert abs(st["loss"] - loss.item()) <= 1e-5 * loss.item()
        assert abs(st["norm"] - ref_norm) <= 1e-5 * ref_norm
    seen: set[str] = set()
    for st in stages:
        assert not seen & set(st["grads"]), "a parameter sits in two stages"
        seen |= set(st["grads"])
        for n, g in st["grads"].items():
            assert rel(g, ref_grads[n]) <= 1e-5, (n, rel(g, ref_grads[n]))
            assert rel(st["params"][n], ref.params[n].detach()) <= 1e-5, n
    assert seen == set(ref_grads)  # the stages together hold the whole model, each parameter once


RECIPE = """
preset = "tiny"
[model]
d_model = 32
n_layers = 4
n_heads = 2
seq_len = 32
tie_embeddings = false
[trainer]
batch_size = 2
warmup_steps = 2
[method]
name = "streaming"
H = 8
P = 2
tau = 2
codec = "fp32"
timeout = 8.0
[peer]
run_id = "{run_id}"
step_seconds = 0.15
join_window = 1.0
heartbeat = 0.5
ttl = 3.0
min_step_seconds = 0.15
"""


def _join(tmp: Path, name: str, initial: list[str], extra: list[str]) -> subprocess.Popen[bytes]:
    return join(tmp, name, 100_000, initial, metrics_port=-1, extra=["--pipeline-timeout", "60", *extra])


@pytest.mark.net
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_two_stage_peer_and_whole_model_peer_share_a_swarm(tmp_path: Path) -> None:
    """A 2-stage gloo pipeline peer and a whole-model peer of one run (S_run = 2: two namespaces) train
    together over real libp2p; in each stage namespace both apply the same rounds, with bitwise equal θ."""
    (tmp_path / "recipe.toml").write_text(RECIPE.format(run_id="pipe"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        whole = _join(tmp_path, "whole", [], ["--run-stages", "2", "--region", "us"])
        procs.append(whole)
        addrs = wait_lines(tmp_path / "whole.maddrs", 60, whole)
        piped = _join(tmp_path, "piped", addrs[:1], ["--pipeline-stages", "2", "--region", "eu"])
        procs.append(piped)
        for r in range(2):
            wait_lines(tmp_path / f"piped.rank{r}.maddrs", 60, piped)
        # Both are training now (addresses are written once a peer has started): ~15 streaming rounds.
        for _ in range(12):
            time.sleep(1.0)
            assert piped.poll() is None and whole.poll() is None, "a peer exited early"
        for p in procs:
            p.send_signal(signal.SIGTERM)  # the launcher forwards it: both stages leave after the same step
        for p in procs:
            assert p.wait(60) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    w = json.loads((tmp_path / "whole.json").read_text())
    ranks = [json.loads((tmp_path / f"piped.rank{r}.json").read_text()) for r in range(2)]
    assert [s["namespace"] for s in w["stages"]] == ["pipe.stage0of2", "pipe.stage1of2"]
    assert ranks[0]["steps"] == ranks[1]["steps"] > 0  # the stages stepped in lockstep
    for k in range(2):
        mine, theirs = w["stages"][k], ranks[k]["stages"][0]
        assert theirs["namespace"] == mine["namespace"] and theirs["peer_id"] != mine["peer_id"]
        common = set(mine["applied"]) & set(theirs["applied"])
        both = {key for key in common if mine["contributors"][key] == theirs["contributors"][key] == 2}
        assert len(both) >= 2, (sorted(mine["contributors"].items()), sorted(theirs["contributors"].items()))
        for key in common:
            assert mine["applied"][key] == theirs["applied"][key], f"stage {k}: θ differs after round {key}"
        # No stage holds the whole model: the pipelined stage's θ is its own slice only.
        assert set(theirs["theta"]) == set(mine["theta"])
        assert not set(ranks[k]["stages"][0]["theta"]) & set(ranks[1 - k]["stages"][0]["theta"])



@pytest.mark.net
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_killed_stage_stops_the_whole_pipelined_peer(tmp_path: Path) -> None:
    """SIGKILL one stage of a training 2-stage peer: the other stage does not hang in its collectives,
    the launcher stops it and exits with an error, and no process of the peer is left."""
    (tmp_path / "recipe.toml").write_text(RECIPE.format(run_id="crash"))
    piped = _join(tmp_path, "piped", [], ["--pipeline-stages", "2", "--pipeline-timeout", "20"])
    try:
        for r in range(2):
            wait_lines(tmp_path / f"piped.rank{r}.maddrs", 60, piped)
        log = (tmp_path / "piped.log").read_text()
        pids = [int(x) for x in re.search(r"stage processes \[(\d+), (\d+)\]", log).groups()]  # type: ignore[union-attr]
        time.sleep(2.0)  # both are stepping through the pipeline
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        code = piped.wait(70)
        assert code != 0
        assert time.monotonic() - t0 < 60
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if piped.poll() is None:
            piped.kill()
            piped.wait(10)


@pytest.mark.net
@pytest.mark.timeout(180)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (an nccl pipeline, one GPU per stage)")
def test_two_stage_nccl_pipeline_matches_unsplit_model_in_bf16(tmp_path: Path) -> None:
    """The GPU path: stages on cuda:0 and cuda:1 over nccl with bf16 autocast match the unsplit model run
    under the same autocast on one GPU (bf16 tolerance)."""
    mp.start_processes(_stage_worker, args=(2, free_port(), str(tmp_path), "1f1b", "cuda"), nprocs=2, join=True,
                       start_method="spawn")
    stages = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TRAINER.seed)
        ref = Trainer(GPT(MODEL), replace(TRAINER, device="cuda:0"), stream=None, val_set=[])  # type: ignore[arg-type]
    x, y = _batch()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = ref.model.loss(x.cuda(), y.cuda())
    loss.backward()
    for st in stages:
        assert abs(st["loss"] - loss.item()) <= 2e-2 * loss.item()
        for n, g in st["grads"].items():
            ref_g = ref.params[n].grad.cpu()
            assert float((g - ref_g).norm() / ref_g.norm().clamp_min(1e-30)) <= 5e-2, n
