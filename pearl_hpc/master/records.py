"""What a run writes as it goes: counters, one metrics line per step, the event log.

Files of a run directory (one layout, read by ``pearl-hpc status`` and ``report``):

    events.jsonl    {"t_s", "kind", ...}: every event, plan and worker transition
    metrics.jsonl   one :class:`StepMetrics` per recorded step
    summary.json    the run's outcome (:func:`format_summary` prints it)
"""

from __future__ import annotations

import bisect
import contextlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import astuple, dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from pearl_hpc.core.controller import Event
from pearl_hpc.core.table import ElasticSource
from pearl_hpc.rundir import JournalError, RunDir, read_jsonl


@dataclass
class Counters:
    """What happened, for the summary and the must-show checks."""

    grows: int = 0
    reclaims: int = 0
    borrow_cycles: int = 0  # a borrowed worker activated, served turns, returned
    borrows_unserved: int = 0  # ... activated and returned without serving a turn
    borrows_cancelled: int = 0  # ... removed by a plan while it was starting
    borrowed_turns: int = 0  # turns the borrowed workers served
    elastic_unserved: int = 0  # elastic workers released (or cancelled) before a turn
    mode_changes: int = 0
    undone_switches: int = 0  # mode switches undone before the next step was recorded
    ratio_changes: int = 0
    role_changes: int = 0
    moved_turns: int = 0
    activation_s: list[float] = field(default_factory=list)  # the toggle estimate's
    # activations that were their engine process's first start (vLLM compiles then)
    first_activation_s: list[float] = field(default_factory=list)
    deactivation_s: list[float] = field(default_factory=list)
    return_latency_s: list[float] = field(default_factory=list)  # Training Begin -> start
    # per step that onloaded a lent GPU, the slowest trainer rank's onload (its offload is
    # inside the overlap engine's activation): part of the GPU's return
    handover_s: list[float] = field(default_factory=list)

    def load_state_dict(self, data: Mapping[str, Any]) -> None:
        """Continue from a journal's counters (checked against the fields' types)."""
        try:
            restored = msgspec.convert(dict(data), Counters)
        except msgspec.ValidationError as exc:
            raise JournalError(f"corrupt journal (counters: {exc})") from None
        self.__dict__.update(restored.__dict__)


@dataclass
class StepMetrics:
    step: int
    t_s: float
    rollout_s: float
    train_s: float
    sync_s: float  # the latest weight broadcast: of this step's weights (synchronous), or
    # of the previous step's (rollout ahead: this step's go out after the next rollout)
    return_latency_s: float
    generated_tokens: int
    tokens_per_s: float
    mean_reward: float
    version: int
    roles: dict[str, str]
    elastic_workers: int
    borrowed: bool
    moved_turns: int
    trajectories: int  # trajectories trained on (those an environment fault ended left out)
    resumed: int  # trajectories of the step recovered from a previous master's journal
    predicted_s: float  # the tracker's prediction of this rollout (before it ran)
    config: str  # the serving configuration at rollout start, e.g. 2C or 1P1D
    max_staleness: int = 0  # largest (trainer version - generating version) in the batch
    # the off-policy gap the trainer corrected (train/objective.py): per policy token
    # with the engine's log-prob mu, mean and max |log(pi_old / mu)|; the share the
    # importance-weight cap clamped or dropped; the PPO clip fraction
    mismatch_mean: float = 0.0
    mismatch_max: float = 0.0
    capped_frac: float = 0.0
    clip_frac: float = 0.0
    behaviour_coverage: float = 0.0  # share of policy tokens that had a mu
    # the update: GRPO loss, mean pre-clip gradient norm, mean entropy per policy token
    # before it (nats: a collapsing policy's falls), the learning rate
    loss: float = 0.0
    grad_norm: float = 0.0
    entropy: float = 0.0
    lr: float = 0.0
    env_failures: int = 0  # trajectories an environment fault ended (reason in the journal)
    # run clock at the rollout's start and end (batches overlap with policy.tail_start)
    rollout_started_s: float = 0.0
    rollout_ended_s: float = 0.0
    # the batch's tail: how long it ran with fewer unfinished trajectories than the
    # serving workers can keep busy (core.policies.tail_level); routed worker-seconds and
    # those with nothing in flight, over the step's window and over that tail
    tail_s: float = 0.0
    worker_s: float = 0.0
    idle_worker_s: float = 0.0
    tail_worker_s: float = 0.0
    tail_idle_worker_s: float = 0.0
    # policy.local_prefill: the batch's disaggregated turns prefilled on the decode
    # worker holding their prefix
    local_prefills: int = 0
    # the borrowing gate's decision in force at the rollout's end, and the turns the
    # borrowed workers served in the cycles that ended since the previous step's record
    borrow_gate: str = ""
    borrowed_served_turns: int = 0
    # the longest the master's asyncio loop went without a turn since the previous
    # step's record (its beat, every 10 ms): what a blocking call in it costs everyone;
    # and the longest gap less the time its thread waited for a CPU (the master's own
    # work or blocking call, where its node has too few cores for everything on it)
    loop_gap_s: float = 0.0
    loop_own_s: float = 0.0

    @property
    def idle_share(self) -> float:
        return self.idle_worker_s / self.worker_s if self.worker_s > 0 else 0.0

    @property
    def tail_idle_share(self) -> float:
        return self.tail_idle_worker_s / self.tail_worker_s if self.tail_worker_s > 0 else 0.0


class EventLog:
    """``events.jsonl``: one JSON line per event, stamped with the run clock."""

    def __init__(self, path: Path, clock: Callable[[], float]) -> None:
        self.path = path
        self.clock = clock

    def __call__(self, kind: str, **fields: Any) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"t_s": round(self.clock(), 3), "kind": kind, **fields}) + "\n")


def event_fields(event: Event) -> dict[str, Any]:
    """A controller event's plain fields, for the event log."""
    out: dict[str, Any] = {}
    for name in getattr(event, "__slots__", ()):
        value = getattr(event, name)
        if isinstance(value, int | float | str) or value is None:
            out[name] = value
        elif isinstance(value, ElasticSource):
            out[name] = value.tag
        elif name == "also" and value:  # a heterogeneous job's other components
            out[name] = [grant.source.tag for grant in value]
    return out


MAX_INT = 1 << 63  # a count or id a record can hold (a bigger one is not ours)


def read_metrics(run_dir: Path) -> list[StepMetrics]:
    """The step records of ``metrics.jsonl``, typed; a line of another shape (torn, or
    not written by a master) is skipped like a torn line."""
    out = []
    for record in read_jsonl(RunDir(run_dir).metrics):
        with contextlib.suppress(msgspec.ValidationError):
            m = msgspec.convert(record, StepMetrics)
            if all(abs(v) < MAX_INT for v in astuple(m) if isinstance(v, int)):
                out.append(m)
    return out


class TableRecord(msgspec.Struct):
    """A ``table`` event: the rollout slots as ``[slot, role, status, zone]``."""

    t_s: float
    slots: list[tuple[int, str, str, str]]


def read_tables(events: list[dict[str, Any]]) -> list[TableRecord]:
    """The well-formed ``table`` events of an event log, in order."""
    out = []
    for ev in events:
        if ev.get("kind") == "table":
            with contextlib.suppress(msgspec.ValidationError):
                out.append(msgspec.convert(ev, TableRecord))
    return out


def format_step(m: StepMetrics) -> str:
    """One step's line of the run's log."""
    roles = " ".join(f"{k}={v[0].upper()}" for k, v in m.roles.items())
    return (
        f"step {m.step}: {m.tokens_per_s:.0f} tok/s, reward {m.mean_reward:.3f}, "
        f"rollout {m.rollout_s:.1f} s, train {m.train_s:.1f} s, return "
        f"{m.return_latency_s:.2f} s, elastic {m.elastic_workers}, "
        f"borrowed {'yes' if m.borrowed else 'no'}, moved turns {m.moved_turns}, "
        f"roles {roles}, off-policy {m.mismatch_mean:.3f}/{m.mismatch_max:.2f}, "
        f"idle {m.idle_share:.0%} (tail {m.tail_s:.1f} s, {m.tail_idle_share:.0%} idle)"
        + (f", {m.local_prefills} turns prefilled on decode" if m.local_prefills else "")
        + (f", resumed {m.resumed} trajectories" if m.resumed else "")
        + (f", {m.env_failures} failed by the environment" if m.env_failures else "")
    )


def format_summary(summary: dict[str, Any]) -> str:
    c = summary["counters"]
    ret = c["return_latency_s"]
    lines = [
        f"steps {summary['steps']} in {summary['wall_s']} s; rollout {summary['tokens_per_s']} "
        f"tokens/s per rollout, {summary.get('aggregate_tokens_per_s', 0.0)} aggregate; idle "
        f"{summary.get('idle_share', 0.0):.0%} of worker time, "
        f"{summary.get('tail_idle_share', 0.0):.0%} in the batch tails",
        "reward per step: " + " ".join(f"{r:.3f}" for r in summary["reward_curve"]),
        f"elastic grows {c['grows']}, reclaims {c['reclaims']}, released before serving "
        f"{c.get('elastic_unserved', 0)}; {format_borrows(c)}; mode changes "
        f"{c['mode_changes']} (undone within a step {c.get('undone_switches', 0)}), ratio "
        f"changes {c['ratio_changes']}, role changes {c['role_changes']}; turns moved "
        f"{c['moved_turns']}",
        "borrowed GPUs returned before every training step: "
        + ", ".join(f"{x:.2f} s" for x in ret),
        "targets: " + " -> ".join(_dedup(summary["targets"])),
    ]
    refused = summary.get("slurm", {}).get("refused_pools", {})
    lines += [f"elastic pool {pool} refused by Slurm: {why}" for pool, why in refused.items()]
    return "\n".join(lines)


def format_borrows(c: Mapping[str, Any]) -> str:
    """The borrow cycles by what they bought: served turns, served none, or were
    cancelled by a plan while starting."""
    return (
        f"borrow cycles {c['borrow_cycles']} served ({c.get('borrowed_turns', 0)} turns), "
        f"{c.get('borrows_unserved', 0)} unserved, {c.get('borrows_cancelled', 0)} cancelled"
    )


def rollout_summary(metrics: list[StepMetrics]) -> dict[str, float]:
    """The rollouts' aggregate over a master's steps: tokens it generated over the time
    from the first rollout's start to the last one's end (the throughput to compare
    overlapping batches by), and the share of routed worker time with nothing in flight,
    over the steps' windows and over their tails."""
    if not metrics:
        return {
            "aggregate_tokens_per_s": 0.0, "idle_share": 0.0, "tail_idle_share": 0.0,
            "local_prefills": 0,
        }  # fmt: skip
    generated = sum(m.tokens_per_s * m.rollout_s for m in metrics)  # resumed ones left out
    span_s = max(m.rollout_ended_s for m in metrics) - min(m.rollout_started_s for m in metrics)
    return {
        "aggregate_tokens_per_s": round(generated / span_s, 1) if span_s > 0 else 0.0,
        "idle_share": round(
            sum(m.idle_worker_s for m in metrics) / max(1e-9, sum(m.worker_s for m in metrics)), 4
        ),
        "tail_idle_share": round(
            sum(m.tail_idle_worker_s for m in metrics)
            / max(1e-9, sum(m.tail_worker_s for m in metrics)),
            4,
        ),
        "local_prefills": sum(m.local_prefills for m in metrics),
    }


def undone_switches(switches: Sequence[tuple[float, Any, Any]], step_ends: Sequence[float]) -> int:
    """Of the mode switches ``(time, from, to)``, in order, those undone before the next
    step was recorded: a switch a -> b followed by b -> a with no step end between them
    (a pair counts once)."""
    ends = sorted(step_ends)
    count, last = 0, None
    for t, a, b in switches:
        undone = (
            last is not None
            and (last[1], last[2]) == (b, a)
            and bisect.bisect_right(ends, t) == bisect.bisect_right(ends, last[0])
        )
        count, last = (count + 1, None) if undone else (count, (t, a, b))
    return count


def _dedup(items: list[str]) -> list[str]:
    return [x for i, x in enumerate(items) if i == 0 or items[i - 1] != x]
