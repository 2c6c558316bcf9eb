"""Host cost of an eager training step, per framework op:  python bench/host_overhead.py

Runs eager steps of GPT-2 (forward, backward, clipping, AdamW, zero_grad) on one rank and prints
one RESULT line: framework ops per step (DTensors made by ops, forward and backward), host time
per step and per op, the split of a step into forward, backward and optimizer, and the cyclic
garbage collector's collections and time per step (`--gc` sets its policy for the timed steps).
Then a cProfile of a few steps: the functions with the most time of their own, and the most
cumulative.

Default shapes keep the device work negligible, so what is timed is Python:
- CPU: GPT-2 124M's 12 layers at width 64 (one head of 64, so bf16 attention takes the flash
  path as on a GPU), a 64-token vocabulary, B=1, T=8;
- GPU: GPT-2 124M itself, B=2, T=64 (the tiny step of docs/benchmarks.md).
Host time is the median over steps of the wall time of issuing one (on a GPU the device is
synchronized only around the timed loop, whose mean wall time per step is printed too); the CPU
time of the process per step is printed beside it, steadier on a busy machine.
"""
import argparse
import cProfile
import gc
import io
import os
import pstats
import time

for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, "1")       # tiny NumPy math: threads only add noise

import numpy  # noqa: E402

import cupytp  # noqa: E402
from cupytp import backend, ops  # noqa: E402
from cupytp.models.gpt2 import GPT2, preset  # noqa: E402
from cupytp.optim import AdamW, clip_grad_norm_, decay_groups  # noqa: E402
from cupytp.tensor import DTensor, Replicated, from_local  # noqa: E402

CPU_SHAPES = {"n_embd": 64, "n_head": 1, "vocab_size": 64}


class GarbageCollections:
    """Collections of the cyclic garbage collector and their time, by generation, while on."""

    def __init__(self):
        self.counts, self.seconds, self.on, self._start = [0, 0, 0], [0.0, 0.0, 0.0], False, 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase, info):
        if not self.on:
            return
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.counts[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._start


class OpCounter:
    """Counts DTensors made by ops (every op's output goes through DTensor._make)."""

    def __init__(self):
        self.count = 0
        self._make = DTensor.__dict__["_make"]

    def __enter__(self):
        make = self._make.__func__

        def counted(cls, local, layout):
            self.count += 1
            return make(cls, local, layout)
        DTensor._make = classmethod(counted)
        return self

    def __exit__(self, *exc):
        DTensor._make = self._make


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="124M")
    p.add_argument("--layers", type=int, default=None, help="override n_layer")
    p.add_argument("--embd", type=int, default=None, help="override n_embd")
    p.add_argument("--heads", type=int, default=None, help="override n_head")
    p.add_argument("--vocab", type=int, default=None, help="override vocab_size")
    p.add_argument("--B", type=int, default=None, help="batch (CPU 1, GPU 2)")
    p.add_argument("--T", type=int, default=None, help="sequence length (CPU 8, GPU 64)")
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--top", type=int, default=25, help="functions listed per table")
    p.add_argument("--gc", default="auto", choices=["auto", "freeze", "off"],
                   help="the garbage collector in the timed steps: Python's default, after "
                        "gc.freeze() (the objects made before them never scanned again), or off")
    args = p.parse_args()

    cupytp.init()
    mesh = cupytp.DeviceMesh((1,), ("tp",))
    overrides = {} if backend.on_gpu else dict(CPU_SHAPES)
    overrides.update({k: v for k, v in (("n_layer", args.layers), ("n_embd", args.embd),
                                        ("n_head", args.heads), ("vocab_size", args.vocab))
                      if v is not None})
    config = preset(args.model, **overrides)
    B = args.B or (2 if backend.on_gpu else 1)
    T = args.T or (64 if backend.on_gpu else 8)
    cupytp.manual_seed(0)
    model = GPT2(config, mesh)
    optimizer = AdamW(decay_groups(model.named_parameters(), 0.1), lr=1e-4)
    ids = numpy.random.default_rng(0).integers(0, config.vocab_size, size=(B, T + 1))
    x, y = (from_local(backend.asarray(a), mesh, (Replicated(),), shape=(B, T))
            for a in (ids[:, :-1], ids[:, 1:]))
    phases = []     # per step: (forward, backward, optimizer) seconds of host time
    cpu = []        # per step: CPU seconds of this process

    def step():
        start, cpu_start = time.perf_counter(), time.process_time()
        with ops.autocast(None if args.dtype == "fp32" else args.dtype):
            _, loss = model(x, y)
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        phases.append((forward - start, backward - forward, time.perf_counter() - backward))
        cpu.append(time.process_time() - cpu_start)
        return loss

    for _ in range(args.warmup):
        step()
    with OpCounter() as counter:
        step()
    ops_per_step = counter.count
    phases.clear()
    cpu.clear()
    if args.gc == "freeze":
        gc.freeze()
    elif args.gc == "off":
        gc.disable()
    collector = GarbageCollections()
    backend.synchronize()
    collector.on = True
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    backend.synchronize()
    collector.on = False
    gc.enable()
    wall_ms = 1e3 * (time.perf_counter() - start) / args.steps
    median = 1e3 * numpy.median(numpy.array(phases), axis=0)      # ms: robust to a busy host
    host_ms = float(numpy.median(1e3 * numpy.array(phases).sum(axis=1)))
    cpu_ms = float(numpy.median(1e3 * numpy.array(cpu)))
    split = " ".join(f"{name}_ms={t:.2f}" for name, t in
                     zip(("forward", "backward", "optimizer"), median))
    print(f"RESULT host_overhead device={backend.device_name} dtype={args.dtype} "
          f"L={config.n_layer} C={config.n_embd} H={config.n_head} V={config.vocab_size} "
          f"B={B} T={T} ops_per_step={ops_per_step} host_ms={host_ms:.2f} "
          f"us_per_op={1e3 * host_ms / ops_per_step:.1f} cpu_ms={cpu_ms:.2f} "
          f"cpu_us_per_op={1e3 * cpu_ms / ops_per_step:.1f} wall_ms={wall_ms:.2f} {split} "
          f"gc={args.gc} gc_ms={1e3 * sum(collector.seconds) / args.steps:.2f} "
          f"gc_per_step={'/'.join(f'{n / args.steps:.2f}' for n in collector.counts)} "
          f"loss={loss.item()!r}", flush=True)

    if args.profile_steps:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.profile_steps):
            step()
        profiler.disable()
        backend.synchronize()
        for order in ("tottime", "cumulative"):
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(args.top)
            body = text.getvalue()
            print(f"---- cProfile of {args.profile_steps} steps, by {order} ----")
            print(body[body.index("   ncalls"):].rstrip())


if __name__ == "__main__":
    main()
