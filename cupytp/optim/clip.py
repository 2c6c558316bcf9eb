"""Gradient clipping by the global norm over the whole mesh, with no host synchronisation."""
import functools
import math

import numpy

from cupytp import backend
from cupytp.launchers import compute_dtype
from cupytp.launchers.multi_tensor import scale_, sum_of_squares
from cupytp.optim.optimizer import check_non_negative, contiguous_grad
from cupytp.tensor import Partial, Replicated, from_local

NORM_OPS = {2.0: "sum", math.inf: "max"}


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, pp_mesh=None):
    """Scale every gradient in place by min(1, max_norm / (norm + 1e-6)) and return `norm`, the
    2-norm (or, with norm_type=inf, the max-norm) of all the gradients as global tensors, as a
    0-d device array that nothing here waits for.

    Each gradient counts once. Gradients are grouped by (mesh, mesh dims along which they are
    sharded); a group's local sum of squares (max of |g| for inf) is Partial over exactly those
    mesh dims and redistributed to Replicated (an all-reduce over each), not over the dims along
    which the group is Replicated (its ranks there hold the same values); then the groups are
    added (maxed). Parameters without a gradient are left out.

    `pp_mesh`: the 1-D mesh of a pipeline's stages (`Pipeline.pp_mesh`), whose ranks hold
    different parameters: the total is Partial over it too and reduced there (in float64), so
    every stage clips by the norm of the whole model. Every rank of it must call this, with or
    without gradients.
    """
    norm_type = float(norm_type)
    if norm_type not in NORM_OPS:
        raise ValueError(f"norm_type must be 2 or inf, got {norm_type}")
    check_non_negative(max_norm=max_norm)
    op = NORM_OPS[norm_type]
    groups = {}     # (mesh, sharded mesh dims) -> {grad dtype: [local grads]}
    for p in parameters:
        grad = p.grad
        if grad is None:
            continue
        layout = grad.layout
        by_dtype = groups.setdefault((layout.mesh, _sharded_dims(layout.placements)), {})
        by_dtype.setdefault(grad._local.dtype, []).append(contiguous_grad(p))
    xp = backend.xp
    totals = []
    for (mesh, dims), by_dtype in groups.items():
        partial = tuple(Partial(op) if d in dims else Replicated() for d in range(mesh.ndim))
        total = from_local(_local_total(by_dtype, op), mesh, partial, shape=(), run_check=False)
        totals.append(total.redistribute((Replicated(),) * mesh.ndim).to_local())
    total = _combine(totals, op) if totals else xp.zeros((), dtype=numpy.float32)
    if pp_mesh is not None:         # float64 on every stage, whatever its gradients' dtype
        stages = from_local(total.astype(numpy.float64), pp_mesh, (Partial(op),), shape=(),
                            run_check=False)
        total = stages.redistribute((Replicated(),)).to_local().astype(total.dtype)
    norm = xp.asarray(xp.sqrt(total) if op == "sum" else total)
    factor = xp.minimum(max_norm / (norm + 1e-6), 1.0)
    for by_dtype in groups.values():
        for grads in by_dtype.values():
            scale_(grads, factor)
    return norm


@functools.cache
def _sharded_dims(placements):
    """The mesh dims along which a tensor with `placements` is sharded."""
    return tuple(d for d, placement in enumerate(placements) if placement.is_shard())


def _local_total(by_dtype, op):
    """This rank's sum of g^2 ("sum") or max of |g| ("max") over lists of grads, one per dtype,
    accumulated in each dtype's compute dtype (float32 or float64)."""
    if op == "sum":
        return _combine([sum_of_squares(grads) for grads in by_dtype.values()], op)
    maxima = [backend.xp.abs(g).max().astype(compute_dtype(dtype))
              for dtype, grads in by_dtype.items() for g in grads if g.size]
    return _combine([backend.xp.zeros((), dtype=numpy.float32)] + maxima, op)


def _combine(values, op):
    """The sum or max of 0-d arrays, as a 0-d array of their promoted dtype (on the device)."""
    stacked = backend.xp.stack(values)
    return backend.xp.asarray(stacked.sum() if op == "sum" else stacked.max())
