"""Fragments: disjoint groups of whole model units that together cover the model.

Streaming DiLoCo (arXiv 2501.18512) synchronises one fragment at a time. A unit
is an indivisible group of parameters (the embedding, one transformer block, the
final norm, the head); a fragment is a set of units:

* ``strided``: unit k of the non-empty units goes to fragment ``k mod P`` (the
  paper's slightly better choice: each fragment spans the depth of the model);
* ``sequential``: contiguous runs of units of near-equal count.

Every peer builds the same fragments from the same model, so fragment ids agree
across the swarm without any communication.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["Fragment", "TensorSpec", "make_fragments"]


@dataclass(frozen=True)
class TensorSpec:
    """One parameter tensor inside a fragment's flat vector."""

    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Fragment:
    """Fragment ``index``: its units and the layout of its parameters in one flat vector."""

    index: int
    units: tuple[str, ...]
    specs: tuple[TensorSpec, ...]

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return [s.shape for s in self.specs]

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.specs)

    def flatten(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Concatenate ``tensors`` (in spec order) into one flat fp32 vector."""
        if len(tensors) != len(self.specs):
            raise ValueError(f"fragment {self.index}: expected {len(self.specs)} tensors, got {len(tensors)}")
        return torch.cat([t.reshape(-1).float() for t in tensors])

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` shaped like the fragment's tensors."""
        if flat.numel() != self.numel:
            raise ValueError(f"fragment {self.index}: expected {self.numel} values, got {flat.numel()}")
        return [flat[s.offset : s.offset + s.numel].view(s.shape) for s in self.specs]


def make_fragments(units: Sequence[tuple[str, Sequence[tuple[str, tuple[int, ...]]]]], num_fragments: int,
                   mode: Literal["strided", "sequential"] = "strided") -> list[Fragment]:
    """Split ``units`` — ``[(unit name, [(param name, shape), ...]), ...]`` in model order —
    into ``P = num_fragments`` fragments.

    Raises ValueError if P is not in ``[1, number of non-empty units]`` or the mode is unknown.
    """
    nonempty = [(u, list(ps)) for u, ps in units if ps]
    if not 1 <= num_fragments <= len(nonempty):
        raise ValueError(
            f"the number of fragments P={num_fragments} must be between 1 and the model's "
            f"{len(nonempty)} units (embedding, blocks, norm, head)"
        )
    if mode == "strided":
        assign = [k % num_fragments for k in range(len(nonempty))]
    elif mode == "sequential":
        assign = [k * num_fragments // len(nonempty) for k in range(len(nonempty))]
    else:
        raise ValueError(f"fragment mode must be 'strided' or 'sequential', got {mode!r}")
    out = []
    for p in range(num_fragments):
        members = [nonempty[k] for k in range(len(nonempty)) if assign[k] == p]
        specs, offset = [], 0
        for _, params in members:
            for name, shape in params:
                spec = TensorSpec(name, tuple(shape), offset)
                specs.append(spec)
                offset += spec.numel
        out.append(Fragment(p, tuple(u for u, _ in members), tuple(specs)))
    return out


def model_units(model: torch.nn.Module) -> list[tuple[str, list[tuple[str, tuple[int, ...]]]]]:
    """``[(unit, [(param, shape)])]`` of a model with a ``units()`` method (see ``p2ptrain.model``)."""
    params = dict(model.named_parameters())
    return [(u, [(n, tuple(params[n].shape)) for n in names]) for u, names in model.units()]  # type: ignore[operator]
