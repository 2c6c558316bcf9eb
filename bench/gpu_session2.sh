#!/usr/bin/env bash
# Device call: clip test detail, NCCL timeout, transformers cross-check, broadcast latency, and
# the README's training run (124M, TP=2) for a few hundred steps. Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export CUPYTP_DEVICE=gpu
out=${OUT:-/tmp/gpu_session2}
CUPYTP_TIMEOUT=60 timeout 120 mpiexec -n 2 python3 -m pytest tests/mpi/test_clip.py -x -q -p no:cacheprovider > "$out/clip.log" 2>&1
echo "clip rc=$?"; grep -E "^E .*(ACTUAL|DESIRED|Max)|passed|failed" "$out/clip.log" | head -8
timeout 100 python3 -m pytest tests/unit/test_timeout.py -q -p no:cacheprovider > "$out/timeout.log" 2>&1
echo "timeout test rc=$?"; grep -E "passed|failed|cupytp:" "$out/timeout.log" | head -5
timeout 120 mpiexec -n 2 python3 bench/hf_check.py --out /tmp > "$out/hf_check.txt" 2>&1
echo "hf_check rc=$?"; grep -E "difference|Error" "$out/hf_check.txt"
timeout 100 mpiexec -n 2 python3 bench/collectives.py --out "$out" --ops broadcast,all_gather,reduce_scatter > "$out/collectives.txt" 2>&1
grep -E " +(1\.000|2\.000)M" "$out/collectives.txt"
timeout 330 mpiexec -n 2 python3 examples/train_gpt2.py --tp 2 --steps 300 --eval-interval 100 --log-interval 20 --out "$out/train" > "$out/train.txt" 2>&1
echo "train rc=$?"; tr '\r' '\n' < "$out/train.txt" | grep -E "GPT-2|first loss|error" ; tr '\r' '\n' < "$out/train.txt" | grep -E "tok/s" | tail -2
cp "$out/train/log.csv" "$out/train_log.csv" 2>/dev/null; cp "$out/train/loss.png" "$out/" 2>/dev/null
