"""``p2ptrain bootstrap`` / ``status`` / ``keygen``: a run's entry point, its view from outside, its key."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Annotated, Any

import typer

from .. import __version__
from .app import app
from .netargs import check_identity, host_maddrs, initial_peers
from .options import AnnounceMaddrs, HostMaddrs, InitialPeers, LogOpt, SwarmKeyOpt, fail, failing, with_env_vars
from .paths import output_file, write_json

__all__ = ["bootstrap", "keygen", "status"]


@app.command()
@with_env_vars
def bootstrap(
    listen: HostMaddrs = None,
    announce: AnnounceMaddrs = None,
    identity: Annotated[Path | None, typer.Option("--identity", help="Private key file (created if missing): a stable address across restarts.")] = None,
    initial: InitialPeers = None,
    maddrs_file: Annotated[Path | None, typer.Option("--maddrs-file", help="Write the multiaddrs here once listening.")] = None,
    log_level: LogOpt = None,
) -> None:
    """Run a DHT-only node: the run's well-known entry point. Prints its multiaddrs; Ctrl-C stops it."""
    import asyncio

    from .. import aio
    from ..net.swarm import SwarmConfig, SwarmError, start_p2p
    from ..ui import console, setup_logging

    setup_logging(log_level)
    with failing():
        check_identity(identity)
        output_file("--maddrs-file", maddrs_file)
        cfg = SwarmConfig(host_maddrs=host_maddrs(listen) or ["/ip4/0.0.0.0/tcp/31337"],
                          announce_maddrs=host_maddrs(announce, announce=True),
                          identity_path=str(identity) if identity else None, initial_peers=initial_peers(initial))

    async def main() -> None:
        p2p, node, _ = await start_p2p(cfg)
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
        aio.run(main())
    except SwarmError as e:
        raise fail(str(e), 1) from None


@app.command()
@with_env_vars
def status(
    initial: InitialPeers = None,
    run_id: Annotated[str, typer.Option("--run-id", help="The run to show.")] = "p2ptrain",
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the peers as JSON to this file (-: standard output) once and exit.")] = None,
    watch: Annotated[bool, typer.Option("--watch", help="Refresh the table until Ctrl-C.")] = False,
    interval: Annotated[float, typer.Option("--interval", min=0.1, help="Seconds between refreshes.")] = 2.0,
    swarm_key_file: SwarmKeyOpt = None,
    log_level: LogOpt = None,
) -> None:
    """Show the swarm of a run as the DHT sees it: peers, regions, step, loss, tokens/s, bandwidth."""
    import asyncio

    from rich.live import Live

    from .. import aio
    from ..net.auth import SwarmKey
    from ..net.swarm import HivemindTransport, SwarmConfig, SwarmError
    from ..ui import out, setup_logging, table

    setup_logging(log_level)
    with failing():
        targets = initial_peers(initial)
        output_file("--json", json_out)
        key = SwarmKey.load(swarm_key_file) if swarm_key_file else None
    if not targets:
        raise fail("status needs --initial-peers of a live peer or bootstrap node")
    cfg = SwarmConfig(run_id=run_id, initial_peers=targets, client_mode=True, connect_attempts=3, swarm_key=key)

    def rows(peers: list[Any]) -> list[list[Any]]:
        return [[p.peer_id[-12:], p.region or "-", p.method or "-", p.step, p.loss, round(p.tokens_per_second),
                 f"{p.bandwidth * 8 / 1e6:.1f} Mbit/s" if p.bandwidth else "-", f"{p.last_seen:.1f} s ago"]
                for p in peers]

    cols = ["peer", "region", "method", "step", "loss", "tok/s", "bandwidth", "last seen"]

    async def main() -> None:
        async with await HivemindTransport.create(cfg) as t:
            peers = [p for p in await t.peers() if p.peer_id != t.peer_id]
            if json_out is not None:
                text = json.dumps([{"peer_id": p.peer_id, "region": p.region, "method": p.method, "step": p.step,
                                    "logical_step": p.logical_step, "loss": p.loss,
                                    "tokens_per_second": p.tokens_per_second,
                                    "bandwidth_bytes_per_second": p.bandwidth, "maddrs": p.maddrs,
                                    "expires": p.expires, "last_seen_seconds": p.last_seen}
                                   for p in peers], indent=2)
                write_json(json_out, text)
                return
            if not watch:
                out.print(table(f"run {run_id}: {len(peers)} peers", cols, rows(peers)))
                return
            with Live(console=out, refresh_per_second=2) as live:
                while True:
                    peers = [p for p in await t.peers() if p.peer_id != t.peer_id]
                    live.update(table(f"run {run_id}: {len(peers)} peers", cols, rows(peers)))
                    await asyncio.sleep(interval)

    try:
        aio.run(main())
    except SwarmError as e:
        raise fail(str(e), 1) from None
    except KeyboardInterrupt:
        pass


@app.command()
def keygen(path: Annotated[Path, typer.Argument(help="Where to write the new key (must not exist).")]) -> None:
    """Create a private swarm's key file (random, readable by you only). Give it to every peer of the run
    with --swarm-key; never commit it or paste it into logs."""
    from ..net.auth import generate_key_file

    try:
        key = generate_key_file(path)
    except FileExistsError:
        raise fail(f"{path} exists: not overwriting a key") from None
    except OSError as e:
        raise fail(f"cannot write {path}: {e.strerror}") from None
    print(f"wrote {path} (fingerprint {key.fingerprint})")
