"""The ``p2ptrain`` command line (typer): flags and a config file -> the run's configs -> the run.

``app.py`` holds the app; the command modules imported below register on it, once, and import nothing
from this package that imports them back. ``p2ptrain.cli:run`` is the console-script entry point.
"""

# The commands register in this order, the order --help lists them in.
from . import train, simulate, export, join, swarm  # noqa: I001, F401
from .app import app, run

__all__ = ["app", "run"]
