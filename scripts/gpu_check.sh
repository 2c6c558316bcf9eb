#!/usr/bin/env bash
# The test suites on GPUs: CuPy arrays, RawKernels, NCCL process groups (one rank per GPU).
# Usage: scripts/gpu_check.sh [max ranks]   Logs go to $OUT (default /tmp/gpu_check).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_vader_single_copy_mechanism=none
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} CUPYTP_DEVICE=gpu CUPYTP_TIMEOUT=${CUPYTP_TIMEOUT:-120} PYTHONUNBUFFERED=1
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
gpus=$(nvidia-smi -L | wc -l)
max=${1:-$gpus}
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
python3 -c "import cupy, mpi4py; from cupy.cuda import nccl; print('cupy', cupy.__version__, \
'nccl', nccl.get_version(), 'mpi4py', mpi4py.__version__)" | tee "$out/versions.txt"
declare -A result
python3 -m pytest tests/unit -q -p no:cacheprovider > "$out/unit.log" 2>&1
result[unit]=$?
n=1
while [ "$n" -le "$max" ]; do
  mpiexec -n "$n" python3 -m pytest tests/mpi -q -p no:cacheprovider --maxfail=10 > "$out/mpi_$n.log" 2>&1
  result[mpi_$n]=$?
  n=$((n * 2))
done
printf '\n%-10s %-6s %s\n' suite rc summary
for suite in "${!result[@]}"; do
  summary=$(grep -E "passed|failed|error" "$out/$suite.log" | tail -1)
  printf '%-10s %-6s %s\n' "$suite" "${result[$suite]}" "$summary"
done | sort
status=0
for rc in "${result[@]}"; do [ "$rc" -eq 0 ] || status=1; done
exit $status
