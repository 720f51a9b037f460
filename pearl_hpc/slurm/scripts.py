"""Pure builders of sbatch scripts, including heterogeneous jobs (one component per
role shape), and of scancel arguments."""

from __future__ import annotations

import re
import shlex
import string
from collections.abc import Sequence
from dataclasses import dataclass, field

from pearl_hpc.config.slurm import SLURM_TIME, SlurmSettings, gpu_request
from pearl_hpc.errors import ConfigError

_NAME_RE = re.compile(r"^[A-Za-z0-9_.+-]+$")


@dataclass(frozen=True)
class HetComponent:
    """One component of a (heterogeneous) job: one role shape."""

    partition: str  # '': the cluster's default partition
    nodes: int = 1
    gpus_per_node: int = 0
    ntasks_per_node: int = 1
    cpus_per_task: int = 1
    time_limit: str = "01:00:00"  # Slurm time format, e.g. 30:00, 2:00:00, 1-00:00:00 ('': none)
    extra: tuple[str, ...] = ()  # further raw sbatch options, e.g. "--exclusive"
    site: SlurmSettings = SlurmSettings()  # how GPUs are asked (gpu_type, gpu_option)

    def __post_init__(self) -> None:
        if self.partition and not _NAME_RE.match(self.partition):
            raise ConfigError(f"partition {self.partition!r}: letters, digits, _ . + - only")
        for what, value in (
            ("nodes", self.nodes),
            ("ntasks_per_node", self.ntasks_per_node),
            ("cpus_per_task", self.cpus_per_task),
        ):
            if value < 1:
                raise ConfigError(f"{what} must be >= 1, got {value}")
        if self.gpus_per_node < 0:
            raise ConfigError(f"gpus_per_node must be >= 0, got {self.gpus_per_node}")
        if self.time_limit and not SLURM_TIME.fullmatch(self.time_limit):
            raise ConfigError(
                f"time_limit {self.time_limit!r} is not a Slurm time: use MM, MM:SS, "
                "HH:MM:SS or D-HH:MM:SS"
            )

    def options(self) -> list[str]:
        opts = [f"--partition={self.partition}"] if self.partition else []
        opts += [
            f"--nodes={self.nodes}",
            f"--ntasks-per-node={self.ntasks_per_node}",
            f"--cpus-per-task={self.cpus_per_task}",
        ]
        opts += [f"--time={self.time_limit}"] if self.time_limit else []
        return opts + gpu_request(self.site, self.gpus_per_node) + list(self.extra)


@dataclass(frozen=True)
class JobSpec:
    """A batch job of one or more components, tagged so a restarted master finds it."""

    name: str  # job name, e.g. pearl-elastic
    run_tag: str  # identifies the pearl run: written to --comment as pearl:<run_tag> ('': none)
    components: tuple[HetComponent, ...]
    command: Sequence[str]  # what the batch step runs (e.g. srun ... python -m ...)
    signal: str | None = "B:USR2@30"  # delivered before preemption / time limit
    requeue: bool = False
    output: str | None = None  # stdout path (%j allowed); None: Slurm's default
    workdir: str | None = None
    env: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    setup: tuple[str, ...] = ()  # shell lines run before the command (after env)
    template: str = ""  # a site's script around $options, $setup, $command ('': ours)

    def __post_init__(self) -> None:
        if not self.components:
            raise ConfigError("a job needs at least one component")
        if not _NAME_RE.match(self.name):
            raise ConfigError(f"job name {self.name!r}: letters, digits, _ . + - only")
        if self.run_tag and not _NAME_RE.match(self.run_tag):
            raise ConfigError(f"run tag {self.run_tag!r}: letters, digits, _ . + - only")
        if not self.command:
            raise ConfigError("a job needs a command")

    @property
    def comment(self) -> str:
        return f"pearl:{self.run_tag}"


def render_sbatch(spec: JobSpec) -> str:
    """The sbatch script text: options of component 0, then ``#SBATCH hetjob`` and the
    options of each further component; job-wide options go with component 0; the env
    and setup lines; the command. A site's template places the three itself."""
    lines = [f"#SBATCH --job-name={spec.name}"]
    if spec.run_tag:
        lines.append(f"#SBATCH --comment={spec.comment}")
    if spec.signal:
        lines.append(f"#SBATCH --signal={spec.signal}")
    lines.append("#SBATCH --requeue" if spec.requeue else "#SBATCH --no-requeue")
    if spec.output:
        lines.append(f"#SBATCH --output={spec.output}")
    if spec.workdir:
        lines.append(f"#SBATCH --chdir={spec.workdir}")
    for i, component in enumerate(spec.components):
        if i:
            lines.append("#SBATCH hetjob")
        lines.extend(f"#SBATCH {opt}" for opt in component.options())
    setup = [f"export {key}={shlex.quote(value)}" for key, value in spec.env] + list(spec.setup)
    # exec: the command replaces the batch shell, so a B: --signal reaches it
    command = "exec " + " ".join(shlex.quote(part) for part in spec.command)
    if spec.template:
        filled = string.Template(spec.template).substitute(
            options="\n".join(lines), setup="\n".join(setup), command=command
        )
        return filled if filled.endswith("\n") else filled + "\n"
    return "\n".join(["#!/bin/bash", *lines, "set -euo pipefail", *setup, command]) + "\n"


def scancel_args(
    job_id: str, component: int | None = None, *, signal: str | None = None
) -> list[str]:
    """``scancel JOB`` (every component) or ``scancel JOB+N`` (one component)."""
    if not re.match(r"^\d+$", job_id):
        raise ConfigError(f"job id {job_id!r} is not a Slurm job id")
    target = job_id if component is None else f"{job_id}+{component}"
    return ["scancel", *([f"--signal={signal}"] if signal else []), target]
