#!/usr/bin/env bash
# NVIDIA nccl-tests for `pearl-hpc calibrate`: build once, run inside an allocation.
#
#   slurm/nccl-tests.sh build   make the tests (MPI=1) from NCCL_TESTS_SRC (a source folder,
#                               or a git URL to clone) into the build folder
#   slurm/nccl-tests.sh run     srun each test across the current allocation (one task per
#                               GPU), each test's stdout to <out>/<test>.txt
#
# Then: pearl-hpc calibrate --nccl-dir <out> --out configs/clusters/NAME-bandwidth.yaml
#
# Settings (environment):
#   NCCL_TESTS_SRC        source folder or git URL (default https://github.com/NVIDIA/nccl-tests)
#   NCCL_TESTS_REF        branch or tag to clone (default: the repository's default branch)
#   PEARL_NCCL_TESTS_DIR  build folder (default ./build/nccl-tests); binaries in <it>/bin
#   CUDA_HOME             CUDA toolkit (default: the folder above `nvcc` on PATH)
#   NCCL_HOME             NCCL with include/nccl.h (default /usr if /usr/include/nccl.h exists)
#   MPI_HOME              MPI with include/mpi.h (default: the folder above `mpicc` on PATH)
#   NVCC_GENCODE          passed to make when set (e.g. -gencode=arch=compute_90,code=sm_90)
#   PEARL_NCCL_TESTS_MPI  1 (default): one task per GPU under srun; 0: no MPI, one process
#                         drives a node's GPUs (-g N), as tests/gpu/smoke.py runs them
#   PEARL_NCCL_TESTS      tests to run (default "all_reduce_perf sendrecv_perf")
#   PEARL_NCCL_TESTS_ARGS arguments of each test (default "-b 8 -e 1G -f 2 -g 1")
#   PEARL_NCCL_TESTS_OUT  output folder (default ./nccl-tests-out/<SLURM_JOB_ID>)
#   PEARL_NCCL_TASKS_PER_NODE  tasks per node (default: the allocation's GPUs per node)
#   PEARL_SRUN_MPI        srun --mpi plugin (default pmi2; `srun --mpi=list` shows yours)
#   PEARL_SRUN_ARGS       extra srun arguments
#
# With -g 1 every task drives one GPU and nccl-tests picks it by the task's rank on its
# node, so each task must see all GPUs of its node: do not bind GPUs per task. The tests
# load libnccl at run time: put $NCCL_HOME/lib on LD_LIBRARY_PATH if it is not a system one.
set -euo pipefail

BUILD=${PEARL_NCCL_TESTS_DIR:-$PWD/build/nccl-tests}
TESTS=${PEARL_NCCL_TESTS:-all_reduce_perf sendrecv_perf}
TEST_ARGS=${PEARL_NCCL_TESTS_ARGS:--b 8 -e 1G -f 2 -g 1}
SRUN_MPI=${PEARL_SRUN_MPI:-pmi2}

say() { echo "nccl-tests: $*" >&2; }
die() { say "error: $*"; exit 1; }
need() { command -v "$1" >/dev/null || die "$1 not found on PATH: $2"; }

# CUDA_HOME, else /usr/local/cuda (nccl-tests' own default), else the toolkit above nvcc.
find_cuda() {
  if [ -z "${CUDA_HOME:-}" ]; then
    if [ -x /usr/local/cuda/bin/nvcc ]; then
      CUDA_HOME=/usr/local/cuda
    else
      command -v nvcc >/dev/null \
        || die "CUDA_HOME is not set and nvcc is not on PATH: export CUDA_HOME=<CUDA toolkit folder with bin/nvcc> (or module load cuda)"
      CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
    fi
  fi
  if ! { [ -x "$CUDA_HOME/bin/nvcc" ] && [ -f "$CUDA_HOME/include/cuda_runtime.h" ]; }; then
    die "CUDA_HOME=$CUDA_HOME has no bin/nvcc and include/cuda_runtime.h: point CUDA_HOME at the CUDA toolkit"
  fi
}

find_nccl() {
  if [ -z "${NCCL_HOME:-}" ]; then
    [ -f /usr/include/nccl.h ] \
      || die "NCCL_HOME is not set and /usr/include/nccl.h does not exist: export NCCL_HOME=<folder with include/nccl.h and lib/libnccl.so> (or apt-get install libnccl-dev)"
    NCCL_HOME=/usr
  fi
  [ -f "$NCCL_HOME/include/nccl.h" ] || die "NCCL_HOME=$NCCL_HOME has no include/nccl.h"
  # nccl-tests links -lnccl: a pip NCCL (nvidia-nccl-cu*) ships only libnccl.so.2
  local lib libs=("$NCCL_HOME"/lib/libnccl.so "$NCCL_HOME"/lib64/libnccl.so)
  [ "$NCCL_HOME" != /usr ] || libs+=(/usr/lib/*-linux-gnu/libnccl.so)
  for lib in "${libs[@]}"; do
    [ -e "$lib" ] && return
  done
  if [ -e "$NCCL_HOME/lib/libnccl.so.2" ]; then
    die "NCCL_HOME=$NCCL_HOME has lib/libnccl.so.2 but no lib/libnccl.so (a pip NCCL): ln -s libnccl.so.2 $NCCL_HOME/lib/libnccl.so"
  fi
  die "NCCL_HOME=$NCCL_HOME has no lib/libnccl.so: point NCCL_HOME at an NCCL install with include/ and lib/"
}

find_mpi() {
  if [ -z "${MPI_HOME:-}" ]; then
    command -v mpicc >/dev/null \
      || die "MPI_HOME is not set and mpicc is not on PATH: export MPI_HOME=<MPI folder with include/mpi.h> (or module load openmpi)"
    # the folder above the include dir the wrapper compiles with (a distribution MPI
    # keeps it away from bin/: /usr/bin/mpicc -> /usr/lib/x86_64-linux-gnu/openmpi)
    local flag inc=
    for flag in $(mpicc -show 2>/dev/null || mpicc -showme 2>/dev/null); do
      case $flag in -I*) [ -f "${flag#-I}/mpi.h" ] && inc=${flag#-I} && break ;; esac
    done
    if [ -n "$inc" ]; then
      MPI_HOME=$(dirname "$(readlink -f "$inc")")
    else
      MPI_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v mpicc)")")")
    fi
  fi
  [ -f "$MPI_HOME/include/mpi.h" ] || die "MPI_HOME=$MPI_HOME has no include/mpi.h"
}

# The source folder: NCCL_TESTS_SRC if it is one, else a clone of it (or of upstream).
source_dir() {
  local src=${NCCL_TESTS_SRC:-https://github.com/NVIDIA/nccl-tests}
  if [ -d "$src" ]; then
    [ -f "$src/Makefile" ] || die "NCCL_TESTS_SRC=$src has no Makefile: is it an nccl-tests checkout?"
    echo "$src"
    return
  fi
  local clone=$BUILD/src
  if [ ! -f "$clone/Makefile" ]; then
    need git "install git, or set NCCL_TESTS_SRC to an nccl-tests source folder"
    say "cloning $src into $clone"
    local branch=()
    [ -z "${NCCL_TESTS_REF:-}" ] || branch=(--branch "$NCCL_TESTS_REF")
    git clone --quiet --depth 1 "${branch[@]}" "$src" "$clone" >&2 \
      || die "git clone $src failed: no network? clone it elsewhere and set NCCL_TESTS_SRC=<folder>"
  fi
  echo "$clone"
}

cmd_build() {
  need make "install make (build-essential)"
  find_cuda
  find_nccl
  local mpi=${PEARL_NCCL_TESTS_MPI:-1} args=()
  if [ "$mpi" = 1 ]; then
    find_mpi
    args+=(MPI=1 "MPI_HOME=$MPI_HOME")
  else
    [ "$mpi" = 0 ] || die "PEARL_NCCL_TESTS_MPI=$mpi: use 1 (srun, one task per GPU) or 0 (one process)"
    args+=(MPI=0)
  fi
  local src
  src=$(source_dir)
  [ -f "$src/src/Makefile" ] || die "NCCL_TESTS_SRC=$src has no src/Makefile: is it an nccl-tests checkout?"
  args+=("CUDA_HOME=$CUDA_HOME" "NCCL_HOME=$NCCL_HOME" "BUILDDIR=$BUILD/bin")
  [ -z "${NVCC_GENCODE:-}" ] || args+=("NVCC_GENCODE=$NVCC_GENCODE")
  local test targets=()
  for test in $TESTS; do targets+=("$BUILD/bin/$test"); done  # only the tests that run
  say "make -C $src/src ${args[*]} ${targets[*]}"
  make -C "$src/src" -j "$(nproc)" "${args[@]}" "${targets[@]}" >&2 || die "make failed (output above)"
  for test in $TESTS; do
    [ -x "$BUILD/bin/$test" ] || die "the build made no $BUILD/bin/$test"
  done
  say "built: $BUILD/bin ($TESTS)"
}

# GPUs per node of the allocation: SLURM_GPUS_PER_NODE may read "h100:8" or "8".
gpus_per_node() {
  local gpus=${SLURM_GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}
  echo "${gpus##*:}"
}

cmd_run() {
  need srun "run this on a Slurm cluster"
  [ -n "${SLURM_JOB_ID:-}" ] \
    || die "not inside an allocation (SLURM_JOB_ID is not set): salloc -N 2 --gpus-per-node=8 --ntasks-per-node=8 slurm/nccl-tests.sh run, or call it from an sbatch script"
  local out=${PEARL_NCCL_TESTS_OUT:-$PWD/nccl-tests-out/$SLURM_JOB_ID}
  local per_node=${PEARL_NCCL_TASKS_PER_NODE:-$(gpus_per_node)}
  local launch=(srun "--mpi=$SRUN_MPI")
  if [ -n "$per_node" ]; then
    local nodes=${SLURM_JOB_NUM_NODES:-1}
    launch+=("--nodes=$nodes" "--ntasks=$((nodes * per_node))" "--ntasks-per-node=$per_node")
  else
    say "warning: no GPU count in the allocation (SLURM_GPUS_PER_NODE); srun's default tasks, set PEARL_NCCL_TASKS_PER_NODE"
  fi
  if [ -n "${PEARL_SRUN_ARGS:-}" ]; then
    local extra
    read -r -a extra <<<"$PEARL_SRUN_ARGS"
    launch+=("${extra[@]}")
  fi
  local test_args
  read -r -a test_args <<<"$TEST_ARGS"
  mkdir -p "$out"
  # the parser checks each test ran on all of these (not one 1-rank test per task)
  if [ -n "$per_node" ]; then echo "$((${SLURM_JOB_NUM_NODES:-1} * per_node))" >"$out/ntasks"; fi
  local test
  for test in $TESTS; do
    [ -x "$BUILD/bin/$test" ] || die "$BUILD/bin/$test not found: run 'slurm/nccl-tests.sh build' first (or set PEARL_NCCL_TESTS_DIR)"
  done
  for test in $TESTS; do
    say "${launch[*]} $BUILD/bin/$test ${test_args[*]} > $out/$test.txt"
    if ! "${launch[@]}" "$BUILD/bin/$test" "${test_args[@]}" 2>"$out/$test.err" | tee "$out/$test.txt"; then
      die "$test failed; its stderr: $out/$test.err (srun 'More processors requested than permitted': allocate with --ntasks-per-node=<GPUs per node>)"
    fi
  done
  say "done; next: pearl-hpc calibrate --nccl-dir $out --out configs/clusters/<name>-bandwidth.yaml"
}

case "${1:-}" in
  build) cmd_build ;;
  run) cmd_run ;;
  *) die "usage: slurm/nccl-tests.sh build|run (settings: see the top of this file)" ;;
esac
