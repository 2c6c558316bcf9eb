"""Bandwidth of the copies a fully sharded step makes, one GPU: casting a shard into the gather
buffer and folding a gradient into the reduce buffer (CuPy's elementwise copy against the
vectorized cast kernel), joining gathered rows into a full parameter (CuPy's elementwise copy
against `backend.copy_rows`, one cudaMemcpy2DAsync).

    python bench/copy_bandwidth.py [--n 8388608]

GB/s counts the bytes read plus written; the last column is against the device-to-device copy
of the same bytes (cudaMemcpyAsync)."""
import argparse

import cupy

from cupytp import backend
from cupytp.launchers.cast import cast_rows


def timed(fn, repeats=50):
    """Median milliseconds of `fn()` from CUDA events."""
    fn()
    times = []
    for _ in range(repeats):
        begin, end = cupy.cuda.Event(), cupy.cuda.Event()
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(begin, end))
    return sorted(times)[len(times) // 2]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=8 << 20, help="elements of one parameter")
    p.add_argument("--ranks", type=int, default=2)
    args = p.parse_args()
    n, dp = args.n, args.ranks
    bf16, f32 = backend.dtype("bf16"), cupy.float32
    shard = n // dp
    master = cupy.ones(shard, f32)
    row = cupy.empty(3 * shard, bf16)                  # a gather buffer holding 3 parameters
    rows = cupy.ones((dp, 3 * shard), bf16)
    full = cupy.empty((dp, shard), bf16)
    grad = cupy.ones((dp, shard), bf16)
    reduce_rows = cupy.empty((dp, 3 * shard), f32)
    region = rows[:, shard:2 * shard]

    def assign(dst, src):
        return lambda: dst.__setitem__(Ellipsis, src)
    cases = [
        ("cast shard into gather row (f32->bf16, 1-D)", assign(row[shard:2 * shard], master),
         shard * 6),
        ("cast shard into gather row: cast_rows kernel",
         lambda: cast_rows(row[shard:2 * shard], master), shard * 6),
        ("join: elementwise copy of rows (bf16, 2-D)", assign(full, region), n * 4),
        ("join: copy_rows (cudaMemcpy2DAsync)", lambda: backend.copy_rows(full, region), n * 4),
        ("fold: cast grad into reduce rows (bf16->f32)",
         assign(reduce_rows[:, shard:2 * shard], grad), n * 6),
        ("fold: cast_rows kernel",
         lambda: cast_rows(reduce_rows[:, shard:2 * shard], grad), n * 6),
        ("fold, adding: cast_rows kernel",
         lambda: cast_rows(reduce_rows[:, shard:2 * shard], grad, add=True), n * 10),
        ("reference: contiguous copy (cudaMemcpyAsync)",
         lambda: full.data.copy_from_device_async(grad.data, full.nbytes), n * 4),
    ]
    reference = timed(cases[-1][1]) / cases[-1][2]
    print(f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, n={n}, dp={dp}")
    print(f"{'copy':48} {'ms':>8} {'GB/s':>8} {'x memcpy':>9}")
    for name, fn, nbytes in cases:
        ms = timed(fn)
        print(f"{name:48} {ms:8.4f} {nbytes / ms / 1e6:8.0f} {reference * nbytes / ms:9.2f}")


if __name__ == "__main__":
    main()
