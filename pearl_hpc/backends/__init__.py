"""How processes and elastic capacity come to exist: one capacity backend per
``backend:`` value of the run config (``local``: ranks this machine starts; ``slurm``:
heterogeneous jobs), each satisfying :class:`~pearl_hpc.master.capacity.CapacityBackend`.

The rank-0 entry picks one with :func:`backend_factory` and hands it to the master (the
master never names a backend); the simulator (:mod:`pearl_hpc.sim`) is the third
executor of the same controller.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # importing a backend module (an elastic job's batch step imports
    # backends.lease) must not load the master's side, MPI included
    from pearl_hpc.master.capacity import BackendContext, CapacityBackend

BackendFactory = Callable[["BackendContext"], "CapacityBackend"]


def _local(ctx: BackendContext) -> CapacityBackend:
    from pearl_hpc.backends.local import LocalBackend

    return LocalBackend(ctx)


def _slurm(ctx: BackendContext) -> CapacityBackend:
    from pearl_hpc.backends.slurm import SlurmBackend

    return SlurmBackend(ctx)


BACKENDS: dict[str, BackendFactory] = {"local": _local, "slurm": _slurm}


def backend_factory(name: str) -> BackendFactory:
    """The backend a run config's ``backend:`` names (the schema allows only these)."""
    return BACKENDS[name]
