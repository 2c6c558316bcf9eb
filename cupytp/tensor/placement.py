"""Placements: how a tensor lies along one mesh dimension.

`Shard(dim)`: split along tensor dimension `dim` (numpy.array_split sizes: the first ranks get
one more). `Replicated()`: a full copy on every rank. `Partial(op)`: every rank holds a part and
the value is their reduction (`op` "sum" or "max"), made only when an op needs it.
Printed short: `S(0)`, `R`, `P`, `P(max)`.
"""
import numbers
from dataclasses import dataclass, fields

_interned = {}


@dataclass(frozen=True, eq=False)
class Placement:
    """Placements are interned: equal placements are one object, so comparing and hashing them
    (layout checks and the rule caches of every op) costs an identity test."""

    def __new__(cls, *values):
        key = (cls, values)
        placement = _interned.get(key)
        if placement is None:
            placement = object.__new__(cls)
            for field, value in zip(fields(cls), values):
                object.__setattr__(placement, field.name, value)
            _interned[key] = placement
        return placement

    def __init__(self, *args, **kwargs):
        pass                          # fields are set once, by __new__

    def __reduce__(self):
        return type(self), tuple(getattr(self, f.name) for f in fields(self))

    def is_shard(self, dim=None):
        return False

    def is_replicated(self):
        return False

    def is_partial(self):
        return False


@dataclass(frozen=True, eq=False, init=False)
class Shard(Placement):
    dim: int

    def __new__(cls, dim):
        if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
            raise TypeError(f"Shard(dim) takes an integer tensor dimension, got {dim!r}")
        return super().__new__(cls, int(dim))

    def is_shard(self, dim=None):
        return dim is None or dim == self.dim

    def __str__(self):
        return f"S({self.dim})"


@dataclass(frozen=True, eq=False, init=False)
class Replicated(Placement):
    def __new__(cls):
        return super().__new__(cls)

    def is_replicated(self):
        return True

    def __str__(self):
        return "R"


PARTIAL_OPS = ("sum", "max")


@dataclass(frozen=True, eq=False, init=False)
class Partial(Placement):
    op: str = "sum"

    def __new__(cls, op="sum"):
        if op not in PARTIAL_OPS:
            raise ValueError(f"Partial op {op!r} is not one of {PARTIAL_OPS}")
        return super().__new__(cls, op)

    def is_partial(self):
        return True

    def __str__(self):
        return "P" if self.op == "sum" else f"P({self.op})"


def describe(placements):
    """A layout's placements as a short string: `[S(0), R]`."""
    return "[" + ", ".join(str(p) for p in placements) + "]"
