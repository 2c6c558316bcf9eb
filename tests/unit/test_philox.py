"""Random numbers drawn in kernels (philox.cuh, random_fill.cu, dropout.cu): the NumPy twins
against independent references (Philox-4x32-10 written out on Python integers, float64
formulas, the dense tensor's block), the counters' block mapping against every element's global
index, and on a GPU each kernel against its twin: uniforms and masks bit for bit, normals to a
few float64 ulps."""
import math

import numpy
import pytest

from cupytp.backend import asnumpy, bfloat16, on_gpu, xp
from cupytp.launchers import dropout as drop, random_fill
from cupytp.launchers.philox import (
    MAX_DIMS, Counters, global_indices, keep_threshold, merged_block, uniform_at, words)

requires_gpu = pytest.mark.skipif(not on_gpu, reason="needs a CUDA GPU and CuPy")
F16, F32, F64 = (numpy.dtype(t) for t in (numpy.float16, numpy.float32, numpy.float64))

# (global shape, offsets, local shape): whole tensors, batch shards, feature shards, blocks split
# along several dimensions, extents of one, odd sizes (tails of a thread's eight elements)
BLOCKS = [((7,), (0,), (7,)), ((4, 6, 8), (2, 0, 0), (2, 6, 8)), ((4, 6, 8), (0, 0, 4), (4, 6, 4)),
          ((5, 6, 10), (2, 3, 0), (3, 2, 10)), ((3, 5, 7, 9), (1, 2, 3, 4), (2, 3, 4, 5)),
          ((6, 1, 9), (3, 0, 0), (3, 1, 9)), ((4, 5, 6), (1, 2, 0), (2, 1, 6)),
          ((2, 3, 4, 5, 6), (0, 1, 1, 1, 3), (2, 2, 2, 2, 3))]


def reference_philox(counter, key):
    """Philox-4x32-10 of (counter lo, counter hi, 0, 0) from the Random123 paper, on Python
    integers."""
    mask = 0xFFFFFFFF
    c = [counter & mask, counter >> 32, 0, 0]
    k = [key & mask, key >> 32]
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k[0], p1 & mask, (p0 >> 32) ^ c[3] ^ k[1], p0 & mask]
        k = [(k[0] + 0x9E3779B9) & mask, (k[1] + 0xBB67AE85) & mask]
    return c


def reference_keeps(c, p):
    """Dropout's decisions over the counters `c`: 16-bit half c mod 8 of the Philox draw at
    c - c mod 8, as a fraction of 2^16, is >= p (Python integers and floats)."""
    flat = [reference_half(int(v)) / 2.0 ** 16 >= p for v in c.reshape(-1)]
    return numpy.array(flat).reshape(c.shape)


def reference_half(counter):
    """Half counter mod 8 of the draw at counter - counter mod 8 under SEED: the low (even) or
    high 16 bits of word (counter mod 8) // 2."""
    k = counter % 8
    return reference_philox(counter - k, SEED)[k // 2] >> 16 * (k % 2) & 0xFFFF


SEED = 0x1234_5678_9ABC


def counters(block, add=5, seed=SEED, base=None):
    shape, offsets, local_shape = block
    base = numpy.zeros((), numpy.uint64) if base is None else base
    return Counters(seed, base + numpy.uint64(11), add, shape, offsets, local_shape)


def kernel_global(arguments, local_index):
    """The global index PhiloxBlock.global (philox.cuh) gives a local index, from the kernels'
    arguments: the decomposition written out."""
    dims, e1, e2, e3, s0, s1, s2, s3 = (int(a) for a in arguments[3:])
    extents, strides = [e1, e2, e3][4 - dims:] if dims > 1 else [], [s0, s1, s2, s3][4 - dims:]
    g, rest = 0, local_index
    for extent, stride in zip(reversed(extents), reversed(strides[1:])):
        g, rest = g + (rest % extent) * stride, rest // extent
    return g + rest * strides[0]


@pytest.mark.parametrize("block", BLOCKS[:-1])
def test_counters_map_every_local_element_to_its_global_index(block):
    c = counters(block)
    arguments = c.arguments()
    first = int(arguments[2]) - c.add
    expected = global_indices(*block, numpy).reshape(-1)
    got = [first + kernel_global(arguments, i) for i in range(math.prod(block[2]))]
    numpy.testing.assert_array_equal(numpy.array(got, numpy.uint64), expected)
    numpy.testing.assert_array_equal(c.indices(), global_indices(*block, numpy) + numpy.uint64(16))


def test_counters_of_a_block_split_too_often_are_a_clear_error():
    assert len(merged_block(*BLOCKS[-1])[1]) > MAX_DIMS
    with pytest.raises(ValueError, match="at most 4"):
        counters(BLOCKS[-1]).arguments()


def test_twin_draws_philox_of_the_random123_paper():
    key = 0x0123_4567_89AB_CDEF
    chosen = numpy.array([0, 1, 2 ** 32 - 1, 2 ** 32, 2 ** 63 + 12345], numpy.uint64)
    a, b, _, _ = words(key, chosen)
    for i, counter in enumerate(chosen.tolist()):
        w = reference_philox(counter, key)
        assert [int(a[i]), int(b[i])] == w[:2]
        bits = (w[0] >> 5) * 2 ** 26 + (w[1] >> 6)
        assert uniform_at(key, chosen[i:i + 1])[0] == bits / 2.0 ** 53


@pytest.mark.parametrize("block", BLOCKS[:-1])
def test_twin_fills_are_the_dense_draws_block(block):
    """A block's uniforms and normals are those of the same draw over the whole tensor, at the
    block's place: the numbers do not depend on the sharding."""
    shape, offsets, local_shape = block
    where = tuple(slice(o, o + n) for o, n in zip(offsets, local_shape))
    dense = counters((shape, (0,) * len(shape), shape))
    for fill in (random_fill.uniform_numpy, random_fill.normal_numpy):
        numpy.testing.assert_array_equal(fill(counters(block)), fill(dense)[where])
    u1 = random_fill.uniform_numpy(dense)
    normal = random_fill.normal_numpy(dense, F32, std=0.5)
    assert normal.dtype == F32 and 0 <= u1.min() and u1.max() < 1
    c = dense.indices().reshape(-1)
    second = numpy.array([reference_philox(int(v), dense.seed)[2:] for v in c], numpy.uint64)
    u2 = ((second[:, 0] >> 5) * 2 ** 26 + (second[:, 1] >> 6)) / 2.0 ** 53
    expected = 0.5 * numpy.sqrt(-2 * numpy.log1p(-u1.reshape(-1))) * numpy.cos(2 * numpy.pi * u2)
    numpy.testing.assert_array_equal(normal.reshape(-1), expected.astype(F32))


@pytest.mark.parametrize("with_bias,with_residual", [(False, False), (True, False),
                                                     (False, True), (True, True)])
def test_twin_dropout_against_float64_formula(with_bias, with_residual):
    """out = residual + (x + bias) kept / (1 - p), the mask dropout's decisions at the same
    counters (eight to a Philox draw), packed eight to a byte; the backward scales the kept
    gradients by 1 / (1 - p)."""
    block = BLOCKS[3]
    rng = numpy.random.default_rng(0)
    x = rng.standard_normal(block[2])
    bias = rng.standard_normal(x.shape[-1]) if with_bias else None
    residual = rng.standard_normal(x.shape) if with_residual else None
    p = 0.3
    out, mask = drop.dropout_numpy(x, p, counters(block), bias, residual)
    keep = reference_keeps(counters(block).indices(), p)
    expected = numpy.where(keep, (x + (0 if bias is None else bias)) / (1 - p), 0) + \
        (0 if residual is None else residual)
    numpy.testing.assert_allclose(out, expected, rtol=1e-14, atol=1e-14)
    numpy.testing.assert_array_equal(numpy.unpackbits(mask, count=x.size, bitorder="little"),
                                     keep.reshape(-1))
    assert 0.5 < keep.mean() < 0.9
    g = rng.standard_normal(x.shape)
    numpy.testing.assert_allclose(drop.dropout_backward_numpy(g, mask, p),
                                  numpy.where(keep, g / (1 - p), 0), rtol=1e-14)


def test_dropout_bad_inputs_are_clear_errors():
    x = numpy.ones((2, 8), F32)
    c = counters(((2, 8), (0, 0), (2, 8)))
    with pytest.raises(ValueError, match=r"p must be in \(0, 1\)"):
        drop.dropout(x, 1.0, c)
    with pytest.raises(ValueError, match="block shape"):
        drop.dropout(numpy.ones((2, 4), F32), 0.5, c)
    with pytest.raises(ValueError, match="no kernel for x float32 with bias float64"):
        drop.dropout(x, 0.5, c, bias=numpy.ones(8, F64))
    with pytest.raises(ValueError, match="the bias must be"):
        drop.dropout(x, 0.5, c, bias=numpy.ones(4, F32))
    with pytest.raises(ValueError, match="mask hold 2 bytes"):
        drop.dropout_backward(x, numpy.zeros(3, numpy.uint8), 0.5)


# ---- on a GPU: kernels against their twins -------------------------------------------------------
def on_device(c):
    return c._replace(base=xp.asarray(c.base))


@requires_gpu
@pytest.mark.parametrize("block", BLOCKS[:-1])
@pytest.mark.parametrize("dtype", [F64, F32, bfloat16, F16])
def test_fill_kernels_draw_the_twins_numbers(block, dtype):
    c = counters(block)
    got = asnumpy(random_fill.uniform(on_device(c), dtype))
    assert got.dtype == dtype
    numpy.testing.assert_array_equal(got, random_fill.uniform_numpy(c, dtype))
    got = asnumpy(random_fill.normal(on_device(c), dtype, std=0.02)).astype(F64)
    want = random_fill.normal_numpy(c, dtype, std=0.02).astype(F64)
    if dtype == F64:
        numpy.testing.assert_allclose(got, want, rtol=8 * numpy.finfo(F64).eps, atol=1e-300)
    else:       # a float64 ulp apart may round to neighbouring values of a narrower dtype
        spacing = numpy.spacing(numpy.abs(want).astype(dtype)).astype(F64)
        assert (numpy.abs(got - want) <= spacing).all()
        assert (got == want).mean() > 0.99


@requires_gpu
@pytest.mark.parametrize("block", BLOCKS[:-1])
@pytest.mark.parametrize("x_dtype,out_dtype", [(F64, F64), (F32, F32), (bfloat16, bfloat16),
                                               (F16, F16), (bfloat16, F32), (F16, F32)])
@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("shift", [0, 3])
def test_dropout_kernels_are_their_twins(block, x_dtype, out_dtype, aligned, shift):
    """Outputs, masks and gradients bit for bit, with and without bias and residual, on vectors
    and off them (an array one element past an aligned start), with the draw's counters
    starting at a multiple of 8 (eight elements to a Philox call) and off one (a call each)."""
    rng = numpy.random.default_rng(1)
    shape = block[2]

    def array(shape, dtype):
        values = rng.standard_normal(shape).astype(dtype)
        if aligned:
            return values, xp.asarray(values)
        padded = xp.empty(math.prod(shape) + 1, dtype=dtype)
        device = padded[1:].reshape(shape)
        device[...] = xp.asarray(values)
        return values, device

    x, x_device = array(shape, x_dtype)
    variants = [(None, None)]
    if out_dtype == x_dtype:
        variants.append((array(shape[-1:], out_dtype), None))
    variants += [(None, array(shape, out_dtype)), (array(shape[-1:], out_dtype),
                                                   array(shape, out_dtype))]
    for bias, residual in variants:
        host = [None if a is None else a[0] for a in (bias, residual)]
        device = [None if a is None else a[1] for a in (bias, residual)]
        c = counters(block, add=8 * int(rng.integers(4, 1 << 40)) + shift - 11)    # base is 11
        out, mask = drop.dropout(x_device, 0.2, on_device(c), *device)
        want, want_mask = drop.dropout_numpy(x, 0.2, c, *host)
        assert out.dtype == want.dtype
        numpy.testing.assert_array_equal(asnumpy(out), want)
        numpy.testing.assert_array_equal(asnumpy(mask), want_mask)
        g, g_device = array(shape, out.dtype)
        numpy.testing.assert_array_equal(
            asnumpy(drop.dropout_backward(g_device, mask, 0.2, x_dtype)),
            drop.dropout_backward_numpy(g, want_mask, 0.2, x_dtype))


@requires_gpu
def test_dropout_threshold_is_the_kernels_test():
    """The kernel keeps exactly the elements whose half / 2^16 is >= p, for p at the edges (one
    exactly a half drawn)."""
    block = ((4096,), (0,), (4096,))
    c = counters(block, add=5)          # base 11: counters from 16, eight to a draw
    drawn = numpy.array([reference_half(int(v)) for v in c.indices()], F64) / 2.0 ** 16
    for p in (2.0 ** -40, 1 / 3, 0.999, 65535 / 65536, float(numpy.sort(drawn)[100])):
        _, mask = drop.dropout(xp.ones(4096, F32), p, on_device(c))
        keep = numpy.unpackbits(asnumpy(mask), bitorder="little").astype(bool)
        numpy.testing.assert_array_equal(keep, drawn >= p)
        assert keep_threshold(p) == math.ceil(p * 2 ** 16)
