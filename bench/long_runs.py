"""The methods on long horizons: ≥ 100 rounds per fragment, several seeds, claims settled with verdicts.

    python bench/long_runs.py                                   # micro preset, 4 peers, 1200 steps, seeds 0,1,2
    python bench/long_runs.py --data /usr/share/perl --out bench/results/long_runs_perl.json   # another corpus
    python bench/long_runs.py --report                          # only rewrite the report from the JSON

Every run is the simulator (the same drivers as a swarm); each (run, seed) is written to the JSON as soon as it
ends, and a run already in the JSON is not run again (so an interrupted benchmark continues where it stopped).
The report (``--md``, default next to the JSON) gives each run's final loss of θ and steps to a target (the
single worker's final loss of the same seed) as mean ± spread over seeds, bytes per peer, and one verdict line
per claim of the papers and issue 16.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from p2ptrain.algo.methods import (
    CoCoDCConfig,
    DDPConfig,
    DiLoCoConfig,
    DiLoCoXConfig,
    EagerConfig,
    MethodConfig,
    StreamingConfig,
)
from p2ptrain.data import DataConfig, load_corpus
from p2ptrain.model import preset
from p2ptrain.sim.runner import RunSpec, SimConfig, Simulator
from p2ptrain.trainer import TrainerConfig
from p2ptrain.ui import out, table

RESULTS = Path(__file__).parent / "results"


def runs(H: int, P: int) -> list[tuple[str, MethodConfig, int | None]]:
    """(label, method, peers) of every run: each method's defaults unless the label says."""
    return [
        ("single", DDPConfig(), 1),
        ("diloco", DiLoCoConfig(H=H), None),
        ("streaming τ=1 (η 0.4)", StreamingConfig(H=H, P=P, tau=1, outer_lr=0.4), None),
        ("streaming τ=1 (η 0.7)", StreamingConfig(H=H, P=P, tau=1, outer_lr=0.7), None),
        ("streaming τ=5", StreamingConfig(H=H, P=P, tau=5), None),
        ("cocodc τ=5", CoCoDCConfig(H=H, P=P, tau=5, sends_per_window=P), None),
        ("cocodc τ=5, N from the link", CoCoDCConfig(H=H, P=P, tau=5), None),
        ("cocodc τ=1, N=H", CoCoDCConfig(H=H, P=P, tau=1, sends_per_window=H), None),
        ("cocodc τ=1, N=2P, drift", CoCoDCConfig(H=H, P=P, tau=1, sends_per_window=2 * P), None),
        ("cocodc τ=1, N=2P, round-robin", CoCoDCConfig(H=H, P=P, tau=1, sends_per_window=2 * P,
                                                       choice="round-robin"), None),
        ("eager", EagerConfig(H=H, variant="eager"), None),
        ("eager naive", EagerConfig(H=H, variant="naive"), None),
        ("dilocox", DiLoCoXConfig(H=H), None),
    ]


def _key(label: str, seed: int) -> str:
    return f"{label} | seed {seed}"


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    record: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {}
    record.setdefault("runs", {})
    record.update({"command": "python bench/long_runs.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
        if k not in ("out", "md", "report") and v is not None),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "H": args.H, "P": args.P})
    model = preset(args.preset)
    sim = SimConfig(peers=args.peers, steps=args.steps, step_time=0.1, eval_every=args.eval_every)
    for seed in [int(s) for s in args.seeds.split(",")]:
        data = DataConfig(path=args.data, seed=seed)
        corpus = load_corpus(data)
        record["corpus"] = corpus.describe()
        trainer = TrainerConfig(batch_size=args.batch_size, total_steps=args.steps, seed=seed)
        simulator = Simulator(sim, model, trainer, data, corpus)
        for label, method, peers in runs(args.H, args.P):
            key = _key(label, seed)
            if key in record["runs"]:
                continue
            t0 = time.perf_counter()
            res = simulator.run(RunSpec(label, method, peers))
            record["runs"][key] = {"label": label, "seed": seed, **res.to_dict(),
                                   "rounds_per_fragment": args.steps // args.H, "run_seconds": time.perf_counter() - t0}
            out.print(f"{key}: final {res.final_loss:.4f}, {res.syncs} syncs, "
                      f"{res.bytes_sent_per_peer / 1e6:.2f} MB/peer, {time.perf_counter() - t0:.0f} s", highlight=False)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(record, indent=1))
    return record


# ---------------------------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------------------------

def _to_target(evals: list[list[float]], target: float) -> float | None:
    prev = None
    for step, _, loss in evals:
        if loss <= target:
            if prev is None or prev[1] == loss:
                return step
            return prev[0] + (prev[1] - target) / (prev[1] - loss) * (step - prev[0])
        prev = (step, loss)
    return None


def _loss_at(evals: list[list[float]], step: float) -> float:
    """The validation loss at ``step`` (the evaluation at or just before it)."""
    best = evals[0][2]
    for s, _, loss in evals:
        if s <= step:
            best = loss
    return best


def _stat(xs: list[float]) -> str:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return "–"
    if len(xs) == 1:
        return f"{xs[0]:.4g}"
    return f"{statistics.mean(xs):.4g} ± {statistics.stdev(xs):.2g}"


def report(record: dict[str, Any]) -> tuple[str, list[list[str]], list[str]]:
    by: dict[str, dict[int, dict[str, Any]]] = {}
    for r in record["runs"].values():
        by.setdefault(r["label"], {})[r["seed"]] = r
    seeds = sorted({s for v in by.values() for s in v})
    targets = {s: by["single"][s]["final_val_loss"] for s in seeds if s in by.get("single", {})}
    rows = []
    for label, per_seed in by.items():
        finals = [r["final_val_loss"] for r in per_seed.values()]
        steps = [_to_target(r["evals"], targets[s]) for s, r in per_seed.items() if s in targets]
        reached = [x for x in steps if x is not None]
        mb = [r["bytes_sent_per_peer"] / 1e6 for r in per_seed.values()]
        rows.append([label, str(len(per_seed)), _stat(finals),
                     _stat(reached) + ("" if len(reached) == len(steps) else f" ({len(steps) - len(reached)} never)"),
                     _stat(mb), _stat([r["syncs"] for r in per_seed.values()])])

    def mean_final(label: str) -> float | None:
        r = by.get(label)
        return statistics.mean(x["final_val_loss"] for x in r.values()) if r else None

    def mean_steps(label: str) -> float | None:
        r = by.get(label)
        if not r:
            return None
        xs = [_to_target(x["evals"], targets[s]) for s, x in r.items() if s in targets]
        return statistics.mean(x if x is not None else math.inf for x in xs) if xs else None

    verdicts: list[str] = []

    def claim(text: str, check: Callable[[], tuple[bool, str] | None]) -> None:
        got = check()
        verdicts.append(f"- {text}: " + ("not measured" if got is None else
                                          f"**{'holds' if got[0] else 'does not hold'}** ({got[1]})"))

    def rel(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else a / b - 1

    claim("diloco beats one worker at equal inner steps per worker", lambda: None if mean_final("diloco") is None
          else (mean_final("diloco") < mean_final("single"),  # type: ignore[operator]
                f"{mean_final('diloco'):.4f} vs {mean_final('single'):.4f}"))
    for lbl in ("streaming τ=1 (η 0.4)", "streaming τ=1 (η 0.7)"):
        claim(f"{lbl} within 2% of diloco's final loss", lambda lbl=lbl: None if rel(mean_final(lbl), mean_final(
            "diloco")) is None else (rel(mean_final(lbl), mean_final("diloco")) <= 0.02,  # type: ignore[operator]
                                     f"{rel(mean_final(lbl), mean_final('diloco')):+.2%}"))
    claim("cocodc needs ≥ 15% fewer steps than streaming to the target at τ = 5", lambda: None if mean_steps(
        "cocodc τ=5") is None or mean_steps("streaming τ=5") is None else (
        mean_steps("cocodc τ=5") <= 0.85 * mean_steps("streaming τ=5"),  # type: ignore[operator]
        f"{mean_steps('cocodc τ=5'):.0f} vs {mean_steps('streaming τ=5'):.0f} steps"))
    claim("cocodc with N from the link ends no worse than streaming (τ = 5) at equal or more bytes", lambda: None
          if rel(mean_final("cocodc τ=5, N from the link"), mean_final("streaming τ=5")) is None else (
        rel(mean_final("cocodc τ=5, N from the link"), mean_final("streaming τ=5")) <= 0.0,  # type: ignore[operator]
        f"{rel(mean_final('cocodc τ=5, N from the link'), mean_final('streaming τ=5')):+.2%}"))
    claim("the drift ranking beats round-robin at the same N (τ = 1, N = 2P)", lambda: None if rel(mean_final(
        "cocodc τ=1, N=2P, drift"), mean_final("cocodc τ=1, N=2P, round-robin")) is None else (
        rel(mean_final("cocodc τ=1, N=2P, drift"), mean_final("cocodc τ=1, N=2P, round-robin")) < 0,  # type: ignore[operator]
        f"{rel(mean_final('cocodc τ=1, N=2P, drift'), mean_final('cocodc τ=1, N=2P, round-robin')):+.2%}"))
    claim("eager within 1% of diloco", lambda: None if rel(mean_final("eager"), mean_final("diloco")) is None else (
        rel(mean_final("eager"), mean_final("diloco")) <= 0.01,  # type: ignore[operator]
        f"{rel(mean_final('eager'), mean_final('diloco')):+.2%}"))
    claim("eager clearly ahead of naive delayed", lambda: None if rel(mean_final("eager"), mean_final(
        "eager naive")) is None else (rel(mean_final("eager"), mean_final("eager naive")) < -0.01,  # type: ignore[operator]
                                      f"{rel(mean_final('eager'), mean_final('eager naive')):+.2%}"))

    def dilocox() -> tuple[bool, str] | None:
        if "dilocox" not in by or "diloco" not in by:
            return None
        ratio = statistics.mean(r["bytes_sent_per_peer"] for r in by["diloco"].values()) / statistics.mean(
            r["bytes_sent_per_peer"] for r in by["dilocox"].values())
        gap = rel(mean_final("dilocox"), mean_final("diloco"))
        assert gap is not None
        return ratio >= 10 and gap <= 0.03, f"{ratio:.0f}× fewer bytes, loss {gap:+.2%}"

    claim("dilocox ≥ 10× fewer bytes than diloco at ≤ 3% loss", dilocox)

    def delay_cost() -> tuple[bool, str] | None:
        if "eager naive" not in by or "diloco" not in by:
            return None
        H = int(record.get("H", 12))
        parts = []
        for rounds in (10, 25, 50, 100):
            gaps = [_loss_at(by["eager naive"][s]["evals"], rounds * H) / _loss_at(by["diloco"][s]["evals"],
                                                                                    rounds * H) - 1
                    for s in seeds if s in by["eager naive"] and s in by["diloco"]]
            if gaps:
                parts.append(f"{rounds} rounds {statistics.mean(gaps):+.1%}")
        return True, "; ".join(parts)

    claim("the one-round delay's cost (naive delayed vs diloco) as rounds grow", delay_cost)
    return f"seeds {seeds}", rows, verdicts


def write_report(record: dict[str, Any], md: Path) -> None:
    seeds, rows, verdicts = report(record)
    cols = ["run", "seeds", "final val loss of θ", "steps to the single worker's final loss", "MB sent per peer",
            "syncs"]
    out.print(table(f"long runs ({seeds})", cols, rows))
    for v in verdicts:
        out.print(v, highlight=False)
    lines = [f"# Long runs — `{record.get('command', 'python bench/long_runs.py')}`", "",
             f"Machine: {record.get('machine', '?')}. Corpus: {record.get('corpus', '?')}. {seeds}; mean ± standard "
             "deviation over seeds. The target is each seed's single-worker final loss.", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", "## Claims", "", *verdicts, ""]
    md.write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="micro")
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--H", type=int, default=12)
    ap.add_argument("--P", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--data", default=None, help="A corpus (default: the built-in one).")
    ap.add_argument("--out", type=Path, default=RESULTS / "long_runs.json")
    ap.add_argument("--md", type=Path, default=None, help="The report (default: the JSON's name with .md).")
    ap.add_argument("--report", action="store_true", help="Only rewrite the report from the JSON.")
    args = ap.parse_args()
    md = args.md or args.out.with_suffix(".md")
    record = json.loads(args.out.read_text()) if args.report else run_all(args)
    record.setdefault("H", args.H)
    write_report(record, md)


if __name__ == "__main__":
    main()
