"""Where a training step's time goes: the device synchronized around every module call (times
per module type, inclusive), the loss, and each phase (backward, clipping, optimizer).

mpiexec -n N python bench/profile_step.py --model 124M --tp N
"""
import argparse
import collections
import os
import time

os.environ.setdefault("CUPY_TF32", "1")

import numpy  # noqa: E402

import cupytp  # noqa: E402
from cupytp import backend, nn, ops  # noqa: E402
from cupytp.models.gpt2 import GPT2, preset  # noqa: E402
from cupytp.optim import AdamW, clip_grad_norm_, decay_groups  # noqa: E402
from cupytp.tensor import Replicated, Shard, from_local  # noqa: E402

totals = collections.defaultdict(float)


def timed(name, fn, *args, **kwargs):
    backend.synchronize()
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    backend.synchronize()
    totals[name] += time.perf_counter() - start
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="124M")
    p.add_argument("--tp", type=int, default=None)
    p.add_argument("--B", type=int, default=8)
    p.add_argument("--T", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    info = cupytp.init()
    tp = args.tp or info.world_size
    mesh = cupytp.DeviceMesh((info.world_size // tp, tp), ("dp", "tp"))
    config = preset(args.model)
    model = GPT2(config, mesh)
    optimizer = AdamW(decay_groups(model.parameters(), 0.1), lr=1e-4)
    call = nn.Module.__call__
    nn.Module.__call__ = lambda self, *a, **k: timed(type(self).__name__, call, self, *a, **k)
    loss_fn = ops.cross_entropy
    rng = numpy.random.default_rng(0)
    dp = mesh.shape[0]
    for step in range(args.steps + 1):
        if step == 1:
            totals.clear()
        ids = rng.integers(0, config.vocab_size, size=(args.B, args.T + 1))
        make = lambda a: from_local(backend.asarray(a), mesh, (Shard(0), Replicated()),
                                    shape=(args.B * dp, args.T))
        x, y = make(ids[:, :-1]), make(ids[:, 1:])
        logits, _ = model(x)
        loss = timed("cross_entropy", loss_fn, logits, y)
        timed("backward", loss.backward)
        timed("clip_grad_norm_", clip_grad_norm_, model.parameters(), 1.0)
        timed("optimizer", optimizer.step)
        optimizer.zero_grad(set_to_none=False)
    if info.rank == 0:
        print(f"per step, tp={tp}, device synchronized around each entry (ms, inclusive):")
        for name, total in sorted(totals.items(), key=lambda kv: -kv[1]):
            print(f"  {name:20} {1e3 * total / args.steps:8.1f}")


if __name__ == "__main__":
    main()
