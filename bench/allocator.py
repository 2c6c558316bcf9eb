"""Host cost of device allocation on one GPU: CuPy's default MemoryPool, cupytp's
CachingAllocator (cupytp.memory, as installed) and raw cudaMalloc/cudaFree, each called as a
CuPy allocator function, in the same run:  python bench/allocator.py [--out DIR]

Two loops, each timed (host wall clock, device synchronized before) after one warm-up pass:
- churn: 50 fixed sizes from 512 B to 200 MiB, each allocated and dropped at once, repeated;
- gpt2-step: the allocation sequence of a GPT-2 training step (activations kept for the backward
  pass, temporaries dropped at once, then gradients), replayed step after step.
Prints µs per call (an allocation and its free), the ratios, and the share of the pool's
allocations served from its cache; writes allocator.json to --out.
"""
import argparse
import itertools
import json
import os
import time

import numpy

from cupytp import backend, memory

MiB = 2 ** 20
SIZES = [int(s) // 4 * 4 for s in numpy.geomspace(512, 200 * MiB, 50)]    # fp32 multiples


def gpt2_step_trace(B, T, C, H, L, V, itemsize=4):
    """The (slot, nbytes) sequence of one GPT-2 step; nbytes None frees the slot. The forward
    keeps what the backward reads and drops its temporaries; the backward makes a gradient of
    each kept tensor, in reverse, freeing the tensor and the previous gradient as it goes."""
    trace, kept = [], []
    slots = itertools.count()

    def alloc(*shape):
        slot, nbytes = next(slots), int(numpy.prod(shape)) * itemsize
        trace.append((slot, nbytes))
        return slot, nbytes

    def keep(*shape):
        kept.append(alloc(*shape))

    def temporary(*shape):
        trace.append((alloc(*shape)[0], None))

    def layer_norm():
        keep(B, T, C)                                  # output
        keep(B, T)                                     # mean
        keep(B, T)                                     # 1 / standard deviation

    keep(B, T, C)                                      # embeddings
    for _ in range(L):
        layer_norm()
        keep(B, T, 3 * C)                              # q|k|v
        temporary(B, H, T, T)                          # scores
        keep(B, H, T, T)                               # probabilities
        keep(B, T, C)                                  # attention output
        temporary(B, T, C)                             # projection
        keep(B, T, C)                                  # residual
        layer_norm()
        keep(B, T, 4 * C)                              # fc
        keep(B, T, 4 * C)                              # gelu
        temporary(B, T, C)                             # projection
        keep(B, T, C)                                  # residual
    layer_norm()
    keep(B, T, V)                                      # logits
    temporary(B, T)                                    # per-token loss
    temporary(1)                                       # mean loss
    grad = None
    for slot, nbytes in reversed(kept):
        previous, grad = grad, alloc(nbytes // itemsize)[0]
        trace.append((slot, None))
        if previous is not None:
            trace.append((previous, None))
    trace.append((grad, None))
    return trace


def churn(allocate, sizes, repeat):
    for _ in range(repeat):
        for nbytes in sizes:
            allocate(nbytes)                                           # dropped: freed at once
    return repeat * len(sizes)


def replay(allocate, trace, steps):
    live = {}
    for _ in range(steps):
        for slot, nbytes in trace:
            if nbytes is None:
                del live[slot]
            else:
                live[slot] = allocate(nbytes)
    return steps * sum(nbytes is not None for _, nbytes in trace)


def timed(loop, allocate, *args):
    """µs per call of `loop(allocate, *args)`, after one untimed pass."""
    loop(allocate, *args)
    backend.synchronize()
    start = time.perf_counter()
    calls = loop(allocate, *args)
    return 1e6 * (time.perf_counter() - start) / calls


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--repeat", type=int, default=40, help="passes over the 50 sizes")
    parser.add_argument("--steps", type=int, default=10, help="GPT-2 steps replayed")
    parser.add_argument("--B", type=int, default=4)
    parser.add_argument("--T", type=int, default=512)
    args = parser.parse_args()
    if not backend.on_gpu:
        raise SystemExit("bench/allocator.py measures device allocation: it needs a GPU")
    cupy = backend.xp
    pool = memory.install()
    cupy_pool = cupy.cuda.MemoryPool()
    allocators = {
        "cupy_pool": cupy_pool.malloc,
        "cupytp": cupy.cuda.get_allocator(),
        "cudaMalloc": lambda nbytes: cupy.cuda.MemoryPointer(cupy.cuda.memory.Memory(nbytes), 0),
    }
    loops = {
        "churn": (churn, SIZES, args.repeat),
        "gpt2-step": (replay, gpt2_step_trace(args.B, args.T, 768, 12, 12, 50257), args.steps),
    }
    rows = []
    for name, (loop, *loop_args) in loops.items():
        row = {"loop": name}
        for which, allocate in allocators.items():
            before = pool.stats()
            row[f"{which}_us"] = timed(loop, allocate, *loop_args)
            if which == "cupytp":
                after = pool.stats()
                row["cupytp_hit_rate"] = ((after["cache_hits"] - before["cache_hits"])
                                          / (after["allocations"] - before["allocations"]))
            cupy_pool.free_all_blocks()
            memory.empty_cache()
        rows.append(row)
    device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    with open(os.path.join(args.out, "allocator.json"), "w") as f:
        json.dump({"device": device, "date": time.strftime("%Y-%m-%d"), "rows": rows}, f,
                  indent=1)
    print(f"allocation + free, µs per call, {device}")
    print(f"{'loop':11}{'cupy pool':>11}{'cupytp':>9}{'cudaMalloc':>12}{'cupytp/cupy':>13}"
          f"{'cudaMalloc/cupytp':>19}{'cache hits':>12}")
    for r in rows:
        print(f"{r['loop']:11}{r['cupy_pool_us']:>11.2f}{r['cupytp_us']:>9.2f}"
              f"{r['cudaMalloc_us']:>12.1f}{r['cupytp_us'] / r['cupy_pool_us']:>13.2f}"
              f"{r['cudaMalloc_us'] / r['cupytp_us']:>19.1f}{r['cupytp_hit_rate']:>12.1%}")


if __name__ == "__main__":
    main()
