#!/usr/bin/env bash
# Device call: bf16 GEMM against its twin, bf16 training throughput (cupytp and PyTorch anchors),
# and a short bf16 run of the training example on 2 GPUs. Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-/tmp/gpu_bf16}
CUPYTP_DEVICE=gpu python3 -m pytest tests/unit/test_kernels.py tests/unit/test_ops_dense.py -q \
  -p no:cacheprovider > "$out/unit_bf16.log" 2>&1
echo "unit rc=$?"; tail -1 "$out/unit_bf16.log"
DTYPES=bf16 bash bench/gpu_bench.sh train
timeout 240 mpiexec -n 2 python3 examples/train_gpt2.py --tp 2 --steps 150 --dtype bf16 \
  --log-interval 25 --eval-interval 75 --sample-tokens 0 --out "$out/train_bf16" > "$out/train_bf16.txt" 2>&1
echo "train rc=$?"; tr '\r' '\n' < "$out/train_bf16.txt" | grep -E "first loss|error" | tail -2
tail -2 "$out/train_bf16/log.csv"
