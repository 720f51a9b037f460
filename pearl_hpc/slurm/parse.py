"""Pure parsers of sbatch and squeue output."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pearl_hpc.errors import PearlError

# `squeue -h -o SQUEUE_FORMAT`: one job (component) per line, fields split by '|'
SQUEUE_FORMAT = "%i|%T|%j|%k|%P|%N|%r|%S"
_FIELDS = SQUEUE_FORMAT.count("|") + 1


class SlurmParseError(PearlError):
    """Slurm printed something we cannot read."""


@dataclass(frozen=True, slots=True)
class JobRow:
    """One job, or one component of a heterogeneous job."""

    job_id: str  # the leader's id for a heterogeneous job
    component: int | None  # het component index; None for a plain job
    state: str  # PENDING, RUNNING, COMPLETING, CANCELLED, ...
    name: str
    comment: str
    partition: str
    nodes: str
    reason: str
    # Slurm's start time (epoch seconds): a pending job's expected start, as the
    # scheduler estimates it (None: no estimate yet)
    start_s: float | None = None

    @property
    def key(self) -> str:
        """``JOB`` or ``JOB+N``, as scancel takes it."""
        return self.job_id if self.component is None else f"{self.job_id}+{self.component}"


def parse_sbatch_parsable(stdout: str) -> str:
    """``sbatch --parsable`` prints ``JOBID`` or ``JOBID;CLUSTER``."""
    text = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    job_id = text.split(";", 1)[0].strip()
    if not re.fullmatch(r"\d+", job_id):
        raise SlurmParseError(f"sbatch --parsable printed {stdout.strip()!r}, not a job id")
    return job_id


_TEST_ONLY = re.compile(r"\bJob \d+ to start at (\S+)")


def parse_test_only(output: str) -> float | None:
    """``sbatch --test-only`` says when Slurm would start the job (``sbatch: Job 42 to
    start at 2026-12-04T01:40:00 using 1 processors on nodes n1 in partition elastic``):
    that time as epoch seconds (:func:`slurm_time`), or None when it printed none."""
    m = _TEST_ONLY.search(output)
    return slurm_time(m.group(1)) if m else None


def parse_squeue_text(stdout: str) -> list[JobRow]:
    rows = []
    for lineno, line in enumerate(stdout.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split("|")
        if len(parts) != _FIELDS:
            raise SlurmParseError(
                f"squeue line {lineno}: {len(parts)} fields, expected {_FIELDS} "
                f"({SQUEUE_FORMAT}): {line!r}"
            )
        raw_id, state, name, comment, partition, nodes, reason, start = (p.strip() for p in parts)
        m = re.fullmatch(r"(\d+)(?:\+(\d+))?(?:_\S+)?", raw_id)
        if not m:
            raise SlurmParseError(f"squeue line {lineno}: job id {raw_id!r}")
        component = int(m.group(2)) if m.group(2) is not None else None
        rows.append(
            JobRow(
                m.group(1),
                component,
                state,
                name,
                comment,
                partition,
                nodes,
                reason,
                start_s=slurm_time(start),
            )
        )
    return rows


def slurm_time(text: str) -> float | None:
    """A time as Slurm prints it (``2026-12-04T02:10:00``: slurmctld's local time, taken
    as this host's) in epoch seconds; None for ``N/A`` / ``Unknown`` / ``None``."""
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:
        return None


def _state(value: Any) -> str:
    """``job_state`` is a string on Slurm 22.05 and a list of flags on newer releases."""
    if isinstance(value, list):
        return str(value[0]) if value else "UNKNOWN"
    return str(value)


def _number(value: Any) -> int | None:
    """Numbers are plain on 22.05 and ``{"set": .., "number": ..}`` on newer releases."""
    if isinstance(value, dict):
        return int(value["number"]) if value.get("set", True) else None
    return None if value is None else int(value)


def parse_squeue_json(stdout: str) -> list[JobRow]:
    try:
        doc = json.loads(stdout)
    except json.JSONDecodeError as exc:
        raise SlurmParseError(f"squeue --json: not JSON ({exc.msg})") from None
    rows = []
    for job in doc.get("jobs", []):
        job_id = _number(job.get("job_id"))
        het_id = _number(job.get("het_job_id"))
        offset = _number(job.get("het_job_offset"))
        if job_id is None:
            raise SlurmParseError(f"squeue --json: job without job_id: {job!r:.200}")
        het = het_id not in (None, 0)
        rows.append(
            JobRow(
                str(het_id if het else job_id),
                offset if het else None,
                _state(job.get("job_state")),
                str(job.get("name", "")),
                str(job.get("comment", "") or ""),
                str(job.get("partition", "")),
                str(job.get("nodes", "") or ""),
                str(job.get("state_reason", "") or ""),
                float(start) if (start := _number(job.get("start_time"))) else None,
            )
        )
    return rows


def expand_hostlist(text: str) -> list[str]:
    """``n[1-3,5],gpu7`` -> ``n1 n2 n3 n5 gpu7`` (one bracket group per name, as squeue
    prints node lists)."""
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", text.strip()):
        m = re.fullmatch(r"([^\[]*)\[([^\]]*)\]", part)
        if not m:
            hosts.append(part)
            continue
        prefix, ranges = m.groups()
        for item in ranges.split(","):
            lo, _, hi = item.partition("-")
            width = len(lo)
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{i:0{width}d}")
    return hosts
