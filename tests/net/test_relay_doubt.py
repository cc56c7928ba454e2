"""A part's result that reached one member late and another never (churn benchmark: a shard's carriers ended with
different bytes in 23 peer-rounds of churn_mmap128k, "the region's carrier and another region's disagree", and where
no witness answered, members applied two θ). The member that gave up on the part used to leave it zero while the
other, whose deadlines were later, averaged it in. A member now leaves a part out only when no other member may
still end with it; otherwise it fails its round."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import torch

from p2ptrain.collective.codecs import get_codec
from p2ptrain.faults import FaultPlan
from p2ptrain.net.allreduce import ButterflyRun
from p2ptrain.net.transport import JoinRequest, ReduceResult, RoundFailed

from .test_pipelined import _swarm

pytestmark = [pytest.mark.net, pytest.mark.timeout(120)]


#: Breaks what a test breaks, given the members a, b, c (the group's order) and the transports by peer id.
Setup = Callable[[str, str, str, dict[str, Any]], None]


def _round_of_three(key: str, timeouts: tuple[float, float, float], setup: Setup) -> list[ReduceResult | BaseException]:
    """One round of three real peers, a, b and c each with its own timeout; the outcomes in that order."""
    async def go() -> list[ReduceResult | BaseException]:
        ts = await _swarm(3, [FaultPlan() for _ in range(3)], pipeline=False)
        try:
            groups = await asyncio.gather(*(t.form_group(JoinRequest(key=key, peer_id=t.peer_id, weight=1.0,
                                                                     fragment=0), None, timeout=30) for t in ts))
            members = list(groups[0].members)
            by_id = {t.peer_id: t for t in ts}
            setup(*members, by_id)
            xs = {p: torch.full((300,), float(i + 1)) for i, p in enumerate(members)}
            return list(await asyncio.gather(*(
                by_id[p].allreduce(groups[0], 0, [xs[p]], 1.0, get_codec("fp32"), timeout=t)
                for p, t in zip(members, timeouts, strict=True)), return_exceptions=True))
        finally:
            await asyncio.gather(*(t.aclose() for t in ts), return_exceptions=True)

    return asyncio.run(go())


def test_a_part_one_member_gets_late_is_not_left_zero_by_another(monkeypatch: pytest.MonkeyPatch) -> None:
    """b and c cannot reach each other; c's result reaches a only after b's round (3 s, a's and c's 12 s) is over.
    b asked a for it until then, and a still expected it: b must not end with c's part zero while a ends with it."""
    def setup(a: str, b: str, c: str, by_id: dict[str, Any]) -> None:
        by_id[b].blocked.add(c)
        by_id[c].blocked.add(b)
        send_result = ButterflyRun._send_result

        async def late_to_a(self: ButterflyRun, j: int) -> int:
            if self.me_id == c and self.members[j] == a:
                await asyncio.sleep(4.0)
            return await send_result(self, j)

        monkeypatch.setattr(ButterflyRun, "_send_result", late_to_a)

    out = _round_of_three("d", (12.0, 3.0, 12.0), setup)
    done = [r for r in out if isinstance(r, ReduceResult)]
    assert not any(isinstance(r, BaseException) and not isinstance(r, RoundFailed) for r in out), out
    assert isinstance(out[0], ReduceResult), out[0]  # a: every part, c's late
    assert isinstance(out[1], RoundFailed) and "another member may use it" in str(out[1]), out[1]  # b: not zero
    assert all(torch.equal(r.tensors[0], done[0].tensors[0]) for r in done)  # whoever applies, applies one average


def test_an_owner_that_averages_after_its_results_deadline_keeps_its_part_from_everyone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """c stalls in its gather until its round (3 s) is over (a peer frozen mid-round wakes with every deadline
    passed). So is b's, which left c's part out; a's (12 s) would still take it, and used to. c must not publish
    it: a and b end with the same bytes."""
    def setup(a: str, b: str, c: str, by_id: dict[str, Any]) -> None:
        gather = ButterflyRun._gather

        async def stalled(self: ButterflyRun) -> None:
            await gather(self)
            if self.me_id == c:
                await asyncio.sleep(max(0.0, self._left(1.0)) + 0.5)  # past b's whole round

        monkeypatch.setattr(ButterflyRun, "_gather", stalled)

    out = _round_of_three("w", (12.0, 3.0, 3.0), setup)
    assert not any(isinstance(r, BaseException) and not isinstance(r, RoundFailed) for r in out), out
    done = [r for r in out[:2] if isinstance(r, ReduceResult)]
    assert len(done) == 2, out  # a and b both end the round
    assert torch.equal(done[0].tensors[0], done[1].tensors[0])  # without c's part, both
    assert bool((done[0].tensors[0][200:] == 0).all())  # c's part (the last third) left out


def test_members_do_not_wait_on_a_frozen_owner_once_no_other_member_expects_its_part() -> None:
    """c freezes as the round starts (SIGSTOP, or a cut that drops packets): every call to it hangs until its timeout.
    a and b find it unreachable when their parts to it time out; then neither expects c's part, and each must learn
    that from the other, not by asking c for its result first: that call hung to the relay deadline (a churn run's
    members ended such rounds at their deadline, with the partial result they could have had at half of it). Both
    end with c's part left out alike, and neither asks c for it (they still send it what members send)."""
    asked: list[tuple[str, str]] = []

    async def go() -> list[ReduceResult | BaseException]:
        ts = await _swarm(3, [FaultPlan() for _ in range(3)], pipeline=False)
        try:
            groups = await asyncio.gather(*(t.form_group(JoinRequest(key="z", peer_id=t.peer_id, weight=1.0,
                                                                     fragment=0), None, timeout=30) for t in ts))
            a, b, c = groups[0].members
            by_id = {t.peer_id: t for t in ts}
            for me in (a, b):
                call = by_id[me]._call

                async def frozen_c(peer: str, kind: str, msg: dict[str, Any], *, timeout: float, me: str = me,
                                   call: Any = call, **kw: Any) -> Any:
                    if peer != c:
                        return await call(peer, kind, msg, timeout=timeout, **kw)
                    asked.append((me, kind))
                    await asyncio.sleep(timeout)
                    raise RoundFailed(f"{kind} to {peer[-8:]}: TimeoutError")

                by_id[me]._call = frozen_c
            xs = {a: torch.full((300,), 1.0), b: torch.full((300,), 2.0)}
            return list(await asyncio.gather(*(by_id[p].allreduce(groups[0], 0, [xs[p]], 1.0, get_codec("fp32"),
                                                                  timeout=8.0) for p in (a, b)),
                                             return_exceptions=True))
        finally:
            await asyncio.gather(*(t.aclose() for t in ts), return_exceptions=True)

    out = asyncio.run(go())
    assert all(isinstance(r, ReduceResult) for r in out), out
    ra, rb = out
    assert isinstance(ra, ReduceResult) and isinstance(rb, ReduceResult)
    assert torch.equal(ra.tensors[0], rb.tensors[0])  # one average for both
    assert bool((ra.tensors[0][200:] == 0).all()) and bool((ra.tensors[0][:200] == 1.5).all())  # c's third left out
    kinds = {kind for _, kind in asked}
    assert "part" in kinds and "getpart" not in kinds, asked  # c was sent its parts, and never asked for its result
