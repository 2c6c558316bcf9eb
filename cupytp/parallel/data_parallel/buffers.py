"""Flat buffers: where the parameters and gradients of a group or bucket sit side by side, so
that one collective moves them all.

- `Slot`: a sharded parameter's place in its group's rows. Every rank's row holds its shard of
  each parameter of the group at the same offset (padded to the longest shard); `join` makes
  the full block from the gathered rows, `write` puts a full gradient's pieces into the rows.
- `ShardRows`: a group's flat gradient for sharding: `rows` [shards, width], the pieces of
  every rank's shard, reduce-scattered to this rank's row; `replicated` the gradients of the
  group's parameters that are not sharded, all-reduced.
- `Bucket`: replicated parameters whose gradients are all-reduced together in place from one
  flat buffer; each gradient is a view of its region, so `.grad` costs no memory of its own.

Regions start at multiples of ALIGN elements (aligned vector loads, 256-byte NCCL chunks).
"""
import math

import numpy

from cupytp import backend
from cupytp.launchers import cast
from cupytp.tensor import DTensor, Replicated
from cupytp.tensor.redistribute import grad_placements

ALIGN = 64


def aligned(n):
    return -(-n // ALIGN) * ALIGN


# ---- sharding: one parameter in a group's rows --------------------------------------------------
class Slot:
    """A parameter of a group: its master (this rank's shard), the modules' attributes that hold
    it, the layout of its gathered value (Replicated on the shard dim), the tensor dim the shard
    dim splits (None: Replicated there) with every shard's shape, and its offset in the rows
    (or, unsharded, in the flat gradient of replicated slots)."""

    def __init__(self, master, places, dim, offset):
        self.master, self.places = master, places
        layout = master.layout
        self.full_layout = layout.with_placements(tuple(
            Replicated() if d == dim else p for d, p in enumerate(layout.placements)))
        self.dim = layout.placements[dim].dim if layout.placements[dim].is_shard() else None
        coordinate = list(layout.mesh.get_coordinate())
        self.shapes = []
        for rank in range(layout.mesh.shape[dim]):
            coordinate[dim] = rank
            self.shapes.append(layout.local_block(coordinate)[1])
        self.sizes = [math.prod(s) for s in self.shapes]
        self.width = max(self.sizes) if self.dim is not None else self.sizes[0]
        self.offset = offset
        self.even = len(set(self.sizes)) == 1
        self.contiguous = (self.dim is not None and self.even and
                           all(n == 1 for n in self.full_layout.local_shape[:self.dim]))

    def split(self, full):
        """`full` (the gathered local block) cut along dim into every rank's shard."""
        starts = numpy.cumsum([0] + [s[self.dim] for s in self.shapes])
        index = [slice(None)] * full.ndim
        for a, b in zip(starts[:-1], starts[1:]):
            index[self.dim] = slice(a, b)
            yield full[tuple(index)]

    def join(self, rows):
        """The full local block from `rows` ([shards, width]: every rank's shard here)."""
        xp = backend.xp
        if self.contiguous:     # rank r's shard is the r-th piece of the block
            full = xp.empty(self.full_layout.local_shape, rows.dtype)
            backend.copy_rows(full.reshape(len(self.sizes), -1),
                              rows[:, self.offset:self.offset + self.sizes[0]])
            return full
        if self.even:
            block = rows[:, self.offset:self.offset + self.sizes[0]]
            block = block.reshape((len(self.sizes),) + self.shapes[0])
            return xp.moveaxis(block, 0, self.dim).reshape(self.full_layout.local_shape)
        return xp.concatenate([rows[r, self.offset:self.offset + n].reshape(shape)
                               for r, (n, shape) in enumerate(zip(self.sizes, self.shapes))],
                              axis=self.dim)

    def pieces(self, rows, local):
        """[(target region, source)] that put the full gradient `local` into `rows`: rank r's
        shard in row r."""
        if self.even:
            n, shape = self.sizes[0], local.shape
            split = local.reshape(shape[:self.dim] + (len(self.sizes), shape[self.dim] //
                                                      len(self.sizes)) + shape[self.dim + 1:])
            return [(rows[:, self.offset:self.offset + n],
                     backend.xp.moveaxis(split, self.dim, 0).reshape(len(self.sizes), n))]
        return [(rows[r, self.offset:self.offset + chunk.size], chunk.reshape(-1))
                for r, chunk in enumerate(self.split(local))]


def gather_row(slots, width, dtype):
    """This rank's row of a group's parameters ([width], `dtype`): each master's shard cast-copied
    in place at its offset, the padding of a shorter shard zeroed."""
    row = backend.xp.empty(width, dtype=dtype)
    for s in slots:
        local = s.master.to_local()
        cast.assign(row[s.offset:s.offset + local.size], local.reshape(-1), add=False)
        if local.size < s.width:
            row[s.offset + local.size:s.offset + s.width] = 0
    return row


class ShardRows:
    """A group's flat gradient in `dtype`: `rows` [shards, width] for its sharded slots,
    `replicated` [width] for the others. Made by the first fold of an accumulation (regions of
    slots without a gradient and the padding of uneven shards zeroed) and summed into by later
    folds (no_sync)."""

    def __init__(self, sharded, replicated, shards, width, replicated_width, dtype):
        xp = backend.xp
        self.rows = xp.empty((shards, width), dtype) if width else None
        self.replicated = xp.empty(replicated_width, dtype) if replicated_width else None
        for slot in sharded:
            if not slot.even:
                for r, n in enumerate(slot.sizes):      # the padding past a shorter shard
                    if n < slot.width:
                        self.rows[r, slot.offset + n:slot.offset + slot.width] = 0
        self.fresh = True

    def fold(self, slots, held):
        """Add the gradients `held` ({slot index: [full local gradients]}) into the buffers,
        each with one cast-copy or in-place add; on the first fold a slot without one is
        zeroed."""
        for slot in slots:
            parts = held.pop(slot.index, [])
            if self.fresh and not parts:
                self._zero(slot)
            for i, local in enumerate(parts):
                self._write(slot, local, add=i > 0 or not self.fresh)
        self.fresh = False

    def _zero(self, slot):
        if slot.dim is None:
            self.replicated[slot.offset:slot.offset + slot.sizes[0]] = 0
        else:
            self.rows[:, slot.offset:slot.offset + slot.width] = 0

    def _write(self, slot, local, add):
        if slot.dim is None:
            targets = [(self.replicated[slot.offset:slot.offset + slot.sizes[0]],
                        local.reshape(-1))]
        else:
            targets = slot.pieces(self.rows, local)
        for target, value in targets:
            cast.assign(target, value, add)


def add_grad(master, local):
    """Accumulate `local` (this rank's part of the gradient) into `master.grad`."""
    local = local.astype(master.dtype, copy=False)
    if master.grad is None:
        master.grad = DTensor._make(local, master.layout.with_placements(
            grad_placements(master.placements)))
    else:
        master.grad._local += local


# ---- replication: one bucket of gradients -------------------------------------------------------
class Bucket:
    """Parameters whose gradients are all-reduced together from one flat buffer (allocated at
    the first gradient; it lives as long as the bucket, so a captured step writes the same
    addresses every replay). `offsets[i]`: where parameter i's region starts."""

    def __init__(self, index, params):
        self.index, self.params = index, params
        self.offsets, size = [], 0
        for p in params:
            self.offsets.append(aligned(size))
            size = self.offsets[-1] + math.prod(p.local_shape)
        self.size = size
        self.buffer = None
        self._regions = [None] * len(params)
        self._views = {}

    @property
    def dtype(self):
        """The parameters' dtype (read when the buffer is made: a cast model is followed)."""
        return self.params[0].dtype if self.buffer is None else self.buffer.dtype

    @property
    def nbytes(self):
        return sum(math.prod(p.local_shape) for p in self.params) * self.dtype.itemsize

    def region(self, i):
        """Parameter i's region of the buffer, flat (made once)."""
        region = self._regions[i]
        if region is None:
            if self.buffer is None:
                self.buffer = backend.xp.empty(self.size, self.dtype)
            start = self.offsets[i]
            region = self._regions[i] = self.buffer[
                start:start + math.prod(self.params[i].local_shape)]
        return region

    def view(self, i, placements):
        """Parameter i's gradient as a DTensor over its region, shaped like the parameter's
        block (one object per placements)."""
        key = (i, placements)
        view = self._views.get(key)
        if view is None:
            p = self.params[i]
            view = self._views[key] = DTensor._make(self.region(i).reshape(p.local_shape),
                                                    p.layout.with_placements(placements))
        return view
