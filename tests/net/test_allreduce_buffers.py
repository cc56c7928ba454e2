"""What an all-reduce holds while it runs, and when it lets go (bench/allreduce_memory.py measures the figures).

- fp32 decodes straight into its destination, byte for byte what ``decode`` gives, refusing what it refuses;
- a plain contribution's payloads are not kept (its values are all its owner uses);
- a streamed result decodes into its range of the run's output (a :class:`Slot`), and once the run closes the slot
  to assemble, a stream still on its way writes nothing more there (it goes on into a buffer of its own);
- a verified fp32 contribution is kept as its values (its bytes are the payload): the same hashes and slices;
- an owner lets its evidence go once every other member's verdict says it judged the part and none proved it wrong;
- and lets the results' wire chunks go after its run once every other member said it judged every part but its own;
- on real peers: every member ends with the exact mean, and nobody holds evidence or results once the verdicts are in.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from typing import Any

import pytest
import torch

from p2ptrain.collective.butterfly import chunk_bounds
from p2ptrain.collective.codecs import get_codec
from p2ptrain.net.chunks import Slot, receive_chunks
from p2ptrain.net.claims import Evidence
from p2ptrain.net.guard import Guard
from p2ptrain.net.mailbox import Mailboxes
from p2ptrain.net.pieces import contribution_shas, raw_shas

FP32 = get_codec("fp32")
CHUNK = 1 << 14  # MIN_CHUNK: the smallest streamed chunk


def _special() -> torch.Tensor:
    """Values whose bytes a careless copy would change: signed zeros, subnormals, the extremes."""
    f = torch.finfo(torch.float32)
    return torch.tensor([0.0, -0.0, f.tiny / 4, -f.tiny / 8, f.max, -f.max, f.eps, 1.0, -3.5])


def test_fp32_decodes_into_its_destination_byte_for_byte_and_refuses_what_decode_refuses() -> None:
    x = torch.cat([_special(), torch.randn(5000)])
    data = FP32.encode(x)
    assert data == x.numpy().tobytes()  # little-endian float32, one copy
    out = torch.full((x.numel(),), 7.0)
    FP32.decode_into(data, out)
    assert out.numpy().tobytes() == data and torch.equal(out, FP32.decode(data, x.numel()))
    view = torch.zeros(x.numel() + 10)[5:-5]  # a range of a larger buffer, as a slot's
    FP32.decode_into(memoryview(data), view)  # (not bytes: the generic path)
    assert view.numpy().tobytes() == data
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match="non-finite"):
            FP32.decode_into(FP32.encode(torch.tensor([1.0])) + torch.tensor([bad]).numpy().tobytes(), torch.empty(2))
    with pytest.raises(ValueError, match="must be 8 bytes"):
        FP32.decode_into(b"\0" * 12, torch.empty(2))


def _stream(payloads: list[bytes], gate: asyncio.Event | None = None, after: int = 1) -> dict[str, Any]:
    """A streamed message's header with its frames (the ``after``-th and later wait for ``gate``)."""

    async def frames() -> AsyncGenerator[bytes, None]:
        for i, p in enumerate(payloads):
            if gate is not None and i == after:
                await gate.wait()
            yield p

    return {"chunk": CHUNK, "chunks": len(payloads), "_frames": frames()}


def _payloads(x: torch.Tensor) -> list[bytes]:
    return [FP32.encode(x[a:b]) for a, b in chunk_bounds(x.numel(), CHUNK)]


def test_a_plain_contribution_keeps_its_values_and_not_its_payloads() -> None:
    x = torch.randn(3 * CHUNK + 17)
    values, pieces = asyncio.run(receive_chunks(_stream(_payloads(x)), FP32, x.numel(), keep=False))
    assert pieces == [] and torch.equal(values, x)
    values, pieces = asyncio.run(receive_chunks(_stream(_payloads(x)), FP32, x.numel()))
    assert b"".join(pieces) == FP32.encode(x) and torch.equal(values, x)


def test_a_result_decodes_into_its_slot_and_writes_nothing_there_once_the_slot_is_closed() -> None:
    x = torch.randn(4 * CHUNK)
    payloads = _payloads(x)

    async def go() -> None:
        out = torch.full((6 * CHUNK,), -1.0)
        slot = Slot(out[CHUNK : 5 * CHUNK])
        got, pieces = await receive_chunks(_stream(payloads), FP32, x.numel(), into=slot)
        assert got.data_ptr() == out[CHUNK:].data_ptr() and torch.equal(out[CHUNK : 5 * CHUNK], x)
        assert (out[:CHUNK] == -1).all() and (out[5 * CHUNK :] == -1).all() and len(pieces) == 4

        # A stream cut off by its run's assembly: the first chunk went in place, the rest may not.
        out.fill_(-1.0)
        slot, gate, first = Slot(out[CHUNK : 5 * CHUNK]), asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()

        def decoded(i: int, data: bytes, values: torch.Tensor) -> None:  # (in the decoding worker thread)
            if i == 0:
                loop.call_soon_threadsafe(first.set)

        task = asyncio.create_task(receive_chunks(_stream(payloads, gate), FP32, x.numel(), on_chunk=decoded,
                                                  into=slot))
        await asyncio.wait_for(first.wait(), 10)
        assert torch.equal(out[CHUNK : 2 * CHUNK], x[:CHUNK])
        slot.close()  # the run assembles: what is in place now is the run's
        out[CHUNK : 5 * CHUNK] = 0.0
        gate.set()
        got, _ = await asyncio.wait_for(task, 10)
        assert (out[CHUNK : 5 * CHUNK] == 0).all(), "a closed slot was written"
        assert got.data_ptr() != out.data_ptr() and torch.equal(got, x)  # the late result, whole, of its own

    asyncio.run(go())


def test_a_slot_takes_a_whole_result_of_its_own_size_only() -> None:
    x = torch.randn(2 * CHUNK)
    with pytest.raises(ValueError, match="slot"):
        asyncio.run(receive_chunks(_stream(_payloads(x)), FP32, x.numel(), into=Slot(torch.empty(CHUNK))))


def test_a_verified_fp32_contribution_kept_as_its_values_hashes_and_shows_as_its_payload() -> None:
    x = torch.cat([_special(), torch.randn(3 * CHUNK)])
    payloads = _payloads(x)
    shas = contribution_shas(payloads, x.numel(), FP32, CHUNK)
    assert raw_shas(x, CHUNK) == shas  # the fp32 codec's pieces are a raw share's
    kept = Evidence((), 2.0, x.numel(), "fp32", CHUNK, b"s" * 64, shas=shas, raw=x)
    wire = Evidence(tuple(payloads), 2.0, x.numel(), "fp32", CHUNK, b"s" * 64, shas=shas)
    assert kept.data == wire.data == FP32.encode(x) and kept.sha == wire.sha
    assert torch.equal(kept.values(), wire.values())
    for lo, hi in ((0, 5), (CHUNK - 3, CHUNK + 9000), (x.numel() - 1, x.numel())):
        assert kept.slice_wire(lo, hi) == wire.slice_wire(lo, hi)


def _box_with_evidence() -> tuple[Mailboxes, Any]:
    boxes = Mailboxes(Guard(), max_numel=1 << 20, verify=True)
    box = boxes.box("r", 0)
    box.own_part = (0, ("a", "b", "c"))
    box.evidence["b"] = Evidence((b"\0" * 8,), 1.0, 2, "fp32", None, b"s")
    return boxes, box


def _verdict(judged: list[int] | None, replaced: list[list[Any]] | None = None) -> dict[str, Any]:
    msg: dict[str, Any] = {"key": "r", "phase": 0, "replaced": replaced or []}
    if judged is not None:
        msg["judged"] = judged
    return msg


def test_an_owner_lets_its_evidence_go_once_every_other_member_judged_its_part() -> None:
    boxes, box = _box_with_evidence()
    asyncio.run(boxes.accept_verdict("b", _verdict([0, 2])))
    assert box.evidence, "c has not judged our part yet"
    asyncio.run(boxes.accept_verdict("c", _verdict([1])))
    assert box.evidence, "c's verdict does not say it judged our part (a late result: judged after it)"
    boxes, box = _box_with_evidence()
    asyncio.run(boxes.accept_verdict("b", _verdict([0, 2])))
    asyncio.run(boxes.accept_verdict("c", _verdict([0, 1])))
    assert not box.evidence


def test_an_owner_keeps_its_evidence_when_a_verdict_names_its_part_or_does_not_say_what_it_judged() -> None:
    boxes, box = _box_with_evidence()
    asyncio.run(boxes.accept_verdict("b", _verdict([0, 2], [[0, b"d" * 32, None]])))  # b proved our part wrong
    asyncio.run(boxes.accept_verdict("c", _verdict([0, 1])))
    assert box.evidence, "the others settle our part from our evidence"
    boxes, box = _box_with_evidence()
    asyncio.run(boxes.accept_verdict("b", _verdict(None)))  # a peer of before: no word of what it judged
    asyncio.run(boxes.accept_verdict("c", _verdict([0, 1])))
    assert box.evidence
    with pytest.raises(ValueError, match="judged"):
        asyncio.run(boxes.accept_verdict("c", {**_verdict(None), "judged": ["0"]}))


@pytest.mark.net
@pytest.mark.timeout(120)
def test_verified_members_end_with_the_exact_mean_and_hold_no_evidence_once_the_verdicts_are_in() -> None:
    from p2ptrain.net.swarm import HivemindTransport, SwarmConfig
    from p2ptrain.net.transport import JoinRequest

    from .peers import announce_and_wait

    async def go() -> None:
        ts: list[HivemindTransport] = []
        try:
            for _ in range(3):
                initial = await ts[0].visible_maddrs() if ts else []
                ts.append(await HivemindTransport.create(SwarmConfig(run_id="buffers", initial_peers=initial,
                                                                     join_window=3.0, ttl=30, verify=True)))
            await announce_and_wait(ts, 3)
            groups = await asyncio.gather(*(t.form_group(JoinRequest(key="m", peer_id=t.peer_id, weight=w,
                                                                     fragment=0), None, timeout=20)
                                            for t, w in zip(ts, (1.0, 2.0, 3.0), strict=True)))
            assert all(len(g.members) == 3 for g in groups)
            n = 3 * 200_003  # parts of ~200 k values: streamed in chunks
            xs = [torch.randn(n, generator=torch.Generator().manual_seed(i)) for i in range(3)]
            res = await asyncio.gather(*(t.allreduce(g, 0, [x], w, FP32, timeout=60)
                                         for t, g, x, w in zip(ts, groups, xs, (1.0, 2.0, 3.0), strict=True)))
            want = sum(w * x.double() for x, w in zip(xs, (1.0, 2.0, 3.0), strict=True)) / 6.0
            for r in res:
                assert not r.partial and not r.liars
                assert torch.allclose(r.tensors[0].double(), want, rtol=0, atol=1e-6)
            assert all(torch.equal(r.tensors[0], res[0].tensors[0]) for r in res)  # one average, bit for bit
            for _ in range(100):  # the last verdicts are deliveries: they may land just after a run returned
                if not any(t.mailboxes.boxes[("m", 0)].evidence or t.mailboxes.boxes[("m", 0)].results for t in ts):
                    break
                await asyncio.sleep(0.05)
            for t in ts:
                box = t.mailboxes.boxes[("m", 0)]
                assert not box.evidence and box.evidence_until is not None
                assert not box.results  # every member holds every part: no relay will be asked for
                assert box.evidence_until > time.monotonic() + 30  # let go long before its deadline
        finally:
            await asyncio.gather(*(t.aclose() for t in ts), return_exceptions=True)

    asyncio.run(go())


def test_results_go_after_the_run_once_every_member_said_it_holds_every_part() -> None:
    """A verified member's verdict names the parts it judged: once each other member judged every part but its own,
    nobody will ask us to relay one, and the results' wire chunks (a fragment's size, less a part) are let go; not
    before our own run has ended, nor while one member has not said so."""
    boxes, box = _box_with_evidence()
    box.results = {j: {"part": j, "data": b"\0" * 8} for j in range(3)}
    asyncio.run(boxes.accept_verdict("b", _verdict([0, 2])))
    asyncio.run(boxes.accept_verdict("c", _verdict([0, 1])))
    assert box.results, "our run has not ended: it still assembles from them"
    box.close()
    assert not box.results
    got = asyncio.run(boxes.relay("x", {"key": "r", "phase": 0, "part": 1}))
    assert got.get("expects") is False and "result" not in got

    boxes, box = _box_with_evidence()
    box.results = {j: {"part": j, "data": b"\0" * 8} for j in range(3)}
    box.close()
    asyncio.run(boxes.accept_verdict("b", _verdict([0, 2])))
    asyncio.run(boxes.accept_verdict("c", _verdict([0])))  # c has not judged part 1: it may still ask for it
    assert set(box.results) == {0, 1, 2}
