"""Token sources: a byte-level tokenizer and seeded per-peer streams.

The built-in corpus is the running interpreter's own standard library source
(found via ``sysconfig``), so training needs no download. ``--data PATH`` takes a
text file, a folder of text files, or a pre-tokenized ``uint16`` ``.bin`` token
file (memory-mapped). Validation is held out by *file* (a hash of the relative
path), or the last 1% of a ``.bin`` file, and is the same on every peer.

``.jsonl`` and ``.parquet`` files (or a folder holding them), and any text source
when a ``tokenizer`` is given, go through :mod:`p2ptrain.textdata`: read streamed,
tokenized once into an on-disk cache, then memory-mapped.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from .corpus import FILE_SEPARATOR, Corpus, DataError

__all__ = [
    "ByteTokenizer",
    "Corpus",
    "DataConfig",
    "DataError",
    "TokenStream",
    "builtin_files",
    "load_corpus",
]

BIN_SUFFIX = ".bin"


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255. Lossless for any text."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int] | np.ndarray | torch.Tensor) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


@dataclass(kw_only=True)
class DataConfig:
    """Where tokens come from and how each peer draws them.

    Attributes:
        path: None for the built-in corpus; else a text file, folder, or ``.bin`` uint16 tokens.
        val_percent: percentage of files (or of a ``.bin`` file's tail) held out for validation.
        split: ``iid``: every peer samples the whole training set with its own seed;
            ``non-iid``: peer r of M samples only its own contiguous share of the files.
        seed: base seed; peer r draws from ``(seed, r)``.
        tokenizer: a local ``tokenizer.json`` (or a folder holding one) to tokenize text,
            ``.jsonl`` and ``.parquet`` sources with; None: UTF-8 bytes.
        text_field: the ``.jsonl`` field / ``.parquet`` column holding a document's text.
        cache_dir: where tokenized sources are cached (default ``~/.cache/p2ptrain/tokens``).
    """

    path: str | None = None
    val_percent: float = 2.0
    split: Literal["iid", "non-iid"] = "iid"
    seed: int = 0
    tokenizer: str | None = None
    text_field: str = "text"
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if not self.text_field:
            raise DataError("data: text_field must not be empty")
        if not 0.0 < self.val_percent < 50.0:
            raise DataError(f"data: val_percent must be in (0, 50), got {self.val_percent}")
        if self.split not in ("iid", "non-iid"):
            raise DataError(f"data: split must be 'iid' or 'non-iid', got {self.split!r}")


def builtin_files() -> tuple[Path, list[Path]]:
    """The standard library's ``*.py`` files of the running interpreter, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for folder, subfolders, names in os.walk(root):  # 16x faster than rglob: installed packages are not walked
        subfolders[:] = [d for d in subfolders if d not in ("site-packages", "dist-packages")]
        files.extend(Path(folder) / n for n in names if n.endswith(".py"))
    return root, sorted(files)


def _is_validation(rel: str, val_percent: float) -> bool:
    digest = int.from_bytes(hashlib.sha1(rel.encode()).digest()[:8], "big")
    return (digest % 10_000) < val_percent * 100


def _read_texts(files: list[Path]) -> list[bytes]:
    out = []
    for f in files:
        data = f.read_bytes()
        if data and b"\x00" not in data[:8192]:  # skip binary files
            out.append(data)
    return out


def _join(chunks: list[bytes]) -> np.ndarray:
    return np.frombuffer(FILE_SEPARATOR.join(chunks), dtype=np.uint8)


def _text_corpus(name: str, root: Path, files: list[Path], val_percent: float) -> Corpus:
    train_files, val_files = [], []
    for f in files:
        rel = f.relative_to(root).as_posix() if f != root else f.name
        (val_files if _is_validation(rel, val_percent) else train_files).append(f)
    train_chunks = _read_texts(train_files)
    val_chunks = _read_texts(val_files)
    if not val_chunks and len(train_chunks) >= 2:
        # Too few files for the hash split: hold out the last file.
        val_chunks = [train_chunks.pop()]
    if not val_chunks and len(train_chunks) == 1:
        # A single file: hold out its tail.
        data = train_chunks[0]
        cut = int(len(data) * (1 - val_percent / 100))
        train_chunks, val_chunks = [data[:cut]], [data[cut:]]
    if not train_chunks or sum(map(len, train_chunks)) == 0:
        raise DataError(f"data: {name} holds no readable text (empty files or binary only)")
    sizes = np.array([len(c) + len(FILE_SEPARATOR) for c in train_chunks], dtype=np.int64)
    bounds = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return Corpus(name, _join(train_chunks), _join(val_chunks), ByteTokenizer.vocab_size, bounds)


def _bin_corpus(path: Path, val_percent: float) -> Corpus:
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"data: {path} is empty")
    if size % 2:
        raise DataError(
            f"data: {path} has an odd number of bytes ({size}); a .bin token file must hold uint16 tokens"
        )
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    cut = int(len(tokens) * (1 - val_percent / 100))
    if cut < 2 or len(tokens) - cut < 2:
        raise DataError(f"data: {path} holds only {len(tokens)} tokens, too few to split")
    vocab = int(tokens.max()) + 1
    vocab = 64 * -(-vocab // 64)  # round up so the head matmul stays aligned
    return Corpus(path.name, tokens[:cut], tokens[cut:], vocab, np.zeros(1, dtype=np.int64))


def _tokenized(cfg: DataConfig, name: str, files: list[Path]) -> Corpus:
    from .textdata import tokenized_corpus

    return tokenized_corpus(name, files, tokenizer=cfg.tokenizer, text_field=cfg.text_field,
                            val_percent=cfg.val_percent, cache_dir=cfg.cache_dir)


def load_corpus(cfg: DataConfig) -> Corpus:
    """Load the corpus named by ``cfg`` (see module docstring); raises :class:`DataError`."""
    from .textdata import RECORD_SUFFIXES

    if cfg.path is None:
        root, files = builtin_files()
        if not files:
            raise DataError(f"data: no standard library sources found under {root}; pass --data PATH")
        if cfg.tokenizer:
            return _tokenized(cfg, f"stdlib ({root})", files)
        return _text_corpus(f"stdlib ({root})", root, files, cfg.val_percent)
    path = Path(cfg.path).expanduser()
    if not path.exists():
        raise DataError(f"data: {path} does not exist")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        if not files:
            raise DataError(f"data: folder {path} holds no files")
        records = [p for p in files if p.suffix in RECORD_SUFFIXES]
        if records:  # a data set folder: its .jsonl/.parquet files only
            return _tokenized(cfg, str(path), records)
        if cfg.tokenizer:
            return _tokenized(cfg, str(path), files)
        return _text_corpus(str(path), path, files, cfg.val_percent)
    if path.suffix == BIN_SUFFIX:
        if cfg.tokenizer:
            raise DataError(f"data: {path} holds token ids already; a tokenizer is only for text sources")
        return _bin_corpus(path, cfg.val_percent)
    if not os.access(path, os.R_OK):
        raise DataError(f"data: {path} is not readable")
    if path.suffix in RECORD_SUFFIXES or cfg.tokenizer:
        return _tokenized(cfg, str(path), [path])
    return _text_corpus(str(path), path.parent, [path], cfg.val_percent)


class TokenStream:
    """Seeded random windows of ``seq_len + 1`` tokens for one peer.

    Peer ``rank`` of ``world`` draws from its own generator seeded by
    ``(seed, rank)``. With ``split="non-iid"`` it only draws from its contiguous
    share of the training files. The generator state is part of
    :meth:`state_dict`, so a resumed peer continues the same stream.
    """

    def __init__(self, corpus: Corpus, *, seq_len: int, batch_size: int, seed: int = 0,
                 rank: int = 0, world: int = 1, split: str = "iid") -> None:
        if batch_size <= 0 or seq_len <= 0:
            raise DataError("data: batch_size and seq_len must be positive")
        if not 0 <= rank < world:
            raise DataError(f"data: rank {rank} out of range for {world} peers")
        self.corpus, self.seq_len, self.batch_size = corpus, seq_len, batch_size
        lo, hi = 0, len(corpus.train)
        if split == "non-iid" and world > 1:
            bounds = corpus.train_bounds
            if len(bounds) < world:
                raise DataError(f"data: non-iid split needs at least {world} files, corpus has {len(bounds)}")
            edges = np.linspace(0, len(bounds), world + 1).astype(int)
            lo = int(bounds[edges[rank]])
            hi = int(bounds[edges[rank + 1]]) if edges[rank + 1] < len(bounds) else len(corpus.train)
        if hi - lo <= seq_len + 1:
            raise DataError(
                f"data: {hi - lo} training tokens for this peer, need more than seq_len+1 = {seq_len + 1}"
            )
        self.lo, self.hi = lo, hi
        self.rng = np.random.Generator(np.random.PCG64([seed, rank]))
        self.batches_drawn = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, each int64 [batch_size, seq_len] on CPU."""
        starts = self.rng.integers(self.lo, self.hi - self.seq_len - 1, size=self.batch_size)
        idx = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        window = torch.from_numpy(self.corpus.train[idx].astype(np.int64))
        self.batches_drawn += 1
        return window[:, :-1], window[:, 1:]

    def reseed(self, seed: int, rank: int) -> None:
        """Draw from ``(seed, rank)`` from now on (a swarm peer learns its rank from its identity)."""
        self.rng = np.random.Generator(np.random.PCG64([seed, rank]))

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state, "batches_drawn": self.batches_drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.batches_drawn = int(state["batches_drawn"])


def validation_batches(corpus: Corpus, *, seq_len: int, batch_size: int,
                       num_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed held-out set: ``num_batches`` batches of evenly spaced windows."""
    n = len(corpus.val)
    if n <= seq_len + 1:
        raise DataError(f"data: validation split has {n} tokens, need more than seq_len+1 = {seq_len + 1}")
    count = num_batches * batch_size
    starts = np.linspace(0, n - seq_len - 1, count).astype(np.int64)
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    windows = torch.from_numpy(corpus.val[idx].astype(np.int64)).view(num_batches, batch_size, seq_len + 1)
    return [(w[:, :-1], w[:, 1:]) for w in windows]
