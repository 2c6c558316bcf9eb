"""Training-step throughput of a Llama-family model on random tokens (no data pipeline), over the
launched ranks (tensor-parallel by default; --fsdp: the data-parallel ranks fully sharded):

    python bench/train_llama.py                       # 16 x 2048, 32/8 heads, FFN 8192, vocab
                                                      # 128256, B=4, T=2048, bf16, one GPU
    mpiexec -n 2 python bench/train_llama.py --tp 2

The default is the shape of the PyTorch anchor (/work/shared/anchors/torch_llama.py: bf16
autocast, fused AdamW, no clipping; run it beside this one, in the same call). Times full steps
(forward, backward, AdamW) after warm-up, the device synchronized around the timed region; on
GPU the step is one captured CUDA graph (--no-cuda-graph: eager). Prints one RESULT line:
tokens/s, ms/step, the device time of one step (CUDA events), the host time to issue a step, the
peak of the framework's pool per GPU over the steps (warm-up and capture included, as the
anchor's peaks are; allocated and reserved) and MFU (the anchor's FLOPs: 6 · parameters + 12 ·
layers · width · T per token). --profile instead synchronizes around every module call and
phase and prints where a step's time goes.
"""
import argparse
import os
import sys

os.environ.setdefault("CUPY_TF32", "1")     # fp32 matmuls on tensor cores, as the anchor does

import cupytp  # noqa: E402
from cupytp.models.llama import Llama, preset  # noqa: E402
from step_timing import BF16_PEAK_FLOPS  # noqa: E402
from train_gpt2 import (  # noqa: E402
    data_parallel, parallel_setup, step_arguments, timed_training)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="1.5B", help="a Llama preset (tiny, 125M, 1B, 1.5B, 8B)")
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    p.add_argument("--tied", action="store_true", help="tie the LM head to the embedding")
    step_arguments(p, batch=4, length=2048, dtype="bf16", grad_clip=0.0)
    args = p.parse_args()
    info, mesh, tp, dp = parallel_setup(args)
    overrides = {"tie_word_embeddings": args.tied}
    if args.layers:
        overrides["num_hidden_layers"] = args.layers
    config = preset(args.model, **overrides)
    model = Llama(config, mesh, recompute=args.recompute)
    data_parallel(model, mesh, args)
    _, profile, eager, _, timing = timed_training(model, mesh, config.vocab_size, args, 2)
    if info.rank != 0:
        return
    if args.profile:
        profile.print_totals(args.steps, tp)
    tokens_per_s = args.B * dp * args.T / timing.step_s
    mfu = config.flops_per_token(args.T) * tokens_per_s / info.world_size / BF16_PEAK_FLOPS
    print(f"RESULT cupytp llama-{args.label or args.model} graph={int(not eager)} "
          f"dtype={args.dtype} tp={tp} dp={dp} fsdp={int(args.fsdp)} "
          f"params={config.num_parameters() / 1e6:.1f}M L={config.num_hidden_layers} "
          f"D={config.hidden_size} H={config.num_attention_heads} "
          f"KV={config.num_key_value_heads} F={config.intermediate_size} "
          f"V={config.vocab_size} B={args.B} T={args.T} tok/s={tokens_per_s:.0f} "
          f"{timing.fields()} mfu={100 * mfu:.1f}% loss={timing.loss.item():.3f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
