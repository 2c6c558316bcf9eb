"""Train a GPT-2 or Llama-family model over any mesh:  mpiexec -n N python examples/train.py

With no arguments: tiny Shakespeare (shipped with cupytp), a byte-level tokenizer, the tiny
GPT-2 on CPU, or on GPU a 10M-parameter GPT-2 in bf16 (nanoGPT's shakespeare-char recipe).
`--model` names a GPT-2 preset or a Llama-family model (`cupytp.models.MODEL_NAMES`), or
`--init-from` a Hugging Face checkpoint directory (its config.json says which). The ranks form
a (dp, pp, cp, tp) mesh: `--tp` ranks split every layer (`--sequence-parallel`: the activations
between its regions too), `--cp` ranks split the sequence (ring attention), `--pp` ranks hold
consecutive blocks (a pipeline schedule runs the micro-batches through them), and the remaining
ranks (world / (tp·cp·pp)) split the batch, replicated or fully sharded (`--fsdp`). Any split
trains like one rank on the same global batch. Logs (CSV, JSON lines, loss.png; TensorBoard
and W&B on request) go to --out.

The script reads top to bottom: the flags (`parse_args`), the mesh (`make_mesh`), the output
places (`check_outputs`), where a resumed run stands (`resume_point`), the pipeline's schedule
(`pipeline_schedule`), the data (`load_data`, `make_loaders`), the model (`build_model`),
checkpoints (`Checkpoints`), the logs (`open_logs`), the loop (`train_loop`) and sampling
(`sample`); `train` calls them in that order.
"""
import argparse
import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import tempfile
import time

os.environ.setdefault("CUPY_TF32", "1")     # fp32 matmuls on tensor cores (before CuPy loads)

import numpy  # noqa: E402


LAUNCHER_RANKS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")
PROG = os.path.splitext(os.path.basename(sys.argv[0]))[0] or "train"   # as the user called it


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
        print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
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
from cupytp.models import (GPT2, MODEL_NAMES, Llama, ModelSpec, gpt2, llama,  # noqa: E402
                           model_spec)
from cupytp.nn.attention import check_heads  # noqa: E402
from cupytp.ops import autocast  # noqa: E402
from cupytp.optim import (AdamW, GradScaler, clip_grad_norm_, constant,  # noqa: E402
                          cosine_with_warmup, decay_groups, linear)
from cupytp.parallel import (ContextParallel, DataParallelModule,  # noqa: E402
                             apply_tensor_parallel, fully_shard, make_schedule, pipeline,
                             replicate)
from cupytp.parallel.pipeline import split_layers  # noqa: E402
from cupytp.tensor import (Partial, Replicated, Shard, default_generator,  # noqa: E402
                           from_local)
from cupytp.train_log import (MissingPackageError, TensorBoardLog, Throughput,  # noqa: E402
                              TrainLog, WandbLog, plot_loss)

# one device's dense peak, by the dtype its products run in (fp32 runs on TF32 tensor cores)
PEAK_TFLOPS = {"H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 494.5},
               "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 494.5},
               "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0}}
LOG_RANKS = env.get("CUPYTP_LOG_RANKS")
# What a run does when a flag is left out: on the CPU a ~2-3 minute run on 2 cores; on a GPU
# nanoGPT's shakespeare-char recipe (6 layers, 6 heads, 384 wide, dropout 0.2), in bf16, for the
# 2000 steps before its validation loss stops falling (it rises past step ~1500 of 5000).
DEFAULTS = {
    "cpu": {"model": "tiny", "dtype": "fp32", "batch_size": 16, "seq_len": 128, "steps": 400,
            "lr": 1e-3, "warmup": 30, "dropout": 0.0, "eval_interval": 100},
    "gpu": {"model": "10M", "dtype": "bf16", "batch_size": 64, "seq_len": 256, "steps": 2000,
            "lr": 1e-3, "warmup": 100, "dropout": 0.2, "eval_interval": 250},
}
FAMILY_NAMES = {"gpt2": "GPT-2", "llama": "Llama"}
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")
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
    p.add_argument("--model", default=None, help=f"{', '.join(gpt2.PRESETS)} (GPT-2), or one of "
                   f"{', '.join(MODEL_NAMES)} (default: tiny on CPU, 10M on GPU)")
    p.add_argument("--tp", type=POSITIVE_INT, default=1, help="tensor-parallel ranks")
    p.add_argument("--sequence-parallel", action="store_true", help="with --tp: shard the "
                   "activations between the tensor-parallel regions on the sequence")
    p.add_argument("--cp", type=POSITIVE_INT, default=1, help="context-parallel ranks: each "
                   "holds 1/cp of every sequence, attention runs as a ring")
    p.add_argument("--pp", type=POSITIVE_INT, default=1, help="pipeline-parallel ranks: each "
                   "holds a run of consecutive blocks")
    p.add_argument("--pp-schedule", default=None, choices=SCHEDULES,
                   help="the pipeline's schedule (default 1f1b; interleaved_1f1b: 2 stages per "
                        "rank)")
    p.add_argument("--microbatches", type=POSITIVE_INT, default=None,
                   help="micro-batches per step in the pipeline (default: --grad-accum's when "
                        "above 1, else --pp); they split the step's batch")
    p.add_argument("--dp", type=POSITIVE_INT, default=None,
                   help="data-parallel ranks (default world / (tp·cp·pp))")
    p.add_argument("--fsdp", action="store_true", help="shard parameters, gradients and "
                   "optimizer states over the data-parallel ranks instead of replicating them "
                   "(over the context-parallel ones with --cp and no other data-parallel rank)")
    p.add_argument("--data", default=None, help="a text file, or a directory of .bin token "
                   "files: llm.c's shards (*train*.bin, *val*.bin) or nanoGPT's train.bin and "
                   "val.bin (with meta.pkl for a character vocabulary); default: tiny "
                   "Shakespeare")
    p.add_argument("--tokenizer", default=None, choices=["byte", "bpe", "tiktoken", "hf"],
                   help="default: byte for a text file; a .bin directory's meta.pkl, else "
                        "tiktoken (GPT-2's ids); hf: a Hugging Face tokenizer.json "
                        "(--tokenizer-path)")
    p.add_argument("--tokenizer-path", default=None, metavar="PATH", help="with --tokenizer hf: "
                   "a tokenizer.json or its directory (default: --init-from's directory)")
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
                   help="GPT-2's dropout probability (default 0 on CPU, 0.2 on GPU; Llama-family "
                        "models have none)")
    p.add_argument("--grad-clip", type=NON_NEGATIVE, default=1.0, help="0: no clipping")
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"],
                   help="bf16/fp16: matmuls in that dtype, fp32 master weights and loss; fp16 "
                        "with dynamic loss scaling (default: fp32 on CPU, bf16 on GPU)")
    p.add_argument("--eval-interval", type=POSITIVE_INT, default=None)
    p.add_argument("--eval-batches", type=POSITIVE_INT, default=10)
    p.add_argument("--log-interval", type=POSITIVE_INT, default=10)
    p.add_argument("--sample-tokens", type=COUNT, default=200)
    p.add_argument("--init-from", default=None, help="a Hugging Face checkpoint to start from: "
                   "a GPT-2 or Llama-family (Llama, Qwen2, Mistral) directory, whose "
                   "config.json says which (a GPT-2 model.safetensors alone works too)")
    p.add_argument("--checkpoint", default=None, help="directory to save the trained model to "
                   "(Hugging Face's format)")
    p.add_argument("--checkpoint-dir", default=None, help="directory of sharded training "
                   "checkpoints (model, optimizer, RNG, data position), saved every "
                   "--checkpoint-interval steps, at the end and on Ctrl-C")
    p.add_argument("--checkpoint-interval", type=COUNT, default=0,
                   help="steps between checkpoints (0: only at the end and on Ctrl-C)")
    p.add_argument("--keep-last", type=POSITIVE_INT, default=None,
                   help="keep only this many checkpoints (the highest steps)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --checkpoint-dir (or from the "
                        "step-N directory it names), on any mesh")
    p.add_argument("--out", default="out/train", help="directory of the run's logs "
                   "(log.csv, log.jsonl, loss.png); a new run replaces the logs there, a "
                   "resumed one continues them")
    p.add_argument("--tensorboard", default=None, metavar="DIR", help="also write TensorBoard "
                   "event files to DIR (needs tensorboardX)")
    p.add_argument("--wandb", default=None, metavar="PROJECT", help="also log to this Weights "
                   "& Biases project (needs wandb; WANDB_MODE=offline works without a network)")
    p.add_argument("--seed", type=COUNT, default=1337)
    p.add_argument("--peak-tflops", type=POSITIVE, default=None,
                   help="one device's peak, for MFU (default: by GPU and --dtype)")
    p.add_argument("--no-cuda-graph", action="store_true", help="on GPU, run each step eagerly "
                   "instead of replaying it as one captured CUDA graph")
    p.add_argument("--recompute", action="store_true", help="keep only each block's input for "
                   "backward and run the block again there: less memory, about a third more "
                   "compute")
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def check_args(p, args):
    """Flags that are wrong together, the device's defaults for those left out, the model
    (`args.spec`, `args.shape`) and what the parallel flags ask of it."""
    if not args.checkpoint_dir and (args.resume or args.checkpoint_interval or args.keep_last):
        p.error("--resume, --checkpoint-interval and --keep-last need --checkpoint-dir")
    defaults = DEFAULTS[backend.device_name]
    args.batch_size_given, args.batch_note = args.batch_size is not None, None
    warmup_given, dropout_given = args.warmup is not None, args.dropout is not None
    if args.warmup is not None and args.steps is not None and args.warmup > args.steps:
        p.error(f"argument --warmup: {args.warmup} steps of warm-up is more than --steps "
                f"{args.steps}: the learning rate would never reach --lr")
    if args.warmup is not None and args.steps is None and args.warmup > defaults["steps"]:
        p.error(f"argument --warmup: {args.warmup} is more than the {defaults['steps']} steps "
                f"of a default run: give --steps too")
    if args.init_from and args.model:
        p.error(f"argument --model: --init-from {args.init_from} brings its own model (its "
                "config.json): leave --model out")
    check_tokenizer_flags(p, args)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if not warmup_given:
        args.warmup = min(args.warmup, args.steps // 10)     # the default, for short runs
    try:
        args.spec = pretrained_spec(args.init_from) if args.init_from else model_spec(args.model)
    except ValueError as err:
        p.error(f"argument {'--init-from' if args.init_from else '--model'}: {err}")
    if args.spec.family != "gpt2":
        if dropout_given and args.dropout > 0:
            p.error(f"argument --dropout: {FAMILY_NAMES[args.spec.family]}-family models have "
                    "no dropout: leave --dropout out")
        args.dropout = 0.0
    args.shape = model_shape(args.spec)
    if args.shape is not None and args.seq_len > args.shape.context:
        p.error(f"argument --seq-len: {args.seq_len} is longer than the model's context "
                f"({args.shape.context}, {describe_model(args.spec)})")
    check_parallel_flags(p, args)


def check_tokenizer_flags(p, args):
    if args.tokenizer_path and args.tokenizer != "hf":
        p.error("argument --tokenizer-path: it names a Hugging Face tokenizer.json: add "
                "--tokenizer hf")
    if args.tokenizer == "hf" and not (args.tokenizer_path or args.init_from):
        p.error("argument --tokenizer: hf reads a tokenizer.json: give --tokenizer-path (a "
                "tokenizer.json or its directory)")
    if args.tokenizer == "hf" and not args.tokenizer_path:
        args.tokenizer_path = args.init_from if os.path.isdir(args.init_from) else \
            os.path.dirname(args.init_from)


def check_parallel_flags(p, args):
    """What --sequence-parallel, --cp and --pp need, each refusal one line: the flags they do
    not compose with (the rank counts are checked by `make_mesh`, the
    pipeline's batch by `pipeline_schedule`)."""
    if args.sequence_parallel and args.tp < 2:
        p.error("argument --sequence-parallel: it shards the sequence over the tensor-parallel "
                "ranks: give --tp 2 or more")
    if args.pp == 1 and (args.pp_schedule or args.microbatches):
        p.error(f"argument {'--pp-schedule' if args.pp_schedule else '--microbatches'}: it "
                "applies to a pipeline: give --pp 2 or more (without one, --grad-accum takes "
                "micro-batches)")
    if args.cp > 1 and args.seq_len < 2 * args.cp:
        p.error(f"argument --cp: each of the {args.cp} ranks holds two chunks of a sequence: "
                f"--seq-len {args.seq_len} is shorter than {2 * args.cp}")
    if args.pp > 1:
        args.pp_schedule = args.pp_schedule or "1f1b"
        args.microbatches = args.microbatches or (args.grad_accum if args.grad_accum > 1
                                                  else args.pp)


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the flags are checked against: blocks, query and key/value heads, head size, the
    longest sequence."""
    layers: int
    heads: int
    kv_heads: int
    head_size: int
    context: int


def model_shape(spec):
    """The ModelShape of a spec's config (None for a GPT-2 file without a config.json: its
    tensors' shapes give it when it loads)."""
    c = spec.config
    if c is None:
        return None
    if spec.family == "gpt2":
        return ModelShape(c.n_layer, c.n_head, c.n_head, c.n_embd // c.n_head, c.block_size)
    return ModelShape(c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
                      c.head_size, min(c.max_position_embeddings, c.sliding_window or math.inf))


def pretrained_spec(path):
    """The ModelSpec of a Hugging Face checkpoint (a directory, or GPT-2's model.safetensors):
    its config.json's model_type names the family (GPT-2 without one)."""
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        return ModelSpec(path, "gpt2", None, GPT2, None)
    try:
        with open(config_path, encoding="utf-8") as f:
            hf = json.load(f)
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{config_path} is not valid JSON: {err}") from None
    model_type = hf.get("model_type") if isinstance(hf, dict) else None
    if model_type == "gpt2":
        return ModelSpec(path, "gpt2", gpt2.config_from_hf(config_path), GPT2, None)
    if model_type in llama.ARCHITECTURES:
        return ModelSpec(path, "llama", llama.config_from_hf(hf), Llama, None)
    raise ValueError(f"{config_path} has model_type {model_type!r}: this script trains gpt2 "
                     f"and the Llama family ({', '.join(llama.ARCHITECTURES)})")


def describe_model(spec):
    """"GPT-2 tiny", "Llama 125M", "Llama from DIR"."""
    family = FAMILY_NAMES[spec.family]
    if spec.name.startswith(spec.family + "-"):
        return f"{family} {spec.name[len(spec.family) + 1:]}"
    return f"{family} from {spec.name}"


# ---- the mesh ------------------------------------------------------------------------------------
@dataclasses.dataclass
class Split:
    """How the job splits the work: the (dp, pp, cp, tp) mesh (pp and cp only when above 1:
    the models find tensor parallelism by the name "tp" and the batch is Shard(0) on "dp", so
    those two stay, size 1 or not), each dimension's size, and the ContextParallel of "cp"."""
    mesh: object
    sizes: dict
    cp: object = None

    @property
    def dp(self):
        return self.sizes["dp"]

    @property
    def shard_dim(self):
        """The dimension --fsdp shards over: dp, or, without a pipeline, cp where dp is one rank
        (torchtitan shards over its dp×cp ranks)."""
        cp_only = self.sizes["dp"] == 1 and self.sizes["cp"] > 1 and self.sizes["pp"] == 1
        return "cp" if cp_only else "dp"

    @property
    def stage_mesh(self):
        """The mesh of the model's parameters: without "pp" (the pipeline cuts along it)."""
        names = tuple(n for n in self.mesh.dim_names if n != "pp")
        return self.mesh[names] if "pp" in self.mesh.dim_names else self.mesh

    def describe(self, args):
        parts = [f"{name}={self.sizes[name]}" for name in self.mesh.dim_names]
        if args.sequence_parallel:
            parts[-1] += " (sequence parallel)"
        text = "mesh " + " ".join(parts)
        if args.fsdp:
            text += f", {self.shard_dim} fully sharded"
        if self.sizes["pp"] > 1:
            text += f", pipeline {args.pp_schedule} over {args.microbatches} micro-batches"
        return text

    def model_inputs(self, x, y):
        """(ids, targets, positions) for the model of this rank's rows `x`, `y` (B, T): rows
        Shard(0) over dp, Replicated elsewhere; with context parallelism the sequence in its
        ring order, Shard(1) along cp, with its positions (else None)."""
        placements = tuple(Shard(0) if name == "dp" else Replicated()
                           for name in self.mesh.dim_names)
        ids, targets = (from_local(backend.asarray(a), self.mesh, placements,
                                   shape=(a.shape[0] * self.dp, a.shape[1])) for a in (x, y))
        if self.cp is None:
            return ids, targets, None
        return self.cp.shard(ids), self.cp.shard(targets), self.cp.positions(x.shape[1])


def make_mesh(args, world):
    """The Split of the launched ranks; sizes that cannot work are an error that suggests ones
    that do."""
    tp, pp, cp, shape = args.tp, args.pp, args.cp, args.shape
    others = tp * pp * cp
    per_replica = world // (pp * cp) if world % (pp * cp) == 0 else world

    def tp_fits(n):
        try:
            check_heads(shape.heads, shape.kv_heads, n)
        except ValueError:
            return False
        return True
    fits = " or ".join(f"--tp {n}" for n in range(1, per_replica + 1)
                       if per_replica % n == 0 and (shape is None or tp_fits(n)))
    if shape is not None and not tp_fits(tp):
        heads = "does not divide the model's " + (
            f"{shape.heads} attention heads" if shape.kv_heads == shape.heads else
            f"{shape.heads} query heads and fit its {shape.kv_heads} key/value heads")
        raise ValueError(f"--tp {tp} {heads}: with {world} "
                         f"rank{'s' if world > 1 else ''} use {fits}")
    terms = " × ".join(f"--{name} {size}" for name, size in (("tp", tp), ("cp", cp), ("pp", pp))
                       if size > 1 or (name == "tp" and others == 1))
    if args.dp is None and world % others:
        hint = f"use {fits}, or " if pp == cp == 1 else ""
        raise ValueError(f"{terms} does not divide the {world} launched ranks: {hint}launch a "
                         f"multiple of {others} ranks")
    dp = args.dp or world // others
    if others * dp != world:
        raise ValueError(f"{terms} × --dp {dp} is {others * dp} ranks, but {world} were "
                         f"launched: run mpiexec -n {others * dp}, or leave --dp out")
    sizes = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
    names = tuple(name for name in ("dp", "pp", "cp", "tp") if sizes[name] > 1 or
                  name in ("dp", "tp"))
    split = Split(cupytp.DeviceMesh(tuple(sizes[n] for n in names), names), sizes)
    if cp > 1:          # the sequence split over the stage mesh (a pipeline lays it out there)
        split.cp = ContextParallel(split.stage_mesh)
    return split


def pipeline_schedule(args, dp):
    """--pp's Schedule, once the batch is known (a resumed run may take the checkpoint's):
    the step's sequences must split into --microbatches equal parts on every data-parallel
    rank, the schedule must take that many, and the model's blocks must fill its stages."""
    if args.pp == 1:
        return None
    rows, m = args.batch_size * args.grad_accum, args.microbatches
    if rows % m:
        divisors = [str(d) for d in range(1, rows + 1) if rows % d == 0]
        raise ValueError(f"--microbatches {m} does not split the {rows} sequences of a step on "
                         f"each data-parallel rank (--batch-size {args.batch_size} × --grad-accum "
                         f"{args.grad_accum}): use one of {', '.join(divisors)}")
    schedule = make_schedule(args.pp_schedule, args.pp, m)
    if args.shape is not None:
        try:
            split_layers([1] * args.shape.layers, schedule.stages)
        except ValueError as err:
            raise ValueError(f"--pp {args.pp} with --pp-schedule {args.pp_schedule} makes "
                             f"{schedule.stages} stages: {err}") from None
    return schedule


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


# ---- the data ------------------------------------------------------------------------------------
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
        return vocabulary or tokenizer_named(args, args.tokenizer or "tiktoken"), train, val
    text = args.data or default_corpus_path()
    if not os.path.isfile(text):
        raise DataError(f"data file {text} does not exist")
    corpus = None
    if args.tokenizer == "bpe":
        with open(text, encoding="utf-8") as f:
            corpus = f.read()
    tokenizer = tokenizer_named(args, args.tokenizer or "byte", corpus)
    cache = default_cache_dir()

    def prepare():
        try:
            return prepare_corpus(text, cache, tokenizer)
        except OSError as err:
            raise DataError(f"the token cache {cache} cannot be written ({err.strerror or err}): "
                            "point XDG_CACHE_HOME at a writable directory") from None
    paths = broadcast_object(on_rank_zero(prepare, rank))
    return tokenizer, read_tokens(paths[0]), read_tokens(paths[1])


def tokenizer_named(args, name, corpus=None):
    return get_tokenizer(name, corpus_text=corpus,
                         path=args.tokenizer_path if name == "hf" else None)


def make_loaders(args, split, vocab_size, train_tokens, val_tokens):
    """(train, validation) loaders. Each step takes the same windows however the job is split:
    --grad-accum batches of --batch-size × dp windows, a data-parallel rank the rows of its
    rank; a pipeline takes them all on every rank (it cuts its micro-batches itself), so its
    loaders give whole global batches. Validation takes a step's worth of windows per batch."""
    pipelined = split.sizes["pp"] > 1
    rank, ranks = (0, 1) if pipelined else (split.mesh.get_local_rank("dp"), split.dp)
    rows = args.batch_size * (split.dp if pipelined else 1)
    return [TokenLoader(tokens, count, args.seq_len, rank, ranks, args.seed,
                        sampling=args.sampling, vocab_size=vocab_size)
            for tokens, count in ((train_tokens, rows), (val_tokens, rows * args.grad_accum))]


def step_batch(loader, args, split):
    """The inputs of one training step: a list of --grad-accum micro-batches (ids, targets,
    positions) of this rank's rows, or for a pipeline the whole global batch (ids, targets) as
    device arrays, the same on every rank."""
    pieces = [loader.next_batch() for _ in range(args.grad_accum)]
    if split.sizes["pp"] > 1:
        return tuple(backend.asarray(numpy.concatenate(a)) for a in zip(*pieces))
    return [split.model_inputs(x, y) for x, y in pieces]


# ---- the model -----------------------------------------------------------------------------------
def build_model(args, split, vocab_size, schedule):
    """(model, trained): the model born sharded over the mesh (or loaded from --init-from):
    built deferred on the stage mesh (tensor-parallel, with --sequence-parallel its activations
    sharded on the sequence), its attention a ring with --cp, then cut into pipeline stages with
    --pp, fully sharded with --fsdp or replicated over the batch's dimensions, and only then
    each rank's blocks made. `trained` is what the optimizer and checkpoints see: the model, or
    this rank's pipeline stages (`cupytp.parallel.Pipeline`)."""
    spec, stage_mesh = args.spec, split.stage_mesh
    if args.init_from:
        options = pretrained_options(args)
        model = spec.model_class.from_pretrained(args.init_from, stage_mesh, **options)
        args.shape = model_shape(dataclasses.replace(spec, config=model.config))
        if spec.family == "gpt2":
            model.transformer.recompute = args.recompute
    else:
        overrides = {"vocab_size": vocab_size}
        if spec.family == "gpt2":
            overrides["dropout"] = args.dropout
        spec = model_spec(spec.name, **overrides)
        with cupytp.deferred_init():
            model = spec.build(stage_mesh, recompute=args.recompute)
    if args.seq_len > args.shape.context:
        raise ValueError(f"--seq-len {args.seq_len} is longer than the model's context "
                         f"({args.shape.context})")
    if args.sequence_parallel:
        apply_tensor_parallel(model, stage_mesh, sequence_parallel=True)
    if split.cp is not None:
        split.cp.apply(model)
    if schedule is not None:
        return model, pipelined(model, split, schedule, args)
    batch_dims = tuple(name for name in ("dp", "cp") if name in split.mesh.dim_names)
    if args.fsdp:
        shard = split.shard_dim
        fully_shard(model, split.mesh, dim=shard,
                    replicate_dim=tuple(d for d in batch_dims
                                        if d != shard and split.sizes[d] > 1) or None,
                    param_dtype=args.dtype)
    elif any(split.sizes[name] > 1 for name in batch_dims):
        replicate(model, split.mesh, dim=batch_dims)      # gradients summed over the batch
    cupytp.materialize(model)
    return model, model


def pretrained_options(args):
    """from_pretrained's options: recomputation (a Llama takes it there, GPT-2 on its blocks
    after), GPT-2's dropout."""
    if args.spec.family == "llama":
        return {"recompute": args.recompute}
    config = args.spec.config
    return {} if config is None else {"config": dataclasses.replace(config,
                                                                     dropout=args.dropout)}


def pipelined(model, split, schedule, args):
    """`model` (deferred, on the stage mesh) cut into this rank's stages of `schedule`, each
    replicated or fully sharded over dp, then materialized."""
    sharding = {"data_parallel": "fully_shard", "param_dtype": args.dtype} if args.fsdp else {}
    pipe = pipeline(model, split.mesh, dim="pp", schedule=schedule, **sharding)
    return cupytp.materialize(pipe)


def unpipelined(pipe, build):
    """The whole model on the stage mesh (as `build()` makes it: tensor-parallel, neither
    sharded nor replicated over dp) holding the pipeline's values, for sampling and
    save_pretrained: each parameter laid out as the new model's on the rank whose stage holds
    it, zeros elsewhere, and summed along the pipeline (Partial over pp, made Replicated)."""
    with cupytp.deferred_init():
        whole = build()
    cupytp.materialize(whole, initialize=False)
    held = dict(pipe.named_parameters())
    mesh, axis = pipe.mesh, pipe.mesh.dim_names.index("pp")
    with no_grad():
        for name, p in whole.named_parameters():       # the same order on every rank
            source = held.get(name)
            local = source.redistribute(p.placements).to_local() if source is not None else \
                backend.xp.zeros(p.local_shape, p.dtype)
            placements = list(p.placements)
            placements.insert(axis, Partial())
            total = from_local(local, mesh, tuple(placements), shape=p.shape, run_check=False)
            placements[axis] = Replicated()
            p.to_local()[...] = total.redistribute(tuple(placements)).to_local()
    return whole


# ---- checkpoints and logs ------------------------------------------------------------------------
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
    Ctrl-C (every rank saves, then the run stops). Besides the model, optimizer,
    RNG and data position, each holds what a resumed run must keep: the mesh it trained on
    (a checkpoint loads on any other), the global batch, the run's first loss and its W&B run."""

    def __init__(self, args, model, optimizer, loader, scaler, split):
        self.args, self.model, self.optimizer, self.loader = args, model, optimizer, loader
        self.scaler, self.split = scaler, split
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

    def due(self, done):
        """Whether a checkpoint is due after `done` steps (every --checkpoint-interval)."""
        interval = self.args.checkpoint_interval
        return bool(interval) and done % interval == 0

    def save(self, done):
        if done == self.saved_step:
            return
        sizes, dp = self.split.sizes, self.split.dp
        extra = {"rng": list(default_generator.get_state()), "data": self.loader.state_dict(),
                 "loss_scale": self.scaler.state_dict(), "tp": self.args.tp, "mesh": sizes,
                 "batch": {"global": self.args.batch_size * dp,
                           "per_rank": self.args.batch_size, "dp": dp},
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
            config = {k: v for k, v in vars(args).items() if k not in ("spec", "shape")}
            wandb_log = WandbLog(args.wandb, args.out, config=config,
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


# ---- a step --------------------------------------------------------------------------------------
def model_loss(model, batch):
    """The model's mean loss over a micro-batch (ids, targets, positions)."""
    ids, targets, positions = batch
    if positions is None:
        return model(ids, targets)[1]
    return model(ids, targets, positions=positions)[1]


def make_train_step(model, trained, optimizer, scaler, args):
    """One optimizer step: forward and backward of the step's batch (gradients accumulate over
    its micro-batches, or a pipeline runs its schedule over them), clipping (over the whole
    pipeline), AdamW (through the loss scaler in fp16: a step with a non-finite gradient is
    skipped on the device). On GPU it is captured as one CUDA graph and replayed (unless
    --no-cuda-graph). Returns the loss of the whole batch (the mean over its tokens) and the
    gradient norm."""
    dtype = None if args.dtype == "fp32" else args.dtype
    pp_mesh = trained.pp_mesh if trained is not model else None

    def update():
        scaler.unscale_(optimizer)
        norm = clip_grad_norm_(trained.parameters(), args.grad_clip, pp_mesh=pp_mesh) \
            if args.grad_clip else None
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()   # the next forward pass reuses the gradients' memory
        return norm

    def pipeline_step(batch):
        with autocast(dtype):
            loss = trained.step(*batch, scaler=scaler)
        return loss, update()

    def accumulating_step(batches):
        parallel, mean = isinstance(model, DataParallelModule), None
        for i, batch in enumerate(batches):
            last = i == len(batches) - 1
            with contextlib.nullcontext() if last or not parallel else model.no_sync():
                with autocast(dtype), cupytp.microbatch(i, len(batches)):   # dropout: the
                    loss = model_loss(model, batch)                       # whole batch's
                loss = loss * (1.0 / len(batches))
                scaler.scale(loss).backward()
            with no_grad():
                mean = loss if mean is None else mean + loss
        return mean, update()
    step = pipeline_step if trained is not model else accumulating_step
    return step if args.no_cuda_graph else cupytp.cuda_graph(step)


def make_eval_loss(model, trained, args):
    """The loss of a validation batch in eval mode, in the training dtype, with no tape: a
    micro-batch's through the model (captured as one CUDA graph on GPUs, at its second call,
    and replayed), or a whole batch's through the pipeline's forwards."""
    dtype = None if args.dtype == "fp32" else args.dtype
    if trained is not model:
        def pipeline_loss(x, y):
            with no_grad(), autocast(dtype):
                return trained.step(backend.asarray(x), backend.asarray(y))
        return pipeline_loss

    def loss_of(batch):
        with no_grad(), autocast(dtype):
            return model_loss(model, batch)
    return cupytp.cuda_graph(loss_of)


def evaluate(loss_of, trained, loader, split, batches, micro):
    """The mean loss over `batches` global validation batches, each taken in pieces of `micro`
    rows per rank as training takes them (a pipeline takes each whole and cuts its own
    micro-batches): the same sequences and mean for any split of the batch. The losses are
    summed on the device and read once."""
    trained.eval()
    total, count = None, 0
    for x, y in loader.val_batches(batches):
        if split.sizes["pp"] > 1:
            losses = [loss_of(x, y)]
        else:
            losses = (loss_of(split.model_inputs(x[rows:rows + micro], y[rows:rows + micro]))
                      for rows in range(0, len(x), micro))
        for loss in losses:                 # each overwritten by the next call on GPUs
            total = loss + 0.0 if total is None else total + loss
            count += 1
    trained.train()
    return total.item() / count


# ---- the run -------------------------------------------------------------------------------------
def train(args):
    info = cupytp.init()
    split = make_mesh(args, info.world_size)
    check_outputs(args, info.rank)
    point = resume_point(args, split.dp)
    schedule = pipeline_schedule(args, split.dp)
    tokenizer, train_tokens, val_tokens = load_data(args, info.rank)
    loaders = make_loaders(args, split, tokenizer.vocab_size, train_tokens, val_tokens)

    cupytp.manual_seed(args.seed)
    model, trained = build_model(args, split, tokenizer.vocab_size, schedule)
    vocab = model.config.vocab_size
    if tokenizer.vocab_size > vocab:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids, more than the model's "
                         f"vocabulary of {vocab} ({describe_model(args.spec)}): use the "
                         "checkpoint's tokenizer (--tokenizer hf)")
    parameters = trained.num_parameters() if trained is model else total_parameters(trained)
    optimizer = AdamW(decay_groups(trained.named_parameters(), args.weight_decay), lr=args.lr,
                      betas=(0.9, 0.95), eps=1e-8)
    scaler = GradScaler(enabled=args.dtype == "fp16",
                        pp_mesh=trained.pp_mesh if trained is not model else None)
    checkpoints = Checkpoints(args, trained, optimizer, loaders[0], scaler, split) \
        if args.checkpoint_dir else None
    if args.resume:
        checkpoints.resume(point)
    run_info = checkpoints.run_info if checkpoints else {"first_loss": None, "wandb_run": None}
    ctrl_c = CtrlC()            # from here on, Ctrl-C stops the run at the end of a step
    tokens_per_step = args.batch_size * split.dp * args.seq_len * args.grad_accum
    padded = f" (padded {model.config.padded_vocab()})" if args.spec.family == "gpt2" else ""
    say(info.rank, f"{describe_model(args.spec)}: "
        f"{parameters / 1e6:.2f}M parameters, "
        f"vocab {tokenizer.vocab_size}{padded}, {split.describe(args)}, "
        f"{backend.device_name} {args.dtype}, {tokens_per_step} tokens/step")
    if isinstance(trained, DataParallelModule):
        say(info.rank, trained.dp_summary())
    if args.resume:
        say(info.rank, f"resumed from {point['path']} at step {point['step']}")
        if args.batch_note:
            say(info.rank, args.batch_note)
    logs = open_logs(args, info.rank, point["step"], run_info)
    try:
        value, val = train_loop(args, model, trained, optimizer, scaler, loaders, split,
                                checkpoints, logs, point["step"], run_info, ctrl_c)
    finally:
        ctrl_c.close()
        for log in logs:
            log.close()
    first = run_info["first_loss"]
    say(info.rank, (f"first loss {first:.4f} (ln vocab = {numpy.log(tokenizer.vocab_size):.4f}), "
                    if first is not None else "") +
        f"final train loss {value:.4f}, final val loss {val:.4f}")
    if args.sample_tokens or args.checkpoint:
        whole = model if trained is model else unpipelined(
            trained, lambda: type(model)(model.config, split.stage_mesh))
        if args.sample_tokens:
            sample(whole, tokenizer, args, info.rank)
        if args.checkpoint:
            whole.save_pretrained(args.checkpoint)
            if info.rank == 0:
                print(f"saved {args.checkpoint}", flush=True)


def total_parameters(trained):
    """The parameters of every stage of a pipeline (each rank counts its own)."""
    counts = all_gather_object((trained.pp_rank, trained.num_parameters()))
    return sum(dict(counts).values())


def peak_flops(args):
    """One device's peak FLOP/s for MFU: --peak-tflops, else the GPU's at --dtype (None when
    not known)."""
    if args.peak_tflops:
        return args.peak_tflops * 1e12
    if not backend.on_gpu:
        return None
    name = gpu_name()
    return next((peaks[args.dtype] * 1e12 for key, peaks in PEAK_TFLOPS.items() if key in name),
                None)


def train_loop(args, model, trained, optimizer, scaler, loaders, split, checkpoints, logs,
               start, run_info, ctrl_c):
    """Steps start..--steps-1, the validation loss before each --eval-interval'th update and
    after the last; returns (the last logged training loss, the final validation loss).
    `run_info["first_loss"]` is the run's first logged loss (kept across resumes)."""
    info = cupytp.distributed.get_runtime()
    loader, val_loader = loaders
    lr_at = lr_schedule(args)
    meter = Throughput(args.batch_size * split.dp * args.seq_len * args.grad_accum,
                       model.config.flops_per_token(args.seq_len), peak_flops(args),
                       info.world_size, backend.synchronize if backend.on_gpu else None)
    # a bar only for one process on a terminal; piped, redirected or under mpiexec (Open MPI
    # hands ranks a pseudo-terminal, but forwards a bar's carriage returns only in part, and
    # not at all from a job that aborts): one plain line per log step
    progress = _progress(args.steps) if info.world_size == 1 and not LOG_RANKS and \
        sys.stdout.isatty() else None
    train_step = make_train_step(model, trained, optimizer, scaler, args)
    eval_loss = make_eval_loss(model, trained, args)

    def validation():
        with meter.paused():
            return evaluate(eval_loss, trained, val_loader, split, args.eval_batches,
                            args.batch_size)
    done, value, shown = start, None, start
    nonfinite = backend.xp.full((), -1, dtype=numpy.int64)   # first step of a non-finite loss
    if progress is not None:
        progress.update(start)
    meter.start()
    try:
        for step in range(start, args.steps):
            val = validation() if step % args.eval_interval == 0 else None   # before the update
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step)
            loss, norm = train_step(step_batch(loader, args, split))
            meter.step()
            done = step + 1
            nonfinite = first_nonfinite(nonfinite, loss, step)
            logged = step % args.log_interval == 0 or val is not None or step == args.steps - 1
            if logged:
                tokens_per_s, mfu = meter.read()      # waits for the device: its steps' time
                value = loss.item()
                check_finite(nonfinite, value, step, args)
                if run_info["first_loss"] is None:
                    run_info["first_loss"] = value
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
                    progress.update(done - shown)
                    shown = done
                else:
                    say(info.rank, f"step {step}/{args.steps}: {text}")
            stop = ctrl_c.agreed(checkpoints is not None or logged)
            if checkpoints is not None and (stop or checkpoints.due(done)):
                with meter.paused():
                    checkpoints.save(done)
            if stop:
                raise KeyboardInterrupt
        val = validation()   # the trained model
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
    model.eval()
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
