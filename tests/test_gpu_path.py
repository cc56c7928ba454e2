"""The GPU path: pinned host snapshots on a side stream, codecs on the GPU, bf16 autocast, torch.compile.

The CUDA tests run where CUDA exists; here (CPU only) they are skipped with the reason, and the CPU
fallbacks of the same code paths are checked instead."""

from __future__ import annotations

import pytest
import torch

from p2ptrain.collective.codecs import CODECS, get_codec
from p2ptrain.data import DataConfig
from p2ptrain.model import GPT, ModelConfig
from p2ptrain.snapshot import HostSnapshots
from p2ptrain.trainer import Trainer, TrainerConfig, make_trainer

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
MODEL = ModelConfig(d_model=64, n_layers=2, n_heads=2, seq_len=32)


# ------------------------------------------------------------------ CPU fallbacks (run everywhere)
def test_cpu_snapshot_is_a_ready_fp32_copy_that_does_not_alias() -> None:
    snaps = HostSnapshots(torch.device("cpu"))
    assert snaps.stream is None
    p = torch.randn(100, dtype=torch.bfloat16)
    pending = snaps.take([p])
    assert pending.ready()
    (copy,) = pending.wait()
    assert copy.dtype == torch.float32 and torch.equal(copy, p.float())
    p.add_(1)
    assert not torch.equal(copy, p.float())  # a copy, not a view


def test_codecs_stay_on_the_cpu_without_a_gpu_and_give_the_same_bytes() -> None:
    x = torch.randn(70_000)
    for name in CODECS:
        plain, with_cpu = get_codec(name), get_codec(name, "cpu")
        assert plain._compute_device(x) is None and with_cpu._compute_device(x) is None
        assert plain.encode(x) == with_cpu.encode(x)


def test_compile_flag_keeps_parameter_names(corpus: object) -> None:
    plain = make_trainer(MODEL, TrainerConfig(batch_size=2, device="cpu"), DataConfig(), corpus=corpus)  # type: ignore[arg-type]
    compiled = make_trainer(MODEL, TrainerConfig(batch_size=2, device="cpu", compile=True), DataConfig(),
                            corpus=corpus)  # type: ignore[arg-type]
    assert list(compiled.params) == list(plain.params)
    assert list(compiled.state_dict()["model"]) == list(plain.state_dict()["model"])


# ------------------------------------------------------------------ CUDA
@CUDA
def test_cuda_snapshot_is_pinned_and_not_overwritten_by_later_writes() -> None:
    dev = torch.device("cuda")
    snaps = HostSnapshots(dev)
    p = torch.randn(8_000_000, device=dev)
    expected = p.cpu()
    pending = snaps.take([p])
    p.mul_(3).add_(1)  # queued right after: the compute stream must wait for the copy
    (copy,) = pending.wait()
    assert copy.device.type == "cpu" and copy.is_pinned() and copy.dtype == torch.float32
    assert torch.equal(copy, expected)
    torch.cuda.synchronize()
    assert torch.equal(p.cpu(), expected * 3 + 1)


@CUDA
def test_cuda_trainer_uses_bf16_autocast_and_keeps_the_outer_state_on_the_host(corpus: object) -> None:
    tr = make_trainer(MODEL, TrainerConfig(batch_size=4, device="cuda"), DataConfig(), corpus=corpus)  # type: ignore[arg-type]
    x, _ = tr.stream.next_batch()
    with tr._autocast():
        assert tr.model(x.cuda()).dtype == torch.bfloat16
    st = tr.step()
    assert torch.isfinite(torch.tensor(st.loss))
    names = list(tr.params)[:3]
    snap = tr.snapshot(names)
    assert all(t.device.type == "cpu" and t.is_pinned() for t in snap)
    tr.apply_outer(names, [t + 1 for t in snap])
    assert torch.equal(tr.params[names[0]].detach().cpu(), snap[0] + 1)
    theta = {n: t.detach().cpu() for n, t in tr.params.items()}
    assert tr.evaluate(theta).loss == pytest.approx(tr.evaluate().loss, rel=1e-3)


@CUDA
@pytest.mark.parametrize("name", sorted(CODECS))
def test_cuda_codecs_give_the_cpu_bytes(name: str) -> None:
    x = torch.randn(300_001) * torch.logspace(-3, 3, 300_001)
    cpu = get_codec(name).encode(x)
    on_gpu_input = get_codec(name).encode(x.cuda())
    from_host_to_gpu = get_codec(name, "cuda").encode(x.pin_memory())
    assert on_gpu_input == cpu and from_host_to_gpu == cpu
    if name != "fp32":
        assert get_codec(name, "cuda")._compute_device(x) == torch.device("cuda")


@CUDA
def test_cuda_compiled_blocks_train_like_eager_ones() -> None:
    torch.manual_seed(0)
    eager = Trainer(GPT(MODEL), TrainerConfig(device="cuda"), stream=None, val_set=[])  # type: ignore[arg-type]
    torch.manual_seed(0)
    compiled = Trainer(GPT(MODEL), TrainerConfig(device="cuda", compile=True), stream=None, val_set=[])  # type: ignore[arg-type]
    x = torch.randint(0, 256, (4, 32), device="cuda")
    with eager._autocast():
        a = eager.model.loss(x, x)
    with compiled._autocast():
        b = compiled.model.loss(x, x)
    assert b.item() == pytest.approx(a.item(), rel=2e-2)
    b.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in compiled.model.parameters())
