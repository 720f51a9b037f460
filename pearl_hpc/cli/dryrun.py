"""``pearl-hpc run CONFIG --dry-run``: what a run would start, without starting it.

    the config, checked       (one line naming the field and the fix if it is bad)
    values not in the file    from the cluster's file or --set, and from which
    the base job              its batch script (``pearl-hpc run CONFIG --sbatch``)
    the world                 the launcher's command and which rank runs what, where
    the elastic request       the sbatch text of the first request (backend slurm)
    the memory plan           a trainer rank's and an engine's GPU memory, a training
                              node's host memory at start (pearl_hpc.config.memory)
    the first decision        the controller's own, on the base workers (a Controller
                              driven with an executor that only records), and how many
                              elastic workers it finds worth requesting
    checks before the queue   the model directory, the cluster (sinfo, sbatch
                              --test-only): pearl_hpc.backends.checks

Paths that exist only once the run starts are written ``RUN_DIR``; the output is the
same on every machine for the same config (a golden file pins the 32-GPU one).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pearl_hpc.comm.layout import ENGINE, TRAINER, base_layout, domains_of, ranks_per_node
from pearl_hpc.config.files import REPO_CONFIGS, load_profile
from pearl_hpc.config.memory import run_plan
from pearl_hpc.config.run import RunConfig
from pearl_hpc.core.controller import Controller
from pearl_hpc.core.orchestrator import WorkerAdd
from pearl_hpc.core.table import ElasticSource
from pearl_hpc.core.types import Role
from pearl_hpc.rundir import RunDir

RUN_DIR = Path("RUN_DIR")


class RecordingExecutor:
    """The controller's executor for a dry run: every call is recorded, nothing runs."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def start_workers(self, adds: Sequence[WorkerAdd]) -> None:
        self.calls += [f"start slot {a.slot_id} as {a.role} on {','.join(a.gpu_ids)}" for a in adds]

    def admit(self, slot_ids: Sequence[int]) -> None:
        self.calls.append(f"admit slots {list(slot_ids)}")

    def change_roles(self, changes: Sequence[tuple[int, Role]]) -> None:
        self.calls += [f"slot {slot} becomes {role}" for slot, role in changes]

    def stop_workers(self, slot_ids: Sequence[int], deadline_s: float | None) -> None:
        self.calls.append(f"stop slots {list(slot_ids)}")

    def start_training(self, step: int) -> None:
        self.calls.append(f"train step {step}")

    def release_capacity(self, source: ElasticSource) -> None:
        self.calls.append(f"release {source.tag}")


def dry_run(
    cfg: RunConfig, config_path: str, origins: dict[str, str], checks: Sequence[str]
) -> str:
    """The dry run's text (pure but for reading the profile file): ``origins``, where
    the values not in the config file came from; ``checks``, the pre-queue checks'
    lines."""
    from pearl_hpc.backends.world import (
        base_job_spec,
        domain_argv,
        het_groups,
        multi_node,
        world_argv,
        world_env,
    )
    from pearl_hpc.slurm.scripts import render_sbatch

    layout = base_layout(cfg.workers, cfg.layout)
    out = [f"# pearl-hpc run {config_path} --dry-run: nothing is submitted or started", ""]
    if origins:
        out += ["## values from the cluster's file and --set", *_origin_lines(cfg, origins), ""]
    where = "its nodes" if multi_node(cfg) else "this node, or its one node"
    out.append(f"## base job ({where}: `pearl-hpc run {config_path} --sbatch` submits it)")
    python = cfg.slurm.python or "python3"
    out.append(render_sbatch(base_job_spec(cfg, RUN_DIR, python=python)).rstrip())
    out += ["", "## the world: the master"]
    node = "NODE0" if multi_node(cfg) else ""
    argv = world_argv(cfg, RUN_DIR, "MODEL_DIR", node=node, python="python3")
    env = [f"{k}='{v}'" for k, v in world_env(cfg, RUN_DIR).items()]
    out.append(" ".join([*env, *argv]))
    domains, groups = domains_of(layout), het_groups(cfg)
    out += ["", "## the failure domains beside it (each started again if it dies)"]
    later = [d for d in domains[2:] if groups and groups[d.ranks[0].node]][:1]
    for domain in [*domains[:2], *later]:  # (and an engine rank of a later component)
        argv = domain_argv(cfg, RUN_DIR, "MODEL_DIR", domain, 0, groups=groups, python="python3")
        out.append(" ".join(argv))
    if multi_node(cfg):
        counts = enumerate(ranks_per_node(list(domains[0].ranks)))
        hosts = ", ".join(f"{count} x NODE{n}" for n, count in counts if count)
        out.append(f"{RunDir(RUN_DIR).hostfile} (the trainer ranks' step: a line a rank): {hosts}")
    if len(domains) > 2:
        out.append(f"(and so on: {len(domains) - 1} engine ranks, a launch each)")
    out.append(
        "each rank sets CUDA_VISIBLE_DEVICES to its devices of its node's GPUs (as Slurm "
        "gives them to the job); device auto: cuda where it is given GPUs, else cpu; tpN: "
        "an engine's tensor-parallel size on cuda"
    )
    out.append(
        f"{'rank':>4}  {'process':<8} {'node':>4}  {'devices':<12} {'device':<10} GPUs (role table)"
    )
    for r in layout:
        devices = ",".join(map(str, r.devices)) or "-"
        gpus = ",".join(r.gpu_ids) or "-"
        note = "  (overlap: time-shared with the trainer ranks)" if r.overlap else ""
        device = _device_text(cfg, r)
        out.append(f"{r.rank:>4}  {r.kind:<8} {r.node:>4}  {devices:<12} {device:<10} {gpus}{note}")
    if cfg.backend == "slurm":
        out += ["", "## elastic request (the first)", _elastic_text(cfg).rstrip()]
    plan = run_plan(cfg)
    out += ["", "## memory plan"]
    out += plan.lines if plan is not None else [
        f"none: the shape of {cfg.model} is not known here (the tiny model, or a directory "
        "without config.json that is not Qwen3-8B or Qwen3-30B-A3B)"
    ]  # fmt: skip
    out += ["", "## the controller's first decision", *_first_decision(cfg, layout)]
    out += ["", "## checks before the queue", *checks]
    return "\n".join(out) + "\n"


def _origin_lines(cfg: RunConfig, origins: dict[str, str]) -> list[str]:
    """``key: value  (source)`` for each value the config file does not set."""
    import dataclasses

    plain = dataclasses.asdict(cfg)
    lines = []
    for key, source in sorted(origins.items()):
        value: Any = plain
        for part in key.split("."):
            value = value[int(part)] if isinstance(value, list) else value.get(part)
        if isinstance(value, str) and Path(value).is_absolute():
            value = _below_cwd(value)
        lines.append(f"{key}: {value!r}  ({_relative(source)})")
    return lines


def _relative(source: str) -> str:
    """A source with its path relative to the working directory where it is below it."""
    kind, _, path = source.partition(" ")
    return f"{kind} {_below_cwd(path)}" if path else source


def _below_cwd(path: str) -> str:
    """``path`` relative to the working directory where it is below it (the dry run's
    text is the same on every machine)."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return path


def _device_text(cfg: RunConfig, rank: Any) -> str:
    """The device setting of a rank's kind (an engine's with its tensor-parallel size)."""
    if rank.kind == TRAINER:
        return cfg.train.device
    if rank.kind == ENGINE:
        tp = f" tp{len(rank.devices)}" if len(rank.devices) > 1 else ""
        return cfg.engine.device + tp
    return "-"


def _elastic_text(cfg: RunConfig) -> str:
    from pearl_hpc.backends.slurm import elastic_job_spec, request_pools
    from pearl_hpc.slurm.scripts import render_sbatch

    model_dir = cfg.model if cfg.model != "tiny" else "MODEL_DIR"
    pools = request_pools(cfg.elastic, 0)
    job = elastic_job_spec(cfg.elastic, pools, cfg.slurm, "RUN_TAG", RunDir(RUN_DIR).elastic,
                           model_dir, cfg.slurm.python or "python3")  # fmt: skip
    return render_sbatch(job)


def _first_decision(cfg: RunConfig, layout: list[Any]) -> list[str]:
    path = Path(cfg.profile)
    profile = load_profile(path if path.is_absolute() else REPO_CONFIGS / path)
    executor = RecordingExecutor()
    controller = Controller(profile, executor, policy=cfg.policy, clock=lambda: 0.0)
    train_gpus = tuple(g for r in layout if r.kind == TRAINER for g in r.gpu_ids)
    controller.register_training(
        train_gpus, overlap_gpu_sets=[r.gpu_ids for r in layout if r.overlap]
    )
    controller.grant_reserved([r.gpu_ids for r in layout if r.kind == ENGINE and not r.overlap])
    lines = []
    for record in controller.history:
        lines.append(f"target {record.plan.target} ({record.cause}): {record.decision.reason}")
        if record.borrow_gate is not None:
            lines.append(f"borrowing: {record.borrow_gate.reason}")
    lines += [f"- {call}" for call in executor.calls]
    demand = controller.elastic_demand(cfg.elastic.max_workers)
    lines.append(
        f"elastic workers worth requesting: {demand.workers} of at most "
        f"{cfg.elastic.max_workers} ({demand.reason})"
    )
    return lines
