"""A trainer snapshot as a Hugging Face model directory: the model's config and
tokenizer, the snapshot's weights in ``dtype`` as sharded safetensors with their index
(transformers' ``save_pretrained``), which transformers and vLLM load as they load the
original model."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from pearl_hpc.train.model import empty_model, load_shards, materialize, weight_files
from pearl_hpc.train.objective import TrainError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "merges.txt", "tokenizer.model", "chat_template.jinja", "added_tokens.json",
)  # fmt: skip


def export_hf(
    model_dir: Path, snapshot: Path, out: Path, dtype: str = "bfloat16", shard_size: str = "5GB"
) -> Path:
    """Write ``out``: ``model_dir``'s architecture and tokenizer with ``snapshot``'s
    weights in ``dtype``, in files of at most ``shard_size``. The model is built on the
    meta device and filled tensor by tensor: the host holds it once, in ``dtype``."""
    if dtype not in DTYPES:
        raise TrainError(f"export dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    if out.exists() and any(out.iterdir()):
        raise TrainError(f"{out} exists and is not empty; export into a new directory")
    lm: Any = empty_model(model_dir, DTYPES[dtype])
    materialize(lm, lm, "cpu")
    load_shards(lm, weight_files(snapshot))
    lm.config.dtype = DTYPES[dtype]
    out.mkdir(parents=True, exist_ok=True)
    lm.save_pretrained(out, max_shard_size=shard_size, safe_serialization=True)
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, out / name)
    return out
