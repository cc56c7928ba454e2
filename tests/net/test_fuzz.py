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
from p2ptrain.net.claims import Entry, Evidence, payload_sha, sign_contribution
from p2ptrain.net.identity import Identity
from p2ptrain.net.state_transfer import StateServer, fetch_chunked
from p2ptrain.net.swarm import HivemindTransport, SwarmConfig
from p2ptrain.net.transport import Group, JoinRequest, PeerInfo, RoundFailed
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
@given(_msg(["name", "sha256", "offset"]))
def test_state_server_always_answers(msg: dict[str, Any]) -> None:
    srv = StateServer(chunk=16)
    srv.provider = lambda name: b"x" * 100 if name == "outer" else None
    reply = asyncio.run(srv.handle(msg))
    assert isinstance(reply, dict) and ("error" in reply or len(reply["chunk"]) <= 16)


@FUZZ
@given(st.lists(_msg(["sha256", "size", "offset", "chunk", "error"]), min_size=1, max_size=4))
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
@given(_msg(["key", "peer", "weight", "fragment", "scores", "busy", "last_sent", "step", "abstain", "sig", "sends"]))
def test_join_requests_parse_or_refuse(msg: dict[str, Any]) -> None:
    try:
        JoinRequest.from_wire(msg)
    except SCHEMA_ERRORS:
        pass


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


def _signed_part(ident: Identity, values: torch.Tensor) -> dict[str, Any]:
    codec = get_codec("fp32")
    data = codec.encode(values)
    sig, _ = sign_contribution(ident, "p2ptrain", "k", 0, 0, 1.0, values.numel(), "fp32", None, payload_sha([data]))
    return {"key": "k", "phase": 0, "part": 0, "weight": 1.0, "fp": None, "codec": "fp32", "numel": values.numel(),
            "data": data, "sig": sig, "pk": ident.public}


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
