"""``pearl-hpc export RUN_DIR [--step N] --out DIR``: a run's weights as a Hugging Face
model directory (config, tokenizer, sharded safetensors) that transformers and vLLM load.

    pearl-hpc export runs/local-...  --out my-model          the newest checkpoint
    pearl-hpc export runs/local-...  --step 3 --out step3     the weights after step 3
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pearl_hpc.errors import ConfigError
from pearl_hpc.rundir import RunDir


def _cmd_export(args: argparse.Namespace) -> int:
    from pearl_hpc.cli.evaluate import model_dir_of
    from pearl_hpc.config.run import read_run_config
    from pearl_hpc.train.checkpoint import checkpoint_of_version, latest_checkpoint
    from pearl_hpc.train.export import export_hf

    run = RunDir(Path(args.run_dir))
    if not run.config.is_file():
        raise ConfigError(
            f"{args.run_dir}: not a run directory (no {run.config.name}); give the directory "
            "`pearl-hpc run` printed"
        )
    cfg = read_run_config(run.config)
    if args.step is None:
        checkpoint = latest_checkpoint(run.checkpoints)
        if checkpoint is None:
            raise ConfigError(
                f"{args.run_dir}: no checkpoint yet (one is written every "
                f"train.checkpoint_every = {cfg.train.checkpoint_every} steps and after the last)"
            )
    else:  # the weights after step N are version N + 1
        checkpoint = checkpoint_of_version(run.checkpoints, args.step + 1)
    out = export_hf(Path(model_dir_of(cfg.model)), checkpoint, Path(args.out), args.dtype)
    print(f"pearl-hpc export: {checkpoint.name} of {args.run_dir} -> {out} ({args.dtype})")
    return 0


def add_parsers(sub: Any) -> None:
    p = sub.add_parser(
        "export", help="a run's weights as a Hugging Face model directory (transformers, vLLM)"
    )
    p.add_argument("run_dir", help="the run directory `pearl-hpc run` printed")
    p.add_argument("--out", required=True, help="a new directory for the model")
    p.add_argument("--step", type=int, help="the weights after this step (default: the newest)")
    p.add_argument(
        "--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
        help="the weights' dtype (default bfloat16)",
    )  # fmt: skip
    p.set_defaults(func=_cmd_export)
