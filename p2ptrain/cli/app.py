"""The ``p2ptrain`` typer app: the one object every command registers on, ``--version``, and ``run``."""

from __future__ import annotations

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


def run() -> None:
    """The console-script entry point: run the app on ``sys.argv`` (it exits with the command's code)."""
    app()
