"""The run's stage partition: contiguous groups of model units, one swarm namespace each.

DiLoCoX (arXiv 2506.21263) trains models too large for one device by making each
peer a pipeline-parallel cluster, and syncs each pipeline stage's slice of the
model only with the same stage of the other peers. Here the *run* fixes
``S_run`` contiguous stage groups of the model's units (``embed``, ``blocks.i``,
``norm``, ``head``): group k holds blocks ``[k·L/S_run, (k+1)·L/S_run)``, group 0
also the embedding, the last group also the final norm and the head. Each group
is its own swarm namespace (``<run>.stage<k>of<S_run>``) with its own fragments,
rounds and outer state, so fragments never straddle a stage and a member of
group k never holds the rest of the model.

A peer holds every group (one process, the whole model) or a contiguous range of
them (a pipeline stage process); either way it is a full member of exactly the
namespaces of the groups it holds. Tied embeddings would put one tensor in the
first and the last group, synced by two namespaces at different times: a run with
``S_run > 1`` refuses them (train with ``tie_embeddings = false``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .model import GPT, ModelConfig, rotary_tables

__all__ = ["StageModel", "StagePlan", "StageRange"]


@dataclass(frozen=True)
class StageRange:
    """The stage groups ``[first, stop)`` one process holds, and its pipeline place."""

    first: int
    stop: int
    rank: int  # pipeline rank of this process (0 for a one-process peer)
    world: int  # pipeline processes of this peer (1 for a one-process peer)

    @property
    def groups(self) -> range:
        return range(self.first, self.stop)


@dataclass(frozen=True)
class StagePlan:
    """``S_run`` contiguous stage groups of a model's units (identical on every peer of a run)."""

    groups: tuple[tuple[str, ...], ...]

    @classmethod
    def of(cls, cfg: ModelConfig, stages: int) -> StagePlan:
        """The run's partition of ``cfg``'s units into ``stages`` groups.

        Raises ValueError if ``stages`` is not in ``[1, n_layers]``, or if ``stages > 1`` with tied
        embeddings (the tied tensor would belong to two groups)."""
        if not 1 <= stages <= cfg.n_layers:
            raise ValueError(f"the run's stage groups S_run={stages} must be between 1 and the model's "
                             f"{cfg.n_layers} layers (every stage holds at least one block)")
        if stages > 1 and cfg.tie_embeddings:
            raise ValueError(
                f"S_run={stages} stage groups need untied embeddings: the tied tensor would sit in the first "
                "and the last stage, synced by two namespaces at different times (set [model] "
                "tie_embeddings = false, or --untie-embeddings)")
        L = cfg.n_layers
        out = []
        for k in range(stages):
            units = [f"blocks.{i}" for i in range(k * L // stages, (k + 1) * L // stages)]
            if k == 0:
                units.insert(0, "embed")
            if k == stages - 1:
                units += ["norm", "head"]
            out.append(tuple(units))
        return cls(tuple(out))

    @property
    def stages(self) -> int:
        return len(self.groups)

    def namespace(self, run_id: str, group: int) -> str:
        """The swarm namespace (run id of the DHT keys and protocols) of stage group ``group``."""
        if not 0 <= group < self.stages:
            raise ValueError(f"stage group {group} is not in [0, {self.stages})")
        return run_id if self.stages == 1 else f"{run_id}.stage{group}of{self.stages}"

    def held_by(self, rank: int, world: int) -> StageRange:
        """The groups held by pipeline process ``rank`` of ``world`` (``world`` must divide ``S_run``)."""
        if world < 1 or self.stages % world:
            raise ValueError(f"a peer of {world} pipeline stages cannot split the run's S_run={self.stages} "
                             "stage groups evenly (S must divide S_run)")
        if not 0 <= rank < world:
            raise ValueError(f"pipeline rank {rank} is not in [0, {world})")
        per = self.stages // world
        return StageRange(rank * per, (rank + 1) * per, rank, world)

    def units_of(self, groups: Sequence[int] | range) -> tuple[str, ...]:
        return tuple(u for g in groups for u in self.groups[g])


class StageModel(nn.Module):
    """The slice of a :class:`~p2ptrain.model.GPT` made of ``units`` (contiguous, in model order).

    It shares the full model's modules (no copy), keeps their parameter names
    (``embed.weight``, ``blocks.3.attn.qkv.weight``, ...) so fragments made from it
    match those of the whole model, and runs only its part of the forward pass:
    the first stage maps token ids to activations, the last activations to logits.
    """

    def __init__(self, full: GPT, units: Sequence[str]) -> None:
        super().__init__()
        self.cfg = full.cfg
        known = [u for u, _ in full.units()]
        unknown = [u for u in units if u not in known]
        if unknown or not units:
            raise ValueError(f"stage units {list(units)} must be a non-empty subset of {known}")
        order = [known.index(u) for u in units]
        if order != list(range(order[0], order[0] + len(order))):
            raise ValueError(f"stage units {list(units)} must be contiguous and in model order")
        self.unit_names = tuple(units)
        self.is_first, self.is_last = "embed" in units, "head" in units
        if self.is_first:
            self.embed = full.embed
        self.blocks = nn.ModuleDict({u.split(".")[1]: full.blocks[int(u.split(".")[1])]
                                     for u in units if u.startswith("blocks.")})
        if self.is_last:
            if "norm" not in units:
                raise ValueError("the last stage must hold the final norm with the head")
            self.norm, self.head = full.norm, full.head
        cos, sin = rotary_tables(self.cfg.seq_len, self.cfg.d_model // self.cfg.n_heads, self.cfg.rope_base)
        self.register_buffer("rope_cos", cos.to(full.rope_cos.device), persistent=False)
        self.register_buffer("rope_sin", sin.to(full.rope_sin.device), persistent=False)

    def units(self) -> list[tuple[str, list[str]]]:
        """This slice's units in order, each with its parameter names (as :meth:`GPT.units`)."""
        names = [n for n, _ in self.named_parameters()]
        return [(u, [n for n in names if n == u or n.startswith(u + ".")]) for u in self.unit_names]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids [B, T] (first stage) or activations [B, T, D] → activations, or logits (last stage)."""
        if self.is_first:
            x = self.embed(x)
        t = x.shape[1]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        for block in self.blocks.values():
            x = block(x, cos, sin)
        if self.is_last:
            x = self.head(self.norm(x))
        return x
