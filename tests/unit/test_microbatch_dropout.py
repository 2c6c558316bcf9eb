"""Random draws under micro-batches (`cupytp.microbatch`, `Generator.microbatch`,
`Microbatches`): inside micro-batch k of a batch every drawing path (ops.dropout: the dropout
kernel's twin; bias_dropout_add; the fused sublayers; attention dropout on the flash twin, its
(b, h, t, s) counters, and on the matmul path; random fills, flattened rows too) draws micro-batch
k's rows of what one pass over the whole batch draws, for equal and uneven micro-batches, and
the generator's offset is the whole batch's at the start of every micro-batch and after the
last; a recomputation whose backward runs outside the micro-batch draws its masks again; CUDA
graphs: the capture hooks driven on the CPU, and on a GPU captured micro-batch loops of the
kernels replayed against eager whole batches; misuse is one clear error."""
import contextlib
import functools

import numpy
import pytest

import cupytp
from cupytp import backend, nn, ops
from cupytp.backend import bfloat16
from cupytp.ops import fused
from cupytp.tensor import Generator, Microbatches, Replicated, from_local, local_mesh
from dense_reference import full, rng_array
from test_graph import FakeCapture

P = 0.3
ROWS, T = 6, 5
SPLITS = {"equal": 3, "uneven": (1, 3, 2)}      # micro-batches of the 6 rows
cpu_only = pytest.mark.skipif(backend.on_gpu, reason="drives the capture hooks on NumPy arrays")


@pytest.fixture(autouse=True)
def runtime():
    return cupytp.init()


def tensor(array, requires_grad=False):
    """A DTensor on one rank over `array` (a host array is copied to the device)."""
    t = from_local(backend.asarray(array), local_mesh(), (Replicated(),), shape=array.shape)
    t.requires_grad = requires_grad
    return t


@functools.cache
def params(*shapes, dtype=numpy.float64):
    """Parameters of fixed values (made once: a captured loop reads them)."""
    return [tensor(rng_array(shape, 10 + i, dtype) * 0.3) for i, shape in enumerate(shapes)]


# ---- the drawing paths: (inputs with the batch on dimension 0, whole batch) -> output ------------
def dropout(g, x):                                              # (B, T, C) float64
    return ops.dropout(tensor(x), P, generator=g)


def bias_dropout_add(g, x):
    bias, = params((x.shape[-1],))
    return ops.bias_dropout_add(tensor(x), bias, tensor(x[..., ::-1].copy()), P, generator=g)


def mlp_residual(g, x):                                         # the fused MLP sublayer
    c = x.shape[-1]
    return fused.mlp_residual(tensor(x), tensor(x * 0.5), *params((c, 4 * c), (4 * c,),
                                                                  (4 * c, c), (c,)),
                              dropout_p=P, generator=g)


def attention_residual(g, x):          # fused, bf16 heads of 64: the flash twin's dropout too
    c = x.shape[-1]
    weights = params((c, 3, c), (3, c), (c, c), (c,), dtype=numpy.float32)
    with ops.autocast("bf16"):
        return fused.attention_residual(tensor(x), tensor(x), *weights, c // 64, dropout_p=P,
                                        generator=g, resid_dropout_p=P).astype("fp64")


def flash_attention(g, qkv):                                   # (B, 3, H, T, 64) bf16
    q, k, v = (tensor(qkv[:, i]) for i in range(3))
    return ops.scaled_dot_product_attention(q, k, v, dropout_p=P, generator=g).astype("fp64")


def matmul_attention(g, qkv):                                  # (B, 3, H, T, D) float64
    q, k, v = (tensor(qkv[:, i]) for i in range(3))
    return ops.scaled_dot_product_attention(q, k, v, dropout_p=P, generator=g)


def random_fill(g, x):
    """A fill over the rows and one over them flattened with the sequence: (rows T, C)."""
    rows, t, c = x.shape
    flat = cupytp.rand((rows * t, c), generator=g, dtype="fp64")
    return cupytp.rand(x.shape, generator=g, dtype="fp64") + flat.reshape(rows, t, c)


EXACT, BF16 = 1e-12, 2e-2          # relative tolerances: float64 paths, bf16 products
PATHS = {           # name: (path, the whole batch's input, tolerance)
    "dropout": (dropout, rng_array((ROWS, T, 8), 1), EXACT),
    "bias_dropout_add": (bias_dropout_add, rng_array((ROWS, T, 8), 1), EXACT),
    "mlp_residual": (mlp_residual, rng_array((ROWS, T, 8), 1), EXACT),
    "attention_residual": (attention_residual, rng_array((ROWS, T, 128), 1, numpy.float32),
                           BF16),
    "flash_attention": (flash_attention, rng_array((ROWS, 3, 2, T, 64), 1, bfloat16), BF16),
    "matmul_attention": (matmul_attention, rng_array((ROWS, 3, 2, T, 3), 1), EXACT),
    "random_fill": (random_fill, numpy.zeros((ROWS, T, 4)), EXACT),
}


def close(got, want, tolerance):
    """Equal to `tolerance` relative to the largest value (a mask drawn otherwise is not)."""
    return numpy.allclose(got, want, rtol=tolerance, atol=tolerance * numpy.abs(want).max())


def bounds(split):
    sizes = [ROWS // split] * split if isinstance(split, int) else list(split)
    starts = numpy.cumsum([0] + sizes)
    return list(zip(starts[:-1], starts[1:]))


def layers(path, g, x):
    """`path` run twice over x, as two layers of a model: (rows, 2, ...). (Micro-batches of a
    path drawing once per pass would draw the whole batch's numbers even without their
    contexts, one after the other.)"""
    return numpy.stack([full(path(g, x)) for _ in range(2)], axis=1)


def whole_steps(path, x, steps=2, seed=11):
    """Each step's output over the whole batch, and the generator's offset before each and
    after the last."""
    g = Generator(seed)
    outputs, offsets = [], []
    for _ in range(steps):
        offsets.append(g.offset)
        outputs.append(layers(path, g, x))
    return outputs, offsets + [g.offset]


def split_steps(path, x, split, steps=2, seed=11, microbatch=True):
    """The same in micro-batches (inside their contexts unless not `microbatch`): the outputs
    joined, and the offset at the start of every micro-batch of each step and after the last."""
    g = Generator(seed)
    outputs, offsets = [], []
    for _ in range(steps):
        parts = []
        for k, (a, b) in enumerate(bounds(split)):
            with g.microbatch(k, split) if microbatch else contextlib.nullcontext():
                offsets.append(g.offset)
                parts.append(layers(path, g, x[a:b]))
        outputs.append(numpy.concatenate(parts))
    return outputs, offsets + [g.offset]


@pytest.mark.parametrize("split", SPLITS.values(), ids=SPLITS.keys())
@pytest.mark.parametrize("name", PATHS)
def test_microbatches_draw_the_whole_batch(name, split):
    """Two steps: each micro-batch's output is its rows of the whole batch's (the masks the
    whole batch's), each starts at the step's offset and the last ends at the next step's;
    drawn without the contexts, the outputs differ."""
    path, x, tolerance = PATHS[name]
    whole, whole_offsets = whole_steps(path, x)
    parts, offsets = split_steps(path, x, split)
    m = len(bounds(split))
    assert offsets == [whole_offsets[0]] * m + [whole_offsets[1]] * m + [whole_offsets[2]]
    for step, (got, want) in enumerate(zip(parts, whole)):
        assert close(got, want, tolerance), f"step {step}: {numpy.abs(got - want).max()}"
    unsplit, _ = split_steps(path, x, split, microbatch=False)
    assert not close(unsplit[0], whole[0], tolerance)


def test_recomputation_outside_the_microbatch_draws_its_masks_again():
    """Forwards recomputed in backward (nn.recompute), the backward walks run after every
    micro-batch's context has ended, last first: the input gradients are the whole batch's
    without recomputation."""
    x, w = rng_array((ROWS, T, 4), 1), rng_array((ROWS, T, 4), 2)

    def block(g):
        return lambda t: ops.dropout(ops.gelu(t), P, generator=g) * 2.0

    g = Generator(3)
    whole = tensor(x, requires_grad=True)
    (block(g)(whole) * tensor(w)).sum().backward()
    g, losses, leaves = Generator(3), [], []
    for k, (a, b) in enumerate(bounds(SPLITS["uneven"])):
        with g.microbatch(k, SPLITS["uneven"]):
            leaves.append(tensor(x[a:b], requires_grad=True))
            out = nn.recompute(block(g), leaves[-1], generator=g)
            losses.append((out * tensor(w[a:b])).sum())
    for loss in reversed(losses):
        loss.backward()
    numpy.testing.assert_array_equal(numpy.concatenate([full(t.grad) for t in leaves]),
                                     full(whole.grad))


def test_snapshot_replays_the_microbatch():
    g = Generator(5)
    with g.microbatch(0, 2):
        snapshot = g.snapshot()
        first = g.uniform((2, 3), (0, 0), (2, 3))
    with g.replaying(snapshot):
        numpy.testing.assert_array_equal(backend.asnumpy(g.uniform((2, 3), (0, 0), (2, 3))),
                                         backend.asnumpy(first))
    assert g.offset == 16 and g._microbatch is None     # 12 counters, to a multiple of 8


# ---- CUDA graphs: the hooks, driven on the CPU ---------------------------------------------------
def uniform_loop(g, split=3):
    """One whole batch's uniforms (6, 5) drawn in micro-batches of rows."""
    parts = []
    for k, (a, b) in enumerate(bounds(split)):
        with g.microbatch(k, split):
            parts.append(g.uniform((b - a, 5), (0, 0), (b - a, 5)))
    return numpy.concatenate(parts)


@cpu_only
def test_a_captured_microbatch_loop_counts_from_the_replay_base():
    eager = Generator(7)
    expected = [eager.uniform((ROWS, 5), (0, 0), (ROWS, 5)) for _ in range(3)]
    g = Generator(7)
    numpy.testing.assert_array_equal(uniform_loop(g), expected[0])
    g._bases[1] = 32               # as the first replay sets it (30 counters, rounded up to 4s)
    with FakeCapture() as capture:
        numpy.testing.assert_array_equal(uniform_loop(g, SPLITS["uneven"]), expected[1])
    assert g.offset == 32                             # the capture drew nothing for real
    (state, record), = capture.states
    assert state is g and record["per_replay"] == 32
    capture.before_replay()
    assert int(g._bases[1]) == 32 and g.offset == 64
    numpy.testing.assert_array_equal(uniform_loop(g), expected[2])


@cpu_only
def test_a_capture_inside_one_microbatch_is_an_error():
    g = Generator(7)
    uniform_loop(g)
    with g.microbatch(0, 2), FakeCapture():
        with pytest.raises(cupytp.GraphCaptureError, match="captured inside micro-batch 0"):
            g.uniform((2, 5), (0, 0), (2, 5))
    with FakeCapture() as capture:
        g.uniform((2, 5), (0, 0), (2, 5))
    with g.microbatch(0, 2), pytest.raises(cupytp.GraphCaptureError,
                                           match="replayed inside micro-batch 0"):
        capture.before_replay()


# ---- errors --------------------------------------------------------------------------------------
def test_misuse_is_one_clear_error():
    g = Generator(1)
    with pytest.raises(ValueError, match="micro-batch 1 of 2 comes before micro-batch 0"):
        g.microbatch(1, 2)
    for bad in (0, -1, 2.0, True, (), (2, 0), [1, 1.5]):
        with pytest.raises(ValueError, match="microbatches must be how many"):
            g.microbatch(0, bad)
    with g.microbatch(0, 2):
        with pytest.raises(RuntimeError, match="do not nest"), g.microbatch(1, 2):
            pass
        with pytest.raises(RuntimeError, match="do not nest"), g.microbatch(0, 2):
            pass
        with pytest.raises(ValueError, match="0-d draw inside micro-batch 0"):
            g.uniform((), (), ())
    with pytest.raises(ValueError, match="micro-batch 2 of 3 comes before"):
        g.microbatch(2, 3)
    with pytest.raises(ValueError, match="micro-batch 2 is not one of the batch's 2"):
        Microbatches(g, 2).microbatch(2).__enter__()
    with g.microbatch(0, (2, 3)), pytest.raises(ValueError,
                                                 match=r"over \(3, 4\) inside micro-batch 0 of 2"):
        g.uniform((3, 4), (0, 0), (3, 4))


def test_unequal_microbatches_given_by_their_number_are_refused():
    """6 rows as 3 + 2 + 1 under microbatch(k, 3): micro-batch 1's draw does not fit micro-batch
    0's at the same offset; the error says to give the rows of each."""
    g = Generator(1)
    x = rng_array((ROWS, 4), 1)
    with g.microbatch(0, 3):
        dropout(g, x[:3])
    with g.microbatch(1, 3), pytest.raises(ValueError, match=r"micro-batch 1 draws over \(2, "
                                                              r"4\) where micro-batch 0 drew over "
                                                              r"\(3, 4\).*give the rows of each"):
        dropout(g, x[3:5])


# ---- GPUs: the kernels inside captured micro-batch loops -----------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not backend.on_gpu, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("split", SPLITS.values(), ids=SPLITS.keys())
@pytest.mark.parametrize("name", PATHS)
def test_captured_microbatch_loops_draw_the_whole_batch_on_the_kernels(name, split):
    """The dropout kernel, bias_dropout_add's, the fused sublayers', flash attention's and the
    fills', each in a micro-batch loop captured as one CUDA graph: every replay draws what an
    eager pass over the whole batch draws at that step (products to their rounding: other row
    counts may take other GEMM kernels)."""
    path, x, tolerance = PATHS[name]
    whole, _ = whole_steps(path, x, steps=5)
    g = Generator(11)
    device = [backend.asarray(x[a:b]) for a, b in bounds(split)]

    def loop(*parts):
        outs = []
        for k, part in enumerate(parts):
            with g.microbatch(k, split):
                outs.append(backend.xp.stack([path(g, part).to_local() for _ in range(2)], 1))
        return backend.xp.concatenate(outs)
    captured = cupytp.cuda_graph(loop, warmup=1)
    for step in range(5):
        got = backend.asnumpy(captured(*device))
        assert close(got, whole[step], tolerance), f"step {step}: {numpy.abs(got - whole[step])}"
    assert captured.graph is not None
