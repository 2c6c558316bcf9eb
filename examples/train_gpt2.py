"""Train GPT-2 with tensor (and data) parallelism:  mpiexec -n N python examples/train_gpt2.py

With no arguments: tiny Shakespeare (shipped with cupytp), a byte-level tokenizer, the tiny
model on CPU or GPT-2 124M on GPU. `--tp` ranks split every layer; the remaining ranks
(world / tp) split the batch. Logs (CSV, JSON lines, loss.png) go to --out.
"""
import argparse
import contextlib
import glob
import math
import os
import signal
import sys
import tempfile
import time

os.environ.setdefault("CUPY_TF32", "1")     # fp32 matmuls on tensor cores (before CuPy loads)

import numpy  # noqa: E402

import cupytp  # noqa: E402
from cupytp import backend, checkpoint  # noqa: E402
from cupytp.autograd import no_grad  # noqa: E402
from cupytp.data import (DataError, TokenLoader, default_corpus_path,  # noqa: E402
                         get_tokenizer, prepare_corpus, read_tokens)
from cupytp.distributed import all_gather_object, broadcast_object  # noqa: E402
from cupytp.models.gpt2 import GPT2, preset  # noqa: E402
from cupytp.ops import autocast  # noqa: E402
from cupytp.optim import (AdamW, GradScaler, clip_grad_norm_, constant, cosine_with_warmup,  # noqa: E402
                          decay_groups, linear)
from cupytp.parallel import DataParallelModule, fully_shard, replicate  # noqa: E402
from cupytp.tensor import Replicated, Shard, default_generator, from_local  # noqa: E402
from cupytp.train_log import TrainLog, estimate_mfu, plot_loss  # noqa: E402

PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}
LOG_RANKS = os.environ.get("CUPYTP_LOG_RANKS", "0") not in ("", "0")


class RankZeroParser(argparse.ArgumentParser):
    """Usage errors print once (rank 0), not once per rank."""

    def error(self, message):
        if cupytp.init().rank == 0:
            self.print_usage(sys.stderr)
            print(f"{self.prog}: error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)


def number(kind, low, strict=False):
    """An argparse type: a finite `kind` (int or float) >= `low` (> `low` when `strict`)."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        if not math.isfinite(value) or value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(
                f"{text} is not a{'n integer' if kind is int else ' finite number'} "
                f"{'>' if strict else '>='} {low}")
        return value
    return parse


POSITIVE_INT, COUNT, POSITIVE, NON_NEGATIVE = (number(int, 0, True), number(int, 0),
                                               number(float, 0, True), number(float, 0))


def parse_args(argv):
    p = RankZeroParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="tiny, 124M, 350M, 774M, 1558M "
                   "(default: tiny on CPU, 124M on GPU)")
    p.add_argument("--tp", type=POSITIVE_INT, default=1, help="tensor-parallel ranks")
    p.add_argument("--dp", type=POSITIVE_INT, default=None,
                   help="data-parallel ranks (default world/tp)")
    p.add_argument("--fsdp", action="store_true", help="shard parameters, gradients and "
                   "optimizer states over the data-parallel ranks instead of replicating them")
    p.add_argument("--data", default=None, help="a text file, or a directory of llm.c .bin "
                   "shards (*train*.bin, *val*.bin); default: tiny Shakespeare")
    p.add_argument("--tokenizer", default="byte", choices=["byte", "bpe", "tiktoken"])
    p.add_argument("--batch-size", type=POSITIVE_INT, default=None,
                   help="sequences per data-parallel rank")
    p.add_argument("--seq-len", type=POSITIVE_INT, default=None)
    p.add_argument("--steps", type=POSITIVE_INT, default=None)
    p.add_argument("--grad-accum", type=POSITIVE_INT, default=1)
    p.add_argument("--lr", type=POSITIVE, default=None)
    p.add_argument("--min-lr-frac", type=NON_NEGATIVE, default=0.1)
    p.add_argument("--warmup", type=COUNT, default=None)
    p.add_argument("--schedule", default="cosine", choices=["cosine", "linear", "constant"])
    p.add_argument("--weight-decay", type=NON_NEGATIVE, default=0.1)
    p.add_argument("--grad-clip", type=NON_NEGATIVE, default=1.0, help="0: no clipping")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="bf16/fp16: matmuls in that dtype, fp32 master weights and loss; fp16 "
                        "with dynamic loss scaling")
    p.add_argument("--eval-interval", type=POSITIVE_INT, default=100)
    p.add_argument("--eval-batches", type=POSITIVE_INT, default=10)
    p.add_argument("--log-interval", type=POSITIVE_INT, default=10)
    p.add_argument("--sample-tokens", type=COUNT, default=200)
    p.add_argument("--init-from", default=None, help="a Hugging Face GPT-2 checkpoint to start "
                   "from (model.safetensors or its directory)")
    p.add_argument("--checkpoint", default=None, help="directory to save the trained model to")
    p.add_argument("--checkpoint-dir", default=None, help="directory of sharded training "
                   "checkpoints (model, optimizer, RNG, data position), saved every "
                   "--checkpoint-interval steps, at the end and on Ctrl-C")
    p.add_argument("--checkpoint-interval", type=int, default=0,
                   help="steps between checkpoints (0: only at the end and on Ctrl-C)")
    p.add_argument("--keep-last", type=int, default=None,
                   help="keep only this many checkpoints (the highest steps)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --checkpoint-dir")
    p.add_argument("--out", default="out/train_gpt2")
    p.add_argument("--seed", type=COUNT, default=1337)
    p.add_argument("--peak-tflops", type=POSITIVE, default=None,
                   help="for MFU (default: by GPU)")
    p.add_argument("--no-cuda-graph", action="store_true", help="on GPU, run each step eagerly "
                   "instead of replaying it as one captured CUDA graph")
    p.add_argument("--recompute", action="store_true", help="keep only each block's input for "
                   "backward and run the block again there: less memory, about a third more "
                   "compute")
    args = p.parse_args(argv)
    if not args.checkpoint_dir and (args.resume or args.checkpoint_interval or args.keep_last):
        p.error("--resume, --checkpoint-interval and --keep-last need --checkpoint-dir")
    if args.checkpoint_interval < 0 or (args.keep_last is not None and args.keep_last < 1):
        p.error("--checkpoint-interval must be >= 0 and --keep-last >= 1")
    if args.min_lr_frac > 1:
        p.error(f"argument --min-lr-frac: {args.min_lr_frac} is more than 1")
    gpu = backend.on_gpu
    defaults = {"model": "124M" if gpu else "tiny", "batch_size": 8 if gpu else 16,
                "seq_len": 1024 if gpu else 128, "steps": 300 if gpu else 400,
                "lr": 6e-4 if gpu else 1e-3, "warmup": 30}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def fail(message):
    """One clear line from rank 0 and a non-zero exit on every rank (all ranks see the same
    bad input, before any collective)."""
    if cupytp.distributed.get_rank() == 0:
        print(f"train_gpt2: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def make_mesh(args, world, heads):
    """The (dp, tp) mesh; sizes that cannot work are an error that suggests ones that do."""
    fits = " or ".join(f"--tp {tp}" for tp in range(1, world + 1)
                       if world % tp == 0 and heads % tp == 0)
    if heads % args.tp:
        raise ValueError(f"--tp {args.tp} does not divide the model's {heads} attention heads: "
                         f"with {world} ranks use {fits}")
    if args.dp is None and world % args.tp:
        raise ValueError(f"--tp {args.tp} does not divide the {world} launched ranks: use "
                         f"{fits}, or launch a multiple of {args.tp} ranks")
    dp = args.dp or world // args.tp
    if args.tp * dp != world:
        raise ValueError(f"--tp {args.tp} × --dp {dp} is {args.tp * dp} ranks, but {world} were "
                         f"launched: run mpiexec -n {args.tp * dp}, or leave --dp out")
    return cupytp.DeviceMesh((dp, args.tp), ("dp", "tp"))


def check_writable(path):
    """Fail before training when the --checkpoint directory cannot be written (rank 0, which
    writes it, tries; every rank gets the verdict)."""
    error = None
    if cupytp.distributed.get_rank() == 0:
        try:
            os.makedirs(path, exist_ok=True)
            with tempfile.TemporaryFile(dir=path):
                pass
        except OSError as err:
            error = f"--checkpoint {path} is not a writable directory: {err.strerror or err}"
    error = broadcast_object(error)
    if error:
        raise ValueError(error)


def load_data(args, tokenizer, rank):
    """(train tokens, val tokens): .bin shards from a directory, or a text file tokenized once
    (by rank 0; the others wait)."""
    if args.data and os.path.isdir(args.data):
        train = sorted(glob.glob(os.path.join(args.data, "*train*.bin")))
        val = sorted(glob.glob(os.path.join(args.data, "*val*.bin")))
        if not train or not val:
            raise DataError(f"{args.data} holds no *train*.bin and *val*.bin token files")
        return (numpy.concatenate([read_tokens(f) for f in train]),
                numpy.concatenate([read_tokens(f) for f in val]))
    text = args.data or default_corpus_path()
    if not os.path.isfile(text):
        raise DataError(f"data file {text} does not exist")
    paths, error = None, None
    if rank == 0:
        try:
            paths = prepare_corpus(text, os.path.join(args.out, "data"), tokenizer)
        except DataError as err:       # every rank must fail with it, not wait for rank 0
            error = str(err)
    paths, error = broadcast_object((paths, error))
    if error:
        raise DataError(error)
    return read_tokens(paths[0]), read_tokens(paths[1])


def batch_tensor(array, mesh):
    """A (B·dp, T) DTensor: this rank's rows Shard(0) over dp, Replicated over tp."""
    dp = mesh.shape[0]
    return from_local(backend.asarray(array), mesh, (Shard(0), Replicated()),
                      shape=(array.shape[0] * dp, array.shape[1]))


def evaluate(model, loader, mesh, batches, micro):
    """The mean loss over `batches` global batches, each taken in pieces of `micro` rows per
    rank as training takes them (the same sequences and mean for any split of the batch)."""
    model.eval()
    losses = []
    with no_grad():
        for x, y in loader.val_batches(batches):
            for rows in range(0, len(x), micro):
                _, loss = model(batch_tensor(x[rows:rows + micro], mesh),
                                batch_tensor(y[rows:rows + micro], mesh))
                losses.append(loss.item())
    model.train()
    return float(numpy.mean(losses))


def memory_gib():
    """(current, peak) GiB of this rank: the framework's device pool (GPU) or the process's
    resident memory (CPU)."""
    if backend.on_gpu:
        stats = cupytp.memory_stats()
        return stats["reserved_bytes"] / 2 ** 30, stats["reserved_bytes_peak"] / 2 ** 30
    import resource
    with open("/proc/self/statm") as f:
        current = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return current / 2 ** 30, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def say(rank, text):
    """A progress line: from rank 0, or from every rank with its rank first (CUPYTP_LOG_RANKS)."""
    if LOG_RANKS or rank == 0:
        from tqdm import tqdm
        line = f"[rank {rank}] {text}" if LOG_RANKS else text
        tqdm.write(line + "\n", file=sys.stdout, end="")   # one write: ranks' lines never mix
        sys.stdout.flush()


class CtrlC:
    """Ctrl-C takes effect when the running step ends (a second one at once), so it never lands
    inside the framework's bookkeeping; several ranks stop at the same step, agreeing through a
    small host all-gather (at every step when checkpointing, else at logged steps)."""

    def __init__(self):
        self.pressed = False
        self.default_handler = signal.signal(signal.SIGINT, self._press)

    def _press(self, signum, frame):
        self.pressed = True
        signal.signal(signal.SIGINT, self.default_handler)

    def agreed(self, ask_every_rank):
        """Whether every rank stops now (a collective with several ranks, when asked)."""
        if cupytp.distributed.get_world_size() == 1:
            return self.pressed
        return ask_every_rank and any(all_gather_object(self.pressed))

    def close(self):
        signal.signal(signal.SIGINT, self.default_handler)


class Checkpoints:
    """--checkpoint-dir: a checkpoint every --checkpoint-interval steps, at the end, and on
    Ctrl-C (then every rank saves and raises KeyboardInterrupt)."""

    def __init__(self, args, model, optimizer, loader, scaler):
        self.args, self.model, self.optimizer, self.loader = args, model, optimizer, loader
        self.scaler = scaler
        self.saved_step = None

    def resume(self):
        """Load the latest checkpoint (model, optimizer, RNG, data position); its step."""
        extra = checkpoint.load(self.args.checkpoint_dir, self.model, self.optimizer)
        if extra["step"] >= self.args.steps:
            raise ValueError(f"{self.args.checkpoint_dir} is at step {extra['step']} of "
                             f"--steps {self.args.steps}: nothing is left to train")
        default_generator.set_state(extra["rng"])
        self.loader.load_state_dict(extra["data"])
        if extra.get("loss_scale"):
            self.scaler.load_state_dict(extra["loss_scale"])
        self.saved_step = extra["step"]
        return extra["step"]

    def after_step(self, done, stop):
        """`done` steps are complete: save at the interval, or on Ctrl-C (`stop`) save and
        stop."""
        interval = self.args.checkpoint_interval
        if stop or (interval and done % interval == 0):
            self.save(done)
        if stop:
            raise KeyboardInterrupt

    def save(self, done):
        if done == self.saved_step:
            return
        extra = {"rng": list(default_generator.get_state()), "data": self.loader.state_dict(),
                 "loss_scale": self.scaler.state_dict()}
        path = checkpoint.save(self.args.checkpoint_dir, done, self.model, self.optimizer,
                               extra=extra, keep_last=self.args.keep_last)
        self.saved_step = done
        if cupytp.distributed.get_rank() == 0:
            from tqdm import tqdm
            tqdm.write(f"saved checkpoint {path}", file=sys.stdout)


def make_train_step(model, optimizer, scaler, args):
    """One optimizer step over a list of (x, y) micro-batches: forward and backward of each
    (gradients accumulate), clipping, AdamW (through the loss scaler in fp16: a step with a
    non-finite gradient is skipped on the device). On GPU it is captured as one CUDA graph and
    replayed (unless --no-cuda-graph). Returns the loss of the whole batch (the mean of the
    micro-batches' losses, each a mean over as many tokens) and the gradient norm."""
    parallel = isinstance(model, DataParallelModule)

    def train_step(batches):
        mean = None
        for i, (x, y) in enumerate(batches):
            last = i == len(batches) - 1
            with contextlib.nullcontext() if last or not parallel else model.no_sync():
                with autocast(None if args.dtype == "fp32" else args.dtype):
                    _, loss = model(x, y)
                loss = loss * (1.0 / len(batches))
                scaler.scale(loss).backward()
            with no_grad():
                mean = loss if mean is None else mean + loss
        scaler.unscale_(optimizer)
        norm = clip_grad_norm_(model.parameters(), args.grad_clip) if args.grad_clip else None
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()   # the next forward pass reuses the gradients' memory
        return mean, norm
    return train_step if args.no_cuda_graph else cupytp.cuda_graph(train_step)


def train(args):
    info = cupytp.init()
    mesh = make_mesh(args, info.world_size, preset(args.model).n_head)
    if args.checkpoint:
        check_writable(args.checkpoint)
    dp_rank, dp = mesh.get_local_rank("dp"), mesh.shape[0]
    text_for_bpe = None
    if args.tokenizer == "bpe":
        with open(args.data or default_corpus_path(), encoding="utf-8") as f:
            text_for_bpe = f.read()
    tokenizer = get_tokenizer(args.tokenizer, corpus_text=text_for_bpe)
    config = preset(args.model, vocab_size=tokenizer.vocab_size)
    if args.seq_len > config.block_size:
        raise ValueError(f"--seq-len {args.seq_len} is longer than the model's context "
                         f"({config.block_size})")
    train_tokens, val_tokens = load_data(args, tokenizer, info.rank)
    loader = TokenLoader(train_tokens, args.batch_size, args.seq_len, dp_rank, dp, args.seed)
    val_loader = TokenLoader(val_tokens, args.batch_size * args.grad_accum, args.seq_len,
                             dp_rank, dp, args.seed)     # whole batches, whatever the split

    cupytp.manual_seed(args.seed)
    if args.init_from:
        model = GPT2.from_pretrained(args.init_from, mesh)
    else:
        with cupytp.deferred_init():        # each rank allocates only its blocks
            model = GPT2(config, mesh)
    model.transformer.recompute = args.recompute
    if args.fsdp:
        fully_shard(model, mesh, param_dtype=args.dtype)
    elif dp > 1:
        replicate(model, mesh)
    cupytp.materialize(model)
    if isinstance(model, DataParallelModule):
        say(info.rank, model.dp_summary())
    optimizer = AdamW(decay_groups(model.named_parameters(), args.weight_decay), lr=args.lr,
                      betas=(0.9, 0.95), eps=1e-8)
    scaler = GradScaler(enabled=args.dtype == "fp16")
    lr_at = lr_schedule(args)
    ctrl_c = CtrlC()
    checkpoints = Checkpoints(args, model, optimizer, loader, scaler) \
        if args.checkpoint_dir else None
    start = checkpoints.resume() if args.resume else 0
    tokens_per_step = args.batch_size * dp * args.seq_len * args.grad_accum
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items()
                                     if backend.on_gpu and k in gpu_name()), None)
    log = TrainLog(args.out) if info.rank == 0 else None
    # a bar only for one process on a terminal; piped, redirected or under mpiexec (Open MPI
    # hands ranks a pseudo-terminal, but forwards a bar's carriage returns only in part, and
    # not at all from a job that aborts): one plain line per log step
    progress = _progress(args.steps) if info.world_size == 1 and not LOG_RANKS and \
        sys.stdout.isatty() else None
    say(info.rank, f"GPT-2 {args.model}: {model.num_parameters() / 1e6:.2f}M parameters, "
        f"vocab {tokenizer.vocab_size} (padded {model.vocab}), mesh dp={dp} tp={args.tp}, "
        f"{backend.device_name}, {tokens_per_step} tokens/step")
    train_step = make_train_step(model, optimizer, scaler, args)
    first_loss, logged_step, step = None, start - 1, start
    nonfinite = backend.xp.full((), -1, dtype=numpy.int64)   # first step of a non-finite loss
    if progress is not None:
        progress.update(start)
    clock = time.perf_counter()
    try:
        for step in range(start, args.steps):
            val = None
            if step % args.eval_interval == 0:       # before the step's update, as its loss
                began = time.perf_counter()
                val = evaluate(model, val_loader, mesh, args.eval_batches, args.batch_size)
                clock += time.perf_counter() - began
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step)
            batches = [tuple(batch_tensor(a, mesh) for a in loader.next_batch())
                       for _ in range(args.grad_accum)]
            loss, norm = train_step(batches)
            nonfinite = first_nonfinite(nonfinite, loss, step)
            logged = step % args.log_interval == 0 or val is not None or step == args.steps - 1
            if logged:
                value = loss.item()           # the one host sync, at log steps only
                check_finite(nonfinite, value, step, args)
                first_loss = value if first_loss is None else first_loss
                elapsed = time.perf_counter() - clock
                steps_done, logged_step = step - logged_step, step
                tokens_per_s = tokens_per_step * steps_done / elapsed
                clock = time.perf_counter()
                mfu = estimate_mfu(config.flops_per_token(args.seq_len),
                                   tokens_per_s / info.world_size, peak * 1e12) if peak else None
                memory = all_gather_object(memory_gib())
                row = {"loss": value, "val_loss": val, "lr": lr_at(step),
                       "tokens_per_s": tokens_per_s, "mfu": mfu,
                       "mem_gib": max(p for _, p in memory)}
                if info.rank == 0:
                    log.log(step, **row)
                text = _postfix(row, norm, memory[info.rank:info.rank + 1] if LOG_RANKS
                                else memory)   # norm: read at log steps only
                if progress is not None:
                    progress.set_postfix_str(text)
                    progress.update(steps_done)
                else:
                    say(info.rank, f"step {step}/{args.steps}: {text}")
            if checkpoints is not None:
                checkpoints.after_step(step + 1, ctrl_c.agreed(True))
            elif ctrl_c.agreed(logged):
                raise KeyboardInterrupt
        step = args.steps
        val = evaluate(model, val_loader, mesh, args.eval_batches, args.batch_size)   # trained
    except KeyboardInterrupt:
        interrupted(step, args.out, progress, info.rank)
    finally:
        ctrl_c.close()
        if progress is not None:
            progress.close()
    if checkpoints is not None:
        checkpoints.save(args.steps)
    if info.rank == 0:
        log.log(args.steps, val_loss=val)
        plot_loss(args.out)
    say(info.rank, f"first loss {first_loss:.4f} (ln vocab = "
        f"{numpy.log(tokenizer.vocab_size):.4f}), final train loss {value:.4f}, final val loss "
        f"{val:.4f}")
    if args.sample_tokens:
        prompt = numpy.array([tokenizer.encode("\n")])
        sample = model.generate(prompt, args.sample_tokens, temperature=0.8, top_k=40,
                                seed=args.seed)
        if info.rank == 0:
            print("--- sample ---\n" + tokenizer.decode(sample[0].tolist()) + "\n---", flush=True)
    if args.checkpoint:
        model.save_pretrained(args.checkpoint)
        if info.rank == 0:
            print(f"saved {args.checkpoint}", flush=True)


def first_nonfinite(first, loss, step):
    """`first` (a device scalar, -1 while every loss was finite) updated with `step`'s loss,
    without a host synchronization."""
    xp = backend.xp
    return xp.where((first < 0) & ~xp.isfinite(loss.full_tensor()), step, first)


def check_finite(first, value, step, args):
    """At a log step: stop with one line when a loss has not been finite (the same verdict on
    every rank: the loss is Replicated)."""
    first = int(first)
    if first < 0 and math.isfinite(value):
        return
    raise ValueError(f"the training loss is not finite from step {first if first >= 0 else step}"
                     f" on ({value} at step {step}): lower --lr (now {args.lr:g}) or "
                     "--grad-clip, or check the data")


def interrupted(step, out, progress, rank):
    """Ctrl-C: one line, loss.png drawn from what was logged, exit status 130."""
    if progress is not None:
        progress.close()
    if rank == 0:
        if os.path.isfile(os.path.join(out, "log.jsonl")):
            plot_loss(out)
        print(f"interrupted at step {step}; logs in {out}", file=sys.stderr, flush=True)
    sys.exit(130)


def lr_schedule(args):
    """The learning rate at each step, by --schedule."""
    warmup = min(args.warmup, args.steps)
    if args.schedule == "constant":
        return lambda step: constant(step, args.lr, warmup)
    decay = cosine_with_warmup if args.schedule == "cosine" else linear
    return lambda step: decay(step, args.lr, warmup, args.steps, args.lr * args.min_lr_frac)


def gpu_name():
    return backend.xp.cuda.runtime.getDeviceProperties(0)["name"].decode()


def _progress(total):
    from tqdm import tqdm
    # drawn at every logged step (updates come only then), however fast the steps run
    return tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stdout, mininterval=0,
                miniters=1)


def _postfix(row, norm, memory):
    parts = [f"loss {row['loss']:.3f}"]
    if norm is not None:
        parts.append(f"|g| {float(norm):.2f}")
    if row["val_loss"] is not None:
        parts.append(f"val {row['val_loss']:.3f}")
    parts.append(f"{row['tokens_per_s'] / 1e3:.1f}k tok/s")
    if row["mfu"] is not None:
        parts.append(f"MFU {100 * row['mfu']:.1f}%")
    ranks = [f"{now:.2f}/{peak:.2f}" for now, peak in memory]
    if len(ranks) > 1:
        ranks = [f"r{rank} {text}" for rank, text in enumerate(ranks)]
    parts.append(f"mem (now/peak GiB) {', '.join(ranks)}")
    return ", ".join(parts)


def main(argv=None):
    args = parse_args(argv)
    numpy.seterr(all="ignore")      # a non-finite loss is reported once, by check_finite
    try:
        train(args)
    except (ValueError, KeyError, FileNotFoundError, DataError) as err:
        fail(err)


if __name__ == "__main__":
    main()
