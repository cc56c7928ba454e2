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
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import time_to_target
from bench.md_blocks import put_block
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
    """(label, method, peers) of every run: each method's defaults unless the label says, except that streaming
    at τ = 5 and every cocodc run use η 0.4 (streaming's default when they were first run; the comparisons
    between them are at equal η)."""
    eta = 0.4
    return [
        ("single", DDPConfig(), 1),
        ("diloco", DiLoCoConfig(H=H), None),
        ("streaming τ=1 (η 0.4)", StreamingConfig(H=H, P=P, tau=1, outer_lr=0.4), None),
        ("streaming τ=1 (η 0.7)", StreamingConfig(H=H, P=P, tau=1, outer_lr=0.7), None),
        ("streaming τ=5", StreamingConfig(H=H, P=P, tau=5, outer_lr=eta), None),
        ("streaming τ=5, take θ̃ (α 0)", StreamingConfig(H=H, P=P, tau=5, alpha=0.0, outer_lr=eta), None),
        ("cocodc τ=5", CoCoDCConfig(H=H, P=P, tau=5, sends_per_window=P, outer_lr=eta), None),
        ("cocodc τ=5, Taylor λ=1000", CoCoDCConfig(H=H, P=P, tau=5, sends_per_window=P, lambda0=1000.0,
                                                   outer_lr=eta), None),
        ("cocodc τ=5, N from the link", CoCoDCConfig(H=H, P=P, tau=5, outer_lr=eta), None),
        ("cocodc τ=1, N=P", CoCoDCConfig(H=H, P=P, tau=1, sends_per_window=P, outer_lr=eta), None),
        ("cocodc τ=1, N=H", CoCoDCConfig(H=H, P=P, tau=1, sends_per_window=H, outer_lr=eta), None),
        ("cocodc τ=1, N=2P, drift", CoCoDCConfig(H=H, P=P, tau=1, sends_per_window=2 * P, outer_lr=eta), None),
        ("cocodc τ=1, N=2P, round-robin", CoCoDCConfig(H=H, P=P, tau=1, sends_per_window=2 * P,
                                                       choice="round-robin", outer_lr=eta), None),
        ("eager", EagerConfig(H=H, variant="eager"), None),
        ("eager naive", EagerConfig(H=H, variant="naive"), None),
        ("dilocox", DiLoCoXConfig(H=H), None),
        # the delayed methods with a shorter outer memory (μ 0.5): is the papers' μ 0.9 what hurts them?
        ("diloco (μ 0.5)", DiLoCoConfig(H=H, outer_momentum=0.5), None),
        ("eager (μ 0.5)", EagerConfig(H=H, variant="eager", outer_momentum=0.5), None),
        ("eager naive (μ 0.5)", EagerConfig(H=H, variant="naive", outer_momentum=0.5), None),
    ]


def _key(label: str, seed: int) -> str:
    return f"{label} | seed {seed}"


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    record: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {}
    record.setdefault("runs", {})
    record.update({"command": "python bench/long_runs.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
        if k not in ("out", "md", "report", "methods_md", "merge", "only", "compare") and v is not None),
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
            if key in record["runs"] or (args.only and label not in args.only.split(";")):
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
    """The inner step at which a run's evaluations ``[(step, sim seconds, loss), ...]`` reach ``target``."""
    return time_to_target([(step, loss) for step, _, loss in evals], target)


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
    verdicts: list[str] = []

    def both(a: str, b: str) -> list[int]:
        return [s for s in seeds if s in by.get(a, {}) and s in by.get(b, {})]

    def gap(a: str, b: str) -> tuple[float, str] | None:
        """a's final loss relative to b's, paired by seed: (mean, 'mean ± sd; per seed')."""
        xs = [by[a][s]["final_val_loss"] / by[b][s]["final_val_loss"] - 1 for s in both(a, b)]
        if not xs:
            return None
        sd = f" ± {statistics.stdev(xs):.1%}" if len(xs) > 1 else ""
        return statistics.mean(xs), f"{statistics.mean(xs):+.2%}{sd} over {len(xs)} seed{'s' if len(xs) > 1 else ''} [" + ", ".join(
            f"{x:+.1%}" for x in xs) + "]"

    def claim(text: str, got: tuple[bool, str] | None) -> None:
        verdicts.append(f"- {text}: " + ("not measured" if got is None else
                                          f"**{'holds' if got[0] else 'does not hold'}** ({got[1]})"))

    def loss_claim(text: str, a: str, b: str, ok: Callable[[float], bool]) -> None:
        g = gap(a, b)
        claim(text, None if g is None else (ok(g[0]), f"{a} vs {b}: {g[1]}"))

    loss_claim("diloco beats one worker at equal inner steps per worker", "diloco", "single", lambda g: g < 0)
    for lbl in ("streaming τ=1 (η 0.4)", "streaming τ=1 (η 0.7)"):
        loss_claim(f"{lbl} within 2% of diloco's final loss", lbl, "diloco", lambda g: g <= 0.02)

    def steps_claim() -> tuple[bool, str] | None:
        a, b = "cocodc τ=5", "streaming τ=5"
        ss = both(a, b)
        if not ss:
            return None
        # the target: streaming's own final loss, seed by seed; cocodc must get there in ≤ 85% of the steps
        pairs = [(_to_target(by[a][s]["evals"], by[b][s]["final_val_loss"]),
                  _to_target(by[b][s]["evals"], by[b][s]["final_val_loss"])) for s in ss]
        ratios = [x / y if x is not None and y else math.inf for x, y in pairs]
        shown = ", ".join("never" if not math.isfinite(r) else f"{r:.2f}" for r in ratios)
        mean = statistics.mean(ratios)
        return mean <= 0.85, f"cocodc's steps to streaming's final loss / streaming's: {shown} (mean {mean:.2f})"

    claim("cocodc needs ≥ 15% fewer steps than streaming to the same loss at τ = 5 (N = P, equal bytes)",
          steps_claim())
    loss_claim("cocodc's delta rule ends no worse than streaming's α-merge (τ = 5, N = P, equal bytes)",
               "cocodc τ=5", "streaming τ=5", lambda g: g <= 0)
    loss_claim("the delta rule ends below taking θ̃ (τ = 5, equal bytes)", "cocodc τ=5", "streaming τ=5, take θ̃ (α 0)",
               lambda g: g < 0)
    loss_claim("the best Taylor λ of the instrument ends below the delta rule (τ = 5)",
               "cocodc τ=5, Taylor λ=1000", "cocodc τ=5", lambda g: g < 0)
    loss_claim("cocodc with N from the link ends no worse than streaming (τ = 5) at equal or more bytes",
               "cocodc τ=5, N from the link", "streaming τ=5", lambda g: g <= 0)
    loss_claim("cocodc with N = H ends no worse than with N = P (τ = 1; more syncs, more bytes)",
               "cocodc τ=1, N=H", "cocodc τ=1, N=P", lambda g: g <= 0)
    loss_claim("the drift ranking beats round-robin at the same N and bytes (τ = 1, N = 2P)",
               "cocodc τ=1, N=2P, drift", "cocodc τ=1, N=2P, round-robin", lambda g: g < 0)
    loss_claim("eager within 1% of diloco", "eager", "diloco", lambda g: g <= 0.01)
    loss_claim("eager clearly (> 1%) ahead of naive delayed", "eager", "eager naive", lambda g: g < -0.01)
    loss_claim("with μ 0.5: eager within 1% of diloco", "eager (μ 0.5)", "diloco (μ 0.5)", lambda g: g <= 0.01)
    loss_claim("with μ 0.5: eager clearly (> 1%) ahead of naive delayed", "eager (μ 0.5)", "eager naive (μ 0.5)",
               lambda g: g < -0.01)

    def dilocox() -> tuple[bool, str] | None:
        g = gap("dilocox", "diloco")
        if g is None:
            return None
        ratio = statistics.mean(r["bytes_sent_per_peer"] for r in by["diloco"].values()) / statistics.mean(
            r["bytes_sent_per_peer"] for r in by["dilocox"].values())
        return ratio >= 10 and g[0] <= 0.03, f"{ratio:.0f}× fewer bytes, loss {g[1]}"

    claim("dilocox ≥ 10× fewer bytes than diloco at ≤ 3% loss", dilocox())

    def delay_cost() -> tuple[bool, str] | None:
        ss = both("eager naive", "diloco")
        if not ss:
            return None
        H = int(record.get("H", 12))
        last = min(by["diloco"][s]["evals"][-1][0] for s in ss)
        parts = []
        for rounds in (10, 25, 50, 100, 200):
            if rounds * H > last:
                break
            gaps = [_loss_at(by["eager naive"][s]["evals"], rounds * H) / _loss_at(by["diloco"][s]["evals"],
                                                                                    rounds * H) - 1 for s in ss]
            parts.append(f"{rounds} rounds {statistics.mean(gaps):+.1%}")
        return True, "naive delayed vs diloco at " + "; ".join(parts)

    claim("the one-round delay's cost as rounds grow (a measurement, not a goal)", delay_cost())
    return f"seeds {seeds}", rows, verdicts


def plot(record: dict[str, Any], png: Path) -> None:
    """Validation loss of θ against the inner step, the mean over seeds of each run (the tail, where they part)."""
    from p2ptrain.plot import pyplot

    plt = pyplot()

    by: dict[str, list[list[list[float]]]] = {}
    for r in record["runs"].values():
        by.setdefault(r["label"], []).append(r["evals"])
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    colors = plt.get_cmap("tab20").colors
    finals = []
    for i, (label, runs_) in enumerate(by.items()):
        n = min(len(e) for e in runs_)
        xs = [runs_[0][j][0] for j in range(n)]
        ys = [statistics.mean(e[j][2] for e in runs_) for j in range(n)]
        finals.append(ys[-1])
        start = n // 4  # the first quarter is where every run falls fast; the differences are at the end
        for ax in axes:
            ax.plot(xs[start:], ys[start:], label=label, color=colors[i % len(colors)],
                    linestyle="--" if "cocodc" in label else "-")
    low = min(finals)
    axes[1].set_ylim(low * 0.98, low * 1.2)  # the methods within 20% of the best, where they part
    axes[0].set_title(f"long runs: {record.get('corpus', '')[:48]}", fontsize=9)
    axes[1].set_title("zoom: within 20% of the best final loss", fontsize=9)
    for ax in axes:
        ax.set_xlabel("inner step (per peer)")
        ax.set_ylabel("validation loss of θ (mean over seeds)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def _status(verdict: str) -> tuple[str, str]:
    """(claim, holds / does not hold / not measured) of a verdict line."""
    claim, _, rest = verdict[2:].partition(": ")
    return claim, ("not measured" if rest.startswith("not measured") else
                   "does not hold" if rest.startswith("**does not hold") else "holds")


def changed_claims(verdicts: list[str], other: list[str]) -> list[str]:
    """The claims whose verdict differs between two reports (both measured)."""
    mine = dict(_status(v) for v in verdicts)
    theirs = dict(_status(v) for v in other)
    return [f"{c}: {mine[c]} here, {theirs[c]} there" for c in mine
            if c in theirs and "not measured" not in (mine[c], theirs[c]) and mine[c] != theirs[c]]


def write_report(record: dict[str, Any], md: Path, methods_md: Path | None, compare: Path | None = None) -> None:
    """Print the table and verdicts, write ``md`` and a plot next to it, and the same section into
    ``methods_md`` (a block named after ``md``, kept when bench/methods.py rewrites the rest). ``compare``:
    another run's JSON (another corpus or seeds); the claims whose verdict differs there are listed."""
    seeds, rows, verdicts = report(record)
    if compare is not None:
        other = json.loads(compare.read_text())
        changed = changed_claims(verdicts, report(other)[2])
        verdicts = [*verdicts, f"- on `{other.get('corpus', compare.name)}` "
                    f"({other.get('command', '')}): " + ("every claim measured there has the same verdict" if not
                                                          changed else "changed: " + "; ".join(changed))]
    cols = ["run", "seeds", "final val loss of θ", "steps to the single worker's final loss", "MB sent per peer",
            "syncs"]
    out.print(table(f"long runs ({seeds})", cols, rows))
    for v in verdicts:
        out.print(v, highlight=False)
    png = md.with_suffix(".png")
    plot(record, png)
    rounds = record.get("rounds_per_fragment") or next(iter(record["runs"].values()))["rounds_per_fragment"]
    lines = [f"## Long runs, {rounds} rounds per fragment — `{record.get('command', 'python bench/long_runs.py')}`",
             "", "These supersede the 10-round figures above where they differ: those ran cocodc with the normalised "
             "Taylor term (λ0 0.2) since removed, and dilocox with the rank read from the projected update.", "",
             f"Machine: {record.get('machine', '?')}. Corpus: {record.get('corpus', '?')}. {seeds}; mean ± "
             "standard deviation over seeds; claims compare runs seed by seed (the same batches). The target of the "
             "steps column is each seed's single-worker final loss."
             + ("".join(f" Merged from `{c}`." for c in record.get("merged", []))), "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", "### Claims", "", *verdicts, "", f"![long runs]({png.name})", ""]
    md.write_text("\n".join(lines))
    if methods_md is not None:
        put_block(methods_md, md.stem, "\n".join(lines))


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
    ap.add_argument("--merge", default=None,
                    help="Add the runs of these JSON files (comma-separated; e.g. other seeds run in parallel) to --out.")
    ap.add_argument("--compare", type=Path, default=None,
                    help="Another run's JSON (another corpus): list the claims whose verdict differs there.")
    ap.add_argument("--only", default=None, help="Only these runs (labels separated by ';').")
    ap.add_argument("--data", default=None, help="A corpus (default: the built-in one).")
    ap.add_argument("--out", type=Path, default=RESULTS / "long_runs.json")
    ap.add_argument("--md", type=Path, default=None, help="The report (default: the JSON's name with .md).")
    ap.add_argument("--report", action="store_true", help="Only rewrite the report from the JSON.")
    ap.add_argument("--methods-md", type=Path, default=RESULTS / "methods.md",
                    help="The methods report to put this section in ('' for none).")
    args = ap.parse_args()
    md = args.md or args.out.with_suffix(".md")
    if args.merge:
        record = json.loads(args.out.read_text())
        for other in args.merge.split(","):
            extra = json.loads(Path(other).read_text())
            for key, run in extra["runs"].items():
                record["runs"].setdefault(key, run)
            record.setdefault("merged", []).append(extra.get("command", other))
        args.out.write_text(json.dumps(record, indent=1))
    record = json.loads(args.out.read_text()) if args.report or args.merge else run_all(args)
    record.setdefault("H", args.H)
    write_report(record, md, args.methods_md if str(args.methods_md) not in ("", ".") else None, args.compare)


if __name__ == "__main__":
    main()
