"""Counter-based random numbers that do not depend on how a tensor is sharded.

Philox-4x32-10 keyed by the seed, with the global element index (plus the generator's running
offset) as the counter: element (i, j) of a global tensor gets the same value whatever the mesh,
the placements or the number of ranks. Every draw advances the offset by the global element
count, identically on all ranks. On a GPU the numbers are drawn inside kernels (`random_fill.cu`,
dropout's, flash attention's; `philox.cuh`): those of the NumPy twin the CPU runs
(`cupytp.launchers.philox`), uniforms and masks bit for bit, normals to a few float64 ulps.

Inside a captured CUDA graph the offset cannot be a constant of the graph: draws made while
capturing count from a device-resident base that is rewritten before every replay (see
`cupytp.graph`), so each replay draws fresh numbers, the same ones an eager run would draw.
"""
import numpy

from cupytp import backend, graph
from cupytp.launchers import random_fill
from cupytp.launchers.philox import Counters


class Generator(graph.GraphState):
    """A seed and a running offset; each draw reserves the counters of one global tensor."""

    def __init__(self, seed=0):
        self._bases = None           # device uint64 (2,): [0] = 0, the base of eager draws;
        self.manual_seed(seed)       # [1] the base of captured draws, set before each replay

    def manual_seed(self, seed):
        self.seed = int(seed) & 0xFFFFFFFFFFFFFFFF
        self.offset = 0
        return self

    def get_state(self):
        return (self.seed, self.offset)

    def set_state(self, state):
        self.seed, self.offset = int(state[0]), int(state[1])

    def philox_args(self, count):
        """Reserve `count` counters: (seed, base, add), the counters being base + add + i for
        i < count, with `base` a 0-d uint64 device array (zero outside a CUDA-graph capture,
        rewritten before each replay inside one) for kernels that read it from memory."""
        if self._bases is None:      # made once, best before any capture (a warm-up step)
            self._bases = backend.xp.zeros(2, dtype=backend.xp.uint64)
        record = graph.join(self)
        if record is not None:
            base, add = self._bases[1], self.offset - record["start"]
        else:
            base, add = self._bases[0], self.offset
        self.offset += count
        return self.seed, base, add

    # ---- CUDA-graph state (cupytp.graph.GraphState) ---------------------------------------------
    def capture_begin(self, record):
        record["start"], record["seed"] = self.offset, self.seed

    def capture_end(self, record):
        record["per_replay"] = self.offset - record["start"]
        self.offset = record["start"]

    def before_replay(self, record):
        if self.seed != record["seed"]:
            raise graph.GraphCaptureError("the generator was reseeded after a CUDA graph captured "
                                          "draws from it: capture the step again")
        self._bases[1:].fill(backend.xp.uint64(self.offset))
        self.offset += record["per_replay"]

    def counters(self, shape, offsets, local_shape):
        """Reserve the counters of one draw over the global `shape`, for the block `local_shape`
        at `offsets` (a `launchers.philox.Counters`, which the drawing kernels take)."""
        count = int(numpy.prod(shape, dtype=numpy.int64))
        return Counters(*self.philox_args(count), tuple(shape), tuple(offsets),
                        tuple(local_shape))

    def uniform(self, shape, offsets, local_shape, dtype=numpy.float64):
        """Uniforms in [0, 1) for the block `local_shape` at `offsets` of `shape`, drawn in
        float64 and rounded to `dtype` (one kernel on a GPU)."""
        return random_fill.uniform(self.counters(shape, offsets, local_shape), dtype)

    def normal(self, shape, offsets, local_shape, dtype=numpy.float64, std=1.0):
        """Normal(0, std) values (Box-Muller in float64, rounded to `dtype`) for the block at
        `offsets` of `shape` (one kernel on a GPU)."""
        return random_fill.normal(self.counters(shape, offsets, local_shape), dtype, std)


default_generator = Generator(0)


def manual_seed(seed):
    """Seed the default generator (same seed on every rank gives the same global tensors)."""
    return default_generator.manual_seed(seed)
