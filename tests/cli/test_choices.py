"""The CLI's own spelling of each choice (``cli/choices.py``, torch-free for a fast ``--help``) is the registry's."""

from __future__ import annotations

import logging
import typing

from p2ptrain.algo.configs import METHODS
from p2ptrain.cli import choices
from p2ptrain.collective.aggregate import AGGREGATIONS
from p2ptrain.collective.codecs import CODECS
from p2ptrain.hf import DTYPES
from p2ptrain.model import PRESETS
from p2ptrain.pipeline import PipelineConfig


def test_choices_are_the_registries() -> None:
    assert choices.PRESETS == tuple(PRESETS)
    assert choices.METHODS == tuple(METHODS)
    assert set(choices.CODECS) == set(CODECS)
    assert choices.AGGREGATIONS == tuple(AGGREGATIONS)
    assert choices.DTYPES == tuple(DTYPES)
    assert choices.SCHEDULES == typing.get_args(typing.get_type_hints(PipelineConfig)["schedule"])
    assert all(isinstance(logging.getLevelName(name.upper()), int) for name in choices.LOG_LEVELS)
