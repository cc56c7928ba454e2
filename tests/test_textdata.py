"""Local .jsonl / .parquet / text data tokenized with a local tokenizer.json into a cache."""

from __future__ import annotations

import itertools
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from p2ptrain import textdata
from p2ptrain.data import DataConfig, DataError, TokenStream, load_corpus, validation_batches

tokenizers = pytest.importorskip("tokenizers")

WORDS = "the a peer swarm round model token data local train value shard update outer inner step".split() + [
    a + b + c + b for a, b, c in itertools.product("bdgkmpt", "aeiou", "lnrst")]


VOCAB = 400


def documents(n: int = 120, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60))) + f" doc{i}." for i in range(n)]


def make_tokenizer(path: Path, docs: list[str], vocab: int = VOCAB) -> Path:
    """A tiny BPE tokenizer.json that puts <s> before every document (as Llama's does)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>"]))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(path))
    return path


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def write_parquet(path: Path, docs: list[str], field: str = "text") -> Path:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({field: docs, "id": list(range(len(docs)))}), path, row_group_size=25)
    return path


@pytest.fixture
def setup(tmp_path: Path) -> tuple[list[str], Path, Path]:
    docs = documents()
    return docs, make_tokenizer(tmp_path / "tokenizer.json", docs), tmp_path / "cache"


def expected_tokens(tok_path: Path, docs: list[str], val_percent: float = 2.0) -> tuple[list[int], list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    train, val = [], []
    for d in docs:
        ids = tok.encode(d).ids
        (val if textdata._is_validation(d, val_percent) else train).extend(ids)
    return train, val


def test_jsonl_is_tokenized_with_the_local_tokenizer(setup: tuple[list[str], Path, Path], tmp_path: Path) -> None:
    docs, tok, cache = setup
    src = write_jsonl(tmp_path / "docs.jsonl", docs)
    corpus = load_corpus(DataConfig(path=str(src), tokenizer=str(tok), cache_dir=str(cache), val_percent=10))
    train, val = expected_tokens(tok, docs, 10)
    assert 0 < len(val) < len(train)  # the hash split held some documents out
    assert corpus.train.tolist() == train and corpus.val.tolist() == val
    assert corpus.vocab_size == VOCAB and corpus.train.dtype == np.uint16
    assert corpus.train[0] == 1  # <s> starts the first document
    assert np.all(np.diff(corpus.train_bounds) > 0) and corpus.train_bounds[0] == 0


def test_parquet_gives_the_same_tokens_as_jsonl(setup: tuple[list[str], Path, Path], tmp_path: Path) -> None:
    docs, tok, cache = setup
    a = load_corpus(DataConfig(path=str(write_jsonl(tmp_path / "d.jsonl", docs)), tokenizer=str(tok), cache_dir=str(cache)))
    b = load_corpus(DataConfig(path=str(write_parquet(tmp_path / "d.parquet", docs, "content")), tokenizer=str(tok),
                               text_field="content", cache_dir=str(cache)))
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)


def test_folder_of_shards_and_bytes_without_tokenizer(tmp_path: Path) -> None:
    docs = documents(60)
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "a.jsonl", docs[:30])
    write_jsonl(tmp_path / "data" / "b.jsonl", docs[30:])
    (tmp_path / "data" / "README.md").write_text("not a shard")
    corpus = load_corpus(DataConfig(path=str(tmp_path / "data"), cache_dir=str(tmp_path / "cache"), val_percent=10))
    assert corpus.vocab_size == 256 and corpus.train.dtype == np.uint8
    text = bytes(corpus.train).decode() + bytes(corpus.val).decode()
    assert all(d in text for d in docs) and "not a shard" not in text


def test_cache_is_reused_and_invalidated(setup: tuple[list[str], Path, Path], tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    docs, tok, cache = setup
    src = write_jsonl(tmp_path / "d.jsonl", docs)
    cfg = DataConfig(path=str(src), tokenizer=str(tok), cache_dir=str(cache))
    first = load_corpus(cfg)
    calls = []
    real_build = textdata._build
    monkeypatch.setattr(textdata, "_build", lambda *a, **k: (calls.append(1), real_build(*a, **k)))
    again = load_corpus(cfg)
    assert calls == [] and np.array_equal(first.train, again.train)  # from the cache
    write_jsonl(src, docs[:-1])  # the source changed: tokenized again
    changed = load_corpus(cfg)
    assert calls == [1] and len(changed.train) + len(changed.val) < len(first.train) + len(first.val)
    assert len([p for p in cache.iterdir() if not p.name.startswith(".")]) == 2


def test_resume_continues_the_stream_after_the_cache_is_rebuilt(setup: tuple[list[str], Path, Path],
                                                                  tmp_path: Path) -> None:
    docs, tok, cache = setup
    cfg = DataConfig(path=str(write_jsonl(tmp_path / "d.jsonl", docs)), tokenizer=str(tok), cache_dir=str(cache))
    stream = TokenStream(load_corpus(cfg), seq_len=32, batch_size=4, seed=5, rank=1, world=3)
    for _ in range(3):
        stream.next_batch()
    state = json.loads(json.dumps(stream.state_dict()))  # as a checkpoint stores it
    expected = [stream.next_batch()[0] for _ in range(2)]
    shutil.rmtree(cache)  # the tokens are made again from the sources: the same positions
    resumed = TokenStream(load_corpus(cfg), seq_len=32, batch_size=4, seed=0, rank=0, world=3)
    resumed.load_state_dict(state)
    got = [resumed.next_batch()[0] for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    assert resumed.batches_drawn == 5


def test_reading_is_streamed(tmp_path: Path) -> None:
    """Documents come one at a time: a broken line further on is only met when reached."""
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "first"}) + "\n" + "{broken\n")
    docs = textdata._documents(path, "text")
    assert next(docs)[0] == "first"
    with pytest.raises(DataError, match=r"d.jsonl:2 is not valid JSON"):
        next(docs)


def test_text_file_with_tokenizer_and_validation(setup: tuple[list[str], Path, Path], tmp_path: Path) -> None:
    docs, tok, cache = setup
    (tmp_path / "book.txt").write_text("\n".join(docs))
    corpus = load_corpus(DataConfig(path=str(tmp_path / "book.txt"), tokenizer=str(tok.parent), cache_dir=str(cache)))
    # one document: validation is the tail of its tokens
    assert len(corpus.val) > 0 and corpus.vocab_size == VOCAB
    (x, y), = validation_batches(corpus, seq_len=8, batch_size=2, num_batches=1)
    assert torch.equal(x[:, 1:], y[:, :-1]) and int(x.max()) < VOCAB


@pytest.mark.parametrize(("make", "config", "message"), [
    (lambda p, d: write_jsonl(p / "d.jsonl", d, "body"), {}, "no field 'text'"),
    (lambda p, d: write_parquet(p / "d.parquet", d, "body"), {}, "no column 'text'"),
    (lambda p, d: write_jsonl(p / "d.jsonl", d), {"tokenizer": "someorg/some-model"}, "not downloaded"),
    (lambda p, d: write_jsonl(p / "d.jsonl", d), {"tokenizer": "/nonexistent/tokenizer.json"}, "does not exist"),
    (lambda p, d: (p / "t.bin").write_bytes(b"\x01\x00" * 100) and p / "t.bin", {"tokenizer": "TOK"}, "token ids already"),
    (lambda p, d: write_jsonl(p / "d.jsonl", d), {"tokenizer": "BAD"}, "not a valid tokenizer"),
])
def test_bad_sources_give_clear_errors(setup: tuple[list[str], Path, Path], tmp_path: Path, make: object,
                                       config: dict[str, str], message: str) -> None:
    docs, tok, cache = setup
    (tmp_path / "bad.json").write_text("{}")
    config = {k: {"TOK": str(tok), "BAD": str(tmp_path / "bad.json")}.get(v, v) for k, v in config.items()}
    src = make(tmp_path, docs)  # type: ignore[operator]
    with pytest.raises(DataError, match=message):
        load_corpus(DataConfig(path=str(src), cache_dir=str(cache), **config))
