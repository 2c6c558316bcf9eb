"""Placements: how a tensor lies along one mesh dimension.

`Shard(dim)`: split along tensor dimension `dim` (numpy.array_split sizes: the first ranks get
one more). `Replicated()`: a full copy on every rank. `Partial(op)`: every rank holds a part and
the value is their reduction (`op` "sum" or "max"), made only when an op needs it.
Printed short: `S(0)`, `R`, `P`, `P(max)`.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    def is_shard(self, dim=None):
        return False

    def is_replicated(self):
        return False

    def is_partial(self):
        return False


@dataclass(frozen=True)
class Shard(Placement):
    dim: int

    def is_shard(self, dim=None):
        return dim is None or dim == self.dim

    def __str__(self):
        return f"S({self.dim})"


@dataclass(frozen=True)
class Replicated(Placement):
    def is_replicated(self):
        return True

    def __str__(self):
        return "R"


PARTIAL_OPS = ("sum", "max")


@dataclass(frozen=True)
class Partial(Placement):
    op: str = "sum"

    def __post_init__(self):
        if self.op not in PARTIAL_OPS:
            raise ValueError(f"Partial op {self.op!r} is not one of {PARTIAL_OPS}")

    def is_partial(self):
        return True

    def __str__(self):
        return "P" if self.op == "sum" else f"P({self.op})"


class ShardingType:
    """The placements under one name, as in `ShardingType.Shard(1)`."""
    Shard = Shard
    Replicated = Replicated
    Partial = Partial


def describe(placements):
    """A layout's placements as a short string: `[S(0), R]`."""
    return "[" + ", ".join(str(p) for p in placements) + "]"
