"""Starting a run's MPI world: the run directory made ready, then its launchers.

    pearl-hpc run CONFIG ──prepare_run──> RUN_DIR (key, model, checkpoints a resume trusts)
                          ──mpiexec.gforker | srun  python -m pearl_hpc.rank rank──> the world:
                             the master alone (world_of(base_layout))
                          ──a launch per failure domain (domain_argv; backends/domains.py):
                             the trainer ranks, each engine rank──> each joins the master
                             like an elastic component; started again if it dies

Where the world runs:
- a layout of one node (the local backend always): this node, started by MPICH's
  ``mpiexec.gforker`` (the wheel beside this Python; it listens on no port) -- also
  inside a Slurm batch job;
- a layout over several nodes (backend slurm, inside the base job's allocation): the
  master a one-task ``srun --mpi=pmi2`` step on the job's first node (Slurm carries the
  PMI); the trainer ranks an ``srun --overlap`` step, ``RUN_DIR/hostfile`` giving each
  its node; each engine rank an ``srun --overlap`` step of one task on its node
  (reserved engine ranks on the rollout nodes, overlap ones on the training nodes);
  :func:`base_job_spec` is the batch job that asks for it (``pearl-hpc run CONFIG
  --sbatch`` submits it, ``--dry-run`` prints it).
Elastic capacity of the Slurm backend comes as heterogeneous jobs (:mod:`.slurm`).
With ``slurm.container`` the ranks run in an image: under pyxis the step's ``srun``
carries the image (a one-node world's gforker runs in an ``srun -n1`` step), under
apptainer each command runs in ``apptainer exec``; the launcher stays on the host.

The master's failure ends the world (it calls ``Abort``; a rank dies with its
launcher); a trainer or engine rank's death ends only its own launch, which is started
again (:class:`~pearl_hpc.backends.domains.Domains`). When the world ends, the launcher
ends the domains' launches, then starts a new world with ``--resume`` by itself,
up to ``run.max_restarts`` times (:func:`with_restarts`): the journal, the newest
checkpoint and the trajectory log carry the run on; elastic jobs are adopted.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pearl_hpc.comm.layout import (
    Domain,
    NodeGroup,
    RankSpec,
    base_layout,
    node_groups,
    trainers_of,
)
from pearl_hpc.comm.mpiexec import die_with_parent, gforker_path, one_node
from pearl_hpc.config.run import RunConfig
from pearl_hpc.config.slurm import (
    ContainerSettings,
    container_srun_options,
    in_container,
    job_env,
    site_options,
)
from pearl_hpc.errors import ConfigError, PearlError
from pearl_hpc.rundir import RunDir, RunStatus, read_journal
from pearl_hpc.slurm.scripts import HetComponent, JobSpec
from pearl_hpc.weights.leftovers import sweep

TEND_S = 0.25  # the launcher looks at the failure domains' launches this often


def multi_node(cfg: RunConfig) -> bool:
    """The world spans several nodes of a Slurm job (else: one node, ``mpiexec``)."""
    return cfg.backend == "slurm" and cfg.layout.nodes > 1


def world_argv(
    cfg: RunConfig,
    run_dir: Path,
    model_dir: str,
    *,
    resume: bool = False,
    live: bool = False,
    launcher: str = "",
    node: str = "",
    python: str = sys.executable,
) -> list[str]:
    """The command that starts the run's world: the master alone (``launcher``:
    :func:`launcher_path`'s, Slurm's ``srun`` over several nodes -- a step of one task
    on ``node``, the job's first --, MPICH's gforker on one; or what runs it in the
    run's container; the bare name for a description)."""
    rank = [
        _python(cfg, python), "-m", "pearl_hpc.rank", "rank",
        "--run-dir", str(run_dir), "--model-dir", model_dir,
        *(["--resume"] if resume else []), *(["--live"] if live else []),
    ]  # fmt: skip
    step = ["--nodes=1", f"--nodelist={node}", "--distribution=block"]
    return _launched(cfg, rank, 1, launcher, step)


def domain_argv(
    cfg: RunConfig,
    run_dir: Path,
    model_dir: str,
    domain: Domain,
    attempt: int,
    *,
    resume: bool = False,
    nodes: Sequence[str] = (),
    groups: Sequence[int] = (),
    launcher: str = "",
    python: str = sys.executable,
) -> list[str]:
    """The command that starts launch ``attempt`` of a failure domain, by the world's
    kind of launcher, beside the world: the trainer ranks (``resume``: from the newest
    checkpoint; over several nodes one ``srun --overlap`` step placed by the hostfile),
    or one engine rank (over several nodes an ``srun --overlap`` step of one task on its
    node; ``nodes``: the job's node names; ``groups``: each node's component of a
    heterogeneous base job, whose steps name any but the first -- the master's and the
    trainer ranks' nodes are in it)."""
    head = [_python(cfg, python), "-m", "pearl_hpc.rank"]
    tail = ["--run-dir", str(run_dir), "--model-dir", model_dir, "--attempt", str(attempt)]
    if domain.vital:  # the trainer ranks
        rank = [*head, "trainers", *tail, *(["--resume"] if resume else [])]
        count = len({r.node for r in domain.ranks})
        step = ["--overlap", f"--nodes={count}", "--distribution=arbitrary"]
        return _launched(cfg, rank, len(domain.ranks), launcher, step, overlap=True)
    (spec,) = domain.ranks
    rank = [*head, "engine", *tail, "--rank", str(spec.rank)]
    node = nodes[spec.node] if nodes else f"NODE{spec.node}"
    het = [f"--het-group={groups[spec.node]}"] if groups and groups[spec.node] else []
    step = [*het, "--overlap", "--nodes=1", f"--nodelist={node}", "--distribution=block"]
    return _launched(cfg, rank, 1, launcher, step, overlap=True)


def _python(cfg: RunConfig, python: str) -> str:
    image = container(cfg)
    return image.python if image.runtime else python


def _launched(
    cfg: RunConfig,
    rank: list[str],
    ranks: int,
    launcher: str,
    step: list[str],
    *,
    overlap: bool = False,
) -> list[str]:
    """``ranks`` processes running ``rank``, as :func:`launcher_path` starts them (pure):
    over several nodes an ``srun`` step placed by ``step``'s options; on one node
    gforker, in the run's container (pyxis: in a one-task step; ``overlap``: beside the
    world's)."""
    image = container(cfg)
    if multi_node(cfg):  # its PMI is Slurm's pmi2 plugin (the MPICH wheel: PMI-1/2, no PMIx)
        head = [
            launcher or "srun", "--mpi=pmi2", "--kill-on-bad-exit=1", "--quit-on-interrupt",
            *step, f"--ntasks={ranks}", f"--cpus-per-task={cfg.layout.cpus_per_rank}",
            *cfg.slurm.srun_extra, *container_srun_options(image),
        ]  # fmt: skip
        return [*head, *in_container(image, rank)]
    if image.runtime == "pyxis":  # the image's gforker, in a one-task step that has it
        beside = ["--overlap"] if overlap else []
        head = [launcher or "srun", "-n1", "--mpi=none", *beside, *cfg.slurm.srun_extra]
        return [*head, *container_srun_options(image), *one_node(ranks, "mpiexec.gforker"), *rank]
    if image.runtime == "apptainer":
        world = [*one_node(ranks, "mpiexec.gforker"), *rank]
        return [launcher or "apptainer", *in_container(image, world)[1:]]
    return [*one_node(ranks, launcher or "mpiexec.gforker"), *rank]


def container(cfg: RunConfig) -> ContainerSettings:
    """The image the run's ranks run in (a Slurm run's ``slurm.container``; none on the
    local backend)."""
    return cfg.slurm.container if cfg.backend == "slurm" else ContainerSettings()


def launcher_path(cfg: RunConfig) -> str:
    """The launcher of the run's world: Slurm's ``srun`` over several nodes (or to start
    the run's pyxis container), MPICH's gforker on one, ``apptainer`` to start gforker in
    the run's image (a clear error where it is missing)."""
    runtime = container(cfg).runtime
    if not multi_node(cfg) and not runtime:
        return gforker_path()
    name = "apptainer" if runtime == "apptainer" and not multi_node(cfg) else "srun"
    path = shutil.which(name)
    if path is None:
        why = (
            "a world over several nodes, or in a pyxis container, runs in a Slurm job"
            if name == "srun"
            else "slurm.container.runtime apptainer: load its module (slurm.setup)"
        )
        raise ConfigError(f"{name} not found: {why}")
    return path


def world_env(cfg: RunConfig, run_dir: Path, *, in_step: bool = False) -> dict[str, str]:
    """What the launchers' environment adds (pure): on several nodes, where each
    trainer rank runs (``SLURM_HOSTFILE``, one node a rank, for
    ``--distribution=arbitrary``) and,
    ``in_step`` (the launcher is itself a task of a job step: a submitit job), a step
    that shares that step's resources (``SLURM_OVERLAP``). A local run's UCX (MPI's
    transport, the engines' NIXL) stays on loopback: no port of it is reachable from
    another host."""
    if cfg.backend == "local":
        return {"UCX_NET_DEVICES": "lo"}
    env = {"SLURM_HOSTFILE": str(RunDir(run_dir).hostfile)} if multi_node(cfg) else {}
    step = multi_node(cfg) or container(cfg).runtime == "pyxis"  # the world is a step
    return {**env, **({"SLURM_OVERLAP": "1"} if in_step and step else {})}


def base_job_spec(
    cfg: RunConfig, run_dir: Path, python: str = "", *, uniform: bool = False
) -> JobSpec:
    """The base job (pure): the run's site options (``slurm:``); the layout's nodes --
    several: a component for each run of nodes that use as many GPUs
    (:func:`~pearl_hpc.comm.layout.node_groups`: their GPUs, enough tasks for the busiest
    node's ranks; ``uniform``: one component of the widest node's shape, for submitit,
    which submits one); one: one task with every rank's CPUs and the GPUs the ranks use
    -- and the warning signal. Its step runs the world in ``run_dir`` (``pearl-hpc run
    --resume``: started there, or resumed from its journal; ``python``: in place of
    ``slurm.python``, for a description). Pure but for reading a site's template
    (``slurm.template``)."""
    layout = base_layout(cfg.workers, cfg.layout)
    s = cfg.slurm
    python = python or s.python or sys.executable
    cpus = cfg.layout.cpus_per_rank
    if not multi_node(cfg):
        gpus = len({d for r in layout for d in r.devices})
        groups = [NodeGroup(0, 1, gpus, 1)]
        cpus *= len(layout)
    elif uniform:
        groups = node_groups(layout)
        widest = max(g.gpus for g in groups), max(g.tasks for g in groups)
        groups = [NodeGroup(0, cfg.layout.nodes, *widest)]
    else:
        groups = node_groups(layout)
    return JobSpec(
        name=cfg.name,
        run_tag="",
        components=tuple(_base_component(cfg, g, cpus) for g in groups),
        command=[python, "-m", "pearl_hpc.cli", "run", "--resume", str(run_dir)],
        signal=f"B:USR2@{s.signal_lead_s}",
        output=str(run_dir / "batch-%j.out"),
        env=tuple(job_env(s).items()),
        setup=tuple(s.setup),
        template=Path(s.template).read_text() if s.template else "",
    )


def _base_component(cfg: RunConfig, group: NodeGroup, cpus: int) -> HetComponent:
    """The base job's component for ``group``'s nodes (pure). A node whose ranks use all
    its GPUs takes the site's options as they are; one used in part asks only its GPUs,
    never ``--exclusive``, and -- where the site asks whole nodes (``slurm.mem`` 0, or
    ``slurm.exclusive`` without a memory) -- its GPUs' share of ``layout.host_memory_gb``
    (the rest of the node stays free for other jobs, the run's elastic workers too)."""
    s, gpn = cfg.slurm, cfg.layout.gpus_per_node
    whole = group.gpus >= gpn
    mem = None  # the site's
    if not whole and (s.mem == "0" or (s.exclusive and not s.mem and not s.mem_per_gpu)):
        if not cfg.layout.host_memory_gb:
            raise ConfigError(
                f"layout.host_memory_gb: node {group.first} of the base job uses {group.gpus} "
                f"of its {gpn} GPUs and the site asks whole nodes (slurm.mem 0 or "
                "slurm.exclusive): give the nodes' memory (GB) so it asks its share, or set "
                "slurm.mem_per_gpu in place of slurm.mem"
            )
        mem = f"{int(cfg.layout.host_memory_gb * 1e9 / 2**20 * group.gpus / gpn)}M"  # MiB
    return HetComponent(
        partition=s.partition,
        nodes=group.nodes,
        gpus_per_node=group.gpus,
        ntasks_per_node=group.tasks,
        cpus_per_task=cpus,
        time_limit=s.time,
        extra=(*(["--exclusive"] if s.exclusive and whole else []), *site_options(s, mem=mem)),
        site=s,
    )


def het_groups(cfg: RunConfig) -> list[int]:
    """Each node's component of the base job ``pearl-hpc run --sbatch`` submits (pure;
    empty: a job of one component)."""
    groups = node_groups(base_layout(cfg.workers, cfg.layout)) if multi_node(cfg) else []
    if len(groups) < 2:
        return []
    return [i for i, g in enumerate(groups) for _ in range(g.nodes)]


def hostfile_text(layout: list[RankSpec], nodes: list[str]) -> str:
    """Slurm's hostfile of the trainer ranks' step (pure): each one's node, a line a
    rank, in their rank order."""
    return "".join(f"{nodes[r.node]}\n" for r in trainers_of(layout))


def job_nodes(cfg: RunConfig) -> tuple[list[str], list[int]]:
    """The allocation's nodes, in order, and each one's component where the job is
    heterogeneous (empty: it is not); a job without enough nodes, or of other
    components than the layout's, is one clear error naming how to submit it."""
    from pearl_hpc.slurm.parse import expand_hostlist

    env = os.environ
    size = int(env.get("SLURM_HET_SIZE", "0") or 0)
    if size:
        lists = [env.get(f"SLURM_JOB_NODELIST_HET_GROUP_{i}", "") for i in range(size)]
        nodes = [n for hosts in lists for n in expand_hostlist(hosts)]
        groups = het_groups(cfg)
        if len(set(groups)) != size or len(nodes) != len(groups):
            raise ConfigError(
                f"layout: {cfg.layout.nodes} nodes in {len(set(groups)) or 1} component(s), but "
                f"this job has {len(nodes)} in {size}; submit it as pearl-hpc run CONFIG --sbatch"
            )
        return nodes, groups
    nodes = expand_hostlist(env.get("SLURM_JOB_NODELIST", ""))
    if "SLURM_JOB_ID" not in env or len(nodes) < cfg.layout.nodes:
        raise ConfigError(
            f"layout: {cfg.layout.nodes} nodes, but this is "
            + (f"a job of {len(nodes)}" if "SLURM_JOB_ID" in env else "not a Slurm job")
            + "; submit the run as its batch job: pearl-hpc run CONFIG --sbatch"
        )
    return nodes, []


def _write_hostfile(cfg: RunConfig, run_dir: Path) -> Path:
    path = RunDir(run_dir).hostfile
    path.write_text(hostfile_text(base_layout(cfg.workers, cfg.layout), job_nodes(cfg)[0]))
    return path


def prepare_run(cfg: RunConfig, run_dir: Path, *, resume: bool) -> str:
    """Everything the ranks read at start, written before they exist: a fresh engine
    socket key (0600), the model directory (the tiny model built once, not by every
    rank), and -- on resume -- no checkpoint newer than the journal (a step trained but
    never recorded is trained again) and none incomplete. Returns the model directory."""
    from pearl_hpc.engine.rpc import new_key, write_key

    run = RunDir(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    run.failure.unlink(missing_ok=True)  # the last world's: this one's is its own
    run.mpi_port.unlink(missing_ok=True)  # a killed master's: its ranks would Connect to it
    run.stop_request.unlink(missing_ok=True)  # a cancel before: this start continues it
    write_key(run.rpc_key, new_key())
    if cfg.model == "tiny":
        from pearl_hpc.engine.tinymodel import build_tiny_model, default_model_dir

        model_dir = str(build_tiny_model(default_model_dir()))
    else:
        model_dir = cfg.model
    if resume:
        run.drop_checkpoints(int(run.read_state()["version"]))
    if multi_node(cfg):
        _write_hostfile(cfg, run_dir)
    return model_dir


def with_restarts(
    cfg: RunConfig,
    run_dir: Path,
    resume: bool,
    start: Callable[[bool], int],
    stopped: Callable[[], bool] = lambda: False,
) -> int:
    """``start(resume)`` the world; a world that failed is started again with resume,
    up to ``run.max_restarts`` times -- unless it was stopped (``stopped()``: a signal
    to the launcher), refused its input (exit 2), left nothing to resume, or a rank of
    it failed before it joined (a start that would fail the same way: a bad model, an
    import or CUDA error). The failed rank's error is printed as one line. Before each
    start and at the end, this user's leftovers in the node's shared memory are swept
    (a killed world's weight directory, segments of ranks that died before finalize).
    A world that exits 0 before its run finished or stopped lost a rank to a signal
    (gforker ends the others but counts a signal as 0): it failed (exit 1)."""
    sweep()
    rc = _lost_rank(start(resume), run_dir)
    attempt = 0
    while rc not in (0, 2):
        restartable = _report_failure(run_dir)
        if not restartable or stopped() or not _resumable(run_dir):
            break
        if attempt == cfg.run.max_restarts:
            break
        attempt += 1
        print(
            f"pearl-hpc run: the world ended with exit {rc}; restart {attempt} of "
            f"{cfg.run.max_restarts} (run.max_restarts): resuming {run_dir}",
            file=sys.stderr,
            flush=True,
        )
        sweep()
        rc = _lost_rank(start(True), run_dir)
    sweep()
    return rc


def _lost_rank(rc: int, run_dir: Path) -> int:
    """A world's exit status, 1 for an exit 0 that left the run neither finished nor
    stopped (with one line saying so)."""
    if rc != 0 or _journal_status(run_dir) in (RunStatus.FINISHED, RunStatus.STOPPED):
        return rc
    print(
        "pearl-hpc run: a rank of the world died of a signal (the launcher's "
        "'signaled with' line names it) before the run finished",
        file=sys.stderr,
        flush=True,
    )
    return 1


def _report_failure(run_dir: Path) -> bool:
    """Print the world's failed rank's error (if one recorded it); may it restart?"""
    run = RunDir(run_dir)
    note = run.read_failure()
    if note is None:
        return True
    print(f"pearl-hpc run: {run.failure_line(note)}", file=sys.stderr, flush=True)
    if not note.get("joined", True):
        print(
            f"pearl-hpc run: it failed before it joined the run, so a restart would fail "
            f"the same way; fix it, then: pearl-hpc run --resume {run.path}",
            file=sys.stderr,
            flush=True,
        )
        return False
    return True


def _resumable(run_dir: Path) -> bool:
    """The run has a journal and did not finish."""
    return _journal_status(run_dir) not in (None, RunStatus.FINISHED)


def _journal_status(run_dir: Path) -> str | None:
    """The run's status in its journal; None without a readable journal."""
    run = RunDir(run_dir)
    try:
        return read_journal(run.journal).get("status") if run.journal.exists() else None
    except PearlError:
        return None


def launch_world(cfg: RunConfig, run_dir: Path, *, resume: bool, live: bool) -> int:
    """Run the world's ``mpiexec`` as this process's child, to its end (started again
    with resume if it failed: :func:`with_restarts`); returns its exit status. A signal
    to this process reaches the world: TERM and HUP go to mpiexec (which passes them to
    every rank; a terminal's INT reaches both already), USR2 -- Slurm's warning before
    the job's time limit or a preemption (``--signal=B:USR2`` reaches a batch script's
    process) -- to the master, which checkpoints. The world dies with this process: a
    launcher killed outright leaves no mpiexec behind."""
    world: list[subprocess.Popen[bytes]] = []
    stops: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        stops.append(signum)
        if world:
            world[-1].send_signal(signum)

    signal.signal(signal.SIGINT, lambda signum, _: stops.append(signum))  # (reaches mpiexec)
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGHUP, forward)
    signal.signal(signal.SIGUSR2, lambda *_: _warn_master(RunDir(run_dir)))
    env = {**os.environ, **world_env(cfg, run_dir)}

    def start(resume: bool) -> int:
        return _one_world(
            cfg, run_dir, env, resume=resume, live=live, child=_world_child, started=world.append
        )

    return with_restarts(cfg, run_dir, resume, start, stopped=lambda: bool(stops))


def _one_world(
    cfg: RunConfig,
    run_dir: Path,
    env: dict[str, str],
    *,
    resume: bool,
    child: Callable[[], None],
    live: bool = False,
    started: Callable[[subprocess.Popen[bytes]], None] = lambda world: None,
    **popen: Any,
) -> int:
    """One world to its end: the run prepared, the master launched (``child`` run in it
    before exec; ``started`` told of it), the failure domains kept beside it; its exit
    status."""
    model_dir = prepare_run(cfg, run_dir, resume=resume)
    launcher = launcher_path(cfg)
    nodes, groups = job_nodes(cfg) if multi_node(cfg) else ([], [])
    argv = world_argv(
        cfg, run_dir, model_dir, resume=resume, live=live, launcher=launcher,
        node=nodes[0] if nodes else "",
    )  # fmt: skip
    world = subprocess.Popen(argv, env=env, preexec_fn=child, **popen)
    started(world)
    return _beside_domains(
        cfg, run_dir, model_dir, world, env, launcher=launcher, resume=resume, nodes=nodes,
        groups=groups, output=popen.get("stdout"),
    )  # fmt: skip


def _beside_domains(
    cfg: RunConfig,
    run_dir: Path,
    model_dir: str,
    world: subprocess.Popen[bytes],
    env: dict[str, str],
    *,
    launcher: str,
    resume: bool,
    nodes: list[str],
    groups: list[int],
    output: Any = None,
) -> int:
    """Wait for ``world`` to end, the failure domains' launches (the trainer ranks,
    each engine rank) started beside it and kept (:class:`~.domains.Domains`), then
    ended; the world's exit status (a first launch that failed before joining, or a
    vital domain given up, ends the world). ``nodes``: the job's (several nodes), and
    ``groups`` their components (:func:`job_nodes`)."""
    from pearl_hpc.backends.domains import Domains, say

    def argv(domain: Domain, attempt: int) -> list[str]:
        again = resume or attempt > 0  # a relaunch continues from the newest checkpoint
        return domain_argv(
            cfg, run_dir, model_dir, domain, attempt, resume=again, nodes=nodes,
            groups=groups, launcher=launcher,
        )  # fmt: skip

    domains = Domains(cfg, run_dir, argv, env=env, output=output, child=_world_child)
    domains.start()
    started = time.time()
    try:
        while world.poll() is None:
            failed = domains.tend()
            if failed is not None:  # (its failure record names it)
                world.terminate()
                world.wait()
                return failed
            silent = _master_silent(RunDir(run_dir), started, cfg.run.heartbeat_timeout_s)
            if silent is not None:  # a stopped master: nothing else would ever end it
                say(output, f"the master is silent ({silent}); ending its world")
                _end_world(world)
            time.sleep(TEND_S)
        rc = world.wait()
    finally:
        domains.stop()
    return rc if rc >= 0 else 128 - rc  # killed by a signal: the shell's convention


def _master_silent(run: RunDir, since: float, timeout_s: float) -> str | None:
    """Why this world's master counts as silent (its lease, touched every second by a
    thread of its own once its backend runs, is older than ``timeout_s``), else None."""
    try:
        touched = run.lease.stat().st_mtime
    except OSError:
        return None  # not written yet (its ranks are still starting)
    age = time.time() - touched
    if touched < since or age <= timeout_s:
        return None  # a previous world's, or fresh
    if _journal_status(run.path) != RunStatus.RUNNING:
        return None  # it stopped its lease: the run is ending (its members leaving)
    return f"its lease not touched for {age:.0f} s, run.heartbeat_timeout_s {timeout_s:g}"


def _end_world(world: subprocess.Popen[bytes]) -> None:
    """SIGINT (srun ends its step; gforker passes it on), SIGKILL 5 s later (a rank dies
    with its gforker)."""
    world.send_signal(signal.SIGINT)
    try:
        world.wait(5.0)
    except subprocess.TimeoutExpired:
        world.kill()


def _world_child() -> None:
    """(In the forked child, before exec.) Die with the launcher; survive USR2."""
    die_with_parent()
    _survive_warning()


def _warn_master(run: RunDir) -> None:
    """Slurm's warning, passed to the live master (its pid is in the run's lock while
    it holds the lock; before, the file may name this process or a dead one)."""
    try:
        pid = int(run.lock_file.read_text().split()[0])
        if run.lock_held() and pid != os.getpid():
            os.kill(pid, signal.SIGUSR2)
    except (OSError, ValueError, IndexError):
        pass  # no live master yet (starting) or any more (ending): nothing to save


def run_world(cfg: RunConfig, run_dir: Path, *, resume: bool = False, **popen: Any) -> int:
    """Run the world to its end (a child ``mpiexec``; started again with resume if it
    failed: :func:`with_restarts`); returns its exit status."""
    env = dict(popen.pop("env", os.environ))
    env.update(world_env(cfg, run_dir, in_step="SLURM_STEP_ID" in env))

    def start(resume: bool) -> int:
        return _one_world(cfg, run_dir, env, resume=resume, child=_survive_warning, **popen)

    return with_restarts(cfg, run_dir, resume, start)


def _survive_warning() -> None:
    """Slurm's warning signal (USR2 before the time limit or a preemption) is the
    master's to act on (a checkpoint now); mpiexec would die of it: ignored here,
    inherited through exec (every rank ignores it too; the master handles it)."""
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


def write_run_config(cfg: RunConfig, run_dir: Path) -> None:
    """``RUN_DIR/config.yaml`` from a config object (benchmarks and tests that vary one)."""
    import dataclasses
    import json

    import yaml

    run_dir.mkdir(parents=True, exist_ok=True)
    plain = json.loads(json.dumps(dataclasses.asdict(cfg)))  # enums as their values
    RunDir(run_dir).config.write_text(yaml.safe_dump(plain, sort_keys=False))


def run_to_summary(
    cfg: RunConfig, run_dir: Path, *, resume: bool = False, **popen: Any
) -> dict[str, Any]:
    """Run the world of ``cfg`` in ``run_dir`` (its config.yaml written from ``cfg``
    unless resuming) and return the run's summary; a failed run raises with its output's
    tail."""
    import json

    if not resume:
        write_run_config(cfg, run_dir)
    log_path = RunDir(run_dir).world_log
    run_dir.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        rc = run_world(cfg, run_dir, resume=resume, stdout=log, stderr=subprocess.STDOUT, **popen)
    summary = RunDir(run_dir).summary
    if rc != 0 or not summary.exists():
        tail = log_path.read_text(errors="replace")[-4000:]
        raise RunFailed(f"the run in {run_dir} failed (exit {rc}); {log_path} ends:\n{tail}")
    result: dict[str, Any] = json.loads(summary.read_text())
    return result


class RunFailed(PearlError):
    """The run's world ended with an error (its output says why)."""
