"""Every outer-loop method side by side on the WAN simulator; writes bench/results/methods.{md,json,png}.

    python bench/methods.py                 # the committed report (tiny preset, M=4, built-in corpus)
    python bench/methods.py --quick         # a 2-minute smoke version (fewer steps, fewer runs)

All runs share seeds and data: every peer i of every method draws the same
batches. θ (the outer parameters of peer 0, after draining in-flight rounds) is
evaluated, not a replica.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.md_blocks import blocks
from p2ptrain.algo.methods import (
    CoCoDCConfig,
    DDPConfig,
    DiLoCoConfig,
    DiLoCoXConfig,
    EagerConfig,
    StreamingConfig,
)
from p2ptrain.data import DataConfig, load_corpus
from p2ptrain.model import preset
from p2ptrain.sim.report import COLUMNS, plot_runs, plot_utilization, summary_rows
from p2ptrain.sim.runner import RunResult, RunSpec, SimConfig, Simulator, replay_utilization
from p2ptrain.sim.utilization import CU_TARGETS, utilization_table
from p2ptrain.trainer import TrainerConfig
from p2ptrain.ui import out, progress_bar, table

RESULTS = Path(__file__).parent / "results"
H, P = 20, 4


MU = 0.5  # outer momentum for every run (see the report: μ = 0.9 is tuned for hundreds of rounds, we run 10)
ETA = 0.7  # outer learning rate for every run (streaming's paper default 0.4 was 2.7% worse here at τ=1)


def specs(quick: bool, with_ddp: bool) -> list[RunSpec]:
    runs = [
        RunSpec("single", DDPConfig(), peers=1),
        RunSpec("diloco", DiLoCoConfig(H=H, outer_momentum=MU, outer_lr=ETA)),
        RunSpec("diloco (paper η 0.7, μ 0.9)", DiLoCoConfig(H=H)),
        RunSpec("streaming τ=1", StreamingConfig(H=H, P=P, tau=1, outer_momentum=MU, outer_lr=ETA)),
        RunSpec("cocodc τ=1", CoCoDCConfig(H=H, P=P, tau=1, sends_per_window=P, outer_momentum=MU, outer_lr=ETA)),
        RunSpec("streaming τ=5", StreamingConfig(H=H, P=P, tau=5, outer_momentum=MU, outer_lr=ETA)),
        RunSpec("cocodc τ=5", CoCoDCConfig(H=H, P=P, tau=5, sends_per_window=P, outer_momentum=MU, outer_lr=ETA)),
        RunSpec("streaming τ=10", StreamingConfig(H=H, P=P, tau=10, outer_momentum=MU, outer_lr=ETA)),
        RunSpec("cocodc τ=10", CoCoDCConfig(H=H, P=P, tau=10, sends_per_window=P, outer_momentum=MU, outer_lr=ETA)),
        RunSpec("cocodc τ=5, adaptive N", CoCoDCConfig(H=H, P=P, tau=5, outer_momentum=MU, outer_lr=ETA)),
        RunSpec("eager naive", EagerConfig(H=H, variant="naive", outer_momentum=MU, outer_lr=ETA)),
        RunSpec("eager", EagerConfig(H=H, variant="eager", outer_momentum=MU, outer_lr=ETA)),
        RunSpec("dilocox", DiLoCoXConfig(H=H, outer_momentum=MU, outer_lr=ETA)),
        RunSpec("dilocox rank 16", DiLoCoXConfig(H=H, outer_momentum=MU, outer_lr=ETA, rank=16, rank_min=16)),
    ]
    if with_ddp:
        runs.insert(1, RunSpec("ddp", DDPConfig(codec="fp32")))
    if quick:
        keep = {"single", "diloco", "streaming τ=5", "cocodc τ=5", "eager naive", "eager", "dilocox"}
        runs = [r for r in runs if r.label in keep]
    return runs


def claims(res: dict[str, RunResult]) -> list[tuple[str, bool | None, str]]:
    """The report's questions, each answered from the measured numbers."""
    out: list[tuple[str, bool | None, str]] = []

    def has(*labels: str) -> bool:
        return all(lbl in res for lbl in labels)

    if has("diloco", "single"):
        d, s = res["diloco"], res["single"]
        steps, _ = d.to_target(s.final_loss)
        out.append(("(1) diloco (M=4) beats one worker at equal inner steps per worker", d.final_loss < s.final_loss,
                    f"final val loss {d.final_loss:.4f} vs {s.final_loss:.4f}; diloco reaches the single worker's "
                    f"final loss after {steps:.0f} of {s.steps} steps" if steps else
                    f"final val loss {d.final_loss:.4f} vs {s.final_loss:.4f}"))
        if has("diloco (paper η 0.7, μ 0.9)"):
            p = res["diloco (paper η 0.7, μ 0.9)"].final_loss
            out.append(("(1b) with the paper's outer momentum μ = 0.9", p < s.final_loss,
                        f"final val loss {p:.4f} (μ 0.9) vs {d.final_loss:.4f} (μ {MU}) vs single {s.final_loss:.4f}"))
    if has("streaming τ=1", "diloco"):
        st, dl = res["streaming τ=1"], res["diloco"]
        ratio = dl.peak_bytes_per_sync / max(st.peak_bytes_per_sync, 1)
        worse = 100.0 * (st.final_loss - dl.final_loss) / dl.final_loss
        out.append(("(2) streaming ≈ diloco loss (at most 2% worse) with ~P× lower peak bytes",
                    worse <= 2.0 and ratio >= P * 0.75,
                    f"loss {st.final_loss:.4f} vs {dl.final_loss:.4f} ({worse:+.1f}%); peak bytes per sync "
                    f"{ratio:.1f}× lower: largest fragment vs whole model ({P} fragments) times 4-bit E3M0 vs fp32"))
    if has("eager naive", "eager"):
        n, e = res["eager naive"].final_loss, res["eager"].final_loss
        extra = f"; no-overlap diloco {res['diloco'].final_loss:.4f}" if has("diloco") else ""
        extra += f"; 1-inner-step overlap (streaming τ=1) {res['streaming τ=1'].final_loss:.4f}" \
            if has("streaming τ=1") else ""
        out.append(("(3) naive-delayed is clearly worse than eager", n > e + 0.02,
                    f"final val loss naive {n:.4f} vs eager {e:.4f}{extra}"))
    for tau in (1, 5, 10):
        a, b = f"streaming τ={tau}", f"cocodc τ={tau}"
        if not has(a, b):
            continue
        target = round(max(res[a].final_loss, res[b].final_loss) + 0.01, 3)  # both runs reach it
        sa, _ = res[a].to_target(target)
        sb, _ = res[b].to_target(target)
        if sa is None or sb is None:
            out.append((f"(4) cocodc vs streaming at τ={tau}", None, f"target {target} not reached"))
            continue
        gain = 100.0 * (sa - sb) / sa
        goal = gain >= 15.0 if tau >= 5 else gain > 0
        out.append((f"(4) cocodc vs streaming at τ={tau}: steps to val loss {target}"
                    + (" (goal: ≥15% fewer)" if tau >= 5 else ""), goal,
                    f"streaming {sa:.1f}, cocodc {sb:.1f} steps: {gain:+.1f}% fewer; final {res[a].final_loss:.4f} "
                    f"vs {res[b].final_loss:.4f}; same bytes (N = P)"))
    if has("cocodc τ=5, adaptive N", "streaming τ=5"):
        c, s5 = res["cocodc τ=5, adaptive N"], res["streaming τ=5"]
        out.append(("(4b) cocodc τ=5 with N from the link (1 Gbit/s allows N = H)", c.final_loss < s5.final_loss,
                    f"final {c.final_loss:.4f} vs streaming τ=5 {s5.final_loss:.4f}, at "
                    f"{c.bytes_sent_per_peer / max(s5.bytes_sent_per_peer, 1):.1f}× the bytes"))
    for label in ("dilocox", "dilocox rank 16"):
        if not has(label, "diloco"):
            continue
        x, d = res[label], res["diloco"]
        per_round = (x.bytes_sent_per_peer / max(x.syncs, 1), d.bytes_sent_per_peer / max(d.syncs, 1))
        ratio = per_round[1] / max(per_round[0], 1)
        worse = 100.0 * (x.final_loss - d.final_loss) / d.final_loss
        out.append((f"(5) {label}: bytes per round ≥10× below diloco at ≤3% higher final loss",
                    ratio >= 10 and worse <= 3.0,
                    f"{ratio:.1f}× fewer bytes per round ({per_round[0] / 1e3:.0f} kB vs {per_round[1] / 1e3:.0f} kB); "
                    f"loss {x.final_loss:.4f} vs {d.final_loss:.4f} ({worse:+.1f}%)"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer steps and runs (smoke test)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--with-ddp", action="store_true", help="add the data-parallel reference (slow: a sync per step)")
    args = ap.parse_args()
    steps = args.steps or (80 if args.quick else 200)
    torch.set_num_threads(max(1, torch.get_num_threads()))

    model = preset("tiny")
    trainer = TrainerConfig(lr=2e-3, warmup_steps=20, total_steps=steps, batch_size=8, eval_batches=4)
    data = DataConfig()
    sim = SimConfig(peers=4, steps=steps, step_time=0.1, bandwidth="1gbit", eval_every=8 if not args.quick else 10)
    corpus = load_corpus(data)
    simulator = Simulator(sim, model, trainer, data, corpus)
    runs = specs(args.quick, args.with_ddp)
    results: dict[str, RunResult] = {}
    t0 = time.perf_counter()
    with progress_bar(len(runs) * steps, "methods") as prog:
        task = prog.task_ids[0]
        for k, spec in enumerate(runs):
            prog.update(task, extra=spec.label)
            results[spec.label] = simulator.run(spec, on_step=lambda s, k=k: prog.update(task, completed=k * steps + s))
            prog.update(task, loss=f"{results[spec.label].final_loss:.3f}")
    wall = time.perf_counter() - t0

    # "steps→target" in the table: the single worker's final loss (what M=4 peers need to match one).
    target = round(results["single"].final_loss, 3)
    rows = summary_rows(list(results.values()), target)
    checks = claims(results)
    util_rows = utilization_table()
    args.out.mkdir(parents=True, exist_ok=True)
    plots = plot_runs(list(results.values()), args.out, target, title=f"tiny preset, M=4, H={H}, P={P}")
    grid = [10 ** (5 + k / 4) for k in range(21)]  # 100 kbit/s .. 10 Gbit/s
    curves = {r.label: [(b, replay_utilization(r, bandwidth=b, step_time=sim.step_time or 0.1)) for b in grid]
              for r in results.values() if r.peers > 1}
    uplot = plot_utilization(curves, args.out)
    for p in [*plots, uplot]:
        p.rename(args.out / f"methods_{p.name}")

    machine = f"{platform.machine()}, {torch.get_num_threads()} threads, Python {platform.python_version()}, torch {torch.__version__}"
    (args.out / "methods.json").write_text(json.dumps({
        "command": "python bench/methods.py" + (" --quick" if args.quick else ""), "machine": machine,
        "wall_seconds": wall, "target_loss": target, "H": H, "P": P,
        "sim": vars(sim), "trainer": {k: v for k, v in vars(trainer).items()}, "model": model.to_dict(),
        "runs": [r.to_dict(target) for r in results.values()],
        "claims": [{"claim": c, "holds": ok, "measured": m} for c, ok, m in checks],
        "utilization_table": [vars(r) for r in util_rows],
    }, indent=2, default=str))
    md = [
        "# Outer-loop methods side by side (WAN simulator)",
        "",
        f"Generated by `python bench/methods.py{' --quick' if args.quick else ''}` in {wall / 60:.1f} min on {machine}.",
        "",
        f"Setting: `tiny` preset (1.3M parameters, byte-level, built-in corpus), M = 4 "
        f"virtual peers, {steps} inner steps per peer, batch 8×128 tokens, AdamW lr 2e-3 with 20 warm-up steps "
        f"and cosine decay, H = {H}, P = {P} strided fragments, outer Nesterov η = {ETA} for every method "
        f"with momentum μ = {MU} (one row keeps the paper's 0.9), wire 4-bit E3M0 for "
        f"streaming/cocodc, fp32 for diloco/eager, low-rank (adaptive rank from 4, or fixed 16) + uint8 with "
        f"error feedback for dilocox (delta-rule start point). Virtual clock: 0.1 s per inner step, 1 Gbit/s per "
        f"peer. cocodc sends N = P fragments per H window (the same bytes as streaming) unless marked adaptive; "
        f"λ0 = 0.2. Validation loss of θ every {sim.eval_every} steps; steps to a target are interpolated "
        f"between evaluations.",
        "",
        "Why μ = 0.5: the papers' μ = 0.9 suits hundreds of outer rounds; this run has 10 per fragment, and "
        "delayed methods (eager, dilocox) oscillate with μ = 0.9 even on a quadratic (tests/algo). The "
        "`diloco (paper η 0.7, μ 0.9)` row shows the cost. Why η = 0.7 for streaming and cocodc too: "
        "their paper's 0.4 gave 2.111 vs 2.055 at τ = 1 in a probe run of this setting.",
        "",
        "## Results",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for r in rows:
        md.append("| " + " | ".join(_cell(v) for v in r) + " |")
    md += ["", f"steps→target: inner steps to reach {target}, the single worker's final validation loss.", "",
           "## Claims", ""]
    for c, ok, m in checks:
        md.append(f"- **{c}**: {'holds' if ok else ('does not hold' if ok is False else 'not measurable')} — {m}")
    md += ["", "![loss vs step](methods_loss_vs_step.png)", "", "![loss vs simulated time](methods_loss_vs_time.png)",
           "", "![utilization vs bandwidth](methods_utilization_vs_bandwidth.png)", "",
           "Utilization vs bandwidth replays each run's recorded syncs on one link at other bandwidths "
           "(0.1 s per inner step), without training again.", "",
           "## (6) Bandwidth for a compute utilization: ours vs the Streaming DiLoCo paper (Table 4)", "",
           "Gbit/s, ours (paper). Paper setting: H = 100, 3 layers per fragment, 2 workers, bf16 (4-bit for fp4), "
           "`p2ptrain simulate --utilization-table`.", "",
           "| model | method | " + " | ".join(f"{int(c * 100)}%" for c in CU_TARGETS) + " |",
           "|---|---|" + "---|" * len(CU_TARGETS)]
    cells: dict[tuple[str, str], dict[float, str]] = {}
    for r in util_rows:
        paper = f"{r.paper_gbps:g}" if r.paper_gbps is not None else "–"
        cells.setdefault((r.model, r.method), {})[r.cu] = f"{r.ours_gbps:.3g} ({paper})"
    for (m, meth), v in cells.items():
        md.append(f"| {m} | {meth} | " + " | ".join(v.get(c, "–") for c in CU_TARGETS) + " |")
    kept = blocks(args.out / "methods.md")  # the sections other benchmarks own (long runs, compensation)
    (args.out / "methods.md").write_text("\n".join(md) + "\n" + "".join("\n" + b for b in kept.values()))
    out.print(table("bench/methods.py", COLUMNS, rows))
    for c, ok, m in checks:
        out.print(f"{'✔' if ok else ('✘' if ok is False else '?')} {c}: {m}", highlight=False)


def _cell(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


if __name__ == "__main__":
    sys.exit(main())
