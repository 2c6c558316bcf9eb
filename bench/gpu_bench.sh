#!/usr/bin/env bash
# One device call on a 2-GPU machine: cupytp's training step beside the PyTorch anchors (copied
# from the shared anchors folder into .carry/anchors, named in the device tool's carry), in the
# same call; the anchors do not clip gradients, so neither do these runs.
# Usage: bench/gpu_bench.sh [check] [comm] [train1] [train2] [train] [host] [fsdp] [ddp] [build]
# [small] [eval] [dropout] [targets] [attention] [llama2] [profile] [profile2] [profile3]
# [profile4] [pipeline]
# [long] [cp] [gemm] [flash_ab]
# (default: train host; train = train1 train2, the 1-GPU and the TP=2 pairs; fsdp: fully_shard
# beside PyTorch FSDP2 with bf16 parameters and fp32 reduction, untied models; ddp: replicated data parallelism of 124M
# (scaling over one GPU, share of the all-reduce hidden) beside PyTorch DDP; build: the
# construction peak of the 1.4B FSDP model; small: the small GPT of small-data users (6 x 384,
# vocab 65, B=64, T=256, no biases) with dropout 0.2 and 0, captured and eager, beside PyTorch
# eager and torch.compile with fused AdamW; eval: the 124M evaluation forward beside its
# training step; dropout: 124M, 774M and 1558M with dropout 0.1 beside torch.compile with fused
# AdamW; targets: the one-GPU targets (small GPT, 124M, Llama 1.5B) beside torch.compile;
# attention: bench/attention.py (the flash kernels' registers, their twin checks, times beside
# cuDNN and PyTorch's SDPA); llama2: two GPUs, the Llama 1.5B shape at TP=2 and fully sharded
# (B=4 a rank) beside PyTorch's tensor-parallel and FSDP2 runs of it, eager and compiled
# (bench/torch_llama_parallel.py);
# profile, profile2, profile3, profile4: device time per kind of kernel at 124M on one GPU, at 24x2048 at TP=2,
# of the 1.4B fully_shard step beside FSDP2's, of the Llama 1.5B shape on one GPU beside
# torch.compile's; pipeline: bench/pipeline.py, every pipeline
# schedule at pp=2 beside tp=2 and fully_shard over 2 GPUs on a 24 x 2048 GPT, with the
# schedules' measured and theoretical bubbles; long: one GPU, peak memory and activation memory
# per token at T = 16k and 32k of 124M with and without recompute and of the Llama 1B shape with
# it, the PyTorch SDPA model of the same shape beside, drawn into $OUT/long_context.png; cp: two
# GPUs, the longest sequence and tokens/s of 124M with recompute at cp=1 and cp=2 under one
# memory cap, and tp=2 with and without sequence parallelism; gemm: bench/gemm_algorithms.py,
# each product of 124M, 774M, XL and the Llama shape with every cuBLASLt candidate; flash_ab:
# bench/flash_ab.py, the flash kernels of the exports in FLASH_AB (folders, default
# .carry/flash_ab; each made here first by `bench/flash_ab.py --export REV FOLDER`) beside the
# tree's, in one process). A
# cuDNN frontend wheel carried in .carry/wheels is installed first (the machines have no
# internet), so that attention can run through cuDNN. Logs under $OUT; the last thing printed is
# the table of bench/compare.py.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-/tmp/gpu_bench}
mkdir -p "$out"
anchors=.carry/anchors
what=${*:-train host}
what=${what//train1/one}; what=${what//train2/two}; what=${what//train/one two}
pairs=()
if compgen -G ".carry/wheels/nvidia_cudnn_frontend-*.whl" > /dev/null; then
  pip install -q --no-deps --target /tmp/cupytp_pylib .carry/wheels/nvidia_cudnn_frontend-*.whl
  export PYTHONPATH=$PYTHONPATH:/tmp/cupytp_pylib
  lib=$(python3 -c "import nvidia.cudnn as c; print(list(c.__path__)[0] + '/lib')" 2>/dev/null) &&
    export LD_LIBRARY_PATH=$lib:${LD_LIBRARY_PATH:-}
fi
run() {   # run NAME COMMAND...: output to $out/NAME.log
  local name=$1; shift
  timeout 300 "$@" > "$out/$name.log" 2>&1 || echo "$name exited $?" >&2
}
for part in $what; do
  case $part in
    check) bash scripts/gpu_check.sh > "$out/gpu_check.txt" 2>&1; tail -6 "$out/gpu_check.txt" ;;
    comm) mpiexec -n 2 python3 bench/collectives.py --out "$out" > "$out/collectives.txt" 2>&1
          tail -4 "$out/collectives.txt" ;;
    one)
      run ours_1gpu python3 bench/train_gpt2.py --tp 1 --dtype bf16 --grad-clip 0 --label 124M-1gpu
      run torch_1gpu python3 $anchors/torch_tp_gpt2.py --dtype bf16 --sdpa 1 --steps 10
      pairs+=("124M-1gpu-B8=$out/ours_1gpu.log,$out/torch_1gpu.log") ;;
    two)
      run ours_tp2 mpiexec -n 2 python3 bench/train_gpt2.py --tp 2 --dtype bf16 --grad-clip 0 --label 124M-tp2
      run torch_tp2 torchrun --nproc_per_node=2 $anchors/torch_megatron_tp.py --steps 10
      run ours_big mpiexec -n 2 python3 bench/train_gpt2.py --tp 2 --dtype bf16 --grad-clip 0 --layers 24 \
          --embd 2048 --heads 16 --B 4 --label 24x2048-tp2
      run ours_big_rc mpiexec -n 2 python3 bench/train_gpt2.py --tp 2 --dtype bf16 --grad-clip 0 --layers 24 \
          --embd 2048 --heads 16 --B 4 --recompute --label 24x2048-tp2-recompute
      run torch_big torchrun --nproc_per_node=2 $anchors/torch_megatron_tp.py --layers 24 \
          --embd 2048 --heads 16 --B 4 --steps 10
      pairs+=("124M-tp2-B8=$out/ours_tp2.log,$out/torch_tp2.log"
              "24x2048-tp2-B4=$out/ours_big.log,$out/torch_big.log"
              "24x2048-tp2-B4-recompute=$out/ours_big_rc.log,$out/torch_big.log") ;;
    fsdp)
      fsdp="python3 bench/train_gpt2.py --fsdp --untied --dtype bf16 --grad-clip 0 --tp 1"
      run torch_fsdp_big env L=24 C=2048 B=4 torchrun --nproc_per_node=2 $anchors/torch_fsdp2.py
      run ours_fsdp_big mpiexec -n 2 $fsdp --layers 24 --embd 2048 --heads 16 --B 4 \
          --label fsdp-1.4B
      run torch_fsdp_small env L=12 C=768 B=8 torchrun --nproc_per_node=2 \
          $anchors/torch_fsdp2.py
      run ours_fsdp_small mpiexec -n 2 $fsdp --model 124M --B 8 --label fsdp-163M
      pairs+=("fsdp-1.4B-B4=$out/ours_fsdp_big.log,$out/torch_fsdp_big.log"
              "fsdp-163M-B8=$out/ours_fsdp_small.log,$out/torch_fsdp_small.log") ;;
    small)   # the small GPT: dropout 0.2 and 0, ours captured and eager, PyTorch eager and compiled
      small="--layers 6 --embd 384 --heads 6 --vocab 65 --B 64 --T 256 --bias 0 --dtype bf16"
      for p in 0.2 0; do
        run ours_small_$p python3 bench/train_gpt2.py --tp 1 --grad-clip 0 $small --dropout $p \
            --steps 30 --label small-d$p-graph
        run ours_small_eager_$p python3 bench/train_gpt2.py --tp 1 --grad-clip 0 $small \
            --dropout $p --steps 30 --no-cuda-graph --label small-d$p-eager
        run torch_small_$p python3 $anchors/torch_tp_gpt2.py $small --dropout $p --fused 1 \
            --steps 30
        run torch_small_compile_$p python3 $anchors/torch_tp_gpt2.py $small --dropout $p \
            --fused 1 --compile 1 --steps 30
        pairs+=("small-d$p-graph/eager=$out/ours_small_$p.log,$out/torch_small_$p.log"
                "small-d$p-graph/compile=$out/ours_small_$p.log,$out/torch_small_compile_$p.log"
                "small-d$p-eager/eager=$out/ours_small_eager_$p.log,$out/torch_small_$p.log")
      done ;;
    targets) # the one-GPU speed targets in one pass: the small GPT with dropout 0.2 (and 0),
             # 124M B=8 and the Llama 1.5B shape, each beside the stronger PyTorch anchor
      small="--layers 6 --embd 384 --heads 6 --vocab 65 --B 64 --T 256 --bias 0 --dtype bf16"
      for p in 0.2 0; do
        run ours_small_$p python3 bench/train_gpt2.py --tp 1 --grad-clip 0 $small --dropout $p \
            --steps 30 --label small-d$p-graph
      done
      run torch_small_0.2 python3 $anchors/torch_tp_gpt2.py $small --dropout 0.2 --fused 1 --steps 30
      run torch_small_compile_0.2 python3 $anchors/torch_tp_gpt2.py $small --dropout 0.2 --fused 1 \
          --compile 1 --steps 30
      run ours_124M python3 bench/train_gpt2.py --tp 1 --dtype bf16 --grad-clip 0 --label 124M-1gpu
      run torch_124M_compile python3 $anchors/torch_tp_gpt2.py --dtype bf16 --sdpa 1 --fused 1 \
          --compile 1 --steps 10
      run ours_llama python3 bench/train_llama.py --label llama-1.5B
      run torch_llama_compile python3 $anchors/torch_llama.py --compile 1
      pairs+=("small-d0.2/eager=$out/ours_small_0.2.log,$out/torch_small_0.2.log"
              "small-d0.2/compile=$out/ours_small_0.2.log,$out/torch_small_compile_0.2.log"
              "small-d0/d0.2-compile=$out/ours_small_0.log,$out/torch_small_compile_0.2.log"
              "124M-B8/compile=$out/ours_124M.log,$out/torch_124M_compile.log"
              "llama-1.5B/compile=$out/ours_llama.log,$out/torch_llama_compile.log") ;;
    flash_ab)
      run flash_ab python3 bench/flash_ab.py --against ${FLASH_AB:-.carry/flash_ab}
      grep -h -e "twin checks" -e RESULT "$out/flash_ab.log" ;;
    gemm)
      run gemm python3 bench/gemm_algorithms.py
      grep -h TOTAL "$out/gemm.log" ;;
    attention)
      run attention python3 bench/attention.py --reps 20
      grep -h -E "registers|worst|^\|" "$out/attention.log" ;;
    llama2)  # the Llama 1.5B shape on two GPUs: TP=2 and fully sharded, beside PyTorch's
      run ours_llama_tp mpiexec -n 2 python3 bench/train_llama.py --tp 2 --label llama-1.5B-tp2
      run ours_llama_fsdp mpiexec -n 2 python3 bench/train_llama.py --tp 1 --fsdp \
          --label llama-1.5B-fsdp
      for mode in tp fsdp; do
        for c in 0 1; do
          run torch_llama_${mode}_$c torchrun --nproc_per_node=2 bench/torch_llama_parallel.py \
              --mode $mode --compile $c
        done
        pairs+=("llama-$mode/eager=$out/ours_llama_$mode.log,$out/torch_llama_${mode}_0.log"
                "llama-$mode/compile=$out/ours_llama_$mode.log,$out/torch_llama_${mode}_1.log")
      done ;;
    eval)    # the 124M evaluation forward (no tape, captured) beside its training step
      run ours_eval python3 bench/train_gpt2.py --tp 1 --dtype bf16 --grad-clip 0 --eval \
          --label 124M-eval
      grep -h "^EVAL" "$out/ours_eval.log" ;;
    dropout) # GPT-2 sizes with dropout 0.1 beside torch.compile + fused AdamW, same dropout
      for model in 124M:8 774M:8 1558M:4; do
        name=${model%:*}; b=${model#*:}
        case $name in 124M) shape="";; 774M) shape="--layers 36 --embd 1280 --heads 20";;
                      1558M) shape="--layers 48 --embd 1600 --heads 25";; esac
        run ours_drop_$name python3 bench/train_gpt2.py --model $name --tp 1 --dtype bf16 \
            --grad-clip 0 --dropout 0.1 --B $b --label $name-d0.1
        run torch_drop_$name python3 $anchors/torch_tp_gpt2.py --dtype bf16 $shape --B $b \
            --dropout 0.1 --fused 1 --compile 1 --steps 10
        pairs+=("$name-d0.1-B$b/compile=$out/ours_drop_$name.log,$out/torch_drop_$name.log")
      done ;;
    ddp)
      for tied in "" --untied; do
        run ours_ddp$tied mpiexec -n 2 python3 bench/data_parallel.py --model 124M --dtype bf16 $tied
        run torch_ddp$tied torchrun --nproc_per_node=2 bench/torch_ddp_gpt2.py $tied
        grep -h -e RESULT -e ANCHOR "$out/ours_ddp$tied.log" "$out/torch_ddp$tied.log"
      done ;;
    build)
      run build_fsdp mpiexec -n 2 python3 bench/construction.py --layers 24 --embd 2048 --heads 16 --untied
      grep -h RESULT "$out/build_fsdp.log" ;;
    profile)   # device time per kind of kernel, ours (eager: 2 + 5 + 5 steps) and PyTorch's
      run profile_ours python3 bench/kernel_profile.py --per 10 -- bench/train_gpt2.py --tp 1 \
          --dtype bf16 --no-cuda-graph --steps 5 --warmup 2
      run profile_torch python3 bench/kernel_profile.py --per 10 -- $anchors/torch_tp_gpt2.py \
          --dtype bf16 --sdpa 1 --steps 10
      for side in ours torch; do grep -B2 -A16 "ms of kernels" "$out/profile_$side.log"; done ;;
    profile4)  # the same for the Llama 1.5B shape, ours captured beside torch.compile
      run profile_ours_llama python3 bench/kernel_profile.py --per 10 -- bench/train_llama.py \
          --steps 5 --warmup 2
      run profile_torch_llama python3 bench/kernel_profile.py --per 10 -- \
          $anchors/torch_llama.py --compile 1 --steps 10
      for side in ours torch; do grep -B2 -A16 "ms of kernels" "$out/profile_${side}_llama.log"; done ;;
    profile2)  # the same for 24 layers x 2048 at TP=2 (rank 0; ours replayed: eager, a rank's
               # collectives would wait for the other's host), ours and Megatron-style
      big="--layers 24 --embd 2048 --heads 16 --B 4"
      run profile_ours_big mpiexec -n 2 python3 bench/kernel_profile.py --per 10 -- \
          bench/train_gpt2.py --tp 2 --dtype bf16 --grad-clip 0 --steps 5 --warmup 2 $big
      run profile_torch_big torchrun --nproc_per_node=2 bench/kernel_profile.py --per 10 -- \
          $anchors/torch_megatron_tp.py --steps 10 $big
      for side in ours_big torch_big; do grep -A22 "ms of kernels" "$out/profile_$side.log"; done ;;
    profile3)  # the 1.4B fully sharded step (rank 0; ours replayed), ours and FSDP2's; ours'
               # memory per phase
      big="--layers 24 --embd 2048 --heads 16 --B 4"
      fsdp="bench/train_gpt2.py --fsdp --untied --dtype bf16 --grad-clip 0 --tp 1 $big"
      run profile_ours_fsdp mpiexec -n 2 python3 bench/kernel_profile.py --per 10 -- $fsdp \
          --steps 5 --warmup 2
      run profile_torch_fsdp env L=24 C=2048 B=4 torchrun --nproc_per_node=2 \
          bench/kernel_profile.py --per 10 -- $anchors/torch_fsdp2.py
      run memory_ours_fsdp mpiexec -n 2 python3 $fsdp --profile --steps 3 --warmup 2
      for side in ours_fsdp torch_fsdp; do grep -A22 "ms of kernels" "$out/profile_$side.log"; done
      tail -30 "$out/memory_ours_fsdp.log" ;;
    pipeline)   # every run fused, then 1F1B and ZB-H1 with the blocks as chains of ops
      timeout 900 mpiexec -n 2 python3 bench/pipeline.py > "$out/pipeline.log" 2>&1 ||
        echo "pipeline exited $?" >&2
      timeout 600 mpiexec -n 2 python3 bench/pipeline.py --runs pp:1f1b pp:zb_h1 --no-fusion \
        > "$out/pipeline_chains.log" 2>&1 || echo "pipeline --no-fusion exited $?" >&2
      grep -h RESULT "$out/pipeline.log" "$out/pipeline_chains.log" ;;
    long)   # one GPU: 124M with recompute and without, Llama 1B's shape with it, at 16k and
            # 32k tokens, PyTorch SDPA of the same shape beside (one anchor may OOM); each run
            # capped so that the part takes under 9 minutes
      lc="python3 bench/long_context.py --T 16384,32768 --steps 3 --warmup 1"
      run long_124M_rc timeout 170 $lc --model 124M --recompute --anchor $anchors \
          --anchor-timeout 60
      run long_124M timeout 90 $lc --model 124M
      run long_llama1B_rc timeout 280 $lc --model llama-1B --recompute --anchor $anchors \
          --anchor-timeout 90 --T 8192,16384,32768
      grep -h -e ^RESULT -e ^ANCHOR -e ^PEAK -e ^SLOPE "$out"/long_*.log | tee "$out/long.txt"
      python3 bench/plot_benchmarks.py long "$out/long.txt" --out "$out/long_context.png" ;;
    cp)     # two GPUs: context parallelism's targets. 124M with recompute, one sequence per
            # step, each rank's pool capped at CP_LIMIT GiB (default 32) so that both splits
            # have the same memory on any card: the longest length each trains (OOM past it)
            # and tokens/s at the lengths both run, cp=2 replicated and fully sharded over cp;
            # then tp=2 with and without sequence parallelism (no recompute, no cap); drawn
            # into $out/long_context_2gpu.png
      lc="python3 bench/long_context.py --model 124M --steps 3 --warmup 1"
      limit="--recompute --memory-limit ${CP_LIMIT:-32}"
      run long_cp1 timeout 150 mpiexec -n 1 $lc $limit --T 65536,98304,114688,122880
      run long_cp2 timeout 200 mpiexec -n 2 $lc $limit --cp 2 --T 65536,98304,114688,212992,229376
      run long_cp2_fsdp timeout 200 mpiexec -n 2 $lc $limit --cp 2 --fsdp --T 229376,245760,262144
      if [ -n "${CP_TP-1}" ]; then   # CP_TP= (empty) skips them
        run long_tp2 timeout 100 mpiexec -n 2 $lc --tp 2 --T 16384,32768,65536
        run long_tp2_sp timeout 100 mpiexec -n 2 $lc --tp 2 --sequence-parallel \
            --T 16384,32768,65536
      fi
      cat "$out"/long_cp1.log "$out"/long_cp2.log "$out"/long_cp2_fsdp.log "$out"/long_tp2*.log \
          2>/dev/null | grep ^RESULT | tee "$out/cp.txt"
      python3 bench/plot_benchmarks.py long "$out/cp.txt" --out "$out/long_context_2gpu.png" ;;
    host)   # the eager tiny step in HOST_ROUNDS rounds (default 5), ours and PyTorch's taking
            # turns, so that both meet the machine's spells of host noise; the median round counts
      ours=(); theirs=()
      for r in $(seq "${HOST_ROUNDS:-5}"); do
        run ours_tiny_$r python3 bench/train_gpt2.py --tp 1 --dtype bf16 --B 2 --T 64 --grad-clip 0 \
            --label tiny-eager --no-cuda-graph --steps 30
        run torch_tiny_$r python3 $anchors/torch_tp_gpt2.py --dtype bf16 --sdpa 1 --B 2 --T 64 \
            --steps 30
        ours+=("$out/ours_tiny_$r.log"); theirs+=("$out/torch_tiny_$r.log")
      done
      run ours_tiny_graph python3 bench/train_gpt2.py --tp 1 --dtype bf16 --B 2 --T 64 --grad-clip 0 \
          --label tiny-graph --steps 30
      joined() { local IFS=+; echo "$*"; }
      pairs+=("124M-B2-T64-eager=$(joined "${ours[@]}"),$(joined "${theirs[@]}")"
              "124M-B2-T64-graph=$out/ours_tiny_graph.log,$(joined "${theirs[@]}")") ;;
  esac
done
[ ${#pairs[@]} -gt 0 ] && python3 bench/compare.py "${pairs[@]}" | tee "$out/table.txt"
