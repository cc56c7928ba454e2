"""``p2ptrain join`` / ``bootstrap`` / ``status``: the swarm commands (registered on the main app)."""

from __future__ import annotations

import hashlib
import json
import signal
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from . import __version__
from .cli import ConfigOpt, InitFromOpt, LogOpt, SeqLenOpt, TokenizerOpt, _model_and_trainer, app, fail
from .data import DataConfig, DataError
from .metrics import DEFAULT_METRICS_PORT, PeerMetrics
from .settings import ConfigError, build, load_file, merged
from .staged_cli import launch_stages, run_staged, staged_or_none, staged_plan

InitialPeers = Annotated[list[str] | None, typer.Option("--initial-peers", "-i", help="Multiaddr of a live peer or bootstrap node (repeatable).")]
HostMaddrs = Annotated[list[str] | None, typer.Option("--host-maddrs", help="Listen address(es), e.g. /ip4/0.0.0.0/tcp/31337.")]
SwarmKeyOpt = Annotated[Path | None, typer.Option("--swarm-key", help="A private swarm's shared key file (see `p2ptrain keygen`): only peers holding it are accepted.")]
AnnounceMaddrs = Annotated[list[str] | None, typer.Option("--announce-maddrs", help="Address(es) others should dial (public IP, explicit port).")]


def _rank_of(peer_id: str) -> int:
    """A data-stream rank from the peer's identity: every peer draws its own batches."""
    return int.from_bytes(hashlib.sha1(peer_id.encode()).digest()[:4], "big")


def _method_knobs(file: dict[str, Any], flags: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    section = dict(file.get("method", {}))
    name = flags.pop("name", None) or section.pop("name", None) or "cocodc"
    section.pop("name", None)
    return name, merged(section, flags)


@app.command()
def join(
    initial_peers: InitialPeers = None,
    run_id: Annotated[str | None, typer.Option("--run-id", help="The run to join (peers of one run find each other by it).")] = None,
    region: Annotated[str | None, typer.Option("--region", help="A label for this peer's location (shown by status).")] = None,
    method: Annotated[str | None, typer.Option("--method", "-m", help="ddp, diloco, streaming, eager, cocodc, dilocox.")] = None,
    preset_name: Annotated[str | None, typer.Option("--preset", "-p", help="Model preset.")] = None,
    steps: Annotated[int | None, typer.Option("--steps", "-n", help="Leave cleanly after this many inner steps.")] = None,
    step_seconds: Annotated[float | None, typer.Option("--step-seconds", help="Round pacing: seconds per logical step (default: the swarm's, or measured).")] = None,
    H: Annotated[int | None, typer.Option("--H", help="Inner steps per round.")] = None,
    P: Annotated[int | None, typer.Option("--P", help="Fragments.")] = None,
    tau: Annotated[int | None, typer.Option("--tau", help="Overlap τ in logical steps.")] = None,
    codec: Annotated[str | None, typer.Option("--codec", help="Wire codec.")] = None,
    timeout: Annotated[float | None, typer.Option("--round-timeout", help="Seconds a round may take.")] = None,
    data: Annotated[str | None, typer.Option("--data", help="Corpus (default: built-in).")] = None,
    tokenizer: TokenizerOpt = None,
    init_from: InitFromOpt = None,
    seq_len: SeqLenOpt = None,
    batch_size: Annotated[int | None, typer.Option("--batch-size")] = None,
    lr: Annotated[float | None, typer.Option("--lr")] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="Model-init seed (identical on every peer).")] = None,
    device: Annotated[str | None, typer.Option("--device")] = None,
    host_maddrs: HostMaddrs = None,
    announce_maddrs: AnnounceMaddrs = None,
    identity: Annotated[Path | None, typer.Option("--identity", help="Private key file: a stable peer id and address.")] = None,
    client_mode: Annotated[bool, typer.Option("--client-mode", help="Behind NAT: dial out only, reached through relays.")] = False,
    use_auto_relay: Annotated[bool, typer.Option("--use-auto-relay", help="Look for libp2p relays to become reachable.")] = False,
    no_relay: Annotated[bool, typer.Option("--no-relay", help="Disable libp2p circuit relays.")] = False,
    connect_attempts: Annotated[int, typer.Option("--connect-attempts", help="Tries (with backoff) when initial peers are unreachable.")] = 5,
    join_window: Annotated[float | None, typer.Option("--join-window", help="Seconds a round leader waits for peers.")] = None,
    min_step_seconds: Annotated[float | None, typer.Option("--min-step-seconds", help="Pad each inner step to this long (emulate a slower device).")] = None,
    eval_every: Annotated[int | None, typer.Option("--eval-every", help="Evaluate θ every this many inner steps during the run (logged in --json as val_log; 0: only at the end).")] = None,
    metrics_port: Annotated[int | None, typer.Option("--metrics-port", help=f"Serve Prometheus metrics here (0: any free port, -1: off; default {DEFAULT_METRICS_PORT}, or the next free one when several peers share a machine).")] = None,
    metrics_host: Annotated[str, typer.Option("--metrics-host", help="Address of the metrics endpoint.")] = "127.0.0.1",
    swarm_key_file: SwarmKeyOpt = None,
    aggregation: Annotated[str, typer.Option("--aggregation", help="How this peer averages what it receives: mean, trimmed-mean, centered-clip.")] = "mean",
    norm_bound: Annotated[float | None, typer.Option("--norm-bound", help="Refuse updates with a norm over this many times the round's median (off by default).")] = None,
    checkpoint_dir: Annotated[Path | None, typer.Option("--checkpoint-dir", help="Write checkpoints here (every --checkpoint-every rounds and on leave).")] = None,
    checkpoint_every: Annotated[int | None, typer.Option("--checkpoint-every", help="Applied rounds between checkpoints.")] = None,
    resume: Annotated[Path | None, typer.Option("--resume", help="Continue from the newest checkpoint in this folder (and keep writing there).")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the peer's summary as JSON here.")] = None,
    maddrs_file: Annotated[Path | None, typer.Option("--maddrs-file", help="Write this peer's multiaddrs here once listening.")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No live status line.")] = False,
    run_stages: Annotated[int | None, typer.Option("--run-stages", help="S_run: the run's stage groups of the model, each synced in its own namespace (every peer of the run gives the same; default: --pipeline-stages).")] = None,
    pipeline_stages: Annotated[int, typer.Option("--pipeline-stages", help="S: pipeline processes of this peer (one GPU each); S must divide S_run.")] = 1,
    microbatches: Annotated[int, typer.Option("--micro-batches", help="M: micro-batches per batch in the pipeline (default S).")] = 0,
    pipeline_schedule: Annotated[str, typer.Option("--pipeline-schedule", help="1f1b or gpipe.")] = "1f1b",
    pipeline_timeout: Annotated[float, typer.Option("--pipeline-timeout", help="Seconds a collective between this peer's stages may wait (a dead stage fails the others after it).")] = 600.0,
    compile_blocks: Annotated[bool, typer.Option("--compile", help="Compile the transformer blocks with torch.compile (worth it on a GPU).")] = False,
    untie_embeddings: Annotated[bool, typer.Option("--untie-embeddings", help="Separate input embedding and output head (needed for S_run > 1).")] = False,
    config: ConfigOpt = None,
    log_level: LogOpt = None,
) -> None:
    """Join a swarm (or start one, with no --initial-peers) and train until --steps."""
    from .algo.methods import method_config
    from .checkpoint import CheckpointError
    from .net.auth import SwarmKey
    from .net.guard import GuardConfig
    from .net.swarm import HivemindTransport, SwarmConfig, SwarmError
    from .peer import PeerConfig, make_peer
    from .peer_checkpoint import PeerCheckpoints
    from .trainer import make_trainer
    from .ui import console, out, setup_logging, status_printer, table

    setup_logging(log_level)
    try:
        file = load_file(config)
        peer_file = file.get("peer", {})
        total = steps or int(peer_file.get("steps", file.get("steps", 300)))
        from .hf_cli import open_init_from

        init = open_init_from(file, preset_name, init_from, seq_len)
        model_flags: dict[str, Any] = {"seq_len": seq_len}
        if untie_embeddings:
            model_flags["tie_embeddings"] = False
        model_cfg, trainer_cfg = _model_and_trainer(
            {k: v for k, v in file.items() if k != "model"} if init else file, None if init else preset_name,
            model_flags, {
                "batch_size": batch_size, "lr": lr, "seed": seed, "device": device,
                "compile": True if compile_blocks else None,
                "total_steps": file.get("trainer", {}).get("total_steps", total)})
        data_cfg = build(DataConfig, merged(file.get("data"), {"path": data, "tokenizer": tokenizer}), "data")
        name, knobs = _method_knobs(file, {"name": method, "H": H, "P": P, "tau": tau, "codec": codec,
                                           "timeout": timeout})
        method_cfg = method_config(name, **knobs)
        rid = run_id or peer_file.get("run_id") or "p2ptrain"
        peer_cfg = build(PeerConfig, merged({k: v for k, v in peer_file.items() if k not in ("initial_peers",)}, {
            "run_id": rid, "region": region, "steps": total, "step_seconds": step_seconds,
            "join_window": join_window, "min_step_seconds": min_step_seconds, "eval_every": eval_every,
            "checkpoint_dir": str(checkpoint_dir or resume) if (checkpoint_dir or resume) else None,
            "checkpoint_every": checkpoint_every}), "peer")
        swarm_cfg = SwarmConfig(
            run_id=rid, initial_peers=list(initial_peers or peer_file.get("initial_peers", [])),
            host_maddrs=list(host_maddrs or ["/ip4/127.0.0.1/tcp/0"]), announce_maddrs=list(announce_maddrs or []),
            identity_path=str(identity) if identity else None, client_mode=client_mode,
            use_relay=not no_relay, use_auto_relay=use_auto_relay, join_window=peer_cfg.join_window, ttl=peer_cfg.ttl,
            connect_attempts=connect_attempts, guard=GuardConfig(aggregation=aggregation, norm_bound=norm_bound),
            swarm_key=SwarmKey.load(swarm_key_file) if swarm_key_file else None)
        staged = staged_or_none(run_stages, pipeline_stages)
        if staged is not None and init is not None:
            raise ValueError("--init-from is not supported for staged peers (S_run > 1 or --pipeline-stages > 1) "
                             "yet: every stage would have to load its own slice of the checkpoint")
        if staged is not None:  # bad stage flags fail here, once, before any stage process starts
            staged_plan(model_cfg, trainer_cfg, method_cfg, run_stages=staged[0], pipeline_stages=pipeline_stages,
                        microbatches=microbatches, schedule=pipeline_schedule, pipeline_timeout=pipeline_timeout)
        if init is not None:  # every peer that loads the same folder starts from the same θ
            from .hf import data_for, trainer_from_hf

            data_cfg = data_for(init, data_cfg)
            trainer = trainer_from_hf(init, trainer_cfg, data_cfg)
        elif staged is None:
            trainer = make_trainer(model_cfg, trainer_cfg, data_cfg)
    except (ConfigError, DataError, ValueError) as e:
        raise fail(str(e)) from None
    if staged is not None:
        s_run, launch = staged
        if checkpoint_dir or resume:
            raise fail("checkpoints of staged peers (S_run > 1 or --pipeline-stages > 1) are not supported yet: "
                       "run without --checkpoint-dir/--resume (a late joiner takes θ from the swarm)")
        if launch:
            if sys.argv[1:2] != ["join"]:
                raise fail("--pipeline-stages > 1 is launched from the `p2ptrain join` command line")
            raise typer.Exit(launch_stages(pipeline_stages, sys.argv[1:]))
        run_staged(model_cfg=model_cfg, trainer_cfg=trainer_cfg, data_cfg=data_cfg, method_cfg=method_cfg,
                   peer_cfg=peer_cfg, swarm_cfg=swarm_cfg, run_stages=s_run, pipeline_stages=pipeline_stages,
                   microbatches=microbatches, schedule=pipeline_schedule, pipeline_timeout=pipeline_timeout,
                   json_out=json_out, maddrs_file=maddrs_file, metrics_port=metrics_port, metrics_host=metrics_host,
                   quiet=quiet, preset_name=preset_name or file.get("preset", "tiny"))
        return

    metrics = PeerMetrics(method=method_cfg.name, region=peer_cfg.region)
    peer = make_peer(peer_cfg, method_cfg, trainer, lambda: HivemindTransport.create(swarm_cfg), metrics=metrics)
    resumed_step: int | None = None
    if resume is not None:
        try:
            found = PeerCheckpoints(resume).latest()
            if found is None:
                raise fail(f"--resume {resume}: no checkpoint there")
            PeerCheckpoints.restore(peer, found[1])
        except (CheckpointError, ValueError, KeyError) as e:
            raise fail(f"--resume {resume}: {e}") from None
        resumed_step = trainer.step_count
        console.print(f"resuming from {found[0].name} (inner step {resumed_step})", highlight=False)
    port: int | None = None
    if metrics_port is None:  # the default: the first free of a few ports from DEFAULT_METRICS_PORT
        for candidate in range(DEFAULT_METRICS_PORT, DEFAULT_METRICS_PORT + 16):
            try:
                port = metrics.serve(candidate, metrics_host)
                break
            except OSError:
                continue
        if port is None:
            raise fail(f"ports {DEFAULT_METRICS_PORT}-{DEFAULT_METRICS_PORT + 15} are all taken; "
                       "pick one with --metrics-port, or -1 to turn metrics off")
    elif metrics_port >= 0:
        try:
            port = metrics.serve(metrics_port, metrics_host)
        except OSError as e:
            raise fail(f"cannot serve metrics on {metrics_host}:{metrics_port} ({e.strerror}); "
                       "pick another --metrics-port, or -1 to turn them off") from None
    if port is not None:
        console.print(f"metrics: http://{metrics_host}:{port}/metrics", highlight=False)
    if not swarm_cfg.initial_peers:
        console.print("[yellow]no --initial-peers: starting a new swarm[/]", highlight=False)
    if swarm_cfg.swarm_key is None:
        console.print("[yellow]this swarm is open: any peer that knows an address can join (no swarm key)[/]",
                      highlight=False)
    else:
        console.print(f"private swarm: key fingerprint {swarm_cfg.swarm_key.fingerprint}", highlight=False)
    try:
        peer.start()
    except SwarmError as e:
        peer.close()
        raise fail(str(e), 1) from None
    if resumed_step is None:  # a resumed peer keeps its data position
        trainer.stream.reseed(data_cfg.seed, _rank_of(peer.peer_id))
    maddrs = peer.net.call(peer.transport.visible_maddrs(), 10)  # type: ignore[union-attr]
    if maddrs_file:
        maddrs_file.write_text("\n".join(maddrs) + "\n")
    others = " ".join(f"--initial-peers {a}" for a in maddrs)
    console.print(f"p2ptrain {__version__} · peer {peer.peer_id} · run {rid} · {method_cfg.name} · "
                  f"step pacing {peer.step_seconds}s", highlight=False)
    console.print(f"another machine joins with:\n  p2ptrain join {others} --run-id {rid} --method {method_cfg.name} "
                  + (f"--init-from {init.path}" if init else f"--preset {preset_name or file.get('preset', 'tiny')}"),
                  highlight=False, soft_wrap=True)

    def on_signal(signum: int, _frame: Any) -> None:
        console.print(f"signal {signal.Signals(signum).name}: leaving after this step", highlight=False)
        peer.request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    peer.on_status = status_printer(quiet)
    try:
        summary = peer.run()
        val = trainer.evaluate(summary.outer_params or None).loss
        metrics.val_loss.set(val)
    finally:
        metrics.close()
    rows = [("peer", summary.peer_id), ("inner steps", summary.steps), ("val loss of θ", f"{val:.4f}"),
            ("rounds complete / partial / failed", f"{summary.rounds_complete} / {summary.rounds_partial} / "
                                                   f"{summary.rounds_failed}"),
            ("compute utilization", f"{summary.utilization:.3f}"), ("stall", f"{summary.stall_seconds:.1f} s"),
            ("bytes sent / received", f"{summary.bytes_sent:,} / {summary.bytes_received:,}"),
            ("repairs", summary.repairs)]
    out.print(table("p2ptrain join: summary", ["", "value"], rows))
    if json_out:
        json_out.write_text(json.dumps({
            "peer_id": summary.peer_id, "steps": summary.steps, "val_loss": val, "wall_seconds": summary.wall_seconds,
            "compute_seconds": summary.compute_seconds, "stall_seconds": summary.stall_seconds,
            "loop_seconds": summary.loop_seconds, "drain_seconds": summary.drain_seconds,
            "stuck_rounds": summary.stuck_rounds,
            "utilization": summary.utilization, "rounds_complete": summary.rounds_complete,
            "rounds_partial": summary.rounds_partial, "rounds_failed": summary.rounds_failed,
            "rounds_applied": summary.rounds_applied, "repairs": summary.repairs, "bytes_sent": summary.bytes_sent,
            "bytes_received": summary.bytes_received, "final_train_loss": summary.final_train_loss,
            "applied": {k: v[0] for k, v in summary.applied.items()}, "method": method_cfg.name,
            "resumed_step": resumed_step, "synced_from": peer.synced_from, "loss_log": peer.loss_log,
            "loop_started": peer.loop_started, "eval_seconds": summary.eval_seconds, "val_log": peer.val_log,
            "round_seconds": list(peer.runner.stats.seconds) if peer.runner is not None else [],
        }, indent=2))


@app.command()
def bootstrap(
    host_maddrs: HostMaddrs = None,
    announce_maddrs: AnnounceMaddrs = None,
    identity: Annotated[Path | None, typer.Option("--identity", help="Private key file (created if missing): a stable address across restarts.")] = None,
    initial_peers: InitialPeers = None,
    maddrs_file: Annotated[Path | None, typer.Option("--maddrs-file", help="Write the multiaddrs here once listening.")] = None,
    log_level: LogOpt = None,
) -> None:
    """Run a DHT-only node: the run's well-known entry point. Prints its multiaddrs; Ctrl-C stops it."""
    import asyncio

    from .net.swarm import SwarmConfig, SwarmError, start_p2p
    from .ui import console, setup_logging

    setup_logging(log_level)
    cfg = SwarmConfig(host_maddrs=list(host_maddrs or ["/ip4/0.0.0.0/tcp/31337"]),
                      announce_maddrs=list(announce_maddrs or []), identity_path=str(identity) if identity else None,
                      initial_peers=list(initial_peers or []))

    async def main() -> None:
        p2p, node = await start_p2p(cfg)
        try:
            maddrs = [str(a) for a in await p2p.get_visible_maddrs()]
            if maddrs_file:
                maddrs_file.write_text("\n".join(maddrs) + "\n")
            console.print(f"p2ptrain {__version__} · bootstrap node {p2p.peer_id}", highlight=False)
            for a in maddrs:
                print(a, flush=True)
            console.print("peers join with: p2ptrain join " + " ".join(f"--initial-peers {a}" for a in maddrs),
                          highlight=False, soft_wrap=True)
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            await stop.wait()
        finally:
            await node.shutdown()
            await p2p.shutdown()

    try:
        asyncio.run(main())
    except SwarmError as e:
        raise fail(str(e), 1) from None


@app.command()
def status(
    initial_peers: InitialPeers = None,
    run_id: Annotated[str, typer.Option("--run-id", help="The run to show.")] = "p2ptrain",
    json_mode: Annotated[bool, typer.Option("--json", help="Print the peers as JSON once and exit.")] = False,
    watch: Annotated[bool, typer.Option("--watch", help="Refresh the table until Ctrl-C.")] = False,
    interval: Annotated[float, typer.Option("--interval", help="Seconds between refreshes.")] = 2.0,
    swarm_key_file: SwarmKeyOpt = None,
    log_level: LogOpt = None,
) -> None:
    """Show the swarm of a run as the DHT sees it: peers, regions, step, loss, tokens/s, bandwidth."""
    import asyncio

    from rich.live import Live

    from .net.swarm import HivemindTransport, SwarmConfig, SwarmError
    from .ui import out, setup_logging, table

    setup_logging(log_level)
    if not initial_peers:
        raise fail("status needs --initial-peers of a live peer or bootstrap node")
    from .net.auth import SwarmKey

    try:
        key = SwarmKey.load(swarm_key_file) if swarm_key_file else None
    except ValueError as e:
        raise fail(str(e)) from None
    cfg = SwarmConfig(run_id=run_id, initial_peers=list(initial_peers), client_mode=True, connect_attempts=3,
                      swarm_key=key)

    def rows(peers: list[Any]) -> list[list[Any]]:
        from hivemind.utils import get_dht_time

        now = get_dht_time()
        return [[p.peer_id[-12:], p.region or "-", p.method or "-", p.step, p.loss, round(p.tokens_per_second),
                 f"{p.bandwidth * 8 / 1e6:.1f} Mbit/s" if p.bandwidth else "-",
                 f"{max(0.0, now - (p.expires - cfg.ttl)):.1f} s ago"] for p in peers]

    cols = ["peer", "region", "method", "step", "loss", "tok/s", "bandwidth", "last seen"]

    async def main() -> None:
        t = await HivemindTransport.create(cfg)
        try:
            peers = [p for p in await t.peers() if p.peer_id != t.peer_id]
            if json_mode:
                from hivemind.utils import get_dht_time

                now = get_dht_time()
                print(json.dumps([{"peer_id": p.peer_id, "region": p.region, "method": p.method, "step": p.step,
                                   "logical_step": p.logical_step, "loss": p.loss,
                                   "tokens_per_second": p.tokens_per_second,
                                   "bandwidth_bytes_per_second": p.bandwidth, "maddrs": p.maddrs,
                                   "expires": p.expires, "last_seen_seconds": max(0.0, now - (p.expires - cfg.ttl))}
                                  for p in peers], indent=2))
                return
            if not watch:
                out.print(table(f"run {run_id}: {len(peers)} peers", cols, rows(peers)))
                return
            with Live(console=out, refresh_per_second=2) as live:
                while True:
                    peers = [p for p in await t.peers() if p.peer_id != t.peer_id]
                    live.update(table(f"run {run_id}: {len(peers)} peers", cols, rows(peers)))
                    await asyncio.sleep(interval)
        finally:
            await t.aclose()

    try:
        asyncio.run(main())
    except SwarmError as e:
        raise fail(str(e), 1) from None
    except KeyboardInterrupt:
        pass


@app.command()
def keygen(path: Annotated[Path, typer.Argument(help="Where to write the new key (must not exist).")]) -> None:
    """Create a private swarm's key file (random, readable by you only). Give it to every peer of the run
    with --swarm-key; never commit it or paste it into logs."""
    from .net.auth import generate_key_file

    try:
        key = generate_key_file(path)
    except FileExistsError:
        raise fail(f"{path} exists: not overwriting a key") from None
    except OSError as e:
        raise fail(f"cannot write {path}: {e.strerror}") from None
    print(f"wrote {path} (fingerprint {key.fingerprint})")
