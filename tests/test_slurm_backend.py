"""The Slurm backend's submissions (one module, with its Slurm edge): a bad partition on
the real local cluster is reported and the run goes on; sbatch meeting an unreachable
slurmctld is retried from the watch."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from pearl_hpc.backends import slurm as backend_mod
from pearl_hpc.backends.slurm import SlurmBackend
from pearl_hpc.config.run import SlurmSettings
from pearl_hpc.engine.vllm_engine import EngineSpec
from pearl_hpc.slurm.client import CommandResult, SlurmClient


class _NoMembers:
    """The world the elastic ranks would join: none join in these tests."""

    def group_state(self, group: str) -> set[Any]:
        return set()

    def leave(self, group: str) -> None:
        pass

    def left(self, group: str) -> bool:
        return True


def _backend(tmp_path: Path, **settings: Any) -> tuple[SlurmBackend, list[tuple[str, dict]]]:
    events: list[tuple[str, dict]] = []
    backend = SlurmBackend(
        SlurmSettings(**{"poll_s": 0.2, **settings}),
        EngineSpec(model_dir="m"),
        tmp_path,
        asyncio.Queue(),
        lambda: 0.0,
        15.0,
        lambda kind, fields: events.append((kind, fields)),
        _NoMembers(),  # type: ignore[arg-type]
    )
    return backend, events


@pytest.mark.slurm
def test_a_bad_partition_is_reported_and_the_run_goes_on(
    slurm_cluster: str, tmp_path: Path
) -> None:
    backend, events = _backend(tmp_path, partition="no-such-partition")

    async def go() -> None:
        await backend.scale_to(2)  # raises nothing
        await backend.close()

    asyncio.run(go())
    failed = [f for k, f in events if k == "submit_failed"]
    assert len(failed) == 1 and not failed[0]["retry"]
    assert "partition" in failed[0]["error"].lower()
    assert backend.summary()["errors"] and backend.jobs == []


def test_sbatch_meeting_an_unreachable_controller_is_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(backend_mod, "SUBMIT_RETRY_S", 0.0)
    calls: list[str] = []

    def runner(argv: Any, stdin: str | None = None) -> CommandResult:
        calls.append(argv[0])
        if argv[0] == "sbatch":
            if calls.count("sbatch") == 1:
                return CommandResult(1, "", "sbatch: error: Unable to contact slurm controller")
            return CommandResult(0, "4242\n", "")
        return CommandResult(0, "", "")  # squeue: nothing yet; scancel: done

    backend, events = _backend(tmp_path)
    backend.client = SlurmClient(runner, min_backoff_s=0.01)

    async def go() -> None:
        await backend.scale_to(1)
        await backend._watch_once()  # the retry is the watch's
        await backend.close()

    asyncio.run(go())
    kinds = [k for k, _ in events]
    assert kinds.count("submit_failed") == 1 and dict(events)["submit_failed"]["retry"]
    assert "submitted" in kinds and backend.jobs == ["4242"]
