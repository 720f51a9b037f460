"""The executor's bookkeeping (a unit test of one module, its engines and trainer
scripted): a dead engine worker that fails every turn it had in flight is reported once
and dropped once; a start a plan removed goes no further; borrow cycles are counted by
what they served."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from pearl_hpc.core.controller import WorkerFailed, WorkerReleased
from pearl_hpc.core.orchestrator import WorkerAdd
from pearl_hpc.core.table import ElasticSource, RoleTable
from pearl_hpc.core.types import Mode, Role, Zone
from pearl_hpc.engine.types import Timing
from pearl_hpc.master.executor import WorkerExecutor, _Worker
from pearl_hpc.master.records import undone_switches
from pearl_hpc.rollout.router import Router


class _DeadProc:
    def __init__(self) -> None:
        self.client: Any = None
        self.address = ("127.0.0.1", 0)
        self.kills = 0

    async def stop(self, timeout_s: float = 60.0) -> None:
        pass

    def kill(self) -> None:
        self.kills += 1


def test_a_worker_failing_many_turns_is_one_failure_event(tmp_path: Path) -> None:
    queue: asyncio.Queue[Any] = asyncio.Queue()
    logged: list[tuple[str, dict[str, Any]]] = []
    router = Router(on_failure=lambda worker_id, reason: executor.router_failed(worker_id, reason))
    executor = WorkerExecutor(
        queue=queue,
        router=router,
        weights=None,  # type: ignore[arg-type]
        backend=None,  # type: ignore[arg-type]
        events=lambda kind, **fields: logged.append((kind, fields)),  # type: ignore[arg-type]
        key="k",
        table=RoleTable(),
    )
    proc = _DeadProc()
    executor.workers["el1+0:0"] = _Worker(proc, "el1+0:0", ("el1:0",), slot_id=3)  # type: ignore[arg-type]
    for _ in range(64):  # every turn in flight on it fails
        router.on_failure("s3", "connection lost")  # type: ignore[misc]
    assert queue.qsize() == 1
    failed = queue.get_nowait()
    assert isinstance(failed, WorkerFailed)
    assert [k for k, _ in logged] == ["worker_failed"] and proc.kills == 1
    assert executor.workers == {}


# ---------------------------------------------------------------- starts a plan removed
class _Engine:
    """An engine rank's client: ``activate`` holds until ``go`` is set (an engine start
    in progress); ``deactivate`` says it served ``served`` turns."""

    def __init__(self, *, first: bool = False, served: int = 0) -> None:
        self.first, self.served = first, served
        self.activating, self.go = asyncio.Event(), asyncio.Event()
        self.calls: list[str] = []

    async def activate(self, role: Any) -> Timing:
        self.calls.append("activate")
        self.activating.set()
        await self.go.wait()
        return Timing("activate", 1.0, {"first": self.first})

    async def deactivate(self) -> tuple[Timing, list[Any]]:
        self.calls.append("deactivate")
        return Timing("deactivate", 0.1, {"served": self.served}), []


class _Proc(_DeadProc):
    def __init__(self, client: _Engine) -> None:
        super().__init__()
        self.client = client
        self.stops = 0

    async def stop(self, timeout_s: float = 60.0) -> None:
        self.stops += 1


class _Trainer:
    """The trainer ranks: a lend waits for them while they are lost (``ready`` clear)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.ready = asyncio.Event()
        self.ready.set()

    async def lend(self, gpu_ids: Any) -> None:
        self.calls.append("lend")
        await self.ready.wait()

    async def catch_up(self, name: str, address: Any) -> float:
        self.calls.append("catch_up")
        return 0.0


class _NeverJoins:
    async def attach(self, *args: Any) -> Any:
        await asyncio.Event().wait()  # the elastic rank never joins


def _executor(logged: list[tuple[str, dict[str, Any]]]) -> WorkerExecutor:
    return WorkerExecutor(
        queue=asyncio.Queue(),
        router=Router(),
        weights=_Trainer(),  # type: ignore[arg-type]
        backend=_NeverJoins(),  # type: ignore[arg-type]
        events=lambda kind, **fields: logged.append((kind, fields)),  # type: ignore[arg-type]
        key="k",
        table=RoleTable(),
    )


def _overlap_rank(executor: WorkerExecutor, engine: _Engine) -> _Proc:
    proc = _Proc(engine)
    worker = _Worker(proc, "base:4", ("train:0",), persistent=True, overlap=True)  # type: ignore[arg-type]
    executor._keep(worker)
    return proc


OVERLAP = WorkerAdd(1, ("train:0",), Role.DECODE, Zone.OVERLAP, None, reactivate=True)


def _drain(queue: asyncio.Queue[Any]) -> list[Any]:
    return [queue.get_nowait() for _ in range(queue.qsize())]


@pytest.mark.parametrize("first", [True, False])
def test_a_borrow_removed_while_its_engine_starts_goes_no_further_and_is_released(
    first: bool,
) -> None:
    """The engine start cannot be interrupted: it ends, then the worker is released at
    once: no weights catch-up, no ready. A warm engine's start, bought for nothing, is
    the borrow's sample of the toggle estimate; a first start (it compiled) is none."""
    logged: list[tuple[str, dict[str, Any]]] = []

    async def scenario() -> tuple[WorkerExecutor, _Engine]:
        executor = _executor(logged)
        engine = _Engine(first=first)
        _overlap_rank(executor, engine)
        executor.start_workers([OVERLAP])
        await engine.activating.wait()
        executor.stop_workers([1], None)  # a plan removed it while it starts
        await asyncio.sleep(0.05)
        assert engine.calls == ["activate"]  # waits for the start to end ...
        engine.go.set()
        while executor.tasks:
            await asyncio.gather(*executor.tasks)
        return executor, engine

    executor, engine = asyncio.run(scenario())
    assert engine.calls == ["activate", "deactivate"]  # ... then released at once
    assert executor.weights.calls == ["lend"]  # type: ignore[attr-defined]
    assert [type(e) for e in _drain(executor.queue)] == [WorkerReleased]
    cancelled = [f for k, f in logged if k == "start_cancelled"]
    assert [(f["slot"], f["phase"], f["reclaimed"]) for f in cancelled] == [(1, "activate", False)]
    c = executor.counters
    assert (c.borrows_cancelled, c.borrow_cycles, c.borrows_unserved) == (1, 0, 0)
    assert c.first_activation_s == [] and len(c.activation_s) == (0 if first else 1)
    assert all(s >= 0.05 for s in c.activation_s)  # from its start to its release
    assert executor.workers["base:4"].slot_id is None  # released, kept (a base rank)


def test_a_borrow_lending_to_lost_trainer_ranks_is_cancelled_at_once() -> None:
    """Its lend waits for the new trainer ranks, which wait for this GPU to come back:
    the plan that takes it back (at the loss) cancels it without waiting."""
    logged: list[tuple[str, dict[str, Any]]] = []

    async def scenario() -> tuple[WorkerExecutor, _Engine]:
        executor = _executor(logged)
        engine = _Engine()
        _overlap_rank(executor, engine)
        executor.weights.ready.clear()  # type: ignore[attr-defined]
        executor.start_workers([OVERLAP])
        await asyncio.sleep(0.01)
        executor.stop_workers([1], None)
        await asyncio.wait_for(asyncio.gather(*executor.tasks, return_exceptions=True), 1.0)
        return executor, engine

    executor, engine = asyncio.run(scenario())
    assert engine.calls == []  # never woke on the GPU
    assert [type(e) for e in _drain(executor.queue)] == [WorkerReleased]
    assert [f["phase"] for k, f in logged if k == "start_cancelled"] == ["lend"]


def test_an_elastic_start_waiting_for_its_rank_is_cancelled_at_once() -> None:
    logged: list[tuple[str, dict[str, Any]]] = []
    add = WorkerAdd(3, ("el1+0:0",), Role.DECODE, Zone.DEDICATED, ElasticSource("el1"), False)

    async def scenario() -> WorkerExecutor:
        executor = _executor(logged)
        executor.start_workers([add])
        await asyncio.sleep(0.01)
        executor.stop_workers([3], None)
        await asyncio.wait_for(asyncio.gather(*executor.tasks, return_exceptions=True), 1.0)
        return executor

    executor = asyncio.run(scenario())
    assert [type(e) for e in _drain(executor.queue)] == [WorkerReleased]
    assert [f["phase"] for k, f in logged if k == "start_cancelled"] == ["attach"]
    assert executor.counters.elastic_unserved == 1


def test_borrow_cycles_are_counted_by_what_they_served_and_first_starts_apart() -> None:
    logged: list[tuple[str, dict[str, Any]]] = []

    async def cycle(executor: WorkerExecutor, engine: _Engine) -> None:
        engine.go.set()
        executor.start_workers([OVERLAP])
        await asyncio.gather(*executor.tasks)
        executor.stop_workers([1], None)
        await asyncio.gather(*executor.tasks)

    async def scenario() -> WorkerExecutor:
        executor = _executor(logged)
        first = _Engine(first=True, served=0)  # compiled, then returned unserved
        _overlap_rank(executor, first)
        await cycle(executor, first)
        warm = _Engine(served=5)
        executor.workers["base:4"].proc = _Proc(warm)  # type: ignore[assignment]
        await cycle(executor, warm)
        return executor

    executor = asyncio.run(scenario())
    c = executor.counters
    assert len(c.first_activation_s) == 1 and len(c.activation_s) == 1
    assert (c.borrow_cycles, c.borrows_unserved, c.borrowed_turns) == (1, 1, 5)
    assert executor.borrowed_turns_unrecorded == 5
    assert [f["first"] for k, f in logged if k == "ready"] == [True, False]
    assert [f["served"] for k, f in logged if k == "released"] == [0, 5]


def test_a_mode_switch_undone_before_the_next_step_is_counted() -> None:
    C, P = Mode.COLOCATED, Mode.DISAGGREGATED
    # C->P at 1 s, back at 2 s: no step ended between them; P again at 5, back at 9
    # after step ends at 8; a third P->C pair straddles nothing but is not a reversal
    switches = [(1.0, C, P), (2.0, P, C), (5.0, C, P), (9.0, P, C)]
    assert undone_switches(switches, [4.0, 8.0]) == 1
    assert undone_switches(switches, []) == 2
    assert undone_switches([(1.0, C, P)], []) == 0
