"""Why more sends per window hurt cocodc: the same fragment synced N/P times per window, with the outer step
as it is and scaled down. Writes bench/results/sync_frequency.json as it goes.

    python bench/sync_frequency.py                  # micro, 4 peers, 480 steps, H 12, P 4, τ 1, seed 0

Each sync extrapolates the fragment's progress by η/(1−μ); with N > P the progress between syncs is shorter and
noisier. The variants: N = P (the reference), N = 2P and N = H as they are, with η scaled by P/N, and N = H with the
outer memory kept in steps (μ^(P/N), η scaled to the same steady-state step).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from p2ptrain.algo.methods import CoCoDCConfig
from p2ptrain.data import DataConfig, load_corpus
from p2ptrain.model import preset
from p2ptrain.sim.runner import RunSpec, SimConfig, Simulator
from p2ptrain.trainer import TrainerConfig
from p2ptrain.ui import out

RESULTS = Path(__file__).parent / "results"


def variants(H: int, P: int, eta: float, mu: float) -> list[tuple[str, CoCoDCConfig]]:
    def cfg(n: int, **kw: float) -> CoCoDCConfig:
        return CoCoDCConfig(H=H, P=P, tau=1, sends_per_window=n, **{"outer_lr": eta, "outer_momentum": mu, **kw})

    k = H / P
    mu_k = mu ** (1 / k)
    return [("N=P", cfg(P)), ("N=2P", cfg(2 * P)), ("N=2P, η/2", cfg(2 * P, outer_lr=eta / 2)),
            ("N=H", cfg(H)), (f"N=H, η/{k:g}", cfg(H, outer_lr=eta / k)),
            ("N=H, μ^(P/N), same steady step", cfg(H, outer_momentum=mu_k, outer_lr=eta * (1 - mu_k) / (1 - mu)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=480)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--H", type=int, default=12)
    ap.add_argument("--P", type=int, default=4)
    ap.add_argument("--out", type=Path, default=RESULTS / "sync_frequency.json")
    args = ap.parse_args()
    data = DataConfig(seed=args.seed)
    sim = Simulator(SimConfig(peers=4, steps=args.steps, step_time=0.1, eval_every=60), preset("micro"),
                    TrainerConfig(batch_size=8, total_steps=args.steps, seed=args.seed), data, load_corpus(data))
    record = {"command": f"python bench/sync_frequency.py --steps {args.steps} --seed {args.seed} --H {args.H} "
                         f"--P {args.P}", "runs": []}
    for label, method in variants(args.H, args.P, eta=0.4, mu=0.9):
        t0 = time.perf_counter()
        res = sim.run(RunSpec(label, method, None))
        record["runs"].append({"label": label, "final_val_loss": res.final_loss, "syncs": res.syncs,
                               "bytes_sent_per_peer": res.bytes_sent_per_peer, "config": res.config})
        out.print(f"{label}: final {res.final_loss:.4f}, {res.syncs} syncs ({time.perf_counter() - t0:.0f} s)",
                  highlight=False)
        args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
