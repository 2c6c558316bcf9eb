"""Counter-based random numbers that depend neither on how a tensor is sharded nor on how its
batch is split into micro-batches.

Philox-4x32-10 keyed by the seed, with the global element index (plus the generator's running
offset) as the counter: element (i, j) of a global tensor gets the same value whatever the mesh,
the placements or the number of ranks. Every draw advances the offset by the global element
count rounded up to a multiple of 8, identically on all ranks (dropout reads eight elements'
decisions from one Philox call, `launchers.philox`, so its groups are global neighbours). On a
GPU the numbers are drawn inside kernels (`random_fill.cu`,
dropout's, flash attention's; `philox.cuh`): those of the NumPy twin the CPU runs
(`cupytp.launchers.philox`), uniforms and masks bit for bit, normals to a few float64 ulps.

Micro-batches (gradient accumulation, a pipeline's): inside `microbatch(k, m)` a draw over a
tensor whose dimension 0 holds micro-batch k's rows is drawn as those rows of the whole batch's
tensor (dimension 0 m times longer, the rows before k's skipped), and reserves the whole
tensor's counters. Every micro-batch starts from the offset the batch started at, so the m
micro-batches draw what one pass over the whole batch would, and after the last one the offset
is where that pass leaves it (`Microbatches`).

Inside a captured CUDA graph the offset cannot be a constant of the graph: draws made while
capturing count from a device-resident base that is rewritten before every replay (see
`cupytp.graph`), so each replay draws fresh numbers, the same ones an eager run would draw.
"""
import contextlib
import math
from typing import NamedTuple

import numpy

from cupytp import backend, graph
from cupytp.launchers import random_fill
from cupytp.launchers.philox import DROPOUT_GROUP, Counters


class Generator(graph.GraphState):
    """A seed and a running offset; each draw reserves the counters of one global tensor (of
    the whole batch's tensor inside a micro-batch)."""

    def __init__(self, seed=0):
        self._bases = None           # device uint64 (2,): [0] = 0, the base of eager draws;
        #                              [1] the base of captured draws, set before each replay
        self._microbatch = None      # the micro-batch drawn for (_InEffect), or None
        self._batch = None           # the Microbatches that `microbatch(0, m)` began
        self.manual_seed(seed)

    def manual_seed(self, seed):
        self.seed = int(seed) & 0xFFFFFFFFFFFFFFFF
        self.offset = 0
        return self

    def get_state(self):
        """(seed, offset): what a checkpoint keeps."""
        return (self.seed, self.offset)

    def set_state(self, state):
        self.seed, self.offset = int(state[0]), int(state[1])

    def snapshot(self):
        """What the next draw depends on: the seed, the offset and the micro-batch in effect
        (for `replaying`)."""
        return (self.seed, self.offset, self._microbatch)

    @contextlib.contextmanager
    def replaying(self, snapshot):
        """Draw as at `snapshot` (recomputation, deferred construction: the numbers of the
        first run, micro-batch included), then put the generator back as it was."""
        now = self.snapshot()
        self.seed, self.offset, self._microbatch = snapshot
        try:
            yield
        finally:
            self.seed, self.offset, self._microbatch = now

    def microbatch(self, index, microbatches):
        """Context in which this generator's draws are those of micro-batch `index` of
        `microbatches` (their number: micro-batches of equal rows; or the rows of each) of one
        batch, as one pass over the whole batch would draw them (see `Microbatches`).
        Micro-batch 0 begins the batch at the offset now; the others continue the batch it
        began. Enter every micro-batch's forward pass (its backward may run inside too)."""
        self._outside_microbatches(index)
        if index == 0:
            self._batch = Microbatches(self, microbatches)
        elif self._batch is None or self._batch.microbatches != _split(microbatches):
            raise ValueError(f"micro-batch {index} of {microbatches} comes before micro-batch "
                             "0 of them: micro-batch 0 marks where the batch's draws begin; "
                             "enter it first (or give a Microbatches its start)")
        return self._batch.microbatch(index)

    def _outside_microbatches(self, index):
        if self._microbatch is not None:
            raise RuntimeError(f"micro-batch {index} entered inside micro-batch "
                               f"{self._microbatch.index}: micro-batches do not nest")

    def philox_args(self, shape):
        """Reserve the counters of one draw over the global `shape`: (seed, base, add), element
        i (row-major index in `shape`) getting counter base + add + i, with `base` a 0-d uint64
        device array (zero outside a CUDA-graph capture, rewritten before each replay inside
        one) for kernels that read it from memory. Inside a micro-batch `shape` is the
        micro-batch's, `add` skips the rows before it, and the whole batch's tensor is
        reserved."""
        shape = tuple(int(n) for n in shape)
        if self._microbatch is None:
            count, skipped = math.prod(shape), 0
        else:
            count, skipped = self._microbatch.place(shape, self.offset)
        record = self._join()
        if record is not None:
            if self._microbatch is not None and not self._microbatch.captured:
                raise graph.GraphCaptureError(
                    f"a CUDA graph is captured inside micro-batch {self._microbatch.index}: "
                    "every replay would draw that micro-batch's rows. Capture the whole loop "
                    "over the micro-batches (enter microbatch() inside the captured function)")
            base, add = self._bases[1], self.offset - record["start"]
        else:
            base, add = self._bases[0], self.offset
        self.offset += -count % DROPOUT_GROUP + count     # draws start at dropout's groups
        return self.seed, base, add + skipped

    # ---- CUDA-graph state (cupytp.graph.GraphState) ---------------------------------------------
    def _join(self):
        """Join the capture in progress: its record (None outside one)."""
        if self._bases is None:      # made once, best before any capture (a warm-up step)
            self._bases = backend.xp.zeros(2, dtype=backend.xp.uint64)
        return graph.join(self)

    def capture_begin(self, record):
        record["start"], record["seed"] = self.offset, self.seed

    def capture_end(self, record):
        record["per_replay"] = self.offset - record["start"]
        self.offset = record["start"]

    def before_replay(self, record):
        if self.seed != record["seed"]:
            raise graph.GraphCaptureError("the generator was reseeded after a CUDA graph captured "
                                          "draws from it: capture the step again")
        if self._microbatch is not None:
            raise graph.GraphCaptureError(
                f"a CUDA graph that draws random numbers is replayed inside micro-batch "
                f"{self._microbatch.index}, which its capture did not see: capture the whole "
                "loop over the micro-batches (enter microbatch() inside the captured function)")
        self._bases[1:].fill(backend.xp.uint64(self.offset))
        self.offset += record["per_replay"]

    def counters(self, shape, offsets, local_shape):
        """Reserve the counters of one draw over the global `shape`, for the block `local_shape`
        at `offsets` (a `launchers.philox.Counters`, which the drawing kernels take)."""
        return Counters(*self.philox_args(shape), tuple(shape), tuple(offsets),
                        tuple(local_shape))

    def uniform(self, shape, offsets, local_shape, dtype=numpy.float64):
        """Uniforms in [0, 1) for the block `local_shape` at `offsets` of `shape`, drawn in
        float64 and rounded to `dtype` (one kernel on a GPU)."""
        return random_fill.uniform(self.counters(shape, offsets, local_shape), dtype)

    def normal(self, shape, offsets, local_shape, dtype=numpy.float64, std=1.0):
        """Normal(0, std) values (Box-Muller in float64, rounded to `dtype`) for the block at
        `offsets` of `shape` (one kernel on a GPU)."""
        return random_fill.normal(self.counters(shape, offsets, local_shape), dtype, std)


class Microbatches:
    """The micro-batches of one batch, drawing from `generator` as one pass over the whole
    batch would. `microbatches`: their number (micro-batches of equal rows) or the rows of
    each (uneven ones: an array_split's, say); `start`: the offset where the batch's draws
    begin (default: the generator's offset now; a pipeline stage's draws begin after the
    earlier stages').

    Inside `with batch.microbatch(k):` the generator's offset is `start` again, and a draw over
    a global tensor of shape (n, ...) is drawn as rows k n .. (k + 1) n - 1 of the whole
    batch's (m n, ...) tensor; with the rows of each given, n is r times micro-batch k's rows
    (r = 1, or the rows of a flattened (rows·T, ...) tensor), drawn as the rows after r times
    the rows before k. The draw reserves the whole tensor's counters, so each micro-batch ends
    where the whole batch's pass would, and any split of the batch draws the same numbers.
    Every micro-batch must make the same draws (the same layers, over its own rows): a draw
    that does not fit the one another micro-batch made at its offset is an error."""

    def __init__(self, generator, microbatches, start=None):
        self.generator = generator
        self.microbatches = _split(microbatches)
        self.start = generator.offset if start is None else int(start)
        self._drawn = {}        # offset -> (whole shape, micro-batch, its shape) drawn there

    @property
    def count(self):
        """How many micro-batches the batch has."""
        m = self.microbatches
        return m if isinstance(m, int) else len(m)

    @contextlib.contextmanager
    def microbatch(self, index):
        """Context: the generator draws as micro-batch `index` (see the class)."""
        if not 0 <= index < self.count:
            raise ValueError(f"micro-batch {index} is not one of the batch's {self.count}")
        generator = self.generator
        generator._outside_microbatches(index)
        generator._join()            # a capture counts from the offset before the rewind
        generator._microbatch = _InEffect(self, index, graph.is_capturing())
        generator.offset = self.start
        try:
            yield self
        finally:
            generator._microbatch = None

    def place(self, index, shape, offset):
        """(the counters to reserve, the counters of the rows before micro-batch `index`) for
        its draw over `shape` at the generator's `offset`."""
        if not shape:
            raise ValueError(f"a 0-d draw inside micro-batch {index}: draws inside a "
                             "micro-batch are over tensors whose dimension 0 holds its rows")
        rows, inner = shape[0], math.prod(shape[1:])
        if isinstance(self.microbatches, int):
            before, whole = index * rows, self.count * rows
        else:
            own = self.microbatches[index]
            if rows % own:
                raise ValueError(f"a draw over {shape} inside micro-batch {index} of "
                                 f"{own} rows: its dimension 0 must hold the micro-batch's "
                                 "rows (or a multiple of them)")
            before = rows // own * sum(self.microbatches[:index])
            whole = rows // own * sum(self.microbatches)
        whole_shape = (whole,) + shape[1:]
        if whole * inner:
            seen = self._drawn.setdefault(offset, (whole_shape, index, shape))
            if seen[0] != whole_shape:
                advice = ("; micro-batches of unequal rows give the rows of each: "
                          "microbatch(k, [rows, ...])" if isinstance(self.microbatches, int)
                          else "")
                raise ValueError(f"micro-batch {index} draws over {shape} where micro-batch "
                                 f"{seen[1]} drew over {seen[2]} (rows of whole-batch tensors "
                                 f"{whole_shape} and {seen[0]}): every micro-batch must make "
                                 f"the same draws over its own rows{advice}")
        return whole * inner, before * inner


class _InEffect(NamedTuple):
    """The micro-batch a generator draws for: its batch, its index, whether it was entered
    inside a CUDA-graph capture."""
    batch: Microbatches
    index: int
    captured: bool

    def place(self, shape, offset):
        return self.batch.place(self.index, shape, offset)


def _split(microbatches):
    """`microbatches` checked: a positive int, or a tuple of positive row counts."""
    if isinstance(microbatches, (int, numpy.integer)) and not isinstance(microbatches, bool):
        if microbatches >= 1:
            return int(microbatches)
    elif isinstance(microbatches, (list, tuple)) and microbatches and all(
            isinstance(n, (int, numpy.integer)) and n >= 1 for n in microbatches):
        return tuple(int(n) for n in microbatches)
    raise ValueError(f"microbatches must be how many micro-batches of equal rows (an int >= 1) "
                     f"or the rows of each (positive ints), got {microbatches!r}")


default_generator = Generator(0)


def manual_seed(seed):
    """Seed the default generator (same seed on every rank gives the same global tensors)."""
    return default_generator.manual_seed(seed)


def microbatch(index, microbatches):
    """Context in which the default generator draws as micro-batch `index` of
    `microbatches` of one batch (`Generator.microbatch`): dropout under gradient accumulation
    is then that of the whole batch."""
    return default_generator.microbatch(index, microbatches)
