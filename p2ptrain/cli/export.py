"""``p2ptrain export``: a checkpoint's trained θ as a Llama checkpoint folder."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .app import app
from .choices import Dtype
from .options import LogOpt, fail, failing, with_env_vars
from .paths import input_path

__all__ = ["export"]


@app.command()
@with_env_vars
def export(
    checkpoint: Annotated[Path, typer.Option("--checkpoint", help="A p2ptrain checkpoint file, or a folder of them (the newest is used).")],
    out: Annotated[Path, typer.Option("--out", help="Folder to write (must not exist or be empty).")],
    template: Annotated[Path | None, typer.Option("--template", help="The checkpoint folder the run started from (--init-from): its config keys, tensor dtypes and tokenizer files are kept.")] = None,
    dtype: Annotated[Dtype | None, typer.Option("--dtype", help="The tensors' dtype (default: the template's, else float32).")] = None,
    log_level: LogOpt = None,
) -> None:
    """Write a checkpoint's trained θ as a Llama checkpoint folder (config.json + model.safetensors)."""
    from ..checkpoint import CheckpointDir, CheckpointError, read_checkpoint
    from ..hf import HFError, export_hf
    from ..hf_run import read_params
    from ..ui import console, setup_logging

    setup_logging(log_level)
    with failing(CheckpointError, ValueError):
        input_path("--template", template)
    with failing(CheckpointError, ValueError, prefix="--checkpoint "):
        if checkpoint.is_dir():
            found = CheckpointDir(checkpoint).latest()
            if found is None:
                raise fail(f"--checkpoint {checkpoint}: no checkpoint there")
            path, state = found
        else:
            path, state = checkpoint, read_checkpoint(checkpoint)
        params, cfg = read_params(state)
    with failing(HFError, ValueError):
        written = export_hf(out, params, cfg, dtype=dtype, template=template)
    which = "outer parameters θ" if state.get("outer") else "model parameters"
    console.print(f"exported the {which} of {path} (step {state['trainer']['step']}) to {written}", highlight=False)
