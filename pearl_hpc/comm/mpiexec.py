"""MPICH's launchers, from this Python environment (``pip install mpich``).

- ``mpiexec.gforker`` starts every MPI process of one node: a run's world on the local
  backend or in a one-node Slurm job, a local elastic rank, the doorman's knock
  (:func:`one_node`). It forks the ranks and serves PMI over socketpairs: it listens on
  no port. When a rank dies it ends the others (SIGINT, SIGQUIT a second later), but it
  exits 0 if the rank died of a signal: a world's launcher tells that from the run's
  journal (:func:`pearl_hpc.backends.world.with_restarts`). A rank dies with it
  (:func:`die_with_parent`).
- ``mpiexec`` (Hydra) starts a world over several nodes (its slurm launcher: ``srun``
  starts one proxy a node). Its control port listens on every interface and
  authenticates nobody (docs/security.md).
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


def _find(name: str) -> str:
    """MPICH's program ``name``: beside this Python (the wheel's), else on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if not found:
        raise ConfigError(
            f"{name} not found: the run is an MPI world; install MPICH with "
            "`pip install mpich mpi4py` (bash launch/install-local.sh does)"
        )
    return found


def mpiexec_path() -> str:
    """MPICH's Hydra ``mpiexec``: the launcher of a world over several nodes."""
    return _find("mpiexec")


def gforker_path() -> str:
    """MPICH's ``mpiexec.gforker``: the launcher of MPI processes on this node."""
    return _find("mpiexec.gforker")


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
