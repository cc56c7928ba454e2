"""The compensation instrument: every merge rule against the ideal local fragment, at several overlaps τ.

    python bench/compensation.py                         # tiny, 3 peers, H=12, P=4, τ = 2, 5, 10, 240 steps
    python bench/compensation.py --taus 5 --steps 120    # one τ, shorter

The run itself uses cocodc with the delta rule (λ0 = 0) and N = P; at each of peer 0's applies the instrument
(:mod:`p2ptrain.sim.compensation`) replays the overlap from θ̃ to get the ideal fragment and measures every
candidate rule against it. Prints a table per τ (median distance, quartiles, median cosine of the correction
with the true error) and writes bench/results/compensation.json as it goes.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from p2ptrain.algo.methods import method_config
from p2ptrain.data import DataConfig, load_corpus
from p2ptrain.model import preset
from p2ptrain.sim.compensation import probe_run, summarize
from p2ptrain.sim.runner import SimConfig
from p2ptrain.trainer import TrainerConfig
from p2ptrain.ui import out, table

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--H", type=int, default=12)
    ap.add_argument("--P", type=int, default=4)
    ap.add_argument("--taus", default="2,5,10")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", default=None, help="A corpus (default: the built-in one).")
    ap.add_argument("--out", type=Path, default=RESULTS / "compensation.json")
    args = ap.parse_args()

    data = DataConfig(path=args.data, seed=args.seed)
    corpus = load_corpus(data)
    model = preset(args.preset)
    trainer = TrainerConfig(batch_size=args.batch_size, total_steps=args.steps, seed=args.seed)
    record: dict = {"command": "python bench/compensation.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out" and v is not None),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "corpus": corpus.describe(), "runs": []}
    for tau in [int(t) for t in args.taus.split(",")]:
        method = method_config("cocodc", H=args.H, P=args.P, tau=tau, lambda0=0.0, sends_per_window=args.P,
                               late="stall", codec="fp32")
        sim = SimConfig(peers=args.peers, steps=args.steps, step_time=0.1, eval_every=10**6)
        t0 = time.perf_counter()
        res, probes = probe_run(sim, model, trainer, data, corpus, method)
        summary = summarize(probes)
        rows = [[name, f"{s['distance_median']:.3f}", f"{s['distance_q1']:.3f}–{s['distance_q3']:.3f}",
                 f"{s['cosine_median']:+.3f}" if s["cosine_median"] == s["cosine_median"] else "–"]
                for name, s in sorted(summary.items(), key=lambda kv: kv[1]["distance_median"])]
        out.print(table(f"τ = {tau}: distance to the ideal fragment ({len(probes)} applies of peer 0; take = 1)",
                        ["rule", "median", "quartiles", "cosine"], rows))
        record["runs"].append({"tau": tau, "applies": len(probes), "final_loss": res.final_loss,
                               "seconds": time.perf_counter() - t0, "summary": summary,
                               "probes": [vars(p) for p in probes]})
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
