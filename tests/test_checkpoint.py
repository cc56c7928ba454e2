from __future__ import annotations

from pathlib import Path

import pytest
import torch

from p2ptrain.checkpoint import CheckpointDir, CheckpointError, pack, read_checkpoint, unpack, write_checkpoint


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
