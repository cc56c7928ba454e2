"""Write a tiny Llama-format checkpoint folder and a local .jsonl/.parquet data set to try
``--init-from``, ``--tokenizer`` and ``export`` without downloading anything.

    python examples/make_tiny_llama.py runs/hf-demo

makes ``runs/hf-demo/llama/`` (config.json, model.safetensors in bf16 with random weights,
tokenizer.json: a BPE trained here on the standard library's docstrings) and
``runs/hf-demo/docs.jsonl`` (+ ``docs.parquet`` when pyarrow is installed): one record per
module docstring, the text in the field ``text``. Needs ``pip install 'p2ptrain[hf]'``.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from p2ptrain.data import builtin_files
from p2ptrain.hf import hf_config, hf_state
from p2ptrain.model import GPT, ModelConfig


def docstrings(limit: int = 3000) -> list[str]:
    """Module, class and function docstrings of the standard library (a few MB of English text)."""
    out: list[str] = []
    for path in builtin_files()[1]:
        try:
            tree = ast.parse(path.read_text(errors="replace"))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and (doc := ast.get_docstring(node)):
                if len(doc) > 200:
                    out.append(doc)
        if len(out) >= limit:
            break
    return out


def main(root: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    docs = docstrings()
    folder = root / "llama"
    folder.mkdir(parents=True, exist_ok=False)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=2048, special_tokens=["<s>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(folder / "tokenizer.json"))

    cfg = ModelConfig(vocab_size=tok.get_vocab_size(), seq_len=512, d_model=128, n_layers=4, n_heads=4,
                      n_kv_heads=2, d_ff=384, tie_embeddings=True, rope_base=10_000.0, norm_eps=1e-5)
    torch.manual_seed(0)
    model = GPT(cfg)

    save_file(hf_state(dict(model.named_parameters()), cfg, torch.bfloat16), folder / "model.safetensors",
              metadata={"format": "pt"})
    config = hf_config(cfg, torch.bfloat16) | {"bos_token_id": 0, "eos_token_id": 0}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    (root / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": docs}), root / "docs.parquet", row_group_size=500)
    except ImportError:
        pass
    print(f"{folder}: {model.num_parameters():,} parameters, vocab {cfg.vocab_size}; {len(docs)} documents in "
          f"{root / 'docs.jsonl'}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(Path(sys.argv[1]))
