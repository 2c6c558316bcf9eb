"""What every op shares: input conversion by the automatic rules, errors, recording. The
conversions themselves are `cupytp.tensor.redistribute`'s (the one home of redistribution).

Sharding rules ask for input placements; only changes that need no gathering happen by
themselves: a Partial input is reduced (the lazy reduction: all-reduce, or reduce-scatter when a
Shard is wanted) and a Replicated input is sliced to a Shard. Anything else (a Shard input that
would have to be gathered or moved) is a ShardingError naming the op, the layouts, and the
redistribute that would make it work; along a mesh dimension of one rank, where no change moves
data, every change happens by itself.
"""
import numbers

from cupytp import backend
from cupytp.autograd import engine
from cupytp.tensor.dtensor import DTensor
from cupytp.tensor.layout import Layout
from cupytp.tensor.placement import Partial, Replicated, Shard, describe
from cupytp.tensor.redistribute import (
    check_same_mesh, describe_layouts, grad_placements, redistribute)


class ShardingError(ValueError):
    """An op was called on layouts it has no rule for."""


def fail(op, tensors, why, advice):
    raise ShardingError(f"{op}: no sharding rule for inputs {describe_layouts(tensors)}: {why}. "
                        f"{advice}")


def is_tensor(x):
    return isinstance(x, DTensor)


_rules = {}
_ndarray = backend.xp.ndarray


def cached(key, rule, *args):
    """`rule(*args)`, computed once per `key` (the inputs' shapes and placements, hashed fast
    since placements are interned): an op's sharding rule runs once per layout signature, not
    once per call. A rule that raises caches nothing, so every bad call gets its error."""
    result = _rules.get(key)
    if result is None:
        if len(_rules) >= 65536:
            _rules.clear()
        result = _rules[key] = rule(*args)
    return result


def make(local, mesh, shape, placements):
    """A DTensor from an op's local result (NumPy's full reductions give scalars: wrapped)."""
    if local is not None and not isinstance(local, _ndarray):
        local = backend.xp.asarray(local)
    return DTensor._make(local, Layout.trusted(mesh, tuple(shape), tuple(placements)))


def automatic(current, target):
    """True when `current` → `target` on one mesh dim may happen without being asked."""
    return current == target or current.is_partial() or (
        current.is_replicated() and isinstance(target, Shard))


def convert(op, x, placements, inputs):
    """`x` redistributed to `placements` where the automatic rules allow it (and along mesh
    dimensions of one rank, where no change moves data), else ShardingError."""
    placements = tuple(placements)
    if x.placements == placements:
        return x
    for current, target, ranks in zip(x.placements, placements, x.mesh.shape):
        if ranks > 1 and not automatic(current, target):
            fail(op, inputs, f"it needs {x.shape}{describe(x.placements)} as "
                 f"{describe(placements)}",
                 f"Call .redistribute({describe(placements)}) on that input first (or choose "
                 "placements the op accepts).")
    return redistribute(x, placements)


def scalar_or_tensor(op, x):
    """Python numbers stay numbers; arrays must be DTensors on the same mesh."""
    if isinstance(x, numbers.Number) or is_tensor(x):
        return x
    raise TypeError(f"{op}: cannot combine a DTensor with {type(x).__name__}; wrap arrays with "
                    "cupytp.distribute or DTensor.from_local")


def same_mesh(op, tensors):
    if len(tensors) > 1:
        check_same_mesh(op, [t for t in tensors if is_tensor(t)])


def reduce_all(op, x):
    """`x` with every Partial placement reduced to Replicated (the lazy reduction)."""
    return convert(op, x, grad_placements(x.placements), [x])


def linear_grad(g, placements, strict=()):
    """The gradient `g` of an op's output that had `placements`, ready for a backward that is
    linear in it: a Partial gradient may stay Partial (except on the mesh dims in `strict`,
    where the input is sharded); anything else is made to match the output's gradient layout."""
    key = (linear_grad, g.placements, tuple(placements), frozenset(strict))
    target = cached(key, _linear_grad_placements, *key[1:])
    if g.placements != target:
        g = redistribute(g, target)
    return g


def _linear_grad_placements(grad, placements, strict):
    return tuple(gp if gp.is_partial() and p.is_replicated() and dim not in strict else p
                 for dim, (gp, p) in enumerate(zip(grad, grad_placements(placements))))


# names the op modules take from here along with the helpers
__all__ = ["ShardingError", "Partial", "Replicated", "Shard", "backend", "engine", "DTensor",
           "Layout", "cached", "convert", "fail", "is_tensor", "linear_grad", "make",
           "redistribute", "reduce_all", "same_mesh", "scalar_or_tensor"]
