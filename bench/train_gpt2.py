"""Training-step throughput of GPT-2 on random tokens (no data pipeline), tensor-parallel over
the launched ranks:  mpiexec -n N python bench/train_gpt2.py --model 124M --tp N

Times full steps (forward, backward, clipping, AdamW) after warm-up, with the device synchronized
around the timed region; prints tokens/s and memory-pool use per GPU. With --profile it instead
synchronizes around every module call, the loss and each phase, and prints where a step's time
goes (inclusive per module type).
"""
import argparse
import collections
import os
import time

os.environ.setdefault("CUPY_TF32", "1")     # fp32 matmuls on tensor cores, as the anchors do

import numpy  # noqa: E402

import cupytp  # noqa: E402
from cupytp import backend, nn, ops  # noqa: E402
from cupytp.models.gpt2 import GPT2, preset  # noqa: E402
from cupytp.optim import AdamW, clip_grad_norm_, decay_groups  # noqa: E402
from cupytp.tensor import Replicated, Shard, from_local  # noqa: E402


class Profile:
    """Synchronized wall time per name (a no-op unless enabled)."""

    def __init__(self, enabled):
        self.enabled = enabled
        self.totals = collections.defaultdict(float)

    def __call__(self, name, fn, *args, **kwargs):
        if not self.enabled:
            return fn(*args, **kwargs)
        backend.synchronize()
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        backend.synchronize()
        self.totals[name] += time.perf_counter() - start
        return out

    def watch_modules(self):
        call = nn.Module.__call__
        nn.Module.__call__ = lambda module, *a, **k: self(type(module).__name__, call, module,
                                                         *a, **k)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="124M")
    p.add_argument("--tp", type=int, default=None)
    p.add_argument("--B", type=int, default=8)
    p.add_argument("--T", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--profile", action="store_true")
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
    profile = Profile(args.profile)

    def batch():
        ids = rng.integers(0, config.vocab_size, size=(args.B, args.T + 1))
        make = lambda a: from_local(backend.asarray(a), mesh, placements,
                                    shape=(args.B * dp, args.T))
        return make(ids[:, :-1]), make(ids[:, 1:])

    def step():
        x, y = batch()
        with ops.autocast(None if args.dtype == "fp32" else args.dtype):
            logits, _ = model(x)
        loss = profile("cross_entropy", ops.cross_entropy, logits, y)
        profile("backward", loss.backward)
        profile("clip_grad_norm_", clip_grad_norm_, model.parameters(), 1.0)
        profile("optimizer", optimizer.step)
        optimizer.zero_grad(set_to_none=False)   # keep the buffers: no reallocation
        return loss

    for _ in range(args.warmup):
        step()
    if args.profile:
        profile.totals.clear()
        profile.watch_modules()
    backend.synchronize()
    cupytp.distributed.runtime.world_comm().Barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    backend.synchronize()
    elapsed = time.perf_counter() - start
    if info.rank != 0:
        return
    if args.profile:
        print(f"per step, tp={tp}, device synchronized around each entry (ms, inclusive):")
        for name, total in sorted(profile.totals.items(), key=lambda kv: -kv[1]):
            print(f"  {name:20} {1e3 * total / args.steps:8.1f}")
        return
    tokens_per_s = args.B * dp * args.T * args.steps / elapsed
    pool = backend.xp.get_default_memory_pool().total_bytes() / 2 ** 30 if backend.on_gpu else 0
    print(f"cupytp GPT-2 {args.model} {args.dtype} tp={tp} dp={dp} B={args.B} T={args.T}: "
          f"{tokens_per_s / 1e3:.1f}k tokens/s, {1e3 * elapsed / args.steps:.1f} ms/step, "
          f"pool {pool:.1f} GiB/GPU, loss {loss.item():.3f}", flush=True)


if __name__ == "__main__":
    main()
