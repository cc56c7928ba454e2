from __future__ import annotations

import pytest
import torch

from p2ptrain.data import Corpus, DataConfig, load_corpus


@pytest.fixture(scope="session")
def corpus() -> Corpus:
    """The built-in corpus, loaded once per test session."""
    return load_corpus(DataConfig())


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)
