"""A mailbox after our all-reduce of it ended: the results keep their wire form only (relays still serve them)."""

from __future__ import annotations

import asyncio

import torch

from p2ptrain.collective.codecs import get_codec
from p2ptrain.net.guard import Guard
from p2ptrain.net.mailbox import Mailboxes


def test_a_closed_mailbox_drops_the_decoded_results_and_still_relays_them_exactly() -> None:
    codec = get_codec("fp32")
    boxes = Mailboxes(Guard(), max_numel=1 << 20)
    box = boxes.box("r0", 0)
    x = torch.randn(3000)
    data = codec.encode(x)
    box.results[1] = {"part": 1, "numel": 3000, "codec": "fp32", "_tensor": x.clone(),
                      "_pieces": [data[:5000], data[5000:]], "_from": "b"}  # streamed: two chunks' payloads
    box.results[2] = {"part": 2, "numel": 3000, "codec": "fp32", "data": data, "_tensor": x.clone(), "_from": "c"}
    box.make_tally = lambda *a: None
    box.close(evidence_until=0.0)
    assert all("_tensor" not in r for r in box.results.values()) and box.make_tally is None
    for part in (1, 2):
        got = asyncio.run(boxes.relay("a", {"key": "r0", "phase": 0, "part": part}))["result"]
        assert got["data"] == data and torch.equal(codec.decode(got["data"], 3000), x)
