"""Deferred construction: tensors that exist as recipes until their layout is final.

Inside `with deferred_init():` the builders (`zeros`, `ones`, `full`, `randn`, `rand`, `arange`)
allocate nothing. Each returns a DTensor whose local array is a `Deferred`: the dtype, this
rank's local shape, and the `Recipe` that makes any block of the tensor's global value. A random
builder reserves its counters of the generator when it is called, as an eager build would, and
its recipe draws from them later: the generator gives every element its dense value, so a
tensor materialized in any layout holds exactly the block the dense tensor would hold.

Between building and materializing, parallelization chooses layouts freely (`relayout` of a
deferred tensor only relabels it), and `materialize_tensor` then allocates and fills this
rank's block alone: a model larger than one device is built on many without ever existing
whole. Any other use of a deferred tensor's data is an error that says to materialize first.
"""
import math
import threading
from contextlib import contextmanager

from cupytp import backend


CHUNK_ELEMENTS = 1 << 20      # elements made at once by a recipe


live = 0        # Deferred objects alive: while any is, modules check theirs before running


class DeferredError(RuntimeError):
    """A deferred tensor's values were asked for before it was materialized."""


class _State(threading.local):
    depth = 0


_state = _State()


@contextmanager
def deferred_init():
    """Builders inside make recipes, not arrays (nested regions are one region)."""
    _state.depth += 1
    try:
        yield
    finally:
        _state.depth -= 1


def is_deferring():
    """True inside `deferred_init()`."""
    return _state.depth > 0


class Recipe:
    """The global value of a deferred tensor: `shape`, `dtype` and `make(offsets, shape)`, which
    gives the block at `offsets` (any dtype; `block` casts it)."""

    def __init__(self, shape, dtype, make):
        self.shape, self.dtype, self.make = tuple(shape), backend.dtype(dtype), make

    def block(self, offsets, local_shape):
        """The C-contiguous block of shape `local_shape` at `offsets`, in `dtype`, made in
        pieces of whole rows of up to CHUNK_ELEMENTS each (a random fill's working arrays are
        several times its piece: bounded so, they stay small beside a large block)."""
        offsets, local_shape = tuple(offsets), tuple(local_shape)
        row = math.prod(local_shape[1:])
        rows = max(1, CHUNK_ELEMENTS // max(row, 1))
        if not local_shape or local_shape[0] <= rows:
            block = self.make(offsets, local_shape)
            return backend.xp.ascontiguousarray(block.astype(self.dtype, copy=False))
        out = backend.xp.empty(local_shape, self.dtype)
        for start in range(0, local_shape[0], rows):
            n = min(rows, local_shape[0] - start)
            out[start:start + n] = self.make((offsets[0] + start,) + offsets[1:],
                                             (n,) + local_shape[1:])
        return out

    def cast(self, dtype):
        return Recipe(self.shape, dtype, self.make)

    def padded(self, shape):
        """This value zero-extended to the larger global `shape` (its elements keep their
        indices)."""
        if len(shape) != len(self.shape) or any(n < m for n, m in zip(shape, self.shape)):
            raise ValueError(f"cannot pad a tensor of shape {self.shape} to {tuple(shape)}")

        def make(offsets, local_shape):
            out = backend.xp.zeros(local_shape, self.dtype)
            stops = [min(o + n, m) for o, n, m in zip(offsets, local_shape, self.shape)]
            inner = tuple(max(b - o, 0) for o, b in zip(offsets, stops))
            if all(inner):
                out[tuple(slice(0, n) for n in inner)] = self.block(offsets, inner)
            return out
        return Recipe(shape, self.dtype, make)


def from_fill(shape, fill, generator=None):
    """The recipe of a builder's `fill(global shape, offsets, local shape)`; with the random
    `generator` it draws from, the counters of the whole tensor are reserved now (a fill of an
    empty block advances the generator as a full draw would) and drawn from when a block is
    made."""
    shape = tuple(shape)
    state = None if generator is None else generator.snapshot()
    dtype = fill(shape, (0,) * len(shape), (0,) * len(shape)).dtype

    def make(offsets, local_shape):
        if generator is None:
            return fill(shape, offsets, local_shape)
        with generator.replaying(state):
            return fill(shape, offsets, local_shape)
    return Recipe(shape, dtype, make)


class Deferred:
    """Stands in for the local array of a tensor that is not materialized: its `recipe` (the
    global value), this rank's `shape` and the `dtype`. Metadata reads work; data reads raise
    DeferredError."""
    __slots__ = ("recipe", "shape")

    def __init__(self, recipe, shape):
        global live
        self.recipe, self.shape = recipe, tuple(shape)
        live += 1

    def __del__(self):
        global live
        live -= 1

    @property
    def dtype(self):
        return self.recipe.dtype

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def size(self):
        return math.prod(self.shape)

    @property
    def nbytes(self):
        """The bytes this block will take once materialized (it takes none now)."""
        return self.size * self.dtype.itemsize

    def astype(self, dtype, copy=True):
        return Deferred(self.recipe.cast(dtype), self.shape)

    def __repr__(self):
        return f"Deferred(shape={self.shape}, dtype={self.dtype})"

    def _refuse(self, *args, **kwargs):
        raise DeferredError(
            f"a tensor built inside cupytp.deferred_init() (global shape {self.recipe.shape}) "
            "has no values yet: call cupytp.materialize(model) (or materialize_tensor) after "
            "choosing its layout")

    __array__ = __getitem__ = __setitem__ = __iter__ = __len__ = __float__ = _refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __matmul__ = _refuse
    __rmatmul__ = __truediv__ = __rtruediv__ = __neg__ = __iadd__ = __imul__ = _refuse
    reshape = copy = view = sum = transpose = _refuse

    @property
    def __cuda_array_interface__(self):
        self._refuse()

    @property
    def T(self):
        self._refuse()


def is_deferred(tensor):
    """True when `tensor` (a DTensor) is not materialized."""
    return type(tensor._local) is Deferred


def check_materialized(tensors):
    """DeferredError if any of `tensors` has no values yet (before a kernel meets one: a device
    array function would fail on it with a less clear error)."""
    for tensor in tensors:
        if type(tensor._local) is Deferred:
            tensor._local._refuse()


def build(layout, fill, requires_grad, generator=None):
    """A deferred DTensor laid out as `layout` whose value `fill` gives (see `from_fill`)."""
    from cupytp.tensor.dtensor import DTensor
    tensor = DTensor._make(Deferred(from_fill(layout.shape, fill, generator),
                                    layout.local_shape), layout)
    tensor.requires_grad = bool(requires_grad)
    return tensor


def relabel(tensor, layout):
    """Give the deferred `tensor` the layout `layout` of the same global shape (no data)."""
    tensor._local = Deferred(tensor._local.recipe, layout.local_shape)
    tensor.layout = layout


def pad(tensor, shape):
    """Zero-extend the deferred `tensor`, in place, to the larger global `shape` (its layout's
    placements kept): rows past a vocabulary, say, added without drawing for them."""
    if not is_deferred(tensor):
        raise ValueError("pad: the tensor is materialized already; pad it inside "
                         "cupytp.deferred_init()")
    recipe = tensor._local.recipe.padded(shape)
    layout = type(tensor.layout)(tensor.mesh, recipe.shape, tensor.placements)
    tensor._local = Deferred(recipe, layout.local_shape)
    tensor.layout = layout


def materialize_tensor(tensor, initialize=True):
    """Allocate this rank's block of the deferred `tensor` in place and fill it from its
    recipe (uninitialized with `initialize=False`: before loading values). A tensor that is
    materialized already is left as it is."""
    if not is_deferred(tensor):
        return tensor
    recipe = tensor._local.recipe
    offsets, local_shape = tensor.layout.local_block()
    tensor._local = recipe.block(offsets, local_shape) if initialize else \
        backend.xp.empty(local_shape, recipe.dtype)
    return tensor
