"""Build the runs of a ``p2ptrain simulate`` invocation from method names and shared knobs."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from ..algo.methods import METHODS, DDPConfig, MethodConfig, method_config
from .runner import RunSpec

__all__ = ["build_specs"]


def build_specs(methods: list[str], knobs: dict[str, Any], per_method: dict[str, dict[str, Any]] | None = None,
                *, single: bool = False) -> list[RunSpec]:
    """One RunSpec per method name; each takes the shared ``knobs`` it has a field for, then its
    own ``per_method[name]`` settings. ``single`` adds the one-worker baseline first."""
    specs: list[RunSpec] = []
    if single:
        specs.append(RunSpec("single", DDPConfig(), peers=1))
    for name in methods:
        if name == "single":
            specs.append(RunSpec("single", DDPConfig(), peers=1))
            continue
        if name not in METHODS:
            raise ValueError(f"unknown method {name!r}; choose from single, {', '.join(METHODS)}")
        own = {f.name for f in fields(METHODS[name])}
        vals = {k: v for k, v in knobs.items() if k in own and v is not None}
        vals.update((per_method or {}).get(name, {}))
        cfg: MethodConfig = method_config(name, **vals)
        specs.append(RunSpec(name, cfg))
    return specs
