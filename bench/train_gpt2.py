"""Training-step throughput of GPT-2 on random tokens (no data pipeline), tensor-parallel over
the launched ranks:  mpiexec -n N python bench/train_gpt2.py --model 124M --tp N

Times full steps (forward, backward, clipping, AdamW) after warm-up, with the device synchronized
around the timed region; prints tokens/s and peak memory per GPU.
"""
import argparse
import os
import time

os.environ.setdefault("CUPY_TF32", "1")     # fp32 matmuls on tensor cores, as the anchors do

import numpy  # noqa: E402

import cupytp  # noqa: E402
from cupytp import backend  # noqa: E402
from cupytp.models.gpt2 import GPT2, preset  # noqa: E402
from cupytp.optim import AdamW, clip_grad_norm_, decay_groups  # noqa: E402
from cupytp.tensor import Replicated, Shard, from_local  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="124M")
    p.add_argument("--tp", type=int, default=None)
    p.add_argument("--B", type=int, default=8)
    p.add_argument("--T", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    args = p.parse_args()
    info = cupytp.init()
    tp = args.tp or info.world_size
    dp = info.world_size // tp
    mesh = cupytp.DeviceMesh((dp, tp), ("dp", "tp"))
    cupytp.manual_seed(0)
    config = preset(args.model)
    model = GPT2(config, mesh)
    optimizer = AdamW(decay_groups(model.parameters(), 0.1), lr=1e-4)
    rng = numpy.random.default_rng(mesh.get_local_rank("dp"))
    placements = (Shard(0), Replicated())

    def batch():
        ids = rng.integers(0, config.vocab_size, size=(args.B, args.T + 1))
        make = lambda a: from_local(backend.asarray(a), mesh, placements, shape=(args.B * dp,
                                                                                  args.T))
        return make(ids[:, :-1]), make(ids[:, 1:])

    def step():
        x, y = batch()
        with cupytp.autocast(None if args.dtype == "fp32" else args.dtype):
            _, loss = model(x, y)
        loss.backward()
        clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)   # keep the buffers: no reallocation
        return loss

    for _ in range(args.warmup):
        step()
    backend.synchronize()
    world = cupytp.distributed.runtime.world_comm()
    world.Barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    backend.synchronize()
    elapsed = time.perf_counter() - start
    tokens_per_s = args.B * dp * args.T * args.steps / elapsed
    peak = backend.xp.get_default_memory_pool().total_bytes() / 2 ** 30 if backend.on_gpu else 0
    if info.rank == 0:
        print(f"cupytp GPT-2 {args.model} {args.dtype} tp={tp} dp={dp} B={args.B} T={args.T}: "
              f"{tokens_per_s / 1e3:.1f}k tokens/s, {1e3 * elapsed / args.steps:.1f} ms/step, "
              f"pool {peak:.1f} GiB/GPU, loss {loss.item():.3f}", flush=True)


if __name__ == "__main__":
    main()
