"""Documents from local ``.jsonl`` / ``.parquet`` / text files, tokenized once into an on-disk cache.

Sources are read streamed (a ``.jsonl`` line, a parquet record batch, a text file at a
time; never a whole data set in memory) and tokenized with a local ``tokenizer.json``
(the ``tokenizers`` library) or as UTF-8 bytes. Token ids are appended to files in a
cache folder keyed by the sources (paths, sizes, modification times), the tokenizer's
bytes and the settings; training then reads random windows from memory maps of them, so
resuming, per-peer seeded streams and the non-i.i.d. split work as for a ``.bin`` file.
A second run (or a second peer on the same machine) finds the cache and starts at once.

A document is held out for validation by a hash of its text, so every peer holds out the
same documents. Documents are concatenated: with a tokenizer, each is encoded with the
tokenizer's own special tokens (a Llama tokenizer puts its BOS token before each
document); as bytes, they are separated by a blank line. Nothing is downloaded: a
tokenizer path that does not exist is an error (a hub name gets a hint).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .corpus import FILE_SEPARATOR, Corpus, DataError

__all__ = ["RECORD_SUFFIXES", "Tokenizer", "cache_root", "load_tokenizer", "tokenized_corpus"]

log = logging.getLogger(__name__)

RECORD_SUFFIXES = (".jsonl", ".parquet")
CACHE_VERSION = "1"
FLUSH_TOKENS = 1 << 20
MAX_BOUNDS = 1 << 16  # document starts kept for the non-i.i.d. split (thinned evenly beyond this)
ENCODE_BATCH = 256


class Tokenizer:
    """A local ``tokenizer.json`` (``tokenizers`` library), or UTF-8 bytes when ``path`` is None."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._tok: Any = None
        if path is None:
            self.vocab_size, self.digest = 256, "bytes"
            return
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError:
            raise DataError("data: --tokenizer needs the tokenizers package: pip install 'p2ptrain[hf]'") from None
        raw = path.read_bytes()
        try:
            self._tok = _HFTokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # the library raises a bare Exception on a malformed file
            raise DataError(f"data: {path} is not a valid tokenizer.json ({e})") from None
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.digest = hashlib.sha256(raw).hexdigest()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self._tok is None:
            return [list(t.encode("utf-8")) + list(FILE_SEPARATOR) for t in texts]
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=True)]

    def decode(self, ids: list[int]) -> str:
        if self._tok is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return str(self._tok.decode(ids, skip_special_tokens=False))


def load_tokenizer(path: str | None) -> Tokenizer:
    """The tokenizer at ``path`` (a ``tokenizer.json`` or a folder holding one); bytes when None.

    Raises :class:`DataError` for a missing file (with a hint when it looks like a hub name).
    """
    if path is None:
        return Tokenizer(None)
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        hint = ""
        if not Path(path).exists() and path.count("/") == 1 and not path.startswith((".", "/", "~")):
            hint = " (tokenizers are not downloaded from a hub: save its tokenizer.json locally and pass that path)"
        raise DataError(f"data: tokenizer {p} does not exist{hint}")
    return Tokenizer(p)


def cache_root(cache_dir: str | None) -> Path:
    """``cache_dir``, else ``$XDG_CACHE_HOME/p2ptrain/tokens`` (``~/.cache/p2ptrain/tokens``)."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "p2ptrain" / "tokens"


def _documents(path: Path, text_field: str) -> Iterator[tuple[str, int]]:
    """``(text, bytes of the file read so far)`` for each document of one source file."""
    if path.suffix == ".jsonl":
        with path.open("rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise DataError(f"data: {path}:{lineno} is not valid JSON ({e})") from None
                if not isinstance(record, dict) or text_field not in record:
                    keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
                    raise DataError(f"data: {path}:{lineno} has no field {text_field!r} (has: {keys}); "
                                    "choose one with text_field in [data]")
                text = record[text_field]
                if text is None:
                    continue
                if not isinstance(text, str):
                    raise DataError(f"data: {path}:{lineno}: field {text_field!r} is a {type(text).__name__}, not text")
                yield text, f.tell()
    elif path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError("data: .parquet files need the pyarrow package: pip install 'p2ptrain[hf]'") from None
        try:
            pf = pq.ParquetFile(path)
        except Exception as e:  # pyarrow raises its own ArrowInvalid (a ValueError) or OSError
            raise DataError(f"data: {path} is not a readable parquet file ({e})") from None
        names = pf.schema_arrow.names
        if text_field not in names:
            raise DataError(f"data: {path} has no column {text_field!r} (has: {', '.join(names)}); "
                            "choose one with text_field in [data]")
        size, rows = path.stat().st_size, max(pf.metadata.num_rows, 1)
        done = 0
        for batch in pf.iter_batches(batch_size=ENCODE_BATCH, columns=[text_field]):
            column = batch.column(0)
            done += len(column)
            for text in column.to_pylist():
                if text is None:
                    continue
                if not isinstance(text, str):
                    raise DataError(f"data: {path}: column {text_field!r} holds {type(text).__name__}, not text")
                yield text, size * done // rows
    else:
        data = path.read_bytes()
        if data and b"\x00" not in data[:8192]:  # binary files are skipped, as in the byte corpus
            yield data.decode("utf-8", errors="replace"), len(data)


def _is_validation(text: str, val_percent: float) -> bool:
    digest = int.from_bytes(hashlib.sha1(text.encode("utf-8", errors="replace")).digest()[:8], "big")
    return (digest % 10_000) < val_percent * 100


def _dtype(vocab_size: int) -> np.dtype[Any]:
    return np.dtype(np.uint8 if vocab_size <= 256 else np.uint16 if vocab_size <= 65536 else np.uint32)


def _cache_key(files: list[Path], tok: Tokenizer, text_field: str, val_percent: float) -> str:
    h = hashlib.sha256(f"{CACHE_VERSION}|{tok.digest}|{text_field}|{val_percent!r}".encode())
    for f in files:
        st = f.stat()
        h.update(f"|{f.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:24]


class _Writer:
    """Appends token ids to one split's file in chunks."""

    def __init__(self, path: Path, dtype: np.dtype[Any]) -> None:
        self.f = path.open("wb")
        self.dtype, self.buf, self.count = dtype, [], 0
        self.pending = 0

    def add(self, ids: list[int]) -> None:
        self.buf.append(np.asarray(ids, dtype=self.dtype))
        self.pending += len(ids)
        self.count += len(ids)
        if self.pending >= FLUSH_TOKENS:
            self.flush()

    def flush(self) -> None:
        for a in self.buf:
            a.tofile(self.f)
        self.buf, self.pending = [], 0

    def close(self) -> None:
        self.flush()
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()


def _build(folder: Path, files: list[Path], tok: Tokenizer, text_field: str, val_percent: float,
           show_progress: bool) -> None:
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    from .ui import console

    dtype = _dtype(tok.vocab_size)
    train, val = _Writer(folder / "train.bin", dtype), _Writer(folder / "val.bin", dtype)
    bounds, docs = _Bounds(), 0
    total = sum(f.stat().st_size for f in files)
    columns = [TextColumn("[bold]tokenize"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn()]
    try:
        with Progress(*columns, console=console, disable=not show_progress) as prog:
            task = prog.add_task("tokenize", total=total)
            done_before = 0
            for f in files:
                batch: list[str] = []
                for text, read in _documents(f, text_field):
                    batch.append(text)
                    if len(batch) >= ENCODE_BATCH:
                        docs += _write_docs(batch, tok, train, val, bounds, val_percent)
                        batch = []
                        prog.update(task, completed=done_before + read)
                docs += _write_docs(batch, tok, train, val, bounds, val_percent)
                done_before += f.stat().st_size
                prog.update(task, completed=done_before)
    finally:
        train.close()
        val.close()
    meta = {"version": CACHE_VERSION, "vocab_size": tok.vocab_size, "dtype": dtype.name, "documents": docs,
            "train_tokens": train.count, "val_tokens": val.count, "tokenizer": str(tok.path) if tok.path else "bytes",
            "text_field": text_field, "files": [str(f) for f in files]}
    np.save(folder / "bounds.npy", np.asarray(bounds.starts, dtype=np.int64))
    (folder / "meta.json").write_text(json.dumps(meta, indent=2))


class _Bounds:
    """Start offsets of training documents, for the non-i.i.d. split: every document's while there
    are at most MAX_BOUNDS, then thinned to every other one with a minimum gap that doubles."""

    def __init__(self) -> None:
        self.starts, self.gap = [0], 1

    def add(self, pos: int) -> None:
        if pos - self.starts[-1] >= self.gap:
            self.starts.append(pos)
            if len(self.starts) > MAX_BOUNDS:
                self.starts = self.starts[::2]
                self.gap = max(self.gap * 2, pos // len(self.starts))


def _write_docs(texts: list[str], tok: Tokenizer, train: _Writer, val: _Writer, bounds: _Bounds,
                val_percent: float) -> int:
    if not texts:
        return 0
    for text, ids in zip(texts, tok.encode_batch(texts), strict=True):
        if not ids:
            continue
        if _is_validation(text, val_percent):
            val.add(ids)
        else:
            bounds.add(train.count)
            train.add(ids)
    return len(texts)


def tokenized_corpus(name: str, files: list[Path], *, tokenizer: str | None, text_field: str = "text",
                     val_percent: float = 2.0, cache_dir: str | None = None, show_progress: bool = True) -> Corpus:
    """The :class:`Corpus` of ``files`` tokenized by ``tokenizer`` (bytes when None), from the cache
    when it is there, else built (streamed) and cached. Raises :class:`DataError`."""
    tok = load_tokenizer(tokenizer)
    root = cache_root(cache_dir)
    folder = root / _cache_key(files, tok, text_field, val_percent)
    if not (folder / "meta.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
        try:
            log.info("event=tokenize files=%d tokenizer=%s cache=%s", len(files), tok.path or "bytes", folder)
            _build(tmp, files, tok, text_field, val_percent, show_progress)
            try:
                os.rename(tmp, folder)
            except OSError:  # another process on this machine finished the same cache first
                if not (folder / "meta.json").is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    else:
        log.info("event=tokenize_cached cache=%s", folder)
    meta = json.loads((folder / "meta.json").read_text())
    dtype = np.dtype(meta["dtype"])

    def mapped(split: str) -> np.ndarray:
        if meta[f"{split}_tokens"] == 0:
            return np.zeros(0, dtype=dtype)
        return np.memmap(folder / f"{split}.bin", dtype=dtype, mode="r")

    train, val = mapped("train"), mapped("val")
    bounds = np.load(folder / "bounds.npy")
    if len(train) < 2:
        raise DataError(f"data: {name} holds no text to train on ({meta['documents']} documents)")
    if len(val) == 0:  # too few documents for the hash split: hold out the tail of the training tokens
        cut = int(len(train) * (1 - val_percent / 100))
        train, val = train[:cut], train[cut:]
        bounds = bounds[bounds < cut]
    what = f"tokenizer {tok.path}" if tok.path else "bytes"
    return Corpus(f"{name} ({meta['documents']:,} documents, {what})", train, val, tok.vocab_size, bounds)
