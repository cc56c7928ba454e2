"""Scale, protocol only: one fragment round among 2 → 1024 peers, modelled (sim/protocol.py).

    python bench/scale_protocol.py                                # k = 2, 4, ..., 1024; G = 8; cells of 32; 4 regions
    python bench/scale_protocol.py --peers 2,16,128 --group-size 16 --regions 2 --trials 8

For each k and each way of averaging a fragment of F bytes (flat butterfly over all k; bounded groups of
at most G from algo/grouping.split_groups; hierarchical by region; cells, what the product runs:
net/hierarchy.py's cells of at most ``--cell-size`` inside each region, all-reduced across by one carrier a
cell, built by its own cells_of/plan_for): the round time (mean over seeded trials of straggler delays),
payload bytes sent per peer and across regions, streams and distinct peers per peer, the
round's buffers per peer, and for bounded groups the rounds needed to mix (spread of k scalars below
1e-3, averaged in the real split_groups' groups). Then the same with a share of peers vanishing each
round. The issue's yardstick: ``round_time(k) / (T_G · log2 k)``, with T_G the flat round of G peers (the
same T_G, G = ``--group-size``, for every scheme, cells included).

Before the model: its byte and message counts against the real butterfly (the swarm's ButterflyRun,
messages handed over in memory, sim/loopback.py) and the in-memory transport, k ≤ ``--validate-upto``;
and the wall time of split_groups at the largest k. Writes bench/results/scale_protocol.json after every
step and scale_protocol.png (with matplotlib), prints tables. A model, not a measurement of a network:
see sim/protocol.py for what it leaves out.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import RESULTS, exit_on_sigterm, write_json


def _args() -> argparse.Namespace:
    from p2ptrain.sim.network import parse_bandwidth, parse_duration

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", default=",".join(str(2**i) for i in range(1, 11)), help="swarm sizes k")
    ap.add_argument("--group-size", type=int, default=8, help="G, the bounded groups' maximum size")
    ap.add_argument("--cell-size", type=int, default=32,
                    help="the cells scheme's G (the product's --max-group): the largest cell")
    ap.add_argument("--regions", type=int, default=4, help="R; peer i is in region i mod R")
    ap.add_argument("--fragment-mib", type=float, default=64.0, help="F, the fragment's encoded size (MiB)")
    ap.add_argument("--intra-bandwidth", type=parse_bandwidth, default=parse_bandwidth("1gbit"))
    ap.add_argument("--inter-bandwidth", type=parse_bandwidth, default=parse_bandwidth("100mbit"))
    ap.add_argument("--region-bandwidth", type=parse_bandwidth, default=None,
                    help="a region's shared uplink to the others (default: not shared)")
    ap.add_argument("--intra-latency", type=parse_duration, default=parse_duration("0.5ms"), help="one-way")
    ap.add_argument("--inter-latency", type=parse_duration, default=parse_duration("50ms"), help="one-way")
    ap.add_argument("--stream-cost", type=parse_duration, default=parse_duration("1ms"),
                    help="a peer's serial time per message it sends")
    ap.add_argument("--jitter", type=parse_duration, default=parse_duration("50ms"), help="median straggler delay")
    ap.add_argument("--jitter-sigma", type=float, default=1.0, help="σ of the lognormal straggler delay")
    ap.add_argument("--fail-prob", type=float, default=1e-3, help="share of peers vanishing per round (2nd table)")
    ap.add_argument("--fail-wait", type=parse_duration, default=parse_duration("30s"),
                    help="how long a group waits for a vanished member")
    ap.add_argument("--trials", type=int, default=16, help="seeded rounds averaged per k")
    ap.add_argument("--fail-trials", type=int, default=200,
                    help="seeded rounds averaged per k with failures (they are rare: more trials)")
    ap.add_argument("--mix-trials", type=int, default=3)
    ap.add_argument("--validate-upto", type=int, default=16, help="check the model against the real butterfly")
    ap.add_argument("--out", type=Path, default=RESULTS / "scale_protocol.json")
    a = ap.parse_args()
    if a.group_size < 2 or a.cell_size < 2 or a.trials < 1:
        ap.error("--group-size and --cell-size must be at least 2 and --trials at least 1")
    return a


def _validate(a: argparse.Namespace) -> list[dict[str, Any]]:
    """The model's bytes and messages per peer against the real butterfly and the in-memory transport."""
    from p2ptrain.sim.loopback import loopback_round, memory_swarm_bytes
    from p2ptrain.sim.protocol import LinkModel, flat

    rows = []
    k = 2
    while k <= a.validate_upto:
        numel = 1 << 16  # 256 KiB of fp32; streamed in chunks of 1024 values
        model = flat(k, LinkModel(fragment_bytes=4 * numel, regions=1, jitter_scale=0.0), [0.0] * k)
        t0 = time.perf_counter()
        real = asyncio.run(loopback_round(k, numel, chunk=1024, timeout=60.0))
        wall = time.perf_counter() - t0
        mem = asyncio.run(memory_swarm_bytes(k, numel))
        rows.append({"k": k, "model_bytes_per_peer": model.bytes_sent_per_peer,
                     "butterfly_bytes_per_peer": sorted(set(real.payload_sent)),
                     "butterfly_reported": sorted({r.bytes_sent for r in real.results}),
                     "memory_transport_bytes": sorted(set(mem)), "model_streams": model.streams_per_peer,
                     "butterfly_messages": sorted(set(real.messages_sent)), "butterfly_wall_seconds": wall,
                     "match": set(real.payload_sent) == set(mem) == {model.bytes_sent_per_peer}
                     and set(real.messages_sent) == {model.streams_per_peer}})
        k *= 2
    return rows


def _grouping_cost(k: int, g: int) -> dict[str, Any]:
    """Wall time of split_groups and group_of over ``k`` members (median of 30, this process)."""
    from p2ptrain.algo.grouping import group_of, split_groups
    from p2ptrain.sim.protocol import peer_names

    names = peer_names(k)
    split, find = [], []
    for r in range(30):
        t0 = time.perf_counter()
        split_groups(names, g, f"run/round{r}")
        t1 = time.perf_counter()
        group_of(names[r], names, g, f"run/round{r}")
        find.append(time.perf_counter() - t1)
        split.append(t1 - t0)
    return {"k": k, "group_size": g, "split_groups_ms": 1e3 * statistics.median(split),
            "group_of_ms": 1e3 * statistics.median(find)}


def _one_k(k: int, a: argparse.Namespace, link: Any, trials: int) -> dict[str, Any]:
    from p2ptrain.sim.protocol import bounded, cells, flat, hierarchical, mean_over_trials, ready_times

    rows: dict[str, list[Any]] = {"flat": [], "bounded": [], "hierarchical": [], "cells": []}
    for t in range(trials):
        ready = ready_times(k, link, random.Random(1000 * k + t))  # the same stragglers for every scheme
        rows["flat"].append(flat(k, link, ready))
        rows["bounded"].append(bounded(k, a.group_size, link, ready, seed=f"run/round{t}"))
        rows["hierarchical"].append(hierarchical(k, link, ready))
        rows["cells"].append(cells(k, a.cell_size, link, ready, seed=f"run/round{t}"))
    return {name: mean_over_trials(v).as_dict() for name, v in rows.items()}


def _criterion(rows: list[dict[str, Any]], g: int, per_group: float) -> dict[str, Any]:
    """``T(k) / (T_G · log2 k)`` per scheme and k. "holds": no k above 8G has a ratio over 1.1× the largest
    of the small swarms (2G ≤ k ≤ 8G, where groups first split): the constant of O(log k) found there
    still bounds every larger swarm measured. Also the slope of log ratio against log k over the larger
    half of the swarm sizes (≤ 0: the ratio is not growing where it ends)."""
    from p2ptrain.sim.protocol import log2_ratio

    out: dict[str, Any] = {"per_group_seconds": per_group, "definition":
                           "ratio(k) = T(k) / (T_G * log2 k), T_G = the flat round of G peers; holds if "
                           "ratio(k) <= 1.1 * max(ratio(k') for 2G <= k' <= 8G) for every k > 8G"}
    series = {
        "flat": [(r["k"], r["flat"]["round_seconds"]) for r in rows],
        "bounded_round": [(r["k"], r["bounded"]["round_seconds"]) for r in rows],
        "bounded_to_mix": [(r["k"], r["mix_rounds"] * r["bounded"]["round_seconds"]) for r in rows],
        "hierarchical": [(r["k"], r["hierarchical"]["round_seconds"]) for r in rows],
        "cells": [(r["k"], r["cells"]["round_seconds"]) for r in rows],  # one round: every member has the mean
    }
    for name, pts in series.items():
        ratios = {k: log2_ratio(t, per_group, k) for k, t in pts}
        small = [v for k, v in ratios.items() if 2 * g <= k <= 8 * g]
        later = [v for k, v in ratios.items() if k > 8 * g]
        base = max(small) if small else None
        upper = sorted(ratios)[len(ratios) // 2 :]
        slope = None
        if len(upper) >= 2:
            xs, ys = [math.log2(k) for k in upper], [math.log2(ratios[k]) for k in upper]
            mx, my = statistics.fmean(xs), statistics.fmean(ys)
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
        out[name] = {"ratio": ratios, "max_small": base, "max_later": max(later) if later else None,
                     "slope_upper_half": slope,
                     "holds": None if base is None or not later else all(v <= 1.1 * base for v in later)}
    return out


def main() -> None:
    a = _args()
    exit_on_sigterm()
    from p2ptrain.sim.protocol import MIB, LinkModel, rounds_to_mix
    from p2ptrain.ui import out, table

    peers = sorted({int(x) for x in a.peers.split(",") if x})
    knobs = {"fragment_bytes": a.fragment_mib * MIB, "intra_bandwidth": a.intra_bandwidth,
             "inter_bandwidth": a.inter_bandwidth, "region_bandwidth": a.region_bandwidth,
             "intra_latency": a.intra_latency, "inter_latency": a.inter_latency, "regions": a.regions,
             "stream_cost": a.stream_cost, "jitter_scale": a.jitter, "jitter_sigma": a.jitter_sigma,
             "fail_wait": a.fail_wait}
    link, failing = LinkModel(**knobs), LinkModel(**knobs, fail_prob=a.fail_prob)
    payload: dict[str, Any] = {"args": vars(a), "link": knobs, "model": "p2ptrain/sim/protocol.py"}

    payload["validation"] = _validate(a)
    write_json(a.out, payload)
    payload["grouping_cost"] = _grouping_cost(max(peers), a.group_size)
    write_json(a.out, payload)

    rows: list[dict[str, Any]] = []
    for k in peers:
        t0 = time.perf_counter()
        row = {"k": k, **_one_k(k, a, link, a.trials), "mix_rounds": rounds_to_mix(k, a.group_size, trials=a.mix_trials)}
        row["with_failures"] = _one_k(k, a, failing, a.fail_trials)
        row["model_wall_seconds"] = time.perf_counter() - t0
        rows.append(row)
        payload["rows"] = rows
        write_json(a.out, payload)
        out.print(f"k={k}: {row['model_wall_seconds']:.2f} s", style="dim")
    per_group = _one_k(a.group_size, a, link, a.trials)["flat"]["round_seconds"]
    payload["criterion"] = _criterion(rows, a.group_size, per_group)
    write_json(a.out, payload)

    v = payload["validation"]
    out.print(table("model vs the real butterfly (payload bytes per peer, messages per peer)",
                    ["k", "model bytes", "butterfly", "memory transport", "model streams", "messages", "match"],
                    [[r["k"], r["model_bytes_per_peer"], r["butterfly_bytes_per_peer"],
                      r["memory_transport_bytes"], r["model_streams"], r["butterfly_messages"], r["match"]]
                     for r in v]))
    out.print(table(_title(a), _COLUMNS, [_row(r) for r in rows]))
    out.print(table(f"the same with {a.fail_prob:g} of peers vanishing per round (groups wait {a.fail_wait:g} s)",
                    ["k", "flat s", "bounded s (slowest)", "bounded s (mean group)", "hier s", "cells s"],
                    [[r["k"], r["with_failures"]["flat"]["round_seconds"],
                      r["with_failures"]["bounded"]["round_seconds"], r["with_failures"]["bounded"]["group_seconds"],
                      r["with_failures"]["hierarchical"]["round_seconds"], r["with_failures"]["cells"]["round_seconds"]]
                     for r in rows]))
    c = payload["criterion"]
    over = [r for r in rows if r["cells"]["extra"].get("carriers_over_G")]
    payload["cells_limit"] = {"G": a.cell_size, "G_squared": a.cell_size ** 2, "k_with_carriers_over_G":
                              [r["k"] for r in over], "note": "the product does not recurse: for C > G (k > G^2 in "
                              "one region) step 2 is one butterfly of C > G carriers, modelled as such"}
    write_json(a.out, payload)
    out.print(table(f"O(log k): T(k) / (T_G · log2 k), T_G = {per_group:.2f} s (flat round of G={a.group_size})",
                    ["k", "flat", "bounded round", "bounded to mix", "hier", "cells"],
                    [[r["k"], *(c[s]["ratio"][r["k"]] for s in _SERIES)] for r in rows]))
    out.print("holds (ratio(k) <= 1.1 × max ratio over 2G..8G, for every k > 8G): " +
              ", ".join(f"{s} {c[s]['holds']}" for s in _SERIES))
    out.print(table(f"cells (G = {a.cell_size}): the plan net/hierarchy.py makes",
                    ["k", "plan", "cells C", "shards S", "largest cell", "C > G", "peers/member",
                     "(fragment bytes only)", "digest B/region across"],
                    [[r["k"], r["cells"]["extra"]["plan"], r["cells"]["extra"]["cells"], r["cells"]["extra"]["shards"],
                      r["cells"]["extra"]["cell_size_max"], r["cells"]["extra"].get("carriers_over_G", False),
                      r["cells"]["peers_per_peer"], r["cells"]["extra"].get("peers_max_without_digests", "-"),
                      r["cells"]["extra"]["digest_bytes_per_region"]] for r in rows]))
    out.print(f"model limit: the product does not recurse, so for k > G² = {a.cell_size ** 2} (or C > G with many "
              "regions) step 2 is a butterfly of more than G carriers; the model runs it as one "
              f"({'reached at k = ' + ', '.join(str(r['k']) for r in over) if over else 'not reached here'}).")
    gc = payload["grouping_cost"]
    out.print(f"split_groups over {gc['k']} members: {gc['split_groups_ms']:.2f} ms; group_of {gc['group_of_ms']:.2f} ms")
    try:
        _plot(rows, c, a, a.out.with_suffix(".png"))
    except ImportError as e:
        out.print(f"no plot: {e}")


_SERIES = ("flat", "bounded_round", "bounded_to_mix", "hierarchical", "cells")
_COLUMNS = ["k", "flat s", "bounded s", "(mean group)", "hier s", "cells s", "MiB/peer flat", "bounded", "hier",
            "cells", "cross MiB/region flat", "bounded", "hier", "cells", "streams/peer flat", "bounded", "hier",
            "cells", "peers/peer flat", "bounded", "hier", "cells", "buffers MiB", "mix rounds"]


def _title(a: argparse.Namespace) -> str:
    return (f"one round of a {a.fragment_mib:g} MiB fragment: {a.regions} regions, G={a.group_size}, "
            f"cells of ≤ {a.cell_size}, {a.trials} trials (model)")


def _row(r: dict[str, Any]) -> list[Any]:
    f, b, h, c = r["flat"], r["bounded"], r["hierarchical"], r["cells"]
    mib = 2**20
    four = (f, b, h, c)
    return [r["k"], f["round_seconds"], b["round_seconds"], b["group_seconds"], h["round_seconds"], c["round_seconds"],
            *(x["bytes_sent_per_peer"] / mib for x in four), *(x["inter_bytes_per_region"] / mib for x in four),
            *(x["streams_per_peer"] for x in four), *(x["peers_per_peer"] for x in four),
            max(x["buffer_bytes"] for x in four) / mib, r["mix_rounds"]]


_COLOR = {"flat": "tab:blue", "bounded": "tab:orange", "hierarchical": "tab:green", "cells": "tab:red"}
_STYLES = (("flat", "o-"), ("bounded", "s-"), ("hierarchical", "^-"), ("cells", "D-"))


def _plot(rows: list[dict[str, Any]], c: dict[str, Any], a: argparse.Namespace, path: Path) -> None:
    from p2ptrain.plot import pyplot

    plt = pyplot()
    ks = [r["k"] for r in rows]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ax = axes[0][0]
    for name, style in _STYLES:
        ax.plot(ks, [r[name]["round_seconds"] for r in rows], style, color=_COLOR[name], label=name)
    ax.plot(ks, [r["bounded"]["group_seconds"] for r in rows], "s--", color=_COLOR["bounded"],
            label="bounded (mean group)")
    ax.plot(ks, [r["mix_rounds"] * r["bounded"]["round_seconds"] for r in rows], "s:", color=_COLOR["bounded"],
            label="bounded × rounds to mix")
    ax.set_title("round time, seconds (model)")
    ax.set_yscale("log")
    ax = axes[0][1]
    for name, style in _STYLES:
        ax.plot(ks, [r[name]["inter_bytes_per_region"] / 2**20 for r in rows], style, color=_COLOR[name],
                label=f"{name}: cross/region")
        ax.plot(ks, [r[name]["bytes_sent_per_peer"] / 2**20 for r in rows], style.replace("-", "--"),
                color=_COLOR[name], label=f"{name}: sent/peer")
    ax.set_yscale("log")
    ax.set_title("MiB per round")
    ax = axes[1][0]
    for name, style in _STYLES:
        ax.plot(ks, [r[name]["streams_per_peer"] for r in rows], style, color=_COLOR[name], label=f"{name}: streams")
        ax.plot(ks, [r[name]["peers_per_peer"] for r in rows], style.replace("-", ":"), color=_COLOR[name],
                label=f"{name}: distinct peers")
    ax.set_yscale("log")
    ax.set_title("streams and distinct peers per peer per round")
    ax = axes[1][1]
    for name, style in (("flat", "o-"), ("bounded_round", "s-"), ("bounded_to_mix", "s:"), ("hierarchical", "^-"),
                        ("cells", "D-")):
        ax.plot(ks, [c[name]["ratio"][k] for k in ks], style, color=_COLOR[name.split("_")[0]], label=name)
    ax.set_title(f"T(k) / (T_G · log2 k), T_G = {c['per_group_seconds']:.2f} s")
    for ax in axes.flat:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("peers k")
        ax.legend(fontsize=7)
    fig.suptitle(f"protocol model: F = {a.fragment_mib:g} MiB, {a.regions} regions, G = {a.group_size} "
                 f"(bounded), cells of ≤ {a.cell_size} (what the product runs)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
