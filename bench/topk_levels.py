"""The two levels of the sparse wire: how much of a round a topk2 payload loses, with the levels it uses now
(2-means, ``collective/lowbit.py:two_levels``) and with the block's smallest and largest selected magnitude
(the levels before).

    python bench/topk_levels.py                       # fractions 0.01, 0.03, 0.15, 0.25
    python bench/topk_levels.py --fractions 0.15 --steps 40

Behind error feedback what one round does not carry waits in the buffer for a later one: the smaller the
round trip's error ``‖x − Q(x)‖² / ‖x‖²``, the sooner the swarm sees a peer's progress. Measured on synthetic
vectors (Gaussian, Laplace, Student-t with 3 degrees of freedom: heavier tails) and on real pseudo-gradients:
the micro model trained ``--steps`` inner steps from its initial θ on the built-in corpus, Δ = θ_0 − θ (one
peer, AdamW as the trainer runs it), flattened. For each, the error of the whole round trip and of the selected
values alone (their coding error over their energy), old levels and new; then the wires side by side, the
dense 1-bit sign codec (``1bit``) among them.

Writes bench/results/topk_levels.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch

from p2ptrain.collective import lowbit
from p2ptrain.collective.codecs import get_codec
from p2ptrain.ui import out, table

OUT = Path(__file__).resolve().parent / "results" / "topk_levels.json"


def _extremes(mags: torch.Tensor, rounds: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The levels before: the row's smallest and largest selected magnitude."""
    return mags.amin(dim=1), mags.amax(dim=1)


def pseudo_gradient(steps: int, seed: int = 0) -> torch.Tensor:
    """Δ = θ_0 − θ after ``steps`` inner steps of the micro model (flat, float32)."""
    from p2ptrain.data import DataConfig
    from p2ptrain.model import preset
    from p2ptrain.trainer import TrainerConfig, make_trainer

    tr = make_trainer(preset("micro"), TrainerConfig(batch_size=8, warmup_steps=10, seed=seed), DataConfig())
    before = torch.cat([p.detach().reshape(-1).clone() for p in tr.model.parameters()])
    for _ in range(steps):
        tr.step()
    after = torch.cat([p.detach().reshape(-1) for p in tr.model.parameters()])
    return (before - after).float()


def errors(x: torch.Tensor, fraction: float) -> dict[str, float]:
    """Round-trip and selected-value errors of topk2 at ``fraction`` on ``x``, new levels and old."""
    codec = get_codec(f"topk2:{fraction}")
    energy = float((x.double() ** 2).sum())
    res: dict[str, float] = {}
    for name, levels in (("new", lowbit.two_levels), ("old", _extremes)):
        saved = lowbit.two_levels
        lowbit.two_levels = levels  # type: ignore[assignment]
        try:
            y = codec.decode(codec.encode(x), x.numel()).double()
        finally:
            lowbit.two_levels = saved  # type: ignore[assignment]
        sel = y != 0
        res[f"roundtrip_{name}"] = float(((x.double() - y) ** 2).sum()) / energy
        res[f"selected_{name}"] = float(((x.double() - y)[sel] ** 2).sum()) / max(float((x.double()[sel] ** 2).sum()),
                                                                                 1e-300)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fractions", default="0.01,0.03,0.15,0.25")
    ap.add_argument("--n", type=int, default=1 << 20, help="values of each synthetic vector")
    ap.add_argument("--steps", type=int, default=20, help="inner steps of the real pseudo-gradient (H)")
    ap.add_argument("--codecs", default="1bit,topk2:0.15,topk2:0.03,2bit,e3m0",
                    help="wires to compare side by side (the second table)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.manual_seed(0)  # the Laplace and Student-t samples draw from the global generator
    sources = {
        "gaussian": torch.randn(args.n),
        "laplace": torch.distributions.Laplace(0.0, 1.0).sample((args.n,)),
        "student-t 3": torch.distributions.StudentT(3.0).sample((args.n,)),
        f"micro Δ, H {args.steps}": pseudo_gradient(args.steps),
    }
    rows: list[dict[str, Any]] = []
    for fraction in [float(f) for f in args.fractions.split(",")]:
        for name, x in sources.items():
            rows.append({"fraction": fraction, "source": name, "values": x.numel(), **errors(x, fraction)})
    out.print(table("topk2's round trip: error ‖x − Q(x)‖² / ‖x‖² (whole, and of the selected values alone)",
              ["fraction", "source", "round trip: old", "new", "selected: old", "new"],
              [[r["fraction"], r["source"], f"{r['roundtrip_old']:.4f}", f"{r['roundtrip_new']:.4f}",
                f"{r['selected_old']:.4f}", f"{r['selected_new']:.4f}"] for r in rows]))
    wires: list[dict[str, Any]] = []
    for codec_name in args.codecs.split(","):
        codec = get_codec(codec_name)
        for name, x in sources.items():
            y = codec.decode(codec.encode(x), x.numel()).double()
            wires.append({"codec": codec_name, "source": name, "bits_per_value": 8 * codec.encoded_size(x.numel())
                          / x.numel(), "roundtrip": float(((x.double() - y) ** 2).sum() / (x.double() ** 2).sum())})
    out.print(table("The wires side by side: bits per value and round-trip error ‖x − Q(x)‖² / ‖x‖²",
                    ["codec", "bits / value", *sources],
                    [[c, f"{next(w['bits_per_value'] for w in wires if w['codec'] == c):.3f}",
                      *(f"{w['roundtrip']:.4f}" for w in wires if w["codec"] == c)] for c in args.codecs.split(",")]))
    args.out.write_text(json.dumps({"command": "python " + " ".join(sys.argv), "machine": platform.node(),
                                    "rows": rows, "wires": wires}, indent=1) + "\n")
    out.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
