"""matplotlib, an optional extra (``[plot]``): only the simulator's ``--plot-dir`` and the benchmarks plot, so
a peer installs and runs without it. Imported here, where a plot is drawn, with an error that says how to
install it."""

from __future__ import annotations

import importlib.util
from typing import Any

__all__ = ["PLOT_EXTRA", "available", "pyplot"]

PLOT_EXTRA = 'pip install -e ".[plot]"'


def available() -> bool:
    """Whether matplotlib is installed (without importing it)."""
    return importlib.util.find_spec("matplotlib") is not None


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend; ImportError naming the extra when it is missing."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError(f"plotting needs matplotlib, an optional extra: {PLOT_EXTRA}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
