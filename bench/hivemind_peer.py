"""A baseline peer: the same model, data and batch as a ``p2ptrain join`` peer, trained with
``hivemind.Optimizer`` in its delayed parameter updates mode.

    python bench/hivemind_peer.py --initial-peers /ip4/127.0.0.1/tcp/PORT/p2p/ID --run-id hm --steps 40 --json hm.json

What a user would otherwise run: ``hivemind.Optimizer(delay_optimizer_step=True,
delay_grad_averaging=True, use_local_updates=False)`` with the model's AdamW (same
hyper-parameters, weight-decay groups and warm-up + cosine schedule as p2ptrain's inner
optimizer, the schedule counted in hivemind epochs) and ``target_batch_size`` samples per
epoch across the swarm (default: one micro-batch from each of ``--peers`` peers, i.e. one
global optimizer step per local step, as ``ddp``). Gradients are clipped locally before they
are handed to hivemind (hivemind has no clip of the averaged gradient).

It leaves after ``--steps`` local steps or on SIGTERM / Ctrl-C (after the current step), and
writes the figures a p2ptrain peer writes (``--json``): inner steps, ``compute_seconds`` (the
forward and backward passes: what the peer computes itself; hivemind's optimizer step runs in
a background thread), ``loop_seconds``, ``bytes_sent`` (with ``--count-bytes-on IFACE``: what that
interface sent during the loop, e.g. a testbed host's own link; hivemind does not count its own
traffic), epochs, and
the validation loss of its parameters at the end. Exits 1 with a message if the DHT cannot
start or reach the initial peers.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _tx_bytes(iface: str | None) -> int | None:
    """Bytes sent so far by network interface ``iface`` of this namespace (None: not counted)."""
    if iface is None:
        return None
    try:
        return int(Path(f"/sys/class/net/{iface}/statistics/tx_bytes").read_text())
    except (OSError, ValueError):
        print(f"warning: cannot read the byte counter of {iface}: bytes_sent not counted", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--initial-peers", action="append", default=[])
    ap.add_argument("--host-maddrs", action="append", default=[])
    ap.add_argument("--announce-maddrs", action="append", default=[])
    ap.add_argument("--run-id", default="hivemind-baseline")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--peers", type=int, default=4, help="swarm size (sets the default target batch size)")
    ap.add_argument("--target-batch-size", type=int, default=None,
                    help="samples per hivemind epoch across the swarm (default: peers × batch size)")
    ap.add_argument("--matchmaking-time", type=float, default=15.0,
                    help="hivemind's default; its docs: 10-15 s for training over the internet")
    ap.add_argument("--averaging-timeout", type=float, default=120.0)
    ap.add_argument("--compression", choices=["none", "fp16"], default="fp16",
                    help="gradient and state averaging compression (hivemind's docs suggest fp16)")
    ap.add_argument("--average-state-every", type=int, default=1, help="epochs between state averaging rounds")
    ap.add_argument("--count-bytes-on", default=None, metavar="IFACE",
                    help="report the bytes this interface sent during the loop as bytes_sent (in a testbed "
                         "namespace: eth0, the peer's own link); hivemind does not count its own traffic")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    if a.steps < 1 or a.batch_size < 1 or a.peers < 1:
        ap.error("--steps, --batch-size and --peers must be at least 1")

    import hivemind
    import torch
    from hivemind.compression import Float16Compression, NoCompression

    from p2ptrain.data import DataConfig
    from p2ptrain.model import preset
    from p2ptrain.trainer import TrainerConfig, lr_at, make_trainer

    torch.set_num_threads(1)
    cfg = TrainerConfig(batch_size=a.batch_size, total_steps=a.steps, device="cpu")
    trainer = make_trainer(preset(a.preset), cfg, DataConfig())
    try:
        dht = hivemind.DHT(initial_peers=a.initial_peers, host_maddrs=a.host_maddrs or ["/ip4/127.0.0.1/tcp/0"],
                           announce_maddrs=a.announce_maddrs or None, start=True)
    except Exception as e:  # hivemind raises its daemon's errors as-is
        print(f"error: the hivemind DHT did not start: {e}", file=sys.stderr)
        return 1
    peer_id = str(dht.peer_id)
    trainer.stream.reseed(DataConfig().seed, int.from_bytes(hashlib.sha1(peer_id.encode()).digest()[:4], "big"))
    decay = [p for p in trainer.model.parameters() if p.dim() >= 2]
    no_decay = [p for p in trainer.model.parameters() if p.dim() < 2]
    comp = Float16Compression() if a.compression == "fp16" else NoCompression()
    opt = hivemind.Optimizer(
        dht=dht, run_id=a.run_id, target_batch_size=a.target_batch_size or a.peers * a.batch_size,
        batch_size_per_step=a.batch_size,
        params=[{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        optimizer=lambda groups: torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps),
        scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda epoch: lr_at(epoch, cfg) / cfg.lr),
        delay_optimizer_step=True, delay_grad_averaging=True, use_local_updates=False, offload_optimizer=True,
        matchmaking_time=a.matchmaking_time, averaging_timeout=a.averaging_timeout, grad_compression=comp,
        state_averaging_compression=comp, average_state_every=a.average_state_every, verbose=False)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    t0 = time.perf_counter()
    tx0 = _tx_bytes(a.count_bytes_on)
    started = time.time()
    compute, steps, loss = 0.0, 0, math.nan
    loss_log: list[tuple[float, int, float]] = []
    try:
        while steps < a.steps and not stop.is_set():
            opt.zero_grad()
            t1 = time.perf_counter()
            trainer.model.train()
            loss, tokens = trainer.forward_backward()
            torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), cfg.grad_clip)
            compute += time.perf_counter() - t1
            trainer.tokens_seen += tokens
            opt.step(batch_size=a.batch_size)
            steps += 1
            loss_log.append((time.time(), steps, loss))
        loop = time.perf_counter() - t0
        tx1 = _tx_bytes(a.count_bytes_on)
        val = trainer.evaluate().loss
        epochs = opt.local_epoch
    finally:
        with contextlib.suppress(Exception):
            opt.shutdown()
        with contextlib.suppress(Exception):
            dht.shutdown()
    summary: dict[str, Any] = {
        "peer_id": peer_id, "method": "hivemind", "steps": steps, "val_loss": val, "final_train_loss": loss,
        "wall_seconds": time.perf_counter() - t0, "loop_seconds": loop, "compute_seconds": compute,
        "eval_seconds": 0.0, "utilization": compute / loop if loop > 0 else 0.0, "loop_started": started,
        "bytes_sent": None if tx0 is None or tx1 is None else tx1 - tx0, "rounds_complete": epochs,
        "rounds_partial": 0, "rounds_failed": 0, "loss_log": loss_log,
        "config": {k: str(v) for k, v in vars(a).items() if k not in ("initial_peers",)},
    }
    print(f"hivemind peer {peer_id}: {steps} steps, {epochs} epochs, val loss {val:.4f}, "
          f"utilization {summary['utilization']:.3f}", flush=True)
    if a.json:
        a.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
