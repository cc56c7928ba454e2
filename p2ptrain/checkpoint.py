"""Atomic checkpoints: tensors in safetensors, everything else as JSON metadata.

A checkpoint is one ``.safetensors`` file. Tensors anywhere in the saved state
(model, inner optimizer, outer state, ...) are stored by name; the rest of the
state tree (counters, RNG states, configs) is JSON in the file's metadata, with
tensors replaced by references. Files are written to a temporary name, fsynced,
renamed into place and the directory fsynced, so a crash at any moment leaves
either the old or the new checkpoint, never a torn one.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .faults import FaultPlan

__all__ = [
    "CheckpointDir",
    "CheckpointError",
    "pack",
    "read_checkpoint",
    "state_from_bytes",
    "state_to_bytes",
    "unpack",
    "write_checkpoint",
]

FORMAT = "p2ptrain-checkpoint"
VERSION = "1"
_NAME = re.compile(r"^ckpt-(\d{10})\.safetensors$")


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated, corrupt, or not one of ours."""


def pack(state: Any, tensors: dict[str, torch.Tensor] | None = None, prefix: str = "t") -> tuple[Any, dict[str, torch.Tensor]]:
    """Split ``state`` into a JSON-able tree and a flat ``{name: tensor}`` dict.

    Dicts keep their key types (int keys survive), tuples become lists.
    """
    tensors = {} if tensors is None else tensors
    if isinstance(state, torch.Tensor):
        name = f"{prefix}{len(tensors)}"
        # safetensors wants contiguous tensors that share no storage; keep them on CPU.
        tensors[name] = state.detach().to("cpu", copy=True).contiguous()
        return {"__tensor__": name}, tensors
    if isinstance(state, dict):
        items = []
        for k, v in state.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"checkpoint: dict key {k!r} must be str or int")
            tree, _ = pack(v, tensors, prefix)
            items.append([k, tree])
        return {"__dict__": items}, tensors
    if isinstance(state, (list, tuple)):
        return [pack(v, tensors, prefix)[0] for v in state], tensors
    if state is None or isinstance(state, (bool, int, float, str)):
        return state, tensors
    raise TypeError(f"checkpoint: cannot store value of type {type(state).__name__}")


def unpack(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`pack`."""
    if isinstance(tree, dict):
        if "__tensor__" in tree:
            return tensors[tree["__tensor__"]]
        return {k: unpack(v, tensors) for k, v in tree["__dict__"]}
    if isinstance(tree, list):
        return [unpack(v, tensors) for v in tree]
    return tree


def state_to_bytes(state: dict[str, Any]) -> bytes:
    """A state tree as one self-describing safetensors payload (what :func:`write_checkpoint` writes)."""
    tree, tensors = pack(state)
    return st_save(tensors, metadata={"format": FORMAT, "version": VERSION, "tree": json.dumps(tree)})


def state_from_bytes(raw: bytes, what: str = "state") -> dict[str, Any]:
    """Inverse of :func:`state_to_bytes`; CheckpointError on anything malformed."""
    meta = _metadata(raw, Path(what))
    try:
        tensors = st_load(raw)
        return unpack(json.loads(meta["tree"]), tensors)
    except (SafetensorError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{what}: corrupt or truncated ({e})") from None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(path: str | Path, state: dict[str, Any], faults: FaultPlan | None = None) -> Path:
    """Write ``state`` to ``path`` atomically (temp file, fsync, rename, fsync dir). ``faults``: a plan whose
    armed checkpoint kill fires half-way through this write (tests; none: no fault). On any error the
    temporary file is removed and the old checkpoint, if any, is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = state_to_bytes(state)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            view, half = memoryview(payload), len(payload) // 2
            f.write(view[:half])
            f.flush()
            if faults is not None:
                faults.mid_write()  # fault injection (tests): off unless the plan armed it
            f.write(view[half:])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def _metadata(raw: bytes, path: Path) -> dict[str, str]:
    # safetensors layout: u64 little-endian header length, then a JSON header.
    if len(raw) < 8:
        raise CheckpointError(f"{path}: truncated ({len(raw)} bytes)")
    n = int.from_bytes(raw[:8], "little")
    if n > len(raw) - 8:
        raise CheckpointError(f"{path}: truncated or not a safetensors file")
    try:
        header = json.loads(raw[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{path}: not a safetensors file (unreadable header)") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a p2ptrain checkpoint")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{path}: checkpoint format version {meta.get('version')} is not supported")
    return meta


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint written by :func:`write_checkpoint`; raises :class:`CheckpointError`."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
    return state_from_bytes(raw, str(path))


class CheckpointDir:
    """Numbered checkpoints ``ckpt-<step>.safetensors`` in a folder, keeping the last ``keep``; ``faults``
    (default: what the environment asks for, see :mod:`p2ptrain.faults`) can kill a write half-way."""

    def __init__(self, root: str | Path, keep: int = 3, faults: FaultPlan | None = None) -> None:
        if keep < 1:
            raise ValueError("checkpoint: keep must be at least 1")
        self.root, self.keep = Path(root), keep
        self.faults = FaultPlan.from_env() if faults is None else faults

    def paths(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if (m := _NAME.match(p.name))]
        return sorted(found)

    def remove_temporaries(self) -> int:
        """Delete temporary files of writes that never finished (call only when no write is running)."""
        if not self.root.is_dir():
            return 0
        stale = [p for p in self.root.iterdir() if p.name.startswith(".ckpt-") and p.name.endswith(".tmp")]
        for p in stale:
            p.unlink(missing_ok=True)
        return len(stale)

    def save(self, step: int, state: dict[str, Any]) -> Path:
        path = write_checkpoint(self.root / f"ckpt-{step:010d}.safetensors", state, self.faults)
        for _, old in self.paths()[: -self.keep]:
            old.unlink(missing_ok=True)
        return path

    def latest(self) -> tuple[Path, dict[str, Any]] | None:
        """The newest checkpoint that reads back cleanly (older ones are tried if it does not)."""
        errors = []
        for _, path in reversed(self.paths()):
            try:
                return path, read_checkpoint(path)
            except CheckpointError as e:
                errors.append(str(e))
        if errors:
            raise CheckpointError("no readable checkpoint: " + "; ".join(errors))
        return None
