"""A member's claims arrive in two messages: its own part's first (once that part's result is made), the rest last."""

from __future__ import annotations

import asyncio

import pytest
import torch

from p2ptrain.collective.sketch import BUCKETS
from p2ptrain.net.claims import Entry
from p2ptrain.net.guard import Guard
from p2ptrain.net.mailbox import Mailboxes


def _entry(part: int, tag: int) -> Entry:
    return Entry(part, bytes([tag]) * 32, 1.0, 0.5, bytes([tag + 1]) * 32, torch.full((BUCKETS,), float(tag),
                                                                                         dtype=torch.float64))


def _msg(entries: list[Entry], final: bool | None) -> dict:
    msg = {"key": "r0", "phase": 0, "members": 3, "entries": [e.to_wire() for e in entries]}
    if final is not None:
        msg["final"] = final
    return msg


def test_claims_merge_by_part_the_first_stays_and_the_last_message_marks_the_sender_done() -> None:
    boxes = Mailboxes(Guard(), 1 << 20, verify=True)

    async def go() -> None:
        assert await boxes.accept_check("b", _msg([_entry(1, 10)], final=False)) == {"ok": True}
        box = boxes.box("r0", 0)
        assert set(box.checks["b"]) == {1} and "b" not in box.final_checks
        # the last message claims every part again: a part already claimed keeps its first claim
        assert await boxes.accept_check("b", _msg([_entry(0, 20), _entry(1, 30), _entry(2, 40)], final=True))
        assert set(box.checks["b"]) == {0, 1, 2} and "b" in box.final_checks
        assert box.checks["b"][1].commit == bytes([10]) * 32 and box.checks["b"][0].commit == bytes([20]) * 32
        # a sender that speaks the one-message protocol (no ``final``) is done with its first message
        assert await boxes.accept_check("c", _msg([_entry(2, 50)], final=None))
        assert "c" in box.final_checks and box.checks["c"][2].commit == bytes([50]) * 32

    asyncio.run(go())


def test_a_final_that_is_not_a_bool_is_refused() -> None:
    boxes = Mailboxes(Guard(), 1 << 20, verify=True)
    with pytest.raises(TypeError):
        asyncio.run(boxes.accept_check("b", {**_msg([_entry(1, 10)], final=None), "final": 1}))
    assert "b" not in boxes.box("r0", 0).final_checks
