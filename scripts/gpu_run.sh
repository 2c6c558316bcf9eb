#!/usr/bin/env bash
# One device call: the GPU test suites, then the collectives benchmark (logs under $OUT).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-/tmp/gpu_run}
bash scripts/gpu_check.sh 2>&1 | tee "$out/gpu_check.txt"
mpiexec -n "$(nvidia-smi -L | wc -l)" python3 bench/collectives.py --out "$out" 2>&1 | tee "$out/collectives.txt"
