"""Long sequences: peak memory and tokens/s of a training step of GPT-2 or a Llama-family model
against the sequence length, with the sequence split over cp ranks (context parallelism, ring
attention) and tp ranks (with or without sequence parallelism), and the activation memory per
token.

    mpiexec -n 1 python bench/long_context.py --T 4096,8192,16384,32768,65536,131072
    mpiexec -n 2 python bench/long_context.py --cp 2 --T 4096,...,131072
    mpiexec -n 2 python bench/long_context.py --tp 2 [--sequence-parallel] --T ...
    python bench/long_context.py --recompute --T 16384,32768 --anchor .carry/anchors
    python bench/long_context.py --model llama-1B --recompute --T 16384,32768 --anchor ...

`--model` takes the registry's names (`cupytp.models.MODEL_NAMES`: gpt2-124M, llama-1B, ...; a
GPT-2 preset's bare name is GPT-2's). The model is built the same way for both families:
deferred, laid out by the tensor-parallel plan, its attention a ring over cp
(`ContextParallel`, the sequence and its positions sharded in the ring's order), replicated over
the batch's dimensions, then each rank's blocks made. The mesh is (dp, cp, tp) over the launched
ranks. One RESULT line per length: tokens/s and step time (eager steps, forward, backward and
AdamW, device synchronized around the timed steps), the pool's peaks (allocated and reserved),
what lives between steps (parameters, gradients, optimizer states), and activation memory per
token: the allocated peak above that, divided by this rank's tokens. A length that runs out of
memory prints OOM and the next one runs; `--memory-limit` caps what each rank's pool may
reserve, so that cp=1 and cp=2 (or two GPUs of different sizes) find their longest length under
the same memory. The model's context (GPT-2's block_size, a Llama's max_position_embeddings) is
each length, so GPT-2's position table grows with it, as in the PyTorch anchor of the same
shape.

`--anchor DIR` (one rank): first, before any memory of ours is held, runs the PyTorch model of the
same shape at each length (PyTorch eager, SDPA flash attention, no recomputation: it has none):
DIR/torch_tp_gpt2.py for GPT-2, DIR/torch_llama.py for a Llama (bf16 only; its rotary angles are
unscaled, which changes no shape, time or memory). It prints the anchor's line, a PEAK line
comparing both peaks where both ran, and, with two lengths or more, both models' activation memory
per token as the slope of peak memory against the length (what grows with T: activations, and
GPT-2's position table, the same in both). An anchor that fails or runs past --anchor-timeout
prints "none (why)".

Under `bench/kernel_profile.py` the kernels count from the first length's timed steps on: profile
one length a run (`--T 98304 --steps 1`, `--per 1`).
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
from cupytp.models import model_spec
from cupytp.optim import AdamW
from cupytp.parallel import ContextParallel, apply_tensor_parallel, fully_shard, replicate
from cupytp.tensor import Replicated, Shard, from_local

GIB = 2 ** 30
CONTEXT_FIELD = {"gpt2": "block_size", "llama": "max_position_embeddings"}   # per family


def lengths(text):
    """'16384,32768' gives [16384, 32768]."""
    try:
        found = [int(t) for t in text.split(",")]
    except ValueError:
        found = []
    if not found or min(found) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of positive "
                                         "sequence lengths (e.g. 16384,32768)")
    return found


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="124M", help="a registry name (cupytp.models.MODEL_NAMES: "
                   "gpt2-124M, llama-1B, ...) or a GPT-2 preset's bare name")
    p.add_argument("--T", type=lengths, default="4096,8192,16384,32768,65536,131072",
                   help="sequence lengths, comma-separated")
    p.add_argument("--B", type=int, default=1, help="sequences per data-parallel rank")
    p.add_argument("--cp", type=int, default=1, help="context-parallel ranks (ring attention)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="tensor parallelism with the activations sharded on the sequence")
    p.add_argument("--no-load-balance", action="store_true", help="contiguous chunks over cp")
    p.add_argument("--recompute", action="store_true", help="recompute each block in backward")
    p.add_argument("--fsdp", action="store_true",
                   help="parameters, gradients and optimizer states sharded over cp (over dp "
                   "without cp), as torchtitan shards them over its dp×cp ranks; replicated "
                   "over the other batch dimension")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--memory-limit", type=float, default=None, metavar="GIB",
                   help="GiB the pool may reserve on each rank (cupytp.set_memory_limit): runs "
                   "at cp=1 and cp=2, or on different GPUs, compared at the same memory")
    p.add_argument("--anchor", default=None,
                   help="folder of torch_tp_gpt2.py and torch_llama.py (one rank)")
    p.add_argument("--anchor-timeout", type=float, default=600,
                   help="seconds one anchor run may take")
    args = p.parse_args()
    try:
        args.spec = model_spec(args.model)
    except ValueError as error:
        p.error(f"argument --model: {error}")
    if args.memory_limit is not None and args.memory_limit <= 0:
        p.error(f"argument --memory-limit: {args.memory_limit} GiB is not a positive size")
    if args.anchor is not None:
        try:
            script = anchor_command(args.spec, args.anchor, args.B, 1, args.dtype)[1]
        except ValueError as error:
            p.error(f"argument --anchor: {error}")
        if not os.path.isfile(script):
            p.error(f"argument --anchor: {args.anchor} has no {os.path.basename(script)}")
    return args


def step_once(model, optimizer, ids, targets, positions, dtype):
    with ops.autocast(None if dtype == "fp32" else dtype):
        _, loss = model(ids, targets, positions=positions)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def build(args, mesh, length):
    """(model, ContextParallel or None, vocabulary size): the model of --model whose context is
    `length`, built deferred, tensor-parallel over "tp", its attention a ring over "cp",
    replicated over the batch's dimensions, then materialized."""
    spec = model_spec(args.model, **{CONTEXT_FIELD[args.spec.family]: length})
    cupytp.manual_seed(0)
    with cupytp.deferred_init():            # each rank allocates only its blocks
        model = spec.build(mesh, recompute=args.recompute)
    if args.sequence_parallel:
        apply_tensor_parallel(model, mesh, sequence_parallel=True)
    context = None
    if args.cp > 1:
        context = ContextParallel(mesh, load_balance=not args.no_load_balance)
        context.apply(model)
    summed = tuple(d for d in ("dp", "cp") if mesh.size(d) > 1)    # gradients summed there
    if args.fsdp:
        shard = "cp" if "cp" in summed else "dp"
        fully_shard(model, mesh, dim=shard,
                    replicate_dim=tuple(d for d in summed if d != shard) or None)
    elif summed:
        replicate(model, mesh, dim=summed)
    cupytp.materialize(model)
    return model, context, spec.config.vocab_size


def measure(args, mesh, length):
    """(tokens/s, ms per step, peak allocated GiB, peak reserved GiB, state GiB, activation bytes
    per token of this rank) for one length."""
    model, context, vocab_size = build(args, mesh, length)
    optimizer = AdamW(model.parameters(), lr=1e-4)
    rng = numpy.random.default_rng(mesh.get_local_rank("dp"))
    dp = mesh.size("dp")
    tokens = rng.integers(0, vocab_size, size=(args.B, length + 1))
    placements = (Shard(0), Replicated(), Replicated())
    ids, targets = (from_local(backend.asarray(a), mesh, placements, shape=(args.B * dp, length))
                    for a in (tokens[:, :-1], tokens[:, 1:]))
    positions = None
    if context is not None:
        ids, targets, positions = context.shard(ids), context.shard(targets), \
            context.positions(length)
    for _ in range(args.warmup):            # the optimizer's states are made here
        step_once(model, optimizer, ids, targets, positions, args.dtype)
    profiler = sys.modules.get("kernel_profile")   # bench/kernel_profile.py runs the script
    if profiler is not None:
        profiler.mark()                             # count the timed steps, not the warm-up
    backend.synchronize()
    state = memory.memory_stats()["allocated_bytes"]
    memory.reset_peak_memory_stats()
    cupytp.distributed.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step_once(model, optimizer, ids, targets, positions, args.dtype)
    backend.synchronize()
    elapsed = (time.perf_counter() - start) / args.steps
    stats = memory.memory_stats()
    peak, reserved = stats["allocated_bytes_peak"], stats["reserved_bytes_peak"]
    loss.item()
    local_tokens = args.B * length / (args.cp * (args.tp if args.sequence_parallel else 1))
    return (args.B * dp * length / elapsed, 1e3 * elapsed, peak / GIB, reserved / GIB,
            state / GIB, (peak - state) / local_tokens)


def anchor_command(spec, folder, batch, length, dtype):
    """The command line of the PyTorch model of `spec`'s shape on `batch` sequences of `length`
    tokens (3 timed steps), or ValueError where the anchor cannot take that model."""
    c = spec.config
    if spec.family == "gpt2":
        if not c.tie_word_embeddings:
            raise ValueError(f"torch_tp_gpt2.py ties its head; {spec.name} does not")
        script, shape = "torch_tp_gpt2.py", dict(
            layers=c.n_layer, embd=c.n_embd, heads=c.n_head, vocab=c.padded_vocab(),
            bias=int(c.bias), dtype=dtype, sdpa=1)
    else:
        if dtype != "bf16":
            raise ValueError("torch_llama.py trains in bf16 only: leave --dtype bf16")
        if c.head_size * c.num_attention_heads != c.hidden_size or c.attention_bias:
            raise ValueError(f"torch_llama.py has no attention biases and a head size of "
                             f"dim / heads; {spec.name} differs")
        script, shape = "torch_llama.py", {
            "layers": c.num_hidden_layers, "dim": c.hidden_size,
            "heads": c.num_attention_heads, "kv-heads": c.num_key_value_heads,
            "ffn": c.intermediate_size, "vocab": c.vocab_size,
            "tied": int(c.tie_word_embeddings), "theta": c.rope_theta}
    options = dict(shape, B=batch, T=length, steps=3)
    return [sys.executable, os.path.join(folder, script)] + \
        [word for name, value in options.items() for word in (f"--{name}", str(value))]


def anchor(args, length):
    """The PyTorch anchor's line at this length, or the reason there is none."""
    command = anchor_command(args.spec, args.anchor, args.B, length, args.dtype)
    try:
        done = subprocess.run(command, capture_output=True, text=True,
                              timeout=args.anchor_timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {args.anchor_timeout:g} s"
    line = next((l for l in done.stdout.splitlines() if l.startswith("ANCHOR")), None)
    if line is None:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return None, tail[0][:200]
    return line, None


def print_slope(name, peaks):
    """Activation memory per token of one model: its peak's growth per token between the
    shortest and the longest length that ran (needs two)."""
    known = sorted(peaks)
    if len(known) >= 2:
        slope = (peaks[known[-1]] - peaks[known[0]]) / (known[-1] - known[0])
        print(f"SLOPE {name} T={known[0]}..{known[-1]} "
              f"act_KiB_per_token={slope / 1024:.1f} (peak growth per token)", flush=True)


def main():
    args = parse()
    info = cupytp.init()
    dp = info.world_size // (args.cp * args.tp)
    if dp * args.cp * args.tp != info.world_size:
        raise SystemExit(f"cp {args.cp} x tp {args.tp} does not divide the {info.world_size} "
                         "ranks launched")
    if args.sequence_parallel and args.tp == 1:
        raise SystemExit("--sequence-parallel needs --tp 2 or more")
    if args.anchor is not None and info.world_size > 1:
        raise SystemExit("--anchor runs the one-GPU PyTorch model: launch one rank")
    mesh = cupytp.DeviceMesh((dp, args.cp, args.tp), ("dp", "cp", "tp"))
    if args.memory_limit is not None:
        cupytp.set_memory_limit(int(args.memory_limit * GIB))
    if info.rank == 0:
        print(cudnn_attention.describe(), flush=True)
    # the anchors first, while this process holds no memory beyond its context (run after the
    # measurements, the pool's cached blocks and libraries' workspaces shrank their GPU)
    anchors = {length: anchor(args, length) for length in args.T} if args.anchor else {}
    ours = {}
    for length in args.T:
        try:
            tok_s, ms, peak, reserved, state, per_token = measure(args, mesh, length)
            line = (f"tok/s={tok_s:.0f} step_ms={ms:.1f} peak_alloc_GiB={peak:.2f} "
                    f"peak_reserved_GiB={reserved:.2f} state_GiB={state:.2f} "
                    f"act_KiB_per_token={per_token / 1024:.1f}")
            ours[length] = peak * GIB
        except (memory.OutOfMemoryError, MemoryError) as error:
            line = f"OOM ({str(error).splitlines()[0][:120]})"
        memory.empty_cache()
        if info.rank == 0:
            print(f"RESULT cupytp long-context {args.model} dtype={args.dtype} dp={dp} "
                  f"cp={args.cp} tp={args.tp} sp={int(args.sequence_parallel)} "
                  f"recompute={int(args.recompute)} fsdp={int(args.fsdp)} B={args.B} T={length} "
                  f"{line}", flush=True)
    if info.rank != 0:
        return
    print_slope("cupytp", ours)             # before the anchors: a cut-off run keeps it
    if args.anchor is None:
        return
    theirs = {}
    for length in args.T:
        line, why = anchors[length]
        print(line if line else f"ANCHOR torch T={length}: none ({why})", flush=True)
        if line:
            theirs[length] = float(re.search(r"peak_mem_GiB=([\d.]+)", line).group(1)) * GIB
        if length in ours and length in theirs:
            ratio = f"{ours[length] / theirs[length]:.2f}" if theirs[length] else "n/a"
            print(f"PEAK {args.model} T={length} cupytp_GiB={ours[length] / GIB:.2f} "
                  f"torch_GiB={theirs[length] / GIB:.2f} ratio={ratio} (cupytp / torch)",
                  flush=True)
    print_slope("torch", theirs)


if __name__ == "__main__":
    main()
