#!/usr/bin/env bash
# One device call on a 2-GPU machine: fully_shard training steps beside PyTorch FSDP2
# (.carry/anchors/torch_fsdp2.py, bf16 parameters, fp32 reduction, AdamW, no clipping) on the same
# models: 24 x 2048 untied (~1.4B, B=4 per rank) and GPT-2-small-sized untied (163M, B=8 per
# rank), T=1024. Then the FSDP tests on 1 and 2 GPUs. Logs under $OUT; RESULT/ANCHOR lines last.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-/tmp/gpu_fsdp}
mkdir -p "$out"
anchors=.carry/anchors
run() {   # run NAME COMMAND...: output to $out/NAME.log
  local name=$1; shift
  timeout 300 "$@" > "$out/$name.log" 2>&1 || echo "$name exited $?" >&2
}
common="bench/train_gpt2.py --fsdp --untied --dtype bf16 --grad-clip 0 --tp 1 --T 1024"
run torch_big env L=24 C=2048 B=4 torchrun --nproc_per_node=2 $anchors/torch_fsdp2.py
run ours_big mpiexec -n 2 python3 $common --layers 24 --embd 2048 --heads 16 --B 4 \
    --label fsdp-1.4B
run torch_small env L=12 C=768 B=8 torchrun --nproc_per_node=2 $anchors/torch_fsdp2.py
run ours_small mpiexec -n 2 python3 $common --model 124M --B 8 --label fsdp-163M
for n in 1 2; do
  CUPYTP_DEVICE=gpu mpiexec -n $n python3 -m pytest tests/mpi/test_fsdp.py -q \
    -p no:cacheprovider > "$out/tests_$n.log" 2>&1; echo "tests on $n GPUs: rc $?"
  tail -1 "$out/tests_$n.log"
done
grep -h "^ANCHOR\|^RESULT\|^fully_shard" "$out"/torch_*.log "$out"/ours_*.log
