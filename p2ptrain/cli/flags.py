"""The flags of ``train``, ``simulate`` and ``join``, each declared once as a dataclass field.

A field's ``Annotated`` typer option makes it a command-line option (see ``options.flags_command``);
the dataclass itself is plain, so the config functions (``config.py``) take it, or a dict of the
same keys, without typer. ``--config`` and ``--log-level`` are added to every such command.
"""

# No ``from __future__ import annotations``: typer reads these annotations as objects.

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from .choices import METHODS, Aggregation, Clock, Method, Schedule
from .options import (
    AnnounceMaddrs,
    BatchSizeOpt,
    CodecOpt,
    DataOpt,
    DeviceOpt,
    HOpt,
    InitFromOpt,
    InitialPeers,
    JsonOpt,
    LogToOpt,
    LrOpt,
    MetricsPortOpt,
    POpt,
    PresetOpt,
    QuietOpt,
    ResumeOpt,
    SeqLenOpt,
    SwarmKeyOpt,
    TokenizerOpt,
)

__all__ = ["SIM_METHODS", "JoinFlags", "SimulateFlags", "TrainFlags"]

#: What ``simulate`` compares without ``--method``.
SIM_METHODS = "single,diloco,streaming,cocodc"


@dataclass(kw_only=True)
class TrainFlags:
    """``p2ptrain train``: one peer, local, no network."""

    preset_name: PresetOpt = None
    steps: Annotated[int | None, typer.Option("--steps", "-n", show_default="300", help="Total inner steps.")] = None
    data: DataOpt = None
    tokenizer: TokenizerOpt = None
    init_from: InitFromOpt = None
    seq_len: SeqLenOpt = None
    checkpoint_dir: Annotated[str | None, typer.Option("--checkpoint-dir", help="Where to write checkpoints.")] = None
    resume: ResumeOpt = False
    batch_size: BatchSizeOpt = None
    lr: LrOpt = None
    seed: Annotated[int | None, typer.Option("--seed", show_default="0", help="Seed of model init and data stream.")] = None
    eval_every: Annotated[int | None, typer.Option("--eval-every", show_default="100", help="Inner steps between validation evaluations (0: only at the end).")] = None
    device: DeviceOpt = None
    json_out: JsonOpt = None
    log_to: LogToOpt = None
    quiet: QuietOpt = False


@dataclass(kw_only=True)
class SimulateFlags:
    """``p2ptrain simulate``: several methods on M virtual peers with a virtual WAN clock."""

    method: Annotated[str | None, typer.Option("--method", "-m", show_default=SIM_METHODS, help=f"The methods to compare, comma-separated: single (one peer, no sync), {', '.join(METHODS)}.")] = None
    methods: Annotated[str | None, typer.Option("--methods", hidden=True, help="The old spelling of --method.")] = None
    peers: Annotated[int | None, typer.Option("--peers", "-M", show_default="4", help="Virtual peers (unless --regions).")] = None
    steps: Annotated[int | None, typer.Option("--steps", "-n", show_default="300", help="Inner steps per peer.")] = None
    preset_name: PresetOpt = None
    data: DataOpt = None
    step_time: Annotated[str | None, typer.Option("--step-time", show_default="0.1s", help="Virtual time per inner step (e.g. 100ms), or 'measured'.")] = None
    regions: Annotated[str | None, typer.Option("--regions", help="NAME:PEERS:BANDWIDTH,... e.g. us:2:1gbit,eu:2:100mbit")] = None
    bandwidth: Annotated[str | None, typer.Option("--bandwidth", show_default="1gbit", help="Per-peer bandwidth without --regions (e.g. 100mbit).")] = None
    rtt: Annotated[str | None, typer.Option("--rtt", help="Round-trip time between regions, e.g. 120ms.")] = None
    H: HOpt = None
    P: POpt = None
    tau: Annotated[int | None, typer.Option("--tau", help="Overlap τ in inner steps (streaming, cocodc).")] = None
    codec: CodecOpt = None
    outer_lr: Annotated[float | None, typer.Option("--outer-lr", help="Outer learning rate η for every method.")] = None
    batch_size: BatchSizeOpt = None
    lr: LrOpt = None
    seed: Annotated[int | None, typer.Option("--seed", show_default="0", help="Seed of model init and data streams.")] = None
    eval_every: Annotated[int | None, typer.Option("--eval-every", show_default="25", help="Inner steps between evaluations of θ.")] = None
    target_loss: Annotated[float | None, typer.Option("--target-loss", help="Report steps/time to reach this validation loss.")] = None
    json_out: Annotated[Path | None, typer.Option("--json", help="Write all results as JSON to this file (-: standard output, the table goes to stderr).")] = None
    plot_dir: Annotated[Path | None, typer.Option("--plot-dir", help="Write PNG plots here.")] = None
    utilization_table: Annotated[bool, typer.Option("--utilization-table", help="Only print the bandwidth each method needs for 50–99% compute utilization (paper setting), no training.")] = False
    quiet: QuietOpt = False


@dataclass(kw_only=True)
class JoinFlags:
    """``p2ptrain join``: a swarm peer (one process, the whole model in stage namespaces, or pipeline stages)."""

    initial_peers: InitialPeers = None
    run_id: Annotated[str | None, typer.Option("--run-id", show_default="p2ptrain", help="The run to join (peers of one run find each other by it).")] = None
    region: Annotated[str | None, typer.Option("--region", help="This peer's location: peers of a region average among themselves, then one fragment a region crosses between regions. 'auto': measured from round-trip times to the live peers.")] = None
    flat_rounds: Annotated[bool, typer.Option("--flat-rounds", help="One all-reduce over every member, even across regions.")] = False
    max_group: Annotated[int | None, typer.Option("--max-group", show_default="32", help="The most peers one step of a round involves: larger regions average in cells of this many, then across cells.")] = None
    clock: Annotated[Clock | None, typer.Option("--clock", show_default="wall", help="Pace rounds by the swarm's shared wall clock, or by each peer's own inner steps (every peer waits for the slowest; every peer of a run must use the same).")] = None
    method: Annotated[Method | None, typer.Option("--method", "-m", show_default="streaming", help="The outer-loop method (every peer of a run runs the same).")] = None
    preset_name: PresetOpt = None
    steps: Annotated[int | None, typer.Option("--steps", "-n", show_default="300", help="Leave cleanly after this many inner steps.")] = None
    step_seconds: Annotated[float | None, typer.Option("--step-seconds", show_default="the swarm's, or measured", help="Round pacing: seconds per logical step.")] = None
    H: HOpt = None
    P: POpt = None
    tau: Annotated[int | None, typer.Option("--tau", show_default="the method's", help="Overlap τ in logical steps.")] = None
    codec: CodecOpt = None
    timeout: Annotated[float | None, typer.Option("--round-timeout", show_default="the method's", help="Seconds a round may take.")] = None
    data: DataOpt = None
    tokenizer: TokenizerOpt = None
    init_from: InitFromOpt = None
    seq_len: SeqLenOpt = None
    batch_size: BatchSizeOpt = None
    lr: LrOpt = None
    seed: Annotated[int | None, typer.Option("--seed", show_default="0", help="Model-init seed (the same on every peer).")] = None
    device: DeviceOpt = None
    host_maddrs: Annotated[list[str] | None, typer.Option("--host-maddrs", show_default="/ip4/127.0.0.1/tcp/0", help="Listen address(es); /ip4/0.0.0.0/tcp/PORT to be reached from other machines.")] = None
    announce_maddrs: AnnounceMaddrs = None
    identity: Annotated[Path | None, typer.Option("--identity", help="Private key file: a stable peer id and address (default with --checkpoint-dir: identity.key there).")] = None
    client_mode: Annotated[bool, typer.Option("--client-mode", help="Behind NAT: dial out only, reached through relays.")] = False
    use_auto_relay: Annotated[bool, typer.Option("--use-auto-relay", help="Look for libp2p relays to become reachable.")] = False
    no_relay: Annotated[bool, typer.Option("--no-relay", help="Disable libp2p circuit relays.")] = False
    no_direct: Annotated[bool, typer.Option("--no-direct", help="Send fragments over libp2p only (no direct TCP path).")] = False
    direct_port: Annotated[int, typer.Option("--direct-port", min=0, max=65535, help="TCP port of the direct path for fragments (0: any; behind a firewall, fix and open it).")] = 0
    direct_announce: Annotated[str | None, typer.Option("--direct-announce", help="host:port other peers should dial for the direct path (a public address).")] = None
    direct_congestion: Annotated[str | None, typer.Option("--direct-congestion", help="TCP congestion control of the direct path (e.g. cubic, bbr; 'system': the host's default).", show_default="cubic")] = None
    connect_attempts: Annotated[int, typer.Option("--connect-attempts", min=1, help="Tries (with backoff) when initial peers are unreachable.")] = 5
    join_window: Annotated[float | None, typer.Option("--join-window", show_default="2.0", help="Seconds a round leader waits for peers.")] = None
    min_step_seconds: Annotated[float | None, typer.Option("--min-step-seconds", help="Pad each inner step to this long (emulate a slower device).")] = None
    eval_every: Annotated[int | None, typer.Option("--eval-every", show_default="0", help="Evaluate θ every this many inner steps during the run (logged in --json as val_log; 0: only at the end).")] = None
    metrics_port: MetricsPortOpt = None
    metrics_host: Annotated[str, typer.Option("--metrics-host", help="Address of the metrics endpoint.")] = "127.0.0.1"
    swarm_key_file: SwarmKeyOpt = None
    aggregation: Annotated[Aggregation, typer.Option("--aggregation", help="How this peer averages what it receives (the robust ones need 3 contributions).")] = "mean"
    norm_bound: Annotated[float | None, typer.Option("--norm-bound", help="Refuse updates with a norm over this many times the round's median (off by default).")] = None
    checkpoint_dir: Annotated[Path | None, typer.Option("--checkpoint-dir", help="Write checkpoints here (every --checkpoint-every rounds, every --checkpoint-seconds and on leave).")] = None
    checkpoint_every: Annotated[int | None, typer.Option("--checkpoint-every", show_default="10", help="Applied rounds between checkpoints.")] = None
    checkpoint_seconds: Annotated[float | None, typer.Option("--checkpoint-seconds", show_default="300", help="Also write one after this many seconds of training since the last (a kill loses at most about this much).")] = None
    resume: ResumeOpt = False
    json_out: JsonOpt = None
    log_to: LogToOpt = None
    maddrs_file: Annotated[Path | None, typer.Option("--maddrs-file", help="Write this peer's multiaddrs here once listening.")] = None
    quiet: QuietOpt = False
    run_stages: Annotated[int | None, typer.Option("--run-stages", help="S_run: the run's stage groups of the model, each synced in its own namespace (every peer of the run gives the same; default: --pipeline-stages).")] = None
    pipeline_stages: Annotated[int, typer.Option("--pipeline-stages", help="S: pipeline processes of this peer (one GPU each); S must divide S_run.")] = 1
    microbatches: Annotated[int, typer.Option("--micro-batches", min=0, show_default="S", help="M: micro-batches per batch in the pipeline (0: S).")] = 0
    pipeline_schedule: Annotated[Schedule, typer.Option("--pipeline-schedule", help="The pipeline's schedule of micro-batches.")] = "1f1b"
    pipeline_timeout: Annotated[float, typer.Option("--pipeline-timeout", help="Seconds a collective between this peer's stages may wait (a dead stage fails the others after it).")] = 600.0
    compile_blocks: Annotated[bool, typer.Option("--compile", help="Compile the transformer blocks with torch.compile (worth it on a GPU).")] = False
    untie_embeddings: Annotated[bool, typer.Option("--untie-embeddings", help="Separate input embedding and output head (needed for S_run > 1).")] = False
