"""The run config of ``pearl-hpc run`` (one schema for both backends).

    name, runs_dir, model, profile, policy   what is trained, how the controller decides
    backend: local | slurm                   how elastic capacity comes to exist
    workers: training_gpus, reserved_rollout, overlap
    layout:  nodes and GPUs of the base world (backend slurm: its batch job's nodes)
    elastic: max_workers, grace_s; pools and request (slurm: what is asked of Slurm) or
             trace | replay (local: the machine's availability)
    cluster: the cluster's file the config starts from (config/cluster.py)
    slurm:   site settings of every job the run submits, squeue polling, socket
             interface, lease (config/slurm.py)
    run:     the workload (steps, env and its options, tasks, batch, sampling, staleness)
    engine:  the vLLM engines (device, memory, batch, any further vLLM EngineArgs)
    train:   the trainer's device, sharding, micro-batches and memory, the optimizer and its
             schedule, weight transport, the GRPO objective (off-policy correction, loss
             aggregation, KL, advantages)
    dashboards: TensorBoard event files, Weights & Biases (the metrics.jsonl keys)

Strict: an unknown key, a value out of range or an inconsistent pair is a
:class:`~pearl_hpc.errors.ConfigError` naming the field and the fix.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pearl_hpc.config.cluster import ClusterFile, resolve_run_mapping
from pearl_hpc.config.files import read_user_text
from pearl_hpc.config.slurm import (
    SLURM_MEM,
    SLURM_NAME,
    SLURM_TIME,
    SlurmSettings,
    slurm_problem,
    template_problem,
)
from pearl_hpc.config.traces import AvailabilityTrace, load_segment, load_trace
from pearl_hpc.core.policies import PolicyConfig
from pearl_hpc.core.schema import from_mapping, spec_field
from pearl_hpc.errors import ConfigError

BACKENDS = ("local", "slurm")
LR_SCHEDULES = ("constant", "cosine")  # the trainer's learning-rate schedules
CORRECTIONS = ("none", "tis", "decoupled")  # the objective's options (train/objective.py)
LOSS_TYPES = ("bnpo", "grpo", "dr_grpo")
MAX_STALENESS = 4  # the most weight versions a rollout may lag behind the trainer
# vLLM EngineArgs the engines set themselves (engine.vllm_args may not), and from what
OWNED_ARGS = {
    "model": "the run's model",
    "seed": "run.seed",
    "max_model_len": "run.max_context_tokens",
    "max_num_seqs": "engine.max_num_seqs",
    "gpu_memory_utilization": "engine.gpu_memory_utilization",
    "tensor_parallel_size": "layout.gpus_per_worker (elastic: the pool's gpus_per_worker)",
    "kv_transfer_config": "the engine's role (engine.kv_buffer_device for its buffer)",
    "distributed_executor_backend": "the tensor-parallel size (uni for 1 GPU, mp above)",
    "worker_extension_cls": "pearl_hpc (TP workers load each version from a file)",
    "enable_sleep_mode": "the device (on for cuda: borrowing frees the GPU)",
    "enable_logging_iteration_details": "pearl_hpc (the tracker's per-iteration telemetry)",
    "logprobs_mode": "pearl_hpc (the trainer's behaviour log-probs)",
}


@dataclass(frozen=True)
class WorkersConfig:
    training_gpus: int = spec_field("GPUs the trainer holds (names on CPU)", default=1, ge=1)
    reserved_rollout: int = spec_field("dedicated rollout workers from the start", default=1, ge=1)
    overlap: int = spec_field(
        "overlap workers that borrow training GPUs (<= training_gpus)", default=1, ge=0
    )


@dataclass(frozen=True)
class LayoutConfig:
    """Where the base world's ranks run. The local backend runs every rank on this
    machine; on Slurm a layout over several nodes is a batch job of that many nodes
    (``pearl-hpc run CONFIG --dry-run`` prints its sbatch command)."""

    gpus_per_node: int = spec_field("GPUs of one node of the base job", default=8, ge=1)
    gpus_per_worker: int = spec_field(
        "GPUs of one reserved or overlap engine worker (its tensor-parallel size)",
        default=1,
        ge=1,
    )
    training_nodes: int = spec_field(
        "nodes of the trainer ranks, one per training GPU (the overlap engines share them)",
        default=1,
        ge=1,
    )
    rollout_nodes: int = spec_field(
        "nodes of the reserved engine ranks (0: the training nodes' spare GPUs)",
        default=0,
        ge=0,
    )
    cpus_per_rank: int = spec_field("CPUs of each rank of a multi-node base job", default=1, ge=1)
    gpu_memory_gb: float = spec_field(
        "memory of one GPU, GB (the memory plan's budget: H100/H800 80, H200 141)",
        default=80.0,
        gt=0,
    )
    host_memory_gb: float = spec_field(
        "memory of one node, GB (a node the layout uses in part asks its GPUs' share of it "
        "where the site asks whole nodes: slurm.mem 0 or slurm.exclusive; 0: not given)",
        default=0.0,
        ge=0,
    )

    @property
    def nodes(self) -> int:
        return self.training_nodes + self.rollout_nodes


@dataclass(frozen=True)
class TracePoint:
    at_step: int = spec_field("the step whose rollout this point precedes", ge=0)
    workers: int = spec_field("elastic workers available from then on", ge=0)
    after_s: float = spec_field(
        "seconds into that step's rollout (0: before it starts)", default=0.0, ge=0
    )


@dataclass(frozen=True)
class TraceReplay:
    """A time-based availability trace replayed over the run's wall clock."""

    segment: int = spec_field(
        "PEARL segment 1-3 of the real spot traces in pearl_hpc/data/traces (0: none)",
        default=0,
        ge=0,
        le=3,
    )
    file: str = spec_field("or an availability trace CSV (time_s,count)", default="")
    speedup: float = spec_field("trace seconds per run second", default=60.0, gt=0)
    instances_per_worker: int = spec_field(
        "trace instances (GPUs) per elastic worker", default=1, ge=1
    )
    max_workers: int = spec_field(
        "at most this many elastic workers (engine processes on this machine)", default=2, ge=0
    )
    poll_s: float = spec_field("how often the trace is read, run seconds", default=0.5, gt=0)

    @property
    def enabled(self) -> bool:
        return bool(self.segment or self.file)

    def load(self) -> AvailabilityTrace:
        return load_segment(self.segment) if self.segment else load_trace(self.file)


@dataclass(frozen=True)
class PoolConfig:
    """Where elastic workers are requested from (backend slurm): one partition and the
    shape of one worker there."""

    partition: str = spec_field("partition (preemptible, or with idle nodes)", default="elastic")
    qos: str = spec_field("sbatch --qos ('': slurm.qos)", default="")
    account: str = spec_field("sbatch --account ('': slurm.account)", default="")
    constraint: str = spec_field(
        "sbatch --constraint, e.g. h100 ('': slurm.constraint)", default=""
    )
    mem: str = spec_field(
        "sbatch --mem of one worker ('': slurm.mem_per_gpu, else Slurm's default)", default=""
    )
    gpus_per_worker: int = spec_field("GPUs of one elastic engine worker", default=1, ge=1)
    cpus_per_worker: int = spec_field("CPUs of one elastic engine worker", default=1, ge=1)
    time_limit: str = spec_field("time limit of a request (Slurm time)", default="1:00:00")
    signal_lead_s: int = spec_field(
        "seconds of notice before a preemption or the time limit (sbatch --signal=B:USR2@N)",
        default=60,
        ge=1,
    )
    sbatch_extra: list[str] = spec_field(
        "further sbatch options of each worker's component (e.g. --exclusive; after "
        "slurm.sbatch_extra)",
        default=[],
    )
    hetjob_workers: int = spec_field(
        "request: hetjob: components one request takes from this pool", default=1, ge=0
    )
    role: str = spec_field(
        "the role a worker there takes when the plan needs it (e.g. decode on nodes with "
        "more GPU memory): any | prefill | decode",
        default="any",
    )


REQUESTS = ("single", "hetjob")
POOL_ROLES = ("any", "prefill", "decode")


@dataclass(frozen=True)
class ElasticConfig:
    grace_s: float = spec_field("reclaim deadline after the notice, seconds", default=30.0, gt=0)
    max_workers: int = spec_field(
        "at most this many elastic workers requested (the expansion gate decides how many "
        "of them are worth it)",
        default=4,
        ge=0,
    )
    request: str = spec_field(
        "backend slurm: single (one one-worker job per worker, each starts as soon as one "
        "worker's GPUs are idle) | hetjob (one job of every pool's hetjob_workers, started "
        "together)",
        default="single",
    )
    pools: list[PoolConfig] = spec_field(
        "backend slurm: partitions to request workers from (single: the soonest start "
        "sbatch --test-only estimates, in turn on a tie)",
        default=[PoolConfig()],
    )
    pending_timeout_s: float = spec_field(
        "backend slurm: a request pending this long is cancelled and asked again (of the "
        "next pool)",
        default=600.0,
        gt=0,
    )
    strict: bool = spec_field(
        "backend slurm: a pool Slurm refuses for good (no such partition, an account or "
        "qos it does not take) ends the run, one line naming it; false: the run goes on "
        "without that pool (shown as refused in the live line, status and summary)",
        default=False,
    )
    trace: list[TracePoint] = spec_field(
        "backend local: the machine's elastic availability, by step", default=[]
    )
    replay: TraceReplay = spec_field(
        "backend local: or availability over time, from a real trace (replaces trace)",
        default=TraceReplay(),
    )


@dataclass(frozen=True)
class TasksSettings:
    path: str = spec_field(
        "tasks: a .jsonl or .parquet file or a datasets directory, one task per row "
        "(handed to the environment's reset); '' = the environment draws its own",
        default="",
    )
    eval_path: str = spec_field("held-out tasks; '' = eval_fraction of path", default="")
    eval_fraction: float = spec_field(
        "share of path held out (eval split) when there is no eval_path", default=0.0, ge=0, le=0.9
    )
    shuffle: bool = spec_field("a new seeded order every pass over the tasks", default=True)


@dataclass(frozen=True)
class RunSettings:
    steps: int = spec_field("training steps", default=4, ge=1)
    env: str = spec_field(
        "environment: calc | code | synthetic, an installed plugin's name (entry point "
        "group pearl_hpc.environments) or an import path package.module:factory",
        default="calc",
    )
    env_options: dict[str, Any] = spec_field(
        "keyword options of the environment's factory (its config fields)", default={}
    )
    env_timeout_s: float = spec_field(
        "one environment reset or step; past it that trajectory fails (kept out of training)",
        default=120.0,
        gt=0,
    )
    tasks: TasksSettings = spec_field(
        "the task dataset (none: built-in tasks)", default=TasksSettings()
    )
    max_turns: int = spec_field("turns per trajectory", default=2, ge=1)
    num_groups: int = spec_field("prompts per step", default=2, ge=1)
    group_size: int = spec_field("samples per prompt (GRPO group)", default=4, ge=1)
    max_tokens_per_turn: int = spec_field("generation budget per turn", default=16, ge=1)
    max_context_tokens: int = spec_field(
        "a trajectory stops before its context passes this (the engines' max_model_len)",
        default=1024,
        ge=64,
    )
    temperature: float = spec_field("sampling temperature", default=1.0, ge=0)
    seed: int = spec_field("rollout and training seed", default=0, ge=0)
    log_every_s: float = spec_field(
        "a batch job's log (not a terminal: that has a live line) gets the rollout line "
        "every this many seconds between the step lines (0: never)",
        default=60.0,
        ge=0,
    )
    max_restarts: int = spec_field(
        "a world that fails (a rank died: its launcher ends them all) is started again with "
        "--resume by its launcher this many times",
        default=3,
        ge=0,
    )
    heartbeat_timeout_s: float = spec_field(
        "a rank of the run silent this long (they heartbeat every second) is declared "
        "failed: an engine's slot is replaced",
        default=10.0,
        ge=3,
    )
    max_staleness: int = spec_field(
        "rollouts run up to this many weight versions behind the trainer: 1: step k+1's "
        "rollout runs while step k trains; 2: rollouts k+1 and k+2 may; 0: synchronous "
        "steps",
        default=1,
        ge=0,
        le=MAX_STALENESS,
    )

    @property
    def batch_size(self) -> int:
        return self.num_groups * self.group_size


DEVICE_SETTINGS = ("auto", "cpu", "cuda")
WEIGHT_SYNCS = ("gloo", "nccl")


@dataclass(frozen=True)
class EngineSettings:
    """The vLLM engines of every rank (reserved, overlap and elastic)."""

    device: str = spec_field(
        "auto (cuda where the rank is given a GPU, else cpu) | cpu | cuda", default="auto"
    )
    gpu_memory_utilization: float = spec_field(
        "cuda: the share of each of its GPUs' memory one engine takes", default=0.85, gt=0, le=1
    )
    kv_cache_gb: int = spec_field("cpu: one engine's KV cache, GiB", default=1, ge=1)
    kv_buffer_device: str = spec_field(
        "where NIXL stages KV for prefill/decode transfer: auto (the engine's device; on "
        "cuda a cpu buffer would be a host copy of the whole KV cache) | cpu | cuda",
        default="auto",
    )
    max_num_seqs: int = spec_field("sequences one engine batches at most", default=64, ge=1)
    vllm_args: dict[str, Any] = spec_field(
        "further vLLM EngineArgs by their field names (e.g. enforce_eager, "
        "kv_cache_memory_bytes, quantization); checked against the installed vLLM when "
        "the run starts",
        default={},
    )


@dataclass(frozen=True)
class TrainSettings:
    """The trainer's device and weight transport, and the GRPO objective (formulas:
    train/objective.py and docs/design.md)."""

    device: str = spec_field(
        "the trainer ranks: auto (cuda where the rank is given a GPU, else cpu) | cpu | cuda",
        default="auto",
    )
    fsdp: bool = spec_field(
        "shard the trainer ranks' weights, gradients and AdamW state with FSDP2 (bf16 "
        "compute on cuda; each rank checkpoints its own shards; lending a trainer's GPU "
        "moves only its shards)",
        default=False,
    )
    micro_batch_tokens: int = spec_field(
        "tokens one trainer rank forwards at once: each rank's share of a minibatch is "
        "packed into micro-batches of at most this (no padding; a longer trajectory is "
        "one of its own), gradients accumulated over them",
        default=8192,
        ge=2,
    )
    activation_checkpointing: bool | None = spec_field(
        "keep only each decoder block's input for the backward (recompute the rest: "
        "~1/3 more compute for a fraction of the activations); null: on where the "
        "trainer is on cuda",
        default=None,
    )
    logprob_chunk: int = spec_field(
        "positions whose logits over the vocabulary exist at once when log-probs and "
        "entropy are computed (memory: three fp32 [chunk, vocab] buffers)",
        default=1024,
        ge=1,
    )
    lr: float = spec_field("AdamW's (peak) learning rate", default=0.02, gt=0)
    lr_warmup_steps: int = spec_field("steps of linear warm-up to lr", default=0, ge=0)
    lr_schedule: str = spec_field(
        "constant | cosine (from lr to lr_min over run.steps, after the warm-up)",
        default="constant",
    )
    lr_min: float = spec_field("cosine's floor", default=0.0, ge=0)
    weight_decay: float = spec_field("AdamW's decoupled weight decay", default=0.0, ge=0)
    grad_clip: float = spec_field(
        "clip the gradient's L2 norm (over all parameters) to this", default=1.0, gt=0
    )
    minibatch_size: int = spec_field(
        "trajectories per optimizer step (a step's batch makes batch / this updates)",
        default=8,
        ge=1,
    )
    epochs: int = spec_field("passes over each step's batch", default=1, ge=1)
    clip_low: float = spec_field(
        "the ratio pi/pi_old is clipped to [1 - clip_low, 1 + clip_high]", default=0.2, gt=0
    )
    clip_high: float = spec_field(
        "its upper side (DAPO's clip-higher: e.g. 0.28 with clip_low 0.2)", default=0.2, gt=0
    )
    checkpoint_every: int = spec_field(
        "steps between checkpoints (weights, AdamW state, version; one shard per trainer "
        "rank, written while the next step runs; one also after the last step): a resume "
        "loads the newest and trains the steps after it again from their trajectory logs",
        default=10,
        ge=1,
    )
    keep_checkpoints: int = spec_field(
        "checkpoints kept (the newest; the one being written is never the only one)",
        default=2,
        ge=2,
    )
    export_every: int = spec_field(
        "steps between Hugging Face exports (RUN_DIR/exports/vN: config, tokenizer, "
        "sharded bf16 safetensors, written by trainer 0 before the step's ack: ~8 s at "
        "Qwen3-8B); 0: only after the last step",
        default=0,
        ge=0,
    )
    weight_sync: str = spec_field(
        "how new weights reach engines on other nodes: gloo (staged through host memory: "
        "any device, any placement) | nccl (GPU to GPU)",
        default="gloo",
    )
    shared_memory: bool = spec_field(
        "engines on trainer 0's node map each version from the file it is staged in "
        "(/dev/shm) instead of receiving it over the weight group (false: every engine "
        "over the network; then nccl refuses an overlap engine on trainer 0's GPU)",
        default=True,
    )

    correction: str = spec_field(
        "off-policy correction against the engine's log-probs: none | tis (truncated "
        "importance weight) | decoupled (AReaL: weights above is_cap dropped)",
        default="tis",
    )
    is_cap: float = spec_field("the importance weight's cap C", default=2.0, ge=1)
    sequence_mask: float = spec_field(
        "> 0: drop whole sequences whose mean |log(pi_old/mu)| per token exceeds this",
        default=0.0,
        ge=0,
    )
    loss_type: str = spec_field(
        "how token losses add up (TRL's names): bnpo (token mean) | grpo (mean of "
        "sequence means) | dr_grpo (token sum / sequences x max tokens)",
        default="bnpo",
    )
    kl_coef: float = spec_field("weight of the k3 KL to the initial model", default=0.0, ge=0)
    kl_bias_correction: bool = spec_field(
        "the k3 term times the ratio pi/pi_old (TRL's use_bias_correction_kl)", default=False
    )
    advantage_std: str = spec_field(
        "a group's reward std: population (n) | sample (n - 1: TRL, verl)", default="population"
    )
    record_logprobs: bool = spec_field(
        "the engines return each generated token's log-prob (a log-softmax over the "
        "vocabulary per token); false only with correction none: the gap is then not "
        "measured",
        default=True,
    )


WANDB_MODES = ("offline", "online")


@dataclass(frozen=True)
class DashboardSettings:
    tensorboard: bool = spec_field(
        "TensorBoard event files in RUN_DIR/tensorboard (pip install tensorboard)", default=False
    )
    wandb_project: str = spec_field(
        "a Weights & Biases project to log to; '' = off (pip install wandb)", default=""
    )
    wandb_mode: str = spec_field(
        "offline (no network; `wandb sync RUN_DIR/wandb/offline-run-*` later) | online",
        default="offline",
    )


@dataclass(frozen=True)
class RunConfig:
    name: str = spec_field("run name (labels the run directory)")
    runs_dir: str = spec_field(
        "where run directories go (relative: to the working directory; the paths a run "
        "reads -- model, profile, task and trace files -- are relative to the file that "
        "sets them: this config, its cluster's file; --set: the working directory)",
        default="runs",
    )
    model: str = spec_field(
        "'tiny' (built locally) or a model directory (config, tokenizer, weights)",
        default="tiny",
    )
    backend: str = spec_field(
        "local (elastic workers are local processes) | slurm (elastic workers are "
        "heterogeneous Slurm jobs, reclaimed by preemption)",
        default="local",
    )
    cluster: str = spec_field(
        "the cluster's file whose values this config starts from: a name "
        "(configs/clusters/NAME.yaml, or one in $PEARL_CLUSTER_CONFIG) or a path; '': "
        "$PEARL_CLUSTER_CONFIG when it names a file, else none",
        default="",
    )
    slurm: SlurmSettings = spec_field(
        "site settings of every job the run submits, elastic job polling (backend slurm)",
        default=SlurmSettings(),
    )
    profile: str = spec_field(
        "workload profile YAML (relative: beside the config, else a shipped one: "
        "profiles/NAME.yaml of configs/)",
        default="profiles/tiny-cpu.yaml",
    )
    policy: PolicyConfig = spec_field("controller policies", default=PolicyConfig())
    workers: WorkersConfig = spec_field("worker counts", default=WorkersConfig())
    layout: LayoutConfig = spec_field("nodes and GPUs of the base world", default=LayoutConfig())
    elastic: ElasticConfig = spec_field("elastic capacity", default=ElasticConfig())
    run: RunSettings = spec_field("the workload", default=RunSettings())
    engine: EngineSettings = spec_field("the vLLM engines", default=EngineSettings())
    train: TrainSettings = spec_field("the GRPO objective", default=TrainSettings())
    dashboards: DashboardSettings = spec_field(
        "metrics dashboards besides metrics.jsonl", default=DashboardSettings()
    )


_PLAIN_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}")  # a run directory's stem


def read_run_config(path: str | Path, sets: Sequence[str] = ()) -> RunConfig:
    """Read a run config -- over its cluster's file, with ``--set key.path=value``
    overrides on top -- and check its values (pure but for reading the files and an
    availability trace it names); every error names the field and the fix. What needs
    the installed runtimes (environments, task files, vLLM, Slurm) is checked by
    :func:`pearl_hpc.master.preflight.load_run_config`."""
    resolved = resolve_run_mapping(path, sets)
    if resolved.cluster:
        check_cluster_defaults(resolved.cluster)
    cfg = from_mapping(RunConfig, resolved.mapping, where=str(path))
    if cfg.workers.overlap > cfg.workers.training_gpus:
        raise ConfigError(
            f"{path}: workers.overlap ({cfg.workers.overlap}) > "
            f"workers.training_gpus ({cfg.workers.training_gpus}); lower it"
        )
    if cfg.elastic.trace and cfg.elastic.replay.enabled:
        raise ConfigError(
            f"{path}: elastic.trace and elastic.replay are both set; keep one (a step-indexed "
            "trace, or a time-based one replayed)"
        )
    if cfg.elastic.replay.enabled:
        cfg.elastic.replay.load()  # a bad segment or file fails here, naming the fix
    if cfg.slurm.template:
        problem = template_problem(read_user_text(cfg.slurm.template, "slurm.template"))
        if problem:
            raise ConfigError(f"{path}: slurm.template {cfg.slurm.template}: {problem}")
    problem = elastic_problem(cfg.backend, cfg.elastic)
    if problem:
        raise ConfigError(f"{path}: {problem}")
    if cfg.backend not in BACKENDS:
        raise ConfigError(f"{path}: backend {cfg.backend!r}: use local or slurm")
    if cfg.policy.tail_dispatch:
        raise ConfigError(
            f"{path}: policy.tail_dispatch is built in the simulator only (pearl-hpc simulate "
            "--systems pearl+dispatch), not yet in pearl-hpc run; remove it"
        )
    if cfg.policy.tail_start and cfg.run.max_staleness < 1:
        raise ConfigError(
            f"{path}: policy.tail_start starts the next batch in this one's tail, which needs "
            "run.max_staleness >= 1 (it is 0); set run.max_staleness: 1 or remove tail_start"
        )
    if not _PLAIN_NAME.fullmatch(cfg.name):
        raise ConfigError(
            f"{path}: name {cfg.name!r}: a plain name (letters, digits, '.', '_', '-'; "
            "not starting with '.'), e.g. my-run"
        )
    problem = (
        layout_problem(cfg.workers, cfg.layout)
        or engine_problem(cfg.engine)
        or train_problem(cfg.train, cfg.workers)
        or dashboards_problem(cfg.dashboards)
        or slurm_problem(cfg.slurm)
    )
    if problem:
        raise ConfigError(f"{path}: {problem}")
    return cfg


def check_cluster_defaults(cluster: ClusterFile) -> None:
    """A cluster file's run-config keys, each error naming the cluster's file."""
    mapping = {"name": "cluster-defaults", **cluster.defaults}
    defaults = from_mapping(RunConfig, mapping, where=str(cluster.path))
    problem = slurm_problem(defaults.slurm)
    if problem:
        raise ConfigError(f"{cluster.path}: {problem}")


def dashboards_problem(dashboards: DashboardSettings) -> str:
    """What is wrong with ``dashboards:`` ('' if nothing; pure)."""
    if dashboards.wandb_mode not in WANDB_MODES:
        return f"dashboards.wandb_mode {dashboards.wandb_mode!r}: use offline or online"
    return ""


def engine_problem(engine: EngineSettings) -> str:
    """What is wrong with ``engine:`` ('' if nothing; pure: the vllm_args names are
    checked against vLLM itself when the run starts,
    :func:`pearl_hpc.engine.spec.check_engine_install`)."""
    for key in ("device", "kv_buffer_device"):
        if getattr(engine, key) not in DEVICE_SETTINGS:
            return f"engine.{key} {getattr(engine, key)!r}: use auto, cpu or cuda"
    owned = [k for k in engine.vllm_args if k in OWNED_ARGS]
    if owned:
        return f"engine.vllm_args.{owned[0]} is set by {OWNED_ARGS[owned[0]]}; remove it"
    return ""


def train_problem(train: TrainSettings, workers: WorkersConfig = WorkersConfig()) -> str:
    """What is wrong with ``train:`` ('' if nothing; pure)."""
    if train.device not in DEVICE_SETTINGS:
        return f"train.device {train.device!r}: use auto, cpu or cuda"
    if train.weight_sync not in WEIGHT_SYNCS:
        return f"train.weight_sync {train.weight_sync!r}: use gloo or nccl"
    if train.weight_sync == "nccl" and workers.overlap and not train.shared_memory:
        return (
            f"train.weight_sync nccl with workers.overlap {workers.overlap} and "
            "train.shared_memory false: an overlap engine shares trainer 0's GPU and NCCL "
            "forbids two ranks on one GPU; set train.shared_memory true, use gloo, or "
            "workers.overlap 0"
        )
    if train.lr_min > train.lr:
        return f"train.lr_min {train.lr_min} is above train.lr {train.lr}: lower it"
    for key, choices in (
        ("lr_schedule", LR_SCHEDULES),
        ("correction", CORRECTIONS),
        ("loss_type", LOSS_TYPES),
        ("advantage_std", ("population", "sample")),
    ):
        if getattr(train, key) not in choices:
            return f"train.{key} {getattr(train, key)!r}: use one of {', '.join(choices)}"
    if not train.record_logprobs and train.correction != "none":
        return (
            f"train.record_logprobs false: correction {train.correction} needs the engines' "
            "log-probs; record them, or use correction none"
        )
    return ""


def elastic_problem(backend: str, elastic: ElasticConfig) -> str:
    """What is wrong with ``elastic:`` for ``backend`` ('' if nothing; pure)."""
    if backend == "slurm" and (elastic.trace or elastic.replay.enabled):
        return (
            "elastic.trace / elastic.replay: on the slurm backend capacity is what Slurm "
            "starts (elastic.pools); remove them, and replay a trace as other users' load "
            "with slurm/replay-load next to the run"
        )
    if elastic.request not in REQUESTS:
        return f"elastic.request {elastic.request!r}: use single or hetjob"
    if backend == "slurm" and not elastic.pools:
        return "elastic.pools is empty: name at least one partition (elastic.pools[0].partition)"
    if elastic.request == "hetjob" and not sum(p.hetjob_workers for p in elastic.pools):
        return "elastic.request hetjob: every pool has hetjob_workers 0; give one 1 or more"
    for i, pool in enumerate(elastic.pools):
        for key in ("partition", "qos", "account", "constraint"):
            value = getattr(pool, key)
            if value and not SLURM_NAME.fullmatch(value):
                return f"elastic.pools[{i}].{key} {value!r}: letters, digits, _ . + - & | only"
        if pool.mem and not SLURM_MEM.fullmatch(pool.mem):
            return f"elastic.pools[{i}].mem {pool.mem!r}: a Slurm size, e.g. 500G or 0"
        if pool.role not in POOL_ROLES:
            return f"elastic.pools[{i}].role {pool.role!r}: use any, prefill or decode"
        if not SLURM_TIME.fullmatch(pool.time_limit):
            return (
                f"elastic.pools[{i}].time_limit {pool.time_limit!r} is not a Slurm time: use "
                "MM, MM:SS, HH:MM:SS or D-HH:MM:SS"
            )
    return ""


def layout_problem(workers: WorkersConfig, layout: LayoutConfig) -> str:
    """Why ``workers`` do not fit ``layout`` (pure; "" when they do)."""
    gpn, gpw = layout.gpus_per_node, layout.gpus_per_worker
    if gpn % gpw:
        return f"layout.gpus_per_worker ({gpw}) must divide layout.gpus_per_node ({gpn})"
    if workers.training_gpus > layout.training_nodes * gpn:
        return (
            f"workers.training_gpus ({workers.training_gpus}) > layout.training_nodes "
            f"({layout.training_nodes}) x layout.gpus_per_node ({gpn}); add training nodes"
        )
    if workers.training_gpus % gpw:
        return (
            f"workers.training_gpus ({workers.training_gpus}) is not a multiple of "
            f"layout.gpus_per_worker ({gpw}): overlap engines take whole workers of them"
        )
    if workers.overlap * gpw > workers.training_gpus:
        return (
            f"workers.overlap ({workers.overlap}) x layout.gpus_per_worker ({gpw}) > "
            f"workers.training_gpus ({workers.training_gpus}); lower workers.overlap"
        )
    free = (
        layout.rollout_nodes * gpn
        if layout.rollout_nodes
        else layout.training_nodes * gpn - workers.training_gpus
    )
    if workers.reserved_rollout * gpw > free:
        where = "layout.rollout_nodes" if layout.rollout_nodes else "the training nodes' spare"
        return (
            f"workers.reserved_rollout ({workers.reserved_rollout}) x layout.gpus_per_worker "
            f"({gpw}) GPUs do not fit {where} GPUs ({free}); add rollout nodes"
        )
    for key, gpus in (
        ("training_nodes", workers.training_gpus),
        ("rollout_nodes", workers.reserved_rollout * gpw if layout.rollout_nodes else 0),
    ):
        need = -(-gpus // gpn)
        if getattr(layout, key) > need:
            return (
                f"layout.{key} ({getattr(layout, key)}): its {gpus} GPUs fill {need} node(s) "
                f"of {gpn}; the job would hold a node no rank runs on: ask {need}"
            )
    return ""
