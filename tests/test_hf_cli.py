"""``train --init-from`` a Llama checkpoint on local .jsonl data with its own tokenizer, resume, export."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from p2ptrain.checkpoint import CheckpointDir
from p2ptrain.cli import app
from p2ptrain.hf_run import read_params

from .test_hf import write_checkpoint
from .test_textdata import documents, make_tokenizer, write_jsonl

tokenizers = pytest.importorskip("tokenizers")
runner = CliRunner()
FLAGS = ["--batch-size", "2", "--eval-every", "0", "--seq-len", "32", "--lr", "1e-4", "-q"]


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """A bf16 Llama checkpoint folder with its tokenizer.json, and a .jsonl data set."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    docs = documents(200)
    tok = make_tokenizer(tmp_path / "tok.json", docs)
    vocab = tokenizers.Tokenizer.from_file(str(tok)).get_vocab_size(with_added_tokens=True)
    stored = write_checkpoint(tmp_path / "llama", tied=False, dtype=torch.bfloat16, vocab=vocab)
    (tmp_path / "llama" / "tokenizer.json").write_bytes(tok.read_bytes())
    return tmp_path / "llama", write_jsonl(tmp_path / "docs.jsonl", docs), stored


def _train(ckpt: Path, data: Path, ck: Path, steps: int, *extra: str) -> dict[str, object]:
    out = ck.parent / f"{ck.name}-{steps}.json"
    r = runner.invoke(app, ["train", "--init-from", str(ckpt), "--data", str(data), "--steps", str(steps),
                            "--checkpoint-dir", str(ck), "--json", str(out), *FLAGS, *extra])
    assert r.exit_code == 0, r.output
    return json.loads(out.read_text())


def test_train_from_checkpoint_resume_and_export(world: tuple[Path, Path, dict[str, torch.Tensor]],
                                                 tmp_path: Path) -> None:
    ckpt, data, stored = world
    straight = _train(ckpt, data, tmp_path / "a", 4)
    _train(ckpt, data, tmp_path / "b", 2)
    resumed = _train(ckpt, data, tmp_path / "b", 4, "--resume")
    assert resumed["start_step"] == 2 and resumed["final_train_loss"] == straight["final_train_loss"]
    (_, a), (_, b) = CheckpointDir(tmp_path / "a").latest(), CheckpointDir(tmp_path / "b").latest()  # type: ignore[misc]
    assert a["trainer"]["stream"] == b["trainer"]["stream"]  # the data position continued where it stopped
    params, cfg = read_params(a)
    assert cfg.seq_len == 32 and cfg.kv_heads == 2 and params["embed.weight"].dtype == torch.float32
    for name in params:  # a resumed run is the same run
        assert torch.equal(params[name], b["trainer"]["model"][name]), name

    r = runner.invoke(app, ["export", "--checkpoint", str(tmp_path / "a"), "--out", str(tmp_path / "hf"),
                            "--template", str(ckpt)])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == json.loads((ckpt / "config.json").read_text())
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (ckpt / "tokenizer.json").read_bytes()
    moved = 0
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        assert sorted(f.keys()) == sorted(stored)
        for name, before in stored.items():
            after = f.get_tensor(name)
            assert after.dtype == torch.bfloat16 and after.shape == before.shape
            # trained from the checkpoint: 4 small steps move it a little, not to a fresh random init
            assert (after.float() - before.float()).norm() < 0.05 * before.float().norm(), name
            moved += not torch.equal(after, before)
    assert moved > len(stored) // 2
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:  # k rows of the fused qkv, as trained
        k_proj = f.get_tensor("model.layers.0.self_attn.k_proj.weight")
    assert torch.equal(params["blocks.0.attn.qkv.weight"][32:48].to(torch.bfloat16), k_proj)


def _plain(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def test_init_from_errors(world: tuple[Path, Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    ckpt, data, _ = world
    base = ["train", "--data", str(data), "--steps", "1", "-q"]
    r = runner.invoke(app, [*base, "--init-from", str(ckpt), "--preset", "tiny"])
    assert r.exit_code == 2 and "drop --preset" in _plain(r.output)
    r = runner.invoke(app, [*base, "--init-from", "someorg/llama"])
    assert r.exit_code == 2 and "not downloaded" in _plain(r.output)
    r = runner.invoke(app, [*base, "--init-from", str(ckpt), "--seq-len", "1000"])
    assert r.exit_code == 2 and "max_position_embeddings" in _plain(r.output)
    big = make_tokenizer(tmp_path / "big.json", [*documents(), *(f"w{i}x" for i in range(2000))], vocab=3000)
    r = runner.invoke(app, [*base, "--init-from", str(ckpt), "--tokenizer", str(big), "--seq-len", "32"])
    assert r.exit_code == 2 and "vocab_size" in _plain(r.output)
    (ckpt / "tokenizer.json").unlink()
    r = runner.invoke(app, [*base, "--init-from", str(ckpt), "--seq-len", "32"])
    assert r.exit_code == 2 and "--tokenizer" in _plain(r.output)
    r = runner.invoke(app, ["export", "--checkpoint", str(tmp_path / "nothing"), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "cannot read" in _plain(r.output)
    (tmp_path / "empty").mkdir()
    r = runner.invoke(app, ["export", "--checkpoint", str(tmp_path / "empty"), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "no checkpoint" in _plain(r.output)
