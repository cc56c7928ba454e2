"""Between the Llama checkpoint format (:mod:`p2ptrain.hf`) and p2ptrain's runs: a trainer started from a
checkpoint folder and its data source (``--init-from``), and the trained θ of a run's checkpoint (``export``).
The format module itself knows only the model; this one knows the trainer, the data and the methods."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import torch

from .algo.fragments import make_fragments, model_units
from .algo.methods import method_config
from .data import DataConfig, load_corpus
from .hf import HFCheckpoint, HFError, load_hf_weights
from .model import GPT, ModelConfig
from .trainer import Trainer, TrainerConfig, make_trainer

__all__ = ["data_for", "read_params", "trainer_from_hf"]

log = logging.getLogger(__name__)


def read_params(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """The trained parameters and model config of a p2ptrain checkpoint state.

    A swarm peer's checkpoint gives its outer parameters θ (the swarm's shared model); a
    ``p2ptrain train`` checkpoint (or a data-parallel peer, which has no outer loop) gives
    the model's parameters. Raises :class:`HFError` on a state that is neither.
    """
    try:
        trainer = state["trainer"]
        cfg = ModelConfig(**trainer["model_config"])
        params: dict[str, torch.Tensor] = dict(trainer["model"])
    except (KeyError, TypeError) as e:
        raise HFError(f"export: not a p2ptrain training checkpoint ({e})") from None
    outer = state.get("outer")
    if outer:
        knobs = dict(outer["method"])
        method = method_config(knobs.pop("method"), **knobs)
        with torch.device("meta"):
            skeleton = GPT(cfg)
        frags = make_fragments(model_units(skeleton), method.fragments, method.fragment_mode)  # type: ignore[arg-type]
        if len(frags) != len(outer["fragments"]):
            raise HFError(f"export: checkpoint has {len(outer['fragments'])} fragments, its method {len(frags)}")
        for frag, saved in zip(frags, outer["fragments"], strict=True):
            for name, theta in zip(frag.names, saved["theta"], strict=True):
                if tuple(theta.shape) != tuple(params[name].shape):
                    raise HFError(f"export: θ of {name} has shape {tuple(theta.shape)}, the model {tuple(params[name].shape)}")
                params[name] = theta
    return params, cfg


def data_for(ckpt: HFCheckpoint, data: DataConfig) -> DataConfig:
    """``data`` with the checkpoint's own ``tokenizer.json`` when none is set and the source is text
    (a ``.bin`` file holds token ids already). Raises :class:`HFError` when there is none to use:
    a Llama model trained on UTF-8 bytes would learn nothing it knows."""
    if data.tokenizer or (data.path or "").endswith(".bin"):
        return data
    own = ckpt.path / "tokenizer.json"
    if not own.is_file():
        raise HFError(f"{ckpt.path} has no tokenizer.json: pass the checkpoint's tokenizer with --tokenizer")
    return replace(data, tokenizer=str(own))


def trainer_from_hf(ckpt: HFCheckpoint, trainer_cfg: TrainerConfig, data_cfg: DataConfig) -> Trainer:
    """A trainer whose model starts from the checkpoint's weights (the data's tokenizer must fit its
    vocabulary: HFError otherwise). Every peer that loads the same folder starts from the same θ."""
    corpus = load_corpus(data_cfg)
    vocab = ckpt.model_config.vocab_size
    if corpus.vocab_size > vocab:
        raise HFError(f"the data's tokenizer ({data_cfg.tokenizer or 'bytes'}) has {corpus.vocab_size} tokens, "
                      f"more than the checkpoint's vocab_size {vocab}: use the checkpoint's own tokenizer.json")
    trainer = make_trainer(ckpt.model_config, trainer_cfg, data_cfg, corpus=corpus)
    load_hf_weights(trainer.model, ckpt)
    log.info("event=init_from path=%s params=%d seq_len=%d", ckpt.path, trainer.model.num_parameters(),
             ckpt.model_config.seq_len)
    return trainer
