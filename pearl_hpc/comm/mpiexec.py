"""MPICH's launcher of one node's MPI processes (``pip install mpich``): ``mpiexec.gforker``.

It starts a run's world on the local backend or in a one-node Slurm job, each local
elastic rank, and the doorman's knock (:func:`one_node`). It forks the ranks and serves
PMI over socketpairs, so it listens on no port (MPICH's other launcher, Hydra, listens
on every interface and authenticates nobody: docs/security.md). When a rank dies it ends
the others (SIGINT, SIGQUIT a second later), but it exits 0 if that rank died of a
signal: a world's launcher tells that from the run's journal
(:func:`pearl_hpc.backends.world.with_restarts`). A rank dies with its launcher
(:func:`die_with_parent`). A world over several nodes is a Slurm job step instead
(:mod:`pearl_hpc.backends.world`).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import sys
from pathlib import Path

from pearl_hpc.errors import ConfigError

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def gforker_path() -> str:
    """MPICH's ``mpiexec.gforker``: beside this Python (the wheel's), else on PATH."""
    beside = Path(sys.executable).parent / "mpiexec.gforker"
    found = str(beside) if beside.exists() else shutil.which("mpiexec.gforker")
    if not found:
        raise ConfigError(
            "mpiexec.gforker not found: the run is an MPI world; install MPICH with "
            "`pip install mpich mpi4py` (bash launch/install-local.sh does)"
        )
    return found


def one_node(ranks: int, gforker: str = "") -> list[str]:
    """The head of a command that starts ``ranks`` MPI processes on this node (its
    program and arguments follow); ``gforker``: the launcher's path, for a description."""
    return [gforker or gforker_path(), "-n", str(ranks)]


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """This process gets ``sig`` when its parent ends (Linux's parent-death signal): a
    rank whose gforker was killed outright does not live on. A parent already gone
    (before the call) is a death too."""
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)
