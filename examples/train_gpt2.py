"""Train GPT-2 with tensor (and data) parallelism:  mpiexec -n N python examples/train_gpt2.py

With no arguments: tiny Shakespeare (shipped with cupytp), a byte-level tokenizer, the tiny
model on CPU, or on GPU a 10M-parameter model in bf16 (nanoGPT's shakespeare-char recipe).
`--tp` ranks split every layer; the remaining ranks (world / tp) split the batch. Logs (CSV,
JSON lines, loss.png; TensorBoard and W&B on request) go to --out.

The script reads top to bottom: the flags (`parse_args`), the mesh (`make_mesh`), the output
places (`check_outputs`), where a resumed run stands (`resume_point`), the data (`load_data`),
the model (`build_model`), checkpoints (`Checkpoints`), the logs (`open_logs`), the loop
(`train_loop`) and sampling (`sample`); `train` calls them in that order.
"""
import argparse
import contextlib
import math
import os
import signal
import sys
import tempfile
import time

os.environ.setdefault("CUPY_TF32", "1")     # fp32 matmuls on tensor cores (before CuPy loads)

import numpy  # noqa: E402


LAUNCHER_RANKS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")


def rank_zero():
    """Whether this process is rank 0 of the job: the runtime's rank once cupytp.init() ran,
    before that (or when `import cupytp` itself failed) the rank its launcher gave it (MPICH,
    Open MPI, PMIx, Slurm; a process started alone is rank 0)."""
    distributed = sys.modules.get("cupytp.distributed")
    if distributed is not None and distributed.is_initialized():
        return distributed.get_rank() == 0
    return all(os.environ.get(name, "0").strip() in ("", "0") for name in LAUNCHER_RANKS)


def fail(message, status=2):
    """One clear line from rank 0 and a non-zero exit on every rank (all ranks see the same
    bad input, before any collective)."""
    if rank_zero():
        print(f"train_gpt2: error: {message}", file=sys.stderr, flush=True)
    sys.exit(status)


try:
    import cupytp
except (ValueError, RuntimeError) as err:    # a CUPYTP_* value not understood; no usable GPU
    fail(err)
from cupytp import backend, checkpoint, env  # noqa: E402
from cupytp.autograd import no_grad  # noqa: E402
from cupytp.checkpoint import CheckpointError  # noqa: E402
from cupytp.data import (DataError, TokenLoader, default_cache_dir,  # noqa: E402
                         default_corpus_path, get_tokenizer, prepare_corpus, read_token_dir,
                         read_tokens)
from cupytp.distributed import all_gather_object, broadcast_object  # noqa: E402
from cupytp.models.gpt2 import GPT2, preset  # noqa: E402
from cupytp.ops import autocast  # noqa: E402
from cupytp.optim import (AdamW, GradScaler, clip_grad_norm_, constant, cosine_with_warmup,  # noqa: E402
                          decay_groups, linear)
from cupytp.parallel import DataParallelModule, fully_shard, replicate  # noqa: E402
from cupytp.tensor import Replicated, Shard, default_generator, from_local  # noqa: E402
from cupytp.train_log import (MissingPackageError, TensorBoardLog, TrainLog,  # noqa: E402
                              WandbLog, estimate_mfu, plot_loss)

PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}
LOG_RANKS = env.get("CUPYTP_LOG_RANKS")
# What a run does when a flag is left out: on the CPU a ~2-3 minute run on 2 cores; on a GPU
# nanoGPT's shakespeare-char recipe (6 layers, 6 heads, 384 wide, dropout 0.2), in bf16.
DEFAULTS = {
    "cpu": {"model": "tiny", "dtype": "fp32", "batch_size": 16, "seq_len": 128, "steps": 400,
            "lr": 1e-3, "warmup": 30, "dropout": 0.0, "eval_interval": 100},
    "gpu": {"model": "10M", "dtype": "bf16", "batch_size": 64, "seq_len": 256, "steps": 5000,
            "lr": 1e-3, "warmup": 100, "dropout": 0.2, "eval_interval": 250},
}
# the errors of bad input, each one line (anything else is a bug and keeps its traceback)
INPUT_ERRORS = (ValueError, KeyError, FileNotFoundError, DataError, CheckpointError,
                MissingPackageError)


class RankZeroParser(argparse.ArgumentParser):
    """A usage error is one line (the usage of so many flags is a screenful: --help shows it),
    printed once (rank 0), not once per rank."""

    def error(self, message):
        if rank_zero():
            print(f"{self.prog}: error: {message} (--help lists the flags)", file=sys.stderr,
                  flush=True)
        sys.exit(2)


def number(kind, low, strict=False, high=None):
    """An argparse type: a finite `kind` (int or float) >= `low` (> `low` when `strict`), and
    below `high` when given."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        if not math.isfinite(value) or value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(
                f"{text} is not a{'n integer' if kind is int else ' finite number'} "
                f"{'>' if strict else '>='} {low}")
        if high is not None and value >= high:
            raise argparse.ArgumentTypeError(f"{text} is not below {high}")
        return value
    return parse


POSITIVE_INT, COUNT, POSITIVE, NON_NEGATIVE = (number(int, 0, True), number(int, 0),
                                               number(float, 0, True), number(float, 0))
FRACTION = number(float, 0, high=1)


def parse_args(argv):
    p = RankZeroParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="tiny, 10M, 124M, 350M, 774M, 1558M "
                   "(default: tiny on CPU, 10M on GPU)")
    p.add_argument("--tp", type=POSITIVE_INT, default=1, help="tensor-parallel ranks")
    p.add_argument("--dp", type=POSITIVE_INT, default=None,
                   help="data-parallel ranks (default world/tp)")
    p.add_argument("--fsdp", action="store_true", help="shard parameters, gradients and "
                   "optimizer states over the data-parallel ranks instead of replicating them")
    p.add_argument("--data", default=None, help="a text file, or a directory of .bin token "
                   "files: llm.c's shards (*train*.bin, *val*.bin) or nanoGPT's train.bin and "
                   "val.bin (with meta.pkl for a character vocabulary); default: tiny "
                   "Shakespeare")
    p.add_argument("--tokenizer", default=None, choices=["byte", "bpe", "tiktoken"],
                   help="default: byte for a text file; a .bin directory's meta.pkl, else "
                        "tiktoken (GPT-2's ids)")
    p.add_argument("--sampling", default="epoch", choices=["epoch", "random"],
                   help="epoch: every window once per epoch, in shuffled order; random: "
                        "windows at random offsets (nanoGPT's get_batch)")
    p.add_argument("--batch-size", type=POSITIVE_INT, default=None,
                   help="sequences per data-parallel rank (a resumed run keeps the "
                        "checkpoint's global batch when this is left out)")
    p.add_argument("--seq-len", type=POSITIVE_INT, default=None)
    p.add_argument("--steps", type=POSITIVE_INT, default=None)
    p.add_argument("--grad-accum", type=POSITIVE_INT, default=1)
    p.add_argument("--lr", type=POSITIVE, default=None)
    p.add_argument("--min-lr-frac", type=number(float, 0, high=1.0000001), default=0.1,
                   help="the schedule's last learning rate, as a fraction of --lr (0..1)")
    p.add_argument("--warmup", type=COUNT, default=None, help="steps of linear warm-up "
                   "(at most --steps; default 30 on CPU, 100 on GPU, at most a tenth of --steps)")
    p.add_argument("--schedule", default="cosine", choices=["cosine", "linear", "constant"])
    p.add_argument("--weight-decay", type=NON_NEGATIVE, default=0.1)
    p.add_argument("--dropout", type=FRACTION, default=None,
                   help="dropout probability (default 0 on CPU, 0.2 on GPU)")
    p.add_argument("--grad-clip", type=NON_NEGATIVE, default=1.0, help="0: no clipping")
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"],
                   help="bf16/fp16: matmuls in that dtype, fp32 master weights and loss; fp16 "
                        "with dynamic loss scaling (default: fp32 on CPU, bf16 on GPU)")
    p.add_argument("--eval-interval", type=POSITIVE_INT, default=None)
    p.add_argument("--eval-batches", type=POSITIVE_INT, default=10)
    p.add_argument("--log-interval", type=POSITIVE_INT, default=10)
    p.add_argument("--sample-tokens", type=COUNT, default=200)
    p.add_argument("--init-from", default=None, help="a Hugging Face GPT-2 checkpoint to start "
                   "from (model.safetensors or its directory)")
    p.add_argument("--checkpoint", default=None, help="directory to save the trained model to")
    p.add_argument("--checkpoint-dir", default=None, help="directory of sharded training "
                   "checkpoints (model, optimizer, RNG, data position), saved every "
                   "--checkpoint-interval steps, at the end and on Ctrl-C")
    p.add_argument("--checkpoint-interval", type=COUNT, default=0,
                   help="steps between checkpoints (0: only at the end and on Ctrl-C)")
    p.add_argument("--keep-last", type=POSITIVE_INT, default=None,
                   help="keep only this many checkpoints (the highest steps)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --checkpoint-dir (or from the "
                        "step-N directory it names)")
    p.add_argument("--out", default="out/train_gpt2", help="directory of the run's logs "
                   "(log.csv, log.jsonl, loss.png); a new run replaces the logs there, a "
                   "resumed one continues them")
    p.add_argument("--tensorboard", default=None, metavar="DIR", help="also write TensorBoard "
                   "event files to DIR (needs tensorboardX)")
    p.add_argument("--wandb", default=None, metavar="PROJECT", help="also log to this Weights "
                   "& Biases project (needs wandb; WANDB_MODE=offline works without a network)")
    p.add_argument("--seed", type=COUNT, default=1337)
    p.add_argument("--peak-tflops", type=POSITIVE, default=None,
                   help="for MFU (default: by GPU)")
    p.add_argument("--no-cuda-graph", action="store_true", help="on GPU, run each step eagerly "
                   "instead of replaying it as one captured CUDA graph")
    p.add_argument("--recompute", action="store_true", help="keep only each block's input for "
                   "backward and run the block again there: less memory, about a third more "
                   "compute")
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def check_args(p, args):
    """Flags that are wrong together, then the device's defaults for those left out."""
    if not args.checkpoint_dir and (args.resume or args.checkpoint_interval or args.keep_last):
        p.error("--resume, --checkpoint-interval and --keep-last need --checkpoint-dir")
    defaults = DEFAULTS[backend.device_name]
    args.batch_size_given, args.batch_note = args.batch_size is not None, None
    warmup_given = args.warmup is not None
    if args.warmup is not None and args.steps is not None and args.warmup > args.steps:
        p.error(f"argument --warmup: {args.warmup} steps of warm-up is more than --steps "
                f"{args.steps}: the learning rate would never reach --lr")
    if args.warmup is not None and args.steps is None and args.warmup > defaults["steps"]:
        p.error(f"argument --warmup: {args.warmup} is more than the {defaults['steps']} steps "
                f"of a default run: give --steps too")
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if not warmup_given:
        args.warmup = min(args.warmup, args.steps // 10)     # the default, for short runs
    try:
        context = preset(args.model).block_size
    except ValueError as err:
        p.error(f"argument --model: {err}")
    if not args.init_from and args.seq_len > context:
        p.error(f"argument --seq-len: {args.seq_len} is longer than the model's context "
                f"({context}, --model {args.model})")


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


def on_rank_zero(action, rank):
    """`action()` run by rank 0 alone; its error (bad input: one line) is raised on every rank,
    so that none waits in a collective for a rank that stopped. Returns rank 0's result (None
    elsewhere)."""
    result, error = None, None
    if rank == 0:
        try:
            result = action()
        except (OSError, RuntimeError) + INPUT_ERRORS as err:
            error = str(err) if str(err) else type(err).__name__
    error = broadcast_object(error)
    if error:
        raise ValueError(error)
    return result


def check_outputs(args, rank):
    """Every place the run writes (--out, --checkpoint-dir, --checkpoint, --tensorboard) is a
    directory rank 0 can write, before anything is built: a bad one is one line naming its
    flag, not an error at the first save."""
    def check():
        for flag, path in (("--out", args.out), ("--checkpoint-dir", args.checkpoint_dir),
                           ("--checkpoint", args.checkpoint), ("--tensorboard", args.tensorboard)):
            if path is None:
                continue
            if os.path.exists(path) and not os.path.isdir(path):
                raise ValueError(f"{flag} {path} is a file, not a directory: name a directory")
            try:
                os.makedirs(path, exist_ok=True)
                with tempfile.TemporaryFile(dir=path):
                    pass
            except OSError as err:
                raise ValueError(f"{flag} {path} is not a writable directory: "
                                 f"{err.strerror or err}") from None
    on_rank_zero(check, rank)


def resume_point(args, dp):
    """Where the run starts: {"step": 0} for a new run, else the checkpoint's extra (with "step"
    and "path") and, saved into from now on, its root (`args.checkpoint_root`). Sets
    --batch-size to keep the checkpoint's global batch when it was left out. A new run refuses a
    --checkpoint-dir that already holds checkpoints (it would mix two runs)."""
    args.checkpoint_root = args.checkpoint_dir
    if not args.checkpoint_dir:
        return {"step": 0}
    if not args.resume:
        try:
            path, extra = checkpoint.read_extra(args.checkpoint_dir)
        except CheckpointError:
            return {"step": 0}                          # no checkpoint there yet
        raise ValueError(f"--checkpoint-dir {args.checkpoint_dir} already holds checkpoints "
                         f"(the latest: {path}): add --resume to continue them, or choose "
                         "another --checkpoint-dir")
    path, extra = checkpoint.read_extra(args.checkpoint_dir)
    if os.path.normpath(path) == os.path.normpath(args.checkpoint_dir):   # a step-N directory
        args.checkpoint_root = os.path.dirname(os.path.normpath(path))
    if extra["step"] >= args.steps:
        raise ValueError(f"{path} is at step {extra['step']} of --steps {args.steps}: nothing is "
                         "left to train (raise --steps to train on)")
    saved = extra.get("batch")
    if saved is not None:
        if not args.batch_size_given:
            if saved["global"] % dp:
                raise ValueError(f"the checkpoint's global batch of {saved['global']} sequences "
                                 f"does not split over dp {dp}: pass --batch-size")
            args.batch_size = saved["global"] // dp
        elif args.batch_size * dp != saved["global"]:
            args.batch_note = (
                f"note: the global batch is now {args.batch_size * dp} sequences (--batch-size "
                f"{args.batch_size} per data-parallel rank × dp {dp}); the checkpoint trained "
                f"with {saved['global']}, so the run no longer follows an uninterrupted one "
                f"(leave --batch-size out to keep it)")
    return dict(extra, path=path)


def load_data(args, rank):
    """(tokenizer, train tokens, val tokens): .bin token files from a directory (a nanoGPT
    meta.pkl there gives the tokenizer), or a text file tokenized once by rank 0 into the token
    cache (the others wait)."""
    if args.data and os.path.isdir(args.data):
        if args.tokenizer == "bpe":
            raise DataError(f"--tokenizer bpe is trained on a text file, but --data {args.data} "
                            "holds token files")
        train, val, vocabulary = read_token_dir(args.data)
        if vocabulary is not None and args.tokenizer is not None:
            raise DataError(f"--tokenizer {args.tokenizer} does not apply: the meta.pkl in "
                            f"{args.data} sets the vocabulary (leave --tokenizer out)")
        return vocabulary or get_tokenizer(args.tokenizer or "tiktoken"), train, val
    text = args.data or default_corpus_path()
    if not os.path.isfile(text):
        raise DataError(f"data file {text} does not exist")
    corpus = None
    if args.tokenizer == "bpe":
        with open(text, encoding="utf-8") as f:
            corpus = f.read()
    tokenizer = get_tokenizer(args.tokenizer or "byte", corpus_text=corpus)
    cache = default_cache_dir()

    def prepare():
        try:
            return prepare_corpus(text, cache, tokenizer)
        except OSError as err:
            raise DataError(f"the token cache {cache} cannot be written ({err.strerror or err}): "
                            "point XDG_CACHE_HOME at a writable directory") from None
    paths = broadcast_object(on_rank_zero(prepare, rank))
    return tokenizer, read_tokens(paths[0]), read_tokens(paths[1])


def build_model(args, mesh, vocab_size):
    """GPT-2 born sharded over `mesh` (or loaded from --init-from): built deferred, laid out
    (tensor-parallel, then fully sharded with --fsdp or replicated over dp), then each rank
    materializes only its blocks."""
    if args.init_from:
        model = GPT2.from_pretrained(args.init_from, mesh)
    else:
        with cupytp.deferred_init():
            model = GPT2(preset(args.model, vocab_size=vocab_size, dropout=args.dropout), mesh)
    if args.seq_len > model.config.block_size:
        raise ValueError(f"--seq-len {args.seq_len} is longer than the model's context "
                         f"({model.config.block_size})")
    model.transformer.recompute = args.recompute
    if args.fsdp:
        fully_shard(model, mesh, param_dtype=args.dtype)
    elif mesh.shape[0] > 1:
        replicate(model, mesh)
    cupytp.materialize(model)
    return model


def batch_tensor(array, mesh):
    """A (B·dp, T) DTensor: this rank's rows Shard(0) over dp, Replicated over tp."""
    dp = mesh.shape[0]
    return from_local(backend.asarray(array), mesh, (Shard(0), Replicated()),
                      shape=(array.shape[0] * dp, array.shape[1]))


_EVAL_LOSSES = {}       # id(model) -> its loss as a function of a batch, captured on GPUs


def evaluate(model, loader, mesh, batches, micro, dtype):
    """The mean loss of the model in eval mode over `batches` global validation batches, each
    taken in pieces of `micro` rows per rank as training takes them (the same sequences and mean
    for any split of the batch): a forward with no tape that keeps nothing for a backward,
    in `dtype` as training runs, captured as one CUDA graph on GPUs (at its second call) and
    replayed; the losses are summed on the device and read once."""
    if id(model) not in _EVAL_LOSSES:
        def loss_of(x, y):
            with no_grad(), autocast(None if dtype == "fp32" else dtype):
                return model(x, y)[1]
        _EVAL_LOSSES[id(model)] = cupytp.cuda_graph(loss_of)
    loss_of = _EVAL_LOSSES[id(model)]
    model.eval()
    total, count = None, 0
    for x, y in loader.val_batches(batches):
        for rows in range(0, len(x), micro):
            loss = loss_of(batch_tensor(x[rows:rows + micro], mesh),
                           batch_tensor(y[rows:rows + micro], mesh))   # overwritten by the next
            total = loss + 0.0 if total is None else total + loss
            count += 1
    model.train()
    return total.item() / count


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
    Ctrl-C (then every rank saves and raises KeyboardInterrupt). Besides the model, optimizer,
    RNG and data position, each holds what a resumed run must keep: the tensor-parallel size,
    the global batch, the run's first loss and its W&B run."""

    def __init__(self, args, model, optimizer, loader, scaler, dp):
        self.args, self.model, self.optimizer, self.loader = args, model, optimizer, loader
        self.scaler, self.dp = scaler, dp
        self.saved_step = None
        self.saved_path = None
        self.run_info = {"first_loss": None, "wandb_run": None}

    def resume(self, point):
        """Load the checkpoint `resume_point` found (model, optimizer, RNG, data position)."""
        saved_tp = point.get("tp", self.args.tp)
        try:
            checkpoint.load(point["path"], self.model, self.optimizer)
        except CheckpointError as err:
            if saved_tp == self.args.tp:
                raise
            raise CheckpointError(f"{point['path']} was saved with --tp {saved_tp}: resume it "
                                  f"with --tp {saved_tp} (at --tp {self.args.tp}: {err})") from None
        default_generator.set_state(point["rng"])
        self.loader.load_state_dict(point["data"])
        if point.get("loss_scale"):
            self.scaler.load_state_dict(point["loss_scale"])
        self.run_info.update({k: point.get(k) for k in self.run_info})
        self.saved_step, self.saved_path = point["step"], point["path"]

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
                 "loss_scale": self.scaler.state_dict(), "tp": self.args.tp,
                 "batch": {"global": self.args.batch_size * self.dp,
                           "per_rank": self.args.batch_size, "dp": self.dp},
                 **self.run_info}
        self.saved_path = checkpoint.save(self.args.checkpoint_root, done, self.model,
                                          self.optimizer, extra=extra,
                                          keep_last=self.args.keep_last)
        self.saved_step = done
        if cupytp.distributed.get_rank() == 0:
            from tqdm import tqdm
            tqdm.write(f"saved checkpoint {self.saved_path}", file=sys.stdout)


def open_logs(args, rank, start, run_info):
    """Rank 0's logs: log.csv / log.jsonl (new, or continued from step `start` when resuming),
    TensorBoard and W&B when asked; and the one line saying where the metrics go. Opened last,
    once nothing else can fail, so a run refused at the start leaves the earlier logs alone."""
    resume_at = start if args.resume else None

    def open_all():
        logs = [TrainLog(args.out, resume_at=resume_at)]
        where = [f"{os.path.join(args.out, 'log.csv')}, log.jsonl, loss.png" +
                 (" (replacing an earlier run's)" if logs[0].replaced else "")]
        if args.tensorboard:
            logs.append(TensorBoardLog(args.tensorboard, resume_at=resume_at))
            where.append(f"TensorBoard {args.tensorboard}")
        if args.wandb:
            wandb_log = WandbLog(args.wandb, args.out, config=vars(args),
                                 run_id=run_info["wandb_run"] if args.resume else None)
            run_info["wandb_run"] = wandb_log.id
            logs.append(wandb_log)
            where.append(f"W&B project {args.wandb} (run {wandb_log.id}, {wandb_log.mode})")
        return logs, "metrics: " + "; ".join(where)
    opened = on_rank_zero(open_all, rank)
    logs, where = opened if rank == 0 else ([], None)
    run_info["wandb_run"] = broadcast_object(run_info["wandb_run"])
    say(rank, broadcast_object(where))
    return logs


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
                with autocast(None if args.dtype == "fp32" else args.dtype), \
                        cupytp.microbatch(i, len(batches)):     # dropout: the whole batch's
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
    dp_rank, dp = mesh.get_local_rank("dp"), mesh.shape[0]
    check_outputs(args, info.rank)
    point = resume_point(args, dp)
    tokenizer, train_tokens, val_tokens = load_data(args, info.rank)
    loaders = [TokenLoader(tokens, rows, args.seq_len, dp_rank, dp, args.seed,
                           sampling=args.sampling, vocab_size=tokenizer.vocab_size)
               for tokens, rows in ((train_tokens, args.batch_size),    # validation: whole
                                    (val_tokens, args.batch_size * args.grad_accum))]  # batches

    cupytp.manual_seed(args.seed)
    model = build_model(args, mesh, tokenizer.vocab_size)
    optimizer = AdamW(decay_groups(model.named_parameters(), args.weight_decay), lr=args.lr,
                      betas=(0.9, 0.95), eps=1e-8)
    scaler = GradScaler(enabled=args.dtype == "fp16")
    checkpoints = Checkpoints(args, model, optimizer, loaders[0], scaler, dp) \
        if args.checkpoint_dir else None
    if args.resume:
        checkpoints.resume(point)
    run_info = checkpoints.run_info if checkpoints else {"first_loss": None, "wandb_run": None}
    ctrl_c = CtrlC()            # from here on, Ctrl-C stops the run at the end of a step
    tokens_per_step = args.batch_size * dp * args.seq_len * args.grad_accum
    say(info.rank, f"GPT-2 {args.model}: {model.num_parameters() / 1e6:.2f}M parameters, "
        f"vocab {tokenizer.vocab_size} (padded {model.vocab}), mesh dp={dp} tp={args.tp}, "
        f"{backend.device_name} {args.dtype}, {tokens_per_step} tokens/step")
    if isinstance(model, DataParallelModule):
        say(info.rank, model.dp_summary())
    if args.resume:
        say(info.rank, f"resumed from {point['path']} at step {point['step']}")
        if args.batch_note:
            say(info.rank, args.batch_note)
    logs = open_logs(args, info.rank, point["step"], run_info)
    try:
        value, val = train_loop(args, model, optimizer, scaler, loaders, mesh, checkpoints, logs,
                                point["step"], run_info, ctrl_c)
    finally:
        ctrl_c.close()
        for log in logs:
            log.close()
    first = run_info["first_loss"]
    say(info.rank, (f"first loss {first:.4f} (ln vocab = {numpy.log(tokenizer.vocab_size):.4f}), "
                    if first is not None else "") +
        f"final train loss {value:.4f}, final val loss {val:.4f}")
    if args.sample_tokens:
        sample(model, tokenizer, args, info.rank)
    if args.checkpoint:
        model.save_pretrained(args.checkpoint)
        if info.rank == 0:
            print(f"saved {args.checkpoint}", flush=True)


def train_loop(args, model, optimizer, scaler, loaders, mesh, checkpoints, logs, start,
               run_info, ctrl_c):
    """Steps start..--steps-1, the validation loss before each --eval-interval'th update and
    after the last; returns (the last logged training loss, the final validation loss).
    `run_info["first_loss"]` is the run's first logged loss (kept across resumes)."""
    info = cupytp.distributed.get_runtime()
    loader, val_loader = loaders
    dp = mesh.shape[0]
    lr_at = lr_schedule(args)
    config = model.config
    tokens_per_step = args.batch_size * dp * args.seq_len * args.grad_accum
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items()
                                     if backend.on_gpu and k in gpu_name()), None)
    # a bar only for one process on a terminal; piped, redirected or under mpiexec (Open MPI
    # hands ranks a pseudo-terminal, but forwards a bar's carriage returns only in part, and
    # not at all from a job that aborts): one plain line per log step
    progress = _progress(args.steps) if info.world_size == 1 and not LOG_RANKS and \
        sys.stdout.isatty() else None
    train_step = make_train_step(model, optimizer, scaler, args)
    logged_step, done, value = start - 1, start, None
    nonfinite = backend.xp.full((), -1, dtype=numpy.int64)   # first step of a non-finite loss
    if progress is not None:
        progress.update(start)
    clock = time.perf_counter()
    try:
        for step in range(start, args.steps):
            val = None
            if step % args.eval_interval == 0:       # before the step's update, as its loss
                began = time.perf_counter()
                val = evaluate(model, val_loader, mesh, args.eval_batches, args.batch_size,
                               args.dtype)
                clock += time.perf_counter() - began
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step)
            batches = [tuple(batch_tensor(a, mesh) for a in loader.next_batch())
                       for _ in range(args.grad_accum)]
            loss, norm = train_step(batches)
            done = step + 1
            nonfinite = first_nonfinite(nonfinite, loss, step)
            logged = step % args.log_interval == 0 or val is not None or step == args.steps - 1
            if logged:
                value = loss.item()           # the one host sync, at log steps only
                check_finite(nonfinite, value, step, args)
                if run_info["first_loss"] is None:
                    run_info["first_loss"] = value
                elapsed = time.perf_counter() - clock
                steps_done, logged_step = step - logged_step, step
                tokens_per_s = tokens_per_step * steps_done / elapsed
                clock = time.perf_counter()
                mfu = estimate_mfu(config.flops_per_token(args.seq_len),
                                   tokens_per_s / info.world_size, peak * 1e12) if peak else None
                memory = all_gather_object(memory_gib())
                row = {"loss": value, "val_loss": val, "lr": lr_at(step),
                       "grad_norm": None if norm is None else float(norm),
                       "tokens_per_s": tokens_per_s, "mfu": mfu,
                       "mem_gib": max(p for _, p in memory)}
                for log in logs:
                    log.log(step, **row)
                text = _postfix(row, memory[info.rank:info.rank + 1] if LOG_RANKS else memory)
                if progress is not None:
                    progress.set_postfix_str(text)
                    progress.update(steps_done)
                else:
                    say(info.rank, f"step {step}/{args.steps}: {text}")
            if checkpoints is not None:
                checkpoints.after_step(done, ctrl_c.agreed(True))
            elif ctrl_c.agreed(logged):
                raise KeyboardInterrupt
        val = evaluate(model, val_loader, mesh, args.eval_batches, args.batch_size,
                       args.dtype)   # the trained model
    except KeyboardInterrupt:
        interrupted(done, args.out, checkpoints, progress, info.rank)
    finally:
        if progress is not None:
            progress.close()
    if checkpoints is not None:
        checkpoints.save(args.steps)
    for log in logs:
        log.log(args.steps, val_loss=val)
    if info.rank == 0:
        plot_loss(args.out)
    return value, val


def sample(model, tokenizer, args, rank):
    """--sample-tokens tokens after a newline, printed by rank 0. They come in tenths, with a
    progress line when one took a while (on the CPU each token runs the whole window through the
    model, with a collective per layer on several ranks)."""
    total = args.sample_tokens
    ids = numpy.array([prompt_ids(tokenizer)])
    prompt_length = ids.shape[1]
    chunk = -(-total // 10)
    say(rank, f"sampling {total} tokens")
    began = shown = time.perf_counter()
    for i, first in enumerate(range(0, total, chunk)):
        ids = model.generate(ids, min(chunk, total - first), temperature=0.8, top_k=40,
                             seed=args.seed + i)
        now = time.perf_counter()
        if now - shown >= 2 and first + chunk < total:
            say(rank, f"sampled {first + chunk}/{total} tokens ({now - began:.0f} s)")
            shown = now
    if rank == 0:
        text = tokenizer.decode(ids[0, prompt_length:].tolist())
        print("--- sample ---\n" + text + "\n---", flush=True)


def prompt_ids(tokenizer):
    """A newline, or the vocabulary's first token where it has no newline."""
    try:
        return tokenizer.encode("\n") or [0]
    except ValueError:
        return [0]


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


def interrupted(done, out, checkpoints, progress, rank):
    """Ctrl-C: one line (the steps done, which is the step of the checkpoint saved), loss.png
    drawn from what was logged, exit status 130."""
    if progress is not None:
        progress.close()
    if rank == 0:
        if os.path.isfile(os.path.join(out, "log.jsonl")):
            plot_loss(out)
        saved = f"; checkpoint {checkpoints.saved_path}" \
            if checkpoints is not None and checkpoints.saved_step == done else ""
        print(f"interrupted at step {done}{saved}; logs in {out}", file=sys.stderr, flush=True)
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


def _postfix(row, memory):
    parts = [f"loss {row['loss']:.3f}"]
    if row["grad_norm"] is not None:
        parts.append(f"|g| {row['grad_norm']:.2f}")
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
    except INPUT_ERRORS as err:
        fail(err)


if __name__ == "__main__":
    main()
