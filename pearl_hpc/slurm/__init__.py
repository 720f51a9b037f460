"""Slurm at the edge: pure sbatch builders and squeue/sbatch parsers, and one client
that runs the commands (submitit's split: build and parse in plain functions, run in
one place)."""
