"""`p2ptrain join --init-from`: a peer starts from a local Llama checkpoint, and `export` writes its θ back."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from p2ptrain.checkpoint import CheckpointDir

from ..test_hf import write_checkpoint
from ..test_textdata import documents, make_tokenizer, write_jsonl

pytestmark = [pytest.mark.net, pytest.mark.timeout(120)]
tokenizers = pytest.importorskip("tokenizers")


def test_join_from_checkpoint_then_export_theta(tmp_path: Path) -> None:
    docs = documents(200)
    tok = make_tokenizer(tmp_path / "tok.json", docs)
    vocab = tokenizers.Tokenizer.from_file(str(tok)).get_vocab_size(with_added_tokens=True)
    stored = write_checkpoint(tmp_path / "llama", tied=True, dtype=torch.bfloat16, vocab=vocab)
    (tmp_path / "llama" / "tokenizer.json").write_bytes(tok.read_bytes())
    data = write_jsonl(tmp_path / "d.jsonl", docs)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    # A lone peer starts a swarm on 127.0.0.1; with H above --steps no round runs, so θ stays the
    # checkpoint's weights while the inner steps move the live model. --step-seconds skips the pacing
    # measurement (whose steps would run before θ is taken).
    r = subprocess.run([sys.executable, "-m", "p2ptrain", "join", "--init-from", str(tmp_path / "llama"),
                        "--data", str(data), "--seq-len", "32", "--batch-size", "2", "--steps", "3",
                        "--method", "diloco", "--H", "50", "--step-seconds", "0.01", "--metrics-port", "-1",
                        "--checkpoint-dir", str(tmp_path / "ck"), "-q"],
                       capture_output=True, text=True, timeout=100, env=env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]
    assert f"--init-from {tmp_path / 'llama'}" in " ".join(r.stderr.split())  # the hint for the next peer
    _, state = CheckpointDir(tmp_path / "ck").latest()  # type: ignore[misc]
    live = state["trainer"]["model"]["blocks.0.mlp.down.weight"].to(torch.bfloat16)
    assert not torch.equal(live, stored["model.layers.0.mlp.down_proj.weight"])  # the inner steps trained

    r = subprocess.run([sys.executable, "-m", "p2ptrain", "export", "--checkpoint", str(tmp_path / "ck"),
                        "--out", str(tmp_path / "hf"), "--template", str(tmp_path / "llama")],
                       capture_output=True, text=True, timeout=100, env=env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]
    assert "outer parameters θ" in r.stderr
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(exported) == sorted(stored) and "lm_head.weight" not in exported
    for name, want in stored.items():
        assert exported[name].dtype == want.dtype and torch.equal(exported[name].view(torch.uint8), want.view(torch.uint8)), name
