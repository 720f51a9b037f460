"""Weights as a Hugging Face model directory: the model's config (its dtype set) and
tokenizer, the weights as sharded safetensors with their index, in the original
checkpoint's layout -- which transformers and vLLM load as they load the original model.

- :func:`export_hf`: from a trainer checkpoint (``pearl-hpc export``, ``pearl-hpc eval``);
- :func:`write_hf`: from weights in hand (trainer 0's copy for the engines: a run's
  ``exports/`` every ``train.export_every`` steps and after the last).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from pearl_hpc.train.checkpoint import last_line
from pearl_hpc.train.model import checkpoint_layout, empty_model, materialize
from pearl_hpc.train.objective import TrainError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "merges.txt", "tokenizer.model", "chat_template.jinja", "added_tokens.json",
    "generation_config.json",
)  # fmt: skip


def export_hf(
    model_dir: Path, checkpoint: Path, out: Path, dtype: str = "bfloat16", shard_size: str = "5GB"
) -> Path:
    """Write ``out``: ``model_dir``'s architecture and tokenizer with ``checkpoint``'s
    weights in ``dtype``, in files of at most ``shard_size``. The model is built on the
    meta device and filled from every rank's shards (DCP reads only the weights, not
    the optimizer state): the host holds it once, in ``dtype``."""
    _check(out, dtype)
    lm: Any = empty_model(model_dir, DTYPES[dtype])
    materialize(lm, lm, "cpu")
    try:  # the tensors of the state dict are the parameters: loaded in place
        dcp.load({"model": lm.state_dict()}, checkpoint_id=checkpoint, no_dist=True)
    except (Exception, CheckpointException) as exc:
        raise TrainError(
            f"{checkpoint} does not fit the model in {model_dir}: {last_line(exc)}"
        ) from exc
    return write_hf(model_dir, checkpoint_layout(lm, lm.state_dict()), out, dtype, shard_size)


def write_hf(
    model_dir: Path,
    state: dict[str, torch.Tensor],
    out: Path,
    dtype: str = "bfloat16",
    shard_size: str = "5GB",
) -> Path:
    """Write ``out`` from ``state`` (a state dict in the checkpoint's layout): written
    beside it, then renamed into place (an interrupted export leaves no ``out``)."""
    from huggingface_hub import save_torch_state_dict

    _check(out, dtype)
    config = json.loads((model_dir / "config.json").read_text())
    config["dtype"] = dtype
    cast = DTYPES[dtype]
    tensors = {
        name: _own(tensor.to(cast) if tensor.is_floating_point() else tensor)
        for name, tensor in state.items()
        if not (name == "lm_head.weight" and config.get("tie_word_embeddings"))
    }
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        save_torch_state_dict(tensors, tmp, max_shard_size=shard_size)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name in TOKENIZER_FILES:
            if (model_dir / name).is_file():
                shutil.copy2(model_dir / name, tmp / name)
        if out.exists():
            out.rmdir()  # empty (checked)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _own(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with storage of its own (an expert's tensor cut from a fused one is a
    view; safetensors writes each tensor's storage once)."""
    return tensor if tensor.untyped_storage().nbytes() == tensor.nbytes else tensor.clone()


def _check(out: Path, dtype: str) -> None:
    if dtype not in DTYPES:
        raise TrainError(f"export dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    if out.exists() and any(out.iterdir()):
        raise TrainError(f"{out} exists and is not empty; export into a new directory")
