"""Replicated data parallelism of GPT-2: scaling, and how much of the gradient all-reduce the
backward pass hides.  mpiexec -n 2 python bench/data_parallel.py --model 124M --dtype bf16

Three measurements on every rank, in one run: (1) the step of the model alone on each GPU (no
communication; one GPU's throughput), (2) the step of the same model under `replicate` over
all ranks (each rank B sequences: the global batch is B x ranks), (3) the all-reduces of that
model's gradient buckets by themselves, back to back. The part of (3) that (2) does not add to
(1) is hidden behind backward:

    speedup = tokens/s of (2) / tokens/s of (1)        (target on 2 GPUs: >= 1.9)
    hidden  = 1 - max(0, t(2) - t(1)) / t(3)            (target: >= 0.8)

Steps are captured CUDA graphs (--no-cuda-graph: eager). `bench/torch_ddp_gpt2.py` measures
the same for PyTorch DDP. Prints one RESULT line. On a CPU it runs (a smoke test), but its
numbers say nothing.
"""
import argparse
import time

import numpy

import cupytp
from cupytp import backend, ops
from cupytp.models.gpt2 import GPT2, preset
from cupytp.optim import AdamW, decay_groups
from cupytp.parallel import replicate
from cupytp.tensor import Replicated, Shard, from_local, local_mesh


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="124M")
    p.add_argument("--B", type=int, default=8, help="sequences per rank")
    p.add_argument("--T", type=int, default=1024)
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--bucket-mib", type=float, default=25.0)
    p.add_argument("--untied", action="store_true", help="an LM head of its own")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-cuda-graph", action="store_true")
    args = p.parse_args()
    info = cupytp.init()
    config = preset(args.model, tie_word_embeddings=not args.untied)
    rng = numpy.random.default_rng(info.rank)
    ids = rng.integers(0, config.vocab_size, size=(args.B, args.T + 1))

    cupytp.manual_seed(0)
    alone = GPT2(config)
    single = timed_step(alone, local_mesh(), ids, args)
    del alone
    mesh = cupytp.DeviceMesh((info.world_size,), ("dp",))
    cupytp.manual_seed(0)
    with cupytp.deferred_init():
        model = GPT2(config)
    replicate(model, mesh, bucket_bytes=int(args.bucket_mib * 2 ** 20))
    cupytp.materialize(model)
    parallel = timed_step(model, mesh, ids, args)
    reduce = timed(lambda: all_reduce_buckets(model), args.steps, args.warmup)
    if info.rank != 0:
        return
    n = info.world_size
    speedup = (n * args.B * args.T / parallel) / (args.B * args.T / single)
    hidden = max(0.0, 1 - max(0.0, parallel - single) / reduce) if reduce > 0 else 1.0
    schedule = model.dp_schedule
    print(model.dp_summary())
    print(f"RESULT cupytp-ddp {args.model} tied={int(not args.untied)} dtype={args.dtype} "
          f"ranks={n} B={args.B}/rank T={args.T} buckets={len(schedule.buckets)} "
          f"bucket_MiB={args.bucket_mib:g} step_1gpu_ms={1e3 * single:.2f} "
          f"step_ddp_ms={1e3 * parallel:.2f} allreduce_ms={1e3 * reduce:.2f} "
          f"tok/s_1gpu={args.B * args.T / single:.0f} "
          f"tok/s_ddp={n * args.B * args.T / parallel:.0f} "
          f"speedup={speedup:.2f} hidden={100 * hidden:.0f}%", flush=True)


def timed_step(model, mesh, ids, args):
    """Seconds per training step (forward, backward, AdamW) of `model` on this rank's `ids`
    (sharded over the mesh's one dimension when it has more than one rank)."""
    optimizer = AdamW(decay_groups(model.parameters(), 0.1), lr=1e-4)
    ranks = mesh.size()
    rows = (Shard(0),) if ranks > 1 else (Replicated(),)
    make = lambda a: from_local(backend.asarray(a), mesh, rows,
                                shape=(a.shape[0] * ranks, a.shape[1]))
    x, y = make(ids[:, :-1]), make(ids[:, 1:])

    def step(x, y):
        with ops.autocast(None if args.dtype == "fp32" else args.dtype):
            _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss
    run = step if args.no_cuda_graph or not backend.on_gpu else cupytp.cuda_graph(step)
    return timed(lambda: run(x, y), args.steps, args.warmup)


def all_reduce_buckets(model):
    """Every gradient bucket all-reduced in place, back to back, asynchronously (as backward
    launches them), then waited for."""
    schedule = model.dp_schedule
    group = schedule.dims.mesh.get_process_group(schedule.dims.replicate[0])
    works = [group.all_reduce(bucket.buffer, async_op=True, in_place=True)
             for bucket in schedule.buckets]
    for work in works:
        work.wait()


def timed(fn, steps, warmup):
    """Median seconds of `fn()` over `steps` calls after `warmup`, the device synchronized and
    the ranks together around each."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        backend.synchronize()
        cupytp.distributed.barrier()
        start = time.perf_counter()
        fn()
        backend.synchronize()
        times.append(time.perf_counter() - start)
    return float(numpy.median(times))


if __name__ == "__main__":
    main()
