"""Compute utilization and bytes on the wire: 4 real peers in 2 emulated regions, each method,
next to hivemind.Optimizer (delayed parameter updates) on the same links.

    python bench/utilization.py                                   # small preset, every method + hivemind
    python bench/utilization.py --preset tiny --steps 60 --H 20 --step-seconds 1.0 --methods streaming,diloco
    python bench/utilization.py --methods streaming,streaming@2bit,streaming@topk2   # the wire codecs side by side

The testbed (bench/testbed.py): regions ``us`` and ``eu``, two peers each (plus the
bootstrap node on a third ``us`` host); every host has its own ``--host-rate`` link (1 Gbit/s),
and each region's uplink is shaped to ``--between-rate`` (100 Mbit/s) with half of
``--delay-ms`` (100 ms one way between the regions) in the delay relay. For each method a
fresh testbed, a bootstrap node and four peers (``p2ptrain join``, one thread each; the four
share this machine's cores) start together from the shared seeded initialisation (no
start-up state download: see harness.fresh_start_args) and train ``--steps`` inner steps, or
until ``--max-minutes`` pass (then they leave gracefully, SIGTERM).

Reported per method (mean over the peers): compute utilization (compute seconds over the
wall time of the inner-step loop), bytes on the wire per inner step (``tx_bytes`` of the
peer's own link: payload, framing, DHT, TCP/IP headers), payload bytes per inner step (the
peer's own count of what its all-reduces sent), how many times fewer wire bytes than ``ddp``,
and the validation loss of θ after the steps it took. ``hivemind`` is
bench/hivemind_peer.py: the same model, data and batch, ``hivemind.Optimizer`` with
``delay_optimizer_step=True, delay_grad_averaging=True, use_local_updates=False``.
Writes bench/results/utilization.json and utilization.png, prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
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
    run_swarm,
    summarize,
    write_json,
)
from bench.testbed import RegionSpec, Testbed, TestbedSpec, parse_rate, unavailable_reason

HOSTS = [("us0", "us"), ("us1", "us"), ("eu0", "eu"), ("eu1", "eu")]
BOOT = "us2"


def testbed_spec(a: argparse.Namespace) -> TestbedSpec:
    """us (2 peers + the bootstrap host) and eu (2 peers), ``delay_ms`` one way between them."""
    host, up = parse_rate(a.host_rate), parse_rate(a.between_rate)
    return TestbedSpec(regions=(RegionSpec(name="us", hosts=3, host_rate=host, uplink_rate=up, delay_ms=a.delay_ms / 2),
                                RegionSpec(name="eu", hosts=2, host_rate=host, uplink_rate=up,
                                           delay_ms=a.delay_ms / 2)))


def launches(method: str, a: argparse.Namespace, run_id: str, work: Path) -> list[PeerLaunch]:
    if method == "hivemind":
        argv = [sys.executable, str(Path(__file__).with_name("hivemind_peer.py")), "--run-id", run_id, "--preset",
                a.preset, "--steps", str(a.steps), "--batch-size", str(a.batch_size), "--peers", str(len(HOSTS)),
                "--count-bytes-on", "eth0"]
        return [PeerLaunch(argv, host=h, name=f"{method}-{h}") for h, _ in HOSTS]
    method, _, codec = method.partition("@")  # e.g. streaming@topk2: the method with another wire codec
    extra = ["--join-window", str(a.join_window), *fresh_start_args(work), *(["--codec", codec] if codec else []),
             *(["--direct-congestion", a.congestion] if a.congestion else [])]
    return [PeerLaunch(join_argv(method, preset=a.preset, steps=a.steps, batch_size=a.batch_size, H=a.H,
                                 step_seconds=a.step_seconds, run_id=run_id, region=region, tau=a.tau, P=a.P,
                                 extra=extra), host=h, name=f"{method}-{h}") for h, region in HOSTS]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="ddp,diloco,streaming,cocodc,hivemind",
                    help="p2ptrain methods and/or 'hivemind' (the hivemind.Optimizer baseline); METHOD@CODEC runs "
                         "a method with another wire codec, e.g. streaming@topk2,streaming@topk2:0.03")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=24, help="inner steps per peer")
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--H", type=int, default=12, help="inner steps per round (streaming: a multiple of --P)")
    ap.add_argument("--P", type=int, default=4, help="fragments (streaming, cocodc)")
    ap.add_argument("--tau", type=int, default=2, help="overlap τ in logical steps (streaming, cocodc)")
    ap.add_argument("--step-seconds", type=float, default=5.0,
                    help="round pacing: ≈ one peer's inner step time when four share this machine")
    ap.add_argument("--host-rate", default="1gbit", help="each host's own link (inside a region)")
    ap.add_argument("--between-rate", default="100mbit", help="each region's uplink (between the regions)")
    ap.add_argument("--delay-ms", type=float, default=100.0, help="one-way delay between the regions")
    ap.add_argument("--max-minutes", type=float, default=6.0, help="per method: then the peers are asked to leave")
    ap.add_argument("--join-window", type=float, default=12.0,
                    help="p2ptrain peers: seconds a round's leader waits for the live peers; longer than an inner "
                         "step here (join's 2 s default is not: a peer mid-step misses the round)")
    ap.add_argument("--congestion", default=None,
                    help="the direct path's TCP congestion control (e.g. cubic, bbr, system; default: the peers' own, cubic)")
    ap.add_argument("--update", action="store_true",
                    help="keep the other methods' figures already in --out (each keeps the command that made it)")
    ap.add_argument("--out", type=Path, default=RESULTS / "utilization.json")
    a = ap.parse_args()
    exit_on_sigterm()
    if (reason := unavailable_reason()) is not None:
        raise SystemExit(f"testbed unavailable: {reason}")

    from p2ptrain.ui import console, out, table

    spec = testbed_spec(a)
    work = Path(tempfile.mkdtemp(prefix="p2ptrain-util-"))
    report: dict[str, dict[str, Any]] = {}
    if a.update and a.out.exists():
        report = json.loads(a.out.read_text())["methods"]
        for s in report.values():  # figures of an earlier run: keep the command that made them
            s.setdefault("command", json.loads(a.out.read_text())["command"])
    command = " ".join(["python bench/utilization.py", *sys.argv[1:]])
    for method in [m.strip() for m in a.methods.split(",") if m.strip()]:
        console.print(f"[bold]{method}[/]: 4 peers, {a.preset}, up to {a.steps} steps or {a.max_minutes:g} min",
                      highlight=False)
        t0 = time.monotonic()
        with Testbed(spec) as tb:
            tag = method.replace("@", "-").replace(":", "_")
            run = run_swarm(launches(method, a, f"util-{tag}-{os.getpid()}", work), work=work / tag, tb=tb,
                            boot_host=BOOT, deadline=60 * a.max_minutes)
        report[method] = summarize(run) | {"summaries": run.summaries, "wire_tx_bytes": run.wire_tx_bytes,
                                           "command": command, "args": vars(a) | {"out": str(a.out)}}
        s = report[method]
        console.print(f"  {s['peers']} peers, {s.get('steps_mean', 0):.0f} steps, "
                      f"utilization {s.get('utilization_mean', float('nan')):.3f}, "
                      f"{time.monotonic() - t0:.0f} s", highlight=False)
    ddp = report.get("ddp", {}).get("wire_bytes_per_step")
    for s in report.values():
        w = s.get("wire_bytes_per_step")
        s["times_fewer_wire_bytes_than_ddp"] = ddp / w if ddp and w else None
    write_json(a.out, {"args": vars(a) | {"out": str(a.out)}, "testbed": {"regions": [vars(r) for r in spec.regions]}, "methods": report,
                       "logs": str(work)})
    _plot(report, a.out.with_suffix(".png"), a)
    rows = []
    for m, s in report.items():
        if not s.get("peers"):
            rows.append([m, 0, "-", "-", "-", "-", "-", "-", "-", "-"])
            continue
        w, x = s.get("wire_bytes_per_step"), s.get("times_fewer_wire_bytes_than_ddp")
        rows.append([m, s["peers"], f"{s['steps_mean']:.0f}", f"{s['val_loss_mean']:.4f}",
                     f"{s['utilization_mean']:.3f}", "-" if w is None else f"{w / 1e6:.3f}",
                     f"{s['payload_bytes_per_step'] / 1e6:.3f}", "-" if x is None else f"{x:,.0f}×",
                     f"{s['rounds_mean']:.0f}", _round_split(s)])
    out.print(table(f"4 peers in 2 regions ({a.between_rate}, {a.delay_ms:g} ms between; {a.host_rate} inside), "
                    f"{a.preset}, batch {a.batch_size}, H={a.H}",
                    ["method", "peers", "inner steps", "val loss of θ", "compute utilization", "wire MB/step",
                     "payload MB/step", "fewer bytes than ddp", "rounds", "round s: group / all-reduce"], rows))
    out.print(_where_bytes_go(report))


def _round_split(s: dict[str, Any]) -> str:
    """A round's median seconds, and of it forming the group (waiting for the slowest member) and all-reducing."""
    r, g, x = (s.get(k, float("nan")) for k in ("round_seconds_median", "group_seconds_median",
                                                 "allreduce_seconds_median"))
    return "-" if r != r else f"{r:.1f}: {g:.1f} / {x:.1f}"


def _where_bytes_go(report: dict[str, dict[str, Any]]) -> Any:
    """Per method, kB per inner step sent by each message kind (the peers' own counts), their sum, and what the
    link sent beyond it (the DHT, TCP/IP headers, libp2p's and the direct path's framing)."""
    from p2ptrain.ui import table

    kinds = sorted({k for s in report.values() for k in s.get("message_bytes_per_step", {})})
    rows = []
    for m, s in report.items():
        per = s.get("message_bytes_per_step") or {}
        if not per:
            continue
        total, wire = sum(per.values()), s.get("wire_bytes_per_step")
        rows.append([m, *(f"{per.get(k, 0) / 1e3:.1f}" for k in kinds), f"{total / 1e3:.1f}",
                     "-" if wire is None else f"{(wire - total) / 1e3:.1f}"])
    return table("kB sent per inner step, by message kind", ["method", *kinds, "messages", "wire − messages"], rows)


def _plot(report: dict[str, dict[str, Any]], path: Path, a: argparse.Namespace) -> None:
    from p2ptrain.plot import pyplot

    plt = pyplot()

    names = [m for m, s in report.items() if s.get("peers")]
    if not names:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.bar(names, [report[m]["utilization_mean"] for m in names], color="tab:blue")
    ax1.axhline(0.95, color="gray", ls="--", lw=1)
    ax1.set_ylim(0, 1.05)
    ax1.set_ylabel("compute utilization")
    ax2.bar(names, [(report[m].get("wire_bytes_per_step") or 0) / 1e6 for m in names], color="tab:orange")
    ax2.set_yscale("log")
    ax2.set_ylabel("MB on the wire per inner step")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(f"4 peers, 2 regions ({a.between_rate}, {a.delay_ms:g} ms), {a.preset}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
