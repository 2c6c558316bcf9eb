"""DTensor: a raw array (CuPy or NumPy) plus the Layout that says which part of what it holds.

There is no other tensor class: a single-process tensor is a DTensor on a one-rank mesh. Ops come
from `cupytp.ops` (each a sharding rule + local forward + local backward), which attaches the
operators and math methods (`+`, `@`, `[...]`, `sum`, `reshape`, ...) to this class when it is
imported (`cupytp/ops/methods.py`): the tensor layer does not know the ops above it.
"""
import functools
import math
import sys
import weakref

import numpy

from cupytp import backend
from cupytp.autograd import engine
from cupytp.tensor.deferred import is_deferred
from cupytp.tensor.layout import Layout
from cupytp.tensor.placement import Replicated, describe
from cupytp.tensor.redistribute import grad_placements, redistribute, redistribute_local


_parameter_reads = [0]


def parameter_reads():
    """How many times a parameter's local array has been handed out by `to_local()` (a count
    that moves whenever a parameter may have been written in place other than by an
    optimizer's kernels)."""
    return _parameter_reads[0]


class DTensor:
    __slots__ = ("_local", "layout", "requires_grad", "grad", "_node", "__weakref__")
    __array_priority__ = 1000      # NumPy/CuPy defer `array <op> DTensor` to us

    def __init__(self, local, layout, requires_grad=False):
        if not isinstance(local, backend.xp.ndarray):
            raise TypeError(f"a DTensor holds a {backend.xp.__name__} array, got "
                            f"{type(local).__name__}")
        if tuple(local.shape) != layout.local_shape:
            raise ValueError(f"local array of shape {local.shape} does not match {layout} "
                             f"(this rank's part is {layout.local_shape})")
        self._local = local
        self.layout = layout
        self.requires_grad = bool(requires_grad)
        self.grad = None
        self._node = None

    @classmethod
    def _make(cls, local, layout):
        """A DTensor without checks, for ops that computed `local` from `layout` themselves."""
        tensor = cls.__new__(cls)
        tensor._local = local
        tensor.layout = layout
        tensor.requires_grad = False
        tensor.grad = None
        tensor._node = None
        return tensor

    # ---- metadata -------------------------------------------------------------------------------
    @property
    def shape(self):
        return self.layout.shape

    @property
    def ndim(self):
        return len(self.layout.shape)

    @property
    def size(self):
        return math.prod(self.layout.shape)

    @property
    def local_shape(self):
        return tuple(self._local.shape)

    @property
    def placements(self):
        return self.layout.placements

    @property
    def mesh(self):
        return self.layout.mesh

    @property
    def dtype(self):
        return self._local.dtype

    @property
    def is_leaf(self):
        return self._node is None

    def __repr__(self):
        grad = ", requires_grad=True" if self.requires_grad else ""
        deferred = ", deferred" if is_deferred(self) else ""
        return (f"DTensor(shape={self.shape}, placements={describe(self.placements)}, "
                f"dtype={self.dtype}, local_shape={self.local_shape}{grad}{deferred})")

    def __len__(self):
        return self.shape[0]

    # ---- data -----------------------------------------------------------------------------------
    def to_local(self):
        """This rank's array (no gradient flows through it). A parameter's (a leaf that
        requires a gradient) counts in `parameter_reads`: its values may be written in place
        through it."""
        if self.requires_grad and self._node is None:
            _parameter_reads[0] += 1
        return self._local

    def full_tensor(self):
        """The global value as one array on every rank (gathers/reduces as needed)."""
        if self.layout.is_replicated():
            return self._local
        target = (Replicated(),) * self.mesh.ndim
        local, _ = redistribute_local(self._local, self.layout, target)
        return local

    def numpy(self):
        """The global value as a NumPy array on every rank."""
        return backend.asnumpy(self.full_tensor())

    def item(self):
        """The global value of a one-element tensor as a Python number (synchronizes)."""
        if self.size != 1:
            raise ValueError(f"item() needs one element, this tensor has shape {self.shape}")
        return self.numpy().reshape(()).item()

    def detach(self):
        return DTensor._make(self._local, self.layout)

    def redistribute(self, placements, async_op=False):
        """This tensor with `placements` (one per mesh dimension); see cupytp.tensor.redistribute.

        With `async_op=True` returns a Work whose wait() gives the DTensor.
        """
        return redistribute(self, placements, async_op)

    # ---- autograd -------------------------------------------------------------------------------
    def requires_grad_(self, flag=True):
        if not self.is_leaf:
            raise RuntimeError("requires_grad_ on a tensor computed by ops: only leaves can "
                               "change it")
        self.requires_grad = flag
        return self

    def backward(self, grad=None):
        """d self / d leaves, accumulated into every leaf's `.grad`. `grad` defaults to 1 for a
        one-element tensor."""
        if grad is None:
            if self.size != 1:
                raise RuntimeError(f"backward() without a gradient needs a one-element tensor, "
                                   f"got shape {self.shape}")
            local = backend.xp.ones(self.local_shape, dtype=self.dtype)
            grad = DTensor._make(local, self.layout.with_placements(
                grad_placements(self.placements)))
        elif not isinstance(grad, DTensor) or grad.shape != self.shape:
            raise ValueError(f"backward: grad must be a DTensor of shape {self.shape}")
        engine.backward(self, grad)

    def accumulate_grad(self, grad, complete=True):
        """Add a gradient contribution (None: none) into `.grad`, laid out like this tensor,
        except that a Partial contribution stays Partial along mesh dimensions of more than
        one rank where this tensor is not sharded: the gradient of a parameter replicated over
        a data-parallel dimension is each rank's sum until the data-parallel engine
        (`cupytp.parallel`) reduces it. The tensor layer never decides when gradients move.
        A tensor with a gradient sink (`set_grad_sink`) hands the contribution and
        `complete` (the last of this backward pass) to the sink instead.

        The first contribution becomes `.grad` itself when nothing else holds it or its buffer
        (a backward pass hands over the fresh gradients its ops made, as PyTorch's AccumulateGrad
        steals an unshared one), else it is copied into a buffer of its own; later contributions
        are added into that buffer in place, so a gradient kept between steps
        (zero_grad(set_to_none=False)) keeps its address."""
        entry = _grad_sinks.get(id(self))
        if entry is not None:
            sink = entry[1]()
            if sink is not None and entry[0]() is self:
                sink(self, grad, complete)
                return
            del _grad_sinks[id(self)]       # its owner is gone
        if grad is None:
            return
        handed_over = (sys.getrefcount(grad) <= _SOLE_ARGUMENT
                       and sys.getrefcount(grad._local) <= _SOLE_ATTRIBUTE
                       and _owns_its_memory(grad._local))
        target = leaf_grad_placements(self.placements, grad.placements, self.mesh.shape)
        reduced = _grad_reductions.get(id(self))
        if reduced is not None and reduced[0]() is self:
            if engine.in_backward():        # reduced at the end of the pass, with the others
                if any(target[d].is_partial() for d in reduced[1]):
                    _pending_reductions.append(self)
                    engine.queue_callback(_reduce_pending, once=True)
            else:
                target = tuple(grad_placements((t,))[0] if d in reduced[1] else t
                               for d, t in enumerate(target))
        if self.grad is not None and self.grad.placements != target:
            target = _either_partial(target, self.grad.placements)
            if self.grad.placements != target:      # Replicated -> Partial: no data moves
                local, layout = redistribute_local(self.grad._local, self.grad.layout, target)
                self.grad = DTensor._make(local, layout)
        if grad.placements != target:
            if _moves_no_data(grad.placements, target, self.mesh.shape):
                local = grad._local
            else:
                local, _ = redistribute_local(grad._local, grad.layout, target)
                handed_over = handed_over and local.base is None
            grad = DTensor._make(local, self.layout.with_placements(target))
        local = grad._local
        if grad.dtype != self.dtype:
            local, handed_over = local.astype(self.dtype), True
        if self.grad is not None:
            self.grad._local += local
        elif handed_over and backend.c_contiguous(local):
            self.grad = DTensor._make(local, grad.layout)
        else:
            self.grad = DTensor._make(backend.xp.array(local, copy=True, order="C"),
                                      grad.layout)

    def grad_to_sum_into(self, placements, dtype):
        """The local array of `.grad` into which a gradient contribution laid out by
        `placements`, of `dtype`, may be summed in place, just as `accumulate_grad` would sum it;
        None where that would do more (no `.grad` yet, a gradient sink or a data-parallel
        reduction to serve, a redistribution or a cast on the way, a buffer that is not
        contiguous). An op that sums into it gives no gradient for this tensor (a tied
        embedding table: its lookup's gradient joins the output product's)."""
        grad = self.grad
        if grad is None or self._node is not None or id(self) in _grad_sinks or \
                id(self) in _grad_reductions or dtype != self.dtype or \
                not backend.c_contiguous(grad._local):
            return None
        target = leaf_grad_placements(self.placements, tuple(placements), self.mesh.shape)
        return grad._local if target == grad.placements and \
            _moves_no_data(tuple(placements), target, self.mesh.shape) else None

    def zero_grad(self):
        self.grad = None


_grad_sinks = {}        # id(tensor) -> (weak ref to it, weak ref to its sink method)


def set_grad_sink(tensor, sink):
    """Hand `tensor`'s gradient contributions to `sink(tensor, grad or None, complete)`, a bound
    method, instead of accumulating them into `.grad` (None: accumulate again). The data-parallel
    engine (`cupytp.parallel`) registers its parameters here. Both are held weakly: once the
    sink's owner (a model's schedule) is gone, the tensor accumulates into `.grad` again."""
    key = id(tensor)
    if sink is None:
        _grad_sinks.pop(key, None)
        return

    def forget(ref):
        if _grad_sinks.get(key, (None,))[0] is ref:
            del _grad_sinks[key]
    _grad_sinks[key] = (weakref.ref(tensor, forget), weakref.WeakMethod(sink))


_grad_reductions = {}   # id(tensor) -> (weak ref to it, mesh dims its Partial gradients leave)


def reduce_grad_over(tensor, dims, partial=False):
    """Reduce `tensor`'s Partial gradient along mesh dims `dims` (indices): the conjugate
    collective of a layout in which a replicated parameter meets activations sharded there
    (sequence parallelism's norms and biases along tp), chosen by the plan that makes that
    layout (`cupytp.parallel`). Contributions of a backward pass stay Partial until the pass
    ends; then every such gradient of one layout is reduced in one collective, through a flat
    buffer (`_reduce_pending`). Partial contributions along other dims stay Partial for the
    data-parallel engine; a gradient sink takes precedence. `partial`: the plan's layout makes
    every contribution Partial along `dims`, so a data-parallel engine reduces them there
    together with its own dims, in its buckets (`grad_reduction`)."""
    key = id(tensor)

    def forget(ref):
        if _grad_reductions.get(key, (None,))[0] is ref:
            del _grad_reductions[key]
    _grad_reductions[key] = (weakref.ref(tensor, forget), frozenset(dims), bool(partial))


def grad_reduction(tensor):
    """(dims, partial) that `reduce_grad_over` gave `tensor`, or None."""
    entry = _grad_reductions.get(id(tensor))
    return None if entry is None or entry[0]() is not tensor else entry[1:]


_pending_reductions = []    # tensors whose gradient the pass in progress left Partial there


def _reduce_pending():
    """End of a backward pass: each gradient left Partial along the dims `reduce_grad_over`
    names, reduced there; those of one mesh, placements and dtype together, as one flat buffer
    (one all-reduce per mesh dimension, not one per parameter), each `.grad` keeping its
    memory. Every rank of those dims holds the same tensors in the same order."""
    tensors = list(dict.fromkeys(_pending_reductions))
    _pending_reductions.clear()
    groups = {}
    for tensor in tensors:
        grad, entry = tensor.grad, _grad_reductions.get(id(tensor))
        if grad is None or entry is None:
            continue
        target = tuple(grad_placements((p,))[0] if d in entry[1] else p
                       for d, p in enumerate(grad.placements))
        if target != grad.placements:
            key = (grad.mesh, grad.placements, target, grad.dtype)
            groups.setdefault(key, []).append(tensor)
    for (mesh, placements, target, _), members in groups.items():
        if any(p.is_shard() for p in placements):   # not a flat buffer's: one by one
            for tensor in members:
                tensor.grad = tensor.grad.redistribute(target)
            continue
        xp = backend.xp
        flat = xp.concatenate([t.grad._local.reshape(-1) for t in members])
        flat, _ = redistribute_local(flat, Layout(mesh, (flat.size,), placements), target)
        start = 0
        for tensor in members:
            local = tensor.grad._local
            local[...] = flat[start:start + local.size].reshape(local.shape)
            start += local.size
            tensor.grad = DTensor._make(local, tensor.grad.layout.with_placements(target))


@functools.lru_cache(maxsize=4096)
def leaf_grad_placements(placements, grad_placements_, mesh_shape):
    """The placements a leaf with `placements` keeps a contribution laid out as
    `grad_placements_` in: the leaf's (Partial made Replicated), except Partial where the
    contribution is Partial, the mesh dimension has more than one rank and the leaf is not
    sharded along it."""
    kept = grad_placements(placements)
    return tuple(g if g.is_partial() and n > 1 and not p.is_shard() else k
                 for p, g, k, n in zip(placements, grad_placements_, kept, mesh_shape))


def _moves_no_data(current, target, mesh_shape):
    """True when a local array laid out by `current` placements is already laid out by `target`:
    they differ only along mesh dimensions of one rank."""
    return all(c == t or n == 1 for c, t, n in zip(current, target, mesh_shape))


def _either_partial(a, b):
    """Placements Partial where `a` or `b` is, else `a`'s."""
    return tuple(y if y.is_partial() and not x.is_partial() else x for x, y in zip(a, b))


def _owns_its_memory(local):
    """True when `local` has no base, or is a whole view (a reshape, such as a contraction's
    result) of a base that nothing but `local` holds."""
    base, holders = _base_holders(local)
    return base is None or (getattr(base, "base", None) is None and base.size == local.size
                            and holders <= _SOLE_BASE)


def _base_holders(local):
    """(local.base, its reference count as seen here)."""
    base = getattr(local, "base", None)
    return base, sys.getrefcount(base)


_SOLE_BASE = _base_holders(numpy.zeros(4).reshape(2, 2))[1]   # a base only its view holds


def _sole_reference_counts():
    """sys.getrefcount inside a method of (an argument that only the caller's variable holds, an
    attribute value that only its object holds): what `accumulate_grad` sees of a gradient that
    nothing else holds, measured on this interpreter."""
    class Holder:
        def counts(self, other):
            return sys.getrefcount(other), sys.getrefcount(other._local)
    other = Holder()
    other._local = Holder()
    return Holder().counts(other)


_SOLE_ARGUMENT, _SOLE_ATTRIBUTE = _sole_reference_counts()
