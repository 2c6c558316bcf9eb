"""Automatic mixed precision: contractions in a 16-bit dtype, parameters kept as fp32 masters.

Inside `autocast("bf16")` contractions (einsum, matmul, attention) and the bias of a linear layer
cast their floating operands through the differentiable `astype`, and layer_norm of a wider input
computes in float32 and returns the autocast dtype (its output feeds a contraction; one kernel
instead of a norm and a cast), so fp32 parameters get fp32
gradients. As in PyTorch's autocast, a parameter (a leaf that requires a gradient) is cast once
per autocast region: a weight used twice in a forward pass is one cast node, whose backward
casts the summed gradient once (forwards whose backwards run apart, such as a pipeline's
micro-batches, make their own: `separate_casts`). A contraction takes a parameter's cast without a node
(`master_cast`) and writes its gradient in the parameter's dtype itself (cuBLAS's fp32 output
of 16-bit operands), so no cast pass runs over weight gradients.

A region's casts are dropped when the outermost region exits and when an optimizer steps, so a
cast never outlives the values it was made from. The memory of an fp32 parameter's bf16 or fp16
cast is kept between regions, though: the first parameter cast of a region rewrites them from
their parameters' current values in one launch (`multi_tensor.cast_`), where one cast and one
allocation per parameter would cost a small model's host more than its device. All of them are
kept (`CUPYTP_KEEP_CASTS=1`, the default): a cast lives from its first use in a forward to its
last in the backward anyway, so holding it between steps too leaves a training step's peak
(the end of its forward) where it was, and adds 2 bytes a parameter outside it. With
`CUPYTP_KEEP_CASTS=0` at most KEEP_BYTES of them are kept (a small model's). An optimizer
whose kernel writes a kept cast beside its parameter's new value (AdamW: `kept_cast`,
`casts_written`) spares that launch the cast: the next region enters it as it is.
`clear_cache()` frees them.
"""
import itertools
import sys
import threading
import weakref
from contextlib import contextmanager

import numpy

from cupytp import backend, env, graph
from cupytp.autograd import engine
from cupytp.launchers.cast import converted
from cupytp.launchers.multi_tensor import cast_
from cupytp.ops.elementwise import astype
from cupytp.tensor.dtensor import parameter_reads


KEEP_BYTES = 256 * 2 ** 20      # with CUPYTP_KEEP_CASTS=0, the most memory of casts kept
#                                 between regions, per thread


class _Kept(dict):
    """The kept casts: (id(parameter), dtype) -> (weak reference to the parameter, its local
    array, cast): all of them, or with CUPYTP_KEEP_CASTS=0 up to KEEP_BYTES in all (a small
    model's, whose step is host-bound). An entry goes with its parameter."""

    def __init__(self):
        super().__init__()
        self.nbytes = 0

    def keep(self, key, x, cast):
        self.drop(key)                  # a cast made again (its parameter's array replaced)
        if env.get("CUPYTP_KEEP_CASTS") or self.nbytes + cast._local.nbytes <= KEEP_BYTES:
            self.nbytes += cast._local.nbytes
            self[key] = (weakref.ref(x, lambda _: self.drop(key)), x._local, cast)

    def drop(self, key):
        entry = self.pop(key, None)
        if entry is not None:
            self.nbytes -= entry[2]._local.nbytes

    def clear(self):
        super().clear()
        self.nbytes = 0


class _State(threading.local):
    def __init__(self):
        self.dtype = None       # the autocast dtype (None: off)
        self.cache = None       # (id(parameter), dtype, grad mode, graph) -> (parameter, its
        #                         local, cast); "graph" tells apart forwards with backwards
        #                         of their own (`separate_casts`)
        self.graph = 0
        self.kept = _Kept()     # (id(parameter), dtype) -> (weak reference, its local, cast)
        self.fresh = False      # whether this region's kept casts hold the current values
        self.written = set()    # keys of kept casts an optimizer wrote with their parameters'
        #                         new values since the last parameters_changed()
        self.written_at = 0     # parameter_reads() then: a parameter handed out since may
        #                         have been written in place, so all are cast again


_state = _State()


@contextmanager
def autocast(dtype="bf16"):
    """Inside: contractions (einsum, matmul, attention) cast floating operands to `dtype`
    (through the differentiable cast, so fp32 parameters stay the masters and get fp32
    gradients); other ops keep their inputs' dtype. `autocast(None)` turns it off."""
    previous, previous_cache = _state.dtype, _state.cache
    _state.dtype = None if dtype is None else backend.dtype(dtype)
    if _state.cache is None:
        _state.cache, _state.fresh = {}, False
    try:
        yield
    finally:
        _state.dtype, _state.cache = previous, previous_cache


_graphs = itertools.count(1)


@contextmanager
def separate_casts():
    """Inside: the recorded casts of parameters are made afresh, not shared with the rest of
    the region: for a forward pass whose backward runs apart from the region's others (a
    pipeline's micro-batches, all in one region), since a backward frees the cast node it
    walks. The unrecorded casts that contractions read (`master_cast`) are still shared."""
    previous, _state.graph = _state.graph, next(_graphs)
    try:
        yield
    finally:
        _state.graph = previous


def autocast_dtype():
    """The dtype of the enclosing autocast region (None outside one)."""
    return _state.dtype


def clear_cache():
    """Forget the casts of parameters made so far and free the memory kept for them."""
    parameters_changed()
    _state.kept.clear()


def parameters_changed():
    """The parameters' values changed (an optimizer calls it when it steps): their casts are
    made again when next needed."""
    if _state.cache:
        _state.cache.clear()
    _state.fresh = False
    _state.written.clear()


def kept_cast(x):
    """(key, array) of a kept cast of parameter `x` that an optimizer may write with x's new
    value in its update pass, or None: one of x's current array that nothing else reads (no
    recorded op that has yet to run; the graph being captured may keep it)."""
    if not _state.kept:
        return None                     # nothing kept (a large model's casts are not)
    for dtype in _CAST_DTYPES:
        key = (id(x), dtype)
        entry = _state.kept.get(key)
        if entry is None or entry[0]() is not x or entry[1] is not x._local:
            continue
        held = _holders(entry)              # before any name here refers to the cast
        local = entry[2]._local
        if held == (_SOLE_HOLDERS[0], _SOLE_HOLDERS[1] + int(graph.kept_by_capture(local))):
            graph.keep_alive(local)     # a captured step writes it on every replay
            return key, local
    return None


def casts_written(keys):
    """The kept casts of `keys` (from `kept_cast`) hold their parameters' new values: the next
    region takes them as they are (after `parameters_changed()`, which the step called first),
    unless a parameter's array is handed out (`DTensor.to_local`) before: the refresh then casts
    them all again, as it does without an optimizer's writing."""
    _state.written.update(keys)
    _state.written_at = parameter_reads()
    if graph.is_capturing():
        record = graph.join(_TAKEN)
        record["keys"] = record.get("keys", set()).difference(keys)


class _TakenCasts(graph.GraphState):
    """The casts a captured forward took as an optimizer wrote them (no cast pass in the graph)
    that the captured step's own optimizer does not write (`record["keys"]`; a capture without
    an optimizer's step, say): cast before every replay from their parameters' values then."""

    def capture_begin(self, record):
        record["keys"] = set()

    def capture_end(self, record):
        entries = [_state.kept[key] for key in record.pop("keys") if key in _state.kept]
        record["pairs"] = ([entry[1] for entry in entries], [entry[2]._local for entry in entries])

    def before_replay(self, record):
        cast_(*record["pairs"])


_TAKEN = _TakenCasts()


def _wants_cast(x, dtype):
    return dtype is not None and x.dtype != dtype and x.dtype.kind in "fV"


def master_cast(x):
    """A parameter's cast to the autocast dtype made without recording (None when `x` is not a
    parameter, a leaf that requires a gradient, needing a cast): the op that uses it records `x`
    itself and gives its gradient in x's dtype. Made once per autocast region."""
    dtype = _state.dtype
    if not _wants_cast(x, dtype) or not x.requires_grad or x._node is not None:
        return None
    key = (id(x), dtype, "master")
    hit = _state.cache.get(key)
    if hit is None and not _state.fresh:
        _refresh(dtype)
        hit = _state.cache.get(key)
    if hit is not None and hit[0] is x and hit[1] is x._local:
        return hit[2]
    cast = type(x)._make(converted(x._local, dtype), x.layout)     # no node: nothing records it
    _state.cache[key] = (x, x._local, cast)
    if x.dtype == numpy.float32 and dtype.itemsize == 2 and not graph.is_capturing():
        _state.kept.keep((id(x), dtype), x, cast)
    return cast


def _refresh(dtype):
    """Rewrite the kept casts to `dtype` from their parameters' current values, in one launch,
    and enter them in this region's cache (a kept cast whose parameter is gone or holds another
    array is dropped)."""
    _state.fresh = True
    sources, targets = [], []
    current = _state.written if _state.written_at == parameter_reads() else ()
    for key, entry in list(_state.kept.items()):
        x, local = entry[0](), entry[1]
        written = key in current                # by the optimizer: current, whoever holds it
        if x is None or x._local is not local or \
                (not written and _holders(entry) != _SOLE_HOLDERS):
            _state.kept.drop(key)       # gone, replaced, or still read by an unfinished graph
        elif key[1] == dtype:
            cast = entry[2]
            if not written:
                sources.append(local)
                targets.append(cast._local)
            elif graph.is_capturing():      # the step's optimizer is to write it (casts_written)
                graph.join(_TAKEN)["keys"].add(key)
            graph.keep_alive(cast._local)   # a captured step reads it (and may write it) on
            #                                 every replay
            _state.cache[(key[0], dtype, "master")] = (x, local, cast)
    cast_(sources, targets)


def autocast_operand(x):
    """`x` cast to the autocast dtype inside `autocast` (differentiably), else `x` itself; a
    parameter's cast is made once per autocast region."""
    dtype = _state.dtype
    if not _wants_cast(x, dtype):
        return x
    if not (x.requires_grad and x._node is None):
        return astype(x, dtype)
    key = (id(x), dtype, engine.is_grad_enabled(), _state.graph)
    hit = _state.cache.get(key)
    if hit is not None and hit[0] is x and hit[1] is x._local and not engine.is_walked(hit[2]):
        return hit[2]
    cast = astype(x, dtype)
    _state.cache[key] = (x, x._local, cast)
    return cast


def _holders(entry):
    """(references to the cast of a kept `entry`, references to its array) as seen here: more
    than `_SOLE_HOLDERS` when a recorded op still holds it (a backward not yet run)."""
    cast = entry[2]
    return sys.getrefcount(cast), sys.getrefcount(cast._local)


class _Cast:
    def __init__(self):
        self._local = bytearray()


_SOLE_HOLDERS = _holders((None, None, _Cast()))     # a cast only its entry holds
_CAST_DTYPES = (backend.dtype("bf16"), backend.dtype("fp16"))   # the kept casts' dtypes


def operand_dtype(x):
    """The dtype a contraction reads `x` in: the autocast dtype where x is cast, else x's."""
    return _state.dtype if _wants_cast(x, _state.dtype) else x.dtype


def autocast_local(x):
    """The local array a contraction reads for `x`, recording nothing (a fused op records its
    inputs themselves): inside `autocast` x's cast (a parameter's made once per region, as
    `master_cast`'s), else x's own array."""
    dtype = _state.dtype
    if not _wants_cast(x, dtype):
        return x._local
    cast = master_cast(x)
    return converted(x._local, dtype) if cast is None else cast._local
