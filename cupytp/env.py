"""The CUPYTP_* environment variables: every one the package reads is declared and parsed here.

`import cupytp` checks them all (`check()`): a value that is not understood, or a CUPYTP_ name
that looks like a misspelt one, is one `EnvError` naming the variable, its value and what it
takes, before anything starts. Modules read a value with `get(name)`, which parses it at the
time of the call (a test may set a variable after the import).
"""
import difflib
import os
from dataclasses import dataclass

__all__ = ["EnvError", "VARIABLES", "check", "get"]

PREFIX = "CUPYTP_"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class EnvError(ValueError):
    """A CUPYTP_* environment variable with a value the package does not understand."""


@dataclass(frozen=True)
class Variable:
    """One variable: its default (what an unset or empty one means), the values it takes
    (`choices`, or a `kind` of "flag", "seconds", "path" (any value) or "fault"), and what it
    does."""
    default: str
    meaning: str
    choices: tuple = ()
    kind: str = "choice"


VARIABLES = {
    "CUPYTP_DEVICE": Variable("", "where arrays live; unset: the GPU when there is one, gpu: an "
                                  "error if none is usable", choices=("cpu", "gpu")),
    "CUPYTP_TIMEOUT": Variable("600", "seconds a collective may take before it is an error "
                                      "that ends the job", kind="seconds"),
    "CUPYTP_DEBUG": Variable("0", "1: the ranks compare every collective before it runs, and "
                                  "from_local checks that Replicated parts agree", kind="flag"),
    "CUPYTP_LOG_RANKS": Variable("0", "1: examples/train.py prints every rank's progress "
                                      "lines, prefixed with its rank", kind="flag"),
    "CUPYTP_ATTENTION": Variable("auto", "the attention backend in bf16/fp16",
                                 choices=("auto", "flash", "cudnn", "matmul")),
    "CUPYTP_FLASH_WGMMA": Variable("1", "1: on compute capability 9.0 the flash kernels multiply "
                                        "with Hopper's warpgroup products (wgmma); 0: mma.sync "
                                        "on every GPU", kind="flag"),
    "CUPYTP_ALLOCATOR": Variable("cupytp", "where GPU arrays come from: the framework's pool "
                                           "or CuPy's own", choices=("cupytp", "cupy")),
    "CUPYTP_FUSED": Variable("1", "0: the fused sublayers run their chains of ops instead",
                             kind="flag"),
    "CUPYTP_CUBLASLT": Variable("1", "0: products through cublasGemmEx instead of cuBLASLt",
                                kind="flag"),
    "CUPYTP_KEEP_CASTS": Variable("1", "1: autocast keeps every parameter's 16-bit cast between "
                                       "steps (AdamW writes it in its update pass; 2 bytes a "
                                       "parameter held between steps); 0: at most 256 MiB of "
                                       "them, the rest cast anew in every step", kind="flag"),
    "CUPYTP_GEMM_TUNE": Variable("1", "1: a product's first run outside a CUDA-graph capture "
                                      "times cuBLASLt's candidate algorithms and keeps the "
                                      "fastest; 0: the heuristic's first", kind="flag"),
    "CUPYTP_GEMM_CACHE": Variable("", "the file of the timed GEMM algorithm choices; unset: "
                                      "gemm_algorithms.json in $XDG_CACHE_HOME/cupytp or "
                                      "~/.cache/cupytp", kind="path"),
    "CUPYTP_CHECKPOINT_FAULT": Variable("", "test hook: <rank>:<point> kills that rank at that "
                                            "point of a checkpoint save",
                                        choices=("shard", "index", "renamed"), kind="fault"),
}

_WANTS = {"flag": "1 or 0", "seconds": "a number of seconds > 0",
          "fault": "<rank>:<point> with a point of shard, index or renamed"}


def get(name):
    """The parsed value of variable `name`: a str (choices, fault), a bool (flag) or a float
    (seconds); its default when unset or empty. An `EnvError` when the value is not understood."""
    variable = VARIABLES[name]
    raw = os.environ.get(name, "").strip()
    value = raw.lower() if variable.kind in ("choice", "flag") else raw
    value = value or variable.default
    if variable.kind == "flag" and value in _TRUE + _FALSE:
        return value in _TRUE
    if variable.kind == "seconds":
        try:
            seconds = float(value)
        except ValueError:
            seconds = float("nan")
        if seconds > 0 and seconds != float("inf"):
            return seconds
    if variable.kind == "path":
        return value
    if variable.kind == "fault" and (value == "" or _is_fault(value, variable.choices)):
        return value
    if variable.kind == "choice" and (value == "" or value in variable.choices):
        return value
    wants = _WANTS.get(variable.kind) or \
        f"{', '.join(variable.choices[:-1])} or {variable.choices[-1]}"
    raise EnvError(f"{name}={raw!r} is not understood: use {wants} ({variable.meaning}), "
                   f"or unset it")


def check():
    """Parse every CUPYTP_* variable that is set; an `EnvError` for the first one that is not
    understood, or whose name is one letter or two away from a variable of the package."""
    for name in sorted(os.environ):
        if not name.startswith(PREFIX):
            continue
        if name in VARIABLES:
            get(name)
            continue
        close = difflib.get_close_matches(name, VARIABLES, n=1, cutoff=0.85)
        if close:
            raise EnvError(f"{name} is not a cupytp variable: did you mean {close[0]}? "
                           f"(known: {', '.join(VARIABLES)})")


def _is_fault(value, points):
    rank, _, point = value.partition(":")
    return rank.isdigit() and point in points
