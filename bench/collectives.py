"""Latency and bus bandwidth of cupytp's NCCL collectives beside raw cupy.cuda.nccl calls on the
same communicator, in the same run.  mpiexec -n 2 python bench/collectives.py [--out DIR]

Each point: warm-up, then `iters` back-to-back calls timed with CUDA events (the way a training
loop issues them); bus bandwidth by the nccl-tests formulas.
"""
import argparse
import json
import os

import numpy

import cupytp
from cupytp import backend

SIZES = [2 ** k for k in range(12, 31, 2)]       # 4 KiB .. 1 GiB per rank (fp32)
NCCL_FLOAT32, NCCL_SUM = 7, 0


def timed(fn, iters, warmup=5):
    xp = backend.xp
    for _ in range(warmup):
        fn()
    start, stop = xp.cuda.Event(), xp.cuda.Event()
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    stop.synchronize()
    return xp.cuda.get_elapsed_time(start, stop) / 1000 / iters


def bench(group, op, nbytes):
    xp = backend.xp
    n = group.size
    count = nbytes // 4
    x = xp.ones(count, dtype=numpy.float32)
    comm = group.comm
    stream = lambda: xp.cuda.get_current_stream().ptr
    if op == "all_reduce":
        out = xp.empty_like(x)
        raw = lambda: comm.allReduce(x.data.ptr, out.data.ptr, count, NCCL_FLOAT32, NCCL_SUM,
                                     stream())
        ours = lambda: group.all_reduce(x)
        factor = 2 * (n - 1) / n
    elif op == "all_gather":
        out = xp.empty(count * n, dtype=numpy.float32)
        raw = lambda: comm.allGather(x.data.ptr, out.data.ptr, count, NCCL_FLOAT32, stream())
        ours = lambda: group.all_gather(x)
        nbytes *= n
        factor = (n - 1) / n
    elif op == "reduce_scatter":
        x = xp.ones(count * n, dtype=numpy.float32)
        out = xp.empty(count, dtype=numpy.float32)
        raw = lambda: comm.reduceScatter(x.data.ptr, out.data.ptr, count, NCCL_FLOAT32,
                                         NCCL_SUM, stream())
        ours = lambda: group.reduce_scatter(x)
        nbytes *= n
        factor = (n - 1) / n
    else:
        raw = lambda: comm.broadcast(x.data.ptr, x.data.ptr, count, NCCL_FLOAT32, 0, stream())
        ours = lambda: group.broadcast(x)
        factor = 1.0
    iters = max(5, min(200, int(2e9 // max(nbytes, 1))))
    t_raw, t_ours = timed(raw, iters), timed(ours, iters)
    return {"op": op, "bytes": nbytes, "raw_us": t_raw * 1e6, "ours_us": t_ours * 1e6,
            "raw_busbw": nbytes / t_raw * factor / 1e9,
            "ours_busbw": nbytes / t_ours * factor / 1e9}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--ops", default="all_reduce,all_gather,reduce_scatter,broadcast")
    args = parser.parse_args()
    info = cupytp.init()
    group = cupytp.DeviceMesh((info.world_size,)).get_process_group(0)
    rows = [bench(group, op, size) for op in args.ops.split(",") for size in SIZES]
    if info.rank == 0:
        with open(os.path.join(args.out, "collectives.json"), "w") as f:
            json.dump(rows, f, indent=1)
        name = backend.xp.cuda.runtime.getDeviceProperties(0)["name"].decode()
        print(f"{info.world_size} ranks, {name}")
        print(f"{'op':15}{'size':>10}{'raw us':>10}{'ours us':>10}{'lat x':>7}"
              f"{'raw GB/s':>10}{'ours GB/s':>10}{'bw %':>7}")
        for r in rows:
            print(f"{r['op']:15}{r['bytes'] / 2 ** 20:>9.3f}M{r['raw_us']:>10.1f}"
                  f"{r['ours_us']:>10.1f}{r['ours_us'] / r['raw_us']:>7.2f}"
                  f"{r['raw_busbw']:>10.1f}{r['ours_busbw']:>10.1f}"
                  f"{100 * r['ours_busbw'] / r['raw_busbw']:>7.1f}")


if __name__ == "__main__":
    main()
