"""A small decoder-only transformer in the modern style.

RMSNorm, rotary positions, SwiGLU MLPs and optional tied embeddings. The model
knows nothing of how it is trained or distributed: the outer loop sees it only
as named *units* (``embed``, ``blocks.0`` ... ``blocks.{L-1}``, ``norm``,
``head``) so that fragments can be made of whole layers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "PRESETS", "ModelConfig", "preset"]


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Architecture of a :class:`GPT`.

    Attributes:
        vocab_size: number of token ids (256 for the byte tokenizer).
        seq_len: context length in tokens (the rotary tables are built for it).
        d_model: residual width.
        n_layers: number of transformer blocks.
        n_heads: attention heads; ``d_model`` must be divisible by it.
        n_kv_heads: key/value heads for grouped-query attention (each serves
            ``n_heads / n_kv_heads`` query heads); None (the default) means ``n_heads``,
            plain multi-head attention. A value equal to ``n_heads`` is stored as None.
        d_ff: hidden width of the SwiGLU MLP; defaults to ~8/3·d_model rounded up to 64.
        tie_embeddings: share the input embedding with the output head.
        rope_base: base of the rotary frequencies.
        norm_eps: epsilon of RMSNorm.
    """

    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    d_ff: int | None = None
    tie_embeddings: bool = True
    rope_base: float = 10_000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model: {name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"model: d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("model: the head dimension d_model/n_heads must be even for rotary positions")
        if self.d_ff is not None and self.d_ff <= 0:
            raise ValueError(f"model: d_ff must be positive, got {self.d_ff}")
        if self.n_kv_heads is not None:
            if self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads:
                raise ValueError(
                    f"model: n_kv_heads ({self.n_kv_heads}) must be positive and divide n_heads ({self.n_heads})"
                )
            if self.n_kv_heads == self.n_heads:
                object.__setattr__(self, "n_kv_heads", None)  # one spelling of plain multi-head attention

    @property
    def kv_heads(self) -> int:
        """Key/value heads actually used (``n_heads`` without grouped-query attention)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def hidden(self) -> int:
        """SwiGLU hidden width actually used."""
        if self.d_ff is not None:
            return self.d_ff
        return 64 * math.ceil(8 * self.d_model / 3 / 64)

    def to_dict(self) -> dict[str, object]:
        """The fields as a dict; ``n_kv_heads`` only when grouped-query attention is on, so the
        configs saved before it existed compare equal."""
        out = asdict(self)
        if out["n_kv_heads"] is None:
            del out["n_kv_heads"]
        return out


#: Named architectures. ``tiny`` trains on a 2-core CPU in minutes; ``small`` is
#: ~25M parameters; ``150m`` and ``1b`` are the DiLoCo and Streaming DiLoCo
#: papers' sizes (their parameter counts assume a ~32k vocabulary; with the byte
#: tokenizer they are ~117M and ~1.2B).
PRESETS: dict[str, ModelConfig] = {
    "micro": ModelConfig(d_model=64, n_layers=4, n_heads=4, d_ff=192, seq_len=64),  # long simulator studies
    "tiny": ModelConfig(d_model=128, n_layers=6, n_heads=4, d_ff=384, seq_len=128),
    "small": ModelConfig(d_model=512, n_layers=8, n_heads=8, d_ff=1408, seq_len=256),
    "150m": ModelConfig(d_model=896, n_layers=12, n_heads=16, d_ff=2432, seq_len=1024),
    "1b": ModelConfig(d_model=2048, n_layers=24, n_heads=16, d_ff=5632, seq_len=2048),
}


def preset(name: str, **overrides: object) -> ModelConfig:
    """The named preset, with fields replaced by ``overrides``."""
    try:
        base = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}") from None
    return replace(base, **overrides)  # type: ignore[arg-type]


def rotary_tables(seq_len: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape [seq_len, head_dim/2] (fp32)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :d/2], x[..., d/2:]) of x [B, H, T, d] by the angle tables [T, d/2]."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    cos = cos.to(x.dtype)
    sin = sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    """Causal self-attention with rotary positions; grouped-query when ``n_kv_heads < n_heads``.

    ``qkv`` is one fused projection whose output rows are ``[q (n_heads·d); k (n_kv_heads·d);
    v (n_kv_heads·d)]``; key/value head j serves query heads ``j·g … j·g+g−1`` (g = n_heads/n_kv_heads).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.kv_heads
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.kv_heads) * cfg.head_dim, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        kv = self.n_kv_heads * self.head_dim
        q, k, v = self.qkv(x).split([c, kv, kv], dim=-1)
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # [B, H, T, d]
        k = k.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.n_kv_heads != self.n_heads:
            group = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, d]
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.hidden, bias=False)
        self.down = nn.Linear(cfg.hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Decoder-only language model; ``forward(idx [B, T] int64) -> logits [B, T, V]``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        cos, sin = rotary_tables(cfg.seq_len, cfg.head_dim, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 style init: N(0, 0.02), residual projections scaled by 1/sqrt(2L)."""
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if p.dim() < 2:
                nn.init.ones_(p)  # RMSNorm gains
            elif name.endswith(("attn.proj.weight", "mlp.down.weight")):
                nn.init.normal_(p, 0.0, resid_std)
            else:
                nn.init.normal_(p, 0.0, 0.02)

    def units(self) -> list[tuple[str, list[str]]]:
        """The model's indivisible units in order, each with its parameter names.

        ``embed``, ``blocks.i`` for every layer, ``norm`` and ``head`` (empty when the
        head is tied to the embedding). Fragments are unions of whole units.
        """
        names = [n for n, _ in self.named_parameters()]
        prefixes = ["embed"] + [f"blocks.{i}" for i in range(self.cfg.n_layers)] + ["norm", "head"]
        out = []
        for prefix in prefixes:
            out.append((prefix, [n for n in names if n == prefix or n.startswith(prefix + ".")]))
        return out

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than the model's seq_len {self.cfg.seq_len}")
        x = self.embed(idx)
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (fp32)."""
        logits = self(idx)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
