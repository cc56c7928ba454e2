"""Bad flags, files, addresses and variables, through every subcommand as a user runs it: exit code 2, one line
on stderr, ``error: ...``, naming the problem, before anything starts, and never a traceback.

Every case runs through the console script's entry point (``p2ptrain.cli:run``) in this process, which pays
the imports once; the first case of each subcommand also runs as a ``p2ptrain`` process of its own (two at a
time), so the path a user takes, interpreter to exit code, is covered for each command. Each case gets a
safety net of flags that keeps it short should a check ever stop failing (``--steps 2``, no metrics server)."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWAupgdBAYgxcu6EbnoP2EGJvaFrwAo795BwSsmnG11agR"
#: Files the cases name (relative to the test's folder): written by the fixture below.
FILES = {"bad.key": b"garbage", "short.key": b"short", "bad.toml": b"steps = [", "file": b"a file, not a folder",
         "bad.ckpt": b"not a checkpoint"}

#: (command, arguments, what the error line must say). ``missing/`` is a folder that does not exist.
CASES: list[tuple[str, list[str], str]] = [
    ("train", ["--steps", "0"], "--steps must be at least 1, got 0"),
    ("train", ["--steps", "-3"], "--steps must be at least 1, got -3"),
    ("train", ["--steps", "many"], "'--steps'"),
    ("train", ["--preset", "huge"], "'huge'"),
    ("train", ["--lr", "-1"], "lr must be positive"),
    ("train", ["--batch-size", "0"], "batch_size must be at least 1"),
    ("train", ["--device", "nope"], "--device 'nope' is not a device"),
    ("train", ["--data", "missing/corpus.txt"], "--data missing/corpus.txt does not exist"),
    ("train", ["--tokenizer", "missing/tokenizer.json"], "--tokenizer missing/tokenizer.json does not exist"),
    ("train", ["--init-from", "missing/llama"], "--init-from missing/llama"),
    ("train", ["-c", "missing/r.toml"], "config file missing/r.toml does not exist"),
    ("train", ["-c", "bad.toml"], "config file bad.toml is not valid TOML"),
    ("train", ["--json", "missing/s.json"], "--json missing/s.json: the folder missing does not exist"),
    ("train", ["--checkpoint-dir", "file/ck"], "--checkpoint-dir file/ck: file is a file"),
    ("train", ["--resume"], "--resume needs --checkpoint-dir"),
    ("train", ["--log-level", "nope"], "'--log-level'"),
    ("train", ["--nope"], "No such option: --nope"),
    ("simulate", ["--steps", "0"], "--steps must be at least 1, got 0"),
    ("simulate", ["--steps", "-1"], "--steps must be at least 1, got -1"),
    ("simulate", ["-m", "nope"], "'nope'"),
    ("simulate", ["--rtt", "fast"], "'fast'"),
    ("simulate", ["--regions", "us:x"], "'us:x'"),
    ("simulate", ["--codec", "nope"], "'nope'"),
    ("simulate", ["--H", "0"], "H must be at least 1"),
    ("simulate", ["--peers", "0"], "peers must be at least 1"),
    ("simulate", ["--json", "missing/s.json"], "--json missing/s.json: the folder missing does not exist"),
    ("simulate", ["--plot-dir", "file"], "--plot-dir file is a file"),
    ("simulate", ["--log-level", "nope"], "'--log-level'"),
    ("join", ["--steps", "0"], "--steps must be at least 1, got 0"),
    ("join", ["--steps", "-3"], "--steps must be at least 1, got -3"),
    ("join", ["--initial-peers", "garbage"], "--initial-peers garbage: a multiaddr begins with /"),
    ("join", ["--initial-peers", "/ip4/127.0.0.1/tcp/9"], "no /p2p/<peer id>"),
    ("join", ["--initial-peers", "/ip4/127.0.0.1/tcp/9/p2p/QmUhcQ"], "'QmUhcQ' is not a peer id"),
    ("join", ["--host-maddrs", "/ip4/127.0.0.1/tcp/99999"], "--host-maddrs /ip4/127.0.0.1/tcp/99999"),
    ("join", ["--announce-maddrs", "/ip4/1.2.3.4/tcp/0"], "--announce-maddrs /ip4/1.2.3.4/tcp/0: port 0"),
    ("join", ["--announce-maddrs", "garbage"], "--announce-maddrs garbage"),
    ("join", ["--identity", "bad.key"], "--identity bad.key: not a libp2p private key"),
    ("join", ["--identity", "missing/id.key"], "--identity missing/id.key: the folder missing does not exist"),
    ("join", ["--swarm-key", "short.key"], "swarm key short.key: too short"),
    ("join", ["--swarm-key", "missing/swarm.key"], "swarm key missing/swarm.key: cannot read it"),
    ("join", ["--method", "nope"], "'nope'"),
    ("join", ["--codec", "nope"], "'nope'"),
    ("join", ["--aggregation", "nope"], "'nope'"),
    ("join", ["--norm-bound", "0.5"], "norm_bound must be above 1"),
    ("join", ["--metrics-port", "70000"], "'--metrics-port'"),
    ("join", ["--connect-attempts", "0"], "'--connect-attempts'"),
    ("join", ["--device", "nope"], "--device 'nope' is not a device"),
    ("join", ["--json", "missing/s.json"], "--json missing/s.json: the folder missing does not exist"),
    ("join", ["--maddrs-file", "missing/m"], "--maddrs-file missing/m: the folder missing does not exist"),
    ("join", ["--data", "missing/corpus.txt"], "--data missing/corpus.txt does not exist"),
    ("join", ["--run-stages", "0"], "--run-stages and --pipeline-stages must be at least 1"),
    ("join", ["-c", "bad.toml"], "config file bad.toml is not valid TOML"),
    ("join", ["--log-level", "nope"], "'--log-level'"),
    ("bootstrap", ["--host-maddrs", "garbage"], "--host-maddrs garbage: a multiaddr begins with /"),
    ("bootstrap", ["--announce-maddrs", "/ip4/1.2.3.4/tcp/0"], "--announce-maddrs /ip4/1.2.3.4/tcp/0: port 0"),
    ("bootstrap", ["--announce-maddrs", "garbage"], "--announce-maddrs garbage"),
    ("bootstrap", ["--identity", "bad.key"], "--identity bad.key: not a libp2p private key"),
    ("bootstrap", ["--initial-peers", "garbage"], "--initial-peers garbage"),
    ("bootstrap", ["--maddrs-file", "missing/m"], "--maddrs-file missing/m: the folder missing does not exist"),
    ("bootstrap", ["--log-level", "nope"], "'--log-level'"),
    ("status", [], "status needs --initial-peers"),
    ("status", ["--initial-peers", "garbage"], "--initial-peers garbage"),
    ("status", ["--initial-peers", PEER, "--swarm-key", "short.key"], "swarm key short.key: too short"),
    ("status", ["--initial-peers", PEER, "--interval", "0"], "'--interval'"),
    ("status", ["--log-level", "nope"], "'--log-level'"),
    ("export", ["--out", "o"], "Missing option '--checkpoint'"),
    ("export", ["--checkpoint", "missing/ck", "--out", "o"], "--checkpoint missing/ck: cannot read"),
    ("export", ["--checkpoint", "bad.ckpt", "--out", "o"], "--checkpoint bad.ckpt: truncated"),
    ("export", ["--checkpoint", "bad.ckpt", "--out", "o", "--dtype", "nope"], "'--dtype'"),
    ("export", ["--checkpoint", "bad.ckpt", "--out", "o", "--template", "missing/t"], "--template missing/t does not exist"),
    ("export", ["--checkpoint", "bad.ckpt", "--out", "o", "--log-level", "nope"], "'--log-level'"),
    ("keygen", ["bad.key"], "bad.key exists: not overwriting a key"),
    ("keygen", ["missing/k"], "cannot write missing/k"),
    ("keygen", [], "Missing argument 'path'"),
]

#: Flags that keep a command short if its check ever stops failing.
SAFETY = {"train": ["--steps", "2", "-q"], "simulate": ["--steps", "2", "-q"],
          "join": ["--steps", "2", "-q", "--metrics-port", "-1", "--connect-attempts", "1"]}


def _argv(command: str, args: list[str]) -> list[str]:
    safety = list(SAFETY.get(command, []))
    for flag in ("--steps", "--metrics-port"):  # the case's own value, not the safety net's
        if flag in args and flag in safety:
            del safety[safety.index(flag):safety.index(flag) + 2]
    return [command, *safety, *args]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding FILES, where the cases run."""
    tmp = tmp_path_factory.mktemp("bad_inputs")
    for name, data in FILES.items():
        (tmp / name).write_bytes(data)
    return tmp


#: The first case of each subcommand: also run as a process of its own.
AS_PROCESS = sorted({c: i for i, (c, _, _) in reversed(list(enumerate(CASES)))}.values())


@pytest.fixture(scope="module")
def processes(folder: Path) -> Iterator[dict[int, tuple[int, str, str]]]:
    """The AS_PROCESS cases, each a ``python -m p2ptrain`` process, two at a time: exit code, stdout, stderr."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("P2PTRAIN_")} | {"OMP_NUM_THREADS": "1"}

    def run(index: int) -> tuple[int, str, str]:
        command, args, _ = CASES[index]
        r = subprocess.run([sys.executable, "-m", "p2ptrain", *_argv(command, args)], cwd=folder, env=env,
                           capture_output=True, text=True, timeout=120)
        return r.returncode, r.stdout, r.stderr

    with ThreadPoolExecutor(2) as pool:
        yield dict(zip(AS_PROCESS, pool.map(run, AS_PROCESS), strict=True))


def _check(index: int, code: object, out: str, err: str) -> None:
    expected = CASES[index][2]
    everything = out + err
    assert "Traceback" not in everything, everything[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, f"exit {code}: {everything[-2000:]}"
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-2000:]
    assert expected in lines[0], lines[0]
    assert out == "", out[-2000:]


def test_every_subcommand_is_covered() -> None:
    import typer

    from p2ptrain.cli import app

    assert {c for c, _, _ in CASES} == set(typer.main.get_command(app).commands)  # type: ignore[attr-defined]
    assert {CASES[i][0] for i in AS_PROCESS} == {c for c, _, _ in CASES}


@contextlib.contextmanager
def _logger_restored() -> Iterator[None]:
    """The ``p2ptrain`` logger as it was on entry, on exit: a command sets it up (``ui.setup_logging``: a handler
    on this test's captured stderr, propagation off), and left so, every later test's log lines went to a closed
    stream."""
    logger = logging.getLogger("p2ptrain")
    kept = (list(logger.handlers), logger.level, logger.propagate)
    try:
        yield
    finally:
        logger.handlers[:], logger.level, logger.propagate = kept


@pytest.fixture
def logger_kept() -> Iterator[None]:
    with _logger_restored():
        yield


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{c} {' '.join(a)}" for c, a, _ in CASES])
def test_a_bad_input_is_one_line_and_exit_code_2(folder: Path, index: int, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str], logger_kept: None) -> None:
    from p2ptrain.cli import run

    monkeypatch.chdir(folder)
    for name in [k for k in os.environ if k.startswith("P2PTRAIN_")]:
        monkeypatch.delenv(name)
    command, args, _ = CASES[index]
    with pytest.raises(SystemExit) as exited:
        run(_argv(command, args))
    captured = capsys.readouterr()
    _check(index, exited.value.code, captured.out, captured.err)


@pytest.mark.parametrize("index", AS_PROCESS, ids=[CASES[i][0] for i in AS_PROCESS])
def test_a_bad_input_to_a_p2ptrain_process_is_one_line_and_exit_code_2(
        processes: dict[int, tuple[int, str, str]], index: int) -> None:
    _check(index, *processes[index])


def test_the_cases_leave_the_logger_as_it_was(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A case that gets as far as setting up logging changes the package's logger; ``_logger_restored`` (the
    fixture every case runs in) puts it back."""
    from p2ptrain.cli import run

    logger = logging.getLogger("p2ptrain")
    before = (list(logger.handlers), logger.level, logger.propagate)
    monkeypatch.chdir(folder)
    with _logger_restored():
        with pytest.raises(SystemExit):
            run(["train", "--steps", "0", "--log-level", "INFO"])
        assert (list(logger.handlers), logger.level, logger.propagate) != before  # the command did set it up
    assert (list(logger.handlers), logger.level, logger.propagate) == before
