"""Long sequences: peak memory and tokens/s of a GPT-2 training step against the sequence length,
with the sequence split over cp ranks (context parallelism, ring attention) and tp ranks (with or
without sequence parallelism), and the activation memory per token.

    mpiexec -n 1 python bench/long_context.py --T 4096,8192,16384,32768,65536,131072
    mpiexec -n 2 python bench/long_context.py --cp 2 --T 4096,...,131072
    mpiexec -n 2 python bench/long_context.py --tp 2 [--sequence-parallel] --T ...
    mpiexec -n 1 python bench/long_context.py --recompute --T 16384,32768 --anchor .carry/anchors

The mesh is (dp, cp, tp) over the launched ranks. One RESULT line per length: tokens/s and step
time (eager steps, forward, backward and AdamW, device synchronized around the timed steps), the
pool's peak, what lives between steps (parameters, gradients, optimizer states), and activation
memory per token: the peak above that, divided by this rank's tokens. A length that runs out of
memory prints OOM and the next one runs. The model's context (block_size) is each length, so
the position table grows with it, as in the PyTorch anchor of the same shape.

`--anchor DIR` (one rank): afterwards runs DIR/torch_tp_gpt2.py (PyTorch eager, SDPA flash
attention, no recomputation: it has none) at each length and prints its peak beside, and, with
two lengths or more, both models' activation memory per token as the slope of peak memory
against the length (what grows with T: activations and the position table, the same in both).
"""
import argparse
import os
import re
import subprocess
import sys
import time

import numpy

import cupytp
from cupytp import backend, memory, ops
from cupytp.launchers import cudnn_attention
from cupytp.models.gpt2 import GPT2, preset
from cupytp.optim import AdamW
from cupytp.parallel import ContextParallel, apply_tensor_parallel, replicate
from cupytp.tensor import Replicated, Shard, from_local

GIB = 2 ** 30


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="124M")
    p.add_argument("--T", default="4096,8192,16384,32768,65536,131072",
                   help="sequence lengths, comma-separated")
    p.add_argument("--B", type=int, default=1, help="sequences per data-parallel rank")
    p.add_argument("--cp", type=int, default=1, help="context-parallel ranks (ring attention)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="tensor parallelism with the activations sharded on the sequence")
    p.add_argument("--no-load-balance", action="store_true", help="contiguous chunks over cp")
    p.add_argument("--recompute", action="store_true", help="recompute each block in backward")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--anchor", default=None, help="folder of torch_tp_gpt2.py (one rank)")
    return p.parse_args()


def step_once(model, optimizer, ids, targets, positions, dtype):
    with ops.autocast(None if dtype == "fp32" else dtype):
        _, loss = model(ids, targets, positions=positions)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def measure(args, mesh, length):
    """(tokens/s, ms per step, peak GiB, state GiB, activation bytes per token of this rank)
    for one length."""
    config = preset(args.model, block_size=length)
    cupytp.manual_seed(0)
    with cupytp.deferred_init():            # each rank allocates only its blocks
        model = GPT2(config, recompute=args.recompute)
    apply_tensor_parallel(model, mesh, sequence_parallel=args.sequence_parallel)
    context = None
    if args.cp > 1:
        context = ContextParallel(mesh, load_balance=not args.no_load_balance)
        context.apply(model)
    summed = tuple(d for d in ("dp", "cp") if mesh.size(d) > 1)    # gradients summed there
    if summed:
        replicate(model, mesh, dim=summed)
    cupytp.materialize(model)
    optimizer = AdamW(model.parameters(), lr=1e-4)
    rng = numpy.random.default_rng(mesh.get_local_rank("dp"))
    dp = mesh.size("dp")
    tokens = rng.integers(0, config.vocab_size, size=(args.B, length + 1))
    placements = (Shard(0), Replicated(), Replicated())
    ids, targets = (from_local(backend.asarray(a), mesh, placements, shape=(args.B * dp, length))
                    for a in (tokens[:, :-1], tokens[:, 1:]))
    positions = None
    if context is not None:
        ids, targets, positions = context.shard(ids), context.shard(targets), \
            context.positions(length)
    for _ in range(args.warmup):            # the optimizer's states are made here
        step_once(model, optimizer, ids, targets, positions, args.dtype)
    backend.synchronize()
    state = memory.memory_stats()["allocated_bytes"]
    memory.reset_peak_memory_stats()
    cupytp.distributed.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step_once(model, optimizer, ids, targets, positions, args.dtype)
    backend.synchronize()
    elapsed = (time.perf_counter() - start) / args.steps
    peak = memory.memory_stats()["allocated_bytes_peak"]
    loss.item()
    local_tokens = args.B * length / (args.cp * (args.tp if args.sequence_parallel else 1))
    return (args.B * dp * length / elapsed, 1e3 * elapsed, peak / GIB, state / GIB,
            (peak - state) / local_tokens)


def anchor(folder, length, dtype):
    """The PyTorch anchor's line at this length (B=1), or the reason there is none."""
    command = [sys.executable, os.path.join(folder, "torch_tp_gpt2.py"), "--dtype", dtype,
               "--B", "1", "--T", str(length), "--steps", "3", "--sdpa", "1"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return None, "timed out"
    line = next((l for l in done.stdout.splitlines() if l.startswith("ANCHOR")), None)
    if line is None:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return None, tail[0][:200]
    return line, None


def main():
    args = parse()
    info = cupytp.init()
    lengths = [int(t) for t in args.T.split(",")]
    dp = info.world_size // (args.cp * args.tp)
    if dp * args.cp * args.tp != info.world_size:
        raise SystemExit(f"cp {args.cp} x tp {args.tp} does not divide the {info.world_size} "
                         "ranks launched")
    if args.sequence_parallel and args.tp == 1:
        raise SystemExit("--sequence-parallel needs --tp 2 or more")
    mesh = cupytp.DeviceMesh((dp, args.cp, args.tp), ("dp", "cp", "tp"))
    if info.rank == 0:
        print(cudnn_attention.describe(), flush=True)
    slopes = {}
    for length in lengths:
        try:
            tok_s, ms, peak, state, per_token = measure(args, mesh, length)
            line = (f"tok/s={tok_s:.0f} step_ms={ms:.1f} peak_alloc_GiB={peak:.2f} "
                    f"state_GiB={state:.2f} act_KiB_per_token={per_token / 1024:.1f}")
            slopes[length] = peak
        except (memory.OutOfMemoryError, MemoryError) as error:
            line = f"OOM ({str(error).splitlines()[0][:120]})"
        memory.empty_cache()
        if info.rank == 0:
            print(f"RESULT cupytp long-context {args.model} dtype={args.dtype} dp={dp} "
                  f"cp={args.cp} tp={args.tp} sp={int(args.sequence_parallel)} "
                  f"recompute={int(args.recompute)} B={args.B} T={length} {line}", flush=True)
    if args.anchor is None or info.rank != 0:
        return
    if info.world_size > 1:
        raise SystemExit("--anchor runs the one-GPU PyTorch model: launch one rank")
    theirs = {}
    for length in lengths:
        line, why = anchor(args.anchor, length, args.dtype)
        print(line if line else f"ANCHOR torch T={length}: none ({why})", flush=True)
        if line:
            theirs[length] = float(re.search(r"peak_mem_GiB=([\d.]+)", line).group(1)) * GIB
    for name, peaks in (("cupytp", slopes), ("torch", theirs)):
        known = sorted(peaks)
        if len(known) >= 2:
            slope = (peaks[known[-1]] - peaks[known[0]]) / (known[-1] - known[0])
            print(f"SLOPE {name} T={known[0]}..{known[-1]} "
                  f"act_KiB_per_token={slope / 1024:.1f} (peak growth per token)", flush=True)


if __name__ == "__main__":
    main()
