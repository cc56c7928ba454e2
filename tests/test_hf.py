"""Llama-format checkpoints: a tiny one written here is loaded, checked against a float64
reference forward of the published Llama formulas (and ``transformers`` when installed),
and exported back bit for bit."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from p2ptrain.hf import HFError, export_hf, load_hf_weights, model_config_from_hf, open_hf
from p2ptrain.model import GPT, ModelConfig

VOCAB, HIDDEN, HEADS, KV_HEADS, LAYERS, FF, MAX_POS = 97, 32, 4, 2, 2, 48, 64


def hf_config(*, tied: bool, dtype: str = "float32", **extra: object) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
        "hidden_size": HIDDEN, "intermediate_size": FF, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "max_position_embeddings": MAX_POS,
        "rms_norm_eps": 1e-5, "rope_theta": 5000.0, "rope_scaling": None, "tie_word_embeddings": tied,
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
        "initializer_range": 0.02, "bos_token_id": 1, "eos_token_id": 2, "pretraining_tp": 1,
        "use_cache": True, "torch_dtype": dtype, **extra,
    }


def hf_weights(*, tied: bool, seed: int = 0, vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / math.sqrt(shape[-1])

    def gain() -> torch.Tensor:
        return 1.0 + 0.2 * torch.randn(HIDDEN, generator=g)

    hd = HIDDEN // HEADS
    t = {"model.embed_tokens.weight": torch.randn(vocab, HIDDEN, generator=g), "model.norm.weight": gain()}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": gain(), p + "post_attention_layernorm.weight": gain(),
              p + "self_attn.q_proj.weight": w(HEADS * hd, HIDDEN), p + "self_attn.k_proj.weight": w(KV_HEADS * hd, HIDDEN),
              p + "self_attn.v_proj.weight": w(KV_HEADS * hd, HIDDEN), p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * hd),
              p + "mlp.gate_proj.weight": w(FF, HIDDEN), p + "mlp.up_proj.weight": w(FF, HIDDEN),
              p + "mlp.down_proj.weight": w(HIDDEN, FF)}
    if not tied:
        t["lm_head.weight"] = w(vocab, HIDDEN)
    return t


def write_checkpoint(path: Path, *, tied: bool, dtype: torch.dtype = torch.float32, shards: int = 1,
                     norms_fp32: bool = False, vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    """A Llama checkpoint folder as transformers writes it; returns the tensors as stored."""
    path.mkdir(parents=True)
    tensors = {n: t.to(torch.float32 if norms_fp32 and "norm" in n else dtype).contiguous()
               for n, t in hf_weights(tied=tied, vocab=vocab).items()}
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    (path / "config.json").write_text(json.dumps(hf_config(tied=tied, dtype=name, vocab_size=vocab), indent=2))
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    else:
        weight_map = {}
        for k in range(shards):
            shard = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            part = names[k::shards]
            save_file({n: tensors[n] for n in part}, path / shard, metadata={"format": "pt"})
            weight_map |= dict.fromkeys(part, shard)
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tensors


def reference_logits(t: dict[str, torch.Tensor], cfg: dict[str, object], ids: torch.Tensor) -> torch.Tensor:
    """Llama forward in float64 straight from the HF tensors (no p2ptrain code)."""
    t = {n: v.double() for n, v in t.items()}
    d, heads, kv_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
    hd, eps, seq = d // heads, float(cfg["rms_norm_eps"]), ids.shape[1]

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w

    inv_freq = 1.0 / float(cfg["rope_theta"]) ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()  # [T, hd]

    def rope(x: torch.Tensor) -> torch.Tensor:  # [B, n, T, hd]; rotate_half(x) = (-x2, x1)
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    b = ids.shape[0]
    x = t["model.embed_tokens.weight"][ids]
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()
    for i in range(int(cfg["num_hidden_layers"])):
        p = f"model.layers.{i}."
        h = rms(x, t[p + "input_layernorm.weight"])
        q = (h @ t[p + "self_attn.q_proj.weight"].T).view(b, seq, heads, hd).transpose(1, 2)
        k = (h @ t[p + "self_attn.k_proj.weight"].T).view(b, seq, kv_heads, hd).transpose(1, 2)
        v = (h @ t[p + "self_attn.v_proj.weight"].T).view(b, seq, kv_heads, hd).transpose(1, 2)
        q, k = rope(q), rope(k)
        outs = []
        for head in range(heads):
            j = head // (heads // kv_heads)  # the key/value head this query head shares
            s = q[:, head] @ k[:, j].transpose(-1, -2) / math.sqrt(hd)
            s = s.masked_fill(~mask, float("-inf"))
            outs.append(torch.softmax(s, -1) @ v[:, j])
        x = x + torch.cat(outs, -1) @ t[p + "self_attn.o_proj.weight"].T
        h = rms(x, t[p + "post_attention_layernorm.weight"])
        gate, up = h @ t[p + "mlp.gate_proj.weight"].T, h @ t[p + "mlp.up_proj.weight"].T
        x = x + (gate * torch.sigmoid(gate) * up) @ t[p + "mlp.down_proj.weight"].T
    x = rms(x, t["model.norm.weight"])
    head = t.get("lm_head.weight", t["model.embed_tokens.weight"])
    return x @ head.T


def load(path: Path, seq_len: int | None = None) -> GPT:
    ckpt = open_hf(path, seq_len=seq_len)
    model = GPT(ckpt.model_config)
    load_hf_weights(model, ckpt)
    return model.eval()


IDS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_float64_reference(tmp_path: Path, tied: bool) -> None:
    tensors = write_checkpoint(tmp_path / "ckpt", tied=tied)
    model = load(tmp_path / "ckpt")
    cfg = model.cfg
    assert (cfg.n_heads, cfg.kv_heads, cfg.d_model, cfg.hidden, cfg.seq_len) == (HEADS, KV_HEADS, HIDDEN, FF, MAX_POS)
    assert cfg.tie_embeddings is tied and cfg.rope_base == 5000.0 and cfg.norm_eps == 1e-5
    with torch.no_grad():
        ours = model(IDS).double()
    ref = reference_logits(tensors, hf_config(tied=tied), IDS)
    assert ref.abs().max() > 1.0  # the logits are far from zero: the comparison means something
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_transformers(tmp_path: Path, tied: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write_checkpoint(tmp_path / "ckpt", tied=tied)
    theirs = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "ckpt"), dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    model = load(tmp_path / "ckpt")
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), theirs(IDS).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("tied", "dtype", "norms_fp32"), [
    (False, torch.float32, False), (True, torch.float32, False),
    (False, torch.bfloat16, False), (True, torch.float16, False), (False, torch.bfloat16, True),
])
def test_export_round_trips_bitwise(tmp_path: Path, tied: bool, dtype: torch.dtype, norms_fp32: bool) -> None:
    src = tmp_path / "ckpt"
    stored = write_checkpoint(src, tied=tied, dtype=dtype, norms_fp32=norms_fp32)
    (src / "tokenizer.json").write_text("{}")
    model = load(src, seq_len=16)  # a capped context must not change the exported config
    assert model.cfg.seq_len == 16 and all(p.dtype == torch.float32 for p in model.parameters())
    out = export_hf(tmp_path / "out", dict(model.named_parameters()), model.cfg, template=src)
    with safe_open(out / "model.safetensors", "pt") as f:
        assert sorted(f.keys()) == sorted(stored)
        for name, want in stored.items():
            got = f.get_tensor(name)
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name  # bit for bit
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    assert (out / "tokenizer.json").read_text() == "{}"


def test_sharded_checkpoint_loads_like_single(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "one", tied=False)
    write_checkpoint(tmp_path / "three", tied=False, shards=3)
    a, b = load(tmp_path / "one"), load(tmp_path / "three")
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    # and an export in shards reads back the same
    out = export_hf(tmp_path / "out", dict(a.named_parameters()), a.cfg, max_shard_bytes=20_000)
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("model-*.safetensors"))) > 1
    c = load(out)
    for (n, p), (_, q) in zip(a.named_parameters(), c.named_parameters(), strict=True):
        assert torch.equal(p, q), n


def test_export_without_template_is_float32_and_loads(tmp_path: Path) -> None:
    cfg = ModelConfig(vocab_size=64, seq_len=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=40)
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    out = export_hf(tmp_path / "out", dict(model.named_parameters()), cfg)
    back = load(out)
    assert back.cfg == cfg
    with torch.no_grad():
        assert torch.equal(back(IDS % 64), model(IDS % 64))
    with safe_open(out / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()  # tied
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    export_bf16 = export_hf(tmp_path / "bf16", dict(model.named_parameters()), cfg, dtype="bfloat16")
    assert json.loads((export_bf16 / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with pytest.raises(HFError, match="not empty"):
        export_hf(tmp_path / "out", dict(model.named_parameters()), cfg)


def test_grouped_query_attention_matches_repeated_heads() -> None:
    """GQA with shared key/value heads equals plain multi-head attention whose k/v heads are copies."""
    torch.manual_seed(0)
    gqa = GPT(ModelConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2)).eval()
    mha = GPT(ModelConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=1, n_heads=4)).eval()
    state = gqa.state_dict()
    w = state["blocks.0.attn.qkv.weight"]
    q, k, v = w.split([32, 16, 16])
    rep = lambda x: x.view(2, 8, 32).repeat_interleave(2, dim=0).reshape(32, 32)  # noqa: E731
    state["blocks.0.attn.qkv.weight"] = torch.cat([q, rep(k), rep(v)])
    mha.load_state_dict(state)
    ids = IDS[:, :16] % 64
    with torch.no_grad():
        torch.testing.assert_close(gqa(ids), mha(ids))
    assert gqa.blocks[0].attn.qkv.weight.shape == (64, 32)


def test_plain_attention_config_is_unchanged() -> None:
    cfg = ModelConfig(n_heads=4, n_kv_heads=4)
    assert cfg.n_kv_heads is None and "n_kv_heads" not in cfg.to_dict() and cfg == ModelConfig(n_heads=4)
    with pytest.raises(ValueError, match="n_kv_heads"):
        ModelConfig(n_heads=4, n_kv_heads=3)


@pytest.mark.parametrize(("change", "match"), [
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, "mistral"),
    ({"head_dim": 16}, "head_dim"),
    ({"num_key_value_heads": 3}, "n_kv_heads"),
])
def test_unsupported_configs_are_refused(change: dict[str, object], match: str) -> None:
    with pytest.raises(HFError, match=match):
        model_config_from_hf(hf_config(tied=False) | change)


def test_seq_len_cap(tmp_path: Path) -> None:
    assert model_config_from_hf(hf_config(tied=False)).seq_len == MAX_POS
    assert model_config_from_hf(hf_config(tied=False), seq_len=8).seq_len == 8
    with pytest.raises(HFError, match="max_position_embeddings"):
        model_config_from_hf(hf_config(tied=False), seq_len=MAX_POS + 1)


def test_bad_folders_are_refused(tmp_path: Path) -> None:
    with pytest.raises(HFError, match="not downloaded"):
        open_hf("meta-llama/Llama-3.2-1B")
    write_checkpoint(tmp_path / "ckpt", tied=False)
    (tmp_path / "ckpt" / "model.safetensors").rename(tmp_path / "ckpt" / "pytorch_model.bin")
    with pytest.raises(HFError, match="pickled"):
        open_hf(tmp_path / "ckpt")
    write_checkpoint(tmp_path / "missing", tied=False)
    tensors = hf_weights(tied=False)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "missing" / "model.safetensors")
    with pytest.raises(HFError, match="up_proj"):
        load(tmp_path / "missing")
    write_checkpoint(tmp_path / "good", tied=False)
    plain = GPT(ModelConfig(vocab_size=VOCAB, d_model=HIDDEN, n_layers=LAYERS, n_heads=HEADS, d_ff=FF))
    with pytest.raises(HFError, match="does not match"):  # no grouped-query attention: another model
        load_hf_weights(plain, open_hf(tmp_path / "good"))
