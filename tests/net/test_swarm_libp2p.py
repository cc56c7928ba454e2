"""Real peers on real libp2p (hivemind's daemon) on 127.0.0.1: every method, late join, slow peer."""

from __future__ import annotations

from typing import Any

import pytest

from p2ptrain.algo.methods import method_config
from p2ptrain.algo.priority import is_send_slot
from p2ptrain.data import Corpus

from .peers import Spec, applied_agree, libp2p_transports, run_peers

pytestmark = [pytest.mark.net, pytest.mark.timeout(240)]


@pytest.mark.parametrize("name,knobs", [
    ("diloco", {"H": 8}),
    ("streaming", {"H": 8, "P": 2, "tau": 2, "codec": "e3m0"}),
    ("cocodc", {"H": 8, "P": 2, "tau": 2, "sends_per_window": 4, "codec": "fp32"}),
    ("eager", {"H": 8}),
    ("dilocox", {"H": 8, "rank": 2}),
    ("ddp", {}),
])
def test_every_method_on_three_libp2p_peers(name: str, knobs: dict[str, Any], corpus: Corpus) -> None:
    """Rounds go by the peers' own inner steps (``clock="steps"``), as in test_memory_swarm: paced by a wall clock
    of 0.05 s per step, a machine loaded 3-5× over cannot keep the pace, groups close before members join,
    and DiLoCoX's rounds resync without end (its one-step delay needs every round)."""
    spec = Spec(steps=25) if name == "ddp" else Spec(steps=80, delay=0.03)
    run = run_peers(method_config(name, timeout=10, **knobs), [spec] * 3, corpus,
                    libp2p_transports(f"m-{name}", join_window=5.0), step_seconds=0.05, join_window=5.0,
                    clock="steps", warmup=1.0, timeout=200)
    assert not run.errors, run.errors
    res = [r for r in run.results if r is not None]
    assert len(res) == 3 and all(r.rounds_complete + r.rounds_partial > 0 for r in res), \
        [(r.rounds_complete, r.rounds_partial, r.rounds_failed) for r in res]
    if name == "ddp":
        for r in res[1:]:
            assert all(t.equal(r.outer_params[n]) for n, t in res[0].outer_params.items())
    elif name != "eager":  # eager's outer state is per peer by design
        applied_agree(res, peers=run.peers)


def test_cocodc_with_n_from_each_link_syncs_on_one_grid(corpus: Corpus) -> None:
    """The CLI default: no fixed N, each peer proposes the N its measured link carries, and the leader
    of each window's first slot sets one N for a later window. Every slot group forms with all three."""
    method = method_config("cocodc", H=8, P=2, tau=2, codec="fp32", timeout=10)
    # Rounds by the peers' own steps (as in the test above): paced by a 0.05 s wall clock, a loaded machine lost
    # 7 rounds on every peer (groups closed before the late members joined).
    run = run_peers(method, [Spec(steps=160, delay=0.03)] * 3, corpus, libp2p_transports("adaptive", join_window=5.0),
                    step_seconds=0.05, join_window=5.0, clock="steps", warmup=1.0, timeout=300)
    assert not run.errors, run.errors
    res = [r for r in run.results if r is not None]
    assert len(res) == 3 and all(r.rounds_failed <= 2 for r in res), \
        [(r.rounds_complete, r.rounds_partial, r.rounds_failed, r.repairs) for r in res]
    common = applied_agree(res, min_common=20)  # bitwise equal θ after every round all three applied
    agreed = [p.outer.sends_per_window for p in run.peers if p.outer is not None]
    assert len(agreed) == 3 and None not in agreed, agreed  # every peer took an N its members proposed
    grids = [p.outer.grid for p in run.peers if p.outer is not None and p.outer.grid is not None]
    assert len(grids) == 3 and len({tuple(g.history) for g in grids}) == 1, [g.history for g in grids]  # one grid
    steps = sorted(int(k.rsplit(".L", 1)[1]) for k in common)

    def n_at(step: int) -> int:
        return grids[0].took_effect(step) or 2  # P until the first agreed change

    off = [s for s in steps if not is_send_slot(s, 8, n_at(s))]
    assert not off, (off, grids[0].history)  # every round on the grid of the N in effect at its step
    wide = {s // 8 for s in steps if n_at(s) > 2}  # windows at N > P (how many depends on this machine's load)
    if len(wide) >= 2:  # h = 2 there: slots at offsets 2 (and 6 for N = 4) besides 0 and 4
        assert any(s % 8 in (2, 6) for s in steps if n_at(s) > 2), (steps, grids[0].history)


def test_late_joiner_syncs_and_takes_part(corpus: Corpus) -> None:
    # The joiner starts once the others applied a round (not after a fixed delay: on a loaded machine the swarm
    # had applied none 4 s in, and the joiner took the initial θ)
    specs = [Spec(steps=120, delay=0.03)] * 3 + [Spec(steps=50, delay=0.03, start_when=lambda run: all(
        p.applied > 0 for p in run.peers[:3]))]
    run = run_peers(method_config("streaming", H=8, P=2, tau=2, codec="fp32", timeout=10), specs, corpus,
                    libp2p_transports("late"), step_seconds=0.15, timeout=200)  # (at 0.05 s: 125-188 s)
    assert not run.errors, run.errors
    late = run.results[3]
    assert late is not None and late.rounds_complete + late.rounds_partial >= 2
    # Before its first inner step the joiner's θ was, bitwise, the θ a live peer held: the one it served (the rounds
    # the source then had in flight are taken after the joiner's warm-up, test_join_catch_up.py), or one after them.
    joiner = run.peers[3]
    assert joiner.synced_from is not None and joiner.start_digests
    source = next(p for p in run.peers[:3] if p.peer_id == joiner.synced_from)
    held = {d for served in source.served_digests for d in served} | {d for d, _ in source.applied_log.values()}
    assert all(d in held for d in joiner.start_digests), (joiner.start_digests, held)
    assert joiner.start_digests != run.peers[0].start_digests  # the swarm had moved on from the initial θ
    assert applied_agree(run.results, min_common=1)  # the joiner's θ matches the swarm's after shared rounds


@pytest.mark.parametrize("factor", [3, 10])
def test_a_slower_peer_does_not_slow_the_others(corpus: Corpus, factor: int) -> None:
    method = method_config("cocodc", H=8, P=2, tau=2, sends_per_window=4, codec="fp32", timeout=10)
    step = 0.04  # each fast peer: ~0.04 s per inner step; the slow one (a straggler) `factor`× that
    base = run_peers(method, [Spec(steps=60, delay=step)] * 3, corpus, libp2p_transports(f"fast{factor}"),
                     step_seconds=0.05)
    mixed = run_peers(method, [Spec(steps=60, delay=step)] * 2 + [Spec(steps=max(12, 60 // factor),
                                                                        delay=factor * step + 0.01)],
                      corpus, libp2p_transports(f"slow{factor}"), step_seconds=0.05)
    assert not base.errors and not mixed.errors, (base.errors, mixed.errors)
    fast_mixed = sum(mixed.step_rates[:2]) / 2
    # the slow peer really is slow: its sleep adds (factor − 1)·step to each step beyond a fast peer's (compared
    # as seconds per step: on a loaded machine every peer's compute grows, and a ratio of rates shrinks with it)
    assert 1 / mixed.step_rates[2] - 1 / fast_mixed > 0.5 * (factor - 1) * step, (mixed.step_rates, fast_mixed)
    # and the fast peers keep their pace: had they waited for the straggler, the time their loop spends outside
    # their own inner steps would grow by about the straggler's extra (factor − 1)·step per step. Compared as that
    # time (waits, merges, applies) and not as a rate of steps: the two swarms run one after the other, and a change
    # of the machine's load between them moved the fast peers' rate by a third (9.5 → 6.0 steps/s in one CI run),
    # and a rate cannot tell a slower compute (inside the steps) from waiting (outside them).
    fast_wait_base = sum(base.waits[:2]) / 2
    fast_wait_mixed = sum(mixed.waits[:2]) / 2
    assert fast_wait_mixed - fast_wait_base < 0.5 * (factor - 1) * step, (base.waits, mixed.waits, mixed.step_rates)
    assert all(r is not None and r.rounds_complete + r.rounds_partial > 0 for r in mixed.results), [
        None if r is None else (r.rounds_complete, r.rounds_partial, r.rounds_failed) for r in mixed.results]
