"""Verified aggregation on real libp2p peers: a part owner that sends back a wrong average is caught by every
honest member, banned, and the honest members end the round with the honest mean (recomputed from the signed
contributions) or without that part; a member that lies about its own contribution to get an honest owner
blamed is the one banned."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import torch

from p2ptrain.collective.butterfly import part_bounds
from p2ptrain.collective.codecs import get_codec
from p2ptrain.faults import LIES, FaultPlan
from p2ptrain.net.guard import GuardConfig
from p2ptrain.net.transport import JoinRequest, PeerInfo

pytestmark = [pytest.mark.net, pytest.mark.timeout(240)]

N = 5
NUMEL = 1 << 14  # 16 Ki values: parts of ~3 Ki, small enough for a test, large enough to count bytes


@asynccontextmanager
async def swarm(faults: FaultPlan, bad: int, guard: GuardConfig | None = None,
                run: str = "liar", audit_rate: float | list[float] = 0.1,
                chunk: int | None = None) -> AsyncIterator[list[Any]]:
    """N libp2p peers on 127.0.0.1; peer ``bad`` injects ``faults``; ``chunk``: values per streamed chunk."""
    from p2ptrain.net.swarm import HivemindTransport, SwarmConfig

    ts: list[Any] = []
    try:
        for i in range(N):
            initial = await ts[0].visible_maddrs() if ts else []
            ts.append(await HivemindTransport.create(SwarmConfig(
                run_id=run, initial_peers=initial, join_window=2.0, ttl=30, guard=guard or GuardConfig(),
                audit_rate=audit_rate[i] if isinstance(audit_rate, list) else audit_rate,
                faults=faults if i == bad else FaultPlan(), **({"chunk_values": chunk} if chunk else {}))))
        for t in ts:
            await t.announce(PeerInfo(peer_id=t.peer_id))
        for t in ts:
            for _ in range(100):
                if len(await t.peers()) == N:
                    break
                await asyncio.sleep(0.1)
        yield ts
    finally:
        await asyncio.gather(*(t.aclose() for t in ts), return_exceptions=True)


def update(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.ones(NUMEL) + 0.1 * torch.randn(NUMEL, generator=g)


async def rounds(ts: list[Any], n: int, timeout: float = 12.0, codec: str = "fp32") -> list[list[Any]]:
    out = []
    for r in range(n):
        async def one(i: int, t: Any, r: int = r) -> Any:
            g = await t.form_group(JoinRequest(key=f"r{r}", peer_id=t.peer_id, weight=1.0 + i, fragment=0), None,
                                   timeout=20)
            return await t.allreduce(g, 0, [update(i)], 1.0 + i, get_codec(codec), timeout=timeout)

        out.append(list(await asyncio.gather(*(one(i, t) for i, t in enumerate(ts)), return_exceptions=True)))
    return out


def weighted(ids: list[int]) -> torch.Tensor:
    ws = torch.tensor([1.0 + i for i in ids], dtype=torch.float64)
    return (torch.stack([update(i).double() for i in ids]) * ws[:, None]).sum(0) / ws.sum()


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("lie", LIES)
def test_a_lying_owner_is_caught_banned_and_its_part_is_the_honest_mean(lie: str, streamed: bool) -> None:
    """Whole parts, and parts streamed in chunks of 1024 values (the lie too, signed like the truth): then every
    member's checks are summed chunk by chunk as the results arrive (net/tally.py), and must catch it the same."""
    bad = N - 1

    async def go() -> None:
        async with swarm(FaultPlan(lie=lie), bad, chunk=1024 if streamed else None) as ts:
            liar = ts[bad].peer_id
            results = await rounds(ts, 3)
            honest_ids = list(range(N))
            for r, res in enumerate(results):
                for i, x in enumerate(res):
                    if i == bad:
                        continue
                    assert not isinstance(x, BaseException), (lie, r, i, x)
                    got = x.tensors[0].double()
                    if liar in x.members:  # every part, the liar's included: the mean of all five
                        want = weighted(honest_ids)
                        if liar in x.contributors:
                            assert torch.allclose(got, want, rtol=0, atol=1e-6), (lie, r, i, float((got - want).abs().max()))
                        else:  # its part was left out: every other part is exact
                            lo, hi = part_bounds(NUMEL, len(x.members))[x.members.index(liar)]
                            keep = torch.ones(NUMEL, dtype=torch.bool)
                            keep[lo:hi] = False
                            assert x.partial and torch.allclose(got[keep], want[keep], rtol=0, atol=1e-6)
                    else:  # after the ban: a group of the four honest peers
                        assert torch.allclose(got, weighted(honest_ids[:bad]), rtol=0, atol=1e-6), \
                            (lie, r, i, x.partial, len(x.members), len(x.contributors), x.timeline)
            for i, t in enumerate(ts[:bad]):
                assert t.guard.is_banned(liar), (lie, i, dict(t.guard.strikes))
                assert not (t.guard.banned - {liar}), (lie, i, t.guard.banned)  # no honest peer was banned
            first = [x for x in results[0][:bad]]
            assert all(liar in x.liars or t.guard.is_banned(liar) for x, t in zip(first, ts, strict=False))
            if streamed and lie != "nan":  # the checks were the ones summed as the chunks came (not a second pass)
                assert all(x.verify_tallied >= N - 2 for x in first), [x.verify_tallied for x in first]
            # What verification cost the honest members in the round that caught the liar, and in one without it.
            for label, res in (("caught", results[0]), ("after", results[2])):
                for x in res[:bad]:
                    print(f"{lie} {label}: round {x.bytes_sent + x.bytes_received} B, verification {x.verify_bytes} B "
                          f"({x.verify_bytes / max(1, x.bytes_sent + x.bytes_received):.1%}), {x.verify_seconds:.3f} s of "
                          f"{x.seconds:.3f} s")

    asyncio.run(go())


def test_a_member_that_lies_about_its_contribution_is_banned_not_the_owner() -> None:
    """A contributor's claims contradict what it signed: every member that checks a part it contributed to
    asks the owner for the signed contributions and finds the framer out; the round ends exact."""
    bad = 1

    async def go() -> None:
        async with swarm(FaultPlan(frame=True), bad, run="framer") as ts:
            framer = ts[bad].peer_id
            results = await rounds(ts, 2)
            for x in results[0]:
                assert not isinstance(x, BaseException), x
                assert torch.allclose(x.tensors[0].double(), weighted(list(range(N))), rtol=0, atol=1e-6)
            for i, t in enumerate(ts):
                if i != bad:
                    assert t.guard.is_banned(framer), (i, t.guard.banned)
                    assert t.guard.banned == {framer}, (i, t.guard.banned)

    asyncio.run(go())


def test_an_owner_that_lies_to_half_the_members_leaves_every_honest_member_with_the_same_values() -> None:
    """Equivocation: the members that got the lie recompute the part from the signed contributions, the
    others got the truth: all end bitwise equal. The owner signed both results: the verdicts carry the proof,
    and every honest member bans it."""
    bad = 0

    async def go() -> None:
        async with swarm(FaultPlan(lie="shift", lie_to_some=True), bad, run="equivocate") as ts:
            liar = ts[bad].peer_id
            [res] = await rounds(ts, 1)
            honest = [x for i, x in enumerate(res) if i != bad]
            assert all(not isinstance(x, BaseException) for x in honest), honest
            for x in honest[1:]:
                assert torch.equal(x.tensors[0], honest[0].tensors[0])
            assert torch.allclose(honest[0].tensors[0].double(), weighted(list(range(N))), rtol=0, atol=1e-6)
            assert all(t.guard.banned == {liar} for t in ts[1:]), [t.guard.banned for t in ts[1:]]

    asyncio.run(go())


@pytest.mark.parametrize("lie", ["scale", "shift"])
def test_centered_clip_holds_against_a_lying_owner_on_the_real_transport(lie: str) -> None:
    """With a robust rule the members check BTARD's equation (the clipped pulls cancel at the result); a lie
    fails it and the part is recomputed with the owner's radius τ. Contributions streamed in chunks (so their
    signatures travel in trailer frames)."""
    bad = 2

    async def go() -> None:
        from p2ptrain.collective.aggregate import centered_clip

        async with swarm(FaultPlan(lie=lie), bad, guard=GuardConfig(aggregation="centered-clip"),
                         run=f"clip-{lie}") as ts:
            for t in ts:
                t.cfg.chunk_values = 1024  # parts of ~3 Ki values travel in 4 chunks each
            liar = ts[bad].peer_id
            [res] = await rounds(ts, 1)
            honest = [(i, x) for i, x in enumerate(res) if i != bad]
            assert all(not isinstance(x, BaseException) for _, x in honest), honest
            members = honest[0][1].members
            for j, owner in enumerate(members):
                lo, hi = part_bounds(NUMEL, len(members))[j]
                ids = [k for k, t in enumerate(ts) if t.peer_id in honest[0][1].contributors]
                # The owner's own share is raw; the others' went through fp32 (lossless): the same values.
                want = centered_clip([update(k)[lo:hi] for k in ids], [1.0 + k for k in ids])
                for _, x in honest:
                    assert torch.allclose(x.tensors[0][lo:hi], want, rtol=1e-5, atol=1e-6), (lie, j, owner == liar)
            assert all(t.guard.is_banned(liar) for i, t in enumerate(ts) if i != bad)

    asyncio.run(go())


@pytest.mark.parametrize("how", ["forged own share", "e3m0 wire"])
def test_audits_catch_what_sketches_cannot(how: str) -> None:
    """Two lies the sketches pass: an owner that passes its lie off as its own share (its claims add up), and a
    shift of 10% within the 4-bit wire's rounding. An exact audit (every member audits here: a rate far above
    the default) recomputes the part from the signed contributions, with the owner's own share as it announced
    it before any result: the liar is banned and every honest member ends with the same, honest values."""
    bad = 3
    forge = how == "forged own share"
    codec = "fp32" if forge else "e3m0"

    async def go() -> None:
        async with swarm(FaultPlan(lie="shift", forge=forge), bad, run=f"audit-{codec}", audit_rate=100.0) as ts:
            liar = ts[bad].peer_id
            [res] = await rounds(ts, 1, codec=codec)
            honest = [x for i, x in enumerate(res) if i != bad]
            assert all(not isinstance(x, BaseException) for x in honest), honest
            for x in honest[1:]:
                assert torch.equal(x.tensors[0], honest[0].tensors[0])
            if forge:
                assert torch.allclose(honest[0].tensors[0].double(), weighted(list(range(N))), rtol=0, atol=1e-6)
            assert all(t.guard.banned == {liar} for i, t in enumerate(ts) if i != bad)

    asyncio.run(go())


async def _forged_shift_is_caught(bad: int, run: str, audit_rate: float | list[float], chunk: int | None = None) -> None:
    """A +10% shift that ``bad`` passes off as its own share: every honest member ends the round with the honest mean
    of all N and bans the liar, and nobody else. (A longer round: the audits' fetches and recomputation, then the
    others' settling, all before the verdict deadline at 0.9 of it, also on a loaded machine; idle it ends in ~2 s.)"""
    async with swarm(FaultPlan(lie="shift", forge=True), bad, run=run, audit_rate=audit_rate, chunk=chunk) as ts:
        liar = ts[bad].peer_id
        [res] = await rounds(ts, 1, timeout=30.0)
        honest = [x for i, x in enumerate(res) if i != bad]
        assert all(not isinstance(x, BaseException) for x in honest), honest
        for x in honest:
            assert torch.allclose(x.tensors[0].double(), weighted(list(range(N))), rtol=0, atol=1e-6)
        assert all(t.guard.banned == {liar} for i, t in enumerate(ts) if i != bad)


def test_what_one_members_audit_proves_every_member_acts_on() -> None:
    """Only one member audits (the others' rate is 0): it proves the forged lie, tells the others in its verdict,
    they settle the part from the owner's evidence themselves, and all ban the liar and end with the same values."""
    bad, auditor = 2, 4
    asyncio.run(_forged_shift_is_caught(bad, "one-audit", [100.0 if i == auditor else 0.0 for i in range(N)]))


def test_one_audited_slice_of_each_part_catches_a_forged_lie_and_costs_a_slice_not_the_part() -> None:
    """Parts streamed in chunks of 1024 values; every member audits one random slice of each part it judges (a
    rate of N − 1; the slices are the chunks here). Honest, that costs each member the slice of every other
    contribution per part, not the parts. An owner that passes a lie over its whole part off as its own share (the
    sketches add up): the audited slice shows it, the dispute that follows settles the part, the liar is banned and
    every honest member ends with the honest mean."""
    part = NUMEL // N + 1
    whole = (N - 1) * N * part * 4  # the evidence bytes of auditing every other part whole

    async def go() -> None:
        async with swarm(FaultPlan(), 0, run="slice-honest", audit_rate=float(N - 1), chunk=1024) as ts:
            [res] = await rounds(ts, 1, timeout=30.0)  # (a loaded machine: no member cut off)
            for x in res:
                assert not isinstance(x, BaseException), x
                assert x.verify_audits == N - 1 and not x.liars and not x.partial
                assert torch.allclose(x.tensors[0].double(), weighted(list(range(N))), rtol=0, atol=1e-6)
                print(f"honest: verification {x.verify_bytes} B; a whole-part audit of each part: {whole} B of evidence")
                assert x.verify_bytes < whole / 3
        await _forged_shift_is_caught(1, "slice-liar", float(N - 1), chunk=1024)

    asyncio.run(go())


def test_an_auditor_that_cannot_settle_a_part_applies_nothing_rather_than_another_theta(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An owner sends its (honest) result to everyone, then falls silent (it answers no request for evidence: a
    peer killed or cut off after its sends). Only one member audits (the others' rate is 0): its audit cannot
    settle the part. It used to leave the part out (zero) and apply; the others used it: two θ after one round,
    flagged by nobody. Now the auditor's round fails (it repairs from the next round's vote) and every member
    that applies holds the same, exact mean."""
    from p2ptrain.net.mailbox import Mailboxes

    silent: set[int] = set()
    show = Mailboxes.show_evidence

    async def maybe_silent(self: Mailboxes, sender: str, msg: dict[str, Any]) -> dict[str, Any]:
        if id(self) in silent:
            await asyncio.sleep(60)  # longer than the round: the asker's request times out
        return await show(self, sender, msg)

    monkeypatch.setattr(Mailboxes, "show_evidence", maybe_silent)
    owner, auditor = 1, 3

    async def go() -> None:
        async with swarm(FaultPlan(), owner, run="silent-owner",
                         audit_rate=[100.0 if i == auditor else 0.0 for i in range(N)]) as ts:
            silent.add(id(ts[owner].mailboxes))
            [res] = await rounds(ts, 1, timeout=12.0)
            failed = res[auditor]
            assert isinstance(failed, Exception) and "could not be verified" in str(failed), failed
            applied = [x for i, x in enumerate(res) if i != auditor]
            assert all(not isinstance(x, BaseException) for x in applied), applied
            for x in applied:
                assert torch.allclose(x.tensors[0].double(), weighted(list(range(N))), rtol=0, atol=1e-6)
            assert not any(t.guard.banned for t in ts)  # silence proves nothing

    asyncio.run(go())


def test_a_lie_that_comes_while_the_others_are_judged_is_judged_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """A result that lands after a member began judging (a late stream under load) was assembled unjudged: an
    owner's lie reached that member's θ while the others replaced it (a full suite beside a benchmark, once).
    Every honest member here holds the liar's result back from its first judging, as a late arrival would be:
    it is judged before the assembly, and replaced with the honest mean."""
    from p2ptrain.net.audit import Audit

    bad = N - 1
    real = Audit.judge_all
    held_back: list[int] = []
    seen: set[int] = set()  # the audits (one per member and run) that judged once already

    async def judge_all(self: Audit, until: float) -> None:
        liar_part = [j for j, p in enumerate(self.members) if p == liar_id[0] and j != self.me]
        first = id(self) not in seen
        seen.add(id(self))
        hide = {j: self.box.results.pop(j) for j in liar_part if j in self.box.results and first}
        held_back.extend(hide)
        try:
            await real(self, until)
        finally:
            self.box.results.update(hide)  # "arrived" while the others were judged

    liar_id: list[str] = []
    monkeypatch.setattr(Audit, "judge_all", judge_all)

    async def go() -> None:
        async with swarm(FaultPlan(lie="scale"), bad, run="late-lie") as ts:
            liar_id.append(ts[bad].peer_id)
            res = (await rounds(ts, 1))[0]
            assert len(held_back) >= bad  # every honest member judged without it first
            want = weighted(list(range(N)))
            for i, x in enumerate(res[:bad]):
                assert not isinstance(x, BaseException), (i, x)
                assert liar_id[0] in x.liars or ts[i].guard.is_banned(liar_id[0]), i
                got = x.tensors[0].double()
                if liar_id[0] in x.contributors:  # replaced by the honest mean
                    assert torch.allclose(got, want, rtol=0, atol=1e-6), (i, float((got - want).abs().max()))
                else:  # or left out: every other part exact
                    lo, hi = part_bounds(NUMEL, len(x.members))[x.members.index(liar_id[0])]
                    keep = torch.ones(NUMEL, dtype=torch.bool)
                    keep[lo:hi] = False
                    assert torch.allclose(got[keep], want[keep], rtol=0, atol=1e-6)

    asyncio.run(go())
