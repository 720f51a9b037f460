"""Hardware/model cost model of one rollout worker (a TP group) and of training.

Every number has a public origin (vendor data sheets, model configs) or is an efficiency
we state; nothing is fitted to PEARL's results here (the calibration report compares).

Per engine iteration on one worker with ``tp`` GPUs:
  - memory time = (weight bytes read + KV bytes read) / (tp * HBM * mem_eff). A dense
    model reads all weights; an MoE model reads the dense part plus the experts the
    iteration's tokens touch: ``E * (1 - (1 - k/E)^tokens)`` per layer (uniform routing);
  - compute time = FLOPs / (tp * peak * compute_eff): ``2 * active_params`` per token
    plus attention ``4 * layers * q_heads * head_dim * context`` per token;
  - a decode iteration is ``max(memory, compute) + overhead``; a colocated iteration that
    also carries a prefill chunk pays the chunk's compute on top (the interference);
  - overhead = scheduler/sampling + per-layer TP all-reduce latency.
KV capacity = tp * memory * gpu_memory_utilization - weights - activation reserve.
Training step = 8 * active_params * tokens FLOPs (forward + backward + old-logprob
forward) at a stated MFU, plus the weight broadcast to rollout workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from pearl_hpc.core.weightcost import SyncCost, sync_cost
from pearl_hpc.errors import PearlError


class SimConfigError(PearlError):
    """Unknown model/GPU or an impossible simulator setting."""


@dataclass(frozen=True)
class GpuSpec:
    name: str
    bf16_flops: float  # dense bf16 peak, FLOP/s
    hbm_bytes_per_s: float
    memory_bytes: float
    network_bytes_per_s: float  # per worker, between rollout pools (KV transfer)
    source: str


@dataclass(frozen=True)
class ModelSpec:
    name: str
    total_params: float
    active_params: float
    expert_params: float  # params inside routed experts (0 for dense)
    num_experts: int
    experts_per_token: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    source: str

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2  # K and V, bf16

    @property
    def weight_bytes(self) -> float:
        return 2.0 * self.total_params


GPUS: dict[str, GpuSpec] = {
    "h800": GpuSpec(
        "h800",
        989e12,
        3.35e12,
        80e9,
        100e9,
        "NVIDIA H800 SXM: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, 80 GB; "
        "800 Gb/s InfiniBand per node (PEARL.md)",
    ),
    "h100": GpuSpec(
        "h100",
        989e12,
        3.35e12,
        80e9,
        100e9,
        "NVIDIA H100 SXM5 data sheet: 989 TFLOP/s bf16 dense, 3.35 TB/s, 80 GB; "
        "400 Gb/s NDR per GPU",
    ),
    "a100": GpuSpec(
        "a100",
        312e12,
        2.039e12,
        80e9,
        25e9,
        "NVIDIA A100 SXM4 80GB data sheet: 312 TFLOP/s bf16 dense, 2.039 TB/s; "
        "200 Gb/s HDR per GPU",
    ),
}

MODELS: dict[str, ModelSpec] = {
    "qwen3-8b": ModelSpec(
        "qwen3-8b",
        8.19e9,
        8.19e9,
        0.0,
        0,
        0,
        36,
        32,
        8,
        128,
        "Qwen3-8B config.json: 36 layers, 32 q / 8 kv heads, head_dim 128",
    ),
    # experts: 48 layers * 128 experts * 3 * 2048 hidden * 768 moe_intermediate = 29.0e9
    "qwen3-30b-a3b": ModelSpec(
        "qwen3-30b-a3b",
        30.5e9,
        3.3e9,
        29.0e9,
        128,
        8,
        48,
        32,
        4,
        128,
        "Qwen3-30B-A3B config.json: 48 layers, 32 q / 4 kv heads, "
        "head_dim 128, 128 experts top-8, moe_intermediate 768",
    ),
}

# Stated efficiencies and engine constants (assumptions, not fits).
MEM_EFFICIENCY = 0.65  # achieved / peak HBM bandwidth in decode (vLLM-class engines)
PREFILL_EFFICIENCY_DENSE = 0.45  # achieved / peak FLOP/s, dense prefill GEMMs
PREFILL_EFFICIENCY_MOE = 0.30  # MoE prefill GEMMs (grouped GEMMs, routing)
ATTENTION_EFFICIENCY = 0.60  # FlashAttention-class kernels on long contexts
ITERATION_OVERHEAD_S = 0.8e-3  # scheduling, sampling, launch per engine step
ALLREDUCE_LATENCY_S = 8e-6  # per TP all-reduce (2 per layer) on NVLink
# CUDA graphs cover decode-only batches; an iteration that carries prefill runs eagerly
# and pays kernel-launch latency: ~20 kernels per layer at ~5 us each.
EAGER_LAUNCH_S_PER_LAYER = 100e-6
NETWORK_EFFICIENCY = 0.5  # achieved / line rate for KV transfer
TRANSFER_LATENCY_S = 2e-3  # per KV hand-off (handshake, block-table exchange)
GPU_MEMORY_UTILIZATION = 0.9
ACTIVATION_RESERVE_BYTES = 4e9  # per GPU: activations, CUDA graphs, workspace
CHUNK_TOKENS = 8192  # chunked-prefill budget per iteration (vLLM max_num_batched_tokens)
TRAIN_MFU_DENSE = 0.20
TRAIN_MFU_MOE = 0.12

# Reconfiguration latencies measured by PEARL (PEARL.md section 7), per model; role
# changes are "tens of seconds" there (rebinding, router update, graph recapture): 20 s.
RECONFIG_S: dict[str, dict[str, float]] = {
    "qwen3-8b": {
        "preparation": 56.29,
        "finalisation": 11.05,
        "activation": 6.26,
        "deactivation": 3.18,
        "rerole": 20.0,
    },
    "qwen3-30b-a3b": {
        "preparation": 67.06,
        "finalisation": 17.89,
        "activation": 6.09,
        "deactivation": 4.38,
        "rerole": 20.0,
    },
}


@dataclass(frozen=True)
class CostModel:
    gpu: GpuSpec
    model: ModelSpec
    tp: int = 2
    # per-worker KV hand-off bandwidth measured on the cluster (a calibrated profile's
    # transfer_bytes_per_s); None: the data sheet's link at NETWORK_EFFICIENCY
    kv_transfer_bytes_per_s: float | None = None

    @classmethod
    def from_names(cls, gpu: str, model: str, tp: int = 2) -> CostModel:
        if gpu.lower() not in GPUS:
            raise SimConfigError(f"unknown GPU {gpu!r}; known: {', '.join(sorted(GPUS))}")
        if model.lower() not in MODELS:
            raise SimConfigError(f"unknown model {model!r}; known: {', '.join(sorted(MODELS))}")
        if tp < 1:
            raise SimConfigError(f"tp must be >= 1, got {tp}")
        cost = cls(GPUS[gpu.lower()], MODELS[model.lower()], tp)
        if cost.kv_capacity_tokens <= 0:
            raise SimConfigError(
                f"{model} does not fit on {tp}x {gpu}: raise tp (weights "
                f"{cost.model.weight_bytes / 1e9:.0f} GB)"
            )
        return cost

    # ------------------------------------------------------------------ sizes
    # (cached: the simulator asks them at every engine iteration)
    @cached_property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token

    @cached_property
    def kv_capacity_tokens(self) -> int:
        usable = self.tp * (
            self.gpu.memory_bytes * GPU_MEMORY_UTILIZATION - ACTIVATION_RESERVE_BYTES
        )
        return int((usable - self.model.weight_bytes) / self.kv_bytes_per_token)

    # ------------------------------------------------------------- iterations
    @cached_property
    def _overhead_s(self) -> float:
        allreduce = 2 * self.model.num_layers * ALLREDUCE_LATENCY_S if self.tp > 1 else 0.0
        return ITERATION_OVERHEAD_S + allreduce

    def _weight_bytes_read(self, tokens: float) -> float:
        m = self.model
        if not m.num_experts:
            return m.weight_bytes
        touched = 1.0 - (1.0 - m.experts_per_token / m.num_experts) ** max(tokens, 1.0)
        return 2.0 * (m.total_params - m.expert_params) + 2.0 * m.expert_params * touched

    @cached_property
    def _linear_per_token(self) -> float:
        return 2.0 * self.model.active_params

    @cached_property
    def _attention_per_token(self) -> float:
        m = self.model
        return 4.0 * m.num_layers * m.num_q_heads * m.head_dim

    @cached_property
    def _hbm_bytes_per_s(self) -> float:
        return self.tp * self.gpu.hbm_bytes_per_s * MEM_EFFICIENCY

    @cached_property
    def _peak_flops(self) -> float:
        return self.tp * self.gpu.bf16_flops

    def _linear_flops(self, tokens: float) -> float:
        return self._linear_per_token * tokens

    def _attention_flops(self, context_tokens: float) -> float:
        return self._attention_per_token * context_tokens

    def decode_iteration_s(self, num_seqs: int, context_tokens: float) -> float:
        """One decode step of ``num_seqs`` sequences holding ``context_tokens`` in all."""
        memory_s = (
            self._weight_bytes_read(num_seqs) + context_tokens * self.kv_bytes_per_token
        ) / self._hbm_bytes_per_s
        flops = self._linear_per_token * num_seqs + self._attention_per_token * context_tokens
        compute_s = flops / self._peak_flops
        return max(memory_s, compute_s) + self._overhead_s

    def prefill_chunk_s(self, tokens: float, context_tokens: float) -> float:
        """Compute time of a prefill chunk of ``tokens`` whose attention spans
        ``context_tokens`` on average (prefix + half the chunk)."""
        eff = PREFILL_EFFICIENCY_MOE if self.model.num_experts else PREFILL_EFFICIENCY_DENSE
        peak = self._peak_flops
        linear_s = self._linear_flops(tokens) / (peak * eff)
        return linear_s + self._attention_flops(tokens * context_tokens) / (
            peak * ATTENTION_EFFICIENCY
        )

    def prefill_iteration_s(self, tokens: float, context_tokens: float) -> float:
        """A prefill-only iteration (a dedicated prefill worker); eager, no CUDA graph."""
        bw = self._hbm_bytes_per_s
        memory_s = self._weight_bytes_read(tokens) / bw
        compute_s = self.prefill_chunk_s(tokens, context_tokens)
        return max(memory_s, compute_s) + self._overhead_s + self.eager_launch_s

    def mixed_iteration_s(
        self, num_seqs: int, context_tokens: float, chunk_tokens: float, chunk_context: float
    ) -> float:
        """A colocated iteration: every decode sequence plus a prefill chunk. The chunk's
        compute adds to the decode step (the interference) and the batch runs eagerly."""
        return (
            self.decode_iteration_s(num_seqs, context_tokens)
            + self.prefill_chunk_s(chunk_tokens, chunk_context)
            + self.eager_launch_s
        )

    @cached_property
    def eager_launch_s(self) -> float:
        return self.model.num_layers * EAGER_LAUNCH_S_PER_LAYER

    def transfer_s(self, tokens: float) -> float:
        """KV hand-off of ``tokens`` from a prefill to a decode worker."""
        return TRANSFER_LATENCY_S + tokens * self.kv_bytes_per_token / self.kv_transfer_rate

    @property
    def kv_transfer_rate(self) -> float:
        """Bytes/s of one prefill -> decode hand-off (each worker its own link)."""
        if self.kv_transfer_bytes_per_s is not None:
            return self.kv_transfer_bytes_per_s
        return self.gpu.network_bytes_per_s * NETWORK_EFFICIENCY

    # --------------------------------------------------------------- training
    def training_step_s(self, tokens: float, num_gpus: int) -> float:
        mfu = TRAIN_MFU_MOE if self.model.num_experts else TRAIN_MFU_DENSE
        compute_s = 8.0 * self.model.active_params * tokens / (num_gpus * self.gpu.bf16_flops * mfu)
        return compute_s + self.sync(num_gpus).trainer_s + self.weight_sync_s

    def sync(self, training_gpus: int) -> SyncCost:
        """One version's way to the engines (:mod:`pearl_hpc.core.weightcost`: FSDP2
        over the training GPUs, engines on other nodes). Its trainer part and the engines'
        pause end the training step; its publish overlaps generation (the engines serve
        the version they hold meanwhile, within the staleness bound), so it is not
        charged."""
        return sync_cost(self.model.weight_bytes, training_gpus, self.tp)

    @property
    def weight_sync_s(self) -> float:
        """What the engines pause for at the end of the training step: each reloads the
        new version from its host copy."""
        return self.sync(1).pause_s

    # ---------------------------------------------------------- reconfiguration
    def reconfig_s(self, kind: str) -> float:
        return RECONFIG_S[self.model.name][kind]
