"""Config files: TOML sections mapped onto the components' config dataclasses.

A file looks like ``peers/tiny.toml``::

    preset = "tiny"          # top-level keys belong to the job (see the command)
    steps = 300
    [model]                  # ModelConfig overrides of the preset
    n_layers = 4
    [trainer]                # TrainerConfig
    lr = 2e-3
    [data]                   # DataConfig
    path = "corpus/"

Command-line flags override the file; unknown keys are errors that name the key.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["ConfigError", "build", "load_file", "merged"]

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or flag combination is invalid; the message says which key."""


def load_file(path: str | Path | None) -> dict[str, Any]:
    """Parse a TOML config file (``{}`` when ``path`` is None)."""
    if path is None:
        return {}
    p = Path(path)
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {p} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {p} is not valid TOML: {e}") from None


def merged(file_section: dict[str, Any] | None, flags: dict[str, Any]) -> dict[str, Any]:
    """``file_section`` with every flag that was given (not None) on top."""
    out = dict(file_section or {})
    out.update({k: v for k, v in flags.items() if v is not None})
    return out


def build(cls: type[T], values: dict[str, Any], where: str) -> T:
    """Instantiate dataclass ``cls`` from ``values``; unknown keys and invalid values raise ConfigError."""
    fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ConfigError(f"[{where}]: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(fields))}")
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"[{where}]: {e}") from None
