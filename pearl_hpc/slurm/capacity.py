"""Elastic capacity as Slurm heterogeneous jobs: a pure state machine, clock injected.

The manager turns what ``squeue`` shows into controller events and turns the
controller's decisions into Slurm actions; the Slurm backend (:mod:`pearl_hpc.backends.slurm`)
runs them.

Lifecycle of one component (``JOB+N``)::

    from \\ to   PENDING  RUNNING  RELEASING  GONE
    SUBMITTED   squeue   squeue   release    vanished / timeout
    PENDING     -        squeue   release    vanished / pending timeout (cancelled)
    RUNNING     -        -        release /  vanished (preempted without a signal)
                                  signal
    RELEASING   -        -        -          vanished from squeue

A component that turns RUNNING yields ``CapacityGranted``; a RUNNING one that is
signalled (preemption with ``--signal``) or vanishes yields ``CapacityReclaimed`` with a
deadline. Joining the MPI control plane and admission are the controller's business.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from pearl_hpc.core.controller import CapacityGranted, CapacityReclaimed
from pearl_hpc.core.table import ElasticSource
from pearl_hpc.errors import TransitionError
from pearl_hpc.slurm.parse import JobRow, expand_hostlist
from pearl_hpc.slurm.scripts import JobSpec

_ACTIVE_STATES = {"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED"}


class ComponentState(StrEnum):
    SUBMITTED = "submitted"
    PENDING = "pending"
    RUNNING = "running"
    RELEASING = "releasing"
    GONE = "gone"


_LEGAL = {
    ComponentState.SUBMITTED: {
        ComponentState.PENDING,
        ComponentState.RUNNING,
        ComponentState.RELEASING,
        ComponentState.GONE,
    },
    ComponentState.PENDING: {ComponentState.RUNNING, ComponentState.RELEASING, ComponentState.GONE},
    ComponentState.RUNNING: {ComponentState.RELEASING, ComponentState.GONE},
    ComponentState.RELEASING: {ComponentState.GONE},
    ComponentState.GONE: set(),
}


@dataclass
class Component:
    source: ElasticSource
    gpus_per_node: int
    gpus_per_worker: int
    state: ComponentState = ComponentState.SUBMITTED
    submitted_s: float = 0.0
    running_s: float | None = None
    ended_s: float | None = None  # reclaimed, given back or vanished
    nodes: tuple[str, ...] = ()
    adopted: bool = False  # found by a resumed master (submitted_s: when it was found)
    expected_start: float | None = None  # pending: Slurm's estimate (epoch s), if any

    def held_s(self, now_s: float) -> float:
        """How long it has run for the run (0 if it never started)."""
        if self.running_s is None:
            return 0.0
        return max(0.0, (now_s if self.ended_s is None else self.ended_s) - self.running_s)

    def gpu_sets(self) -> tuple[tuple[str, ...], ...]:
        """One GPU set per prospective worker; ids are scoped by the job component
        (Slurm keeps jobs' GPUs disjoint)."""
        gpus = [
            f"{self.source.tag}:{node}:gpu{i}"
            for node in self.nodes
            for i in range(self.gpus_per_node)
        ]
        per = self.gpus_per_worker
        return tuple(tuple(gpus[i : i + per]) for i in range(0, len(gpus) - per + 1, per))


def gpu_ids_of(group: str, node: str, local_id: int, gpus_per_worker: int) -> list[str]:
    """A rank's GPUs as :meth:`Component.gpu_sets` names them (``JOB+N:node:gpuI``):
    the ranks of a node split its GPUs in local-id order (pure)."""
    first = local_id * gpus_per_worker
    return [f"{group}:{node}:gpu{i}" for i in range(first, first + gpus_per_worker)]


@dataclass
class Actions:
    """What the driver must do, and the events for the controller."""

    cancel: list[tuple[str, int | None]] = field(default_factory=list)
    events: list[CapacityGranted | CapacityReclaimed] = field(default_factory=list)
    timed_out: list[ElasticSource] = field(default_factory=list)


class CapacityManager:
    def __init__(self, run_tag: str, *, pending_timeout_s: float, grace_s: float) -> None:
        self.run_tag = run_tag
        self.pending_timeout_s = pending_timeout_s
        self.grace_s = grace_s
        self.components: dict[str, Component] = {}  # keyed JOB+N

    # ------------------------------------------------------------------ inputs
    def submitted(
        self, job_id: str, spec: JobSpec, gpus_per_worker: list[int], now_s: float
    ) -> None:
        """A request: component ``i`` holds workers of ``gpus_per_worker[i]`` GPUs."""
        for i, (comp, gpus) in enumerate(zip(spec.components, gpus_per_worker, strict=True)):
            source = ElasticSource(job_id, i)
            self.components[source.tag] = Component(
                source, comp.gpus_per_node, gpus, submitted_s=now_s
            )

    def observe(self, jobs: Mapping[str, JobRow], now_s: float) -> Actions:
        """Fold one poll of this run's jobs into the states."""
        out = Actions()
        for key, comp in self.components.items():
            if comp.state is ComponentState.GONE:
                continue
            row = jobs.get(key)
            if row is None and comp.source.het_component == 0:
                row = jobs.get(comp.source.job_id)  # a plain job shows without +0
            if row is None:  # sbatch registers a job before returning: it has ended
                if comp.state is ComponentState.RUNNING:  # preempted or died, unannounced
                    out.events.append(CapacityReclaimed(comp.source, now_s))
                if comp.running_s is not None and comp.ended_s is None:
                    comp.ended_s = now_s
                self._move(comp, ComponentState.GONE)
                continue
            if comp.state is ComponentState.RELEASING:
                continue
            if row.state in _ACTIVE_STATES and comp.state is not ComponentState.RUNNING:
                comp.nodes = tuple(expand_hostlist(row.nodes))
                comp.running_s = now_s
                self._move(comp, ComponentState.RUNNING)
                out.events.append(CapacityGranted(comp.source, comp.gpu_sets()))
            elif row.state == "PENDING":
                comp.expected_start = row.start_s
                if comp.state is ComponentState.SUBMITTED:
                    self._move(comp, ComponentState.PENDING)
                if now_s - comp.submitted_s > self.pending_timeout_s:
                    self._move(comp, ComponentState.RELEASING)
                    out.cancel.append((comp.source.job_id, None))
                    out.timed_out.append(comp.source)
        out.cancel = sorted(set(out.cancel), key=str)
        return out

    def signalled(self, source: ElasticSource, now_s: float) -> CapacityReclaimed | None:
        """The component got its preemption / time-limit signal: give it back by the
        grace deadline."""
        comp = self.components.get(source.tag)
        if comp is None or comp.state is not ComponentState.RUNNING:
            return None
        self._move(comp, ComponentState.RELEASING)
        comp.ended_s = now_s
        return CapacityReclaimed(source, now_s + self.grace_s)

    def release(
        self, source: ElasticSource, now_s: float | None = None
    ) -> tuple[str, int | None] | None:
        """The controller gives a component back (or a request is withdrawn): the
        scancel to run (None if gone)."""
        comp = self.components.get(source.tag)
        if comp is None or comp.state in (ComponentState.RELEASING, ComponentState.GONE):
            return None
        self._move(comp, ComponentState.RELEASING)
        if comp.running_s is not None and now_s is not None:
            comp.ended_s = now_s
        return self.cancel_target(source)

    def cancel_target(self, source: ElasticSource) -> tuple[str, int | None]:
        """What ``scancel`` takes for this component: the whole job when it is the only
        component, else ``JOB+N``."""
        whole = len([c for c in self.components.values() if c.source.job_id == source.job_id])
        return (source.job_id, None if whole == 1 else source.het_component)

    def adopt(
        self, jobs: Iterable[JobRow], gpus_per_node: int, gpus_per_worker: int, now_s: float
    ) -> None:
        """After a master restart: take over this run's jobs found by tag."""
        for row in jobs:
            source = ElasticSource(row.job_id, row.component or 0)
            if source.tag not in self.components:
                self.components[source.tag] = Component(
                    source, gpus_per_node, gpus_per_worker, submitted_s=now_s, adopted=True
                )

    def live(self) -> list[Component]:
        return [c for c in self.components.values() if c.state is not ComponentState.GONE]

    def _move(self, comp: Component, state: ComponentState) -> None:
        if state not in _LEGAL[comp.state]:
            raise TransitionError(f"elastic component {comp.source.tag}: {comp.state} -> {state}")
        comp.state = state
