"""Mailboxes of the all-reduce: what arrives for each (round, phase), filed by the stream handlers.

A member's mailbox of one (round, phase) holds the contributions other members sent to the part it
owns (``part`` messages) and the averaged parts their owners sent back (``result`` messages, or
relayed on request: ``getpart``). Messages may arrive before this member's own all-reduce of that
phase starts; they wait here. Every message is checked before it is filed: sizes against the codec
and the announced limits before anything is decoded, the weight, and a streamed payload against its
header; a message that does not fit is refused with a strike against its sender.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..collective.codecs import get_codec
from .chunks import Refused, receive_chunks
from .guard import Guard
from .parts import wire_result

__all__ = ["Contribution", "Mailbox", "Mailboxes"]

#: A member's contribution to a part: (part index, values, weight, its fingerprint of θ or None).
Contribution = tuple[int, torch.Tensor, float, list[float] | None]


@dataclass
class Mailbox:
    """Frames that arrived for one (round, phase): contributions to our part, and results of parts."""

    contribs: dict[str, Contribution] = field(default_factory=dict)
    unreachable: set[str] = field(default_factory=set)  # members our sends could not reach
    results: dict[int, dict[str, Any]] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    created: float = field(default_factory=time.monotonic)
    finished: float | None = None  # when our all-reduce of this (round, phase) returned or failed

    def poke(self) -> None:
        self.changed.set()

    async def wait(self, deadline: float) -> None:
        """Wait until something arrives or ``deadline`` (monotonic) passes, whichever comes first."""
        self.changed.clear()
        left = deadline - time.monotonic()
        if left > 0:
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except TimeoutError:
                pass

    def close(self) -> None:
        """Our all-reduce of this phase ended: the contributions are spent. The parts' results stay, so that
        a member that missed one can still fetch it from us (a relay), until the mailbox is collected."""
        self.finished = time.monotonic()
        self.contribs.clear()


class Mailboxes:
    """Every (round, phase)'s mailbox at one peer, the handlers that fill them, and their collection.

    ``max_numel`` bounds the values a message may announce (checked before anything is allocated).
    The handlers answer ``{"ok": True}``, ``{"error": ...}`` or, for ``getpart``, ``{"result": ...}``; a
    message that does not fit its schema raises one of wire.SCHEMA_ERRORS (the stream layer strikes).
    """

    def __init__(self, guard: Guard, max_numel: int) -> None:
        self.guard, self.max_numel = guard, max_numel
        self.boxes: dict[tuple[str, int], Mailbox] = {}

    def box(self, key: str, phase: int) -> Mailbox:
        return self.boxes.setdefault((key, phase), Mailbox())

    def collect(self, max_age: float = 600.0, after_finish: float = 60.0) -> None:
        """Forget a mailbox ``after_finish`` seconds after our all-reduce of it ended (until then our
        averaged part can still be fetched by a member that missed it), any other after ``max_age`` (a
        round that never ran here, late frames)."""
        now = time.monotonic()
        for k in [k for k, m in self.boxes.items()
                  if now - m.created > max_age or (m.finished is not None and now - m.finished > after_finish)]:
            del self.boxes[k]

    def unreachable(self, key: str, phase: int) -> set[str]:
        """Members our sends of this (round, phase) could not reach."""
        box = self.boxes.get((key, phase))
        return set(box.unreachable) if box else set()

    async def accept_part(self, sender: str, msg: dict[str, Any]) -> dict[str, Any]:
        """File ``sender``'s contribution to a part we own, decoded (chunk by chunk if streamed)."""
        codec = get_codec(str(msg["codec"]))
        numel = int(msg["numel"])
        if numel < 0 or numel > self.max_numel:
            return {"error": "bad size"}
        streamed = "chunks" in msg
        data = None if streamed else msg["data"]
        if not streamed and (not isinstance(data, bytes) or len(data) != codec.encoded_size(numel)):
            self.guard.strike(sender, f"part payload of {len(data) if isinstance(data, bytes) else '?'} bytes "
                                      f"for {numel} values")
            return {"error": "payload size does not match"}
        if (reason := self.guard.bad_weight(msg["weight"])) is not None:
            self.guard.strike(sender, reason)
            return {"error": reason}
        if streamed:
            try:
                x, _ = await receive_chunks(msg, codec, numel)
            except Refused as e:
                self.guard.strike(sender, f"streamed part: {e}")
                return {"error": "streamed part does not match its header"}
        else:
            assert isinstance(data, bytes)
            try:
                x = await asyncio.to_thread(codec.decode, data, numel)
            except ValueError as e:
                self.guard.strike(sender, f"undecodable part ({e})")
                return {"error": "undecodable part"}
        fp = msg.get("fp")
        box = self.box(str(msg["key"]), int(msg["phase"]))
        box.contribs[sender] = (int(msg["part"]), x, float(msg["weight"]), None if fp is None else [float(v) for v in fp])
        box.poke()
        return {"ok": True}

    async def accept_result(self, sender: str, msg: dict[str, Any]) -> dict[str, Any]:
        """File a part's averaged result as its owner sent it (the first one for a part stays). A streamed
        one is decoded as it arrives; its metadata is checked when the all-reduce assembles it."""
        box = self.box(str(msg["key"]), int(msg["phase"]))
        part = int(msg["part"])
        res = {k: v for k, v in msg.items() if not (isinstance(k, str) and k.startswith("_"))}
        if "chunks" in msg:
            numel = msg["numel"]
            if not isinstance(numel, int) or not 0 <= numel <= self.max_numel:
                return {"error": "bad size"}
            try:
                x, pieces = await receive_chunks(msg, get_codec(str(msg["codec"])), numel)
            except Refused as e:
                self.guard.strike(sender, f"streamed result: {e}")
                return {"error": "streamed result does not match its header"}
            res |= {"_tensor": x, "_pieces": pieces}
        box.results.setdefault(part, {**res, "_from": sender})
        box.poke()
        return {"ok": True}

    async def relay(self, sender: str, msg: dict[str, Any]) -> dict[str, Any]:
        """A part's result we hold, for a member that missed it (as one message)."""
        box = self.boxes.get((str(msg["key"]), int(msg["phase"])))
        res = None if box is None else box.results.get(int(msg["part"]))
        return {"result": wire_result(res)} if res is not None else {"error": "no such part here"}
