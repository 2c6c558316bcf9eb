"""The products of one training step, each timed with every algorithm cuBLASLt's heuristic
offers for it (up to gemm_choice.CANDIDATES), as a product's first run times them
(CUPYTP_GEMM_TUNE): what the heuristic's first costs a step and what the fastest candidates do.

    python3 bench/gemm_algorithms.py [--models 124M 774M 1558M llama-1.5B]

For each model: its decoder block's four products (qkv, attention output, the MLP's two) forward,
input gradient and weight gradient (fp32), times its layers, and the output head's three, in
bf16 without epilogues; one line per product (µs with the heuristic's first and with the
fastest, which candidate that is), then a TOTAL line per model. GPU only.
"""
import argparse
import os

import numpy

from cupytp import backend
from cupytp.backend import bfloat16, xp
from cupytp.launchers import gemm, gemm_choice

# name: (tokens a step, width, MLP width, vocabulary, layers, qkv width, MLP input product width)
MODELS = {
    "124M": (8192, 768, 3072, 50304, 12, 3 * 768, 3072),
    "774M": (8192, 1280, 5120, 50304, 36, 3 * 1280, 5120),
    "1558M": (4096, 1600, 6400, 50304, 48, 3 * 1600, 6400),
    "24x2048": (4096, 2048, 8192, 50304, 24, 3 * 2048, 8192),
    "llama-1.5B": (8192, 2048, 8192, 128256, 16, 2048 + 2 * 512, 2 * 8192),   # gate and up
}


def products(tokens, width, hidden, vocab, layers, qkv, mlp_in):
    """(label, m, k, n, a stored transposed, b stored transposed, output dtype, count)."""
    out = []
    for label, k, n in (("qkv", width, qkv), ("proj", width, width), ("fc", width, mlp_in),
                        ("fc2", hidden, width)):
        out += [(f"{label} fwd", tokens, k, n, False, False, bfloat16, layers),
                (f"{label} dx", tokens, n, k, False, True, bfloat16, layers),
                (f"{label} dw", k, tokens, n, True, False, numpy.float32, layers)]
    return out + [("head fwd", tokens, width, vocab, False, True, bfloat16, 1),
                  ("head dx", tokens, vocab, width, False, False, bfloat16, 1),
                  ("head dw", vocab, tokens, width, True, False, numpy.float32, 1)]


def candidate_times(m, k, n, a_t, b_t, out_dtype):
    """Seconds of each of the heuristic's candidates for this product (inf: refused)."""
    a = xp.random.standard_normal((k, m) if a_t else (m, k), dtype=xp.float32).astype(bfloat16)
    b = xp.random.standard_normal((n, k) if b_t else (k, n), dtype=xp.float32).astype(bfloat16)
    a, b = (a.T if a_t else a), (b.T if b_t else b)
    plan = gemm.product(a, b, out_dtype).lt
    out = xp.empty((m, n), dtype=out_dtype)

    def run(index):
        plan.use(index)
        plan.run(b.data.ptr, a.data.ptr, out.data.ptr)
    return gemm_choice.timed_from_memory(
        lambda timer: gemm_choice.timings(run, len(plan.candidates), timer))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["124M", "774M", "1558M", "llama-1.5B"],
                        choices=sorted(MODELS))
    args = parser.parse_args()
    os.environ["CUPYTP_GEMM_TUNE"] = "1"          # the heuristic's whole list of candidates
    if not backend.on_gpu:
        raise SystemExit("bench/gemm_algorithms.py times cuBLASLt's algorithms: it needs a GPU")
    for name in args.models:
        first_total = best_total = 0.0
        for label, m, k, n, a_t, b_t, out_dtype, count in products(*MODELS[name]):
            times = candidate_times(m, k, n, a_t, b_t, out_dtype)
            first, best = times[0], min(times)
            first_total, best_total = first_total + count * first, best_total + count * best
            print(f"{name} {label:9s} ({m}x{k})@({k}x{n}) x{count}: first {first * 1e6:7.1f} us, "
                  f"fastest {best * 1e6:7.1f} us (#{times.index(best)} of {len(times)}) "
                  f"{first / best:.3f}x", flush=True)
        print(f"TOTAL {name}: first {first_total * 1e3:.2f} ms, fastest {best_total * 1e3:.2f} ms "
              f"a step ({first_total / best_total:.3f}x)", flush=True)


if __name__ == "__main__":
    main()
