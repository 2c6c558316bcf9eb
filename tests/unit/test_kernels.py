"""The kernels package: each NumPy twin against an independent reference (float64 math, finite
differences, PyTorch's documented optimizer algorithms written out element by element), and on a
GPU each kernel against its twin."""
import contextlib
import ctypes
import math

import numpy
import pytest

from cupytp.backend import asnumpy, bfloat16, on_gpu, xp
from cupytp.launchers import ceil_div, compute_dtype, dtype_suffix, get_kernel, rows_grid, sources
from cupytp.launchers.adamw import adamw_scalars, adamw_step, adamw_step_numpy
from cupytp.launchers.gelu import gelu, gelu_backward, gelu_backward_numpy, gelu_numpy
from cupytp.launchers.kernel import ArgumentSlots, Kernel, as_three
from cupytp.launchers.multi_tensor import CHUNK, cast_, cast_numpy, chunk_blocks, scale_
from cupytp.launchers.multi_tensor import scale_numpy
from cupytp.launchers.multi_tensor import sum_of_squares, sum_of_squares_numpy, tensor_table
from cupytp.launchers.sgd import sgd_scalars, sgd_step, sgd_step_numpy
from cupytp.launchers.values import write_values

F16 = numpy.dtype(numpy.float16)
F32 = numpy.dtype(numpy.float32)
F64 = numpy.dtype(numpy.float64)
TOLERANCE = {F64: (1e-12, 1e-12), F32: (1e-5, 1e-5), bfloat16: (1e-2, 1e-2), F16: (2e-3, 2e-3)}

requires_gpu = pytest.mark.skipif(not on_gpu, reason="needs a CUDA GPU and CuPy")


def assert_close(actual, expected, dtype):
    rtol, atol = TOLERANCE[numpy.dtype(dtype)]
    actual = numpy.asarray(asnumpy(actual), dtype=F64)
    expected = numpy.asarray(asnumpy(expected), dtype=F64)
    numpy.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


def random(shape, dtype, seed=0, scale=1.0):
    return (numpy.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)


# ---- loader -------------------------------------------------------------------------------------

def test_loader_helpers():
    assert ceil_div(10, 4) == 3 and ceil_div(8, 4) == 2 and ceil_div(0, 4) == 0
    assert [dtype_suffix(d) for d in (F32, F64, bfloat16, F16)] == ["f32", "f64", "bf16", "f16"]
    assert [compute_dtype(d) for d in (F32, F64, bfloat16, F16)] == [F32, F64, F32, F32]
    with pytest.raises(ValueError, match="no kernel for dtype int32"):
        dtype_suffix(numpy.int32)


@pytest.mark.parametrize("vectors, lanes", [(1, 32), (33, 64), (96, 96), (192, 192), (256, 256),
                                            (384, 128), (640, 128), (768, 256), (800, 128),
                                            (1000, 256)])
def test_rows_grid_covers_the_row_with_few_idle_lanes(vectors, lanes):
    """Lanes across a row: whole warps, at most a block; half a block where that leaves fewer
    lanes past the row's end (384 vectors: 3 blocks of 128, not 2 of 256 with 128 idle). The
    grid covers every vector and every row, about rows_per_thread rows a thread."""
    grid, block = rows_grid(8192, vectors, 256, 16, 1024)
    assert block == (lanes, 256 // lanes)
    assert grid[0] == ceil_div(vectors, lanes)
    assert grid[1] == min(1024, ceil_div(8192, block[1] * 16))


def test_every_launched_source_is_in_the_kernels_folder():
    """The CUDA sources sit in the top-level kernels/ folder (a checkout); every .cu file a
    launcher names is there, and no CUDA source is left beside the launchers."""
    import re
    from pathlib import Path
    import cupytp.launchers as launchers
    folder = sources()
    assert folder == Path(__file__).resolve().parents[2] / "kernels"
    here = Path(launchers.__file__).parent
    named = {m for py in here.glob("*.py") for m in re.findall(r'"(\w+\.cu)"', py.read_text())}
    assert named and all((folder / name).is_file() for name in named), named
    assert not list(here.glob("*.cu")) and not list(here.glob("*.cuh"))


def test_a_changed_header_changes_every_kernels_compile_options(tmp_path):
    """CuPy caches compiled kernels by a source's own text and its options: the digest of
    kernels/*.cuh among the options is what makes a changed header build its sources again."""
    from cupytp.launchers import _source_options
    for path in sources().iterdir():
        if path.suffix in (".cu", ".cuh"):
            (tmp_path / path.name).write_bytes(path.read_bytes())
    before = _source_options(tmp_path)
    assert before[0] == f"-I{tmp_path}" and before[-1].startswith("-DCUPYTP_HEADERS=")
    assert before[1:] == _source_options(sources())[1:]       # the shipped headers' digest
    (tmp_path / "dropout.cu").write_text("// a source's own text is CuPy's key already\n")
    assert _source_options(tmp_path) == before
    philox = tmp_path / "philox.cuh"
    philox.write_text(philox.read_text() + "\n// one more line\n")
    assert _source_options(tmp_path)[-1] != before[-1]


def test_check_lists_names_what_is_wrong():
    from cupytp.launchers import check_lists
    a = [numpy.zeros((2, 3), F32), numpy.zeros(4, F32)]
    assert check_lists(x=a, y=[v.astype(F64) for v in a]) == {"x": F32, "y": F64}
    bad = [("has 1 arrays but p has 2", dict(p=a, x=[a[0]])),
           (r"x\[1\] has dtype float64 but x\[0\] has float32",
            dict(p=a, x=[a[0], a[1].astype(F64)])),
           (r"x\[1\] has shape \(5,\) but p\[1\] has shape \(4,\)",
            dict(p=a, x=[a[0], numpy.zeros(5, F32)])),
           (r"x\[0\] is not C-contiguous", dict(p=a, x=[numpy.zeros((3, 2), F32).T, a[1]])),
           (r"x\[1\] is a list but p\[0\] is a ndarray", dict(p=a, x=[a[0], [0.0]]))]
    for message, lists in bad:
        with pytest.raises(ValueError, match=message):
            check_lists(**lists)


def test_argument_slots_hold_each_argument_as_its_c_type():
    """What cuLaunchKernel reads: kernelParams[i] points at argument i, in its C type."""
    class Array:
        class data:
            ptr = 0x7F00_0000_1000
    args = (Array(), numpy.int32(-5), numpy.float32(1.5), numpy.uint64(2 ** 63 + 3), 7, 2.5,
            numpy.int64(-2 ** 40), True)
    types = tuple(map(type, args))
    assert ArgumentSlots.supports(types, Array) and not ArgumentSlots.supports((list,), Array)
    slots = ArgumentSlots(types, Array)
    slots.fill(args)
    pointers = (ctypes.c_void_p * len(args)).from_address(slots.address)
    read = [ctypes.c_uint64, ctypes.c_int32, ctypes.c_float, ctypes.c_uint64, ctypes.c_int64,
            ctypes.c_double, ctypes.c_int64, ctypes.c_bool]
    values = [kind.from_address(pointer).value for kind, pointer in zip(read, pointers)]
    assert values == [0x7F00_0000_1000, -5, 1.5, 2 ** 63 + 3, 7, 2.5, -2 ** 40, True]
    assert [as_three(d) for d in (4, (4,), (4, 5), (4, 5, 6))] == \
        [(4, 1, 1), (4, 1, 1), (4, 5, 1), (4, 5, 6)]


def test_planned_launch_writes_fixed_scalars_once_and_open_arguments_per_call():
    """A planned launch's kernelParams: the template's scalars as written when planned, its
    open slots (arrays, addresses, typed scalars) as given to each call; grid, block and shared
    memory as planned."""
    class Array:
        def __init__(self, ptr):
            self.data = type("Pointer", (), {"ptr": ptr})()

    launches = []

    class Driver:
        @staticmethod
        def launchKernel(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
            pointers = (ctypes.c_void_p * 5).from_address(params)
            read = [ctypes.c_uint64, ctypes.c_int32, ctypes.c_uint64, ctypes.c_uint64,
                    ctypes.c_float]
            launches.append(((gx, gy, gz, bx, by, bz, shared, stream),
                             [kind.from_address(p).value for kind, p in zip(read, pointers)]))

    class Xp:
        ndarray = Array

        class cuda:
            driver = Driver
            get_current_stream = staticmethod(lambda: type("Stream", (), {"ptr": 77})())

    kernel = Kernel(type("Raw", (), {"kernel": type("Function", (), {"ptr": 5})()})(), Xp)
    launch = kernel.planned((3, 2), 128, (None, numpy.int32(-4), numpy.uint64, None,
                                          numpy.float32(0.5)), shared_mem=64)
    launch(Array(0x1000), numpy.uint64(9), 0x2000)
    launch(Array(0x3000), 11, Array(0x4000))
    config = (3, 2, 1, 128, 1, 1, 64, 77)
    assert launches == [(config, [0x1000, -4, 9, 0x2000, 0.5]),
                        (config, [0x3000, -4, 11, 0x4000, 0.5])]
    with pytest.raises(TypeError, match="a planned launch takes"):
        kernel.planned(1, 1, (None, [1]))


@pytest.mark.skipif(on_gpu, reason="the NumPy backend's error")
def test_get_kernel_needs_cupy():
    with pytest.raises(RuntimeError, match="needs the CuPy backend"):
        get_kernel("gelu.cu", "gelu_forward_f32_v1")


def test_chunk_blocks_cover_every_tensor_once():
    sizes = [0, 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5, 0, 7]
    blocks = chunk_blocks(sizes)
    assert blocks.dtype == numpy.int64 and blocks.shape == (1 + 1 + 2 + 4 + 1, 3)
    for tensor, size in enumerate(sizes):
        mine = blocks[blocks[:, 0] == tensor]
        covered = numpy.concatenate([numpy.arange(start, end) for _, start, end in mine] or [[]])
        numpy.testing.assert_array_equal(covered, numpy.arange(size))
        assert all(end - start <= CHUNK for _, start, end in mine)


# ---- GeLU twin ----------------------------------------------------------------------------------

def gelu_reference(x):
    """GPT-2's tanh GeLU in float64, element by element."""
    c = math.sqrt(2 / math.pi)
    values = [0.5 * v * (1 + math.tanh(c * (v + 0.044715 * v ** 3))) for v in x.ravel().tolist()]
    return numpy.array(values, dtype=F64).reshape(x.shape)


@pytest.mark.parametrize("dtype", [F64, F32, bfloat16, F16], ids=dtype_suffix)
def test_gelu_numpy_matches_float64_math(dtype):
    x = random((5, 41), dtype, scale=3.0)
    y = gelu_numpy(x)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, gelu_reference(x.astype(F64)), dtype)


def test_gelu_numpy_known_values():
    x = numpy.array([0.0, 1.0, -1.0, 10.0])
    expected = [0.0, 0.8411919906082768, -0.15880800939172324, 10.0]
    numpy.testing.assert_allclose(gelu_numpy(x), expected, rtol=1e-15, atol=1e-15)


def test_gelu_backward_numpy_matches_finite_differences():
    x = random((3, 57), F64, seed=1, scale=3.0)
    dy = random((3, 57), F64, seed=2)
    h = 1e-6
    expected = dy * (gelu_reference(x + h) - gelu_reference(x - h)) / (2 * h)
    numpy.testing.assert_allclose(gelu_backward_numpy(x, dy), expected, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("dtype", [F32, bfloat16, F16], ids=dtype_suffix)
def test_gelu_backward_numpy_low_precision_matches_float64(dtype):
    x = random((200,), dtype, seed=3, scale=3.0)
    dy = random((200,), dtype, seed=4)
    dx = gelu_backward_numpy(x, dy)
    assert dx.dtype == dtype
    assert_close(dx, gelu_backward_numpy(x.astype(F64), dy.astype(F64)), dtype)


def test_gelu_on_numpy_arrays_is_the_twin():
    x = random((9,), F32)
    numpy.testing.assert_array_equal(gelu(x), gelu_numpy(x))
    numpy.testing.assert_array_equal(gelu_backward(x, x), gelu_backward_numpy(x, x))


def test_gelu_rejects_bad_inputs():
    x = random((4, 6), F32)
    with pytest.raises(ValueError, match="not C-contiguous"):
        gelu(x.T)
    with pytest.raises(ValueError, match="shape"):
        gelu_backward(x, x[:2])
    with pytest.raises(ValueError, match="dtype"):
        gelu_backward(x, x.astype(F64))
    with pytest.raises(ValueError, match="no kernel for dtype int64"):
        gelu(numpy.arange(3))


# ---- AdamW twin ---------------------------------------------------------------------------------

def adamw_reference(params, grads_per_step, *, lr, beta1, beta2, eps, weight_decay):
    """torch.optim.AdamW's documented algorithm, one Python float at a time."""
    params = [p.astype(F64).ravel().tolist() for p in params]
    exp_avgs = [[0.0] * len(p) for p in params]
    exp_avg_sqs = [[0.0] * len(p) for p in params]
    for t, grads in enumerate(grads_per_step, start=1):
        for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
            for i, gi in enumerate(g.astype(F64).ravel().tolist()):
                p[i] = p[i] - lr * weight_decay * p[i]
                m[i] = beta1 * m[i] + (1 - beta1) * gi
                v[i] = beta2 * v[i] + (1 - beta2) * gi * gi
                m_hat = m[i] / (1 - beta1 ** t)
                v_hat = v[i] / (1 - beta2 ** t)
                p[i] = p[i] - lr * m_hat / (math.sqrt(v_hat) + eps)
    return params, exp_avgs, exp_avg_sqs


ADAMW = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
SMALL_SHAPES = [(1,), (7,), (3, 5), (33,)]


@pytest.mark.parametrize("param_dtype, grad_dtype, tolerance_dtype",
                         [(F64, F64, F64), (F32, bfloat16, F32), (F32, F16, F32)])
def test_adamw_numpy_matches_torch_algorithm(param_dtype, grad_dtype, tolerance_dtype):
    params = [random(shape, param_dtype, seed=i) for i, shape in enumerate(SMALL_SHAPES)]
    grads_per_step = [[random(p.shape, grad_dtype, seed=100 * step + i) for i, p in
                       enumerate(params)] for step in range(5)]
    expected = adamw_reference(params, grads_per_step, **ADAMW)
    exp_avgs = [numpy.zeros_like(p) for p in params]
    exp_avg_sqs = [numpy.zeros_like(p) for p in params]
    for step, grads in enumerate(grads_per_step, start=1):
        adamw_step(params, grads, exp_avgs, exp_avg_sqs, adamw_scalars(step=step, **ADAMW))
    for actual, reference in zip((params, exp_avgs, exp_avg_sqs), expected):
        for a, r in zip(actual, reference):
            assert a.dtype == param_dtype
            assert_close(a.ravel(), r, tolerance_dtype)


def test_adamw_rejects_bad_lists():
    p = [random((4,), F32), random((3,), F32)]
    def state():
        return [numpy.zeros_like(x) for x in p]
    scalars = adamw_scalars(step=1, **ADAMW)
    with pytest.raises(ValueError, match="grads has 1 arrays but params has 2"):
        adamw_step_numpy(p, p[:1], state(), state(), scalars)
    with pytest.raises(ValueError, match=r"grads\[1\] has shape \(4,\)"):
        adamw_step_numpy(p, [p[0], p[0]], state(), state(), scalars)
    with pytest.raises(ValueError, match="exp_avgs must have the params' dtype"):
        adamw_step_numpy(p, p, [x.astype(F64) for x in p], state(), scalars)
    with pytest.raises(ValueError, match="grads must be float32, bfloat16 or float16"):
        adamw_step_numpy(p, [x.astype(F64) for x in p], state(), state(), scalars)
    with pytest.raises(ValueError, match="params must be float32 or float64"):
        half = [x.astype(F16) for x in p]
        adamw_step_numpy(half, half, half, half, scalars)
    with pytest.raises(ValueError, match=r"grads\[1\] has dtype float64"):
        adamw_step_numpy(p, [p[0], p[1].astype(F64)], state(), state(), scalars)
    with pytest.raises(ValueError, match="step counts from 1"):
        adamw_scalars(step=0, **ADAMW)
    square = random((4, 4), F32)
    with pytest.raises(ValueError, match=r"params\[0\] is not C-contiguous"):
        adamw_step_numpy([square.T], [square], [square.copy()], [square.copy()], scalars)


# ---- SGD twin -----------------------------------------------------------------------------------

def sgd_reference(params, grads_per_step, *, lr, momentum, dampening, nesterov, weight_decay):
    """torch.optim.SGD's documented algorithm, one Python float at a time."""
    params = [p.astype(F64).ravel().tolist() for p in params]
    bufs = [[0.0] * len(p) for p in params]
    for t, grads in enumerate(grads_per_step, start=1):
        for p, g, b in zip(params, grads, bufs):
            for i, gi in enumerate(g.astype(F64).ravel().tolist()):
                if weight_decay != 0:
                    gi = gi + weight_decay * p[i]
                if momentum != 0:
                    b[i] = momentum * b[i] + (1 - dampening) * gi if t > 1 else gi
                    gi = gi + momentum * b[i] if nesterov else b[i]
                p[i] = p[i] - lr * gi
    return params, bufs


SGD_CONFIGS = [
    dict(lr=0.1, momentum=0.9, dampening=0.0, nesterov=True, weight_decay=0.01),
    dict(lr=0.1, momentum=0.9, dampening=0.3, nesterov=False, weight_decay=0.1),
    dict(lr=0.05, momentum=0.8, dampening=0.0, nesterov=False, weight_decay=0.0),
    dict(lr=0.1, momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.05),
]


@pytest.mark.parametrize("config", SGD_CONFIGS, ids=["nesterov", "dampening", "plain", "no-mom"])
@pytest.mark.parametrize("param_dtype, grad_dtype", [(F64, F64), (F32, bfloat16)])
def test_sgd_numpy_matches_torch_algorithm(config, param_dtype, grad_dtype):
    params = [random(shape, param_dtype, seed=i) for i, shape in enumerate(SMALL_SHAPES)]
    grads_per_step = [[random(p.shape, grad_dtype, seed=100 * step + i) for i, p in
                       enumerate(params)] for step in range(4)]
    expected_params, expected_bufs = sgd_reference(params, grads_per_step, **config)
    bufs = [numpy.full_like(p, numpy.nan) for p in params] if config["momentum"] else None
    scalars = sgd_scalars(**config)
    for step, grads in enumerate(grads_per_step):
        sgd_step(params, grads, bufs, scalars, nesterov=config["nesterov"],
                 first_step=step == 0)
    for p, r in zip(params, expected_params):
        assert_close(p.ravel(), r, param_dtype)
    for b, r in zip(bufs or [], expected_bufs):
        assert_close(b.ravel(), r, param_dtype)


def test_sgd_rejects_bad_settings():
    p = [random((3,), F32)]
    with pytest.raises(ValueError, match="nesterov momentum needs"):
        sgd_scalars(lr=0.1, momentum=0.9, dampening=0.1, nesterov=True, weight_decay=0.0)
    with pytest.raises(ValueError, match=r"momentum_bufs\[0\] has shape"):
        sgd_step_numpy(p, p, [p[0][:1].copy()], sgd_scalars(lr=0.1, momentum=0.9, dampening=0.0,
                       weight_decay=0.0), nesterov=False, first_step=True)


def test_write_values_twin():
    out = numpy.full(8, numpy.nan)
    write_values(out, [1.5, -2.0, 3.25])
    assert out[:3].tolist() == [1.5, -2.0, 3.25] and numpy.isnan(out[3:]).all()
    with pytest.raises(ValueError, match="at most 8 values"):
        write_values(out, range(9))
    with pytest.raises(ValueError, match="float64 vector"):
        write_values(numpy.zeros(8, numpy.float32), [1.0])


# ---- sum_of_squares / scale_ twins --------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F64, F32, bfloat16, F16], ids=dtype_suffix)
def test_sum_of_squares_numpy_matches_float64(dtype):
    arrays = [random(shape, dtype, seed=i) for i, shape in enumerate(SMALL_SHAPES + [(0,)])]
    total = sum_of_squares(arrays)
    assert total.shape == () and total.dtype == compute_dtype(dtype)
    expected = sum(float(numpy.sum(a.astype(F64) ** 2)) for a in arrays)
    rtol = 1e-14 if dtype == F64 else 1e-6
    numpy.testing.assert_allclose(float(total), expected, rtol=rtol)
    with pytest.raises(ValueError, match="at least one array"):
        sum_of_squares_numpy([])


@pytest.mark.parametrize("dtype", [F64, F32, bfloat16], ids=dtype_suffix)
def test_scale_numpy_multiplies_in_place(dtype):
    arrays = [random(shape, dtype, seed=i) for i, shape in enumerate(SMALL_SHAPES)]
    originals = [a.astype(F64) for a in arrays]
    scale_(arrays, numpy.asarray(0.37, dtype=compute_dtype(dtype)))
    for a, original in zip(arrays, originals):
        assert a.dtype == dtype
        assert_close(a, original * 0.37, dtype)
    with pytest.raises(ValueError, match="factor must be 0-d"):
        scale_numpy(arrays, numpy.ones(2))


@pytest.mark.parametrize("dtype", [bfloat16, F16], ids=dtype_suffix)
def test_cast_numpy_rounds_as_astype(dtype):
    sources = [random(shape, F32, seed=i, scale=300.0) for i, shape in enumerate(SMALL_SHAPES)]
    targets = [numpy.full(a.shape, numpy.nan, dtype) for a in sources]
    cast_(sources, targets)
    for source, target in zip(sources, targets):
        numpy.testing.assert_array_equal(target.astype(F64), source.astype(dtype).astype(F64))
    with pytest.raises(ValueError, match="float32 sources"):
        cast_numpy([a.astype(F64) for a in sources], targets)
    with pytest.raises(ValueError, match="shape"):
        cast_numpy(sources, targets[::-1])


# ---- GPU: each kernel against its twin ----------------------------------------------------------

SIZES = [1, 7, 1000, 65536 * 4 + 3, 65537, 3]


@contextlib.contextmanager
def poisoned_allocations():
    """Every CuPy allocation inside starts as 0xFF bytes (NaN in every float dtype), so an output
    element the kernel never writes fails the comparison."""
    pool = xp.get_default_memory_pool()

    def malloc(size):
        memory = pool.malloc(size)
        if size:
            memory.memset_async(0xFF, size)
        return memory

    with xp.cuda.using_allocator(malloc):
        yield


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [F32, F64, bfloat16, F16], ids=dtype_suffix)
@pytest.mark.parametrize("shape", [(1,), (1001,), (3, 87383)])
@pytest.mark.parametrize("offset", [0, 1])    # 16-byte vectors and a tail; one element past them
def test_gelu_kernels_match_twin(dtype, shape, offset):
    x = random(shape, dtype, seed=1, scale=3.0)
    dy = random(shape, dtype, seed=2)

    def device(a):
        return xp.asarray(numpy.concatenate([numpy.zeros(offset, dtype), a.ravel()]))[
            offset:].reshape(shape)
    with poisoned_allocations():
        y = gelu(device(x))
        dx = gelu_backward(device(x), device(dy))
    assert y.dtype == dtype and y.shape == shape and dx.dtype == dtype and dx.shape == shape
    assert_close(y, gelu_numpy(x), dtype)
    assert_close(dx, gelu_backward_numpy(x, dy), dtype)


def upload(arrays):
    return [xp.asarray(a) for a in arrays]


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("param_dtype, grad_dtype",
                         [(F32, F32), (F32, bfloat16), (F32, F16), (F64, F64), (F64, bfloat16)])
@pytest.mark.parametrize("cast_dtype", [None, bfloat16, F16], ids=str)
def test_adamw_kernel_matches_twin(param_dtype, grad_dtype, cast_dtype):
    """With casts, every other tensor's (the rest have none): the new values rounded, equal to
    the device's own params rounded (vector and element paths: SIZES has odd lengths); casts
    are of float32 parameters only."""
    if cast_dtype is not None and param_dtype != F32:
        pytest.skip("autocast keeps casts of float32 parameters only")
    params = [random((n,), param_dtype, seed=i) for i, n in enumerate(SIZES)]
    exp_avgs = [numpy.zeros_like(p) for p in params]
    exp_avg_sqs = [numpy.zeros_like(p) for p in params]
    device = [upload(params), upload(exp_avgs), upload(exp_avg_sqs)]
    casts = None if cast_dtype is None else \
        [xp.zeros(p.shape, cast_dtype) if i % 2 == 0 else None for i, p in enumerate(params)]
    for step in range(1, 4):
        grads = [random(p.shape, grad_dtype, seed=100 * step + i) for i, p in enumerate(params)]
        scalars = adamw_scalars(step=step, **ADAMW)
        adamw_step_numpy(params, grads, exp_avgs, exp_avg_sqs, scalars)
        on_device = xp.empty(8, xp.float64)
        write_values(on_device, scalars)
        adamw_step(device[0], upload(grads), device[1], device[2], on_device, casts=casts)
    for host_list, device_list in zip((params, exp_avgs, exp_avg_sqs), device):
        for host, on_device in zip(host_list, device_list):
            assert_close(on_device, host, param_dtype)
    for p, cast in zip(device[0], casts or []):
        if cast is not None:
            numpy.testing.assert_array_equal(asnumpy(cast), asnumpy(p).astype(cast_dtype))


def test_adamw_twin_writes_the_casts():
    params = [random((5,), F32, seed=1), random((3, 2), F32, seed=2)]
    grads = [random(p.shape, bfloat16, seed=3) for p in params]
    states = [[numpy.zeros_like(p) for p in params] for _ in range(2)]
    casts = [numpy.zeros((5,), bfloat16), None]
    adamw_step(params, grads, *states, adamw_scalars(step=1, **ADAMW), casts=casts)
    numpy.testing.assert_array_equal(casts[0], params[0].astype(bfloat16))
    with pytest.raises(ValueError, match="casts must be of one dtype"):
        adamw_step(params, grads, *states, adamw_scalars(step=2, **ADAMW),
                   casts=[casts[0], numpy.zeros((3, 2), F16)])
    with pytest.raises(ValueError, match="a cast must be C-contiguous of its parameter's shape"):
        adamw_step(params, grads, *states, adamw_scalars(step=2, **ADAMW),
                   casts=[None, numpy.zeros((2, 3), bfloat16)])
    wide = [p.astype(F64) for p in params]
    with pytest.raises(ValueError, match="casts are of float32 parameters"):
        adamw_step(wide, grads, *[[s.astype(F64) for s in state] for state in states],
                   adamw_scalars(step=2, **ADAMW), casts=casts)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("config", SGD_CONFIGS, ids=["nesterov", "dampening", "plain", "no-mom"])
@pytest.mark.parametrize("param_dtype, grad_dtype", [(F32, F32), (F32, bfloat16), (F64, F64)])
def test_sgd_kernel_matches_twin(config, param_dtype, grad_dtype):
    params = [random((n,), param_dtype, seed=i) for i, n in enumerate(SIZES)]
    bufs = [numpy.full_like(p, numpy.nan) for p in params] if config["momentum"] else None
    device_params = upload(params)
    device_bufs = upload(bufs) if bufs else None
    scalars = sgd_scalars(**config)
    for step in range(3):
        grads = [random(p.shape, grad_dtype, seed=100 * step + i) for i, p in enumerate(params)]
        sgd_step_numpy(params, grads, bufs, scalars, nesterov=config["nesterov"],
                       first_step=step == 0)
        sgd_step(device_params, upload(grads), device_bufs, scalars, nesterov=config["nesterov"],
                 first_step=step == 0)
    for host, on_device in zip(params + (bufs or []), device_params + (device_bufs or [])):
        assert_close(on_device, host, param_dtype)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [F32, F64, bfloat16, F16], ids=dtype_suffix)
def test_sum_of_squares_kernel_matches_twin(dtype):
    arrays = [random((n,), dtype, seed=i) for i, n in enumerate(SIZES + [0])]
    with poisoned_allocations():
        total = sum_of_squares(upload(arrays))
    assert total.shape == () and total.dtype == compute_dtype(dtype)
    rtol = 1e-12 if dtype == F64 else 1e-4
    numpy.testing.assert_allclose(float(total), float(sum_of_squares_numpy(arrays)), rtol=rtol)
    assert float(sum_of_squares(upload([numpy.zeros(0, dtype)]))) == 0.0
    # Small integers: every partial sum is exact even in float32, so one lost element shows.
    rng = numpy.random.default_rng(0)
    integers = [rng.integers(-3, 4, n).astype(dtype) for n in SIZES]
    expected = sum(int(numpy.sum(a.astype(numpy.int64) ** 2)) for a in integers)
    assert float(sum_of_squares(upload(integers))) == expected


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [F32, F64, bfloat16, F16], ids=dtype_suffix)
def test_scale_kernel_matches_twin_exactly(dtype):
    arrays = [random((n,), dtype, seed=i) for i, n in enumerate(SIZES)]
    device = upload(arrays)
    factor = numpy.asarray(0.37, dtype=compute_dtype(dtype))
    scale_numpy(arrays, factor)
    scale_(device, xp.asarray(factor))
    for host, on_device in zip(arrays, device):
        numpy.testing.assert_array_equal(asnumpy(on_device).astype(F64), host.astype(F64))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [bfloat16, F16], ids=dtype_suffix)
def test_cast_kernel_matches_twin_exactly(dtype):
    sources = [random((n,), F32, seed=i, scale=300.0) for i, n in enumerate(SIZES + [0])]
    targets = [numpy.empty(a.shape, dtype) for a in sources]
    cast_numpy(sources, targets)
    with poisoned_allocations():
        device = [xp.empty(a.shape, dtype) for a in sources]
    cast_(upload(sources), device)
    for host, on_device in zip(targets, device):
        numpy.testing.assert_array_equal(asnumpy(on_device).astype(F64), host.astype(F64))


@pytest.mark.gpu
@requires_gpu
def test_tensor_table_is_cached_and_points_at_the_arrays():
    arrays = upload([random((n,), F32, seed=i) for i, n in enumerate(SIZES)])
    table = tensor_table([arrays])
    again = tensor_table([arrays])
    assert again.rows[0] is table.rows[0] and again.blocks is table.blocks
    numpy.testing.assert_array_equal(asnumpy(table.rows[0]), [a.data.ptr for a in arrays])
    numpy.testing.assert_array_equal(asnumpy(table.blocks),
                                     chunk_blocks([a.size for a in arrays]))
    fresh = upload([random((n,), F32, seed=9) for n in SIZES])        # new pointers, same sizes
    both = tensor_table([arrays, fresh])
    assert both.rows[0] is table.rows[0] and both.blocks is table.blocks
    numpy.testing.assert_array_equal(asnumpy(both.rows[1]), [a.data.ptr for a in fresh])
    assert tensor_table([arrays[:-1]]).blocks is not table.blocks


# ---- GEMM (cuBLAS) and its NumPy twin -------------------------------------------------------------
def _bf16(shape, seed):
    return numpy.random.default_rng(seed).standard_normal(shape).astype(bfloat16)


def test_gemm_twin_accumulates_in_float32():
    from cupytp.launchers.gemm import matmul_numpy
    a, b = _bf16((3, 5, 7), 1), _bf16((7, 4), 2)
    exact = a.astype(numpy.float64) @ b.astype(numpy.float64)
    out = matmul_numpy(a, b)
    assert out.dtype == bfloat16
    numpy.testing.assert_allclose(out.astype(numpy.float64), exact, rtol=1e-2, atol=1e-2)
    wide = matmul_numpy(a, b, out_dtype=numpy.float32)      # the float32 sums, unrounded
    assert wide.dtype == numpy.float32
    numpy.testing.assert_allclose(wide, exact, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="not float16"):
        matmul_numpy(a, b, out_dtype=numpy.float16)


@pytest.mark.gpu
@pytest.mark.skipif(not on_gpu, reason="needs a GPU")
@pytest.mark.parametrize("a_shape,b_shape,transpose_a,transpose_b", [
    ((33, 17), (17, 9), False, False), ((4, 33, 17), (17, 9), False, False),
    ((4, 33, 17), (4, 17, 9), False, True), ((4, 33, 17), (17, 9), True, False),
    ((2, 3, 8, 5), (2, 3, 5, 6), True, True),
])
@pytest.mark.parametrize("dtype", [bfloat16, F16, F32, F64], ids=dtype_suffix)
def test_gemm_matches_twin(a_shape, b_shape, transpose_a, transpose_b, dtype):
    from cupytp.launchers.gemm import matmul, matmul_numpy
    a, b = _bf16(a_shape, 3).astype(dtype), _bf16(b_shape, 4).astype(dtype)
    da = xp.swapaxes(xp.ascontiguousarray(xp.swapaxes(xp.asarray(a), -1, -2)), -1, -2) \
        if transpose_a else xp.asarray(a)
    db = xp.swapaxes(xp.ascontiguousarray(xp.swapaxes(xp.asarray(b), -1, -2)), -1, -2) \
        if transpose_b else xp.asarray(b)
    assert da.flags.c_contiguous != transpose_a and db.flags.c_contiguous != transpose_b
    got = asnumpy(matmul(da, db))
    assert got.dtype == dtype
    assert_close(got, matmul_numpy(a, b), dtype)
    if dtype in (bfloat16, F16):       # the float32 sums of 16-bit operands, unrounded
        wide = asnumpy(matmul(da, db, out_dtype=F32))
        assert wide.dtype == F32
        assert_close(wide, matmul_numpy(a, b, out_dtype=F32), F32)
    flat = matmul(da, db, shape=(got.size,))
    assert flat.base is None            # made with the shape, not a view of another array
    numpy.testing.assert_array_equal(asnumpy(flat), got.reshape(-1))


def test_gemm_writes_the_shape_asked():
    from cupytp.launchers.gemm import matmul
    a, b = xp.asarray(_bf16((2, 3, 4), 5)), xp.asarray(_bf16((4, 6), 6))
    out = matmul(a, b, shape=(6, 2, 3))
    assert out.shape == (6, 2, 3)
    numpy.testing.assert_array_equal(asnumpy(out), asnumpy(matmul(a, b)).reshape(6, 2, 3))
    with pytest.raises(ValueError, match="has 36 elements, not the 35"):
        matmul(a, b, shape=(5, 7))


@pytest.mark.parametrize("dtype", [numpy.float64, bfloat16])
def test_contractions_over_an_empty_shard(dtype):
    """A data-parallel rank with no rows of a micro-batch: its weight gradient (the rows
    contracted) is zeros of the weight's shape, its activations empty."""
    from cupytp.ops import linalg
    a, g, w = (xp.zeros(shape, dtype) for shape in ((0, 3, 4), (0, 3, 5), (4, 5)))
    grad = linalg.local_einsum("btc", "btd", "cd", a, g, F32 if dtype == bfloat16 else None)
    numpy.testing.assert_array_equal(asnumpy(grad), numpy.zeros((4, 5)))
    assert linalg.local_einsum("btc", "cd", "btd", a, w).shape == (0, 3, 5)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("spec,shape_a,shape_b,transposed", [
    ("btc,cd->btd", (2, 5, 8), (8, 6), False),               # batch folded into M
    ("btd,cd->btc", (2, 5, 6), (8, 6), False),               # the second operand transposed
    ("btc,btd->cd", (2, 5, 8), (2, 5, 6), False),            # leading contracted axes
    ("bhtd,bhsd->bhts", (2, 3, 5, 4), (2, 3, 7, 4), False),  # batched products
    ("btc,cd->btd", (2, 5, 8), (8, 6), True),                # a transposed view read in place
    ("td,dt->", (3, 4), (4, 3), False),                      # a full contraction to a scalar
])
@pytest.mark.parametrize("out_dtype", [None, F32])
def test_planned_contraction_matches_the_general_path(spec, shape_a, shape_b, transposed,
                                                      out_dtype):
    from cupytp.ops import linalg
    a, b = _bf16(shape_a, 7), _bf16(shape_b, 8)
    da, db = xp.asarray(a), xp.asarray(b)
    if transposed:
        db = xp.swapaxes(xp.ascontiguousarray(xp.swapaxes(db, -1, -2)), -1, -2)
    (sa, sb), out = spec.split("->")[0].split(","), spec.split("->")[1]
    linalg._products.clear()
    first = linalg.local_einsum(sa, sb, out, da, db, out_dtype)      # plans, then runs
    assert len(linalg._products) == 1
    second = linalg.local_einsum(sa, sb, out, da, db, out_dtype)     # the planned product
    assert second.dtype == first.dtype == (out_dtype or bfloat16)
    numpy.testing.assert_array_equal(asnumpy(second), asnumpy(first))
    exact = numpy.einsum(spec, a.astype(numpy.float64), b.astype(numpy.float64))
    numpy.testing.assert_allclose(asnumpy(second).astype(numpy.float64), exact, rtol=2e-2,
                                  atol=2e-2)


# ---- causal softmax ---------------------------------------------------------------------------
def _masked_softmax_reference(x, scale):
    """Independent float64 reference: -inf above the causal diagonal, then softmax."""
    t_len, s_len = x.shape[-2:]
    scores = x.astype(numpy.float64) * scale
    for t in range(t_len):
        scores[..., t, t + s_len - t_len + 1:] = -numpy.inf
    out = numpy.zeros_like(scores)
    for index in numpy.ndindex(scores.shape[:-1]):
        row = scores[index]
        if numpy.isfinite(row).any():
            e = numpy.exp(row - row[numpy.isfinite(row)].max())
            out[index] = e / e.sum()
    return out


@pytest.mark.parametrize("shape", [(2, 3, 5, 5), (4, 7), (2, 3, 6)])
def test_causal_softmax_twin(shape):
    from cupytp.launchers.softmax import causal_softmax_backward_numpy, causal_softmax_numpy
    x = numpy.random.default_rng(5).standard_normal(shape)
    y = causal_softmax_numpy(x, 0.7)
    numpy.testing.assert_allclose(y, _masked_softmax_reference(x, 0.7), rtol=1e-12, atol=1e-15)
    if shape[-2] > shape[-1]:                       # queries with no visible key: zeros
        assert not y[..., 0, :].any()
    g = numpy.random.default_rng(6).standard_normal(shape)
    grad = causal_softmax_backward_numpy(y, g, 0.7)
    eps, numeric = 1e-6, numpy.zeros_like(x)
    for index in numpy.ndindex(shape):
        plus, minus = x.copy(), x.copy()
        plus[index] += eps
        minus[index] -= eps
        numeric[index] = ((causal_softmax_numpy(plus, 0.7) - causal_softmax_numpy(minus, 0.7))
                          * g).sum() / (2 * eps)
    numpy.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-8)


@pytest.mark.gpu
@pytest.mark.skipif(not on_gpu, reason="needs a GPU")
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-6), ("float64", 1e-12), ("bf16", 2e-2)])
@pytest.mark.parametrize("shape", [(3, 2, 37, 37), (5, 300, 300), (2, 9, 1030)])
def test_causal_softmax_kernel_matches_twin(dtype, tol, shape):
    from cupytp.launchers.softmax import (causal_softmax, causal_softmax_backward,
                                        causal_softmax_backward_numpy, causal_softmax_numpy)
    dtype = bfloat16 if dtype == "bf16" else numpy.dtype(dtype)
    rng = numpy.random.default_rng(7)
    x = (3 * rng.standard_normal(shape)).astype(dtype)
    g = rng.standard_normal(shape).astype(dtype)
    y = causal_softmax(xp.asarray(x), 0.125)
    numpy.testing.assert_allclose(asnumpy(y).astype(numpy.float64),
                                  causal_softmax_numpy(x, 0.125).astype(numpy.float64),
                                  rtol=tol, atol=tol)
    y_twin = causal_softmax_numpy(x, 0.125)
    dx = causal_softmax_backward(xp.asarray(y_twin), xp.asarray(g), 0.125)
    numpy.testing.assert_allclose(asnumpy(dx).astype(numpy.float64),
                                  causal_softmax_backward_numpy(y_twin, g, 0.125).astype(
                                      numpy.float64), rtol=tol, atol=tol)


# ---- layer norm -------------------------------------------------------------------------------
def test_layer_norm_twin_against_float64_formula():
    from cupytp.launchers.layernorm import layer_norm_backward_numpy, layer_norm_forward_numpy
    rng = numpy.random.default_rng(8)
    x, w, b, g = (rng.standard_normal(s) for s in ((3, 4, 10), (10,), (10,), (3, 4, 10)))
    y, mu, rstd = layer_norm_forward_numpy(x, w, b, 1e-5)
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    numpy.testing.assert_allclose(y, (x - mean) / numpy.sqrt(var + 1e-5) * w + b, rtol=1e-12)
    numpy.testing.assert_allclose(mu, mean, rtol=1e-12)
    numpy.testing.assert_allclose(rstd, 1 / numpy.sqrt(var + 1e-5), rtol=1e-12)
    eps, numeric = 1e-6, numpy.zeros_like(x)
    for index in numpy.ndindex(x.shape):
        plus, minus = x.copy(), x.copy()
        plus[index] += eps
        minus[index] -= eps
        numeric[index] = ((layer_norm_forward_numpy(plus, w, b, 1e-5)[0]
                           - layer_norm_forward_numpy(minus, w, b, 1e-5)[0]) * g).sum() / (2 * eps)
    numpy.testing.assert_allclose(layer_norm_backward_numpy(g, x, mu, rstd, w), numeric,
                                  rtol=1e-6, atol=1e-8)
    # the weight and bias gradients: finite differences of the same loss
    dx, dw, db = layer_norm_backward_numpy(g, x, mu, rstd, w, param_grads=True)
    numpy.testing.assert_array_equal(dx, layer_norm_backward_numpy(g, x, mu, rstd, w))
    for param, grad in ((w, dw), (b, db)):
        numeric = numpy.zeros_like(param)
        for i in range(param.size):
            values = []
            for step in (eps, -eps):
                param[i] += step
                values.append((layer_norm_forward_numpy(x, w, b, 1e-5)[0] * g).sum())
                param[i] -= step
            numeric[i] = (values[0] - values[1]) / (2 * eps)
        numpy.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-8)


def test_layer_norm_twin_sums_a_given_gradient_before_rounding():
    """`add` joins dx in the compute dtype and the sum is rounded once: exactly dx + add in
    float64; for bf16 storage, the float32 sum rounded, not two bf16 roundings."""
    from cupytp.launchers.layernorm import layer_norm_backward_numpy, layer_norm_forward_numpy
    rng = numpy.random.default_rng(4)
    x, g, add = (rng.standard_normal((3, 16)) for _ in range(3))
    _, mean, rstd = layer_norm_forward_numpy(x, None, None, 1e-5)
    numpy.testing.assert_array_equal(layer_norm_backward_numpy(g, x, mean, rstd, None, add=add),
                                     layer_norm_backward_numpy(g, x, mean, rstd, None) + add)
    x16, g16, add16 = (a.astype(bfloat16) for a in (x, g, add))
    _, mean, rstd = layer_norm_forward_numpy(x16, None, None, 1e-5)
    wide = layer_norm_backward_numpy(g16, x16, mean, rstd, None, numpy.float32)
    numpy.testing.assert_array_equal(
        layer_norm_backward_numpy(g16, x16, mean, rstd, None, add=add16),
        (wide + add16.astype(numpy.float32)).astype(bfloat16))
    from cupytp.launchers.layernorm import layer_norm_backward
    with pytest.raises(ValueError, match="add must have"):
        layer_norm_backward(g, x, mean, rstd, None, add=add[:2])


def test_layer_norm_twin_with_a_16_bit_output():
    """float32 x with bf16 y (autocast): y is the float32 result rounded once; the backward takes
    a bf16 g and gives a float32 dx, the float32 formula on g's values."""
    from cupytp.launchers.layernorm import layer_norm_backward_numpy, layer_norm_forward_numpy
    rng = numpy.random.default_rng(10)
    x, w, b = (rng.standard_normal(s).astype(numpy.float32) for s in ((4, 16), (16,), (16,)))
    g = rng.standard_normal((4, 16)).astype(bfloat16)
    y, mean, rstd = layer_norm_forward_numpy(x, w, b, 1e-5, bfloat16)
    y32, mean32, _ = layer_norm_forward_numpy(x, w, b, 1e-5)
    assert y.dtype == bfloat16 and (y == y32.astype(bfloat16)).all() and (mean == mean32).all()
    dx = layer_norm_backward_numpy(g, x, mean, rstd, w, numpy.float32)
    assert dx.dtype == numpy.float32
    assert (dx == layer_norm_backward_numpy(g.astype(numpy.float32), x, mean, rstd, w)).all()


@pytest.mark.gpu
@pytest.mark.skipif(not on_gpu, reason="needs a GPU")
@pytest.mark.parametrize("dtype,out,tol", [("float32", None, 2e-5), ("float64", None, 1e-12),
                                           ("bf16", None, 3e-2), ("float32", "bf16", 3e-2)])
@pytest.mark.parametrize("shape,affine,form", [
    ((7, 5, 768), True, "cached"), ((4, 2048), True, "cached"), ((2, 4096), False, "cached"),
    ((600, 256), True, "cached"),
    ((3, 1031), False, "streaming"), ((1, 33), True, "streaming"),
    ((2, 16384), True, "streaming")])
def test_layer_norm_kernel_matches_twin(dtype, out, tol, shape, affine, form):
    """Rows held in registers (1, 2 and 4 vectors per thread; more rows than the backward's
    blocks) and streamed (unaligned or long)."""
    from cupytp.launchers.layernorm import (_Plan, _suffix, layer_norm_backward,
                                          layer_norm_backward_numpy, layer_norm_forward,
                                          layer_norm_forward_numpy)
    dtype = bfloat16 if dtype == "bf16" else numpy.dtype(dtype)
    out = bfloat16 if out == "bf16" else dtype
    rng = numpy.random.default_rng(9)
    x, g = rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(out)
    w, b = ((rng.standard_normal(shape[-1:]).astype(dtype) if affine else None)
            for _ in range(2))
    on = lambda a: None if a is None else xp.asarray(a)
    if dtype == numpy.float64 and shape[-1] > 2048:
        form = "streaming"          # 2 doubles per vector: 256 threads x 4 vectors hold 2048
    plan = _Plan("forward", _suffix(dtype, out), shape)
    assert (plan.kernel(on(x)) is plan.cached) == (form == "cached")
    y, mean, rstd = layer_norm_forward(on(x), on(w), on(b), 1e-5, out)
    y_twin, mean_twin, rstd_twin = layer_norm_forward_numpy(x, w, b, 1e-5, out)
    assert y.dtype == out and mean.shape == rstd.shape == shape[:-1] + (1,)
    for got, want in ((y, y_twin), (mean, mean_twin), (rstd, rstd_twin)):
        numpy.testing.assert_allclose(asnumpy(got).astype(numpy.float64),
                                      want.astype(numpy.float64), rtol=tol, atol=tol)
    saved = (on(x), xp.asarray(mean_twin), xp.asarray(rstd_twin))
    add = rng.standard_normal(shape).astype(dtype)
    for given in (None, add):
        dx = layer_norm_backward(on(g), *saved, on(w), dtype, on(given))
        assert dx.dtype == dtype
        numpy.testing.assert_allclose(asnumpy(dx).astype(numpy.float64),
                                      layer_norm_backward_numpy(g, x, mean_twin, rstd_twin, w,
                                                                dtype, given).astype(numpy.float64),
                                      rtol=tol, atol=tol)
    # with the weight and bias gradients summed in the same pass (sums over many rows)
    grads = layer_norm_backward(on(g), *saved, on(w), dtype, on(add), param_grads=True)
    twins = layer_norm_backward_numpy(g, x, mean_twin, rstd_twin, w, dtype, add,
                                      param_grads=True)
    scale = max(1.0, numpy.sqrt(x.size // shape[-1]))
    for got, want, unit in zip(grads, twins, (1.0, scale, scale)):
        assert got.dtype == want.dtype
        numpy.testing.assert_allclose(asnumpy(got).astype(numpy.float64) / unit,
                                      want.astype(numpy.float64) / unit, rtol=tol, atol=tol)
    # dx once more in bf16 and its column sums: in the pass (g in bf16) or after it
    if dtype == numpy.float32:
        for with_sum in (True, False):
            with poisoned_allocations():
                *got, (copy, sums) = layer_norm_backward(on(g), *saved, on(w), dtype, on(add),
                                                         True, (bfloat16, with_sum))
            *want, (_, sums_twin) = layer_norm_backward_numpy(
                g, x, mean_twin, rstd_twin, w, dtype, add, True, (bfloat16, with_sum))
            assert copy.dtype == bfloat16 and (sums is None) == (not with_sum)
            numpy.testing.assert_array_equal(asnumpy(copy), asnumpy(got[0]).astype(bfloat16))
            if with_sum:
                numpy.testing.assert_allclose(asnumpy(sums) / scale, sums_twin / scale,
                                              rtol=tol, atol=tol)
        with poisoned_allocations():        # without the parameters' sums
            dx, (copy, sums) = layer_norm_backward(on(g), *saved, on(w), dtype, on(add), False,
                                                   (bfloat16, False))
        assert sums is None
        numpy.testing.assert_array_equal(asnumpy(copy), asnumpy(dx).astype(bfloat16))
