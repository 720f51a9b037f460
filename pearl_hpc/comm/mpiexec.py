"""Where MPICH's launchers are, and the command that starts ranks on this node.

A world on one node (and each local elastic rank) starts under MPICH's ``gforker``: it
forks the ranks and speaks PMI over sockets they inherit, so it listens on no port.
Hydra's ``mpiexec`` (worlds over several nodes: its proxies dial back) listens on every
interface without authentication, where anyone who reaches the node can stall or end
the world (docs/security.md)."""

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


def forker_path() -> str | None:
    """MPICH's ``mpiexec.gforker`` of this Python environment (the wheel has it), if any."""
    beside = Path(sys.executable).parent / "mpiexec.gforker"
    return str(beside) if beside.exists() else shutil.which("mpiexec.gforker")


def one_node_argv(ranks: int, forker: str | None, mpiexec: str) -> list[str]:
    """The start of ``ranks`` ranks on this node (pure): ``forker`` (gforker) if there is
    one, else Hydra's fork launcher (its control port then listens on every interface)."""
    if forker:
        return [forker, "-n", str(ranks)]
    return [mpiexec, "-launcher", "fork", "-hosts", "localhost", "-n", str(ranks)]


def local_launch(ranks: int) -> list[str]:
    """:func:`one_node_argv` with this environment's launchers."""
    forker = forker_path()
    return one_node_argv(ranks, forker, "" if forker else mpiexec_path())

