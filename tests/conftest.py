"""Shared fixtures: the local Slurm cluster for tests marked ``slurm``."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest


@pytest.fixture(scope="session")
def slurm_cluster() -> str:
    """The running local cluster's SLURM_CONF; skips (with the way to start one) if none."""
    how = "start one: eval $(bash slurm/local-cluster.sh up)"
    if shutil.which("sbatch") is None:
        pytest.skip(f"Slurm is not installed here; {how}")
    conf = os.environ.get("SLURM_CONF")
    if not conf:
        pytest.skip(f"SLURM_CONF is not set; {how}")
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=20)
    if "is UP" not in ping.stdout:
        pytest.skip(f"the Slurm controller at {conf} is not up; {how}")
    resume_drained_nodes()
    return conf


@pytest.fixture(autouse=True)
def _nodes_resumed(request: pytest.FixtureRequest) -> None:
    """Before every test on the cluster: an earlier test's killed step may have drained
    its node, and a job would wait for it forever."""
    if "slurm_cluster" in request.fixturenames:
        request.getfixturevalue("slurm_cluster")
        resume_drained_nodes()


def resume_drained_nodes() -> None:
    """A step that outlived its kill signals (e.g. a test that stopped slurmctld while a
    job ended) drains its node ("Kill task failed"); a test cluster takes it back."""
    out = subprocess.run(
        ["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=20
    ).stdout
    for line in sorted(set(out.splitlines())):
        node, _, state = line.partition(" ")
        if "drain" in state or state.startswith("down"):
            subprocess.run(
                ["scontrol", "update", f"nodename={node}", "state=resume"],
                capture_output=True,
                timeout=20,
            )


def vllm_skip_reason() -> str | None:
    """Why real-vLLM tests cannot run here, or None when they can."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed: pip install -e '.[engine]' (tests/run-all.sh does)"
    return None


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Qwen3 model, built once per session (a few seconds, no hub access)."""
    from pearl_hpc.engine.tinymodel import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-model")))


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Qwen3-MoE built like the tiny model: 4 experts a block, 2 a token (initialised
    at the usual scale: with the tiny model's large weights, float noise flips near-tied
    routing choices between packings of the same rows)."""
    from pearl_hpc.engine.tinymodel import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(num_experts=4, initializer_range=0.02)
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-moe"), spec))
