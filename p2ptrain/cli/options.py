"""What the commands share: ``Annotated`` options, clean failures, commands made from a flags dataclass, and
the environment variable of every option (``--initial-peers`` <- ``P2PTRAIN_INITIAL_PEERS``).

Where a value comes from, first found wins: the flag, its ``P2PTRAIN_*`` variable, the TOML recipe
(``--config``), the default. A variable is read as the flag would be (click checks it the same way); a list
option's variable holds its values separated by spaces (or commas, for addresses).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from ..metrics import DEFAULT_METRICS_PORT
from .choices import Codec, LogLevel, Preset

__all__ = ["AnnounceMaddrs", "BatchSizeOpt", "CodecOpt", "ConfigOpt", "DataOpt", "DeviceOpt", "HOpt", "HostMaddrs", "InitFromOpt",
           "InitialPeers", "JsonOpt", "LogOpt", "LogToOpt", "LrOpt", "MetricsPortOpt", "POpt", "PresetOpt", "QuietOpt", "ResumeOpt", "SeqLenOpt",
           "SwarmKeyOpt", "TokenizerOpt", "env_var", "fail", "failing", "flags_command", "with_env", "with_env_vars"]

#: Every option ``--some-name`` is also read from ``P2PTRAIN_SOME_NAME``.
ENV_PREFIX = "P2PTRAIN_"

F = TypeVar("F")

ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="TOML recipe; flags and P2PTRAIN_* variables override it.")]
LogOpt = Annotated[LogLevel | None, typer.Option("--log-level", case_sensitive=False, help="How much to log on stderr.")]
PresetOpt = Annotated[Preset | None, typer.Option("--preset", "-p", show_default="tiny", help="Model preset (its architecture).")]
TokenizerOpt = Annotated[str | None, typer.Option("--tokenizer", help="A local tokenizer.json (or its folder) for text/.jsonl/.parquet data; default: bytes, or the --init-from folder's.")]
InitFromOpt = Annotated[str | None, typer.Option("--init-from", help="Start from a local Llama checkpoint folder (config.json + safetensors); sets the architecture.")]
SeqLenOpt = Annotated[int | None, typer.Option("--seq-len", help="Context length in tokens (caps an --init-from checkpoint's max_position_embeddings).")]
InitialPeers = Annotated[list[str] | None, typer.Option("--initial-peers", "-i", help="Multiaddr of a live peer or bootstrap node (repeatable).")]
HostMaddrs = Annotated[list[str] | None, typer.Option("--host-maddrs", help="Listen address(es), e.g. /ip4/0.0.0.0/tcp/31337.")]
AnnounceMaddrs = Annotated[list[str] | None, typer.Option("--announce-maddrs", help="Address(es) others should dial (public IP, explicit port).")]
SwarmKeyOpt = Annotated[Path | None, typer.Option("--swarm-key", help="A private swarm's shared key file (see `p2ptrain keygen`): only peers holding it are accepted.")]
DataOpt = Annotated[str | None, typer.Option("--data", show_default="the built-in corpus", help="Text file, folder, .jsonl/.parquet, or uint16 .bin tokens.")]
BatchSizeOpt = Annotated[int | None, typer.Option("--batch-size", show_default="16", help="Sequences per inner step.")]
LrOpt = Annotated[float | None, typer.Option("--lr", show_default="0.002", help="Peak inner learning rate (AdamW; warm-up, then cosine).")]
DeviceOpt = Annotated[str | None, typer.Option("--device", show_default="auto", help="Where the model trains: auto (cuda when present, else cpu), cpu, cuda, cuda:N.")]
HOpt = Annotated[int | None, typer.Option("--H", show_default="the method's", help="H: inner steps per round.")]
POpt = Annotated[int | None, typer.Option("--P", show_default="the method's", help="P: fragments synced in turn (streaming, cocodc).")]
CodecOpt = Annotated[Codec | None, typer.Option("--codec", show_default="the method's", help="Wire codec of the all-reduce.")]
JsonOpt = Annotated[Path | None, typer.Option("--json", help="Write the summary as JSON to this file (-: standard output, the table goes to stderr).")]
LogToOpt = Annotated[list[str] | None, typer.Option("--log-to", help="Also log the curves to tensorboard:DIR, wandb or wandb:PROJECT (repeatable; extras [tensorboard], [wandb]; WANDB_MODE=offline needs no network).")]
ResumeOpt = Annotated[bool, typer.Option("--resume", help="Continue from the newest checkpoint in --checkpoint-dir (start afresh when it has none).")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar or live status line.")]
MetricsPortOpt = Annotated[int | None, typer.Option("--metrics-port", min=-1, max=65535, help=f"Serve Prometheus metrics here (0: any free port, -1: off; default {DEFAULT_METRICS_PORT}, or the next free one when several peers share a machine).")]


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``error: message`` (as text: ``[model]`` is not markup) and return the Exit to raise."""
    from rich.markup import escape

    from ..ui import console

    # One line, however long (a log collector or a test reads it as one record).
    console.print(f"[bold red]error:[/] {escape(' '.join(message.split()))}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


@contextmanager
def failing(*errors: type[Exception], code: int = 2, prefix: str = "") -> Iterator[None]:
    """Turn an error of one of ``errors`` (default ValueError, which ConfigError, DataError and HFError are)
    raised inside the block into ``error: prefix + message`` and exit ``code``; anything else passes."""
    caught = errors or (ValueError,)
    try:
        yield
    except caught as e:
        raise fail(f"{prefix}{e}", code) from None


def env_var(option: str) -> str:
    """The environment variable of ``option`` (its long name): ``--initial-peers`` -> ``P2PTRAIN_INITIAL_PEERS``."""
    return ENV_PREFIX + option.lstrip("-").replace("-", "_").upper()


def with_env(annotation: Any) -> Any:
    """``Annotated[T, typer.Option(...)]`` with the option's ``P2PTRAIN_*`` variable set (a copy: the aliases
    above are shared by several commands); anything else as it is."""
    if typing.get_origin(annotation) is not Annotated:
        return annotation
    base, *meta = typing.get_args(annotation)
    out = []
    for info in meta:
        if isinstance(info, typer.models.OptionInfo) and info.envvar is None:
            # In ``Annotated``, typer.Option's first positional (``default``) is the first option name.
            names = [info.default, *(info.param_decls or ())]
            long = next(d for d in names if isinstance(d, str) and d.startswith("--"))
            info = copy.copy(info)
            info.envvar = env_var(long)
        out.append(info)
    return Annotated[(base, *out)]  # type: ignore[valid-type]


def with_env_vars(command: Callable[..., None]) -> Callable[..., None]:
    """``command`` (a typer command function) with every option readable from its ``P2PTRAIN_*`` variable."""
    hints = typing.get_type_hints(command, include_extras=True)
    sig = inspect.signature(command)
    params = [p.replace(annotation=with_env(hints.get(p.name, p.annotation))) for p in sig.parameters.values()]
    command.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params} | {"return": None}
    return command


def flags_command(app: typer.Typer,
                  flags: type[F]) -> Callable[[Callable[[dict[str, Any], F], None]], Callable[..., None]]:
    """Register ``body(file, flags)`` on ``app`` as a command named after it, whose options are the fields
    of the dataclass ``flags`` (each ``Annotated`` with its typer option), then ``--config`` and
    ``--log-level``, each also read from its ``P2PTRAIN_*`` variable. The command sets up logging, reads the config file (``{}`` without one) and calls the
    body with both; a bad log level or config file fails with exit code 2 before the body runs."""
    hints = typing.get_type_hints(flags, include_extras=True)
    params = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                                annotation=with_env(hints[f.name]))
              for f in dataclasses.fields(flags)]  # type: ignore[arg-type]
    params += [inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=with_env(ConfigOpt)),
               inspect.Parameter("log_level", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=with_env(LogOpt))]

    def register(body: Callable[[dict[str, Any], F], None]) -> Callable[..., None]:
        def command(**values: Any) -> None:
            from ..settings import load_file
            from ..ui import setup_logging

            config, log_level = values.pop("config"), values.pop("log_level")
            with failing():
                setup_logging(log_level)
                file = load_file(config)
            body(file, flags(**values))

        command.__name__, command.__qualname__, command.__doc__ = body.__name__, body.__qualname__, body.__doc__
        command.__module__ = body.__module__
        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params} | {"return": None}
        app.command()(command)
        return command

    return register
