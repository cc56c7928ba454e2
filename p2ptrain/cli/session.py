"""The frame around a run, the same for a plain and a staged ``join``: the Prometheus endpoint, leaving on
SIGTERM/SIGINT, starting, the addresses others dial, the live status line, and the summary table and JSON
file at the end (``train`` writes its summary with :func:`report` too)."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from ..metrics import DEFAULT_METRICS_PORT, PeerMetrics
from .options import fail, failing
from .paths import STDOUT, write_json

if TYPE_CHECKING:
    from ..explog import ExperimentLog
    from ..peer import PeerBase

__all__ = ["METRICS_PORTS", "HeldSignal", "RunSession", "SessionPeer", "join_hint", "open_experiment_log", "report",
           "shutdown_grace", "visible_maddrs"]

#: How many ports from DEFAULT_METRICS_PORT (plus a stage's rank) are tried when none is given.
METRICS_PORTS = 16

log = logging.getLogger(__name__)

R = TypeVar("R")


def shutdown_grace(run: Any) -> float:
    """Seconds a peer of ``run`` (a JoinRun) may take to leave after a signal: the flush of its unsent progress
    (``leave_flush``), a round in flight the method's timeout, the drain its own, and the last checkpoint a minute
    (a 1B model's state, fsynced)."""
    return float(run.peer.leave_flush) + float(run.method.timeout) + float(run.peer.drain_timeout) + 60.0


class SessionPeer(Protocol[R]):
    """What a session drives: a Peer, or a StagedPeer (``run`` returns its summary, or one per stage group)."""

    on_status: Callable[[dict[str, Any]], None] | None

    def start(self) -> None: ...

    def run(self) -> R: ...

    def request_stop(self) -> None: ...

    def close(self) -> None: ...


class HeldSignal:
    """A SIGTERM or SIGINT that comes while a peer is being built (its imports, model and checkpoint: tens of
    seconds on a loaded machine), held until :meth:`RunSession.stop_on_signals` can act on it. Without it the
    signal's default action ends the process (exit code -15) before anything is saved: a resumed peer would
    lose what it trained while connecting, and a leave would not be a clean one. A second signal leaves at once
    (exit code 130). :meth:`arm` installs it; the session's own handlers replace it."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._saved: dict[int, Any] = {}

    def arm(self) -> HeldSignal:
        def hold(signum: int, _frame: Any) -> None:
            if self.signum is not None:
                raise SystemExit(130)
            self.signum = signum
            print(f"signal {signal.Signals(signum).name}: leaving once this peer has started (a second signal "
                  "leaves at once)", file=sys.stderr, flush=True)

        self._saved = {s: signal.signal(s, hold) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def disarm(self) -> None:
        """Put back the handlers from before :meth:`arm` (when the run is over, or for a process that hands the
        signals on itself)."""
        for s, h in self._saved.items():
            signal.signal(s, h)
        self._saved = {}


class RunSession:
    """One peer process's metrics (``self.metrics``, for the peer to fill) and the steps around its run."""

    def __init__(self, method: str, region: str) -> None:
        self.metrics = PeerMetrics(method=method, region=region)
        self._watchdog: threading.Timer | None = None  # armed by the first signal, disarmed once the peer left
        self.last_step = 0  # the inner step of the last status (what the final evaluation is logged at)

    def serve_metrics(self, requested: int | None, host: str, offset: int = 0) -> int | None:
        """Serve ``/metrics`` on ``host`` and print where; the port, or None when ``requested`` is negative
        (off). ``requested`` None: the first free of ``METRICS_PORTS`` ports from DEFAULT_METRICS_PORT +
        ``offset`` (a pipeline stage's rank); 0: any free port; N: port N + ``offset``. Fails (exit code 2,
        naming the flag to change) when that port, or every one tried, is taken."""
        if requested is not None and requested < 0:
            return None
        if requested is None:
            first, port = DEFAULT_METRICS_PORT + offset, None
            for candidate in range(first, first + METRICS_PORTS):
                if (port := self._try_serve(candidate, host)) is not None:
                    break
            if port is None:
                raise fail(f"ports {first}-{first + METRICS_PORTS - 1} are all taken; "
                           "pick one with --metrics-port, or -1 to turn metrics off")
        else:
            wanted = requested + offset if requested else 0
            try:
                port = self.metrics.serve(wanted, host)
            except OSError as e:
                raise fail(f"cannot serve metrics on {host}:{wanted} ({e.strerror}); "
                           "pick another --metrics-port, or -1 to turn them off") from None
        from ..ui import console

        console.print(f"metrics: http://{host}:{port}/metrics", highlight=False)
        return port

    def _try_serve(self, port: int, host: str) -> int | None:
        """The port if ``/metrics`` could be served there, None when it is taken."""
        try:
            return self.metrics.serve(port, host)
        except OSError:
            return None

    def stop_on_signals(self, peer: SessionPeer[Any], grace: float,
                        exit_now: Callable[[int], Any] = os._exit, held: HeldSignal | None = None) -> None:
        """On SIGTERM or SIGINT (Ctrl-C), say so and let ``peer`` leave cleanly after its current step; if it
        has not left ``grace`` seconds later (its rounds' timeout, the drain and a checkpoint), leave anyway
        (``exit_now``, exit code 124; not once the peer has left: the summary may take its time). A second signal leaves at once: SystemExit from the handler, so the
        ``finally`` blocks still close the network with their own bounded waits. A signal ``held`` from before
        (:class:`HeldSignal`) counts as the first one."""
        from ..ui import console

        signals = 0

        def watchdog() -> None:
            log.error("event=shutdown_overdue grace=%.0f: leaving without a clean shutdown", grace)
            console.print(f"still running {grace:.0f} s after the signal: leaving now", highlight=False)
            exit_now(124)

        def on_signal(signum: int, _frame: Any) -> None:
            nonlocal signals
            signals += 1
            name = signal.Signals(signum).name
            if signals > 1:
                console.print(f"signal {name} again: leaving now", highlight=False)
                raise SystemExit(130)
            console.print(f"signal {name}: leaving once the progress no round carries yet is sent, training on "
                          "meanwhile (a second signal leaves at once)", highlight=False)
            self._watchdog = threading.Timer(grace, watchdog)
            self._watchdog.daemon = True
            self._watchdog.start()
            peer.request_stop()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        if held is not None and held.signum is not None:  # it came while the peer was being built: act on it now
            on_signal(held.signum, None)

    @staticmethod
    def start(peer: SessionPeer[Any]) -> None:
        """Start ``peer`` (join the swarm); when it cannot, close it and fail with exit code 1 and the reason."""
        from ..net.swarm import SwarmError
        from ..peer.vitals import JoinRefused

        try:
            peer.start()
        except (SwarmError, JoinRefused) as e:
            peer.close()
            raise fail(str(e), 1) from None

    def run(self, peer: SessionPeer[R], quiet: bool, evaluate: Callable[[R], float],
            log: ExperimentLog | None = None, total: int | None = None) -> tuple[R, float]:
        """Run ``peer`` to the end (``total`` inner steps) with a live status line (in place on a terminal;
        none when ``quiet``), then the validation loss of θ by ``evaluate(result)``; the result and that loss.
        With a ``log`` (``--log-to``), every step's scalars and each evaluation of θ go there too. The metrics
        endpoint and the log close either way."""
        from ..ui import StatusLine

        line = StatusLine(total, quiet)
        peer.on_status = line.update if log is None else self._logging(peer, line.update, log)
        try:
            with line:
                result = peer.run()
            if self._watchdog is not None:  # the peer left: what remains is this process's own summary
                self._watchdog.cancel()
            val = evaluate(result)
            self.metrics.val_loss.set(val)
            if log is not None:
                log.log(self.last_step, {"loss/validation": val})
        finally:
            self.metrics.close()
            if log is not None:
                log.close()
        return result, val

    def _logging(self, peer: SessionPeer[Any], printer: Callable[[dict[str, Any]], None],
                 log: ExperimentLog) -> Callable[[dict[str, Any]], None]:
        """The status callback that also logs the step's scalars (from the metrics) and the evaluations of θ the
        peer made since the last step (its ``val_log``: wall time, step, loss, ...)."""
        from ..explog import peer_scalars

        said = 0

        def on_status(s: dict[str, Any]) -> None:
            nonlocal said
            printer(s)
            evals = list(getattr(peer, "val_log", ()))
            for entry in evals[said:]:
                log.log(int(entry[1]), {"loss/validation": float(entry[2])})
            said = len(evals)
            self.last_step = int(s["step"])
            log.log(self.last_step, peer_scalars(self.metrics.registry) | {"loss/train": float(s["loss"])})

        return on_status


def open_experiment_log(run: Any, peer_id: str, stage: str = "") -> ExperimentLog | None:
    """The ``--log-to`` sinks of a peer of ``run`` (a JoinRun; None without any): TensorBoard under
    ``DIR/<run id>/<peer id>`` (one run per peer), W&B as run ``<region>-<peer id>`` in the run's group.
    Exit code 2 when one cannot be opened; nothing has trained yet."""
    if not run.log_to:
        return None
    from ..explog import open_log

    short = peer_id[-8:] + stage
    config = {"command": "join", "run_id": run.peer.run_id, "region": run.peer.region, "method": run.method.name,
              "model": str(run.init.path) if run.init else run.preset, "peer_id": peer_id,
              "batch_size": run.trainer.batch_size, "lr": run.trainer.lr, "steps": run.peer.steps}
    with failing():
        return open_log(run.log_to, name=f"{run.peer.region or 'peer'}-{short}", group=run.peer.run_id,
                        subdir=f"{run.peer.run_id}/{short}", config=config)


def join_hint(maddrs: Sequence[str], run: Any, stages: str = "") -> str:
    """What another machine runs to join the run of this peer (``run``, a JoinRun; ``stages``: the flags of a
    staged run): this peer's addresses, the run, method and model every peer shares, a region of its own,
    the swarm key if the swarm is private; and, when every address is this machine's loopback, how to
    listen where others can reach it."""
    model = f"--init-from {run.init.path}" if run.init else f"--preset {run.preset}"
    key = " --swarm-key SWARM_KEY_FILE" if run.swarm.swarm_key is not None else ""
    text = ("another machine joins with (REGION: a label of its own):\n  p2ptrain join "
            + " ".join(f"--initial-peers {a}" for a in maddrs)
            + f" --run-id {run.peer.run_id} --method {run.method.name} {model}{stages} --region REGION{key}")
    if maddrs and all(_loopback(a) for a in maddrs):
        text += ("\n  (from this machine only: these are loopback addresses; to be reached from others, start "
                 "with --host-maddrs /ip4/0.0.0.0/tcp/PORT --announce-maddrs /ip4/PUBLIC_IP/tcp/PORT)")
    return text


def _loopback(maddr: str) -> bool:
    """Whether multiaddr ``maddr`` is an address on this machine's loopback (127.0.0.0/8, ::1)."""
    import ipaddress

    from .netargs import parse_maddr

    try:
        return any(ipaddress.ip_address(v).is_loopback for k, v in parse_maddr(maddr) if k in ("ip4", "ip6") and v)
    except ValueError:
        return False


def visible_maddrs(peers: Sequence[PeerBase], path: Path | None) -> list[str]:
    """The multiaddrs others dial to reach ``peers`` (started), written one a line to ``path`` if given;
    TimeoutError when a peer's transport does not tell them within 10 s."""
    maddrs = [a for p in peers for a in p.net.call(p.transport.visible_maddrs(), 10)]  # type: ignore[union-attr]
    if path is not None:
        path.write_text("\n".join(maddrs) + "\n")
    return maddrs


def report(title: str, rows: Sequence[Sequence[Any]], path: Path | None,
           record: Callable[[], dict[str, Any]]) -> None:
    """Print the run's summary ``rows`` as a table on stdout; with a ``path``, write ``record()`` there as JSON
    (``-``: on stdout, and the table on stderr, so that stdout is the JSON alone)."""
    from ..ui import console, out, table

    (console if path == STDOUT else out).print(table(title, ["", "value"], rows))
    if path is not None:
        write_json(path, json.dumps(record(), indent=2))
