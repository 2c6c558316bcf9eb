"""Automatic mixed precision: contractions in a 16-bit dtype, parameters kept as fp32 masters.

Inside `autocast("bf16")` contractions (einsum, matmul, attention) and the bias of a linear layer
cast their floating operands through the differentiable `astype`, and layer_norm of a wider input
computes in float32 and returns the autocast dtype (its output feeds a contraction; one kernel
instead of a norm and a cast), so fp32 parameters get fp32
gradients. As in PyTorch's autocast, a parameter (a leaf that requires a gradient) is cast once
per autocast region: a weight used twice in a forward pass is one cast node, whose backward
casts the summed gradient once. A contraction takes a parameter's cast without a node
(`master_cast`) and writes its gradient in the parameter's dtype itself (cuBLAS's fp32 output
of 16-bit operands), so no cast pass runs over weight gradients. The cache is dropped when the outermost region exits and when an
optimizer steps (`clear_cache`), so a cast never outlives the values it was made from.
"""
import threading
from contextlib import contextmanager

from cupytp import backend
from cupytp.autograd import engine
from cupytp.launchers.cast import converted
from cupytp.ops.elementwise import astype


class _State(threading.local):
    dtype = None            # the autocast dtype (None: off)
    cache = None            # (id(parameter), dtype, grad mode) -> (parameter, its local, cast)


_state = _State()


@contextmanager
def autocast(dtype="bf16"):
    """Inside: contractions (einsum, matmul, attention) cast floating operands to `dtype`
    (through the differentiable cast, so fp32 parameters stay the masters and get fp32
    gradients); other ops keep their inputs' dtype. `autocast(None)` turns it off."""
    previous, previous_cache = _state.dtype, _state.cache
    _state.dtype = None if dtype is None else backend.dtype(dtype)
    if _state.cache is None:
        _state.cache = {}
    try:
        yield
    finally:
        _state.dtype, _state.cache = previous, previous_cache


def autocast_dtype():
    """The dtype of the enclosing autocast region (None outside one)."""
    return _state.dtype


def clear_cache():
    """Forget the casts of parameters made so far (an optimizer calls it when it steps)."""
    if _state.cache:
        _state.cache.clear()


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
    if hit is not None and hit[0] is x and hit[1] is x._local:
        return hit[2]
    cast = type(x)._make(converted(x._local, dtype), x.layout)     # no node: nothing records it
    _state.cache[key] = (x, x._local, cast)
    return cast


def autocast_operand(x):
    """`x` cast to the autocast dtype inside `autocast` (differentiably), else `x` itself; a
    parameter's cast is made once per autocast region."""
    dtype = _state.dtype
    if not _wants_cast(x, dtype):
        return x
    if not (x.requires_grad and x._node is None):
        return astype(x, dtype)
    key = (id(x), dtype, engine.is_grad_enabled())
    hit = _state.cache.get(key)
    if hit is not None and hit[0] is x and hit[1] is x._local and not engine.is_walked(hit[2]):
        return hit[2]
    cast = astype(x, dtype)
    _state.cache[key] = (x, x._local, cast)
    return cast


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
