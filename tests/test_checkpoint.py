from __future__ import annotations

from pathlib import Path

import pytest
import torch

from p2ptrain.checkpoint import (
    CheckpointDir,
    CheckpointError,
    NonFiniteState,
    pack,
    read_checkpoint,
    unpack,
    write_checkpoint,
)
from p2ptrain.data import Corpus
from p2ptrain.model import ModelConfig
from p2ptrain.single import TrainJob, run_train
from p2ptrain.trainer import TrainerConfig, make_trainer


def test_pack_round_trip_keeps_types() -> None:
    state = {"a": torch.arange(6.0).view(2, 3), 3: {"x": [1, 2.5, None, True]}, "s": "hi",
             "big": 2**100, "t": (1, torch.ones(2))}
    tree, tensors = pack(state)
    back = unpack(tree, tensors)
    assert torch.equal(back["a"], state["a"]) and back[3] == {"x": [1, 2.5, None, True]}
    assert back["big"] == 2**100 and back["s"] == "hi" and torch.equal(back["t"][1], torch.ones(2))


def test_file_round_trip(tmp_path: Path) -> None:
    state = {"w": torch.randn(4, 4), "opt": {0: {"step": torch.tensor(3.0)}}, "n": 7}
    p = write_checkpoint(tmp_path / "c.safetensors", state)
    back = read_checkpoint(p)
    assert torch.equal(back["w"], state["w"]) and back["opt"][0]["step"].item() == 3.0 and back["n"] == 7
    assert list(tmp_path.iterdir()) == [p]  # no temp file left behind


def test_truncated_and_foreign_files(tmp_path: Path) -> None:
    p = write_checkpoint(tmp_path / "c.safetensors", {"w": torch.randn(64, 64)})
    raw = p.read_bytes()
    for cut in (4, 100, len(raw) - 10):
        p.write_bytes(raw[:cut])
        with pytest.raises(CheckpointError):
            read_checkpoint(p)
    p.write_bytes(b"hello world, not a checkpoint")
    with pytest.raises(CheckpointError):
        read_checkpoint(p)
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, str(p))  # a valid safetensors file, but not ours
    with pytest.raises(CheckpointError, match="not a p2ptrain checkpoint"):
        read_checkpoint(p)
    with pytest.raises(CheckpointError, match="cannot read"):
        read_checkpoint(tmp_path / "nope.safetensors")


def test_dir_keeps_last_k_and_falls_back(tmp_path: Path) -> None:
    d = CheckpointDir(tmp_path, keep=2)
    for step in (10, 20, 30):
        d.save(step, {"step": step})
    assert [s for s, _ in d.paths()] == [20, 30]
    newest = d.paths()[-1][1]
    newest.write_bytes(newest.read_bytes()[:20])  # corrupt the newest
    path, state = d.latest()  # type: ignore[misc]
    assert state["step"] == 20 and path.name.endswith("20.safetensors")
    assert CheckpointDir(tmp_path / "none").latest() is None


def _data_offset(raw: bytes) -> int:
    return 8 + int.from_bytes(raw[:8], "little")  # the tensor data begins after the JSON header


def test_corrupt_tensor_data_is_refused_by_name(tmp_path: Path) -> None:
    """Bytes overwritten inside the tensor data (header intact) must not load: safetensors alone accepts them."""
    p = write_checkpoint(tmp_path / "c.safetensors", {"trainer": {"model": {"wte": torch.randn(256, 256)}},
                                                     "opt": torch.ones(8)})
    raw = bytearray(p.read_bytes())
    at = _data_offset(bytes(raw)) + 1000
    raw[at:at + 64 * 1024] = b"\x7f" * (64 * 1024)  # 64 KiB of garbage inside the first tensor
    p.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"checksum mismatch in trainer\.model\.wte"):
        read_checkpoint(p)


def test_a_corrupt_newest_checkpoint_is_named_and_the_newest_good_one_used(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    d = CheckpointDir(tmp_path, keep=3)
    for step in (10, 20):
        d.save(step, {"step": step, "w": torch.full((1024,), float(step))})
    newest = d.paths()[-1][1]
    raw = bytearray(newest.read_bytes())
    raw[_data_offset(bytes(raw)) + 16] ^= 0xFF  # one flipped byte
    newest.write_bytes(bytes(raw))
    with caplog.at_level("WARNING", logger="p2ptrain.checkpoint"):
        path, state = d.latest()  # type: ignore[misc]
    assert path.name == "ckpt-0000000010.safetensors"
    assert state["step"] == 10 and torch.equal(state["w"], torch.full((1024,), 10.0))
    assert newest.name in caplog.text and "checksum mismatch" in caplog.text and "fallback" in caplog.text


def test_a_state_that_is_not_finite_is_never_written(tmp_path: Path) -> None:
    d = CheckpointDir(tmp_path, keep=2)
    d.save(10, {"w": torch.ones(4)})
    d.save(20, {"w": torch.ones(4)})
    before = [(s, p.read_bytes()) for s, p in d.paths()]
    for bad in (float("nan"), float("inf")):
        with pytest.raises(NonFiniteState, match=r"opt\.m"):
            d.save(30, {"w": torch.ones(4), "opt": {"m": torch.tensor([1.0, bad])}})
    assert [(s, p.read_bytes()) for s, p in d.paths()] == before  # nothing rotated out, nothing written
    assert sorted(p.name for p in tmp_path.iterdir()) == [p.name for _, p in d.paths()]  # no temporaries
    d.save(30, {"w": torch.ones(4), "steps": torch.tensor([1, 2])})  # integer tensors are not checked


def test_version_1_files_without_checksums_still_read(tmp_path: Path) -> None:
    import json

    from safetensors.torch import save as st_save

    tree, tensors = pack({"w": torch.arange(4.0)})
    p = tmp_path / "old.safetensors"
    p.write_bytes(st_save(tensors, metadata={"format": "p2ptrain-checkpoint", "version": "1",
                                             "tree": json.dumps(tree)}))
    assert torch.equal(read_checkpoint(p)["w"], torch.arange(4.0))


def test_train_removes_temporaries_of_killed_writes(tmp_path: Path, corpus: Corpus) -> None:
    stale = tmp_path / ".ckpt-0000000010.safetensors.abc.tmp"
    stale.write_bytes(b"half a checkpoint")
    job = TrainJob(model=ModelConfig(d_model=32, n_layers=1, n_heads=2, seq_len=32),
                   trainer=TrainerConfig(batch_size=2, total_steps=2), steps=2, eval_every=0,
                   checkpoint_dir=str(tmp_path))
    run_train(job, trainer=make_trainer(job.model, job.trainer, job.data, corpus=corpus))
    assert not stale.exists() and [p.name for p in tmp_path.iterdir()] == ["ckpt-0000000002.safetensors"]


def test_every_dtype_reads_back_from_the_file_as_from_the_payload(tmp_path: Path) -> None:
    """The file reader (tensor by tensor) and the payload reader (safetensors' own) agree, dtype by dtype."""
    from p2ptrain.checkpoint import state_from_bytes

    gen = torch.Generator().manual_seed(3)
    state = {"f32": torch.randn(3, 5, generator=gen), "bf16": torch.randn(7, generator=gen).bfloat16(),
             "f16": torch.randn(2, 2, generator=gen).half(), "f64": torch.randn(4, generator=gen).double(),
             "i64": torch.tensor([-(2**40), 3]), "i8": torch.tensor([-5, 7], dtype=torch.int8),
             "mask": torch.tensor([True, False, True]), "empty": torch.empty(0, 4), "scalar": torch.tensor(2.5)}
    p = write_checkpoint(tmp_path / "c.safetensors", state)
    for back in (read_checkpoint(p), state_from_bytes(p.read_bytes())):
        assert back.keys() == state.keys()
        for k, t in state.items():
            assert back[k].dtype == t.dtype and back[k].shape == t.shape and torch.equal(back[k], t), k


def test_tensors_read_are_not_backed_by_the_file(tmp_path: Path) -> None:
    """A state read from a checkpoint outlives the file's truncation in place (a mapped tensor would SIGBUS)."""
    w = torch.randn(1 << 18)
    p = write_checkpoint(tmp_path / "c.safetensors", {"w": w})
    back = read_checkpoint(p)
    p.write_bytes(b"")  # the same inode, cut to nothing
    assert torch.equal(back["w"], w)


def _with_header(raw: bytes, edit: dict[str, object]) -> bytes:
    """``raw`` (a checkpoint's bytes) with some of its header's entries replaced, its tensor data kept."""
    import json

    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n]) | edit
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + raw[8 + n:]


@pytest.mark.parametrize(("entry", "match"), [
    ({"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 4 << 40]}, "ends past the end of the file"),
    ({"dtype": "F32", "shape": [64, 64], "data_offsets": [0, 4]}, "corrupt header entry"),
    ({"dtype": "F32", "shape": [-1, 64], "data_offsets": [0, 64 * 4]}, "corrupt header entry"),
    ({"dtype": "Q4", "shape": [64, 64], "data_offsets": [0, 64 * 64 * 4]}, "corrupt header entry"),
    ({"dtype": "F32", "shape": "64", "data_offsets": [0, 256]}, "corrupt header entry"),
])
def test_a_corrupt_header_entry_is_refused_before_anything_is_allocated_for_it(
        tmp_path: Path, entry: dict[str, object], match: str) -> None:
    p = write_checkpoint(tmp_path / "c.safetensors", {"w": torch.randn(64, 64)})
    p.write_bytes(_with_header(p.read_bytes(), {"t0": entry}))
    with pytest.raises(CheckpointError, match=match):
        read_checkpoint(p)
