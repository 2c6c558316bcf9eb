"""Flash attention on one GPU: correctness against the NumPy twin and an fp32 reference, then
forward and forward+backward times beside PyTorch's SDPA (flash backend) in the same process.

    python3 bench/attention.py [--reps 30] [--skip-check] [--stress N] [--loop N]

Times the flash RawKernel (with dropout also keeping its bits for the backward, `ours-kept`),
cupytp's cuDNN path (where the cuDNN frontend imports) and PyTorch.
Prints first the registers per thread and spilled (local) bytes of each flash kernel.

Checks: random bf16/fp16 inputs as strided views of one (B, T, 3, H, D) array (as GPT-2 builds
them), outputs poisoned with NaN before each launch, tails (T not a multiple of 64), head dims 64
and 128, causal and not, dropout. Times: median of CUDA-event timings after warm-up. Prints a
table last: ms, TFLOP/s (causal counts half the score matrix; backward = 2.5 x forward) and the
ratio torch time / ours. `--loop N`: the flash RawKernel and cuDNN at small to GPT-2 shapes, each
timed as an eager step meets it: N forward-and-backward pairs issued back to back, the device
synchronized only at the end (host cost where the device is idle, device time where it is not).
"""
import argparse
import sys
import time
from pathlib import Path

import numpy

from cupytp.backend import asnumpy, bfloat16, xp
from cupytp.launchers import cudnn_attention
from cupytp.launchers import flash_attention
from cupytp.launchers.flash_attention import (
    AttentionDropout, attention_backward, attention_backward_numpy, attention_forward,
    attention_forward_numpy)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "unit"))
from test_flash_attention import strided_qkv as inputs  # noqa: E402  (B, H, T, D) views of qkv
from test_kernels import poisoned_allocations as poisoned  # noqa: E402  outputs start as NaN

F16 = numpy.dtype(numpy.float16)


def rel(got, want):
    got, want = asnumpy(got).astype(numpy.float64), asnumpy(want).astype(numpy.float64)
    if not numpy.isfinite(got).all():
        return float("nan")
    return float(numpy.linalg.norm(got - want) / max(numpy.linalg.norm(want), 1e-30))


def torch_reference(host, g, causal):
    """fp32 o, lse, dq, dk, dv by explicit masked softmax in PyTorch (float32 math)."""
    import torch
    q, k, v = (torch.tensor(a.astype(numpy.float32), device="cuda", requires_grad=True)
               for a in host)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        t, s = scores.shape[-2:]
        visible = torch.ones(t, s, dtype=torch.bool, device="cuda").tril(s - t)
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    o = torch.softmax(scores, -1) @ v
    o.backward(torch.tensor(g.astype(numpy.float32), device="cuda"))
    return [x.detach().cpu().numpy() for x in (o, lse, q.grad, k.grad, v.grad)]


CHECKS = [  # b, h, t, d, causal, dropout p, dtype, grouped draws with the kept bits stored
    (2, 3, 257, 64, True, 0.0, bfloat16, False), (1, 4, 1000, 64, False, 0.0, bfloat16, False),
    (2, 2, 333, 128, True, 0.0, bfloat16, False), (1, 3, 130, 128, False, 0.0, F16, False),
    (1, 2, 64, 64, True, 0.0, F16, False), (2, 2, 200, 64, True, 0.1, bfloat16, False),
    (1, 2, 150, 128, False, 0.2, bfloat16, False), (4, 12, 1024, 64, True, 0.0, bfloat16, False),
    (2, 2, 200, 64, True, 0.1, bfloat16, True), (1, 2, 320, 128, False, 0.2, bfloat16, True),
]


def check():
    rows, worst = [], 0.0
    for case_id, (b, h, t, d, causal, p, dtype, kept) in enumerate(CHECKS):
        host, device = inputs(b, h, t, d, dtype, seed=case_id)
        g = numpy.random.default_rng(100 + case_id).standard_normal((b, h, t, d)).astype(dtype)
        dropout = None
        if p:
            # counters from a multiple of 8 (base + add) and S a multiple of 8: the grouped
            # draws, eight keys a Philox call, whose bits the forward can store; else one a score
            base = xp.full((), 3, dtype=xp.uint64)
            mask = flash_attention.kept_bits(device[0], device[1]) if kept else None
            dropout = AttentionDropout(p, 1234 + case_id, base, 5 if kept else 2 ** 32 - 5,
                                       h + 1, 0, 1, mask=mask)
        scale = d ** -0.5
        with poisoned():
            o, lse = attention_forward(*device, causal, scale, dropout)
            grads = attention_backward(*device, o, lse, xp.asarray(g), causal, scale, dropout)
        ours = [o, lse, *grads]
        twin_o, twin_lse = attention_forward_numpy(*host, causal, scale, dropout)
        twin = [twin_o, twin_lse, *attention_backward_numpy(*host, asnumpy(o), asnumpy(lse), g,
                                                            causal, scale, dropout)]
        errors = [rel(a, b_) for a, b_ in zip(ours, twin)]
        ref = torch_reference(host, g, causal) if not p else None
        ref_errors = [rel(a, b_) for a, b_ in zip(ours, ref)] if ref else [float("nan")] * 5
        name = f"B{b} H{h} T{t} D{d} {'causal' if causal else 'full'} p={p} {dtype}" + \
            (" grouped, kept bits" if kept else "")
        rows.append((name, errors, ref_errors))
        if not p and cudnn_attention.applies(device[0], device[1], 0.0):
            with poisoned():
                o_c, lse_c = cudnn_attention.attention_forward(*device, causal, scale)
                grads_c = cudnn_attention.attention_backward(*device, o_c, lse_c, xp.asarray(g),
                                                             causal, scale)
            cudnn_errors = [rel(a, b_) for a, b_ in zip([o_c, lse_c, *grads_c], ref)]
            rows.append(("  cuDNN path", cudnn_errors, cudnn_errors))
        worst = max(worst, *(e if e == e else 1.0 for e in errors))
    print("\ncorrectness: relative L2 error of o, lse, dq, dk, dv (vs twin | vs fp32 reference)")
    for name, errors, ref_errors in rows:
        print(f"  {name:42s} twin " + " ".join(f"{e:.1e}" for e in errors) +
              " | fp32 " + " ".join(f"{e:.1e}" for e in ref_errors))
    print(f"worst error vs twin: {worst:.2e} -> {'PASS' if worst < 2e-2 else 'FAIL'}")
    return worst < 2e-2


def stress(n):
    """Race hunt. (1) The backward of one small causal case n times, given o and lse uploaded
    from the twin or the kernel's own: count wrong gradients. (2) dk and dv (no atomics: they
    must be bit-identical run to run) of larger cases, n runs each."""
    b, h, t, d = 1, 2, 100, 64
    host, device = inputs(b, h, t, d, bfloat16, seed=t + d)
    g = numpy.random.default_rng(9).standard_normal((b, h, t, d)).astype(bfloat16)
    o_twin, lse_twin = attention_forward_numpy(*host, True, d ** -0.5)
    want = attention_backward_numpy(*host, o_twin, lse_twin, g, True, d ** -0.5)
    counts = {"uploaded o, lse: wrong grads": 0, "upload differs": 0, "own o, lse: wrong grads": 0}
    for _ in range(n):
        with poisoned():
            o, lse = attention_forward(*device, True, d ** -0.5)
            o_up, lse_up = xp.asarray(o_twin), xp.asarray(lse_twin)
            counts["upload differs"] += int(not (asnumpy(o_up) == o_twin).all())
            for key, (o_, lse_) in (("uploaded o, lse: wrong grads", (o_up, lse_up)),
                                    ("own o, lse: wrong grads", (o, lse))):
                grads = attention_backward(*device, o_, lse_, xp.asarray(g), True, d ** -0.5)
                counts[key] += int(any(rel(a, w) > 2e-2 for a, w in zip(grads, want)))
    print(f"stress, {n} runs of B{b} H{h} T{t} D{d} causal: {counts}")
    for b, h, t, d in ((4, 12, 1024, 64), (2, 2, 333, 128)):
        _, device = inputs(b, h, t, d, bfloat16, seed=1)
        g = xp.asarray(numpy.random.default_rng(2).standard_normal((b, h, t, d)).astype(bfloat16))
        o, lse = attention_forward(*device, True, d ** -0.5)
        first = [asnumpy(a) for a in attention_backward(*device, o, lse, g, True, d ** -0.5)]
        differ = 0
        for _ in range(n):
            again = attention_backward(*device, o, lse, g, True, d ** -0.5)
            differ += int(any((asnumpy(a) != f).any() for a, f in zip(again[1:], first[1:])))
        print(f"stress, B{b} H{h} T{t} D{d} causal: dk or dv differs from the first run in "
              f"{differ} of {n} runs")


def median_ms(fn, reps, event_module):
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = event_module.Event(), event_module.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(event_module.elapsed(start, end))
    return float(numpy.median(times))


class CupyEvents:
    @staticmethod
    def Event():
        return xp.cuda.Event()

    @staticmethod
    def elapsed(start, end):
        return xp.cuda.get_elapsed_time(start, end)


class TorchEvents:
    @staticmethod
    def Event():
        import torch
        return torch.cuda.Event(enable_timing=True)

    @staticmethod
    def elapsed(start, end):
        return start.elapsed_time(end)


def time_ours(b, h, t, d, causal, p, reps, kind):
    _, (q, k, v) = inputs(b, h, t, d, bfloat16, seed=7)
    g = xp.asarray(numpy.random.default_rng(8).standard_normal((b, h, t, d)).astype(bfloat16))
    mask = flash_attention.kept_bits(q, k) if kind == "flash-kept" else None
    dropout = AttentionDropout(p, 99, xp.zeros((), xp.uint64), 0, h, mask=mask) if p else None
    scale = d ** -0.5
    kernels = cudnn_attention if kind == "cudnn" else flash_attention
    forward = lambda: kernels.attention_forward(q, k, v, causal, scale, dropout)

    def both():
        o, lse = forward()
        kernels.attention_backward(q, k, v, o, lse, g, causal, scale, dropout)
    return median_ms(forward, reps, CupyEvents), median_ms(both, reps, CupyEvents)


def time_torch(b, h, t, d, causal, p, reps, backend_name):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    chosen = getattr(SDPBackend, backend_name)
    qkv = torch.randn(b, t, 3, h, d, device="cuda", dtype=torch.bfloat16)
    q, k, v = (qkv[:, :, i].transpose(1, 2).detach().requires_grad_() for i in range(3))
    g = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16)
    fn = torch.nn.functional.scaled_dot_product_attention

    def forward():
        with sdpa_kernel(chosen):
            return fn(q, k, v, is_causal=causal, dropout_p=p)

    def both():
        forward().backward(g)
    return median_ms(forward, reps, TorchEvents), median_ms(both, reps, TorchEvents)


BENCH = [  # b, h, t, d, causal, p
    (8, 12, 1024, 64, True, 0.0), (8, 12, 1024, 64, False, 0.0), (8, 12, 1024, 64, True, 0.1),
    (4, 16, 2048, 128, True, 0.0), (2, 16, 4096, 64, True, 0.0),
    (64, 6, 256, 64, True, 0.0), (64, 6, 256, 64, True, 0.2),   # the small GPT's attention
]


def bench(reps):
    rows = []
    for b, h, t, d, causal, p in BENCH:
        flops = 4 * b * h * t * t * d * (0.5 if causal else 1.0)
        results = {"ours": time_ours(b, h, t, d, causal, p, reps, "flash")}
        if p:       # the backward reading the forward's kept bits instead of drawing them
            results["ours-kept"] = time_ours(b, h, t, d, causal, p, reps, "flash-kept")
        if not p and cudnn_attention.applies(xp.empty((1, 1, t, d), bfloat16),
                                             xp.empty((1, 1, t, d), bfloat16), 0.0):
            results["ours-cudnn"] = time_ours(b, h, t, d, causal, p, reps, "cudnn")
        for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION"):
            try:
                results[name] = time_torch(b, h, t, d, causal, p, reps, name)
            except Exception as err:   # a backend that refuses the shape or is missing
                print(f"torch {name} B{b} H{h} T{t} D{d} p={p}: {type(err).__name__}: "
                      f"{str(err)[:120]}")
        rows.append(((b, h, t, d, causal, p), flops, results))
    print("\n| shape (B,H,T,D) | mask | p | impl | fwd ms | fwd TFLOP/s | fwd+bwd ms | "
          "fwd+bwd TFLOP/s | torch flash / ours (fwd, fwd+bwd) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (b, h, t, d, causal, p), flops, results in rows:
        flash = results.get("FLASH_ATTENTION")
        for impl, (fwd, both) in results.items():
            ratio = (f"{flash[0] / fwd:.2f}x, {flash[1] / both:.2f}x"
                     if flash and impl == "ours" else "")
            print(f"| {b},{h},{t},{d} | {'causal' if causal else 'full'} | {p} | {impl} | "
                  f"{fwd:.3f} | {flops / fwd / 1e9:.0f} | {both:.3f} | "
                  f"{3.5 * flops / both / 1e9:.0f} | {ratio} |")


LOOP = [(2, 12, 64, 64), (8, 12, 64, 64), (8, 12, 128, 64), (8, 12, 256, 64),
        (8, 12, 512, 64), (8, 12, 1024, 64), (4, 16, 1024, 128)]   # b, h, t, d (causal, p = 0)


def loop(n):
    """µs per forward-and-backward pair of each kind in a loop of n (module docstring)."""
    kinds = [("flash", flash_attention)]
    if cudnn_attention.choice() != "flash" and cudnn_attention._frontend(False) is not None:
        kinds.append(("cudnn", cudnn_attention))
    print("\n| shape (B,H,T,D) causal | " + " | ".join(f"{k} µs/pair" for k, _ in kinds) + " |")
    print("|---|" + "---|" * len(kinds))
    for b, h, t, d in LOOP:
        _, (q, k, v) = inputs(b, h, t, d, bfloat16, seed=7)
        g = xp.asarray(numpy.random.default_rng(8).standard_normal((b, t, h, d))
                       .astype(bfloat16)).transpose(0, 2, 1, 3)     # o's layout, as in GPT-2
        times = []
        for _, kernels in kinds:
            def pair():
                o, lse = kernels.attention_forward(q, k, v, True, d ** -0.5)
                kernels.attention_backward(q, k, v, o, lse, g, True, d ** -0.5)
            for _ in range(5):
                pair()
            xp.cuda.Device().synchronize()
            start = time.perf_counter()
            for _ in range(n):
                pair()
            xp.cuda.Device().synchronize()
            times.append(1e6 * (time.perf_counter() - start) / n)
        print(f"| {b},{h},{t},{d} | " + " | ".join(f"{u:.1f}" for u in times) + " |")


def registers():
    """Registers per thread and local (spilled) bytes of each flash kernel, as ptxas left them."""
    for d in (64, 128):
        for kind in ("forward", "backward"):
            for variant in ("", "_dropout", "_dropout_at"):
                raw = flash_attention._kernel(kind, d, bfloat16, variant).raw
                print(f"flash_{kind}_d{d}{variant}: {raw.num_regs} registers, "
                      f"{raw.local_size_bytes} local bytes, {raw.max_threads_per_block} threads "
                      f"at most")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--stress", type=int, default=0, help="race hunt: runs per case")
    parser.add_argument("--loop", type=int, default=0, help="pairs per loop-timed shape")
    args = parser.parse_args()
    import torch
    print(f"device: {xp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, "
          f"CuPy {xp.__version__}, torch {torch.__version__}")
    start = time.perf_counter()
    for d in (64, 128):      # compile outside the timings
        host, device = inputs(1, 1, 8, d, bfloat16, 0)
        attention_forward(*device, True, 0.1)
    print(f"compile: {time.perf_counter() - start:.1f} s")
    registers()
    print(cudnn_attention.describe())
    view = numpy.arange(2 * 3 * 5 * 8, dtype=numpy.float32).astype(bfloat16).reshape(2, 3, 5, 8)
    view = view.transpose(0, 2, 1, 3)
    print("xp.asarray keeps a non-contiguous bf16 NumPy view's values:",
          bool((asnumpy(xp.asarray(view)) == view).all()))
    ok = True if args.skip_check else check()
    if args.stress:
        stress(args.stress)
    if args.loop:
        loop(args.loop)
    if args.reps:
        bench(args.reps)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
