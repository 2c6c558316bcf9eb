#!/usr/bin/env bash
# One device call on a 2-GPU machine: GPU test suites, collectives vs raw NCCL, training-step
# throughput vs the PyTorch anchors (carried in .carry/anchors). Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-/tmp/gpu_bench}
what=${1:-all}
if [ "$what" = all ] || [ "$what" = check ]; then
  bash scripts/gpu_check.sh > "$out/gpu_check.txt" 2>&1
  tail -5 "$out/gpu_check.txt"
fi
if [ "$what" = all ] || [ "$what" = comm ]; then
  mpiexec -n 2 python3 bench/collectives.py --out "$out" > "$out/collectives.txt" 2>&1
  grep -E "^(all_reduce|all_gather|reduce_scatter|broadcast) +(1\.000|16\.000|32\.000|1024\.000|2048\.000)M" "$out/collectives.txt"
fi
dtypes=${DTYPES:-fp32 bf16}
if [ "$what" = all ] || [ "$what" = train ]; then
  for dtype in $dtypes; do
    python3 bench/train_gpt2.py --tp 1 --steps 10 --dtype "$dtype"
    mpiexec -n 2 python3 bench/train_gpt2.py --tp 2 --steps 10 --dtype "$dtype"
    python3 .carry/anchors/torch_tp_gpt2.py --dtype "$dtype" --sdpa 0 --steps 10
    torchrun --nproc_per_node=2 .carry/anchors/torch_tp_gpt2.py --dtype "$dtype" --sdpa 1 --steps 10
  done > "$out/train_bench.txt" 2>&1
  grep -E "tokens/s|tok/s|Error|error" "$out/train_bench.txt" | tail -12
fi
