"""A trainer checkpoint as a Hugging Face model directory: the model's config and
tokenizer, the checkpoint's weights in ``dtype`` as sharded safetensors with their index
(transformers' ``save_pretrained``, in the original checkpoint's layout), which
transformers and vLLM load as they load the original model."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from pearl_hpc.train.checkpoint import last_line
from pearl_hpc.train.model import empty_model, materialize
from pearl_hpc.train.objective import TrainError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "merges.txt", "tokenizer.model", "chat_template.jinja", "added_tokens.json",
)  # fmt: skip


def export_hf(
    model_dir: Path, checkpoint: Path, out: Path, dtype: str = "bfloat16", shard_size: str = "5GB"
) -> Path:
    """Write ``out``: ``model_dir``'s architecture and tokenizer with ``checkpoint``'s
    weights in ``dtype``, in files of at most ``shard_size``. The model is built on the
    meta device and filled from every rank's shards (DCP reads only the weights, not
    the optimizer state): the host holds it once, in ``dtype``."""
    if dtype not in DTYPES:
        raise TrainError(f"export dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    if out.exists() and any(out.iterdir()):
        raise TrainError(f"{out} exists and is not empty; export into a new directory")
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"  # renamed into place once written
    shutil.rmtree(tmp, ignore_errors=True)
    lm: Any = empty_model(model_dir, DTYPES[dtype])
    materialize(lm, lm, "cpu")
    try:  # the tensors of the state dict are the parameters: loaded in place
        dcp.load({"model": lm.state_dict()}, checkpoint_id=checkpoint, no_dist=True)
    except (Exception, CheckpointException) as exc:
        raise TrainError(
            f"{checkpoint} does not fit the model in {model_dir}: {last_line(exc)}"
        ) from exc
    lm.config.dtype = DTYPES[dtype]
    tmp.mkdir(parents=True)
    try:
        lm.save_pretrained(tmp, max_shard_size=shard_size, safe_serialization=True)
        for name in (*TOKENIZER_FILES, "generation_config.json"):
            if (model_dir / name).is_file():
                shutil.copy2(model_dir / name, tmp / name)
        if out.exists():
            out.rmdir()  # empty (checked above)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
