#!/usr/bin/env bash
# pearl_hpc for a CUDA cluster, installed once from a login node into a virtual
# environment on a file system every node mounts (compute nodes need no network after):
#
#   bash launch/install-gpu.sh /shared/$USER/pearl-venv
#
# 1. a venv there (PYTHON, default python3, >= 3.11), unless it exists;
# 2. this checkout, editable, with the `gpu` (CUDA vLLM 0.31.x or 0.32.x, its CUDA torch),
#    `dist`, `slurm` (submitit, mpi4py, MPICH) and `data` extras;
# 3. (with gpu) NIXL, the engines' prefill -> decode KV transfer: the backend of torch's
#    CUDA major (vLLM 0.32's wheel: CUDA 13, which needs an R580 or newer driver);
# 4. the tiny model in VENV/share/pearl-tiny (a first run: model: that directory);
# 5. an import check of vLLM, torch and mpi4py, and the lines for the cluster's file
#    (slurm.setup, slurm.python: every job of a run then uses this venv).
# Then: `pearl-hpc calibrate --profile-out` makes a profile of the cluster's own GPUs
# (docs/install.md).
set -euo pipefail
VENV=${1:-}
if [ -z "$VENV" ] || [ "$VENV" = -h ] || [ "$VENV" = --help ]; then
  echo "usage: bash launch/install-gpu.sh VENV_DIR   (a directory every node mounts)" >&2
  exit 2
fi
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
say() { echo "install-gpu: $*" >&2; }
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null ||
  { say "Python >= 3.11 needed ($PY: $("$PY" -V 2>&1)); set PYTHON=/path/to/python3.11"; exit 2; }
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip_install() { "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$@"; }
say "installing into $VENV (vLLM with CUDA torch: several GB)"
pip_install -U pip
pip_install -e "$REPO[gpu,dist,slurm,data]"
"$VENV/bin/pearl-hpc" tiny-model "$VENV/share/pearl-tiny" >/dev/null
"$VENV/bin/python" - <<'PY'
import mpi4py, torch, vllm
from pearl_hpc.engine.nixl import nixl_problem
print(f"install-gpu: vLLM {vllm.__version__}, torch {torch.__version__} "
      f"(CUDA {torch.version.cuda}), mpi4py {mpi4py.__version__}")
print(f"install-gpu: {nixl_problem() or 'NIXL loads (PD disaggregation)'}")
PY
cat <<EOT
install-gpu: done. In the cluster's file (configs/clusters/NAME.yaml, docs/slurm.md):
  slurm:
    setup: [source $VENV/bin/activate]
    python: python3
and a first run with model: $VENV/share/pearl-tiny
EOT
