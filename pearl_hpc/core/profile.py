"""The workload profile: the parameters of PEARL.md section 3, one YAML key each."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pearl_hpc.core.schema import from_mapping, spec_field


@dataclass(frozen=True)
class WorkloadProfile:
    """Parameters of the bubble-aware makespan models (PEARL.md section 3).

    Units: seconds, tokens and bytes; "worker" is one rollout engine (a TP group).
    """

    batch_size: int = spec_field("B: trajectories in one rollout batch", gt=0)
    turns: float = spec_field("S: turns of the slowest trajectory", gt=0)
    new_tokens_per_turn: float = spec_field("dL: new prompt (observation) tokens per turn", ge=0)
    gen_tokens_per_turn: float = spec_field("r: generated tokens per turn", gt=0)
    prefill_s_per_token: float = spec_field(
        "t_prefill: prefill time per token on one worker, seconds", ge=0
    )
    decode_fixed_s: float = spec_field(
        "A: fixed cost of one decode iteration (weight reads, launch), seconds", ge=0
    )
    decode_per_seq_s: float = spec_field(
        "b: marginal cost per concurrent sequence in a decode iteration (KV reads), seconds",
        ge=0,
    )
    overhead_s_per_turn: float = spec_field(
        "T_over: per-turn overheads of colocated P/D switching, seconds", ge=0
    )
    env_s: float = spec_field("T_env: environment time along the slowest trajectory, seconds", ge=0)
    decode_bubble_ratio: float = spec_field(
        "theta = (1-f)/f, f the average fraction of trajectories actively decoding", ge=0
    )
    kv_bytes_per_token: float = spec_field("K: KV-cache bytes per token", gt=0)
    transfer_bytes_per_s: float = spec_field(
        "BW: KV transfer bandwidth of one worker's link (prefill -> decode), bytes/s", gt=0
    )
    kv_bytes_per_trajectory: float = spec_field(
        "K_seq: KV-cache bytes one trajectory holds on a decode worker", gt=0
    )
    kv_capacity_bytes_per_worker: float = spec_field(
        "H_max: KV-cache memory of one worker, bytes", gt=0
    )
    mean_turns: float = spec_field(
        "S-bar: mean turns per trajectory, the batch's prefill work B*S-bar*dL (0 = S)",
        default=0.0,
        ge=0,
    )
    ratio_switch_threshold: float = spec_field(
        "hysteresis for P:D ratio changes: minimum relative makespan improvement",
        default=0.05,
        ge=0,
        le=1,
    )
    mode_switch_threshold: float = spec_field(
        "hysteresis for colocated<->disaggregated switches: minimum relative improvement",
        default=0.10,
        ge=0,
        le=1,
    )

    @classmethod
    def from_dict(cls, data: Any, *, where: str = "profile") -> WorkloadProfile:
        return from_mapping(cls, data, where=where)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> WorkloadProfile:
        return dataclasses.replace(self, **changes)


# The parameters the runtime tracker refits from telemetry (PEARL.md section 4).
FITTED_FIELDS: tuple[str, ...] = (
    "turns",
    "mean_turns",
    "new_tokens_per_turn",
    "gen_tokens_per_turn",
    "prefill_s_per_token",
    "decode_fixed_s",
    "decode_per_seq_s",
    "env_s",
    "decode_bubble_ratio",
)
