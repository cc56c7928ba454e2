"""The 1- and 2-bit codecs on both transports: peers' error-feedback payloads go through the real all-reduce (parts,
owners, audit) and every member ends with what the simulator's butterfly computes, bit for bit; no honest
owner is taken for a liar although the sparse codecs round far more than the others."""

from __future__ import annotations

import asyncio

import pytest
import torch

from p2ptrain.algo.feedback import ErrorFeedback
from p2ptrain.algo.methods import method_config
from p2ptrain.collective.butterfly import butterfly_mean, parts_roundtrip
from p2ptrain.collective.codecs import get_codec
from p2ptrain.data import Corpus

from .peers import Spec, applied_agree, libp2p_transports, run_peers
from .test_transport_contract import SWARMS, Make, _round, run


@pytest.mark.parametrize("make", SWARMS)
@pytest.mark.parametrize("codec", ["topk2", "2bit", "1bit"])
def test_error_feedback_payloads_reduce_as_in_the_simulator(make: Make, codec: str) -> None:
    wire = get_codec(codec)

    async def go() -> None:
        async with make(3) as ts:
            g = torch.Generator().manual_seed(1)
            payloads = {}
            for t in ts:
                ef = ErrorFeedback(lambda flat, m: parts_roundtrip(wire, flat, m))
                ef.expect_members(3)
                payloads[t.peer_id] = ef.begin([torch.randn(6000, generator=g)])[0]
            out = await asyncio.gather(*(_round(t, "s", [payloads[t.peer_id]], 1.0, codec) for t in ts))
            group = out[0][0]
            expected = butterfly_mean([payloads[p] for p in group.members], [1.0] * 3, wire)
            for _, r in out:
                assert not r.partial and len(r.contributors) == 3
                assert torch.equal(r.tensors[0], expected)

    run(go())


@pytest.mark.net
@pytest.mark.timeout(240)
def test_streaming_with_topk2_on_three_libp2p_peers(corpus: Corpus) -> None:
    """Real peers, real drivers: streaming behind error feedback with the 1% top-k wire; θ agrees bitwise."""
    method = method_config("streaming", H=8, P=2, tau=2, codec="topk2", outer_momentum=0.0, outer_lr=1.0,
                           timeout=10)
    res_run = run_peers(method, [Spec(steps=80, delay=0.03)] * 3, corpus, libp2p_transports("topk2"),
                        step_seconds=0.15, timeout=200.0)  # (at 0.05 s, a round every 0.2 s a peer, peers on a
    # machine with half its CPU stolen trained 0.6 steps a second and missed the 120 s limit; at 0.15 s the test took
    # 26-28 s alone and 103 s beside the suite and a benchmark: 200 s leaves room)
    assert not res_run.errors, res_run.errors
    res = [r for r in res_run.results if r is not None]
    assert len(res) == 3 and all(r.rounds_complete > 0 for r in res)
    applied_agree(res)
