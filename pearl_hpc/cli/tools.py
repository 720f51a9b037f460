"""``pearl-hpc tiny-model`` and ``pearl-hpc bench``."""

from __future__ import annotations

import argparse
from typing import Any

from pearl_hpc.cli.common import out_dir
from pearl_hpc.config import REPO_CONFIGS


def _cmd_tiny_model(args: argparse.Namespace) -> int:
    from pearl_hpc.engine.tinymodel import build_tiny_model, default_model_dir

    print(build_tiny_model(args.out or default_model_dir()))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from pearl_hpc.bench import decision_speed, sim_speed

    if args.report is not None:
        from pearl_hpc.bench import report

        return report.main(args.report, check=args.check)
    out = ["--record", args.record] + (["--json"] if args.json else [])
    if args.engines:
        from pearl_hpc.bench import engines

        extra = ["--model", args.model] if args.model else []
        return engines.main(extra + out)
    if args.train:
        from pearl_hpc.bench import train

        return train.main(out)
    if args.checkpoint:
        from pearl_hpc.bench import checkpoint

        return checkpoint.main(out)
    if args.plane:
        from pearl_hpc.bench import plane

        return plane.main(["--ranks", args.plane_ranks, *out])
    if args.messages:
        from pearl_hpc.bench import messages

        return messages.main(out)
    if args.weights:
        from pearl_hpc.bench import weights

        scale = ["--at-scale"] if args.at_scale else []
        return weights.main(["--gib", str(args.gib), *scale, *out])
    if args.local:
        from pearl_hpc.bench import local_run

        return local_run.main(
            args.config or str(REPO_CONFIGS / "runs" / "local.yaml"),
            args.json,
            variants=tuple(args.variants.split(",")),
            steps=args.steps,
            record_to=args.record,
        )
    if args.harvest:
        from pearl_hpc.bench import harvest

        config = args.config or str(REPO_CONFIGS / "runs" / "slurm-local.yaml")
        requests = tuple(args.requests.split(","))
        steps = 40 if args.steps is None else args.steps
        return harvest.main(
            config, args.segment, args.speedup, steps, args.json, requests, args.record
        )
    if args.sim:
        return sim_speed.main(out)
    return decision_speed.main(["--repeats", str(args.repeats), *out])


def add_parsers(sub: Any) -> None:
    tiny = sub.add_parser(
        "tiny-model", help="build the tiny Qwen3 model + tokenizer locally (no hub access)"
    )
    tiny.add_argument(
        "out", nargs="?", type=out_dir, help="directory (default: $PEARL_HPC_CACHE/tiny-qwen3)"
    )
    tiny.set_defaults(func=_cmd_tiny_model)
    _add_bench_parser(sub)


def _add_bench_parser(sub: Any) -> None:
    from pearl_hpc.bench import record

    bench = sub.add_parser(
        "bench", help="benchmarks: decision + plan speed (64 .. 50,000 workers), or --sim"
    )
    bench.add_argument("--sim", action="store_true", help="simulator speed instead")
    bench.add_argument(
        "--engines",
        action="store_true",
        help="real vLLM engines: start, role change, weight load, (de)activation, memory, "
        "tokens/s colocated vs disaggregated",
    )
    bench.add_argument(
        "--checkpoint",
        action="store_true",
        help="a checkpoint's seconds on the training step's critical path, before (fp32 "
        "gather + fsync every step) and after (staged, written in the background), on the "
        "tiny model and a 0.5B random Qwen3 (CPU)",
    )
    bench.add_argument(
        "--messages",
        action="store_true",
        help="the control plane's TRAIN message at PEARL's shape (64 x 32K tokens, 16 "
        "trainer ranks): msgpack of typed records vs mpi4py's pickle",
    )
    bench.add_argument(
        "--plane",
        action="store_true",
        help="the MPI control plane on protocol-only ranks: the master's loop per plan and "
        "per join at 8 .. 256 ranks, a burst of 200 joiners",
    )
    bench.add_argument(
        "--train",
        action="store_true",
        help="one trainer step on 4K-8K-token trajectories (CPU): peak memory with and "
        "without activation checkpointing and chunked log-probs; padded vs packed tokens/s",
    )
    bench.add_argument(
        "--weights",
        action="store_true",
        help="weight sync to an engine on trainer 0's node: gloo group vs shared memory",
    )
    bench.add_argument(
        "--local",
        action="store_true",
        help="the local training run: pearl vs fixed colocated, synchronous steps and pearl+ "
        "(tail_start), reconfiguration latencies, predicted vs measured rollout",
    )
    bench.add_argument(
        "--harvest",
        action="store_true",
        help="on the local Slurm cluster: elastic worker-seconds served / idle worker-seconds "
        "a replayed trace left, single vs hetjob requests",
    )
    _add_bench_options(bench)
    bench.add_argument("--json", action="store_true")
    record.add_argument(bench)
    bench.add_argument(
        "--report",
        nargs="?",
        const="docs/bench.jsonl",
        metavar="FILE",
        help="write docs/benchmarks.md's generated tables from the newest line of each "
        "bench in FILE (default: docs/bench.jsonl); nothing is measured",
    )
    bench.add_argument(
        "--check", action="store_true", help="with --report: fail if the tables differ"
    )
    bench.set_defaults(func=_cmd_bench)


def _add_bench_options(bench: argparse.ArgumentParser) -> None:
    """The options of one bench or another (each says which)."""
    bench.add_argument(
        "--plane-ranks", default="8,32,128,256", help="with --plane: world sizes, comma-separated"
    )
    bench.add_argument(
        "--gib", type=float, default=1.0, help="with --weights: bf16 size of the model"
    )
    bench.add_argument(
        "--at-scale",
        action="store_true",
        help="with --weights: one version's stages at Qwen3-8B and 30B-A3B by arithmetic",
    )
    bench.add_argument(
        "--variants",
        default="pearl,colocated,pearl-sync,pearl+",
        help="with --local: which runs, comma-separated (pearl first; also pearl+s2: pearl+ "
        "at run.max_staleness 2)",
    )
    bench.add_argument(
        "--segment", type=int, default=1, choices=(1, 2, 3), help="with --harvest: trace segment"
    )
    bench.add_argument(
        "--speedup", type=float, default=60.0, help="with --harvest: trace seconds per second"
    )
    bench.add_argument(
        "--steps",
        type=int,
        help="steps per run (--harvest: default 40; --local: default the run YAML's)",
    )
    bench.add_argument(
        "--requests", default="single,hetjob", help="with --harvest: request kinds to run"
    )
    bench.add_argument("--model", help="with --engines: model directory (default: tiny model)")
    bench.add_argument(
        "--config",
        help="with --local: run YAML (default: configs/runs/local.yaml); with --harvest: "
        "a slurm run YAML (default: configs/runs/slurm-local.yaml)",
    )
    bench.add_argument(
        "--repeats", type=int, default=30, help="decision + plan: timed runs of each event"
    )
