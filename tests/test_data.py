from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from p2ptrain.data import (
    ByteTokenizer,
    Corpus,
    DataConfig,
    DataError,
    TokenStream,
    load_corpus,
    validation_batches,
)


@given(st.text())
def test_tokenizer_round_trip(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text


def test_builtin_corpus_is_real_text(corpus: Corpus) -> None:
    assert corpus.vocab_size == 256
    assert len(corpus.train) > 1_000_000 and len(corpus.val) > 10_000
    assert b"def " in corpus.train[:200_000].tobytes()


def test_stream_is_deterministic_per_seed_and_differs_per_peer(corpus: Corpus) -> None:
    def batches(seed: int, rank: int) -> list[torch.Tensor]:
        s = TokenStream(corpus, seq_len=32, batch_size=4, seed=seed, rank=rank, world=4)
        return [s.next_batch()[0] for _ in range(3)]

    a, b = batches(0, 1), batches(0, 1)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not torch.equal(batches(0, 2)[0], a[0])
    assert not torch.equal(batches(1, 1)[0], a[0])


def test_targets_are_inputs_shifted(corpus: Corpus) -> None:
    s = TokenStream(corpus, seq_len=32, batch_size=2)
    x, y = s.next_batch()
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_stream_resumes_from_state(corpus: Corpus) -> None:
    s = TokenStream(corpus, seq_len=16, batch_size=2, seed=3)
    s.next_batch()
    state = s.state_dict()
    expected = s.next_batch()[0]
    t = TokenStream(corpus, seq_len=16, batch_size=2, seed=99)
    t.load_state_dict(state)
    assert torch.equal(t.next_batch()[0], expected)
    assert t.batches_drawn == 2


def test_non_iid_split_gives_disjoint_ranges(corpus: Corpus) -> None:
    streams = [TokenStream(corpus, seq_len=16, batch_size=2, rank=r, world=4, split="non-iid") for r in range(4)]
    ranges = [(s.lo, s.hi) for s in streams]
    assert ranges[0][0] == 0 and ranges[-1][1] == len(corpus.train)
    for (_, hi), (lo, _) in itertools.pairwise(ranges):
        assert hi == lo


def test_validation_set_is_fixed(corpus: Corpus) -> None:
    a = validation_batches(corpus, seq_len=16, batch_size=2, num_batches=3)
    b = validation_batches(corpus, seq_len=16, batch_size=2, num_batches=3)
    assert len(a) == 3 and all(torch.equal(x[0], y[0]) for x, y in zip(a, b, strict=True))


def test_text_folder_and_file(tmp_path: Path) -> None:
    for i in range(5):
        (tmp_path / f"f{i}.txt").write_text(f"file {i} " * 200)
    (tmp_path / "blob.dat").write_bytes(b"\x00\x01" * 100)  # binary: skipped
    c = load_corpus(DataConfig(path=str(tmp_path)))
    assert len(c.train) > 0 and len(c.val) > 0
    assert b"\x00\x01" not in c.train.tobytes()
    single = load_corpus(DataConfig(path=str(tmp_path / "f0.txt")))
    assert len(single.train) + len(single.val) == 1400


def test_bin_token_file(tmp_path: Path) -> None:
    tokens = (np.arange(10_000) % 1000).astype(np.uint16)
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    c = load_corpus(DataConfig(path=str(path)))
    assert c.vocab_size == 1024 and isinstance(c.train, np.memmap)
    assert len(c.train) + len(c.val) == 10_000
    x, _ = TokenStream(c, seq_len=8, batch_size=2).next_batch()
    assert int(x.max()) < 1000


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "missing", "does not exist"),
        (lambda p: _mkdir(p / "empty"), "holds no files"),
        (lambda p: _write(p / "e.txt", b""), "no readable text"),
        (lambda p: _write(p / "odd.bin", b"\x01\x02\x03"), "odd number of bytes"),
        (lambda p: _write(p / "z.bin", b""), "is empty"),
    ],
)
def test_bad_data_gives_clear_error(tmp_path: Path, make: Callable[[Path], Path], message: str) -> None:
    with pytest.raises(DataError, match=message):
        load_corpus(DataConfig(path=str(make(tmp_path))))


def test_too_short_corpus_for_seq_len(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("x" * 100)
    c = load_corpus(DataConfig(path=str(tmp_path / "a.txt")))
    with pytest.raises(DataError, match="seq_len"):
        TokenStream(c, seq_len=128, batch_size=1)
