"""Every command's event loop is uvloop: the peer's network thread and the commands with a loop of their own."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import p2ptrain
from p2ptrain import aio
from p2ptrain.sync import NetLoop


async def _loop_kind() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_run_and_the_network_thread_use_uvloop() -> None:
    assert aio.run(_loop_kind()).startswith("uvloop")
    with NetLoop() as net:
        assert type(net.loop).__module__.startswith("uvloop")


def test_no_command_starts_a_plain_asyncio_loop() -> None:
    """``asyncio.run`` / ``asyncio.new_event_loop`` only in aio.py, which picks the loop for all."""
    package = Path(p2ptrain.__file__).parent
    for path in package.rglob("*.py"):
        if path.name == "aio.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "asyncio":
                assert node.attr not in ("run", "new_event_loop", "Runner"), f"{path}: asyncio.{node.attr}"
