"""Atomic checkpoints: tensors in safetensors, everything else as JSON metadata.

A checkpoint is one ``.safetensors`` file. Tensors anywhere in the saved state
(model, inner optimizer, outer state, ...) are stored by name; the rest of the
state tree (counters, RNG states, configs) is JSON in the file's metadata, with
tensors replaced by references. Files are written to a temporary name, fsynced,
renamed into place and the directory fsynced, so a crash at any moment leaves
either the old or the new checkpoint, never a torn one. A write goes from each
tensor's memory into the file and a read from the file into each tensor's own
memory: neither holds a second copy of the state beside it, which for a
1B-parameter peer would be ~16 GB more at every checkpoint
(bench/checkpoint_memory.py).

Every tensor's CRC-32 rides in the metadata and is checked on load, so damaged tensor
data (a bad disk, a copy cut short, bytes overwritten) is refused by name instead of
training on garbage. CRC-32, not a cryptographic hash: it guards against accidents, not
an adversary, and at ~2 GB/s (zlib, the GIL released) it costs a 1B-parameter peer's
~16 GB of model and optimizer state about 8 s of a background thread per write and per
load. A directory of checkpoints never takes a state with a NaN or infinite tensor: a
run that diverged keeps its last good checkpoints instead of rotating them out.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from safetensors.torch import save_file as st_save_file

from .faults import FaultPlan

__all__ = [
    "CheckpointDir",
    "CheckpointError",
    "NonFiniteState",
    "Snapshot",
    "pack",
    "read_checkpoint",
    "state_from_bytes",
    "state_to_bytes",
    "tensor_bytes",
    "unpack",
    "write_checkpoint",
]

log = logging.getLogger(__name__)

FORMAT = "p2ptrain-checkpoint"
VERSION = "2"  # 2: per-tensor CRC-32 in the metadata (version 1 files, without them, still read)
_READABLE = ("1", "2")
_NAME = re.compile(r"^ckpt-(\d{10})\.safetensors$")


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated, corrupt, or not one of ours."""


class NonFiniteState(CheckpointError):
    """A state with NaN or infinite tensors was not written (the older checkpoints are kept)."""


def tensor_bytes(t: torch.Tensor) -> Any:
    """The raw bytes of a contiguous CPU tensor, without a copy (a buffer ``zlib.crc32`` reads)."""
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""


def _crc32(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    return {name: zlib.crc32(tensor_bytes(t)) for name, t in tensors.items()}


#: Elements checked for NaN and infinity at a time: the check's temporaries stay a few MB whatever the tensor's
#: size (whole, they were ~2.5x the largest tensor: 1 GB beside a 1B-parameter model's 400 MB embedding).
_FINITE_CHUNK = 1 << 20


def _finite(t: torch.Tensor) -> bool:
    return all(bool(torch.isfinite(c).all()) for c in t.reshape(-1).split(_FINITE_CHUNK))


def non_finite(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors holding a NaN or an infinity."""
    return [n for n, t in tensors.items() if t.is_floating_point() and t.numel() and not _finite(t)]


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


@dataclass(frozen=True)
class Snapshot:
    """A state tree already packed (:func:`pack`: every tensor copied to CPU), so that it can be serialised and
    written while the state it came from moves on (a peer's checkpoint written in the background)."""

    tree: Any
    tensors: dict[str, torch.Tensor]


def _packed(state: dict[str, Any] | Snapshot, finite: bool) -> tuple[Any, dict[str, torch.Tensor], dict[str, str]]:
    """The tree, the tensors and the file's metadata (with every tensor's CRC-32) of a state to write."""
    tree, tensors = (state.tree, state.tensors) if isinstance(state, Snapshot) else pack(state)
    if finite and (bad := non_finite(tensors)):
        raise NonFiniteState(f"not written: {len(bad)} tensor(s) hold NaN or inf ({_paths(tree, bad)})")
    return tree, tensors, {"format": FORMAT, "version": VERSION, "tree": json.dumps(tree),
                           "crc32": json.dumps(_crc32(tensors))}


def state_to_bytes(state: dict[str, Any] | Snapshot, finite: bool = False) -> bytes:
    """A state tree as one self-describing safetensors payload (what :func:`write_checkpoint` writes), with
    every tensor's CRC-32. ``finite``: raise :class:`NonFiniteState` instead if a tensor is not finite."""
    _, tensors, meta = _packed(state, finite)
    return st_save(tensors, metadata=meta)


def _paths(tree: Any, names: list[str], limit: int = 3) -> str:
    """Where the tensors ``names`` sit in the state tree (``trainer.model.wte.weight``), the first few."""
    found: dict[str, str] = {}

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict) and "__tensor__" in node:
            found[node["__tensor__"]] = path or "."
        elif isinstance(node, dict):
            for k, v in node.get("__dict__", []):
                walk(v, f"{path}.{k}" if path else str(k))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}[{i}]")

    walk(tree, "")
    shown = [found.get(n, n) for n in names[:limit]]
    return ", ".join(shown) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def state_from_bytes(raw: bytes, what: str = "state") -> dict[str, Any]:
    """Inverse of :func:`state_to_bytes`; CheckpointError on anything malformed."""
    meta = _metadata(raw, Path(what))
    try:
        tensors = st_load(raw)
    except (SafetensorError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{what}: corrupt or truncated ({e})") from None
    return _unpacked(meta, tensors, what)


def _unpacked(meta: dict[str, str], tensors: dict[str, torch.Tensor], what: str) -> dict[str, Any]:
    """The state tree of a file's metadata and tensors, each tensor checked against its CRC-32 if it has one."""
    try:
        tree = json.loads(meta["tree"])
        expected = json.loads(meta["crc32"]) if "crc32" in meta else None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{what}: corrupt or truncated ({e})") from None
    if expected is not None:
        got = _crc32(tensors)
        bad = sorted(n for n in set(expected) | set(got) if expected.get(n) != got.get(n))
        if bad:
            raise CheckpointError(f"{what}: corrupt tensor data, checksum mismatch in {_paths(tree, bad)}")
    try:
        return unpack(tree, tensors)
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{what}: corrupt or truncated ({e})") from None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(path: str | Path, state: dict[str, Any] | Snapshot, faults: FaultPlan | None = None,
                     finite: bool = True) -> Path:
    """Write ``state`` to ``path`` atomically (temp file, fsync, rename, fsync dir). ``faults``: a plan whose
    armed checkpoint kill fires half-way through this write (tests; none: no fault). On any error the
    temporary file is removed and the old checkpoint, if any, is left as it was. ``finite``: refuse a state
    with a NaN or infinite tensor (:class:`NonFiniteState`, nothing written)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _, tensors, meta = _packed(state, finite)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        # Each tensor straight from its memory into the file (save_file writes from the tensors' pointers), not
        # through one payload of the whole state beside them: for a 1B-parameter peer's ~16 GB of model and
        # optimizer state, 16 GB more at every write (bench/checkpoint_memory.py).
        st_save_file(tensors, tmp, metadata=meta)
        if faults is not None and faults.armed:
            os.truncate(tmp, os.path.getsize(tmp) // 2)  # the file a kill half-way through the write leaves
            faults.mid_write()  # fault injection (tests): off unless the plan armed it
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def _header(raw: bytes, path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors payload (a u64 little-endian length, then the JSON), checked as ours."""
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
    if meta.get("version") not in _READABLE:
        raise CheckpointError(f"{path}: checkpoint format version {meta.get('version')} is not supported")
    return header


def _metadata(raw: bytes, path: Path) -> dict[str, str]:
    return _header(raw, path)["__metadata__"]


#: safetensors' dtype names (those torch has).
_DTYPES = {name: getattr(torch, attr) for name, attr in (
    ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"), ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"), ("I64", "int64"), ("I32", "int32"), ("I16", "int16"), ("I8", "int8"),
    ("U64", "uint64"), ("U32", "uint32"), ("U16", "uint16"), ("U8", "uint8"), ("BOOL", "bool"))
    if hasattr(torch, attr)}


def _read_tensors(f: Any, header: dict[str, Any], start: int, size: int, path: Path) -> dict[str, torch.Tensor]:
    """Every tensor the header names, read from the open file ``f`` straight into a tensor of its own (the data
    begins at ``start``; the file is ``size`` bytes): each entry is checked against the file before anything
    is allocated for it, so a corrupt header cannot ask for more memory than the file holds."""
    tensors: dict[str, torch.Tensor] = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES[spec["dtype"]]
            shape = [int(d) for d in spec["shape"]]
            begin, end = (int(x) for x in spec["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt header entry {name!r}") from None
        nbytes = math.prod(shape) * dtype.itemsize
        if min(shape, default=0) < 0 or not 0 <= begin <= end or end - begin != nbytes:
            raise CheckpointError(f"{path}: corrupt header entry {name!r}")
        if start + end > size:
            raise CheckpointError(f"{path}: truncated (tensor {name!r} ends past the end of the file)")
        t = torch.empty(shape, dtype=dtype)
        f.seek(start + begin)
        if nbytes and f.readinto(t.view(-1).view(torch.uint8).numpy()) != nbytes:
            raise CheckpointError(f"{path}: truncated (tensor {name!r} cut short)")
        tensors[name] = t
    return tensors


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint written by :func:`write_checkpoint`; raises :class:`CheckpointError`.

    Each tensor is read from the file into memory of its own: the state is held once, not beside a buffer of
    the whole file (as ``path.read_bytes()`` and safetensors' ``load`` did), and no tensor stays backed by the
    file (safetensors' ``load_file`` and ``safe_open`` map it: a later truncation in place would turn into a
    SIGBUS in training, and the mapped pages count as the process's memory on top of the copies)."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            size = os.fstat(f.fileno()).st_size
            raw = head + (f.read(n) if 8 + n <= size else b"")  # (a length past the file's end: read nothing)
            header = _header(raw, path)
            tensors = _read_tensors(f, header, 8 + n, size, path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
    return _unpacked(header["__metadata__"], tensors, str(path))


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

    def save(self, step: int, state: dict[str, Any] | Snapshot) -> Path:
        """Write the checkpoint of ``step`` and drop the oldest beyond ``keep``. A state that is not finite is
        refused (:class:`NonFiniteState`) before anything is written or rotated out."""
        path = write_checkpoint(self.root / f"ckpt-{step:010d}.safetensors", state, self.faults)
        for _, old in self.paths()[: -self.keep]:
            old.unlink(missing_ok=True)
        return path

    def latest(self) -> tuple[Path, dict[str, Any]] | None:
        """The newest checkpoint that reads back cleanly and verifies; each newer one that does not is named
        in a warning, and the older ones are tried in turn."""
        errors = []
        for _, path in reversed(self.paths()):
            try:
                found = path, read_checkpoint(path)
            except CheckpointError as e:
                log.warning("event=checkpoint_unusable path=%s reason=%s (trying an older one)", path, e)
                errors.append(str(e))
                continue
            if errors:
                log.warning("event=checkpoint_fallback path=%s skipped=%d", path, len(errors))
            return found
        if errors:
            raise CheckpointError("no readable checkpoint: " + "; ".join(errors))
        return None
