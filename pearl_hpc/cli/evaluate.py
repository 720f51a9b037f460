"""``pearl-hpc eval RUN_DIR|MODEL``: pass@1 on a held-out split, on one local engine.

    pearl-hpc eval runs/local-...            the run's model at its newest checkpoint, on the
                                             run's environment (its eval tasks if it has)
    pearl-hpc eval tiny --env code           a model directory (or the tiny model) as is

Each problem runs once, greedy, through the training agent loop; the result (pass@1,
mean reward, per problem) is printed and written as JSON (``RUN_DIR/eval/`` or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

from pearl_hpc.cli.common import positive_int
from pearl_hpc.errors import ConfigError
from pearl_hpc.rundir import RunDir, version_dir


@dataclass
class Target:
    """What is evaluated: a model (a run's: its newest checkpoint exported), the
    environment and the problems."""

    model_dir: str
    version: int  # the run's weight version (0: the model's own weights)
    env: str
    env_options: dict[str, Any]
    tasks: list[dict[str, Any]] | None  # a run's eval tasks (None: the env's eval split)
    out: Path


def _target(args: argparse.Namespace) -> Target:
    path = Path(args.target)
    if RunDir(path).config.is_file():
        return _run_target(path, args)
    if args.target != "tiny" and not (path / "config.json").is_file():
        raise ConfigError(
            f"{args.target}: neither a run directory (no {RunDir(path).config.name}) nor a "
            "model directory (no config.json); give the directory `pearl-hpc run` printed, a "
            "model, or tiny"
        )
    env = args.env or "code"
    name = path.name if args.target != "tiny" else "tiny"
    out = Path(args.out) if args.out else Path(f"eval-{name}-{env}.json")
    return Target(model_dir_of(args.target), 0, env, {}, None, out)


def _run_target(run_dir: Path, args: argparse.Namespace) -> Target:
    from pearl_hpc.master.preflight import load_run_config
    from pearl_hpc.rollout.tasks import load_tasks
    from pearl_hpc.train.checkpoint import latest_checkpoint, read_meta
    from pearl_hpc.train.export import export_hf

    run = RunDir(run_dir)
    cfg = load_run_config(run.config, need_slurm=False)
    env = args.env or cfg.run.env
    same_env = env == cfg.run.env
    tasks = load_tasks(cfg.run) if same_env else None
    eval_tasks = list(tasks.eval) if tasks is not None and tasks.eval else None
    if same_env and tasks is not None and eval_tasks is None:
        raise ConfigError(
            f"{run_dir}: the run's tasks have no eval split; set run.tasks.eval_path or "
            "eval_fraction, or evaluate another environment with --env"
        )
    model_dir = model_dir_of(cfg.model)
    checkpoint = latest_checkpoint(run.checkpoints)
    version = 0
    if checkpoint is not None:  # its export (written now if the run has none of it)
        version = int(read_meta(checkpoint)["version"])
        exported = version_dir(run.exports, version)
        if not (exported / "config.json").is_file():
            print(f"pearl-hpc eval: exporting {checkpoint.name} to {exported}", flush=True)
            export_hf(Path(model_dir), checkpoint, exported)
        model_dir = str(exported)
    out = Path(args.out) if args.out else run_dir / "eval" / f"{env}-v{version}.json"
    options = dict(cfg.run.env_options) if same_env else {}
    return Target(model_dir, version, env, options, eval_tasks, out)


def model_dir_of(model: str) -> str:
    """A run config's ``model`` as a directory (tiny: built locally, once)."""
    if model == "tiny":
        from pearl_hpc.engine.tinymodel import build_tiny_model, default_model_dir

        return str(build_tiny_model(default_model_dir()))
    return model


def _items(target: Target, args: argparse.Namespace) -> tuple[list[Any], dict[str, Any]]:
    """The problems and the environment's options (``code``: its eval split)."""
    from pearl_hpc.rollout.envs.code import split_problems
    from pearl_hpc.rollout.evaluate import EvalItem

    options = {**target.env_options, "max_turns": args.max_turns}
    if target.tasks is not None:
        items = [EvalItem(i, t) for i, t in enumerate(target.tasks)]
    else:
        if target.env == "code":
            options.setdefault("split", args.split)
            problems = split_problems(options["split"])
            items = [EvalItem(seed, name=p.task_id) for seed, p in enumerate(problems)]
        else:
            items = [EvalItem(seed) for seed in range(args.problems or 32)]
    return items[: args.problems] if args.problems else items, options


async def _evaluate(target: Target, args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from pearl_hpc.core.types import Mode, Role
    from pearl_hpc.engine.client import spawn_worker
    from pearl_hpc.engine.rpc import new_key
    from pearl_hpc.engine.spec import EngineSpec
    from pearl_hpc.rollout.agent import ChatFormat, RolloutConfig
    from pearl_hpc.rollout.envs import make_env
    from pearl_hpc.rollout.evaluate import evaluate
    from pearl_hpc.rollout.router import Router

    items, options = _items(target, args)
    make_env(target.env, **options)  # bad options: one line before an engine starts
    context = args.max_context_tokens or _longest_context(target.model_dir)
    spec = EngineSpec(model_dir=target.model_dir, max_model_len=context)
    with tempfile.TemporaryDirectory(prefix="pearl-eval-") as tmp:
        print(f"pearl-hpc eval: starting an engine for {target.model_dir}", flush=True)
        worker = await spawn_worker(spec, "eval", run_dir=Path(tmp), key=new_key())
        try:
            router = Router()
            router.set_workers({"eval": worker.client}, {"eval": Role.COLOCATED}, Mode.COLOCATED)
            chat = ChatFormat(cast(Any, AutoTokenizer.from_pretrained(target.model_dir)))
            config = RolloutConfig(
                max_tokens_per_turn=args.max_tokens,
                max_context_tokens=context,
                temperature=0.0,
            )
            t0 = time.perf_counter()
            result = await evaluate(
                router, chat, lambda: make_env(target.env, **options), items, config,
                on_done=_progress,
            )  # fmt: skip
            wall_s = time.perf_counter() - t0
        finally:
            await worker.stop()
    return {
        "model": target.model_dir,
        "weights_version": target.version,
        "env": target.env,
        "env_options": {k: v for k, v in options.items() if k != "limits"},
        "pass_at_1": result.pass_at_1,
        "wall_s": round(wall_s, 2),
        **asdict(result),
    }


def _longest_context(model_dir: str, cap: int = 8192) -> int:
    """The model's own position limit (config.json), at most ``cap``."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return min(int(config.get("max_position_embeddings", cap)), cap)


def _progress(done: int, total: int) -> None:
    if done == total or done % 8 == 0:
        print(f"  {done}/{total} problems", flush=True)


def _cmd_eval(args: argparse.Namespace) -> int:
    target = _target(args)
    report = asyncio.run(_evaluate(target, args))
    target.out.parent.mkdir(parents=True, exist_ok=True)
    target.out.write_text(json.dumps(report, indent=1) + "\n")
    print(
        f"{report['env']} (weights v{report['weights_version']}): pass@1 "
        f"{report['pass_at_1']:.3f} ({report['passed']}/{report['problems']}), mean reward "
        f"{report['mean_reward']:.3f}, {report['env_failures']} environment faults, "
        f"{report['wall_s']} s"
    )
    print(target.out, file=sys.stderr)
    return 0


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("eval", help="pass@1 of a run's model (or any model) on a held-out split")
    p.add_argument("target", help="a run directory, a model directory, or tiny")
    p.add_argument("--env", help="environment (default: the run's; code for a model)")
    p.add_argument(
        "--split",
        default="eval",
        choices=("eval", "train", "all"),
        help="code: the HumanEval split (default eval: every fifth problem)",
    )
    p.add_argument("--problems", type=positive_int, help="only the first N problems")
    p.add_argument("--max-turns", type=positive_int, default=4, help="turns per problem")
    p.add_argument("--max-tokens", type=positive_int, default=512, help="tokens per turn")
    p.add_argument("--max-context-tokens", type=positive_int,
                   help="the engine's max_model_len, prompt + every turn (default: the "
                   "model's max_position_embeddings, at most 8192)")  # fmt: skip
    p.add_argument("--out", help="the JSON result (default: RUN_DIR/eval/ENV-vN.json)")
    p.set_defaults(func=_cmd_eval)
