"""A checkpoint's cost on the training step's critical path, before and after, on this
machine's CPU (one trainer rank; its disk).

- **before** (the release until this one): after every step, trainer 0 gathered the full
  weights in fp32, wrote them as one safetensors file and AdamW's state as
  ``optimizer.pt``, each fsynced, before the step's ack;
- **after** (:class:`pearl_hpc.train.checkpoint.Checkpointer`): the step waits while the
  rank's state (weights and AdamW's moments, its shards under FSDP2) is staged in host
  memory; DCP writes it in the background (reported beside, off the critical path), and
  only every ``train.checkpoint_every`` steps.

Models: the tiny Qwen3 and a random Qwen3 of ``--hidden`` x ``--layers`` (a vocabulary
of ``--vocab``; the default is 0.5B parameters). The trajectory log's bytes and the
master's seconds per step are ``pearl-hpc bench --messages``'s.

Run: ``pearl-hpc bench --checkpoint`` (or ``python -m pearl_hpc.bench.checkpoint``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pearl_hpc.bench import record


def before(trainer: Any, out: Path) -> tuple[float, int]:
    """The old per-step save, as it ran: (seconds the step waited, bytes written)."""
    import torch
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    out.mkdir(parents=True)
    save_file(trainer.state_dict(), str(out / "model.safetensors"))
    torch.save(trainer.optimizer.state_dict(), out / "optimizer.pt")
    for path in out.iterdir():
        with path.open("rb") as handle:
            os.fsync(handle.fileno())
    return time.perf_counter() - t0, sum(p.stat().st_size for p in out.iterdir())


def after(trainer: Any, root: Path) -> tuple[float, float, int]:
    """A checkpoint now: (seconds the step waited, seconds until it is on disk, bytes)."""
    from pearl_hpc.train.checkpoint import Checkpointer, read_meta

    saver = Checkpointer(root, keep=2, sharded=False, lead=True)
    t0 = time.perf_counter()
    blocked_s = saver.save(trainer)
    saver.close()
    total_s = time.perf_counter() - t0
    return blocked_s, total_s, int(read_meta(root / f"v{trainer.version:06d}")["bytes"])


def measure(name: str, model_dir: Path, repeats: int) -> dict[str, Any]:
    import shutil

    from torch.distributed.checkpoint.state_dict import get_state_dict

    from pearl_hpc.train.grpo import GRPOConfig, GRPOTrainer

    trainer = GRPOTrainer(model_dir, GRPOConfig())
    get_state_dict(trainer.model, trainer.optimizer)  # AdamW's state exists (as after a step)
    params = sum(p.numel() for p in trainer.model.parameters())
    rows: dict[str, list[float]] = {"before_s": [], "blocked_s": [], "written_s": []}
    with tempfile.TemporaryDirectory(prefix="pearl-bench-ckpt-", dir=model_dir.parent) as tmp:
        for i in range(repeats):
            seconds, before_bytes = before(trainer, Path(tmp) / f"old-{i}")
            rows["before_s"].append(seconds)
            shutil.rmtree(Path(tmp) / f"old-{i}")
            blocked, total, after_bytes = after(trainer, Path(tmp) / f"new-{i}")
            rows["blocked_s"].append(blocked)
            rows["written_s"].append(total)
            shutil.rmtree(Path(tmp) / f"new-{i}")
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {
        "model": name, "params": params, "before_bytes": before_bytes,
        "before_s": round(med["before_s"], 4), "state_bytes": after_bytes,
        "blocked_s": round(med["blocked_s"], 4), "written_s": round(med["written_s"], 4),
        "ratio": round(med["before_s"] / med["blocked_s"], 1),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pearl-hpc bench --checkpoint", description=__doc__)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--every", type=int, default=10, help="train.checkpoint_every")
    parser.add_argument("--json", action="store_true")
    record.add_argument(parser)
    args = parser.parse_args(argv)

    from pearl_hpc.bench.train import build_model
    from pearl_hpc.engine.tinymodel import build_tiny_model

    rows = []
    with tempfile.TemporaryDirectory(prefix="pearl-bench-ckpt-models-") as tmp:
        tiny = build_tiny_model(Path(tmp) / "tiny")
        rows.append(measure("tiny", tiny, args.repeats))
        big = build_model(Path(tmp) / "big", args.hidden, args.layers, args.vocab, 4096)
        rows.append(measure(f"qwen3 {args.layers}x{args.hidden}", big, args.repeats))
    for row in rows:  # the step's wait, averaged over the steps between checkpoints
        row["per_step_s"] = round(row["blocked_s"] / args.every, 4)
        row["per_step_ratio"] = round(row["before_s"] / row["per_step_s"], 1)
    ratios = {f"{r['model']}: before / after per step": r["per_step_ratio"] for r in rows}
    record.append(args.record, "checkpoint", rows, ratios, vars(args))
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    print("a checkpoint on the step's critical path, one CPU rank (median of "
          f"{args.repeats}): before, written every step before the ack; after, staged "
          f"(the step waits) and written in the background, every {args.every} steps")  # fmt: skip
    print(f"{'model':<18}{'params':>8}{'before GB':>10}{'before s':>10}{'state GB':>10}"
          f"{'waits s':>9}{'written s':>10}{'per step s':>11}{'before/after':>13}")  # fmt: skip
    for r in rows:
        print(f"{r['model']:<18}{r['params'] / 1e9:>7.2f}B{r['before_bytes'] / 1e9:>10.2f}"
              f"{r['before_s']:>10.2f}{r['state_bytes'] / 1e9:>10.2f}{r['blocked_s']:>9.3f}"
              f"{r['written_s']:>10.2f}{r['per_step_s']:>11.3f}"
              f"{r['per_step_ratio']:>12.1f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
