"""Llama-family checkpoints in the Hugging Face layout: load into a :class:`GPT`, export back.

A checkpoint folder holds ``config.json`` and the weights as ``model.safetensors`` or as
shards listed in ``model.safetensors.index.json``. Only local folders are read (nothing is
downloaded); pickled ``pytorch_model.bin`` weights are refused. The architecture is the
Llama decoder (``LlamaForCausalLM``): RMSNorm, rotary positions in the rotate-half
convention, SwiGLU, grouped-query attention, tied or untied head. What p2ptrain's model
does not compute the same way is refused with an error naming the config key: biases,
rotary scaling, a head dimension other than ``hidden_size / num_attention_heads``, other
activations or architectures.

Name mapping (layer i)::

    model.embed_tokens.weight                  embed.weight
    model.layers.i.input_layernorm.weight      blocks.i.attn_norm.weight
    model.layers.i.self_attn.{q,k,v}_proj      blocks.i.attn.qkv.weight  rows [q; k; v]
    model.layers.i.self_attn.o_proj            blocks.i.attn.proj.weight
    model.layers.i.post_attention_layernorm    blocks.i.mlp_norm.weight
    model.layers.i.mlp.{gate,up}_proj          blocks.i.mlp.gate_up.weight  rows [gate; up]
    model.layers.i.mlp.down_proj               blocks.i.mlp.down.weight
    model.norm.weight                          norm.weight
    lm_head.weight                             head.weight  (absent when tied)

Weights are loaded into fp32 parameters (a bf16/fp16 value is exact in fp32) and exported
in the checkpoint's own dtype by default, so load → export reproduces the tensors bit for bit.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .model import GPT, ModelConfig

__all__ = [
    "HFCheckpoint",
    "HFError",
    "export_hf",
    "hf_tensors",
    "load_hf_weights",
    "model_config_from_hf",
    "open_hf",
]

log = logging.getLogger(__name__)

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
#: Files besides the weights and config that an export copies from its template folder.
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
#: Tensors some older checkpoints carry that are recomputed, not learned.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


class HFError(ValueError):
    """A checkpoint folder cannot be loaded or written; the message names the file or config key."""


@dataclass(frozen=True)
class HFCheckpoint:
    """A local checkpoint folder: its ``config.json``, the model config made from it, the
    weight files (one, or the shards of an index) and each tensor's dtype."""

    path: Path
    hf_config: dict[str, Any]
    model_config: ModelConfig
    files: dict[str, Path]  # tensor name -> file holding it
    dtypes: dict[str, torch.dtype]  # tensor name -> dtype as stored

    @property
    def dtype(self) -> torch.dtype:
        """The most common dtype of the weights."""
        counts: dict[torch.dtype, int] = {}
        for d in self.dtypes.values():
            counts[d] = counts.get(d, 0) + 1
        return max(counts, key=counts.__getitem__)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise HFError(f"{path}: cannot read ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise HFError(f"{path}: not valid JSON ({e})") from None


def model_config_from_hf(hf: dict[str, Any], *, seq_len: int | None = None) -> ModelConfig:
    """The :class:`ModelConfig` of a Llama ``config.json`` dict.

    ``seq_len`` caps the context (the rotary tables are built for it): the default is
    ``max_position_embeddings``, which for long-context checkpoints is far more than a
    run needs. Raises :class:`HFError` on a config this model does not compute exactly.
    """
    arch = hf.get("architectures") or ["LlamaForCausalLM"]
    if hf.get("model_type", "llama") != "llama" or arch != ["LlamaForCausalLM"]:
        raise HFError(f"config.json: model_type {hf.get('model_type')!r} / architectures {arch} is not supported; "
                      "only the Llama decoder (LlamaForCausalLM) is")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise HFError(f"config.json: {key}=true is not supported (the model has no biases)")
    if hf.get("hidden_act", "silu") != "silu":
        raise HFError(f"config.json: hidden_act {hf['hidden_act']!r} is not supported (only silu, SwiGLU)")
    scaling = hf.get("rope_scaling")
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if scaling is not None and rope_type != "default":
        raise HFError(f"config.json: rope_scaling of type {rope_type!r} is not supported (only unscaled rotary positions)")
    if float(hf.get("attention_dropout", 0.0) or 0.0) != 0.0:
        raise HFError("config.json: attention_dropout must be 0")
    try:
        d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        layers, ff, vocab = int(hf["num_hidden_layers"]), int(hf["intermediate_size"]), int(hf["vocab_size"])
    except KeyError as e:
        raise HFError(f"config.json: missing key {e.args[0]!r}") from None
    if hf.get("head_dim") is not None and int(hf["head_dim"]) * heads != d:
        raise HFError(f"config.json: head_dim {hf['head_dim']} × num_attention_heads {heads} != hidden_size {d} "
                      "is not supported")
    max_pos = int(hf.get("max_position_embeddings", 2048))
    if seq_len is not None and seq_len > max_pos:
        raise HFError(f"seq_len {seq_len} is longer than the checkpoint's max_position_embeddings {max_pos}")
    try:
        return ModelConfig(
            vocab_size=vocab, seq_len=seq_len or max_pos, d_model=d, n_layers=layers, n_heads=heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or heads), d_ff=ff,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rope_base=float(hf.get("rope_theta", 10_000.0)), norm_eps=float(hf.get("rms_norm_eps", 1e-6)))
    except ValueError as e:
        raise HFError(f"config.json: {e}") from None


def _header_dtypes(file: Path) -> dict[str, torch.dtype]:
    """Tensor name -> dtype from a safetensors file's header (no tensor is read)."""
    try:
        with file.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n)) if 0 < n < 100 * 2**20 else None
    except OSError as e:
        raise HFError(f"{file}: cannot read ({e.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        header = None
    if not isinstance(header, dict):
        raise HFError(f"{file}: not a safetensors file")
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info.get("dtype") not in _ST_DTYPES:
            raise HFError(f"{file}: tensor {name} has dtype {info.get('dtype')}; only F32, BF16 and F16 are loaded")
        out[name] = _ST_DTYPES[info["dtype"]]
    return out


def _weight_files(path: Path) -> tuple[dict[str, Path], dict[str, torch.dtype]]:
    index = path / INDEX
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise HFError(f"{index}: no weight_map")
        files = {name: path / shard for name, shard in weight_map.items()}
        dtypes: dict[str, torch.dtype] = {}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise HFError(f"{index} lists {f.name}, which is missing")
            dtypes.update(_header_dtypes(f))
        unlisted = sorted(n for n in files if n not in dtypes)
        if unlisted:
            raise HFError(f"{index}: {unlisted[0]} is not in the shard the index names")
        return files, {n: dtypes[n] for n in files}
    single = path / SINGLE
    if single.is_file():
        dtypes = _header_dtypes(single)
        return dict.fromkeys(dtypes, single), dtypes
    if (path / "pytorch_model.bin").exists() or list(path.glob("pytorch_model*.bin")):
        raise HFError(f"{path}: holds pickled pytorch_model*.bin weights only; convert them to safetensors "
                      "(they are not loaded: unpickling runs code)")
    raise HFError(f"{path}: no {SINGLE} or {INDEX}")


def open_hf(path: str | Path, *, seq_len: int | None = None) -> HFCheckpoint:
    """Read a local checkpoint folder's config and weight layout (no tensors yet).

    ``path`` must be a folder on this machine: a hub name like ``org/model`` is refused
    (nothing is ever downloaded). Raises :class:`HFError`.
    """
    p = Path(path).expanduser()
    if not p.is_dir():
        hint = (" (model names from a hub are not downloaded: fetch the folder yourself and pass its path)"
                if not p.exists() and str(path).count("/") == 1 and not str(path).startswith((".", "/", "~")) else "")
        raise HFError(f"--init-from {path}: not a folder{hint}")
    if not (p / CONFIG).is_file():
        raise HFError(f"{p}: no {CONFIG}")
    hf = _read_json(p / CONFIG)
    cfg = model_config_from_hf(hf, seq_len=seq_len)
    files, dtypes = _weight_files(p)
    return HFCheckpoint(p, hf, cfg, files, dtypes)


def hf_tensors(files: dict[str, Path], names: list[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for ``names`` (default all), one file opened at a time, one tensor in memory."""
    wanted = list(files) if names is None else names
    by_file: dict[Path, list[str]] = {}
    for n in wanted:
        by_file.setdefault(files[n], []).append(n)
    for file, ns in by_file.items():
        try:
            with safe_open(file, "pt") as f:
                for n in ns:
                    yield n, f.get_tensor(n)
        except (OSError, SafetensorError) as e:
            raise HFError(f"{file}: cannot read tensor ({e})") from None


def _layout(cfg: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """HF tensor name -> (p2ptrain parameter, first row, row count) (count 0: the whole tensor)."""
    q, kv, ff = cfg.d_model, cfg.kv_heads * cfg.head_dim, cfg.hidden
    out = {"model.embed_tokens.weight": ("embed.weight", 0, 0), "model.norm.weight": ("norm.weight", 0, 0)}
    for i in range(cfg.n_layers):
        hf, me = f"model.layers.{i}.", f"blocks.{i}."
        out.update({
            hf + "input_layernorm.weight": (me + "attn_norm.weight", 0, 0),
            hf + "self_attn.q_proj.weight": (me + "attn.qkv.weight", 0, q),
            hf + "self_attn.k_proj.weight": (me + "attn.qkv.weight", q, kv),
            hf + "self_attn.v_proj.weight": (me + "attn.qkv.weight", q + kv, kv),
            hf + "self_attn.o_proj.weight": (me + "attn.proj.weight", 0, 0),
            hf + "post_attention_layernorm.weight": (me + "mlp_norm.weight", 0, 0),
            hf + "mlp.gate_proj.weight": (me + "mlp.gate_up.weight", 0, ff),
            hf + "mlp.up_proj.weight": (me + "mlp.gate_up.weight", ff, ff),
            hf + "mlp.down_proj.weight": (me + "mlp.down.weight", 0, 0),
        })
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = ("head.weight", 0, 0)
    return out


@torch.no_grad()
def load_hf_weights(model: GPT, ckpt: HFCheckpoint) -> None:
    """Copy the checkpoint's tensors into ``model`` (cast to each parameter's dtype, any device).

    The model's config must equal the checkpoint's except for ``seq_len``. Every parameter must
    be covered and every tensor used (a tied checkpoint's redundant ``lm_head.weight`` must equal
    the embedding). Raises :class:`HFError` naming the tensor otherwise.
    """
    mine, theirs = model.cfg.to_dict(), ckpt.model_config.to_dict()
    mine.pop("seq_len"), theirs.pop("seq_len")
    if mine != theirs:
        diff = {k: (mine.get(k), theirs.get(k)) for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k)}
        raise HFError(f"{ckpt.path}: the model does not match the checkpoint's config (model, checkpoint): {diff}")
    params = dict(model.named_parameters())
    layout = _layout(model.cfg)
    extra = sorted(n for n in ckpt.files if n not in layout and not n.endswith(_IGNORED_SUFFIXES)
                   and not (n == "lm_head.weight" and model.cfg.tie_embeddings))
    if extra:
        raise HFError(f"{ckpt.path}: tensors this model has no place for: {', '.join(extra[:5])}"
                      + (f" (+{len(extra) - 5} more)" if len(extra) > 5 else ""))
    missing = sorted(n for n in layout if n not in ckpt.files)
    if missing:
        raise HFError(f"{ckpt.path}: missing tensors: {', '.join(missing[:5])}")
    filled: dict[str, int] = {}
    for name, t in hf_tensors(ckpt.files, list(layout)):
        pname, row, rows = layout[name]
        p = params[pname]
        dst = p if rows == 0 else p[row : row + rows]
        if tuple(t.shape) != tuple(dst.shape):
            raise HFError(f"{ckpt.path}: {name} has shape {tuple(t.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(t.to(device=p.device, dtype=p.dtype))
        filled[pname] = filled.get(pname, 0) + (rows or p.shape[0])
    short = [n for n, p in params.items() if filled.get(n, 0) != p.shape[0] and n != "head.weight"]
    if short:
        raise HFError(f"{ckpt.path}: parameters not filled: {short[:5]}")
    if model.cfg.tie_embeddings and "lm_head.weight" in ckpt.files:
        (_, head), = hf_tensors(ckpt.files, ["lm_head.weight"])
        if not torch.equal(head.to(params["embed.weight"].dtype).cpu(), params["embed.weight"].detach().cpu()):
            raise HFError(f"{ckpt.path}: tie_word_embeddings is true but lm_head.weight differs from the embedding")


def hf_state(params: dict[str, torch.Tensor], cfg: ModelConfig, dtype: torch.dtype,
             dtypes: dict[str, torch.dtype] | None = None) -> dict[str, torch.Tensor]:
    """p2ptrain parameters by name -> HF tensors by name (contiguous CPU copies in ``dtype``, or in
    ``dtypes[name]`` for the tensors it names)."""
    out = {}
    for name, (pname, row, rows) in _layout(cfg).items():
        try:
            p = params[pname]
        except KeyError:
            raise HFError(f"export: parameter {pname} is missing") from None
        src = p if rows == 0 else p[row : row + rows]
        out[name] = src.detach().to("cpu").to((dtypes or {}).get(name, dtype)).contiguous().clone()
    return out


def hf_config(cfg: ModelConfig, dtype: torch.dtype | None, template: dict[str, Any] | None = None) -> dict[str, Any]:
    """A Llama ``config.json`` for ``cfg``: ``template``'s other keys kept, the architecture's set.

    ``max_position_embeddings`` stays the template's when the run used a shorter ``seq_len``;
    the dtype key is the template's when ``dtype`` is None.
    """
    out = dict(template or {})
    max_pos = int(out.get("max_position_embeddings", 0))
    out.update({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.hidden,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads, "max_position_embeddings": max(max_pos, cfg.seq_len),
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_base, "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
    })
    for key, default in (("attention_bias", False), ("mlp_bias", False), ("rope_scaling", None),
                         ("attention_dropout", 0.0), ("initializer_range", 0.02)):
        out.setdefault(key, default)
    # transformers writes the dtype as "torch_dtype" (older) or "dtype" (newer): keep whichever is there.
    key = "dtype" if "dtype" in out and "torch_dtype" not in out else "torch_dtype"
    if dtype is not None or key not in out:
        out[key] = _DTYPE_NAMES[dtype or torch.float32]
    return out


def export_hf(out_dir: str | Path, params: dict[str, torch.Tensor], cfg: ModelConfig, *,
              dtype: torch.dtype | str | None = None, template: str | Path | None = None,
              max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write ``params`` (p2ptrain names) as a Llama checkpoint folder ``out_dir``.

    ``template``: a checkpoint folder whose config keys the export keeps (token ids, ...),
    whose tensors' dtypes it uses by default and whose tokenizer files it copies. ``dtype``:
    float32, bfloat16 or float16 for every tensor (default: as in the template, else float32). Shards of at most
    ``max_shard_bytes`` with an index when the weights are larger. The folder is written
    under a temporary name and renamed into place. Raises :class:`HFError`.
    """
    out = Path(out_dir).expanduser()
    if out.exists() and any(out.iterdir()):
        raise HFError(f"export: {out} exists and is not empty")
    tmpl = open_hf(template) if template is not None else None
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise HFError(f"export: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        dtype = DTYPES[dtype]
    per_tensor = tmpl.dtypes if tmpl is not None and dtype is None else None
    dtype = dtype or (tmpl.dtype if tmpl else torch.float32)
    if dtype not in _DTYPE_NAMES:
        raise HFError(f"export: dtype {dtype} is not one of {', '.join(DTYPES)}")
    if tmpl is not None:
        a, b = cfg.to_dict(), tmpl.model_config.to_dict()
        a.pop("seq_len"), b.pop("seq_len")
        if a != b:
            raise HFError(f"export: the template {tmpl.path} is of another architecture: "
                          f"{ {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)} }")
    tensors = hf_state(params, cfg, dtype, per_tensor)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        meta = {"format": "pt"}
        shards: list[list[str]] = [[]]
        size = 0
        for name in sorted(tensors):
            n = tensors[name].numel() * tensors[name].element_size()
            if shards[-1] and size + n > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(name)
            size += n
        if len(shards) == 1:
            save_file(tensors, tmp / SINGLE, metadata=meta)
        else:
            weight_map = {}
            for k, names in enumerate(shards):
                shard = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file({n: tensors[n] for n in names}, tmp / shard, metadata=meta)
                weight_map.update(dict.fromkeys(names, shard))
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        (tmp / CONFIG).write_text(json.dumps(hf_config(cfg, None if per_tensor else dtype, tmpl.hf_config if tmpl else None), indent=2) + "\n")
        if tmpl is not None:
            for side in SIDE_FILES:
                if (tmpl.path / side).is_file():
                    shutil.copy2(tmpl.path / side, tmp / side)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
