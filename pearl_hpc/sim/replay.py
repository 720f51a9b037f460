"""A finished run, read back as the simulator's inputs (``pearl-hpc validate-sim``, the
counterfactual of ``pearl-hpc report``).

Everything comes from the run directory; nothing is taken from the simulator's
data-sheet cost model:
- **start-up**: the run clock until the first rollout worker is admitted (engine starts,
  compilation). It is its own phase: the replay's clock starts at its end, the reserved
  workers up, and step 0's rollout is measured from there.
- **physics** (:class:`MeasuredCost`): the profile the tracker refitted by the run's end
  (``summary.json``): a decode iteration ``a + b * sequences``, prefill seconds per
  token, the KV hand-off rate and capacity; training seconds per trained token and the
  weight broadcast from ``metrics.jsonl``; the elastic workers' preparation (grant, or
  the start-up's end, to ready), activation / deactivation of borrowed workers (the
  run's counters: warm starts only, a first start compiles) and role changes
  from ``events.jsonl``.
- **workload**: each step's trajectories as recorded (``trajectories/``): per turn its
  new tokens, its response, the part of it kept in context, and its environment time
  plus the profile's per-turn overhead.
- **capacity**: the elastic grants and reclaims of ``events.jsonl`` on the replay's
  clock (a grant during start-up is there at 0).
- **the controller**: the run's policies and its starting profile (``config.yaml``),
  refitted from the simulated telemetry each step as the real master refits it.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pearl_hpc.config import REPO_CONFIGS, load_profile
from pearl_hpc.config.run import RunConfig, read_run_config
from pearl_hpc.config.traces import AvailabilityTrace
from pearl_hpc.core.profile import WorkloadProfile
from pearl_hpc.errors import PearlError
from pearl_hpc.rollout.types import Trajectory, fold_log
from pearl_hpc.rundir import RunDir, read_jsonl
from pearl_hpc.sim.workload import TrajectorySpec, Turn


class ReplayError(PearlError):
    """A run directory that cannot be replayed; the message says what is missing."""


@dataclass(frozen=True)
class MeasuredCost:
    """The simulator's cost model (:class:`~pearl_hpc.sim.costmodel.CostModel`'s
    interface) from what one run measured. A worker is one unit (``tp`` 1): the run's
    workers, whatever their GPUs, are the simulator's."""

    profile: WorkloadProfile
    train_s_per_token: float
    weight_sync_s: float
    latencies: Mapping[str, float]  # preparation, finalisation, activation, ...
    tp: int = 1

    @property
    def kv_bytes_per_token(self) -> float:
        return self.profile.kv_bytes_per_token

    @property
    def kv_capacity_tokens(self) -> int:
        return int(self.profile.kv_capacity_bytes_per_worker / self.profile.kv_bytes_per_token)

    @property
    def kv_transfer_rate(self) -> float:
        return self.profile.transfer_bytes_per_s

    def decode_iteration_s(self, num_seqs: int, context_tokens: float) -> float:
        return self.profile.decode_fixed_s + self.profile.decode_per_seq_s * num_seqs

    def prefill_chunk_s(self, tokens: float, context_tokens: float) -> float:
        return self.profile.prefill_s_per_token * tokens

    def prefill_iteration_s(self, tokens: float, context_tokens: float) -> float:
        return self.prefill_chunk_s(tokens, context_tokens)

    def mixed_iteration_s(
        self, num_seqs: int, context_tokens: float, chunk_tokens: float, chunk_context: float
    ) -> float:
        return self.decode_iteration_s(num_seqs, context_tokens) + self.prefill_chunk_s(
            chunk_tokens, chunk_context
        )

    def transfer_s(self, tokens: float) -> float:
        return tokens * self.kv_bytes_per_token / self.kv_transfer_rate

    def training_step_s(self, tokens: float, num_gpus: int) -> float:
        return tokens * self.train_s_per_token + self.weight_sync_s

    def reconfig_s(self, kind: str) -> float:
        return self.latencies[kind]


@dataclass(frozen=True)
class RecordedStep:
    """One step as the run measured it, on the replay's clock."""

    step: int
    rollout_s: float  # step 0's from the start-up's end
    generated_tokens: int
    config: str  # serving configuration at the rollout's start
    recorded_s: float  # its record written (training done)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.rollout_s if self.rollout_s > 0 else 0.0


@dataclass(frozen=True)
class RunRecord:
    """What :func:`load_run` read: the simulator's inputs and the measured steps."""

    name: str
    cfg: RunConfig
    startup_s: float
    prior: WorkloadProfile  # the controller's starting profile
    prior_source: str
    cost: MeasuredCost
    sources: Mapping[str, str]  # how each latency of the cost was measured
    batches: tuple[tuple[TrajectorySpec, ...], ...]
    capacity: AvailabilityTrace | None  # elastic workers granted, on the replay's clock
    steps: tuple[RecordedStep, ...]
    counters: Mapping[str, Any]

    @property
    def run_s(self) -> float:
        """The run after start-up: until its last step was recorded."""
        return self.steps[-1].recorded_s


def load_run(run_dir: Path) -> RunRecord:
    """Read a finished run directory (``summary.json`` written) as replay inputs; a
    directory that is not one run of one master, as pearl-hpc writes it, is refused in
    one line (:class:`ReplayError`)."""
    run = RunDir(Path(run_dir))
    if not run.summary.exists():
        raise ReplayError(
            f"{run_dir}: no summary.json; a run is replayed once it has ended "
            "(pearl-hpc status shows where it is)"
        )
    events = read_jsonl(run.events)
    masters = sum(1 for e in events if e.get("kind") == "clock")
    if masters > 1:
        raise ReplayError(
            f"{run_dir}: resumed {masters - 1} time(s); each master has its own clock, and "
            "the replay takes the run of one master"
        )
    try:
        return _read(run, Path(run_dir).name, events)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise ReplayError(
            f"{run_dir}: not a run directory pearl-hpc wrote ({type(exc).__name__}: {exc})"
        ) from None


def _read(run: RunDir, name: str, events: list[dict[str, Any]]) -> RunRecord:
    summary = json.loads(run.summary.read_text())
    cfg = read_run_config(run.config)
    metrics = read_jsonl(run.metrics)
    if not metrics:
        raise ReplayError(f"{run.metrics}: no step recorded; nothing to replay")
    admits = [e["t_s"] for e in events if e.get("kind") == "admit"]
    origin = min(admits) if admits else 0.0
    fitted = WorkloadProfile.from_dict(summary["profile"])
    prior, prior_source = _prior(cfg, fitted)
    latencies, sources = _latencies(cfg, events, summary.get("counters", {}), origin)
    batches = tuple(
        recorded_batch(
            fold_log(read_jsonl(run.trajectory_log(int(m["step"])))).values(),
            fitted.overhead_s_per_turn,
        )
        for m in metrics
    )
    trained = [sum(s.total_tokens for s in batch) for batch in batches]
    train_s = [float(m["train_s"]) for m in metrics]
    cost = MeasuredCost(
        fitted,
        train_s_per_token=sum(train_s) / max(1, sum(trained)),
        weight_sync_s=statistics.fmean(float(m.get("sync_s", 0.0)) for m in metrics),
        latencies=latencies,
    )
    steps = tuple(
        RecordedStep(
            step=int(m["step"]),
            rollout_s=float(m["rollout_ended_s"]) - max(float(m["rollout_started_s"]), origin),
            generated_tokens=int(m["generated_tokens"]),
            config=str(m["config"]),
            recorded_s=float(m["t_s"]) - origin,
        )
        for m in metrics
    )
    return RunRecord(
        name=name,
        cfg=cfg,
        startup_s=origin,
        prior=prior,
        prior_source=prior_source,
        cost=cost,
        sources=sources,
        batches=batches,
        capacity=capacity_trace(events, origin),
        steps=steps,
        counters=summary.get("counters", {}),
    )


def _prior(cfg: RunConfig, fitted: WorkloadProfile) -> tuple[WorkloadProfile, str]:
    path = Path(cfg.profile)
    path = path if path.is_absolute() else REPO_CONFIGS / path
    if path.exists():
        return load_profile(path), str(cfg.profile)
    return fitted, f"the refitted profile ({cfg.profile} is not on this machine)"


def _mean(values: Iterable[float]) -> float | None:
    got = list(values)
    return statistics.fmean(got) if got else None


def _latencies(
    cfg: RunConfig, events: Sequence[Mapping[str, Any]], counters: Mapping[str, Any], origin: float
) -> tuple[dict[str, float], dict[str, str]]:
    """The reconfiguration latencies the run measured (and how), else its policy's."""
    granted: dict[str, float] = {}
    for e in events:
        if e.get("kind") == "event" and e.get("event") == "CapacityGranted":
            for tag in (e.get("source"), *e.get("also", ())):
                granted.setdefault(str(tag), float(e["t_s"]))
    prepared = [
        max(0.0, float(e["t_s"]) - max(granted[str(e["source"])], origin))
        for e in events
        if e.get("kind") == "ready" and str(e.get("source")) in granted
    ]
    reroles = [float(e["s"]) for e in events if e.get("kind") == "rerole"]
    policy = cfg.policy
    half_toggle = policy.toggle_cost_s / 2
    measured = {
        "preparation": (_mean(prepared), f"mean of {len(prepared)} elastic starts"),
        # a first start compiles: part of the start-up, not what a later borrow costs
        "activation": (_mean(counters.get("activation_s", ())), "the run's warm activations"),
        "deactivation": (_mean(counters.get("deactivation_s", ())), "the run's borrow releases"),
        "rerole": (_mean(reroles), f"mean of {len(reroles)} role changes"),
    }
    fallback = {
        "preparation": (policy.preparation_s, "policy.preparation_s"),
        "activation": (half_toggle, "policy.toggle_cost_s / 2"),
        "deactivation": (half_toggle, "policy.toggle_cost_s / 2"),
        "rerole": (0.0, "none measured: in place"),
    }
    latencies, sources = {"finalisation": 0.0}, {"finalisation": "in each start's ready"}
    for kind, (value, how) in measured.items():
        if value is None:
            value, how = fallback[kind]
        latencies[kind], sources[kind] = value, how
    return latencies, sources


def recorded_batch(
    trajectories: Iterable[Trajectory], overhead_s: float
) -> tuple[TrajectorySpec, ...]:
    """One step's trajectories, folded from its log (:func:`fold_log`), as the
    simulator's. A turn's kept tokens are what the next turn's context shows of its
    response; every turn but the last waits its environment time plus ``overhead_s``."""
    groups: dict[str, int] = {}
    out = []
    for traj in trajectories:
        turns = sorted(traj.turns, key=lambda t: t.turn_index)
        specs = []
        for t, nxt in zip(turns, [*turns[1:], None], strict=True):
            new, gen = t.new_input_tokens, t.generated_tokens
            if nxt is not None:
                kept = nxt.context_tokens - nxt.new_input_tokens - nxt.generated_tokens
                kept -= t.context_tokens - gen
                env = t.env_s + overhead_s
            else:
                kept, env = gen, 0.0
            specs.append(Turn(max(1, new), max(1, gen), min(gen, max(0, kept)), env))
        group = groups.setdefault(traj.group_id, len(groups))
        out.append(TrajectorySpec(traj.trajectory_id, group, tuple(specs)))
    return tuple(out)


def capacity_trace(events: Sequence[Mapping[str, Any]], origin: float) -> AvailabilityTrace | None:
    """Elastic workers granted over the replay's clock: a grant adds its components; a
    reclaim, or the failure of the worker a component ran, removes it (a grant the
    controller gave back stays available, as the trace's capacity does in the
    simulator). None: the run had no elastic capacity."""
    held: set[str] = set()
    source_of: dict[int, str] = {}  # slot -> the component its worker ran on
    points: dict[float, int] = {}
    for e in events:
        kind, event = e.get("kind"), e.get("event")
        if kind == "ready" and e.get("source") is not None:
            source_of[int(e["slot"])] = str(e["source"])
            continue
        if kind == "worker_failed" and int(e["slot"]) in source_of:
            held = held - {source_of[int(e["slot"])]}
        elif kind == "event" and event in ("CapacityGranted", "CapacityReclaimed"):
            tags = {str(tag) for tag in (e.get("source"), *e.get("also", ()))}
            held = held | tags if event == "CapacityGranted" else held - tags
        else:
            continue
        points[round(max(0.0, float(e["t_s"]) - origin), 3)] = len(held)
    if not points:
        return None
    times = sorted(points)
    if times[0] > 0:
        points[0.0] = 0
        times.insert(0, 0.0)
    return AvailabilityTrace("recorded", tuple(times), tuple(points[t] for t in times))
