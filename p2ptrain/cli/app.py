"""The ``p2ptrain`` typer app: the one object every command registers on, ``--version``, and ``run``."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from .. import __version__

__all__ = ["app", "run"]

app = typer.Typer(
    name="p2ptrain",
    help="Decentralized peer-to-peer training of language models (DiLoCo family) over a libp2p DHT.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def version_callback(value: bool) -> None:
    """Print the version and exit when ``--version`` is given."""
    if value:
        typer.echo(f"p2ptrain {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[bool, typer.Option("--version", callback=version_callback, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """p2ptrain: train language models across regions, clouds and volunteer GPUs, no coordinator."""


def _usage_errors() -> tuple[type[Exception], ...]:
    """The exceptions a bad flag, value or variable raises: click's, or those of the click typer carries."""
    found: list[type[Exception]] = [typer.TyperException] if hasattr(typer, "TyperException") else []
    try:
        import click

        found.append(click.ClickException)
    except ImportError:
        pass
    return tuple(found)


def old_spellings(argv: list[str]) -> list[str]:
    """``argv`` with the old spellings that no longer parse rewritten to today's: ``join --resume DIR`` (now
    ``--checkpoint-dir DIR --resume``, as in ``train``) and a bare ``status --json`` (now ``--json -``: like
    every ``--json``, it names a file, ``-`` for standard output). Unambiguous: a switch takes no value, and
    ``--json`` always needs one."""
    command, out = argv[:1], []
    rest = argv[1:]
    for i, arg in enumerate(rest):
        before, after = rest[i - 1] if i else None, rest[i + 1] if i + 1 < len(rest) else None
        if command == ["join"] and arg.startswith("--resume="):
            out += ["--checkpoint-dir", arg.split("=", 1)[1], "--resume"]
        elif command == ["join"] and before == "--resume" and not arg.startswith("-"):
            out[-1:] = ["--checkpoint-dir", arg, "--resume"]
        elif command == ["status"] and arg == "--json" and (after is None or (after.startswith("-") and after != "-")):
            out += ["--json", "-"]
        else:
            out.append(arg)
    return command + out


def run(argv: list[str] | None = None) -> None:
    """The console-script entry point: run the app on ``argv`` (default ``sys.argv[1:]``) and exit with the
    command's code. A bad flag, value or variable is one line, ``error: ...``, on stderr and exit code 2, like
    the errors the commands raise themselves (``options.fail``); bare ``p2ptrain`` prints the help."""
    try:
        args = old_spellings(sys.argv[1:] if argv is None else argv)
        code = app(args=args, prog_name="p2ptrain", standalone_mode=False)
    except _usage_errors() as e:
        code = getattr(e, "exit_code", 2)
        if type(e).__name__ == "NoArgsIsHelpError":
            e.show()  # type: ignore[attr-defined]
        else:
            ctx = getattr(e, "ctx", None)
            hint = f" (see: {ctx.command_path} --help)" if ctx is not None else ""
            message = (e.format_message() if hasattr(e, "format_message") else str(e)).replace("Value error, ", "")
            print(f"error: {' '.join(message.split())}{hint}", file=sys.stderr)
    except typer.Abort:  # Ctrl-C or end of input at a prompt
        code = 130
    sys.exit(code if isinstance(code, int) else 0)
