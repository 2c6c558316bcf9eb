"""Module: parameters (leaf DTensors with requires_grad), buffers and child modules.

Attributes are found by type: a leaf DTensor that requires a gradient is a parameter, a Module is
a child, a ModuleList holds children by index. Names are dotted paths (`h.0.attn.c_attn.weight`),
and a parameter reached by two paths (tied weights) is listed once, under its first name.

Inside `track_calls()` (which cupytp.debug.CommTracer uses) every call of a module is kept on a
per-thread stack, `calling()`; outside it a call costs one test more than `forward`.
"""
import threading
from collections import OrderedDict
from contextlib import contextmanager

import numpy

from cupytp import backend
from cupytp.tensor import DTensor, deferred, is_deferred, materialize_tensor
from cupytp.tensor.layout import Layout


class Module:
    def __init__(self):
        object.__setattr__(self, "training", True)
        object.__setattr__(self, "_buffers", OrderedDict())

    def forward(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} has no forward()")

    def __call__(self, *args, **kwargs):
        if deferred.live:           # a tensor has no values yet: not one of this module's
            deferred.check_materialized(self.parameters())
        if not _tracking:
            return self.forward(*args, **kwargs)
        stack = _stack()
        stack.append(self)
        try:
            return self.forward(*args, **kwargs)
        finally:
            stack.pop()

    # ---- registration -------------------------------------------------------------------------
    def register_buffer(self, name, tensor):
        """A DTensor that is state but not trained (saved in state_dict)."""
        self._buffers[name] = tensor
        object.__setattr__(self, name, tensor)

    def _own(self):
        """(name, value) of this module's own parameters and children, in definition order."""
        buffers = self._buffers
        return [(name, value) for name, value in vars(self).items()
                if (isinstance(value, Module) or (isinstance(value, DTensor) and value.requires_grad
                                                  and value._node is None))
                and not name.startswith("_") and name not in buffers]

    # ---- traversal ----------------------------------------------------------------------------
    def named_children(self):
        for name, value in self._own():
            if isinstance(value, Module):
                yield name, value

    def children(self):
        return [module for _, module in self.named_children()]

    def named_modules(self, prefix=""):
        yield prefix, self
        for name, child in self.named_children():
            yield from child.named_modules(f"{prefix}.{name}" if prefix else name)

    def modules(self):
        return [module for _, module in self.named_modules()]

    def named_parameters(self, prefix=""):
        """(dotted name, parameter) in definition order; a tied parameter once, first name.
        (Collected into a list by one call per module: `parameters()` runs every step.)"""
        found = []
        self._collect_parameters(prefix, found, set())
        return iter(found)

    def _collect_parameters(self, prefix, found, seen):
        for name, value in self._own():
            full = f"{prefix}.{name}" if prefix else name
            if isinstance(value, Module):
                value._collect_parameters(full, found, seen)
            elif id(value) not in seen:
                seen.add(id(value))
                found.append((full, value))

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def tensors(self):
        """Every parameter (tied ones once) and buffer."""
        return self.parameters() + [b for _, b in self.named_buffers()]

    def named_buffers(self):
        for module_name, module in self.named_modules():
            for name, value in module._buffers.items():
                yield (f"{module_name}.{name}" if module_name else name), value

    # ---- state --------------------------------------------------------------------------------
    def state_dict(self):
        """{name: DTensor} of every parameter and buffer (each rank holds its shards)."""
        return self.sharded_state_dict()

    def sharded_state_dict(self):
        """{name: DTensor} of every parameter and buffer as this rank stores it: what
        checkpoints save and load_state_dict writes into. The same as state_dict(), except on a
        fully sharded model, whose state_dict() gathers the data-parallel shards."""
        return OrderedDict(list(self.named_parameters()) + list(self.named_buffers()))

    def load_state_dict(self, state, strict=True):
        """Copy values in: DTensors (redistributed to each parameter's placements) or full
        arrays (NumPy or device; each rank keeps its own block)."""
        own = self.sharded_state_dict()
        missing = [name for name in own if name not in state]
        unexpected = [name for name in state if name not in own]
        if strict and (missing or unexpected):
            raise KeyError(f"load_state_dict: missing keys {missing}, unexpected keys "
                           f"{unexpected}")
        for name, target in own.items():
            if name in state:
                assign(target, state[name], name)
        return missing, unexpected

    # ---- modes and types ------------------------------------------------------------------------
    def train(self, mode=True):
        for module in self.modules():
            object.__setattr__(module, "training", mode)
        return self

    def eval(self):
        return self.train(False)

    def zero_grad(self):
        for p in self.parameters():
            p.grad = None

    def to(self, dtype):
        """Cast every floating parameter and buffer to `dtype`, in place."""
        dtype = backend.dtype(dtype)
        for tensor in self.tensors():
            if tensor.dtype.kind == "f" or tensor.dtype == backend.bfloat16:
                tensor._local = tensor._local.astype(dtype)
                tensor.grad = None
        return self

    def num_parameters(self):
        return sum(p.size for p in self.parameters())


_tracking = 0                   # how many track_calls() are open
_calls = threading.local()


def _stack():
    if not hasattr(_calls, "stack"):
        _calls.stack = []
    return _calls.stack


@contextmanager
def track_calls():
    """Keep the modules being called on a per-thread stack while inside."""
    global _tracking
    _tracking += 1
    try:
        yield
    finally:
        _tracking -= 1


def calling():
    """The modules being called on this thread, outermost first (empty outside
    track_calls())."""
    return tuple(_stack())


def materialize(module, initialize=True):
    """Allocate and fill, in place, this rank's block of every parameter and buffer of `module`
    built inside `cupytp.deferred_init()`, in the layout it has now (choose layouts first:
    apply_tensor_parallel, fully_shard). `initialize=False` leaves the blocks uninitialized,
    for values loaded next (a checkpoint). Returns the module."""
    for tensor in module.tensors():
        materialize_tensor(tensor, initialize)
    return module


def is_materialized(module):
    """True when no parameter or buffer of `module` is deferred."""
    return not any(is_deferred(t) for t in module.tensors())


def assign(target, value, name="tensor"):
    """Overwrite `target`'s values (in place) from a DTensor or a full array."""
    if isinstance(value, DTensor):
        if value.shape != target.shape:
            raise ValueError(f"{name}: shape {value.shape} does not match {target.shape}")
        value = value.redistribute(target.placements).to_local()
    else:
        value = numpy.asarray(value) if not isinstance(value, backend.xp.ndarray) else value
        if tuple(value.shape) != target.shape:
            raise ValueError(f"{name}: shape {tuple(value.shape)} does not match {target.shape}")
        layout = Layout(target.mesh, target.shape, target.placements)
        offsets, local_shape = layout.local_block()
        block = value[tuple(slice(o, o + n) for o, n in zip(offsets, local_shape))]
        if any(p.is_partial() for p in target.placements):
            raise ValueError(f"{name}: cannot load a full array into a Partial tensor")
        value = backend.asarray(block)
    target.to_local()[...] = value.astype(target.dtype)     # counted: casts made of it renew


class ModuleList(Module):
    """A list of modules, named by index (`h.0`, `h.1`, ...)."""

    def __init__(self, modules=()):
        super().__init__()
        for module in modules:
            self.append(module)

    def append(self, module):
        object.__setattr__(self, str(len(self)), module)
        return self

    def __iter__(self):
        return iter(self.children())

    def __getitem__(self, index):
        return self.children()[index]

    def __len__(self):
        return len(self.children())


class Sequential(ModuleList):
    """Modules applied in order."""

    def __init__(self, *modules):
        super().__init__(modules)

    def forward(self, x):
        for module in self:
            x = module(x)
        return x
