"""Regions on one machine: network namespaces, shaped links (tbf) and a userspace delay relay.

    python bench/testbed.py check                                   # 2 regions, 80 Mbit/s, 20 ms + 20 ms
    python bench/testbed.py check --region us:2:1gbit:100mbit:25ms --region eu:2:1gbit:100mbit:25ms
    python bench/testbed.py up --region us:2:1gbit:100mbit:50ms --region eu:1:-:50mbit:50ms --ports 31337
    python bench/testbed.py down                                    # kept (``up``) and crashed testbeds

Topology (one :class:`Testbed`, every name starts with ``p2tb``)::

    host us0 ─┐ host link (tbf both ways)           uplink (tbf both ways, one-way delay d_us)
    host us1 ─┼── gw-us ───────────────────────────┐
                                                   core (router + delay relay)
    host eu0 ──── gw-eu ───────────────────────────┘

* Every host is a namespace with its own veth to its region's gateway namespace; each
  region's gateway has one veth (the *uplink*) to the core router namespace. ``tbf``
  shapes egress only, so each shaped link gets a tbf on *both* ends: a host link of
  rate R carries R up and R down at once, like a full-duplex access link.
* Delay: the kernel here has no ``netem``, so delay comes from a userspace relay in
  the core. Every host has two addresses: its link address (``10.r.h.2``) and an
  *announce* address (``10.200.r.h``, on the host's loopback). Inside a region the
  gateway routes announce addresses straight to the host: no relay, no delay. From
  another region the packets reach the core, where the whole announce range is local:
  the relay accepts the TCP connection and forwards its bytes, in both directions, to
  the host's link address after ``d_r + d_s`` (the two uplinks' one-way delays, or a
  ``delays`` override per region pair). So a peer listens on ``0.0.0.0:PORT`` and
  announces ``/ip4/<announce address>/tcp/PORT`` (:meth:`Testbed.maddrs`).
* What the relay emulates and what it does not: data is delayed by exactly the
  configured one-way delay each way (RTT = 2·d) and still crosses both regions'
  shaped uplinks. TCP's own handshake (SYN) is not delayed, the sender's congestion
  control sees the short RTT to the relay (no slow start over the long path; the
  relay holds at most ``window_bytes`` per direction, like a receive window), and the
  relay costs CPU on this machine (Python, one event loop for all inter-region
  connections). Only TCP is relayed (p2ptrain and hivemind use TCP).

Teardown (``Testbed.down``, also on exceptions and Ctrl-C) kills every process the
testbed started and every process still inside its namespaces, then deletes the
namespaces (which deletes their veths). Namespaces of crashed runs (their owner's pid
is gone) are removed when the next testbed starts or by ``down``. Where namespaces
cannot be made (no root, no ``ip``), :func:`unavailable_reason` says why.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections import deque
from collections.abc import Coroutine
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "RegionSpec",
    "Testbed",
    "TestbedError",
    "TestbedSpec",
    "cleanup",
    "measure_rtt",
    "measure_throughput",
    "parse_rate",
    "parse_region",
    "unavailable_reason",
]

PREFIX = "p2tb"
THIS = Path(__file__).resolve()
RESULTS = THIS.parent / "results"
_ANNOUNCE = "10.200"  # announce addresses 10.200.r.h; host links 10.r.h.0/24; uplinks 10.250.r.0/24
_MAX_REGIONS, _MAX_HOSTS = 199, 250


class TestbedError(RuntimeError):
    """The testbed could not be built or used (the message names the command and its error)."""

    __test__ = False


# ---------------------------------------------------------------------------------------------- spec
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}


def parse_rate(text: str | float | None) -> float | None:
    """``"100mbit"``/``"1gbit"``/``"12.5mbps"`` (tc units) or a number of bit/s → bit/s; ``"-"``/None → unshaped."""
    if text is None or text in ("-", "", "none"):
        return None
    if isinstance(text, int | float):
        return float(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*", text.lower())
    if not m or m.group(2) not in {**_UNITS, "": 1}:
        raise ValueError(f"rate {text!r}: expected a number with a tc unit (bit, kbit, mbit, gbit, mbps), e.g. 100mbit")
    return float(m.group(1)) * _UNITS.get(m.group(2), 1)


def _parse_ms(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*", text.lower())
    if not m:
        raise ValueError(f"delay {text!r}: expected e.g. 25ms or 0.1s")
    return float(m.group(1)) * (1000.0 if m.group(2) == "s" else 1.0)


@dataclass(kw_only=True, frozen=True)
class RegionSpec:
    """One region: ``hosts`` namespaces behind a gateway, one uplink to the core.

    Attributes:
        name: short alphanumeric name; hosts are named ``<name>0``, ``<name>1``, ...
        hosts: number of hosts (1..250).
        host_rate: bit/s of each host's own link, both directions (None: unshaped).
        uplink_rate: bit/s of the region's link to the core, both directions (None: unshaped).
        delay_ms: one-way delay of the uplink; between regions r and s data takes d_r + d_s.
    """

    name: str
    hosts: int = 1
    host_rate: float | None = None
    uplink_rate: float | None = None
    delay_ms: float = 0.0

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", self.name):
            raise ValueError(f"region name {self.name!r}: 1-8 lowercase letters/digits, starting with a letter")
        if not 1 <= self.hosts <= _MAX_HOSTS:
            raise ValueError(f"region {self.name}: hosts must be in 1..{_MAX_HOSTS}, got {self.hosts}")
        for what, rate in (("host_rate", self.host_rate), ("uplink_rate", self.uplink_rate)):
            if rate is not None and not rate >= 8e3:
                raise ValueError(f"region {self.name}: {what} must be at least 8 kbit/s or None, got {rate}")
        if not 0.0 <= self.delay_ms <= 10_000:
            raise ValueError(f"region {self.name}: delay_ms must be in [0, 10000], got {self.delay_ms}")

    def host_names(self) -> list[str]:
        return [f"{self.name}{i}" for i in range(self.hosts)]


def parse_region(text: str) -> RegionSpec:
    """``NAME:HOSTS[:HOST_RATE[:UPLINK_RATE[:DELAY]]]``, e.g. ``us:2:1gbit:100mbit:25ms`` (``-``: unshaped)."""
    parts = text.split(":")
    if not 2 <= len(parts) <= 5:
        raise ValueError(f"region {text!r}: expected NAME:HOSTS[:HOST_RATE[:UPLINK_RATE[:DELAY]]]")
    parts += ["-"] * (5 - len(parts))
    return RegionSpec(name=parts[0], hosts=int(parts[1]), host_rate=parse_rate(parts[2]),
                      uplink_rate=parse_rate(parts[3]), delay_ms=0.0 if parts[4] == "-" else _parse_ms(parts[4]))


@dataclass(kw_only=True, frozen=True)
class TestbedSpec:
    """Regions and how they are joined.

    Attributes:
        regions: the regions (unique names).
        delays_ms: one-way delay per region pair ``{("us", "eu"): 80.0}`` (either order), replacing d_r + d_s.
        window_bytes: most bytes the relay holds per direction of a connection (an emulated receive window).
        burst_bytes: tbf bucket (None: max(64 KiB, 2 ms at the rate)).
        queue_ms: tbf queue length in ms at the rate (tbf ``latency``).
    """

    __test__ = False

    regions: tuple[RegionSpec, ...]
    delays_ms: dict[tuple[str, str], float] = field(default_factory=dict)
    window_bytes: int = 32 * 1024 * 1024
    burst_bytes: int | None = None
    queue_ms: float = 50.0

    def __post_init__(self) -> None:
        names = [r.name for r in self.regions]
        if not 1 <= len(names) <= _MAX_REGIONS:
            raise ValueError(f"a testbed needs 1..{_MAX_REGIONS} regions, got {len(names)}")
        if len(set(names)) != len(names):
            raise ValueError(f"region names must be unique: {names}")
        for (a, b), d in self.delays_ms.items():
            if a not in names or b not in names or a == b:
                raise ValueError(f"delays_ms key {(a, b)}: two different regions of {names}")
            if not 0.0 <= d <= 10_000:
                raise ValueError(f"delays_ms[{a},{b}] must be in [0, 10000], got {d}")
        if self.window_bytes < 64 * 1024:
            raise ValueError(f"window_bytes must be at least 64 KiB, got {self.window_bytes}")
        if self.queue_ms <= 0:
            raise ValueError(f"queue_ms must be positive, got {self.queue_ms}")

    def region(self, name: str) -> RegionSpec:
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(f"no region {name!r} (regions: {[r.name for r in self.regions]})")

    def delay(self, a: str, b: str) -> float:
        """One-way delay in ms between regions ``a`` and ``b`` (0 inside a region)."""
        if a == b:
            return 0.0
        for key in ((a, b), (b, a)):
            if key in self.delays_ms:
                return self.delays_ms[key]
        return self.region(a).delay_ms + self.region(b).delay_ms

    def hosts(self) -> list[str]:
        return [h for r in self.regions for h in r.host_names()]

    def region_of(self, host: str) -> RegionSpec:
        for r in self.regions:
            if host in r.host_names():
                return r
        raise KeyError(f"no host {host!r} (hosts: {self.hosts()})")

    def path_rate(self, a: str, b: str) -> float | None:
        """The narrowest configured rate on the path between hosts ``a`` and ``b`` (None: unshaped)."""
        ra, rb = self.region_of(a), self.region_of(b)
        rates = [ra.host_rate, rb.host_rate]
        if ra.name != rb.name:
            rates += [ra.uplink_rate, rb.uplink_rate]
        shaped = [r for r in rates if r is not None]
        return min(shaped) if shaped else None


# ---------------------------------------------------------------------------------------------- commands
def _cmd(*argv: str, check: bool = True, timeout: float = 30) -> str:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as e:
        raise TestbedError(f"{argv[0]} not found: install iproute2") from e
    except subprocess.TimeoutExpired as e:
        raise TestbedError(f"`{' '.join(argv)}` took more than {timeout:.0f} s") from e
    if check and p.returncode != 0:
        raise TestbedError(f"`{' '.join(argv)}` failed: {p.stderr.strip() or p.stdout.strip()}")
    return p.stdout


def unavailable_reason() -> str | None:
    """None if network namespaces, veths and tbf can be made here, else why not (for a skip message)."""
    if sys.platform != "linux":
        return f"network namespaces need Linux (this is {sys.platform})"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "`ip` or `tc` (iproute2) is not installed"
    probe = f"{PREFIX}{os.getpid()}probe"
    try:
        _cmd("ip", "netns", "add", probe)
    except TestbedError as e:
        return f"cannot create a network namespace (root or CAP_SYS_ADMIN needed): {e}"
    try:
        _cmd("ip", "-n", probe, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1")
        _cmd("tc", "-n", probe, "qdisc", "add", "dev", "probe0", "root", "tbf", "rate", "10mbit", "burst", "32kb",
             "latency", "50ms")
    except TestbedError as e:
        return f"veth pairs or tbf shaping are not available: {e}"
    finally:
        _cmd("ip", "netns", "del", probe, check=False)
    return None


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _cmd("ip", "netns", "list", check=False).splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace(ns: str) -> None:
    """SIGKILL every process inside ``ns``, then delete it (its veths go with it)."""
    for _ in range(3):
        pids = [int(p) for p in _cmd("ip", "netns", "pids", ns, check=False).split() if p.isdigit()]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    _cmd("ip", "netns", "del", ns, check=False)


def cleanup(*, kept: bool = False, live: bool = False) -> list[str]:
    """Delete testbed namespaces whose owner process is gone, and kept (``up``) ones if ``kept``, and those of
    running processes if ``live``; returns their names."""
    gone = []
    for ns in _namespaces():
        if not ns.startswith(PREFIX):
            continue
        m = re.match(rf"{PREFIX}(\d+)x\d+-", ns)
        is_kept = ns.startswith(f"{PREFIX}keep")
        stale = m is not None and not _pid_alive(int(m.group(1)))
        if stale or (kept and is_kept) or (live and not is_kept):
            _kill_namespace(ns)
            gone.append(ns)
    return gone


# ---------------------------------------------------------------------------------------------- testbed
_counter = 0


class Testbed:
    """A running set of namespaces for a :class:`TestbedSpec` (a context manager; see the module docstring).

    ``with Testbed(spec) as tb: p = tb.run("us0", [...])``. ``keep=True`` leaves everything up after the
    ``with`` (``python bench/testbed.py down`` removes it). TestbedError if a command fails while building
    (everything built so far is removed first).
    """

    __test__ = False

    def __init__(self, spec: TestbedSpec, *, keep: bool = False) -> None:
        global _counter
        _counter += 1
        self.spec, self.keep = spec, keep
        self.tag = f"{PREFIX}keep{os.getpid()}x{_counter}" if keep else f"{PREFIX}{os.getpid()}x{_counter}"
        self.procs: list[subprocess.Popen[Any]] = []
        self._made: list[str] = []
        self._relay: subprocess.Popen[str] | None = None
        self._ports: dict[str, int] = {}
        self._exposed: set[tuple[str, int]] = set()
        self._up = False

    # ------------------------------------------------------------------ names and addresses
    @property
    def hosts(self) -> list[str]:
        return self.spec.hosts()

    def ns(self, host: str) -> str:
        """The namespace of ``host`` (or of ``"core"`` / ``"gw-<region>"``)."""
        if host != "core" and not host.startswith("gw-"):
            self.spec.region_of(host)  # KeyError for an unknown host
        return f"{self.tag}-{host}"

    def _index(self, host: str) -> tuple[int, int]:
        r = self.spec.region_of(host)
        return [x.name for x in self.spec.regions].index(r.name) + 1, r.host_names().index(host) + 1

    def addr(self, host: str) -> str:
        """The address others dial to reach ``host`` (through the delay relay from other regions)."""
        r, h = self._index(host)
        return f"{_ANNOUNCE}.{r}.{h}"

    def link_addr(self, host: str) -> str:
        """The address of ``host``'s own link (reached without the relay; not for peers to announce)."""
        r, h = self._index(host)
        return f"10.{r}.{h}.2"

    def maddrs(self, host: str, port: int | None = None) -> tuple[list[str], list[str]]:
        """``(host_maddrs, announce_maddrs)`` for a libp2p peer on ``host``: listen on ``0.0.0.0:port`` (never on
        the announce address: dials reuse the listen address as source) and announce ``addr(host):port``.
        ``port`` None: the next free one of this host. The relay is told to forward the port from other regions."""
        if port is None:
            port = self._ports.get(host, 31330) + 1
            self._ports[host] = port
        self.expose(host, port)
        return [f"/ip4/0.0.0.0/tcp/{port}"], [f"/ip4/{self.addr(host)}/tcp/{port}"]

    def expose(self, host: str, port: int) -> None:
        """Make ``addr(host):port`` reachable from other regions (the relay listens there and forwards)."""
        if (host, port) in self._exposed or len(self.spec.regions) < 2:
            return
        if self._relay is None or self._relay.poll() is not None:
            raise TestbedError("the delay relay is not running")
        assert self._relay.stdin is not None and self._relay.stdout is not None
        self._relay.stdin.write(json.dumps({"listen": [self.addr(host), port, self.link_addr(host), port,
                                                       self.spec.region_of(host).name]}) + "\n")
        self._relay.stdin.flush()
        answer = self._relay.stdout.readline().strip()
        if answer != "ok":
            raise TestbedError(f"the delay relay could not listen on {self.addr(host)}:{port}: {answer or 'exited'}")
        self._exposed.add((host, port))

    def partition(self, region: str, cut: bool = True) -> None:
        """Cut ``region`` off from the others (``cut``) or heal it: packets between its hosts and the rest are
        dropped silently both ways (a blackhole route in its gateway and in the core; no ICMP, like a cut
        cable), while its own hosts still reach each other. Connections open across the cut stall until
        their own timeouts; those not yet dead resume when it heals."""
        if not self._up:
            raise TestbedError("the testbed is not up")
        ri = [r.name for r in self.spec.regions].index(self.spec.region(region).name) + 1
        gw, core = self.ns(f"gw-{region}"), self.ns("core")
        if cut:
            _cmd("ip", "-n", gw, "route", "replace", "blackhole", "default")
            _cmd("ip", "-n", core, "route", "replace", "blackhole", f"10.{ri}.0.0/16")
        else:
            _cmd("ip", "-n", gw, "route", "replace", "default", "via", f"10.250.{ri}.1")
            _cmd("ip", "-n", core, "route", "replace", f"10.{ri}.0.0/16", "via", f"10.250.{ri}.2")

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Testbed:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.keep:
            self.down()

    def _netns(self, name: str) -> str:
        ns = f"{self.tag}-{name}"
        _cmd("ip", "netns", "add", ns)
        self._made.append(ns)
        _cmd("ip", "-n", ns, "link", "set", "lo", "up")
        return ns

    def _veth(self, ns_a: str, if_a: str, addr_a: str, ns_b: str, if_b: str, addr_b: str, rate: float | None) -> None:
        _cmd("ip", "link", "add", if_a, "netns", ns_a, "type", "veth", "peer", "name", if_b, "netns", ns_b)
        for ns, dev, addr in ((ns_a, if_a, addr_a), (ns_b, if_b, addr_b)):
            _cmd("ip", "-n", ns, "addr", "add", addr, "dev", dev)
            _cmd("ip", "-n", ns, "link", "set", dev, "up")
            if rate is not None:
                self._shape(ns, dev, rate)

    def _shape(self, ns: str, dev: str, rate: float) -> None:
        burst = self.spec.burst_bytes or max(64 * 1024, int(rate / 8 * 0.002))
        _cmd("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{int(rate)}bit", "burst",
             str(burst), "latency", f"{self.spec.queue_ms:g}ms")

    def up(self) -> None:
        """Build the namespaces, links, routes and shaping, and start the relay (see the module docstring)."""
        if self._up:
            return
        reason = None if os.geteuid() == 0 else "network namespaces need root"
        if reason:
            raise TestbedError(reason)
        cleanup()
        if not self.keep:
            atexit.register(self.down)
        self._up = True
        try:
            core = self._netns("core")
            _cmd("ip", "netns", "exec", core, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            _cmd("ip", "-n", core, "route", "add", "local", f"{_ANNOUNCE}.0.0/16", "dev", "lo")
            for ri, region in enumerate(self.spec.regions, start=1):
                gw = self._netns(f"gw-{region.name}")
                _cmd("ip", "netns", "exec", gw, "sysctl", "-qw", "net.ipv4.ip_forward=1")
                self._veth(gw, "uplink", f"10.250.{ri}.2/24", core, f"r{ri}", f"10.250.{ri}.1/24", region.uplink_rate)
                _cmd("ip", "-n", gw, "route", "add", "default", "via", f"10.250.{ri}.1")
                _cmd("ip", "-n", core, "route", "add", f"10.{ri}.0.0/16", "via", f"10.250.{ri}.2")
                for hi, host in enumerate(region.host_names(), start=1):
                    ns = self._netns(host)
                    self._veth(ns, "eth0", f"10.{ri}.{hi}.2/24", gw, f"h{hi}", f"10.{ri}.{hi}.1/24", region.host_rate)
                    _cmd("ip", "-n", ns, "addr", "add", f"{_ANNOUNCE}.{ri}.{hi}/32", "dev", "lo")
                    _cmd("ip", "-n", ns, "route", "add", "default", "via", f"10.{ri}.{hi}.1")
                    _cmd("ip", "-n", gw, "route", "add", f"{_ANNOUNCE}.{ri}.{hi}/32", "via", f"10.{ri}.{hi}.2")
            if len(self.spec.regions) > 1:
                self._start_relay(core)
        except BaseException:
            self.down()
            raise

    def _start_relay(self, core: str) -> None:
        cfg = {"regions": {r.name: f"10.{i}." for i, r in enumerate(self.spec.regions, start=1)},
               "delays": {a.name: {b.name: self.spec.delay(a.name, b.name) for b in self.spec.regions}
                          for a in self.spec.regions},
               "window": self.spec.window_bytes, "keep": self.keep}
        self._relay = subprocess.Popen(
            ["ip", "netns", "exec", core, sys.executable, str(THIS), "_relay", json.dumps(cfg)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, start_new_session=True)
        self.procs.append(self._relay)
        assert self._relay.stdout is not None
        if self._relay.stdout.readline().strip() != "ready":
            raise TestbedError("the delay relay did not start (see its stderr above)")

    def run(self, host: str, argv: list[str], **popen: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside ``host``'s namespace (``ip netns exec``, own process group); killed on teardown."""
        if not self._up:
            raise TestbedError("the testbed is not up")
        popen.setdefault("start_new_session", True)
        p = subprocess.Popen(["ip", "netns", "exec", self.ns(host), *argv], **popen)
        self.procs.append(p)
        return p

    def down(self) -> None:
        """Kill every process started here or still inside the namespaces, delete the namespaces. Idempotent."""
        if not self._up:
            return
        self._up = False
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 3
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.05, deadline - time.monotonic()))
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(2)
        for ns in reversed(self._made):
            _kill_namespace(ns)
        self._made.clear()
        atexit.unregister(self.down)


# ---------------------------------------------------------------------------------------------- delay relay
def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float, window: int) -> None:
    """Copy ``reader`` to ``writer``, each chunk released ``delay`` seconds after it arrived; hold ≤ ``window`` bytes."""
    loop = asyncio.get_running_loop()
    queue: deque[tuple[float, bytes]] = deque()
    held, more, room = 0, asyncio.Event(), asyncio.Event()

    async def pump_in() -> None:
        nonlocal held
        while True:
            while held >= window:
                room.clear()
                await room.wait()
            data = await reader.read(256 * 1024)
            queue.append((loop.time() + delay, data))
            held += len(data)
            more.set()
            if not data:
                return

    async def pump_out() -> None:
        nonlocal held
        while True:
            while not queue:
                more.clear()
                await more.wait()
            due, data = queue.popleft()
            if (wait := due - loop.time()) > 0:
                await asyncio.sleep(wait)
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()
            held -= len(data)
            room.set()

    await _both(pump_in(), pump_out())


async def _both(first: Coroutine[Any, Any, None], second: Coroutine[Any, Any, None]) -> None:
    """Run two coroutines until both end; when one raises, cancel the other and raise. (With a bare gather a
    failed side left the other waiting on an event nobody would set: its task was then garbage-collected
    pending, printing "Task was destroyed but it is pending" and "coroutine ignored GeneratorExit".)"""
    tasks = [asyncio.ensure_future(first), asyncio.ensure_future(second)]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            if not t.cancelled() and (e := t.exception()) is not None:
                raise e
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _relay_main(cfg: dict[str, Any]) -> None:
    prefixes: dict[str, str] = cfg["regions"]
    delays: dict[str, dict[str, float]] = cfg["delays"]
    window = int(cfg["window"])
    servers: list[asyncio.Server] = []
    # The connections' handler tasks, held here: the server keeps only a weak path to them, and a pending one
    # collected by the GC printed "Task was destroyed but it is pending" and "coroutine ignored GeneratorExit"
    # (its finally awaits) in the churn runs' logs. Held, they end or are cancelled when the relay ends.
    handlers: set[asyncio.Task[Any]] = set()

    def region_of(ip: str) -> str | None:
        for name, prefix in prefixes.items():
            if ip.startswith(prefix):
                return name
        return None

    async def serve(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter, target: tuple[str, int],
                    dst_region: str) -> None:
        peer = client_w.get_extra_info("peername")
        if peer is None:  # the client went away before it was served
            client_w.close()
            return
        src = region_of(peer[0])
        delay = (delays[src][dst_region] if src is not None else 0.0) / 1000.0
        _nodelay(client_w)
        try:
            target_r, target_w = await asyncio.wait_for(asyncio.open_connection(*target), 10)
        except (OSError, TimeoutError):
            client_w.close()
            return
        _nodelay(target_w)
        try:
            await _both(_forward(client_r, target_w, delay, window), _forward(target_r, client_w, delay, window))
        except (OSError, ConnectionError, RuntimeError):  # RuntimeError: uvloop's write to a closed transport
            pass
        finally:
            for w in (client_w, target_w):
                w.close()

    async def control() -> None:
        reader = asyncio.StreamReader()
        await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        print("ready", flush=True)
        while line := await reader.readline():
            vip, port, tip, tport, region = json.loads(line)["listen"]

            async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, _t: tuple[str, int] = (tip, tport),
                              _reg: str = region) -> None:
                task = asyncio.current_task()
                if task is not None:
                    handlers.add(task)
                try:
                    await serve(r, w, _t, _reg)
                finally:
                    handlers.discard(task)  # type: ignore[arg-type]

            try:
                servers.append(await asyncio.start_server(handler, vip, port, limit=1 << 20))
                print("ok", flush=True)
            except OSError as e:
                print(f"error {e}", flush=True)

    await control()
    if cfg.get("keep"):  # stdin closed (the `up` command exited): keep relaying until killed
        await asyncio.Event().wait()


# ---------------------------------------------------------------------------------------------- measurements
def _listen(port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(4)
    return s


def _connect(addr: str, port: int, timeout: float = 10.0) -> socket.socket:
    deadline = time.monotonic() + timeout
    while True:
        try:
            s = socket.create_connection((addr, port), timeout=timeout)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return s
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _sink(port: int, nbytes: int) -> dict[str, float]:
    """Receive ``nbytes`` on one connection; rate from the first to the last byte (the path's delay excluded)."""
    with _listen(port) as srv:
        print("listening", flush=True)
        conn, _ = srv.accept()
        with conn:
            got, first, t_first = 0, 0, 0.0
            while got < nbytes:
                chunk = conn.recv(1 << 20)
                if not chunk:
                    break
                if got == 0:
                    t_first, first = time.monotonic(), len(chunk)
                got += len(chunk)
            t_last = time.monotonic()
            conn.sendall(b"k")
    # (t_first/t_last on the system-wide monotonic clock: measure_flows spans several sinks' with them)
    return {"bytes": got, "seconds": t_last - t_first, "bits_per_s": 8 * (got - first) / max(1e-9, t_last - t_first),
            "t_first": t_first, "t_last": t_last, "first": first}


def _source(addr: str, port: int, nbytes: int) -> dict[str, float]:
    buf = b"\0" * (1 << 20)
    with _connect(addr, port) as s:
        t0, left = time.monotonic(), nbytes
        while left > 0:
            left -= s.send(buf[: min(left, len(buf))])
        s.recv(1)
    return {"bytes": nbytes, "seconds": time.monotonic() - t0}


def _echo(port: int) -> None:
    with _listen(port) as srv:
        print("listening", flush=True)
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)


def _ping(addr: str, port: int, count: int, size: int) -> dict[str, Any]:
    msg = b"p" * size
    rtts = []
    with _connect(addr, port) as s:
        for _ in range(count + 2):  # the first two warm the path (connection set-up through the relay)
            t0 = time.monotonic()
            s.sendall(msg)
            got = 0
            while got < size:
                chunk = s.recv(size - got)
                if not chunk:
                    raise ConnectionError("echo closed")
                got += len(chunk)
            rtts.append(time.monotonic() - t0)
    rtts = rtts[2:]
    return {"rtts": rtts, "rtt": statistics.median(rtts)}


def _helper(tb: Testbed, host: str, args: list[str]) -> subprocess.Popen[str]:
    return tb.run(host, [sys.executable, str(THIS), *args], stdout=subprocess.PIPE, text=True)


def _result(p: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        raise TestbedError(f"measurement helper did not finish within {timeout:.0f} s") from None
    if p.returncode != 0:
        raise TestbedError(f"measurement helper failed with exit code {p.returncode}")
    return json.loads(out.strip().splitlines()[-1])


_port = 9000


def _next_port() -> int:
    global _port
    _port += 1
    return _port


def _start_sink(tb: Testbed, dst: str, nbytes: int) -> tuple[int, subprocess.Popen[str]]:
    """A sink of ``nbytes`` listening on ``dst`` (reachable from other regions): its port and process."""
    port = _next_port()
    tb.expose(dst, port)
    sink = _helper(tb, dst, ["_sink", str(port), str(nbytes)])
    assert sink.stdout is not None
    if sink.stdout.readline().strip() != "listening":
        raise TestbedError("the sink did not start")
    return port, sink


def measure_throughput(tb: Testbed, src: str, dst: str, nbytes: int = 8 << 20, timeout: float = 60) -> dict[str, Any]:
    """Bulk TCP from ``src`` to ``dst`` (dialled at its announce address, like a peer would); bit/s at the receiver."""
    port, sink = _start_sink(tb, dst, nbytes)
    source = _helper(tb, src, ["_source", tb.addr(dst), str(port), str(nbytes)])
    res = _result(sink, timeout)
    res["sender"] = _result(source, 10)
    return res


def measure_flows(tb: Testbed, pairs: list[tuple[str, str]], nbytes: int = 8 << 20,
                  timeout: float = 120) -> dict[str, float]:
    """Bulk TCP on every (src, dst) of ``pairs`` at once (a pair may repeat: more flows); per source region, bit/s of
    its flows together, from the first byte any of them received to the last (the path's delay excluded). The
    ceiling of an exchange whose flows cross both ways at once (a hierarchical round's step across regions)."""
    sinks = []
    for src, dst in pairs:
        port, sink = _start_sink(tb, dst, nbytes)
        sinks.append((src, dst, port, sink))
    sources = [_helper(tb, src, ["_source", tb.addr(dst), str(port), str(nbytes)]) for src, dst, port, _ in sinks]
    got = [(src, _result(sink, timeout)) for src, _, _, sink in sinks]
    for source in sources:
        _result(source, 30)
    out: dict[str, float] = {}
    for region in sorted({tb.spec.region_of(src).name for src, _ in got}):
        mine = [r for src, r in got if tb.spec.region_of(src).name == region]
        span = max(r["t_last"] for r in mine) - min(r["t_first"] for r in mine)
        out[region] = 8 * sum(r["bytes"] - r["first"] for r in mine) / max(1e-9, span)
    return out


def measure_rtt(tb: Testbed, src: str, dst: str, count: int = 20, size: int = 64, timeout: float = 60) -> dict[str, Any]:
    """Median round trip of ``size``-byte messages from ``src`` to an echo on ``dst``: ``rtt`` s, ``one_way`` s."""
    port = _next_port()
    tb.expose(dst, port)
    echo = _helper(tb, dst, ["_echo", str(port)])
    assert echo.stdout is not None
    if echo.stdout.readline().strip() != "listening":
        raise TestbedError("the echo server did not start")
    res = _result(_helper(tb, src, ["_ping", tb.addr(dst), str(port), str(count), str(size)]), timeout)
    echo.wait(5)
    res["one_way"] = res["rtt"] / 2
    return res


# ---------------------------------------------------------------------------------------------- CLI
def _spec_from(args: argparse.Namespace) -> TestbedSpec:
    regions = tuple(parse_region(r) for r in (args.region or ["a:1:-:80mbit:20ms", "b:1:-:80mbit:20ms"]))
    return TestbedSpec(regions=regions, queue_ms=args.queue_ms)


def _check(args: argparse.Namespace) -> None:
    from p2ptrain.ui import out, table

    spec = _spec_from(args)
    pairs: list[tuple[str, str]] = []
    for r in spec.regions:  # inside each region with 2+ hosts, then between each pair of regions
        if r.hosts > 1:
            pairs.append((r.host_names()[0], r.host_names()[1]))
    for i, a in enumerate(spec.regions):
        for b in spec.regions[i + 1:]:
            pairs.append((a.host_names()[0], b.host_names()[0]))
    rows, records = [], []
    with Testbed(spec) as tb:
        for a, b in pairs:
            rate = spec.path_rate(a, b)
            delay = spec.delay(spec.region_of(a).name, spec.region_of(b).name)
            ping = measure_rtt(tb, a, b, count=args.pings)
            thr = [measure_throughput(tb, s, d, int(args.mbytes * 1e6)) for s, d in ((a, b), (b, a))]
            rec = {"from": a, "to": b, "rate_bits": rate, "delay_ms": delay, "one_way_ms": 1000 * ping["one_way"],
                   "rtt_ms": [1000 * x for x in ping["rtts"]], "measured_bits": [t["bits_per_s"] for t in thr]}
            records.append(rec)
            for (s, d), t in zip(((a, b), (b, a)), thr, strict=True):
                rows.append([f"{s} → {d}", "-" if rate is None else f"{rate / 1e6:g}",
                             f"{t['bits_per_s'] / 1e6:.1f}", "-" if rate is None else f"{t['bits_per_s'] / rate:.3f}",
                             f"{delay:g}", f"{1000 * ping['one_way']:.1f}",
                             f"{1000 * ping['one_way'] / delay:.3f}" if delay else "-"])
    result = {"spec": asdict(spec) | {"delays_ms": {f"{a}-{b}": d for (a, b), d in spec.delays_ms.items()}},
              "mbytes": args.mbytes, "pairs": records, "machine": _machine()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    out.print(f"wrote {args.out}")
    out.print(table("testbed check: bulk TCP and small-message RTT/2 through the links",
                    ["path", "rate Mbit/s", "measured", "ratio", "delay ms", "measured", "ratio"], rows))


def _machine() -> dict[str, Any]:
    import platform

    return {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "kernel": platform.release()}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0].startswith("_"):  # helpers run inside namespaces
        cmd, rest = argv[0], argv[1:]
        if cmd == "_relay":
            try:
                import uvloop

                uvloop.install()
            except ImportError:
                pass
            with contextlib.suppress(KeyboardInterrupt):
                asyncio.run(_relay_main(json.loads(rest[0])))
        elif cmd == "_sink":
            print(json.dumps(_sink(int(rest[0]), int(rest[1]))), flush=True)
        elif cmd == "_source":
            print(json.dumps(_source(rest[0], int(rest[1]), int(rest[2]))), flush=True)
        elif cmd == "_echo":
            _echo(int(rest[0]))
        elif cmd == "_ping":
            print(json.dumps(_ping(rest[0], int(rest[1]), int(rest[2]), int(rest[3]))), flush=True)
        else:
            raise SystemExit(f"unknown helper {cmd}")
        return

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, text in (("up", "build a testbed and leave it up (with its relay)"),
                       ("check", "build a testbed, measure throughput and delay of its links, print a table")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--region", action="append",
                       help="NAME:HOSTS[:HOST_RATE[:UPLINK_RATE[:DELAY]]], e.g. us:2:1gbit:100mbit:25ms (repeat; "
                            "default: a:1:-:80mbit:20ms and b:1:-:80mbit:20ms)")
        p.add_argument("--queue-ms", type=float, default=50.0, help="tbf queue length in ms at the rate")
        if name == "up":
            p.add_argument("--ports", default="", help="comma-separated ports to relay between regions on every host")
        else:
            p.add_argument("--mbytes", type=float, default=8.0, help="MB per throughput measurement")
            p.add_argument("--pings", type=int, default=20)
            p.add_argument("--out", type=Path, default=RESULTS / "testbed_check.json")
    d = sub.add_parser("down", help="remove kept and crashed testbeds (--all: also those of running processes)")
    d.add_argument("--all", action="store_true")
    args = ap.parse_args(argv)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # teardown runs on SIGTERM as on Ctrl-C
    if args.cmd == "down":
        gone = cleanup(kept=True, live=args.all)
        print("removed: " + (" ".join(gone) or "nothing"))
        return
    if (reason := unavailable_reason()) is not None:
        raise SystemExit(f"testbed unavailable: {reason}")
    if args.cmd == "check":
        _check(args)
        return
    tb = Testbed(_spec_from(args), keep=True)
    tb.up()
    for host in tb.hosts:
        for port in filter(None, args.ports.split(",")):
            tb.expose(host, int(port))
        print(f"{host}: ip netns exec {tb.ns(host)} ...   announce {tb.addr(host)}   link {tb.link_addr(host)}")
    print(f"remove with: python {Path(sys.argv[0]).as_posix()} down")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the testbed is already torn down (the `with` / atexit ran)
        raise SystemExit("interrupted: testbed removed") from None
