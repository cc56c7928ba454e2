"""Hierarchical rounds against flat ones: 2 regions × 3 peers on the testbed, a slow link between the regions.

    python bench/hierarchy.py                                      # diloco, tiny, 10 Mbit/s between regions
    python bench/hierarchy.py --between-rate 10mbit --max-minutes 5 --H 10 --repeats 2

The testbed (bench/testbed.py): regions ``us`` and ``eu``, three peers each (plus the bootstrap node on a fourth
``us`` host), every host on its own ``--host-rate`` link (1 Gbit/s), each region's uplink shaped to
``--between-rate`` with half of ``--delay-ms`` one way. The same swarm runs twice in turn, ``hierarchical`` (the
default: peers announce their region, net/hierarchy.py) and ``flat`` (``--flat-rounds``: one butterfly over all six),
``--repeats`` times, alternating which goes first.

Reported per run: bytes that left each region over its uplink (``tx_bytes`` of the gateway's uplink: payload,
framing, DHT and TCP/IP headers) per round, against one fragment (the model in the wire codec); rounds done;
the validation loss of θ over training time and the time to a target loss (the higher of the two variants' final
losses, so both reach it). Goal (issue 20): inter-region bytes per round per region ≈ one fragment (±10%), and the
time to the target loss ≥ 1.5× shorter than flat. Writes bench/results/hierarchy.json after every run, a table and
hierarchy.png (loss of θ against time).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import (
    RESULTS,
    PeerLaunch,
    exit_on_sigterm,
    fresh_start_args,
    join_argv,
    machine,
    median,
    run_swarm,
    summarize,
    time_to_target,
    val_curve,
    write_json,
)
from bench.testbed import RegionSpec, Testbed, TestbedSpec, parse_rate, unavailable_reason

REGIONS = ("us", "eu")
PEERS = 3
BOOT = "us3"
VARIANTS = ("hierarchical", "flat")


def testbed_spec(a: argparse.Namespace) -> TestbedSpec:
    host, up = parse_rate(a.host_rate), parse_rate(a.between_rate)
    return TestbedSpec(regions=tuple(RegionSpec(name=r, hosts=PEERS + (1 if r == "us" else 0), host_rate=host,
                                                uplink_rate=up, delay_ms=a.delay_ms / 2) for r in REGIONS))


def uplink_tx(tb: Testbed, region: str) -> int | None:
    """Bytes the region's gateway sent over its uplink (to the other region and the core)."""
    try:
        out = subprocess.run(["ip", "-n", f"{tb.tag}-gw-{region}", "-s", "-j", "link", "show", "dev", "uplink"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])
    except (subprocess.SubprocessError, OSError, ValueError, KeyError, IndexError):
        return None


def fragment_bytes(preset: str, codec: str) -> int:
    """One fragment on the wire: diloco sends the whole model (P = 1)."""
    from p2ptrain.collective.codecs import get_codec
    from p2ptrain.model import GPT, PRESETS

    n = sum(p.numel() for p in GPT(PRESETS[preset]).parameters())
    return get_codec(codec).encoded_size(n)


def run_variant(variant: str, a: argparse.Namespace, work: Path, n: int) -> dict[str, Any]:
    tag = f"{variant}-{n}"
    extra = ["--join-window", str(a.join_window), "--eval-every", str(a.eval_every), "--codec", a.codec,
             "--min-step-seconds", str(a.step_seconds), "--clock", a.clock,
             *fresh_start_args(work), *(["--flat-rounds"] if variant == "flat" else [])]
    launches = [PeerLaunch(join_argv(a.method, preset=a.preset, steps=a.steps, batch_size=a.batch_size, H=a.H,
                                     step_seconds=a.step_seconds, run_id=f"hier-{tag}-{os.getpid()}", region=r,
                                     extra=extra), host=f"{r}{i}", name=f"{tag}-{r}{i}")
                for i in range(PEERS) for r in REGIONS]
    with Testbed(testbed_spec(a)) as tb:
        before = {r: uplink_tx(tb, r) for r in REGIONS}
        t0 = time.monotonic()
        run = run_swarm(launches, work=work / tag, tb=tb, boot_host=BOOT, deadline=60 * a.max_minutes)
        after = {r: uplink_tx(tb, r) for r in REGIONS}
    s = summarize(run)
    sums = [x for x in run.summaries if x is not None]
    rounds = median([float(x["rounds_complete"] + x["rounds_partial"]) for x in sums]) if sums else float("nan")
    crossed = {r: (after[r] - before[r]) if after[r] is not None and before[r] is not None else None
               for r in REGIONS}
    per_round = {r: c / rounds if c is not None and rounds else None for r, c in crossed.items()}
    curves = [val_curve(x) for x in sums if x.get("val_log")]
    return {"variant": variant, "repeat": n, "wall_seconds": time.monotonic() - t0, "rounds": rounds,
            "rounds_partial": sum(x["rounds_partial"] for x in sums), "rounds_failed": sum(x["rounds_failed"] for x in sums),
            "uplink_tx_bytes": crossed, "uplink_bytes_per_round": per_round, "curves": curves,
            "final_val_loss": median([c[-1][1] for c in curves if c]),
            "loop_seconds": median([float(x.get("loop_seconds", 0.0)) for x in sums]),
            "summary": {k: v for k, v in s.items() if not isinstance(v, (list, dict))}, "logs": str(work / tag)}


def _plot(runs: list[dict[str, Any]], path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {"hierarchical": "tab:blue", "flat": "tab:red"}
    for r in runs:
        for i, c in enumerate(r["curves"][:1]):  # one peer per run: θ is the same on every peer
            ax.plot([t for t, _ in c], [x for _, x in c], color=colors[r["variant"]], alpha=0.8,
                    label=f"{r['variant']} (run {r['repeat']})" if i == 0 else None)
    ax.set_xlabel("training seconds")
    ax.set_ylabel("validation loss of θ")
    ax.set_title(title, fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="diloco")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--codec", default="fp32")
    ap.add_argument("--steps", type=int, default=5000, help="inner steps per peer (at most: --max-minutes ends the run)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--H", type=int, default=10)
    ap.add_argument("--step-seconds", type=float, default=0.5,
                    help="every inner step takes this long (padded: a GPU's step, longer than one of six CPU peers'), "
                         "and the rounds are paced by it")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--host-rate", default="1gbit")
    ap.add_argument("--between-rate", default="10mbit")
    ap.add_argument("--delay-ms", type=float, default=100.0, help="one-way delay between the regions")
    ap.add_argument("--clock", default="steps", choices=("steps", "wall"),
                    help="steps: every round waits for the slowest peer, as a blocking diloco round is meant to (wall "
                         "pacing with rounds longer than H steps has peers reach a round far apart: measured, most "
                         "rounds then fail to form, flat or not)")
    ap.add_argument("--join-window", type=float, default=30.0,
                    help="generous: six peers on two shared cores reach a round seconds apart (at 10 s most "
                         "rounds lost members in a smoke run, flat or not)")
    ap.add_argument("--max-minutes", type=float, default=5.0, help="training time per run (then the peers leave)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "hierarchy.json")
    a = ap.parse_args()
    exit_on_sigterm()
    if (reason := unavailable_reason()) is not None:
        raise SystemExit(f"testbed unavailable: {reason}")
    from p2ptrain.ui import console, out, table

    work = Path(tempfile.mkdtemp(prefix="p2ptrain-hier-"))
    frag = fragment_bytes(a.preset, a.codec)
    command = " ".join(["python bench/hierarchy.py", *sys.argv[1:]])
    runs: list[dict[str, Any]] = []
    report: dict[str, Any] = {"command": command, "args": vars(a) | {"out": str(a.out)}, "machine": machine(),
                              "fragment_bytes": frag, "runs": runs}
    for n in range(a.repeats):
        for variant in (VARIANTS if n % 2 == 0 else VARIANTS[::-1]):
            console.print(f"[bold]{variant}[/] (run {n}): 2 regions × {PEERS} peers, {a.between_rate} between them",
                          highlight=False)
            runs.append(run_variant(variant, a, work, n))
            r = runs[-1]
            console.print(f"  {r['rounds']:.0f} rounds, uplink bytes/round {r['uplink_bytes_per_round']}, "
                          f"final val loss {r['final_val_loss']:.3f}, {r['wall_seconds']:.0f} s", highlight=False)
            write_json(a.out, report)
    finals = [r["final_val_loss"] for r in runs if r["final_val_loss"] == r["final_val_loss"]]
    target = round(max(finals) + 0.005, 3) if finals else float("nan")
    for r in runs:
        times = [t for t in (time_to_target(c, target) for c in r["curves"]) if t is not None]
        r["time_to_target"] = median(times) if times else None
        r["bytes_per_round_over_fragment"] = {k: v / frag if v is not None else None
                                              for k, v in r["uplink_bytes_per_round"].items()}
    by = {v: [r for r in runs if r["variant"] == v] for v in VARIANTS}
    tt = {v: median([r["time_to_target"] for r in rs if r["time_to_target"] is not None]) for v, rs in by.items()}
    ratio = {v: median([x for r in rs for x in r["bytes_per_round_over_fragment"].values() if x is not None])
             for v, rs in by.items()}
    speedup = tt["flat"] / tt["hierarchical"] if tt["hierarchical"] and tt["hierarchical"] == tt["hierarchical"] else None
    report["target_loss"] = target
    report["verdict"] = {
        "uplink_bytes_per_round_over_fragment": ratio,
        "bytes_within_10pct": abs(ratio["hierarchical"] - 1.0) <= 0.10 if ratio["hierarchical"] == ratio["hierarchical"] else None,
        "time_to_target": tt, "speedup": speedup, "speedup_ge_1_5": speedup is not None and speedup >= 1.5}
    write_json(a.out, report)
    _plot(runs, a.out.with_suffix(".png"), f"{a.method} {a.preset}, 2 regions × {PEERS} peers, {a.between_rate} "
                                           f"between regions, {a.delay_ms:g} ms")
    rows = [[r["variant"], r["repeat"], f"{r['rounds']:.0f}", r["rounds_partial"], r["rounds_failed"],
             *[f"{r['bytes_per_round_over_fragment'][g]:.2f}" if r["bytes_per_round_over_fragment"][g] is not None
               else "-" for g in REGIONS],
             f"{r['final_val_loss']:.3f}", f"{r['time_to_target']:.0f}" if r["time_to_target"] else "-"] for r in runs]
    out.print(table("hierarchical vs flat rounds", ["variant", "run", "rounds", "partial", "failed", *[f"{g} uplink/round ÷ fragment" for g in REGIONS],
               "final val loss", f"s to {target}"], rows))
    console.print(f"verdict: {report['verdict']}", highlight=False)


if __name__ == "__main__":
    main()
