"""pearl_hpc: PEARL (adaptive prefill-decode execution with elasticity for agentic RL)
as a Slurm-integrated HPC batch system.

The pure controller core lives in :mod:`pearl_hpc.core`; backends (simulator, local
processes, Slurm) execute the plans it makes.
"""

__version__ = "0.1.0"
