"""matplotlib is an optional extra: peers run without it; plotting without it says how to install it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from p2ptrain.cli.config import simulate_config
from p2ptrain.plot import PLOT_EXTRA, pyplot
from p2ptrain.settings import ConfigError


def test_without_matplotlib_plotting_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setattr("p2ptrain.plot.available", lambda: False)
    with pytest.raises(ImportError, match=r'pip install -e "\.\[plot\]"'):
        pyplot()
    with pytest.raises(ConfigError, match=r"--plot-dir needs matplotlib"):
        simulate_config({}, {"plot_dir": tmp_path / "plots"})
    assert simulate_config({}, {}).plot_dir is None  # no plots asked for: nothing needs it
    assert PLOT_EXTRA in 'pip install -e ".[plot]"'


def test_a_peer_s_modules_import_without_matplotlib() -> None:
    script = ("import sys\n"
              "sys.modules['matplotlib'] = None\n"
              "import p2ptrain.cli, p2ptrain.cli.join, p2ptrain.cli.config, p2ptrain.peer, p2ptrain.net.swarm\n"
              "import p2ptrain.sim.runner, p2ptrain.sim.report, p2ptrain.single\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
