"""Dynamic loss scaling on one process: GradScaler against the same training without it (exact:
the scales are powers of two), skipped steps that change nothing and do not count in AdamW's
bias corrections, the scale's backoff and growth, the kernels' NumPy twins, a tiny GPT-2 trained
in fp16, and input errors."""
import numpy
import pytest

import cupytp
from cupytp import backend, ops
from cupytp.launchers.loss_scale import update_loss_scale, update_loss_scale_numpy
from cupytp.launchers.multi_tensor import unscale_check_, unscale_check_numpy
from cupytp.models.gpt2 import GPT2, GPT2Config
from cupytp.optim import SGD, AdamW, GradScaler
from dense_reference import full, lay_out, rng_array, step_on_gradients

on_gpu = backend.on_gpu


@pytest.fixture(scope="module", autouse=True)
def world():
    return cupytp.init()


def f32(*values):
    return backend.asarray(numpy.array(values, numpy.float32))


def params_like(values):
    mesh = cupytp.local_mesh()
    return [lay_out(v.copy(), mesh, (cupytp.Replicated(),), requires_grad=True) for v in values]


def run(values, grad_steps, scaler=None, optimizer_class=AdamW, **kwargs):
    """Train copies of `values` on the given gradients per step (see step_on_gradients)."""
    params = params_like(values)
    optimizer = optimizer_class(params, lr=0.1, **kwargs)
    return step_on_gradients(params, optimizer, grad_steps, scaler), optimizer


SHAPES = [(3, 4), (5,)]


def gradients(step):
    return [rng_array(shape, 100 * step + i, numpy.float32) for i, shape in enumerate(SHAPES)]


def test_scaled_training_equals_unscaled():
    values = [rng_array(s, i, numpy.float32) for i, s in enumerate(SHAPES)]
    steps = [gradients(k) for k in range(4)]
    plain, _ = run(values, steps)
    scaled, _ = run(values, steps, GradScaler(init_scale=2.0 ** 12, growth_interval=2))
    for a, b in zip(scaled, plain):
        numpy.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("optimizer_class,kwargs", [(AdamW, {}), (SGD, {"momentum": 0.9})])
def test_a_non_finite_step_changes_nothing_and_does_not_count(optimizer_class, kwargs):
    """Step 2's gradient has an inf: with the scaler, the result equals training without step 2
    (AdamW's bias corrections count the steps taken), and the scale halves."""
    values = [rng_array(s, i, numpy.float32) for i, s in enumerate(SHAPES)]
    steps = [gradients(k) for k in range(5)]
    bad = [g.copy() for g in steps[2]]
    bad[1][3] = numpy.inf
    scaler = GradScaler(init_scale=2.0 ** 4, growth_interval=100)
    scaled, optimizer = run(values, steps[:2] + [bad] + steps[3:], scaler, optimizer_class,
                            **kwargs)
    skipping, _ = run(values, steps[:2] + [None] + steps[3:], None, optimizer_class, **kwargs)
    for a, b in zip(scaled, skipping):
        numpy.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert scaler.get_scale() == 2.0 ** 3
    assert optimizer.steps_skipped() == {0: 1}
    if optimizer_class is AdamW:
        assert optimizer.param_groups[0]["step"] == 5          # every step() call
        assert optimizer.state_dict()["param_groups"][0]["step"] == 4   # the steps taken


def test_the_scale_backs_off_and_grows():
    scaler = GradScaler(init_scale=8.0, growth_factor=2.0, backoff_factor=0.25, growth_interval=3)
    values = [rng_array((4,), 0, numpy.float32)]
    nan = [numpy.full(4, numpy.nan, numpy.float32)]
    good = [numpy.ones(4, numpy.float32)]
    seen = []
    params = params_like(values)
    optimizer = SGD(params, lr=0.1)
    for grads in [nan, good, good, good, good, nan, good]:
        params[0].grad = lay_out(grads[0].copy(), params[0].mesh, params[0].placements)
        scaler.step(optimizer)
        scaler.update()
        seen.append(scaler.get_scale())
    assert seen == [2.0, 2.0, 2.0, 4.0, 4.0, 1.0, 1.0]
    assert scaler.state_dict()["growth_tracker"] == 1
    copy = GradScaler()
    copy.load_state_dict(scaler.state_dict())
    assert copy.get_scale() == 1.0 and copy.state_dict() == scaler.state_dict()


def test_unscale_twice_and_bad_arguments_are_errors():
    params = params_like([numpy.ones(2, numpy.float32)])
    params[0].grad = lay_out(numpy.ones(2, numpy.float32), params[0].mesh, params[0].placements)
    optimizer = SGD(params, lr=0.1)
    scaler = GradScaler()
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match="already called"):
        scaler.unscale_(optimizer)
    for kwargs, match in [({"init_scale": 0}, "init_scale"), ({"growth_factor": 1.0}, "growth"),
                          ({"backoff_factor": 1.0}, "backoff"),
                          ({"growth_interval": 0}, "growth_interval")]:
        with pytest.raises(ValueError, match=match):
            GradScaler(**kwargs)


def test_disabled_scaler_passes_through():
    values = [rng_array(s, i, numpy.float32) for i, s in enumerate(SHAPES)]
    steps = [gradients(k) for k in range(3)]
    plain, _ = run(values, steps)
    scaler = GradScaler(enabled=False)
    assert scaler.get_scale() == 1.0
    disabled, _ = run(values, steps, scaler)
    for a, b in zip(disabled, plain):
        numpy.testing.assert_array_equal(a, b)


def test_unscale_check_twin():
    arrays = [numpy.array([2.0, -4.0], numpy.float32), numpy.array([numpy.inf], numpy.float16)]
    found = numpy.zeros(1, numpy.float32)
    unscale_check_numpy(arrays[:1], numpy.array([0.5], numpy.float32), found)
    numpy.testing.assert_array_equal(arrays[0], [1.0, -2.0])
    assert found[0] == 0
    unscale_check_numpy(arrays[1:], numpy.array([0.25], numpy.float32), found)
    assert found[0] == 1 and numpy.isinf(arrays[1][0])
    unscale_check_numpy(arrays[:1], numpy.array([1.0], numpy.float32), found)
    assert found[0] == 1                                    # never cleared here


def test_update_loss_scale_twin_rejects_bad_buffers():
    with pytest.raises(ValueError, match="tracker"):
        update_loss_scale_numpy(numpy.ones(1, numpy.float32), numpy.zeros(1, numpy.int64),
                                numpy.zeros(1, numpy.float32), 2.0, 0.5, 10)


@pytest.mark.gpu
@pytest.mark.skipif(not on_gpu, reason="needs a GPU")
@pytest.mark.parametrize("dtype", ["float32", "bf16", "float16", "float64"])
def test_unscale_check_kernel_matches_twin(dtype):
    from cupytp.backend import bfloat16
    dtype = bfloat16 if dtype == "bf16" else numpy.dtype(dtype)
    rng = numpy.random.default_rng(2)
    host = [(rng.standard_normal(n) * 100).astype(dtype) for n in (70000, 5, 130001)]
    for poison in (None, numpy.nan, numpy.inf):
        arrays = [a.copy() for a in host]
        if poison is not None:
            arrays[2][99999] = poison
        device = [backend.asarray(a) for a in arrays]
        found, twin_found = f32(0.0), numpy.zeros(1, numpy.float32)
        unscale_check_(device, f32(0.125), found)
        unscale_check_numpy(arrays, numpy.array([0.125], numpy.float32), twin_found)
        assert float(found[0]) == twin_found[0] == (poison is not None)
        for d, a in zip(device, arrays):
            numpy.testing.assert_array_equal(backend.asnumpy(d).astype(numpy.float64),
                                          a.astype(numpy.float64))   # NaN == NaN, bf16 too


@pytest.mark.gpu
@pytest.mark.skipif(not on_gpu, reason="needs a GPU")
def test_update_loss_scale_kernel_matches_twin():
    flags = [0, 1, 0, 0, 0, 0, 1, 0]
    device = (f32(3.0e38), backend.asarray(numpy.zeros(1, numpy.int32)))
    twin = (numpy.array([3.0e38], numpy.float32), numpy.zeros(1, numpy.int32))
    for flag in flags:
        update_loss_scale(*device, f32(flag), 2.0, 0.5, 2)
        update_loss_scale_numpy(*twin, numpy.array([flag], numpy.float32), 2.0, 0.5, 2)
        assert float(device[0][0]) == twin[0][0] and int(device[1][0]) == twin[1][0]
    assert numpy.isfinite(twin[0][0])           # growth past float32's range is refused


@pytest.mark.filterwarnings("ignore::RuntimeWarning")    # the twins' float16 overflows
def test_fp16_gpt2_trains_with_dynamic_loss_scaling():
    """A tiny GPT-2 under autocast("fp16") with a scale large enough to overflow at first: the
    first steps are skipped and back the scale off, then the loss falls."""
    cupytp.manual_seed(0)
    config = GPT2Config(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)
    model = GPT2(config, cupytp.local_mesh())
    optimizer = AdamW(model.parameters(), lr=3e-3)
    scaler = GradScaler(init_scale=2.0 ** 24, growth_interval=1000)
    ids = numpy.random.default_rng(0).integers(0, 32, size=(2, 9))
    x, y = (lay_out(a, model.transformer.wte.weight.mesh, (cupytp.Replicated(),))
            for a in (ids[:, :-1], ids[:, 1:]))
    losses = []
    for _ in range(30):
        with ops.autocast("fp16"):
            _, loss = model(x, y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        losses.append(float(full(loss)))
    skipped = optimizer.steps_skipped()[0]
    assert 1 <= skipped < 15 and scaler.get_scale() < 2.0 ** 24
    assert numpy.isfinite(losses).all() and losses[-1] < losses[0] - 0.5
