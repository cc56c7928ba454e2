"""Every handler that parses bytes or messages from the network, fed thousands of generated inputs:
it answers, or refuses with the errors its caller turns into a refusal of the sender; it never
crashes otherwise, never hangs, and never allocates more than the announced limits allow."""

from __future__ import annotations

import asyncio
import types
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2ptrain.checkpoint import CheckpointError, state_from_bytes
from p2ptrain.collective.codecs import CODECS, get_codec
from p2ptrain.net.claims import Entry, Evidence, sign_contribution
from p2ptrain.net.identity import Identity
from p2ptrain.net.pieces import payload_sha
from p2ptrain.net.state_transfer import StateServer, fetch_chunked
from p2ptrain.net.swarm import HivemindTransport, SwarmConfig
from p2ptrain.net.transport import MAX_SKIPPED, Group, JoinRequest, PeerInfo, RoundFailed
from p2ptrain.net.wire import SCHEMA_ERRORS, FrameError, decode_message, encode_message, read_frame

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20) | st.binary(max_size=64))
values = st.recursive(scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                      max_leaves=12)


def _msg(keys: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """Messages with (some of) the right keys and values of any type, plus stray keys."""
    return st.builds(lambda a, b: {**a, **b},
                     st.fixed_dictionaries({}, optional={k: values for k in keys}),
                     st.dictionaries(st.text(max_size=8), values, max_size=3))


def _transport() -> HivemindTransport:
    return HivemindTransport(SwarmConfig(max_message=1 << 20), types.SimpleNamespace(peer_id="me"), None)


def _handled(coro: Any) -> Any:
    async def go() -> Any:
        return await asyncio.wait_for(coro, 2.0)

    try:
        return asyncio.run(go())
    except SCHEMA_ERRORS:
        return None


@FUZZ
@given(st.binary(max_size=256))
def test_decode_message_only_ever_raises_frame_errors(data: bytes) -> None:
    try:
        assert isinstance(decode_message(data, max_size=128), dict)
    except FrameError:
        pass


@FUZZ
@given(st.binary(max_size=64), st.integers(min_value=0, max_value=2**32 - 1))
def test_read_frame_is_bounded_in_size_and_time(body: bytes, announced: int) -> None:
    async def go() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(announced.to_bytes(4, "big") + body)
        reader.feed_eof()
        try:
            msg, n = await read_frame(reader, timeout=1.0, max_size=1024)
            assert isinstance(msg, dict) and n <= 1024 + 4
        except FrameError:
            pass

    asyncio.run(go())


@FUZZ
@given(_msg(["key", "phase", "part", "weight", "fp", "codec", "numel", "data"]))
def test_part_handler(msg: dict[str, Any]) -> None:
    t = _transport()
    reply = _handled(t._on_part("peer", msg))
    assert reply is None or isinstance(reply, dict)


@FUZZ
@given(_msg(["key", "phase", "part", "contributors", "total", "agree", "numel", "codec", "data"]))
def test_result_and_getpart_handlers(msg: dict[str, Any]) -> None:
    t = _transport()
    for handler in (t._on_result, t._on_getpart):
        reply = _handled(handler("peer", msg))
        assert reply is None or isinstance(reply, dict)


@FUZZ
@given(_msg(["name", "digest", "offset"]))
def test_state_server_always_answers(msg: dict[str, Any]) -> None:
    srv = StateServer(chunk=16)
    srv.provider = lambda name: b"x" * 100 if name == "outer" else None
    reply = asyncio.run(srv.handle(msg))
    assert isinstance(reply, dict) and ("error" in reply or len(reply["chunk"]) <= 16)


@FUZZ
@given(st.lists(_msg(["digest", "size", "offset", "chunk", "error"]), min_size=1, max_size=4))
def test_state_download_refuses_whatever_a_source_sends(replies: list[dict[str, Any]]) -> None:
    it = iter(replies)

    async def call(_: dict[str, Any]) -> dict[str, Any]:
        try:
            return next(it)
        except StopIteration:
            return {"error": "no more"}

    try:
        out = asyncio.run(fetch_chunked(call, "outer", max_bytes=4096))
        assert len(out) <= 4096
    except RoundFailed:
        pass


@FUZZ
@given(_msg(["key", "peer", "weight", "fragment", "scores", "busy", "last_sent", "step", "abstain", "sig", "sends",
             "region", "skipped"]))
def test_join_requests_parse_or_refuse(msg: dict[str, Any]) -> None:
    try:
        req = JoinRequest.from_wire(msg)
    except SCHEMA_ERRORS:
        return
    assert len(req.skipped) <= MAX_SKIPPED and all(isinstance(p, str) for p in req.skipped)


@FUZZ
@given(_msg(["key", "members", "leader", "fragment", "sig", "schedule"])
       | st.fixed_dictionaries({"key": st.text(max_size=8), "members": st.lists(st.text(max_size=4), max_size=3),
                                "leader": st.text(max_size=4)},
                               optional={"schedule": st.lists(values, max_size=3)}))
def test_groups_parse_or_refuse(msg: dict[str, Any]) -> None:
    """What a round's leader replies to a join: a Group whose schedule is two sane integers, or a refusal."""
    try:
        g = Group.from_wire(msg)
    except SCHEMA_ERRORS:
        return
    assert g.schedule is None or (g.schedule[0] >= 1 and g.schedule[1] >= 0)


@FUZZ
@given(_msg(["peer", "region", "step", "lstep", "tps", "bw", "loss", "maddrs", "method", "extra"]))
def test_announcements_parse_or_refuse(msg: dict[str, Any]) -> None:
    try:
        PeerInfo.from_wire(msg)
    except SCHEMA_ERRORS:
        pass


@FUZZ
@given(st.sampled_from(sorted(CODECS)), st.binary(max_size=128), st.integers(min_value=0, max_value=64))
def test_codecs_decode_or_refuse(name: str, data: bytes, numel: int) -> None:
    codec = get_codec(name)
    if name == "lowrank":
        pytest.skip("low-rank payloads are decoded by their compressor, not by a codec")
    try:
        out = codec.decode(data, numel)
        assert isinstance(out, torch.Tensor) and out.numel() == numel
    except ValueError:
        pass


@FUZZ
@given(st.binary(max_size=512))
def test_state_bytes_parse_or_refuse(data: bytes) -> None:
    try:
        state_from_bytes(data, "fuzz")
    except CheckpointError:
        pass


@FUZZ
@given(_msg(["key", "phase", "members", "entries", "replaced", "who", "part"])
       | st.fixed_dictionaries({"key": st.text(max_size=4), "phase": st.integers(0, 2), "members": st.integers(-2, 9),
                                "entries": st.lists(_msg(["part", "commit", "w", "inf", "d", "s", "c"]), max_size=3)}))
def test_check_and_evidence_handlers(msg: dict[str, Any]) -> None:
    """Verified aggregation's claims (net/verify.py): parsed or refused, never a crash."""
    t = _transport()
    for handler in (t.mailboxes.accept_check, t.mailboxes.show_evidence, t.mailboxes.accept_verdict):
        reply = _handled(handler("peer", msg))
        assert reply is None or isinstance(reply, dict)


@FUZZ
@given(_msg(["data", "w", "numel", "codec", "chunk", "sig", "pk"]))
def test_evidence_parses_or_refuses_and_never_decodes_past_its_size(msg: dict[str, Any]) -> None:
    try:
        ev = Evidence.from_wire(msg)
    except SCHEMA_ERRORS:
        return
    try:
        assert ev.values().numel() == ev.numel
    except (ValueError, KeyError):  # a payload that does not fit its size or codec, or no such codec
        pass


def _signed_part(ident: Identity, values: torch.Tensor, codec: str = "fp32", data: bytes | None = None
                 ) -> dict[str, Any]:
    data = get_codec(codec).encode(values) if data is None else data
    sig, _ = sign_contribution(ident, "p2ptrain", "k", 0, 0, 1.0, values.numel(), codec, None,
                             payload_sha([data], values.numel(), codec, None))
    return {"key": "k", "phase": 0, "part": 0, "weight": 1.0, "fp": None, "codec": codec, "numel": values.numel(),
            "data": data, "sig": sig, "pk": ident.public}


def _sparse_limits(codec: Any, n: int) -> tuple[int, int]:
    """(blocks, most nonzero values) of a top-k payload of ``n`` values (topk2g4: groups of 4 share a slot)."""
    from p2ptrain.collective.grouped import TopK2GroupCodec

    if isinstance(codec, TopK2GroupCodec):
        _, blocks, slots, _ = codec._layout(n)
        return blocks, codec.GROUP * slots
    return -(-n // codec.BLOCK), codec._slot_counts(n)[1]


@FUZZ
@given(st.sampled_from(["topk2", "topk2:0.03", "topk2g4:0.03"]), st.integers(1, 5000), st.integers(0, 2**31 - 1),
       st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=6))
def test_sparse_payloads_with_mutated_index_sets_decode_or_refuse(name: str, n: int, seed: int,
                                                                   edits: list[tuple[int, int]]) -> None:
    """A real top-k payload with bytes of its index set (after the block headers) overwritten: it decodes to
    at most the slots' worth of nonzeros, each inside its block, or it is refused."""
    codec = get_codec(name)
    data = bytearray(codec.encode(torch.randn(n, generator=torch.Generator().manual_seed(seed))))
    blocks, most = _sparse_limits(codec, n)
    for where, byte in edits:
        data[4 * blocks + where % max(1, len(data) - 4 * blocks)] = byte
    try:
        out = codec.decode(bytes(data), n)
    except ValueError:
        return
    assert out.numel() == n and int((out != 0).sum()) <= most


def _topk2_payload(indices: list[int], codes: int = 10) -> bytes:
    """A one-block topk2 payload for 13 values (lo 1, hi 2) with the given index set."""
    from p2ptrain.collective.lowbit import pack_bits

    from ..collective.test_lowbit import elias_fano

    header = torch.tensor([1.0, 2.0], dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()
    return (header + elias_fano([(13, indices)], 6)
            + pack_bits(torch.zeros(codes, dtype=torch.int64), 2).numpy().tobytes())


@pytest.mark.parametrize("indices", [
    [0, 3, 5, 6, 7, 8, 9, 10, 11, 13],  # out of range: 13 is past a 13-value block
    [0, 3, 3, 6, 7, 8, 9, 10, 11, 12],  # duplicated
    [0, 5, 3, 6, 7, 8, 9, 10, 11, 12],  # unsorted
    [0, 1, 3, 5, 6, 7, 8, 9, 10, 11, 12],  # oversized: one slot more than the block has
])
def test_a_part_with_a_hostile_index_set_is_refused(indices: list[int]) -> None:
    """A signed sparse part whose index set is out of range, duplicated, unsorted or oversized is refused
    like any bad payload (and its sender gets a strike); the same part with a valid set is accepted."""
    t = _transport()
    ident = Identity.generate()
    values = torch.zeros(13)
    bad = _signed_part(ident, values, "topk2", _topk2_payload(indices, codes=len(indices)))
    assert "error" in asyncio.run(t._on_part(ident.peer_id, decode_message(encode_message(bad))))
    assert t.guard.strikes[ident.peer_id] == 1
    good = _signed_part(ident, values, "topk2", _topk2_payload([0, 3, 5, 6, 7, 8, 9, 10, 11, 12]))
    assert asyncio.run(t._on_part(ident.peer_id, decode_message(encode_message(good)))) == {"ok": True}


def test_a_well_formed_part_is_accepted() -> None:
    """The fuzzed handlers do accept the real thing (the tests above are not vacuous): a part signed by its
    sender, kept as evidence; the same part under another sender's name, or with another payload, is not."""
    t = _transport()
    ident, other = Identity.generate(), Identity.generate()
    msg = _signed_part(ident, torch.ones(4))
    assert asyncio.run(t._on_part(ident.peer_id, decode_message(encode_message(msg)))) == {"ok": True}
    assert t._mail[("k", 0)].contribs[ident.peer_id][1].equal(torch.ones(4))
    assert t._mail[("k", 0)].evidence[ident.peer_id].values().equal(torch.ones(4))
    assert "error" in asyncio.run(t._on_part(other.peer_id, msg))
    forged = {**msg, "data": get_codec("fp32").encode(torch.zeros(4))}
    assert "error" in asyncio.run(t._on_part(ident.peer_id, forged))
    assert t.guard.strikes[other.peer_id] == 1 and t.guard.strikes[ident.peer_id] == 1
    shown = asyncio.run(t.mailboxes.show_evidence("x", {"key": "k", "phase": 0, "who": ident.peer_id}))
    assert Evidence.from_wire(shown["evidence"]).signed_by(ident.peer_id, "p2ptrain", "k", 0, 0)
    entry = Entry(0, b"h" * 32, 1.0, 1.0, b"d" * 32, torch.arange(32, dtype=torch.float64), None)
    check = {"key": "k", "phase": 0, "members": 2, "entries": [entry.to_wire()]}
    assert asyncio.run(t.mailboxes.accept_check(ident.peer_id, decode_message(encode_message(check)))) == {"ok": True}
    got = t._mail[("k", 0)].checks[ident.peer_id][0]
    assert got.s is not None and got.s.equal(entry.s) and got.commit == entry.commit


@FUZZ
@given(values)
def test_a_result_with_a_hostile_print_is_refused_and_never_raises(value: Any) -> None:
    """An averaged part's ``print`` (the majority's fingerprint, which a divergent member's repair will trust)
    must be a short list of finite numbers; anything else makes the result malformed (its owner's strike)."""
    from p2ptrain.net.parts import MAX_PRINT, Assembly, result_problem

    codec = get_codec("fp32")
    res = {"key": "k", "phase": 0, "part": 0, "numel": 4, "codec": "fp32", "data": codec.encode(torch.ones(4)),
           "contributors": ["a", "b"], "agree": ["a", "b"], "total": 2.0, "_from": "a", "print": value}
    problem = result_problem(res, 0, 4, codec, ["a", "b"], "b")
    fine = value is None or (isinstance(value, list) and len(value) <= MAX_PRINT and all(
        isinstance(v, int | float) and not isinstance(v, bool) and abs(v) != float("inf") and v == v for v in value))
    assert (problem is None) == fine, (problem, value)
    if problem is not None:
        assert problem[1]  # the owner's fault
    else:
        out = Assembly(8, ["a", "b"], 1, check_agree=True)
        out.add(0, 0, 4, torch.ones(4), res)
        assert out.prints == ({} if value is None else {tuple(float(v) for v in value): 1})


def test_the_print_a_result_carries_is_the_majoritys() -> None:
    """A member assembles the majority's fingerprint from its parts' results (the most common, ties to the
    smallest), which its round keeps for a repair."""
    from p2ptrain.net.parts import Assembly

    out = Assembly(9, ["a", "b", "c"], 2, check_agree=True)
    group = Group("k", ("a", "b", "c"), "a", 0, "")
    for part, fp in enumerate(([1.0, 2.0], [1.0, 2.0], [3.0, 4.0])):
        out.add(part, 3 * part, 3 * part + 3, torch.ones(3), {"contributors": ["a", "b", "c"], "agree": ["a", "b"],
                                                               "total": 3.0, "print": fp})
    res = out.result(group, 0, [torch.zeros(9)], sent=0, seconds=0.0)
    assert res.agreed == (1.0, 2.0) and res.divergent  # c was not among those who agreed
