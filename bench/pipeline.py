"""Pipeline parallelism against tensor parallelism and FSDP on the same GPUs:

    mpiexec -n 2 python bench/pipeline.py        # a 24-layer, 2048-wide GPT, every run below
    mpiexec -n 2 python bench/pipeline.py --runs pp:1f1b pp:zb_h1 tp --microbatches 16

Runs, one after the other in one job: "pp:<schedule>" (the ranks as pipeline stages; <schedule>
one of gpipe, 1f1b, interleaved_1f1b, zb_h1), "tp" (tensor parallel over the ranks), "fsdp"
(fully sharded over them). Each trains on the same global batch (--B sequences of --T random
tokens; a pipeline splits it into --microbatches), with bf16 autocast over fp32 masters, gradient
clipping and AdamW, every step eager. Prints one RESULT line per run: tokens/s, ms per step, the
pool's peak memory, and for a pipeline the bubble measured on one more step (the device
synchronized around each action, so that step is slower; not timed) beside the schedule's
simulated and theoretical bubbles. `--no-fusion` runs the blocks as chains of ops (ZB-H1's W
actions hold the weights' products either way).
"""
import argparse
import gc
import os
import time

os.environ.setdefault("CUPY_TF32", "1")

import numpy  # noqa: E402

import cupytp  # noqa: E402
from cupytp import backend, memory, ops  # noqa: E402
from cupytp.models.gpt2 import GPT2, GPT2Config  # noqa: E402
from cupytp.optim import AdamW, clip_grad_norm_, decay_groups  # noqa: E402
from cupytp.parallel import fully_shard, pipeline  # noqa: E402
from cupytp.tensor import Layout, Replicated, Shard, from_local  # noqa: E402
from train_gpt2 import BF16_PEAK_FLOPS  # noqa: E402

RUNS = ["pp:gpipe", "pp:1f1b", "pp:interleaved_1f1b", "pp:zb_h1", "tp", "fsdp"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", nargs="+", default=RUNS)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--embd", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--B", type=int, default=16)
    p.add_argument("--T", type=int, default=1024)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--virtual-stages", type=int, default=2, help="for interleaved_1f1b")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--no-fusion", action="store_true", help="blocks as chains of ops")
    args = p.parse_args()
    info = cupytp.init()
    config = GPT2Config(n_layer=args.layers, n_embd=args.embd, n_head=args.heads,
                        block_size=args.T)
    rng = numpy.random.default_rng(0)
    ids = [rng.integers(0, config.vocab_size, size=(args.B, args.T + 1)) for _ in range(2)]
    for run in args.runs:
        with ops.fusion(not args.no_fusion):
            result = measure(run, config, ids, args, info)
        if info.rank == 0:
            print(result, flush=True)
        gc.collect()
        memory.empty_cache()


def measure(run, config, ids, args, info):
    """Build the model for `run`, train warm-up and timed steps; the RESULT line."""
    n = info.world_size
    autocast = None if args.dtype == "fp32" else args.dtype
    cupytp.manual_seed(0)
    memory.reset_peak_memory_stats()
    pipe = None
    if run.startswith("pp:"):
        schedule = run[3:]
        pipe = pipeline(GPT2(config), cupytp.DeviceMesh((n,), ("pp",)), schedule=schedule,
                        microbatches=args.microbatches,
                        virtual_stages=args.virtual_stages if "interleaved" in schedule else None)
        params = pipe.parameters()
        batches = [(backend.asarray(a[:, :-1]), backend.asarray(a[:, 1:])) for a in ids]

        def step(x, y, measure=None):
            with ops.autocast(autocast):
                loss = pipe.step(x, y, measure=measure)
            clip_grad_norm_(params, 1.0, pp_mesh=pipe.pp_mesh)
            optimizer.step()
            optimizer.zero_grad()
            return loss
    else:
        dim = "tp" if run == "tp" else "dp"
        mesh = cupytp.DeviceMesh((n,), (dim,))
        model = GPT2(config, mesh if run == "tp" else None)
        if run == "fsdp":
            fully_shard(model, mesh, param_dtype=autocast)
        elif run != "tp":
            raise SystemExit(f"unknown run {run!r}: choose among {RUNS}")
        params = model.parameters()
        batches = [tuple(_laid_out(part, mesh, run == "tp") for part in (a[:, :-1], a[:, 1:]))
                   for a in ids]

        def step(x, y, measure=None):
            with ops.autocast(autocast):
                _, loss = model(x, y)
            loss.backward()
            clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad()
            return loss
    optimizer = AdamW(decay_groups(params, 0.1), lr=1e-4)
    for i in range(args.warmup):
        step(*batches[i % 2])
    backend.synchronize()
    cupytp.distributed.barrier()
    start = time.perf_counter()
    for i in range(args.steps):
        loss = step(*batches[i % 2])
    backend.synchronize()
    elapsed = (time.perf_counter() - start) / args.steps
    bubble = ""
    if pipe is not None:
        step(*batches[0], measure="time")
        stats = pipe.stats
        bubble = (f" microbatches={args.microbatches} bubble={100 * stats.bubble:.1f}% "
                  f"simulated={100 * stats.simulated:.1f}% theory={100 * stats.theoretical:.1f}%")
    peak = memory.memory_stats()["allocated_bytes_peak"] / 2 ** 30
    tokens = args.B * args.T / elapsed
    mfu = config.flops_per_token(args.T) * tokens / n / BF16_PEAK_FLOPS
    return (f"RESULT pipeline-bench run={run} ranks={n} L={config.n_layer} C={config.n_embd} "
            f"B={args.B} T={args.T} dtype={args.dtype} tok/s={tokens:.0f} "
            f"fused={int(not args.no_fusion)} step_ms={1e3 * elapsed:.1f} "
            f"peak_alloc_GiB={peak:.2f} mfu={100 * mfu:.1f}% "
            f"loss={loss.item():.3f}{bubble}")


def _laid_out(array, mesh, replicated):
    """The batch on `mesh`: Replicated (tensor parallel), or Shard(0) over the data-parallel
    ranks (this rank's rows)."""
    placements = (Replicated(),) if replicated else (Shard(0),)
    (start, _), (rows, _) = Layout(mesh, array.shape, placements).local_block()
    return from_local(backend.asarray(array[start:start + rows]), mesh, placements,
                      shape=array.shape)


if __name__ == "__main__":
    main()
