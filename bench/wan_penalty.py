"""The WAN penalty, the headline number: wall time for 4 peers to reach a target validation loss
in 2 emulated regions (100 Mbit/s and 100 ms between them), divided by the same 4 peers on
unconstrained links, per method, in one run.

    python bench/wan_penalty.py                                   # ddp, diloco, streaming, cocodc; tiny preset
    python bench/wan_penalty.py --methods streaming,cocodc --steps 60 --target 3.2

For each method, two swarms back to back (so both see the same load on this machine), each in
a fresh testbed (bench/testbed.py) with four ``p2ptrain join`` peers (started together from the
shared seeded initialisation, no start-up state download) and a bootstrap node:

* ``lan``: one region of unshaped links (no rate limit, no delay relay);
* ``wan``: regions ``us`` and ``eu`` with two peers each, every region's uplink shaped to
  ``--between-rate`` and ``--delay-ms`` one way between the regions (hosts unshaped inside).

Every peer evaluates θ on the validation set when its loop starts and every ``--eval-every``
inner steps (``p2ptrain join --eval-every``); the time axis is seconds since the peer's
inner-step loop started, without the evaluation pauses. A swarm reaches the target when
every one of its peers has (the latest of the four crossings, each linearly interpolated
between two evaluations). The target, unless ``--target`` is given, is the highest of the
methods' ``lan`` losses at 80% of their steps, so that every method reaches it on unconstrained
links; a ``wan`` run that does not reach it by the deadline gives a lower bound on the ratio.

    python bench/wan_penalty.py --retarget bench/results/wan_penalty.json --targets 3.5,3.0,2.7

recomputes the times and ratios of a saved run at other targets from its stored validation
curves (no swarm is started): a method that hardly learned on ``lan`` drags the default target
up to where every method is still warming up.
Writes bench/results/wan_penalty.json and wan_penalty.png, prints a table.
"""

from __future__ import annotations

import argparse
import math
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
    loss_at_step,
    run_swarm,
    summarize,
    time_to_target,
    val_curve,
    write_json,
)
from bench.testbed import RegionSpec, Testbed, TestbedSpec, parse_rate, unavailable_reason

WAN_HOSTS = [("us0", "us"), ("us1", "us"), ("eu0", "eu"), ("eu1", "eu")]
LAN_HOSTS = [("lan0", "lan"), ("lan1", "lan"), ("lan2", "lan"), ("lan3", "lan")]


def specs(a: argparse.Namespace) -> dict[str, tuple[TestbedSpec, list[tuple[str, str]], str]]:
    """condition → (testbed, peer hosts with their region, bootstrap host)."""
    up = parse_rate(a.between_rate)
    wan = TestbedSpec(regions=(RegionSpec(name="us", hosts=3, uplink_rate=up, delay_ms=a.delay_ms / 2),
                               RegionSpec(name="eu", hosts=2, uplink_rate=up, delay_ms=a.delay_ms / 2)))
    lan = TestbedSpec(regions=(RegionSpec(name="lan", hosts=5),))
    return {"lan": (lan, LAN_HOSTS, "lan4"), "wan": (wan, WAN_HOSTS, "us2")}


def swarm_time_to_target(summaries: list[dict[str, Any] | None], target: float) -> tuple[float | None, list]:
    """(the latest of the peers' crossing times, each peer's), None if any peer never reached ``target``."""
    each = [time_to_target(val_curve(s), target) if s else None for s in summaries]
    done = [t for t in each if t is not None]
    return (max(done) if done and len(done) == len(each) else None), each


def default_target(lan: dict[str, list[dict[str, Any] | None]], fraction: float) -> float:
    """The highest of the methods' ``lan`` val losses at ``fraction`` of their steps (mean over peers)."""
    worst = -math.inf
    for summaries in lan.values():
        losses = [loss_at_step(s, fraction * s["steps"]) for s in summaries if s]
        losses = [x for x in losses if x is not None]
        if losses:
            worst = max(worst, sum(losses) / len(losses))
    if worst == -math.inf:
        raise RuntimeError("no unconstrained run left a validation curve: cannot choose a target")
    return worst


def curves_time_to_target(curves: list[list[list[float]]], target: float) -> float | None:
    """The latest of the peers' crossings of ``target`` on their stored curves; None if one never does."""
    each = [time_to_target([(t, v) for t, v in c], target) for c in curves if c]
    return max(each) if each and None not in each else None  # type: ignore[type-var]


def retarget(path: Path, targets: list[float]) -> None:
    """Times to each target and wan/lan ratios of a saved run (its curves), as a table and in
    ``retargeted`` of the same JSON."""
    import json

    from p2ptrain.ui import out, table

    if not targets:
        raise SystemExit("--retarget needs --targets, e.g. --targets 3.5,3.0")
    saved = json.loads(path.read_text())
    rows, extra = [], {}
    for target in targets:
        for method, r in saved["methods"].items():
            lan, wan = (curves_time_to_target(r["curves"][c], target) for c in ("lan", "wan"))
            ratio = wan / lan if lan and wan else None
            extra.setdefault(f"{target:g}", {})[method] = {"seconds_to_target_lan": lan,
                                                           "seconds_to_target_wan": wan, "ratio": ratio}
            rows.append([f"{target:g}", method, _secs(lan), _secs(wan), "-" if ratio is None else f"{ratio:.3f}×"])
    saved["retargeted"] = extra
    path.write_text(json.dumps(saved, indent=1))
    out.print(table(f"WAN penalty of {path.name} at other targets", ["target", "method", "lan s", "wan s",
                                                                      "wan / lan"], rows))


def _secs(t: float | None) -> str:
    return "not reached" if t is None else f"{t:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="ddp,diloco,streaming,cocodc")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=96, help="inner steps per peer")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--H", type=int, default=12)
    ap.add_argument("--P", type=int, default=4)
    ap.add_argument("--tau", type=int, default=2)
    ap.add_argument("--step-seconds", type=float, default=1.5,
                    help="round pacing: above a peer's inner step time here, so that τ steps cover a round")
    ap.add_argument("--eval-every", type=int, default=12, help="inner steps between evaluations of θ")
    ap.add_argument("--between-rate", default="100mbit")
    ap.add_argument("--delay-ms", type=float, default=100.0, help="one-way delay between the regions")
    ap.add_argument("--target", type=float, default=None, help="target val loss (default: see above)")
    ap.add_argument("--target-fraction", type=float, default=0.8)
    ap.add_argument("--max-minutes", type=float, default=6.0, help="per swarm: then the peers are asked to leave")
    ap.add_argument("--join-window", type=float, default=5.0,
                    help="seconds a round's leader waits for the live peers; longer than an inner step here "
                         "(join's 2 s default is not always: a peer mid-step misses the round)")
    ap.add_argument("--out", type=Path, default=RESULTS / "wan_penalty.json")
    ap.add_argument("--retarget", type=Path, default=None, help="a saved run's JSON: recompute it at --targets")
    ap.add_argument("--targets", default="", help="comma-separated val losses for --retarget")
    a = ap.parse_args()
    if a.retarget is not None:
        retarget(a.retarget, [float(x) for x in a.targets.split(",") if x.strip()])
        return
    exit_on_sigterm()
    if (reason := unavailable_reason()) is not None:
        raise SystemExit(f"testbed unavailable: {reason}")

    from p2ptrain.ui import console, out, table

    work = Path(tempfile.mkdtemp(prefix="p2ptrain-wan-"))
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    window = ["--join-window", str(a.join_window), *fresh_start_args(work)]
    runs: dict[str, dict[str, Any]] = {c: {} for c in ("lan", "wan")}
    figures: dict[str, dict[str, dict[str, Any]]] = {c: {} for c in ("lan", "wan")}
    for method in methods:
        for cond, (spec, hosts, boot) in specs(a).items():
            console.print(f"[bold]{method}[/] on {cond}: 4 peers, {a.preset}, {a.steps} steps", highlight=False)
            t0 = time.monotonic()
            ls = [PeerLaunch(join_argv(method, preset=a.preset, steps=a.steps, batch_size=a.batch_size, H=a.H,
                                       step_seconds=a.step_seconds, run_id=f"wan-{method}-{cond}-{os.getpid()}",
                                       region=region, tau=a.tau, P=a.P,
                                       extra=["--eval-every", str(a.eval_every), *window]), host=h,
                             name=f"{method}-{cond}-{h}")
                  for h, region in hosts]
            with Testbed(spec) as tb:
                run = run_swarm(ls, work=work / f"{method}-{cond}", tb=tb, boot_host=boot,
                                deadline=60 * a.max_minutes)
            runs[cond][method] = run.summaries
            figures[cond][method] = summarize(run)
            console.print(f"  {figures[cond][method]['peers']} peers, {time.monotonic() - t0:.0f} s", highlight=False)
    target = a.target if a.target is not None else default_target(runs["lan"], a.target_fraction)
    rows, report = [], {}
    for method in methods:
        t_lan, each_lan = swarm_time_to_target(runs["lan"][method], target)
        t_wan, each_wan = swarm_time_to_target(runs["wan"][method], target)
        ran_wan = max((s["loop_seconds"] - s.get("eval_seconds", 0.0) for s in runs["wan"][method] if s), default=None)
        ratio = t_wan / t_lan if t_lan and t_wan else None
        bound = ran_wan / t_lan if t_lan and ran_wan and t_wan is None else None
        report[method] = {"seconds_to_target_lan": t_lan, "seconds_to_target_wan": t_wan, "ratio": ratio,
                          "ratio_at_least": bound, "per_peer_lan": each_lan, "per_peer_wan": each_wan,
                          "lan": figures["lan"][method], "wan": figures["wan"][method],
                          "curves": {c: [val_curve(s) if s else [] for s in runs[c][method]] for c in ("lan", "wan")}}
        ratio_s = f"{ratio:.3f}×" if ratio else (f"> {bound:.2f}×" if bound else "-")
        rows.append([method, _secs(t_lan), _secs(t_wan), ratio_s,
                     f"{figures['lan'][method].get('utilization_mean', math.nan):.3f}",
                     f"{figures['wan'][method].get('utilization_mean', math.nan):.3f}",
                     f"{figures['wan'][method].get('val_loss_mean', math.nan):.4f}"])
    write_json(a.out, {"args": vars(a), "target_val_loss": target,
                       "target_rule": "--target" if a.target is not None else
                       f"highest lan val loss at {a.target_fraction:.0%} of the steps", "methods": report,
                       "logs": str(work)})
    _plot(report, target, a.out.with_suffix(".png"))
    out.print(table(f"WAN penalty: time to val loss {target:.4f}, 4 peers, {a.preset}; wan = 2 regions, "
                    f"{a.between_rate} and {a.delay_ms:g} ms between; lan = unshaped",
                    ["method", "lan s", "wan s", "wan / lan", "utilization lan", "utilization wan",
                     "final val loss wan"], rows))


def _plot(report: dict[str, dict[str, Any]], target: float, path: Path) -> None:
    from p2ptrain.plot import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, (method, r) in enumerate(report.items()):
        for cond, ls in (("lan", "-"), ("wan", "--")):
            curve = next((c for c in r["curves"][cond] if c), [])
            if curve:
                ax.plot([t for t, _ in curve], [v for _, v in curve], ls, color=colors[k % len(colors)],
                        label=f"{method} ({cond})")
    ax.axhline(target, color="gray", lw=1, ls=":")
    ax.set_xlabel("seconds of training (peer 0)")
    ax.set_ylabel("validation loss of θ")
    ax.legend(ncol=2, fontsize=8)
    ax.set_title("WAN (dashed) vs unconstrained (solid)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
