"""One trainer step's memory and speed on long trajectories, on this machine's CPU.

A random Qwen3 that is small but deep (``--layers`` decoder blocks of ``--hidden``, a
``--vocab``-token vocabulary) trains one GRPO step on trajectories of ``--lengths``
tokens:

- **memory**: the step's peak host memory (the process's peak RSS over its RSS before
  the step), each case in a fresh process: the log-probs' logits in one piece (a chunk
  as long as the micro-batch: what a full ``[N, V]`` log-softmax holds) or in chunks of
  ``--chunk`` positions, with and without activation checkpointing;
- **padding**: the same trajectories as one right-padded batch (the model's attention
  mask; every row as long as the longest) against the trainer's packed micro-batch (the
  rows one after another, position ids restarting): tokens computed, padding share and
  trajectory tokens per second of a forward and backward.

Run: ``pearl-hpc bench --train`` (or ``python -m pearl_hpc.bench.train``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pearl_hpc.bench import record

CASES = {  # name: (activation checkpointing, chunked log-probs)
    "neither": (False, False),
    "checkpointing": (True, False),
    "chunked": (False, True),
    "both": (True, True),
}


def build_model(
    out: Path, hidden: int, layers: int, vocab: int, max_len: int, head_dim: int = 0
) -> Path:
    """A random Qwen3 in ``out`` (config and safetensors; no tokenizer: ids are random):
    4 heads of ``hidden / 4`` (or heads of ``head_dim``, a quarter of them key-value)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    heads = hidden // head_dim if head_dim else 4
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4) if head_dim else 2,
        head_dim=head_dim or hidden // 4,
        max_position_embeddings=max_len,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).float().save_pretrained(out, safe_serialization=True)
    return out


def batch(lengths: list[int], vocab: int) -> list[Any]:
    """One group of trajectories: a prompt of a quarter of each, the rest generated."""
    import random

    from pearl_hpc.rollout.types import Segment, Trajectory

    rng = random.Random(0)
    out = []
    for i, n in enumerate(lengths):
        ids = [rng.randrange(1, vocab) for _ in range(n)]
        segments = [Segment(tuple(ids[: n // 4]), False), Segment(tuple(ids[n // 4 :]), True)]
        out.append(Trajectory(f"t{i}", "g", segments, float(i % 2), True, {0}))
    return out


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_case(model_dir: str, case: str, lengths: list[int], chunk: int) -> dict[str, Any]:
    """One step of ``case`` in this process: its peak memory over the RSS before it."""
    import torch

    from pearl_hpc.train.grpo import GRPOConfig, GRPOTrainer

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    checkpointing, chunked = CASES[case]
    config = GRPOConfig(
        lr=1e-4,
        minibatch_size=len(lengths),
        micro_batch_tokens=max(lengths),  # one trajectory per forward: the longest sets the peak
        logprob_chunk=chunk if chunked else max(lengths),
        activation_checkpointing=checkpointing,
    )
    trainer = GRPOTrainer(model_dir, config)
    trajectories = batch(lengths, trainer.vocab_size)
    before = _rss_bytes()
    t0 = time.perf_counter()
    trainer.train_step(trajectories)
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"case": case, "peak_mib": round((peak - before) / 2**20, 1), "step_s": round(wall, 2)}


def padding(model_dir: str, lengths: list[int]) -> list[dict[str, Any]]:
    """Forward and backward of the trajectories' log-probs, padded vs packed."""
    import torch

    from pearl_hpc.train.grpo import GRPOConfig, GRPOTrainer
    from pearl_hpc.train.packing import pack

    trainer = GRPOTrainer(model_dir, GRPOConfig(logprob_chunk=1024))
    rows = [t.token_ids() for t in batch(lengths, trainer.vocab_size)]
    real = sum(lengths)

    def padded() -> int:
        ids = torch.zeros((len(rows), max(lengths)), dtype=torch.long)
        attention = torch.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
            attention[i, : len(row)] = 1
        logits = trainer.model(input_ids=ids, attention_mask=attention, use_cache=False).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])
        (logp[..., 0] * attention[:, 1:]).sum().backward()
        return ids.numel()

    def packed() -> int:
        p = pack(torch.nn.utils.rnn.pad_sequence([torch.tensor(r) for r in rows], True),
                 lengths, list(range(len(rows))))  # fmt: skip
        logprobs, _ = trainer.policy(p.input_ids, p.position_ids, p.targets)
        (p.per_row(logprobs)).sum().backward()
        return p.input_ids.numel()

    out = []
    for name, step in (("padded", padded), ("packed", packed)):
        t0 = time.perf_counter()
        computed = step()
        wall = time.perf_counter() - t0
        trainer.model.zero_grad(set_to_none=True)
        out.append({
            "layout": name,
            "tokens_computed": computed,
            "padding_share": round(1 - real / computed, 3),
            "tokens_per_s": round(real / wall, 1),
        })  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pearl-hpc bench --train", description=__doc__)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--chunk", type=int, default=1024, help="positions per logits chunk")
    parser.add_argument("--lengths", default="8192,6144,4096", help="memory: tokens per row")
    parser.add_argument("--mixed", default="2048,512,256,128,128,64",
                        help="padding: tokens per row (agentic trajectories vary)")  # fmt: skip
    parser.add_argument("--json", action="store_true")
    record.add_argument(parser)
    parser.add_argument("--case", help=argparse.SUPPRESS)  # one memory case, in a child
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.case:
        print(json.dumps(memory_case(args.model_dir, args.case, lengths, args.chunk)))
        return 0
    mixed = [int(x) for x in args.mixed.split(",")]
    with tempfile.TemporaryDirectory(prefix="pearl-bench-train-") as tmp:
        model_dir = str(build_model(Path(tmp), args.hidden, args.layers, args.vocab,
                                    max(lengths + mixed)))  # fmt: skip
        memory = []
        for case in CASES:
            child = subprocess.run(
                [sys.executable, "-m", "pearl_hpc.bench.train", "--case", case,
                 "--model-dir", model_dir, "--lengths", args.lengths, "--chunk", str(args.chunk)],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            memory.append(json.loads(child.stdout.strip().splitlines()[-1]))
        layouts = padding(model_dir, mixed)
    base = memory[0]["peak_mib"]
    ratios = {f"{r['case']}: peak / neither": r["peak_mib"] / base for r in memory}
    pad, packed = layouts
    ratios["packed / padded tokens/s"] = packed["tokens_per_s"] / pad["tokens_per_s"]
    record.append(args.record, "train", memory + layouts, ratios, vars(args))
    report(args, memory, layouts)
    return 0


def report(args: argparse.Namespace, memory: list[dict[str, Any]], layouts: list[Any]) -> None:
    if args.json:
        for row in memory + layouts:
            print(json.dumps(row))
        return
    base = memory[0]["peak_mib"]
    print(f"one GRPO step, Qwen3 {args.layers} x {args.hidden}, vocab {args.vocab}, "
          f"trajectories of {args.lengths} tokens (one per micro-batch)")  # fmt: skip
    print(f"{'case':<15}{'peak MiB':>10}{'vs neither':>12}{'step s':>9}")
    for row in memory:
        print(f"{row['case']:<15}{row['peak_mib']:>10.0f}{row['peak_mib'] / base:>11.2f}x"
              f"{row['step_s']:>9.2f}")  # fmt: skip
    print(f"\nforward + backward of trajectories of {args.mixed} tokens")
    print(f"{'layout':<8}{'computed':>10}{'padding':>9}{'tokens/s':>10}")
    for row in layouts:
        print(f"{row['layout']:<8}{row['tokens_computed']:>10}{row['padding_share']:>9.1%}"
              f"{row['tokens_per_s']:>10.0f}")  # fmt: skip
    pad, packed = layouts
    print(f"packed / padded tokens/s: {packed['tokens_per_s'] / pad['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
