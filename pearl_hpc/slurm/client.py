"""The one place that runs Slurm commands.

Submission fails loudly (``SlurmError`` with Slurm's stderr); polling is best effort: a
failed ``squeue`` is logged, the last known state is kept and the next poll backs off
(doubling up to ``max_backoff_s``). All job ids are polled in one ``squeue`` call.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pearl_hpc.errors import PearlError
from pearl_hpc.slurm.parse import (
    SQUEUE_FORMAT,
    JobRow,
    parse_sbatch_parsable,
    parse_squeue_text,
    parse_test_only,
)
from pearl_hpc.slurm.scripts import JobSpec, render_sbatch, scancel_args

log = logging.getLogger(__name__)


class SlurmError(PearlError):
    """A Slurm command failed where failing matters (submit, cancel)."""


@dataclass(frozen=True)
class CommandResult:
    returncode: int
    stdout: str
    stderr: str


Runner = Callable[[Sequence[str], str | None], CommandResult]


# Held while a Slurm command's child process lives. The master's MPI Accept takes it
# too: MPICH crashed in Accept while a child forked after MPI_Init was alive.
FORK_LOCK = threading.Lock()


def run_command(
    argv: Sequence[str], stdin: str | None = None, timeout_s: float = 60.0
) -> CommandResult:
    """Run one Slurm command (the default runner). The caller may itself be a task of a
    job step: its ``SLURM_*`` variables (the step's distribution, hostfile, task counts)
    are not passed on, or the jobs it submits would inherit that placement; only
    ``SLURM_CONF`` (which cluster) is."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    try:
        with FORK_LOCK:
            proc = subprocess.run(
                list(argv),
                input=stdin,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
                env=env,
            )
    except FileNotFoundError:
        return CommandResult(127, "", f"{argv[0]}: command not found (is Slurm installed?)")
    except subprocess.TimeoutExpired:
        return CommandResult(124, "", f"{argv[0]}: no answer within {timeout_s:g} s")
    except OSError as exc:  # e.g. fork failing on a loaded machine: a failed call, retried
        return CommandResult(126, "", f"{argv[0]}: could not run ({exc})")
    return CommandResult(proc.returncode, proc.stdout, proc.stderr)


class SlurmClient:
    def __init__(
        self,
        runner: Runner = run_command,
        *,
        clock: Callable[[], float] = time.monotonic,
        min_backoff_s: float = 1.0,
        max_backoff_s: float = 60.0,
    ) -> None:
        self._run = runner
        self._clock = clock
        self._min_backoff_s = min_backoff_s
        self._max_backoff_s = max_backoff_s
        self._backoff_s = 0.0
        self._next_poll_s = 0.0
        self.last_known: dict[str, JobRow] = {}
        self.poll_failures = 0

    def submit(self, spec: JobSpec) -> str:
        """Submit a (heterogeneous) job; returns the leader's job id."""
        result = self._run(["sbatch", "--parsable"], render_sbatch(spec))
        if result.returncode != 0:
            raise SlurmError(f"sbatch failed ({result.returncode}): {result.stderr.strip()}")
        return parse_sbatch_parsable(result.stdout)

    def start_estimate(self, spec: JobSpec) -> float | None:
        """Seconds until Slurm would start ``spec`` if it were submitted now (``sbatch
        --test-only``: nothing is submitted; 0 when it would start at once); None when
        sbatch refused it or printed no estimate."""
        result = self._run(["sbatch", "--test-only"], render_sbatch(spec))
        at = parse_test_only(result.stderr + result.stdout) if result.returncode == 0 else None
        return None if at is None else max(0.0, at - time.time())

    def cancel(
        self, job_id: str, component: int | None = None, *, signal: str | None = None
    ) -> None:
        result = self._run(scancel_args(job_id, component, signal=signal), None)
        if result.returncode != 0:
            target = job_id if component is None else f"{job_id}+{component}"
            raise SlurmError(f"scancel {target} failed: {result.stderr.strip()}")

    def poll(self, run_tag: str | None = None) -> dict[str, JobRow]:
        """Jobs (components keyed ``JOB+N``) in squeue, only this run's with ``run_tag``.
        On a failed or backed-off poll, the last known state."""
        now = self._clock()
        if now < self._next_poll_s:
            return self._tagged(run_tag)
        result = self._run(["squeue", "-h", "-o", SQUEUE_FORMAT], None)
        if result.returncode != 0:
            self.poll_failures += 1
            self._backoff_s = min(
                self._max_backoff_s, max(self._min_backoff_s, 2 * self._backoff_s)
            )
            self._next_poll_s = now + self._backoff_s
            log.warning(
                "squeue failed (%s); keeping the last known state, next try in %.0f s",
                result.stderr.strip(),
                self._backoff_s,
            )
            return self._tagged(run_tag)
        self._backoff_s = 0.0
        self._next_poll_s = now
        self.last_known = {row.key: row for row in parse_squeue_text(result.stdout)}
        return self._tagged(run_tag)

    def _tagged(self, run_tag: str | None) -> dict[str, JobRow]:
        if run_tag is None:
            return dict(self.last_known)
        comment = f"pearl:{run_tag}"
        return {k: r for k, r in self.last_known.items() if r.comment == comment}
