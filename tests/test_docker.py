"""The container images: the CPU image built and run (a peer configured by environment variables alone) where
a docker engine answers; skipped with the reason elsewhere. Their pins are checked everywhere."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
IMAGE = "p2ptrain-test:latest"


def _engine() -> str | None:
    """Why docker cannot be used here (None: it can)."""
    if shutil.which("docker") is None:
        return "no docker command"
    try:
        r = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "docker info did not answer within 30 s"
    if r.returncode != 0:
        return f"no docker engine: `docker info` fails ({' '.join(r.stderr.split())[:160]})"
    return None


def test_images_pin_the_readme_s_torch_and_run_p2ptrain() -> None:
    pin = re.search(r"pip install torch==([\d.]+)", (ROOT / "README.md").read_text())
    assert pin is not None
    for name in ("Dockerfile", "Dockerfile.cuda"):
        text = (ROOT / name).read_text()
        assert f"pip install torch=={pin.group(1)} --index-url" in text, name
        assert 'ENTRYPOINT ["p2ptrain"]' in text and "pip install ." in text, name
    assert "download.pytorch.org/whl/cpu" in (ROOT / "Dockerfile").read_text()
    assert "FROM python:3.11-slim" in (ROOT / "Dockerfile").read_text()
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert "*" in ignore and {"!pyproject.toml", "!README.md", "!p2ptrain/"} <= set(ignore)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_cpu_image_builds_and_a_peer_runs_from_environment_variables() -> None:
    reason = _engine()
    if reason is not None:
        pytest.skip(reason)
    build = subprocess.run(["docker", "build", "-t", IMAGE, "-f", "Dockerfile", "."], cwd=ROOT, capture_output=True,
                           text=True, timeout=3000)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    try:
        r = subprocess.run(["docker", "run", "--rm", IMAGE, "--version"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.startswith("p2ptrain "), r.stderr
        env = {"P2PTRAIN_PRESET": "micro", "P2PTRAIN_STEPS": "5", "P2PTRAIN_RUN_ID": "docker-test",
               "P2PTRAIN_QUIET": "1", "P2PTRAIN_METRICS_PORT": "-1", "OMP_NUM_THREADS": "1"}
        cmd = ["docker", "run", "--rm", *[a for k, v in env.items() for a in ("-e", f"{k}={v}")], IMAGE, "join"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "inner steps" in r.stdout and "run docker-test" in r.stderr
    finally:
        subprocess.run(["docker", "image", "rm", "-f", IMAGE], capture_output=True, timeout=120)
