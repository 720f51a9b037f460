"""The memory plan of a run: what one trainer rank and one engine hold on a GPU, and what
a training node's host holds at start, from the model's shape and the run config (pure
arithmetic; ``pearl-hpc run CONFIG --dry-run`` prints it, and a run whose trainer or
engine cannot fit is refused before anything is queued).

A trainer rank (``T`` tokens in its largest micro-batch, ``P`` parameters, ``W`` trainer
ranks; FSDP2 divides the first three by ``W``)::

    weights fp32 4P, gradients fp32 4P, AdamW moments 8P
    FSDP2's unsharded working copy: bf16 of the root (embedding, final norm, LM head)
      and of two decoder blocks (the one computing and the one prefetched)
    activations: every block's saved tensors (T x per-block bytes, below) or, with
      checkpointing, each block's input (T x H x 2) plus two blocks' worth while one
      block is recomputed and differentiated
    log-probs: three fp32 [chunk, V] buffers (logits, their exp, the gradient) and the
      LM head's fp32 gradient accumulator (V x H x 4)
    the KL reference (kl_coef > 0): fp32 weights, sharded like the policy

Per block and token, bf16, the tensors autograd keeps (Qwen3: q/k norms, SDPA without
an N x N score matrix): the two norms' inputs and outputs (4H), q, k, v before and after
their norm and rotary (3 x (q + 2kv)), the attention output and o-proj input (2q), and
the MLP's gate, up, activation and product (4I; MoE: 4I per routed expert) -- about 22H
for Qwen3-8B: 184 KB a token a block, 217 GB for a 32K-token trajectory without
checkpointing.

An engine of tensor-parallel size ``tp`` takes ``engine.gpu_memory_utilization`` of each
of its GPUs (vLLM allocates it at start): its bf16 weights (2P / tp), a 2 GB activation
and graph reserve, and the rest is its KV pool, which must hold one trajectory at
``run.max_context_tokens``. An overlap engine and the trainer rank on its GPU take turns
(the trainer's state leaves the GPU while it is lent), so that GPU needs the larger one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pearl_hpc.config.run import RunConfig
from pearl_hpc.core.weightcost import BUCKET_BYTES, BUCKETS_IN_FLIGHT

GB = 1e9
RESERVE_BYTES = 3e9  # per GPU: the CUDA context, NCCL's buffers, the allocator's slack
ENGINE_RESERVE_BYTES = 2e9  # per engine GPU: activations, CUDA graphs, sampler

# HF config.json fields of the models PEARL trains, for a dry run where the model
# directory is not on this machine (its config.json wins when it is)
KNOWN_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-8b": {
        "vocab_size": 151936, "hidden_size": 4096, "num_hidden_layers": 36,
        "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "tie_word_embeddings": False,
    },
    "qwen3-30b-a3b": {
        "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48,
        "intermediate_size": 6144, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "tie_word_embeddings": False, "num_experts": 128,
        "num_experts_per_tok": 8, "moe_intermediate_size": 768,
    },
}  # fmt: skip


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a decoder-only transformer (a Hugging Face config)."""

    name: str
    vocab: int
    hidden: int
    layers: int
    intermediate: int  # dense MLP width (MoE: each expert's)
    q_dim: int  # heads x head_dim
    kv_dim: int  # key-value heads x head_dim
    tied: bool
    experts: int = 0  # 0: dense
    experts_per_token: int = 0
    qk_norm: int = 0  # Qwen3's per-head query and key norms: 2 x head_dim weights a block

    @classmethod
    def from_config(cls, name: str, c: dict[str, Any]) -> ModelShape:
        head_dim = int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
        experts = int(c.get("num_experts") or c.get("num_local_experts") or 0)
        return cls(
            name=name,
            vocab=int(c["vocab_size"]),
            hidden=int(c["hidden_size"]),
            layers=int(c["num_hidden_layers"]),
            intermediate=int(c["moe_intermediate_size"] if experts else c["intermediate_size"]),
            q_dim=int(c["num_attention_heads"]) * head_dim,
            kv_dim=int(c.get("num_key_value_heads") or c["num_attention_heads"]) * head_dim,
            tied=bool(c.get("tie_word_embeddings", False)),
            experts=experts,
            experts_per_token=int(c.get("num_experts_per_tok") or 0),
            qk_norm=2 * head_dim if str(c.get("model_type", "qwen3")).startswith("qwen3") else 0,
        )

    @property
    def block_params(self) -> int:
        h = self.hidden
        attention = 2 * h * self.q_dim + 2 * h * self.kv_dim
        if self.experts:
            mlp = self.experts * 3 * h * self.intermediate + h * self.experts  # + router
        else:
            mlp = 3 * h * self.intermediate
        return attention + mlp + 2 * h + self.qk_norm

    @property
    def expert_params(self) -> int:
        """A block's routed experts (0: dense)."""
        return self.experts * 3 * self.hidden * self.intermediate

    @property
    def root_params(self) -> int:
        """Embedding, final norm and LM head."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.block_params + self.root_params

    @property
    def block_activation_bytes(self) -> int:
        """bf16 bytes one block keeps for its backward, per token (module docstring)."""
        h, q, kv = self.hidden, self.q_dim, self.kv_dim
        mlp = 4 * self.intermediate * (self.experts_per_token if self.experts else 1)
        return 2 * (4 * h + 3 * (q + 2 * kv) + 2 * q + mlp)


def model_shape(model: str, model_dir: Path | None) -> ModelShape | None:
    """The shape of ``model`` from its directory's config.json, else from the known
    models by the directory's name (None: neither)."""
    if model_dir is not None and (model_dir / "config.json").is_file():
        return ModelShape.from_config(
            model_dir.name, json.loads((model_dir / "config.json").read_text())
        )
    known = KNOWN_SHAPES.get(Path(model).name.lower())
    return ModelShape.from_config(Path(model).name, known) if known else None


@dataclass(frozen=True)
class TrainerMemory:
    """One trainer rank's planned GPU bytes."""

    weights: float
    gradients: float
    optimizer: float
    gathered: float  # FSDP2's unsharded working copy
    activations: float  # of the largest micro-batch, as configured
    activations_other: float  # with the checkpointing switch the other way
    logprobs: float
    reference: float

    @property
    def total(self) -> float:
        return (
            self.weights + self.gradients + self.optimizer + self.gathered
            + self.activations + self.logprobs + self.reference
        )  # fmt: skip


def trainer_memory(
    shape: ModelShape,
    *,
    ranks: int,
    fsdp: bool,
    tokens: int,
    checkpointing: bool,
    chunk: int,
    kl: bool,
) -> TrainerMemory:
    """One trainer rank of ``ranks``, forwarding at most ``tokens`` tokens at once."""
    p = shape.params
    shard = ranks if fsdp else 1
    full = tokens * shape.layers * shape.block_activation_bytes
    kept = tokens * shape.layers * shape.hidden * 2 + 2 * tokens * shape.block_activation_bytes
    gathered = 2 * (shape.root_params + 2 * shape.block_params) if fsdp else 0.0
    return TrainerMemory(
        weights=4 * p / shard,
        gradients=4 * p / shard,
        optimizer=8 * p / shard,
        gathered=gathered,
        activations=kept if checkpointing else full,
        activations_other=full if checkpointing else kept,
        logprobs=3 * min(chunk, tokens) * shape.vocab * 4 + shape.vocab * shape.hidden * 4,
        reference=4 * p / shard if kl else 0.0,
    )


@dataclass(frozen=True)
class EngineMemory:
    """One engine GPU's planned bytes."""

    allocated: float  # gpu_memory_utilization of the GPU
    weights: float  # bf16, this GPU's share of the tensor-parallel engine
    kv_pool: float  # what is left for the KV cache
    kv_needed: float  # one trajectory at max_context_tokens, this GPU's share

    @property
    def fits(self) -> bool:
        return self.kv_pool >= self.kv_needed


def engine_memory(
    shape: ModelShape, *, tp: int, utilization: float, gpu_bytes: float, context: int
) -> EngineMemory:
    allocated = utilization * gpu_bytes
    weights = 2 * shape.params / tp
    kv_per_token = shape.layers * 2 * shape.kv_dim * 2 / tp  # K and V, bf16
    return EngineMemory(
        allocated=allocated,
        weights=weights,
        kv_pool=allocated - weights - ENGINE_RESERVE_BYTES,
        kv_needed=context * kv_per_token,
    )


def reload_headroom_bytes(shape: ModelShape, *, tp: int, nccl: bool) -> float:
    """What a weight load into a running engine needs beyond its size, a GPU: vLLM's
    in-place reload makes each module on the device before copying it into place (the
    largest: the embedding or LM head, V x H, or an MoE block's experts, in bf16, its
    share at ``tp``), and an NCCL weight group receives its buckets onto the GPU (two in
    flight: 1 GiB)."""
    largest = 2 * max(shape.vocab * shape.hidden, shape.expert_params) / tp
    return largest + (BUCKETS_IN_FLIGHT * BUCKET_BYTES if nccl else 0)


def overlap_engine_share(configured: float, gpu_bytes: float, headroom_bytes: float) -> float:
    """The share of its GPU an overlap engine takes: ``configured``, or less where the
    lent trainer rank's residue (its CUDA context and NCCL communicators stay on the GPU
    while its tensors are on the host: :data:`RESERVE_BYTES`) and a weight load's
    headroom (:func:`reload_headroom_bytes`) need more of the GPU (pure)."""
    return min(configured, (gpu_bytes - RESERVE_BYTES - headroom_bytes) / gpu_bytes)


def host_bytes_at_start(shape: ModelShape, per_node: int, ranks: int, fsdp: bool) -> float:
    """A training node's host memory as its ``per_node`` trainer ranks (of ``ranks``)
    build the model: replicated, each loads the whole fp32 model; FSDP2, each reads only
    its rows of every tensor from the safetensors files (a shard at a time)."""
    return per_node * 4 * shape.params / (ranks if fsdp else 1)


@dataclass(frozen=True)
class Plan:
    """A run's memory plan: its lines, and what cannot fit ('' if all fits)."""

    lines: list[str]
    problem: str


def _gb(n: float) -> str:
    return f"{n / GB:.1f} GB"


def memory_plan(cfg: RunConfig, shape: ModelShape) -> Plan:
    """The plan of ``cfg``'s trainer ranks and engines for a model of ``shape`` on GPUs of
    ``layout.gpu_memory_gb`` (pure)."""
    t, layout = cfg.train, cfg.layout
    gpu = layout.gpu_memory_gb * GB
    ranks = cfg.workers.training_gpus
    tokens = max(t.micro_batch_tokens, cfg.run.max_context_tokens)
    checkpointing = t.activation_checkpointing is not False  # the trainer is on cuda here
    mem = _rank_memory(cfg, shape, fsdp=t.fsdp, checkpointing=checkpointing)
    budget = gpu - RESERVE_BYTES
    engine = engine_memory(
        shape,
        tp=layout.gpus_per_worker,
        utilization=cfg.engine.gpu_memory_utilization,
        gpu_bytes=gpu,
        context=cfg.run.max_context_tokens,
    )
    overlap = _overlap_engine(cfg, shape) if cfg.workers.overlap else None
    per_node = -(-ranks // layout.training_nodes)
    other = "without" if checkpointing else "with"
    lines = [
        f"{shape.name}: {shape.params / 1e9:.2f}B parameters"
        + (
            f" ({shape.experts} experts, {shape.experts_per_token} a token)"
            if shape.experts
            else ""
        )
        + f"; GPUs of {layout.gpu_memory_gb:g} GB ({_gb(RESERVE_BYTES)} kept for CUDA and NCCL)",
        f"trainer rank (1 of {ranks}, {'FSDP2-sharded' if t.fsdp else 'replicated'}; "
        f"micro-batches of up to {tokens} tokens):",
        f"  weights fp32 {_gb(mem.weights)}, gradients {_gb(mem.gradients)}, "
        f"AdamW {_gb(mem.optimizer)}, unsharded working copy {_gb(mem.gathered)}",
        f"  activations {_gb(mem.activations)} (checkpointing {'on' if checkpointing else 'off'}; "
        f"{other}: {_gb(mem.activations_other)}), log-probs {_gb(mem.logprobs)} "
        f"(chunks of {min(t.logprob_chunk, tokens)}), KL reference {_gb(mem.reference)}",
        f"  total {_gb(mem.total)} of {_gb(budget)}: "
        + ("fits" if mem.total <= budget else "DOES NOT FIT"),
        f"engine GPU (tp{layout.gpus_per_worker}, gpu_memory_utilization "
        f"{cfg.engine.gpu_memory_utilization:g}): {_gb(engine.allocated)} = weights "
        f"{_gb(engine.weights)} + reserve {_gb(ENGINE_RESERVE_BYTES)} + KV pool "
        f"{_gb(engine.kv_pool)} (one {cfg.run.max_context_tokens}-token trajectory: "
        f"{_gb(engine.kv_needed)}): {'fits' if engine.fits else 'DOES NOT FIT'}",
        *([overlap[0]] if overlap is not None else []),
        f"host at start, a training node: "
        f"{_gb(host_bytes_at_start(shape, per_node, ranks, t.fsdp))} ({per_node} trainer "
        + (
            "ranks, each reading its shard of the safetensors)"
            if t.fsdp
            else "ranks, each loading the whole fp32 model)"
        ),
        _checkpoint_line(cfg, shape, per_node),
    ]
    if shape.experts and t.fsdp:
        ep = _gb(2 * (shape.root_params + 2 * (shape.block_params - shape.expert_params
                                                + shape.expert_params / ranks)))  # fmt: skip
        lines.append(
            f"expert parallelism (not built): each rank would keep its {shape.experts}/{ranks} "
            f"experts instead of gathering a block's: working copy {_gb(mem.gathered)} -> {ep}"
        )
    problem = ""
    if mem.total > budget:
        problem = _trainer_fix(cfg, shape, mem, budget, checkpointing)
    elif not engine.fits:
        problem = (
            f"an engine's KV pool ({_gb(engine.kv_pool)} a GPU) cannot hold one "
            f"{cfg.run.max_context_tokens}-token trajectory ({_gb(engine.kv_needed)}): raise "
            "engine.gpu_memory_utilization or layout.gpus_per_worker, or lower "
            "run.max_context_tokens"
        )
    elif overlap is not None and not overlap[1].fits:
        problem = (
            f"an overlap engine's KV pool ({_gb(overlap[1].kv_pool)} a GPU, beside its lent "
            f"trainer rank) cannot hold one {cfg.run.max_context_tokens}-token trajectory "
            f"({_gb(overlap[1].kv_needed)}): raise layout.gpus_per_worker, lower "
            "run.max_context_tokens, or set workers.overlap: 0"
        )
    return Plan(lines, problem)


def _overlap_engine(cfg: RunConfig, shape: ModelShape) -> tuple[str, EngineMemory]:
    """An overlap engine's GPU, sized to leave the lent trainer rank's residue and a
    weight load's headroom (:func:`overlap_engine_share`): its line and its memory."""
    gpu, tp = cfg.layout.gpu_memory_gb * GB, cfg.layout.gpus_per_worker
    headroom = reload_headroom_bytes(shape, tp=tp, nccl=cfg.train.weight_sync == "nccl")
    share = overlap_engine_share(cfg.engine.gpu_memory_utilization, gpu, headroom)
    engine = engine_memory(
        shape, tp=tp, utilization=share, gpu_bytes=gpu, context=cfg.run.max_context_tokens
    )
    line = (
        f"overlap engine GPU: {share:.3f} of it ({_gb(engine.allocated)}), beside the lent "
        f"trainer rank's {_gb(RESERVE_BYTES)} and a weight load's {_gb(headroom)}: KV pool "
        f"{_gb(engine.kv_pool)}: {'fits' if engine.fits else 'DOES NOT FIT'}"
    )
    return line, engine


def _checkpoint_line(cfg: RunConfig, shape: ModelShape, per_node: int) -> str:
    """A checkpoint's bytes: fp32 weights and AdamW's two moments (12 bytes a parameter),
    sharded over the FSDP2 ranks (replicated: trainer 0 saves them whole), staged in
    pinned host memory, kept ``train.keep_checkpoints`` times on disk."""
    t = cfg.train
    state = 12 * shape.params
    staged = per_node * state / cfg.workers.training_gpus if t.fsdp else state
    return (
        f"checkpoint every {t.checkpoint_every} steps: {_gb(state)} on disk "
        f"({t.keep_checkpoints} kept: {_gb(t.keep_checkpoints * state)}), staged in pinned host "
        f"memory: {_gb(staged)} on a training node"
    )


def _rank_memory(
    cfg: RunConfig, shape: ModelShape, *, fsdp: bool, checkpointing: bool
) -> TrainerMemory:
    """A trainer rank of ``cfg`` with ``fsdp`` and ``checkpointing`` as given."""
    return trainer_memory(
        shape,
        ranks=cfg.workers.training_gpus,
        fsdp=fsdp,
        tokens=max(cfg.train.micro_batch_tokens, cfg.run.max_context_tokens),
        checkpointing=checkpointing,
        chunk=cfg.train.logprob_chunk,
        kl=cfg.train.kl_coef > 0,
    )


def _trainer_fix(
    cfg: RunConfig,
    shape: ModelShape,
    mem: TrainerMemory,
    budget: float,
    checkpointing: bool,
) -> str:
    """The one line naming the knob that makes the trainer rank fit."""
    t = cfg.train
    head = f"a trainer rank needs {_gb(mem.total)} of a GPU's {_gb(budget)}"
    if not t.fsdp and cfg.workers.training_gpus > 1:
        sharded = _rank_memory(cfg, shape, fsdp=True, checkpointing=checkpointing)
        if sharded.total <= budget:
            return (
                f"{head} (replicated {shape.params / 1e9:.1f}B fp32 with AdamW): set "
                f"train.fsdp: true ({_gb(sharded.total)} a rank)"
            )
    if not checkpointing and mem.total - mem.activations + mem.activations_other <= budget:
        return (
            f"{head} (activations {_gb(mem.activations)}): set train.activation_checkpointing: true"
        )
    if mem.activations > mem.total / 2:
        knob = (
            "lower train.micro_batch_tokens"
            if t.micro_batch_tokens > cfg.run.max_context_tokens
            else "lower run.max_context_tokens (a trajectory is forwarded whole)"
        )
        return f"{head} (activations {_gb(mem.activations)}): {knob}"
    return (
        f"{head}: shard over more trainer ranks (workers.training_gpus, layout.training_nodes"
        + (")" if t.fsdp else ") with train.fsdp: true")
    )


def run_shape(cfg: RunConfig) -> ModelShape | None:
    """The shape of ``cfg``'s model (its directory relative to the working directory,
    where the run is submitted from); None for the tiny model, or a model whose
    config.json is not here and is not one of the known models."""
    return None if cfg.model == "tiny" else model_shape(cfg.model, Path(cfg.model))


def run_plan(cfg: RunConfig) -> Plan | None:
    """The memory plan of ``cfg``'s model (None: its shape is not known, as above)."""
    shape = run_shape(cfg)
    return None if shape is None else memory_plan(cfg, shape)


def trainer_on_gpu(cfg: RunConfig) -> bool:
    """Whether the trainer ranks will be on cuda (device cuda, or auto on a Slurm
    cluster's GPUs)."""
    return cfg.train.device == "cuda" or (cfg.train.device == "auto" and cfg.backend == "slurm")
