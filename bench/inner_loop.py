"""Inner-loop overhead: tokens/s of p2ptrain's Trainer.step() vs a bare hand-written PyTorch loop.

    python bench/inner_loop.py                  # tiny preset, batch 16, 9 alternating blocks of 20 steps
    python bench/inner_loop.py --preset small --batch-size 8 --blocks 3 --steps 5

Same model, batch, optimizer (AdamW, two param groups, clipping) and data in
both; the two loops alternate in blocks so that machine noise hits both alike.
Target: ratio ≥ 0.95 (the framework adds at most 5%). Writes
bench/results/inner_loop.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from p2ptrain.data import DataConfig, load_corpus
from p2ptrain.model import GPT, preset
from p2ptrain.trainer import TrainerConfig, make_trainer
from p2ptrain.ui import out, table

RESULTS = Path(__file__).parent / "results"


def bare_loop(cfg, corpus, batch: int, seed: int):  # type: ignore[no-untyped-def]
    """The loop a user would write by hand: returns a function running n steps, giving tokens/s."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.95))
    rng = np.random.default_rng(seed)
    data, T = corpus.train, cfg.seq_len

    def run(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            starts = rng.integers(0, len(data) - T - 1, size=batch)
            w = torch.from_numpy(data[starts[:, None] + np.arange(T + 1)].astype(np.int64))
            loss = model.loss(w[:, :-1], w[:, 1:])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return n * batch * T / (time.perf_counter() - t0)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=9)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=RESULTS / "inner_loop.json")
    args = ap.parse_args()

    cfg = preset(args.preset)
    corpus = load_corpus(DataConfig())
    tr = make_trainer(cfg, TrainerConfig(batch_size=args.batch_size, lr=1e-3, warmup_steps=10), DataConfig(),
                      corpus=corpus)
    bare = bare_loop(cfg, corpus, args.batch_size, seed=0)

    def framework(n: int) -> float:
        t0 = time.perf_counter()
        tokens = sum(tr.step().tokens for _ in range(n))
        return tokens / (time.perf_counter() - t0)

    framework(3)  # warm-up both (allocator, kernels)
    bare(3)
    f_rates, b_rates = [], []
    for _ in range(args.blocks):
        f_rates.append(framework(args.steps))
        b_rates.append(bare(args.steps))
    f, b = statistics.median(f_rates), statistics.median(b_rates)
    # Paired blocks ran back to back: the median of their ratios cancels slow drifts of the machine.
    ratio = statistics.median(x / y for x, y in zip(f_rates, b_rates, strict=True))
    rows = [["p2ptrain Trainer.step()", f"{f:,.0f}"], ["bare PyTorch loop", f"{b:,.0f}"],
            ["ratio, median of paired blocks (target ≥ 0.95)", f"{ratio:.3f}"]]
    machine = f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": "python bench/inner_loop.py", "machine": machine, "preset": args.preset,
        "batch_size": args.batch_size, "seq_len": cfg.seq_len, "blocks": args.blocks, "steps_per_block": args.steps,
        "framework_tokens_per_s": f_rates, "bare_tokens_per_s": b_rates, "median_framework": f, "median_bare": b,
        "ratio": ratio, "target": 0.95, "meets_target": ratio >= 0.95}, indent=2))
    out.print(table(f"inner loop, {args.preset}, batch {args.batch_size}×{cfg.seq_len} ({machine})",
                    ["loop", "tokens/s (median of blocks)"], rows))


if __name__ == "__main__":
    main()
