"""Checks before anything is queued (``pearl-hpc run --dry-run``, ``--sbatch``,
``--submit``): the model directory, then -- when Slurm answers -- the cluster itself:

    the base job's partition exists and is up, its nodes have the GPUs (of the
    cluster's type), CPUs and node count it asks      (sinfo)
    each elastic pool's partition, and one worker's GPUs and CPUs there
    sbatch --test-only takes the base job             (account, qos, time, constraint)
    and one worker's job of each elastic pool

Each problem is one line naming the key and the fix. ``offline`` (a dry run away from
the cluster) skips what needs the cluster: Slurm and the model directory on its file
system.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from pearl_hpc.backends.slurm import elastic_job_spec
from pearl_hpc.backends.world import base_job_spec
from pearl_hpc.config.run import RunConfig
from pearl_hpc.core.policies import PDPolicyName
from pearl_hpc.master.preflight import model_problem
from pearl_hpc.slurm.client import Runner, run_command
from pearl_hpc.slurm.cluster import base_problems, pool_problems, read_sinfo, test_only


@dataclass
class Checks:
    """What was checked (lines for the dry run), what failed (one line each) and what
    the run would expose (warnings: it is queued all the same)."""

    done: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        return [
            *(f"ok: {d}" for d in self.done),
            *(f"WARNING: {w}" for w in self.warnings),
            *(f"PROBLEM: {p}" for p in self.problems),
        ]


def shared_node_warnings(cfg: RunConfig) -> list[str]:
    """The channels without authentication that a Slurm run would open on nodes other
    users' jobs may share (pure; docs/security.md): vLLM's NIXL KV path (PD
    disaggregation; a site that named the fabric for it, ``slurm.engine_interface`` and
    ``UCX_NET_DEVICES``, chose it)."""
    if cfg.backend != "slurm":
        return []
    out = []
    shared = not cfg.slurm.exclusive or bool(cfg.elastic.pools)
    fabric = cfg.slurm.engine_interface != "hostname" and "UCX_NET_DEVICES" in cfg.slurm.env
    if shared and not fabric and cfg.policy.pd_policy != PDPolicyName.COLOCATED:
        where = "elastic pools' nodes" if cfg.slurm.exclusive else "nodes"
        out.append(
            f"PD disaggregation on {where} other users' jobs may share: vLLM's NIXL KV "
            "path has no authentication; give slurm.engine_interface and UCX "
            "(UCX_NET_DEVICES in slurm.env) a network only the run's nodes reach, or "
            "set policy.pd_policy: colocated (docs/security.md)"
        )
    return out


def _has_pyxis(run: Runner) -> bool:
    """Slurm's srun here takes pyxis's options (its SPANK plugin adds them to --help)."""
    return "--container-image" in run(["srun", "--help"], None).stdout


SANDBOXED_ENVS = ("calc", "code")  # their tool calls run in rollout.sandbox


def _sandbox_check(cfg: RunConfig, checks: Checks) -> None:
    """The tool sandbox (bubblewrap) of an environment that runs the policy's code: a
    problem where the run is local; on Slurm what this node says is a warning (the
    run's nodes need it, and may differ)."""
    if cfg.run.env not in SANDBOXED_ENVS:
        return
    from pearl_hpc.rollout.sandbox import sandbox_problem

    problem = sandbox_problem()
    if problem is None:
        checks.done.append(f"the tool sandbox of run.env {cfg.run.env} starts here")
    elif cfg.backend == "local":
        checks.problems.append(f"run.env {cfg.run.env}: {problem}")
    else:
        checks.warnings.append(
            f"run.env {cfg.run.env}: on this node, {problem}; the run's nodes need it"
        )


def prequeue_checks(
    cfg: RunConfig,
    *,
    slurm: bool,
    offline: bool = False,
    queue: bool = True,
    run: Runner = run_command,
) -> Checks:
    """The checks of a run about to be queued (``slurm``: as a Slurm job, or with
    elastic Slurm jobs; ``queue``: it is, so a cluster that does not answer is a
    problem -- for a description, a note)."""
    checks = Checks(warnings=shared_node_warnings(cfg))
    if offline:
        checks.done.append("nothing against the cluster (--offline)")
        return checks
    problem = model_problem(cfg.model)
    (checks.problems if problem else checks.done).append(problem or f"model {cfg.model}")
    _sandbox_check(cfg, checks)
    if not slurm:
        return checks
    if shutil.which("sinfo") is None:  # a description away from any cluster
        checks.done.append("nothing against a cluster: Slurm is not installed here")
        return checks
    groups = read_sinfo(run)
    if isinstance(groups, str):
        why = f"the cluster did not answer ({groups})"
        (checks.problems if queue else checks.done).append(
            f"{why}; --offline to skip" if queue else f"nothing against the cluster: {why}"
        )
        return checks
    job = base_job_spec(cfg, Path(tempfile.gettempdir()) / "pearl-check")
    found = base_problems(cfg, groups, job) + pool_problems(cfg, groups)
    checks.problems += [message for _, message in found]
    if found:
        return checks
    checks.done.append("partitions, GPUs, CPUs and nodes (sinfo)")
    if cfg.slurm.container.runtime == "pyxis":
        if _has_pyxis(run):
            checks.done.append("pyxis: srun has --container-image")
        else:
            checks.problems.append(
                "slurm.container.runtime pyxis: this cluster's srun has no --container-image "
                "(pyxis is not installed): use apptainer, or no container"
            )
    refused = test_only(job, run)
    if refused:
        checks.problems.append(f"slurm: sbatch --test-only refuses the base job: {refused}")
    else:
        checks.done.append("sbatch --test-only takes the base job")
    for i, pool in enumerate(cfg.elastic.pools if cfg.backend == "slurm" else []):
        spec = elastic_job_spec(cfg.elastic, [i], cfg.slurm, "check", Path(tempfile.gettempdir()),
                                "MODEL", "python3")  # fmt: skip
        refused = test_only(spec, run)
        if refused:
            checks.problems.append(
                f"elastic.pools[{i}] ({pool.partition}): sbatch --test-only refuses a "
                f"worker's job: {refused}"
            )
        else:
            checks.done.append(f"sbatch --test-only takes a worker of elastic.pools[{i}]")
    return checks
