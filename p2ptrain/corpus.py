"""A loaded corpus and the errors of data sources: what the readers of every format produce.

:mod:`p2ptrain.data` (bytes, ``.bin`` tokens, the built-in corpus) and :mod:`p2ptrain.textdata` (``.jsonl``,
``.parquet``, text through a tokenizer) both build a :class:`Corpus`; neither imports the other's module for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["FILE_SEPARATOR", "Corpus", "DataError"]

#: Between two files (or documents) of a text corpus.
FILE_SEPARATOR = b"\n\n"


class DataError(ValueError):
    """A data source cannot be used; the message says why and what to do."""


@dataclass
class Corpus:
    """Training and validation tokens, plus the training set's file boundaries.

    ``train`` and ``val`` are 1-D integer arrays (uint8 for bytes, uint16 memmaps
    for ``.bin``). ``train_bounds`` holds the start offset of each training file so
    a non-i.i.d. split can hand each peer its own files.
    """

    name: str
    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    train_bounds: np.ndarray

    def describe(self) -> str:
        return f"{self.name}: {len(self.train):,} train / {len(self.val):,} val tokens, vocab {self.vocab_size}"
