"""pearl_hpc: PEARL (adaptive prefill-decode execution with elasticity for agentic RL)
as a Slurm-integrated HPC batch system.

The pure controller core lives in :mod:`pearl_hpc.core`; backends (simulator, local
processes, Slurm) execute the plans it makes.
"""

from pathlib import Path
from typing import Any

__version__ = "0.1.0"


def submit(config: str | Path, sets: tuple[str, ...] = ()) -> tuple[Any, Path]:
    """Submit a run as a submitit job (``pearl-hpc run CONFIG --submit``): the master,
    with the config's site settings (``slurm:``, over its cluster's file) and ``sets``
    (``"key.path=value"``, as ``--set``). Returns (submitit's Job, the run directory);
    ``job.results()[0]`` waits for the run's summary::

        import pearl_hpc
        job, run_dir = pearl_hpc.submit("configs/runs/slurm-local.yaml", ("run.steps=3",))
        print(job.job_id, run_dir)
        summary = job.results()[0]
    """
    from pearl_hpc.runjob import submit_run  # submitit and the run's world: on demand

    return submit_run(config, sets)
