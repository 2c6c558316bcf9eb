"""Training-step throughput of GPT-2 on random tokens (no data pipeline), tensor-parallel over
the launched ranks:  mpiexec -n N python bench/train_gpt2.py --model 124M --tp N
(the other ranks data-parallel: replicated, gradients all-reduced in buckets of --bucket-mib;
--fsdp: fully sharded, parameters gathered in --dtype; the model built deferred and
materialized in its final layout, whose construction peak is printed as init_peak_GiB).

Times full steps (forward, backward, clipping, AdamW) after warm-up, with the device synchronized
around the timed region; on GPU the step is one captured CUDA graph (--no-cuda-graph: eager).
Prints one RESULT line: tokens/s, ms/step, device time of one step (CUDA events), host time to
issue a step, peak memory of the framework's pool per GPU over the whole run (warm-up and
capture included, as the anchors' peaks are), allocated and reserved, and MFU. With --eval it
then times the evaluation forward (the model in eval mode, no tape, captured like the step
unless --no-cuda-graph) on the same batches and prints an EVAL line: ms per forward, its ratio
to the training step, and the pool's allocated and reserved peaks over the evaluation. With
--profile it instead synchronizes around every module call, the loss and each phase, and prints
where a step's time goes (inclusive per module type).

The small GPT that small-data users train (nanoGPT's Shakespeare character model):
    python bench/train_gpt2.py --dtype bf16 --layers 6 --embd 384 --heads 6 --vocab 65 \
        --B 64 --T 256 --dropout 0.2 --bias 0
"""
import argparse
import collections
import os
import sys
import time
from typing import NamedTuple

os.environ.setdefault("CUPY_TF32", "1")     # fp32 matmuls on tensor cores, as the anchors do

import numpy  # noqa: E402

import cupytp  # noqa: E402
from cupytp import backend, memory, nn, ops  # noqa: E402
from cupytp.launchers import cudnn_attention  # noqa: E402
from cupytp.models.gpt2 import GPT2, preset  # noqa: E402
from cupytp.optim import AdamW, GradScaler, clip_grad_norm_, decay_groups  # noqa: E402
from cupytp.parallel import DataParallelModule, fully_shard, replicate  # noqa: E402
from cupytp.tensor import Replicated, Shard, from_local  # noqa: E402
from step_timing import BF16_PEAK_FLOPS, device_time_ms, time_steps  # noqa: E402


class Profile:
    """Synchronized wall time per name, and for the outermost calls (the phases of a step) the
    pool's peak and final allocated bytes, every step's (a no-op unless enabled)."""

    def __init__(self, enabled):
        self.enabled = enabled
        self.totals = collections.defaultdict(float)
        self.memory = collections.defaultdict(list)  # phase -> [(peak, allocated at end)]
        self.depth = 0

    def __call__(self, name, fn, *args, **kwargs):
        if not self.enabled:
            return fn(*args, **kwargs)
        backend.synchronize()
        if self.depth == 0:
            memory.reset_peak_memory_stats()
        self.depth += 1
        start = time.perf_counter()
        try:
            out = fn(*args, **kwargs)
        finally:
            self.depth -= 1
        backend.synchronize()
        self.totals[name] += time.perf_counter() - start
        if self.depth == 0:
            stats = memory.memory_stats()
            self.memory[name].append((stats["allocated_bytes_peak"], stats["allocated_bytes"]))
        return out

    def start(self):
        """After the warm-up: forget its times and time every module call from now on."""
        if self.enabled:
            self.totals.clear()
            self.watch_modules()

    def print_totals(self, steps, tp):
        """Each module's time per step (ms, inclusive of what it calls)."""
        print(f"per step, tp={tp}, device synchronized around each entry (ms, inclusive):")
        for name, total in sorted(self.totals.items(), key=lambda kv: -kv[1]):
            print(f"  {name:24} {1e3 * total / steps:8.1f}")

    def watch_modules(self):
        call = nn.Module.__call__
        nn.Module.__call__ = lambda module, *a, **k: self(type(module).__name__, call, module,
                                                         *a, **k)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="124M")
    p.add_argument("--layers", type=int, default=None, help="override the preset's n_layer")
    p.add_argument("--embd", type=int, default=None, help="override n_embd")
    p.add_argument("--heads", type=int, default=None, help="override n_head")
    p.add_argument("--vocab", type=int, default=None, help="override vocab_size")
    p.add_argument("--dropout", type=float, default=None, help="override the dropout (0.0)")
    p.add_argument("--bias", type=int, default=None, choices=[0, 1],
                   help="0: no biases in the linear layers and LayerNorms")
    p.add_argument("--eval", action="store_true", help="also time the evaluation forward")
    p.add_argument("--untied", action="store_true", help="an LM head of its own (as the "
                   "FSDP anchor's model)")
    step_arguments(p, batch=8, length=1024, dtype="fp32", grad_clip=1.0)
    args = p.parse_args()
    info, mesh, tp, dp = parallel_setup(args)
    overrides = {k: v for k, v in (("n_layer", args.layers), ("n_embd", args.embd),
                                   ("n_head", args.heads), ("vocab_size", args.vocab),
                                   ("dropout", args.dropout),
                                   ("bias", None if args.bias is None else bool(args.bias)))
                 if v is not None}
    config = preset(args.model, tie_word_embeddings=not args.untied, **overrides)
    with cupytp.deferred_init():
        model = GPT2(config, mesh, recompute=args.recompute)
    data_parallel(model, mesh, args)
    cupytp.materialize(model)
    if info.rank == 0 and isinstance(model, DataParallelModule):
        print(model.dp_summary())
    optimizer, profile, eager, batches, timing = timed_training(model, mesh, config.vocab_size,
                                                                args, 4)
    loss, stats = timing.loss, timing.stats
    evaluation = time_evaluation(model, args, eager, batches) if args.eval else None
    if info.rank != 0:
        return
    if args.profile:
        profile.print_totals(args.steps, tp)
        print("pool memory per phase (GiB): peak in the first step, the last, any; allocated "
              "at the end of the last")
        for name, steps in profile.memory.items():
            peaks = [peak / 2 ** 30 for peak, _ in steps]
            print(f"  {name:20} {peaks[0]:8.2f} {peaks[-1]:8.2f} {max(peaks):8.2f} "
                  f"{steps[-1][1] / 2 ** 30:8.2f}")
        if backend.on_gpu:
            print_resident(model, optimizer, stats["allocated_bytes"])
        return
    tokens_per_s = args.B * dp * args.T / timing.step_s
    mfu = config.flops_per_token(args.T) * tokens_per_s / info.world_size / BF16_PEAK_FLOPS
    print(f"RESULT cupytp {args.label or args.model} graph={int(not eager)} dtype={args.dtype} "
          f"tp={tp} dp={dp} fsdp={int(args.fsdp)} params={model.num_parameters() / 1e6:.0f}M "
          f"L={config.n_layer} C={config.n_embd} B={args.B} T={args.T} "
          f"tok/s={tokens_per_s:.0f} {timing.fields()} "
          f"mfu={100 * mfu:.1f}% loss={loss.item():.3f}", flush=True)
    if evaluation is not None:
        eval_ms, eval_device_ms, eval_stats, eval_loss = evaluation
        print(f"EVAL cupytp {args.label or args.model} graph={int(not eager)} "
              f"dtype={args.dtype} tp={tp} dp={dp} B={args.B} T={args.T} "
              f"eval_ms={eval_ms:.2f} eval_device_ms={eval_device_ms:.2f} "
              f"train_step_ms={1e3 * timing.step_s:.2f} "
              f"eval/step={eval_ms / (1e3 * timing.step_s):.3f} "
              f"peak_alloc_GiB={eval_stats['allocated_bytes_peak'] / 2 ** 30:.2f} "
              f"peak_reserved_GiB={eval_stats['reserved_bytes_peak'] / 2 ** 30:.2f} "
              f"loss={eval_loss:.3f}", flush=True)


def step_arguments(p, batch, length, dtype, grad_clip):
    """The arguments of both training benchmarks (this one and train_llama.py): the mesh, the
    batch, the steps timed, the dtype, data parallelism, clipping, capture, recomputation,
    profiling and the label; `batch`, `length`, `dtype` and `grad_clip` their defaults."""
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks (default all)")
    p.add_argument("--B", type=int, default=batch)
    p.add_argument("--T", type=int, default=length)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dtype", default=dtype, choices=["fp32", "bf16", "fp16"],
                   help="fp16: with dynamic loss scaling")
    p.add_argument("--fsdp", action="store_true", help="fully shard over the dp ranks")
    p.add_argument("--bucket-mib", type=float, default=25.0,
                   help="replicated data parallelism: the all-reduce bucket size")
    p.add_argument("--grad-clip", type=float, default=grad_clip,
                   help="0: no clipping (as the anchors)")
    p.add_argument("--no-cuda-graph", action="store_true", help="run every step eagerly")
    p.add_argument("--recompute", action="store_true", help="recompute each block's activations "
                   "in backward (less memory)")
    p.add_argument("--profile", action="store_true", help="eager, synchronized per module")
    p.add_argument("--label", default="", help="a name for this run in the RESULT line")


def parallel_setup(args):
    """(info, mesh, tp, dp): the ranks started, the attention backend said, the (dp, tp) mesh
    of --tp (default every rank), the seed set."""
    info = cupytp.init()
    if args.profile and backend.on_gpu:
        memory.record_origins()     # to say what stays allocated between steps
    if info.rank == 0:
        print(cudnn_attention.describe())
    tp = args.tp or info.world_size
    dp = info.world_size // tp
    mesh = cupytp.DeviceMesh((dp, tp), ("dp", "tp"))
    cupytp.manual_seed(0)
    return info, mesh, tp, dp


def data_parallel(model, mesh, args):
    """The model fully sharded over dp with --fsdp, else replicated there (gradients summed in
    buckets of --bucket-mib) when dp > 1."""
    if args.fsdp:
        fully_shard(model, mesh, param_dtype=args.dtype)
    elif mesh.size("dp") > 1:
        replicate(model, mesh, bucket_bytes=int(args.bucket_mib * 2 ** 20))


class TimedRun(NamedTuple):
    optimizer: object
    profile: Profile
    eager: bool
    batches: list
    timing: object


def timed_training(model, mesh, vocab_size, args, count):
    """AdamW over `model`, its training step (eager with --no-cuda-graph or --profile) timed
    over `count` random batches cycled: a TimedRun."""
    optimizer = AdamW(decay_groups(model.parameters(), 0.1), lr=1e-4)
    profile = Profile(args.profile)
    eager = args.no_cuda_graph or args.profile
    step = training_step(model, optimizer, args, profile, eager)
    batches = random_batches(mesh, vocab_size, args, count)
    timing = time_steps(step, batches, args.warmup, args.steps, profile.start)
    return TimedRun(optimizer, profile, eager, batches, timing)


def random_batches(mesh, vocab_size, args, count):
    """`count` (inputs, targets) pairs of random token ids (B·dp, T), sharded on "dp"."""
    rng = numpy.random.default_rng(mesh.get_local_rank("dp"))
    dp = mesh.size("dp")

    def make(a):
        return from_local(backend.asarray(a), mesh, (Shard(0), Replicated()),
                          shape=(args.B * dp, args.T))
    batches = []
    for _ in range(count):
        ids = rng.integers(0, vocab_size, size=(args.B, args.T + 1))
        batches.append((make(ids[:, :-1]), make(ids[:, 1:])))
    return batches


def training_step(model, optimizer, args, profile, eager):
    """One training step (forward in autocast, backward through the loss scaler in fp16,
    clipping with --grad-clip, the optimizer), captured as a CUDA graph unless `eager`."""
    scaler = GradScaler(enabled=args.dtype == "fp16")

    def train_step(x, y):
        with ops.autocast(None if args.dtype == "fp32" else args.dtype):
            _, loss = profile("forward", model, x, y)
        profile("backward", scaler.scale(loss).backward)
        scaler.unscale_(optimizer)
        if args.grad_clip:
            profile("clip_grad_norm_", clip_grad_norm_, model.parameters(), args.grad_clip)
        profile("optimizer", scaler.step, optimizer)
        scaler.update()
        optimizer.zero_grad()   # the next forward pass reuses the gradients' memory
        return loss
    return train_step if eager else cupytp.cuda_graph(train_step)


def time_evaluation(model, args, eager, batches):
    """(ms per evaluation forward, its device ms, the pool's stats over the evaluation, the last
    loss): the model in eval mode under no_grad and autocast, captured as one CUDA graph unless
    `eager`, timed like the steps (after args.warmup calls)."""
    def loss_of(x, y):
        with cupytp.no_grad(), ops.autocast(None if args.dtype == "fp32" else args.dtype):
            return model(x, y)[1]
    forward = loss_of if eager else cupytp.cuda_graph(loss_of)
    model.eval()
    memory.reset_peak_memory_stats()
    for i in range(max(args.warmup, 2)):            # the warm-up call and the capture
        forward(*batches[i % len(batches)])
    backend.synchronize()
    cupytp.distributed.barrier()
    start = time.perf_counter()
    for i in range(args.steps):
        loss = forward(*batches[i % len(batches)])
    backend.synchronize()
    elapsed = time.perf_counter() - start
    device_ms = device_time_ms(forward, batches[0])
    model.train()
    return 1e3 * elapsed / args.steps, device_ms, memory.memory_stats(), loss.item()


def print_resident(model, optimizer, allocated):
    """What stays allocated between steps: parameters, optimizer states, and the rest by the
    place that allocated it."""
    params = sum(p.to_local().nbytes for p in model.parameters())
    states = sum(t.to_local().nbytes for state in optimizer.state.values()
                 for t in state.values() if hasattr(t, "to_local"))
    print(f"between steps: {allocated / 2 ** 30:.2f} GiB allocated = parameters "
          f"{params / 2 ** 30:.2f} + optimizer states {states / 2 ** 30:.2f} + other "
          f"{(allocated - params - states) / 2 ** 30:.2f}; live blocks by origin:")
    for size, count, where in memory.live_by_origin():
        print(f"  {size / 2 ** 20:10.1f} MiB {count:5}x  {where}")


if __name__ == "__main__":
    main()
