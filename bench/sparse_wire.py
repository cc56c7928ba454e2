"""Bytes on the wire of one all-reduce per codec, on real libp2p peers on 127.0.0.1: payload against what
the all-reduce actually sends (parts, results, verified aggregation's claims and evidence).

    python bench/sparse_wire.py                     # 4 peers, the micro model's P = 4 fragments, H = 20

Per codec, one round per fragment of the model (``--preset``, ``--P`` strided fragments), ``--windows`` times:
each peer contributes an error-feedback payload (or its raw pseudo-gradient for the codecs without feedback).
Per codec and H window: the encoded payloads of one peer, the bytes its all-reduces sent (the parts and
results, as the transport counts them) and what verified aggregation added (claims sent, evidence received);
per inner step, and how many times fewer than ddp, whose peer all-reduces the fp32 gradient of the whole model
(the same bytes as an fp32 window) every inner step. Not included: message keys, signatures and TCP/IP and
libp2p framing. Writes bench/results/sparse_wire.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2ptrain.algo.feedback import ErrorFeedback
from p2ptrain.collective.butterfly import parts_roundtrip, ring_factor
from p2ptrain.collective.codecs import get_codec
from p2ptrain.net.transport import JoinRequest, PeerInfo
from p2ptrain.ui import out, table

RESULTS = Path(__file__).parent / "results"


async def _swarm(n: int) -> list[Any]:
    from p2ptrain.net.swarm import HivemindTransport, SwarmConfig

    first = await HivemindTransport.create(SwarmConfig(run_id="sparse-wire", join_window=1.0, ttl=60))
    ts = [first]
    maddrs = await first.visible_maddrs()
    for _ in range(n - 1):
        ts.append(await HivemindTransport.create(SwarmConfig(run_id="sparse-wire", initial_peers=maddrs,
                                                             join_window=1.0, ttl=60)))
    for t in ts:
        await t.announce(PeerInfo(peer_id=t.peer_id))
    for t in ts:
        for _ in range(100):
            if len(await t.peers()) == n:
                break
            await asyncio.sleep(0.1)
    return ts


async def _one(t: Any, p: torch.Tensor, key: str, codec: Any) -> Any:
    g = await t.form_group(JoinRequest(key=key, peer_id=t.peer_id, weight=1.0, fragment=0), None, timeout=20)
    return await t.allreduce(g, 0, [p], 1.0, codec, timeout=30.0, fingerprint=None)


def fragment_sizes(preset_name: str, P: int) -> list[int]:
    """Values per fragment of the preset's model in strided fragments (as the simulator splits it)."""
    from p2ptrain.algo.fragments import make_fragments, model_units
    from p2ptrain.model import GPT, preset

    return [sum(math.prod(s) for s in f.shapes) for f in make_fragments(model_units(GPT(preset(preset_name))), P,
                                                                         "strided")]


async def measure(args: argparse.Namespace, sizes: list[int]) -> dict[str, Any]:
    ts = await _swarm(args.peers)
    rows: dict[str, Any] = {}
    try:
        for name in args.codecs.split(","):
            codec = get_codec(name)
            efs = [[ErrorFeedback(lambda flat, m, c=codec: parts_roundtrip(c, flat, m)) for _ in sizes] for _ in ts]
            for ef in (e for per in efs for e in per):
                ef.expect_members(args.peers)
            gen = torch.Generator().manual_seed(0)
            windows = []
            for w in range(args.windows):
                sent, verify = [0] * len(ts), [0] * len(ts)
                for f, numel in enumerate(sizes):
                    vecs = [torch.randn(numel, generator=gen) * 1e-3 for _ in ts]
                    payloads = [per[f].begin([v])[0] if codec.error_feedback else v
                                for per, v in zip(efs, vecs, strict=True)]
                    res = await asyncio.gather(*(_one(t, p, f"{name}-{w}-{f}", codec)
                                                 for t, p in zip(ts, payloads, strict=True)))
                    for i, (per, x) in enumerate(zip(efs, res, strict=True)):
                        if codec.error_feedback:
                            per[f].receive(x.tensors)
                        sent[i] += x.bytes_sent
                        verify[i] += x.verify_bytes
                windows.append({"sent": sent, "verify": verify})
            payload = sum(codec.encoded_size(s) for s in sizes)
            used = windows[1:] or windows  # the first window also pays for connections being set up
            sent_w = statistics.mean(s for wd in used for s in wd["sent"])
            verify_w = statistics.mean(s for wd in used for s in wd["verify"])
            rows[name] = {"payload_bytes_per_window": payload, "sent_bytes_per_window": sent_w,
                          "verify_bytes_per_window": verify_w, "sent_over_payload": sent_w / payload,
                          "ideal": ring_factor(args.peers), "windows": windows}
            out.print(f"{name}: payload {payload} B, sent {sent_w:.0f} B/peer (verify {verify_w:.0f}) per window",
                      highlight=False)
    finally:
        await asyncio.gather(*(t.aclose() for t in ts), return_exceptions=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--preset", default="micro")
    ap.add_argument("--P", type=int, default=4)
    ap.add_argument("--H", type=int, default=20)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--codecs", default="fp32,e3m0,2bit,topk2:0.03,topk2")
    ap.add_argument("--out", type=Path, default=RESULTS / "sparse_wire.json")
    args = ap.parse_args()
    sizes = fragment_sizes(args.preset, args.P)
    rows = asyncio.run(measure(args, sizes))
    ddp = rows["fp32"]["sent_bytes_per_window"] + rows["fp32"]["verify_bytes_per_window"] if "fp32" in rows else None
    for v in rows.values():
        v["payload_per_inner_step"] = v["payload_bytes_per_window"] / args.H
        v["wire_per_inner_step"] = (v["sent_bytes_per_window"] + v["verify_bytes_per_window"]) / args.H
        v["wire_ratio_vs_ddp"] = ddp / v["wire_per_inner_step"] if ddp else None
        v["payload_ratio_vs_ddp"] = 4.0 * sum(sizes) / v["payload_per_inner_step"]
    cols = ["codec", "payload B / step", "× below ddp", "sent B / step", "+ verification B / step",
            "wire × below ddp", "sent / payload"]
    out.print(table(f"{args.preset}: {sum(sizes):,} values in {args.P} fragments, {args.peers} libp2p peers, "
                    f"H = {args.H}", cols, [
        [k, f"{v['payload_per_inner_step']:.1f}", f"{v['payload_ratio_vs_ddp']:.0f}",
         f"{v['sent_bytes_per_window'] / args.H:.1f}", f"{v['verify_bytes_per_window'] / args.H:.1f}",
         f"{v['wire_ratio_vs_ddp']:.0f}" if v["wire_ratio_vs_ddp"] else "–", f"{v['sent_over_payload']:.2f}"]
        for k, v in rows.items()]))
    args.out.write_text(json.dumps({"command": "python bench/sparse_wire.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"), "fragments": sizes,
        "peers": args.peers, "H": args.H, "codecs": rows}, indent=1))


if __name__ == "__main__":
    main()
