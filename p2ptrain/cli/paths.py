"""Files and folders named by flags, checked before anything starts: a run must not train for an hour and
then fail to write its summary, or fail half-way through its banner on a data path with a typo."""

from __future__ import annotations

import os
from pathlib import Path

from ..settings import ConfigError

__all__ = ["STDOUT", "input_path", "output_dir", "output_file", "write_json"]

#: ``--json -`` writes to standard output.
STDOUT = Path("-")


def input_path(flag: str, path: str | Path | None) -> None:
    """ConfigError naming ``flag`` when ``path`` (a file or folder to read) does not exist."""
    if path is not None and not Path(path).exists():
        raise ConfigError(f"{flag} {path} does not exist")


def output_file(flag: str, path: Path | None) -> None:
    """ConfigError naming ``flag`` when file ``path`` cannot be written: its folder does not exist, or it is a
    folder itself. ``-`` (standard output) and None pass."""
    if path is None or path == STDOUT:
        return
    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a folder; give a file name")
    if not path.parent.is_dir():
        raise ConfigError(f"{flag} {path}: the folder {path.parent} does not exist")


def output_dir(flag: str, path: str | Path | None) -> None:
    """ConfigError naming ``flag`` when folder ``path`` cannot be written to or made (a file is in the way, or
    the nearest folder that exists is not writable). Nothing is made here: the run makes it when it writes."""
    if path is None:
        return
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{flag} {p} is a file, not a folder")
    nearest = p if p.exists() else next(a for a in p.parents if a.exists())  # "." or "/" at worst
    if not nearest.is_dir():
        raise ConfigError(f"{flag} {p}: {nearest} is a file, not a folder")
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {p}: {nearest} is not writable")


def write_json(path: Path, text: str) -> None:
    """Write ``text`` (JSON) to file ``path``, or to standard output for ``-``."""
    if path == STDOUT:
        print(text, flush=True)
    else:
        path.write_text(text)
