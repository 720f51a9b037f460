"""The run's world, described without starting it: the base layout (which rank runs
what on which node and GPUs), layout errors, the launcher's command, the hostfile of a
multi-node job, and `pearl-hpc run --dry-run` pinned by a golden file for PEARL's
32-GPU cluster."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from pearl_hpc.backends.world import (
    base_job_spec,
    domain_argv,
    het_groups,
    hostfile_text,
    job_nodes,
    world_argv,
    world_env,
)
from pearl_hpc.comm.layout import (
    ENGINE,
    MASTER,
    TRAINER,
    NodeGroup,
    base_layout,
    cpu_threads,
    domain_group,
    domain_of,
    domains_of,
    gpus_per_node,
    node_groups,
    ranks_per_node,
    world_of,
)
from pearl_hpc.config.run import LayoutConfig, WorkersConfig, layout_problem
from pearl_hpc.errors import ConfigError
from pearl_hpc.master.preflight import load_run_config

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden" / "pearl-32gpu.dryrun.txt"
REPLICATED = REPO / "tests" / "golden" / "pearl-32gpu.replicated.txt"
PEARL_32 = REPO / "configs" / "runs" / "pearl-32gpu.yaml"


def test_the_default_world_is_master_two_trainers_and_two_engines() -> None:
    cfg = load_run_config(REPO / "configs" / "runs" / "local.yaml")
    layout = base_layout(cfg.workers, cfg.layout)
    assert [(r.rank, r.kind) for r in layout] == [
        (0, MASTER), (1, TRAINER), (2, TRAINER), (3, ENGINE), (4, ENGINE)
    ]  # fmt: skip
    assert [r.gpu_ids for r in layout[3:]] == [("rsv:0",), ("train:0",)]
    assert not layout[3].overlap and layout[4].overlap
    argv = world_argv(cfg, Path("R"), "M")
    assert argv[:3] == ["mpiexec.gforker", "-n", "1"]  # one node: gforker, no port
    # the world: the master; the trainer ranks one launch, each engine rank another
    assert [(r.rank, r.kind) for r in world_of(layout)] == [(0, MASTER)]
    trainers, *engines = domains_of(layout)
    assert [r.rank for r in trainers.ranks] == [1, 2] and trainers.vital
    assert [d.name for d in engines] == ["rank3", "rank4"]
    assert domain_argv(cfg, Path("R"), "M", trainers, 1, resume=True) == [
        "mpiexec.gforker", "-n", "2", sys.executable, "-m", "pearl_hpc.rank", "trainers",
        "--run-dir", "R", "--model-dir", "M", "--attempt", "1", "--resume",
    ]  # fmt: skip
    assert domain_argv(cfg, Path("R"), "M", engines[1], 1) == [
        "mpiexec.gforker", "-n", "1", sys.executable, "-m", "pearl_hpc.rank", "engine",
        "--run-dir", "R", "--model-dir", "M", "--attempt", "1", "--rank", "4",
    ]  # fmt: skip
    assert [domain_group("rank4", 1), domain_of("rank4-1"), domain_of("trainers-2")] == [
        "rank4-1", ("rank4", 1), ("trainers", 2)
    ]  # fmt: skip
    assert domain_of("12+0") is None and domain_of("el1+0") is None
    assert world_env(cfg, Path("R")) == {"UCX_NET_DEVICES": "lo"}  # a local run: UCX on loopback


def test_pearl_32_gpu_layout_places_every_rank() -> None:
    cfg = load_run_config(PEARL_32, need_slurm=False)
    layout = base_layout(cfg.workers, cfg.layout)
    trainers = [r for r in layout if r.kind == TRAINER]
    reserved = [r for r in layout if r.kind == ENGINE and not r.overlap]
    overlap = [r for r in layout if r.overlap]
    assert len(trainers) == 16 and {r.node for r in trainers} == {0, 1}
    assert Counter(r.node for r in trainers) == {0: 8, 1: 8}  # 8 GPUs a node
    assert [(r.node, r.devices) for r in reserved] == [(2, (0, 1)), (2, (2, 3))]
    # an overlap engine sits on the GPUs of two trainer ranks of its node
    for engine in overlap:
        hosts = [t for t in trainers if t.gpu_ids[0] in engine.gpu_ids]
        assert len(hosts) == 2 and {t.node for t in hosts} == {engine.node}
        assert tuple(d for t in hosts for d in t.devices) == engine.devices
    gpus = [g for r in layout if not r.overlap for g in r.gpu_ids]
    assert len(gpus) == len(set(gpus)) == 20  # no GPU in two places (overlap aside)
    assert ranks_per_node(layout) == [13, 12, 2]
    # each rank's share of its node's CPUs (104 a node): 8 on the first, 52 on the last
    assert [cpu_threads(layout, r, 104) for r in (0, 13, 26)] == [8, 8, 52]
    assert cpu_threads(layout, 0, 2) == 1  # fewer CPUs than ranks: one thread each
    # the base job: the training nodes whole, the rollout node its 4 GPUs and their share
    # of its memory (a heterogeneous job: the node's other 4 GPUs stay free)
    assert gpus_per_node(layout) == [8, 8, 4]
    assert node_groups(layout) == [NodeGroup(0, 2, 8, 13), NodeGroup(2, 1, 4, 2)]
    training, rollout = base_job_spec(cfg, Path("R")).components
    assert (training.nodes, training.ntasks_per_node, training.gpus_per_node) == (2, 13, 8)
    assert (rollout.nodes, rollout.ntasks_per_node, rollout.gpus_per_node) == (1, 2, 4)
    assert "--exclusive" in training.extra and "--mem=0" in training.extra
    assert "--exclusive" not in rollout.extra and "--mem=976562M" in rollout.extra
    assert het_groups(cfg) == [0, 0, 1]
    (one,) = base_job_spec(cfg, Path("R"), uniform=True).components  # submitit's
    assert (one.nodes, one.ntasks_per_node, one.gpus_per_node) == (3, 13, 8)
    # ranks numbered node by node: the hostfile gives each rank its node
    assert [r.node for r in layout] == sorted(r.node for r in layout)
    # the world (the master) is a one-task srun step on the first node; Slurm's pmi2
    argv = world_argv(cfg, Path("R"), "M", node="a")
    assert argv[:10] == [
        "srun", "--mpi=pmi2", "--kill-on-bad-exit=1", "--quit-on-interrupt", "--nodes=1",
        "--nodelist=a", "--distribution=block", "--ntasks=1", "--cpus-per-task=4",
        sys.executable,
    ]  # fmt: skip
    # the trainer ranks: one step beside it, placed by the hostfile
    domains = domains_of(layout)
    argv = domain_argv(cfg, Path("R"), "M", domains[0], 0)
    assert argv[:9] == [
        "srun", "--mpi=pmi2", "--kill-on-bad-exit=1", "--quit-on-interrupt", "--overlap",
        "--nodes=2", "--distribution=arbitrary", "--ntasks=16", "--cpus-per-task=4",
    ]  # fmt: skip
    hosts = hostfile_text(layout, ["a", "b", "c", "d"]).split()
    assert hosts == ["a"] * 8 + ["b"] * 8  # a line a trainer rank
    # each engine rank: a one-task step of its own on its node
    (engine,) = [d for d in domains if d.ranks == (reserved[0],)]
    argv = domain_argv(cfg, Path("R"), "M", engine, 0, nodes=["a", "b", "c"])
    assert argv[:10] == [
        "srun", "--mpi=pmi2", "--kill-on-bad-exit=1", "--quit-on-interrupt", "--overlap",
        "--nodes=1", "--nodelist=c", "--distribution=block", "--ntasks=1", "--cpus-per-task=4",
    ]  # fmt: skip
    assert argv[-2:] == ["--rank", str(reserved[0].rank)]
    env = {"SLURM_HOSTFILE": str(Path("R") / "hostfile")}
    assert world_env(cfg, Path("R")) == env
    assert world_env(cfg, Path("R"), in_step=True) == {**env, "SLURM_OVERLAP": "1"}


@pytest.mark.parametrize(
    ("workers", "layout", "field"),
    [
        (WorkersConfig(17, 1, 0), LayoutConfig(8, 1, 2, 1), "training_nodes"),
        (WorkersConfig(16, 5, 0), LayoutConfig(8, 2, 2, 1), "rollout nodes"),
        (WorkersConfig(8, 1, 5), LayoutConfig(8, 2, 1, 1), "workers.overlap"),
        (WorkersConfig(8, 1, 0), LayoutConfig(8, 3, 1, 1), "must divide"),
        (WorkersConfig(7, 1, 0), LayoutConfig(8, 2, 1, 1), "multiple"),
    ],
)
def test_a_layout_that_does_not_fit_names_the_field(
    workers: WorkersConfig, layout: LayoutConfig, field: str
) -> None:
    assert field in layout_problem(workers, layout)


def test_a_bad_layout_in_a_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    doc = yaml.safe_load(PEARL_32.read_text())
    doc["layout"]["training_nodes"] = 1  # 16 training GPUs on one 8-GPU node
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match=r"layout\.training_nodes"):
        load_run_config(bad, need_slurm=False)
    proc = subprocess.run(
        [sys.executable, "-m", "pearl_hpc.cli", "run", str(bad), "--dry-run"],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "training_nodes" in proc.stderr


def test_a_heterogeneous_base_job_is_read_and_its_steps_name_their_component(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In the batch job Slurm lists each component's nodes apart (SLURM_JOB_NODELIST is
    the first's only); a step on a node of a later component names it (--het-group)."""
    cfg = load_run_config(PEARL_32, need_slurm=False)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_HET_SIZE", "2")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[1-2]")
    monkeypatch.setenv("SLURM_JOB_NODELIST_HET_GROUP_0", "gpu[1-2]")
    monkeypatch.setenv("SLURM_JOB_NODELIST_HET_GROUP_1", "gpu7")
    nodes, groups = job_nodes(cfg)
    assert (nodes, groups) == (["gpu1", "gpu2", "gpu7"], [0, 0, 1])
    domains = domains_of(base_layout(cfg.workers, cfg.layout))
    steps = {
        d.ranks[0].node: domain_argv(cfg, Path("R"), "M", d, 0, nodes=nodes, groups=groups)
        for d in domains[1:]
    }
    assert "--het-group=1" in steps[2] and "--nodelist=gpu7" in steps[2]
    assert not any(a.startswith("--het-group") for a in steps[0] + steps[1])
    monkeypatch.setenv("SLURM_HET_SIZE", "1")  # a job of another shape: one line
    with pytest.raises(ConfigError, match="3 nodes in 2 component"):
        job_nodes(cfg)


def test_a_node_used_in_part_asks_its_share_or_is_refused() -> None:
    """A training node used in part stays in the trainer ranks' component (their one
    step), asking the most any training node uses; a node used in part where the site
    asks whole nodes needs the nodes' memory to ask its share; a node no rank would
    run on is refused."""
    workers = WorkersConfig(training_gpus=12, reserved_rollout=2, overlap=0)
    layout = LayoutConfig(gpus_per_node=8, gpus_per_worker=2, training_nodes=2, rollout_nodes=1)
    ranks = base_layout(workers, layout)
    assert gpus_per_node(ranks) == [8, 4, 4]
    assert node_groups(ranks) == [NodeGroup(0, 2, 8, 9), NodeGroup(2, 1, 4, 2)]
    cfg = load_run_config(PEARL_32, need_slurm=False)  # slurm.mem 0, slurm.exclusive
    cfg = replace(cfg, layout=replace(cfg.layout, host_memory_gb=0.0))
    with pytest.raises(ConfigError, match=r"layout\.host_memory_gb: node 2 of the base job uses 4"):
        base_job_spec(cfg, Path("R"))
    idle = LayoutConfig(gpus_per_node=8, training_nodes=3)
    assert "layout.training_nodes (3): its 16 GPUs fill 2 node(s)" in layout_problem(
        WorkersConfig(training_gpus=16), idle
    )


def test_dry_run_of_pearl_32gpu_matches_the_golden_file() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pearl_hpc.cli", "run", "configs/runs/pearl-32gpu.yaml",
         "--dry-run", "--offline"],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == GOLDEN.read_text(), (
        "the dry run changed; if on purpose, regenerate the golden file with\n"
        "  pearl-hpc run configs/runs/pearl-32gpu.yaml --dry-run --offline > " + str(GOLDEN)
    )
    # what the golden file says, spelled out
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=13" in proc.stdout
    rollout = proc.stdout.split("#SBATCH hetjob\n")[1].split("set -euo")[0]  # the base job's
    assert "--nodes=1\n" in rollout and "--gres=gpu:h800:4\n" in rollout
    assert "--mem=976562M" in rollout and "--exclusive" not in rollout
    assert "--het-group=1 --overlap --nodes=1 --nodelist=NODE2" in proc.stdout
    assert "#SBATCH --partition=preemptible" in proc.stdout and "--gres=gpu:h800:2" in proc.stdout
    # the cluster's site section, on the base job and the elastic one
    for line in ("#SBATCH --account=pearl", "#SBATCH --gres=gpu:h800:8", "--mpi=pmix",
                 "module load cuda/12.4", "export NCCL_SOCKET_IFNAME=ib0",
                 "export GLOO_SOCKET_IFNAME=ib0"):  # fmt: skip
        assert line in proc.stdout
    assert proc.stdout.count("#SBATCH hetjob") == 1  # the base job's; the request: single
    assert "target 5P5D" in proc.stdout
    assert "elastic workers worth requesting: 1 of at most 6" in proc.stdout
    # the memory plan: every GPU under its memory
    assert "total 37.6 GB of 77.0 GB: fits" in proc.stdout
    assert "KV pool 57.8 GB (one 32768-token trajectory: 2.4 GB): fits" in proc.stdout
    # a checkpoint: 12 bytes a parameter, a node's 8 of 16 ranks staging their shards
    assert "checkpoint every 10 steps: 98.3 GB on disk" in proc.stdout
    assert "staged in pinned host memory: 49.1 GB on a training node" in proc.stdout


def test_pearl_32gpu_with_replicated_trainers_is_refused_naming_fsdp(tmp_path: Path) -> None:
    """The same config without FSDP2: one line, before anything is described or queued,
    naming train.fsdp (a golden file pins it)."""
    doc = yaml.safe_load(PEARL_32.read_text())
    doc["train"]["fsdp"] = False
    path = tmp_path / "replicated.yaml"
    path.write_text(yaml.safe_dump(doc))
    proc = subprocess.run(
        [sys.executable, "-m", "pearl_hpc.cli", "run", str(path), "--dry-run"],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.replace(str(path), "CONFIG") == REPLICATED.read_text()
    assert "set train.fsdp: true" in proc.stderr and len(proc.stderr.splitlines()) == 1


def _journal(run_dir: Path, status: str) -> None:
    from pearl_hpc.rundir import RunDir, write_journal

    write_journal(RunDir(run_dir).journal, {"status": status}, time_s=0.0)


@pytest.mark.parametrize(
    ("codes", "status", "stopped", "starts"),
    [
        ([9, 9, 0], "running", False, [False, True, True]),  # failed twice, then finished
        ([9, 9, 9, 9, 9], "running", False, [False, True, True, True]),  # 3 restarts, no more
        ([2], "running", False, [False]),  # refused its input: not again
        ([9], "finished", False, [False]),  # nothing left to resume
        ([9], "running", True, [False]),  # stopped by a signal to the launcher
        ([0], "running", False, [False]),  # finished (the world's exit 0 finishes it here)
    ],
)
def test_a_failed_world_is_resumed_up_to_max_restarts(
    tmp_path: Path, codes: list[int], status: str, stopped: bool, starts: list[bool]
) -> None:
    from pearl_hpc.backends.world import with_restarts

    cfg = load_run_config(REPO / "configs" / "runs" / "local.yaml")
    assert cfg.run.max_restarts == 3
    _journal(tmp_path, status)
    resumed: list[bool] = []

    def start(resume: bool) -> int:
        resumed.append(resume)
        if codes[len(resumed) - 1] == 0:
            _journal(tmp_path, "finished")
        return codes[len(resumed) - 1]

    rc = with_restarts(cfg, tmp_path, False, start, stopped=lambda: stopped)
    assert resumed == starts
    assert rc == codes[len(starts) - 1]


@pytest.mark.parametrize(
    ("status", "starts", "rc"),
    [
        ("running", [False, True], 0),  # a rank died of a signal: restarted, then finished
        ("stopped", [False], 0),  # `pearl-hpc cancel`: checkpointed and ended
        (None, [False], 1),  # no journal: nothing to resume
    ],
)
def test_an_exit_0_that_left_the_run_unfinished_lost_a_rank(
    tmp_path: Path, status: str | None, starts: list[bool], rc: int, capsys
) -> None:
    """gforker exits 0 when a rank died of a signal: the run's journal tells."""
    from pearl_hpc.backends.world import with_restarts

    cfg = load_run_config(REPO / "configs" / "runs" / "local.yaml")
    if status is not None:
        _journal(tmp_path, status)
    resumed: list[bool] = []

    def start(resume: bool) -> int:
        resumed.append(resume)
        if resume:
            _journal(tmp_path, "finished")
        return 0

    assert with_restarts(cfg, tmp_path, False, start) == rc
    assert resumed == starts
    said = capsys.readouterr().err
    assert ("died of a signal" in said) == (status != "stopped"), said


def test_trainer_ranks_started_again_wait_while_an_overlap_engine_holds_their_gpu(
    tmp_path: Path,
) -> None:
    """The mark the master keeps while an overlap worker starts, serves or leaves: a
    relaunched trainer launch loads nothing until it goes (its GPU back)."""
    import threading

    from pearl_hpc.rank import _wait_while
    from pearl_hpc.rundir import RunDir

    mark = RunDir(tmp_path).trainer_gpus_lent
    mark.parent.mkdir()
    mark.touch()
    threading.Timer(0.3, mark.unlink).start()
    assert _wait_while(mark, "trainer rank 1", every_s=0.01) >= 0.25
    assert _wait_while(mark, "trainer rank 1", every_s=0.01) < 0.3  # gone: no wait
