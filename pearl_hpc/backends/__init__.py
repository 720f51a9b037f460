"""How processes and elastic capacity come to exist: one :class:`~.base.CapacityBackend`
per backend (``local``: processes on this machine; ``slurm``: heterogeneous jobs).

The master's loop, executor and step pipeline (:mod:`pearl_hpc.master`) are the same for
both; the simulator (:mod:`pearl_hpc.sim`) is the third executor of the same controller.
"""
