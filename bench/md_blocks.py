"""Sections of a Markdown report that another benchmark owns.

``bench/results/methods.md`` is written by ``bench/methods.py``, but the long runs and the compensation
instrument put their own sections in it. Each such section sits between two HTML comments naming its owner,
so the owner can replace it and ``methods.py`` can keep it when it rewrites the rest.
"""

from __future__ import annotations

import re
from pathlib import Path

_BLOCK = re.compile(r"<!-- block:(?P<name>[\w.-]+) -->\n.*?<!-- /block:(?P=name) -->\n", re.S)


def _wrap(name: str, text: str) -> str:
    return f"<!-- block:{name} -->\n{text.rstrip()}\n<!-- /block:{name} -->\n"


def blocks(path: Path) -> dict[str, str]:
    """Every owned section of ``path`` (name → the whole block, markers included); none if it does not exist."""
    if not path.exists():
        return {}
    return {m["name"]: m.group(0) for m in _BLOCK.finditer(path.read_text())}


def put_block(path: Path, name: str, text: str) -> None:
    """Replace the section ``name`` of ``path`` with ``text`` (appended at the end the first time)."""
    doc = path.read_text() if path.exists() else ""
    block = _wrap(name, text)
    pattern = re.compile(rf"<!-- block:{re.escape(name)} -->\n.*?<!-- /block:{re.escape(name)} -->\n", re.S)
    if pattern.search(doc):
        doc = pattern.sub(lambda _: block, doc, count=1)
    else:
        doc = doc.rstrip("\n") + ("\n\n" if doc else "") + block
    path.write_text(doc)
