"""Pipeline-parallel peers: a 2-stage gloo pipeline against the unsplit model, and a 2-stage peer
next to a 1-stage peer in one real swarm (hivemind DHT, libp2p on 127.0.0.1)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from p2ptrain.data import DataConfig
from p2ptrain.model import GPT, ModelConfig
from p2ptrain.pipeline import PipelineConfig, StageEnv
from p2ptrain.stages import StagePlan
from p2ptrain.trainer import Trainer, TrainerConfig

MODEL = ModelConfig(d_model=32, n_layers=4, n_heads=2, seq_len=16, tie_embeddings=False)
# A small clip so that clipping is active: the global norm across stages must match the unsplit one.
TRAINER = TrainerConfig(batch_size=4, warmup_steps=0, total_steps=10, grad_clip=0.05, lr=1e-2, device="cpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, MODEL.vocab_size, (TRAINER.batch_size, MODEL.seq_len), generator=g)
    y = torch.randint(0, MODEL.vocab_size, (TRAINER.batch_size, MODEL.seq_len), generator=g)
    return x, y


def _stage_worker(rank: int, world: int, port: int, out: str, schedule: str) -> None:
    torch.set_num_threads(1)
    from p2ptrain.pipeline import init_stage_group, make_stage_trainer

    env = StageEnv(rank, world, rank, "127.0.0.1", port)
    init_stage_group(env, torch.device("cpu"), timeout=60)
    try:
        plan = StagePlan.of(MODEL, world)
        tr = make_stage_trainer(MODEL, TRAINER, DataConfig(), PipelineConfig(stages=world, microbatches=2,
                                                                             schedule=schedule, timeout=60),
                                plan, env, torch.device("cpu"))
        x, y = _batch()
        loss = tr.forward_backward_batch(x, y)
        grads = {n: p.grad.clone() for n, p in tr.params.items()}
        _, norm = tr.optimizer_step(loss)
        torch.save({"loss": tr.last_loss, "norm": norm, "grads": grads,
                    "params": {n: p.detach().clone() for n, p in tr.params.items()}}, f"{out}/rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.net
@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["1f1b", pytest.param("gpipe", marks=pytest.mark.slow)])
def test_two_stage_pipeline_matches_unsplit_model(tmp_path: Path, schedule: str) -> None:
    """Loss, every parameter's gradient, the clipped global norm and the parameters after one AdamW step of
    a 2-stage gloo pipeline (2 micro-batches) equal the unsplit model's within 1e-5 relative."""
    mp.start_processes(_stage_worker, args=(2, _free_port(), str(tmp_path), schedule), nprocs=2, join=True,
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
