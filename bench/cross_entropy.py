"""Device time of the cross-entropy kernels (`kernels/cross_entropy.cu`) over a training step's
logits: GPT-2's (rows, 50304) of which 50257 exist, Llama 3's (rows, 128256), bf16, one rank.

    python bench/cross_entropy.py [--rows 8192] [--launches 10] [--repeats 20]

Prints one line per case: device µs per call (CUDA events around `--launches` calls in a row,
the median of the repeats, over the launches: the host issues a call in far less than the
device runs one, so its time stays out) and the bytes it moves per µs (the forward reads the
existing columns; the backward reads them and writes every column of dx); a device-to-device
copy of the logits is the bandwidth reference, and the last column is the share of its rate.
"""
import argparse

import numpy

import cupytp
from copy_bandwidth import timed          # median ms from CUDA events (bench/ is on the path)
from cupytp import backend
from cupytp.launchers.cross_entropy import cross_entropy_backward, cross_entropy_forward

IGNORE = -100
VOCABULARIES = (("GPT-2", 50304, 50257), ("Llama 3", 128256, 128256))  # (columns, existing)


def device_us(fn, launches, repeats):
    """Device µs of one fn(): `launches` calls between two CUDA events, the median of
    `repeats`; each call's outputs are dropped before the next, so memory is reused."""
    def run():
        for _ in range(launches):
            fn()
    return 1e3 * timed(run, repeats) / launches


def cases(rows, cols, vocab_size):
    """(name, fn, bytes moved) of the copy, the forward and the backward over one shape."""
    xp = backend.xp
    logits = cupytp.randn((rows, cols), dtype="bf16", std=2.0).to_local()   # (rows, cols)
    targets = xp.asarray(numpy.random.default_rng(0).integers(0, vocab_size, rows))
    targets[::50] = IGNORE
    row_max, stats = cross_entropy_forward(logits, targets, 0, vocab_size, IGNORE)
    row_sum = xp.ascontiguousarray(stats[:, 0])
    grad = xp.full(rows, 1.0 / rows, xp.float32)
    read, written = rows * vocab_size * logits.itemsize, logits.nbytes
    return [
        ("copy of the logits (bandwidth reference)", logits.copy, 2 * logits.nbytes),
        ("forward", lambda: cross_entropy_forward(logits, targets, 0, vocab_size, IGNORE), read),
        ("backward", lambda: cross_entropy_backward(logits, row_max, row_sum, targets, grad, 0,
                                                    vocab_size, IGNORE), read + written),
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8192, help="B·T, the logits' rows")
    parser.add_argument("--launches", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    cupytp.init()
    if not backend.on_gpu:
        raise SystemExit("bench/cross_entropy.py times CUDA kernels: it needs a GPU")
    device = backend.xp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"cross-entropy kernels, bf16 logits, {args.rows} rows, {device}")
    for model, cols, vocab_size in VOCABULARIES:
        reference = None
        for name, fn, moved in cases(args.rows, cols, vocab_size):
            us = device_us(fn, args.launches, args.repeats)
            rate = moved / us / 1e3
            reference = reference or rate
            print(f"  {model:8} ({args.rows}, {cols}) {name:42} {us:8.1f} us "
                  f"{rate:6.0f} GB/s {rate / reference:5.2f} of the copy's")
        backend.xp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
