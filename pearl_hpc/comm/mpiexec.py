"""Where MPICH's ``mpiexec`` is: the launcher of a run's world and of local elastic ranks."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from pearl_hpc.errors import ConfigError


def mpiexec_path() -> str:
    """MPICH's ``mpiexec`` of this Python environment (``pip install mpich``)."""
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if not found:
        raise ConfigError(
            "mpiexec not found: the run is an MPI world; install MPICH with "
            "`pip install mpich mpi4py` (bash launch/install-local.sh does)"
        )
    return found
