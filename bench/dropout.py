"""Device time of the dropout kernels (`kernels/dropout.cu`) at a transformer's residual shape,
and what decides their backward: reading the forward's 1-bit mask against drawing the numbers
again (the forward's kernel run on the gradient without writing a mask costs what such a
backward would).

    python bench/dropout.py [--shape 64 256 384] [--p 0.2] [--repeats 50]

Prints one line per kernel: its device µs (LAUNCHES launches captured in one CUDA graph, the
median of the repeats' replays between CUDA events, over LAUNCHES: no host time inside) and the
bytes it moves per µs; a device-to-device copy of x is the bandwidth reference.
"""
import argparse

import numpy

import cupytp
from copy_bandwidth import timed          # median ms from CUDA events (bench/ is on the path)
from cupytp import backend
from cupytp.launchers import dropout
from cupytp.tensor import Generator


LAUNCHES = 20


def device_us(fn, repeats):
    """Device µs of one fn(): LAUNCHES of them in one captured graph, replayed `repeats` times."""
    graph = cupytp.cuda_graph(lambda: [fn() for _ in range(LAUNCHES)])
    graph()                                 # the warm-up; the next call captures
    return 1e3 * timed(graph, repeats) / LAUNCHES


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", type=int, nargs="+", default=[64, 256, 384])
    parser.add_argument("--p", type=float, default=0.2)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    cupytp.init()
    if not backend.on_gpu:
        raise SystemExit("bench/dropout.py times CUDA kernels: it needs a GPU")
    xp, shape, p = backend.xp, tuple(args.shape), args.p
    x = xp.asarray(numpy.random.default_rng(0).standard_normal(shape), dtype=backend.bfloat16)
    residual = xp.asarray(numpy.random.default_rng(1).standard_normal(shape), dtype=xp.float32)
    bias = xp.zeros(shape[-1], dtype=xp.float32)
    counters = Generator(0).counters(shape, (0,) * len(shape), shape)
    _, mask = dropout.dropout(x, p, counters)
    g = xp.ones(shape, dtype=xp.float32)
    n = x.size
    cases = [
        ("copy of x (bandwidth reference)", lambda: x.copy(), 4 * n),
        ("dropout, writing the mask", lambda: dropout.dropout(x, p, counters), 4 * n + n // 8),
        ("dropout without a mask (= a backward that draws again)",
         lambda: dropout.dropout(x, p, counters, keep_mask=False), 4 * n),
        ("backward from the mask", lambda: dropout.dropout_backward(x, mask, p), 4 * n + n // 8),
        ("bias + dropout + fp32 residual, writing the mask",
         lambda: dropout.dropout(x, p, counters, bias, residual), 10 * n + n // 8),
        ("backward of it from the mask (fp32 gradient to bf16)",
         lambda: dropout.dropout_backward(g, mask, p, x.dtype), 6 * n + n // 8),
    ]
    device = xp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"dropout kernels, {shape} bf16, p={p}, {device}")
    for name, fn, moved in cases:
        us = device_us(fn, args.repeats)
        print(f"  {name:58} {us:8.1f} us {moved / us / 1e3:7.0f} GB/s")


if __name__ == "__main__":
    main()
