"""cupytp.optim on one process: SGD and AdamW against torch.optim's documented algorithms written
out in plain NumPy (independent of the kernels and their twins), param groups, zero_grad, state
dict round trips, learning-rate schedules and input errors."""
import math

import numpy
import pytest

import cupytp
from cupytp import backend
from cupytp.optim import (
    SGD, AdamW, LRScheduler, clip_grad_norm_, constant, cosine_with_warmup, decay_groups, linear)
from dense_reference import lay_out, rng_array

SHAPES = [(3, 4), (5,), (1,), (2, 3, 2)]
STEPS = 4


@pytest.fixture(scope="module", autouse=True)
def world():
    return cupytp.init()


def make_params(shapes=SHAPES, seed=0, dtype=numpy.float64):
    """(initial values, parameters on a one-rank mesh holding copies of them)."""
    values = [rng_array(shape, seed + i, dtype) for i, shape in enumerate(shapes)]
    mesh = cupytp.local_mesh()
    params = [lay_out(v.copy(), mesh, (cupytp.Replicated(),), requires_grad=True)
              for v in values]
    return values, params


def grads_for(values, step, dtype=numpy.float64):
    return [rng_array(v.shape, 1000 * (step + 1) + i, dtype) for i, v in enumerate(values)]


def set_grads(params, grads):
    for p, g in zip(params, grads):
        p.grad = None if g is None else lay_out(g, p.mesh, p.placements)


def value(p):
    return backend.asnumpy(p.to_local())


# ---- references: torch.optim's documented algorithms, one array at a time -----------------------

def sgd_reference(p, grads, lr, momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0):
    """torch.optim.SGD: returns (param, momentum buffer) after one update per gradient."""
    buf = None
    for g in grads:
        if weight_decay != 0:
            g = g + weight_decay * p
        if momentum != 0:
            buf = g.copy() if buf is None else momentum * buf + (1 - dampening) * g
            g = g + momentum * buf if nesterov else buf
        p = p - lr * g
    return p, buf


def adamw_reference(p, grads, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
    """torch.optim.AdamW (amsgrad=False): returns (param, exp_avg, exp_avg_sq)."""
    beta1, beta2 = betas
    m = numpy.zeros_like(p)
    v = numpy.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        p = p - lr * weight_decay * p
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        m_hat = m / (1 - beta1 ** t)
        v_hat = v / (1 - beta2 ** t)
        p = p - lr * m_hat / (numpy.sqrt(v_hat) + eps)
    return p, m, v


def run(optimizer, params, values, steps=STEPS, first=0):
    """`steps` optimizer steps with the gradients of grads_for(values, first ...)."""
    for step in range(first, first + steps):
        set_grads(params, grads_for(values, step))
        optimizer.step()


def history(values, steps=STEPS):
    """The gradients run() feeds, per parameter."""
    per_step = [grads_for(values, step) for step in range(steps)]
    return [[grads[i] for grads in per_step] for i in range(len(values))]


# ---- SGD and AdamW ------------------------------------------------------------------------------

SGD_CONFIGS = [
    dict(lr=0.1),
    dict(lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.1),
    dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.01),
]


@pytest.mark.parametrize("config", SGD_CONFIGS, ids=["plain", "dampening", "nesterov"])
def test_sgd_matches_torch_algorithm(config):
    values, params = make_params()
    locals_before = [p._local for p in params]
    optimizer = SGD(params, **config)
    run(optimizer, params, values)
    for p, local, v, grads in zip(params, locals_before, values, history(values)):
        assert p._local is local, "parameters are updated in place"
        expected, buf = sgd_reference(v, grads, **config)
        numpy.testing.assert_allclose(value(p), expected, rtol=1e-12, atol=1e-14)
        if buf is not None:
            state = optimizer.state[p]["momentum_buffer"]
            assert state.layout == p.layout
            numpy.testing.assert_allclose(value(state), buf, rtol=1e-12, atol=1e-14)
        else:
            assert optimizer.state_dict()["state"] == {}


def test_adamw_matches_torch_algorithm():
    values, params = make_params()
    locals_before = [p._local for p in params]
    config = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    optimizer = AdamW(params, **config)
    run(optimizer, params, values)
    assert optimizer.param_groups[0]["step"] == STEPS
    for p, local, v, grads in zip(params, locals_before, values, history(values)):
        assert p._local is local, "parameters are updated in place"
        expected, m, v2 = adamw_reference(v, grads, **config)
        numpy.testing.assert_allclose(value(p), expected, rtol=1e-12, atol=1e-14)
        numpy.testing.assert_allclose(value(optimizer.state[p]["exp_avg"]), m, rtol=1e-12)
        numpy.testing.assert_allclose(value(optimizer.state[p]["exp_avg_sq"]), v2, rtol=1e-12)


def test_adamw_defaults_are_torchs():
    values, params = make_params()
    optimizer = AdamW(params)
    assert {k: v for k, v in optimizer.defaults.items() if k != "step"} == dict(
        lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    run(optimizer, params, values)
    for p, v, grads in zip(params, values, history(values)):
        numpy.testing.assert_allclose(value(p), adamw_reference(v, grads)[0], rtol=1e-12)


def test_low_precision_grads_update_wide_params():
    """float32 params with bfloat16 and float32 gradients in one group (two kernel calls)."""
    values, params = make_params(dtype=numpy.float32)
    grad_dtypes = [backend.bfloat16, numpy.float32, backend.bfloat16, numpy.float32]
    optimizer = AdamW(params, lr=1e-2, weight_decay=0.1)
    all_grads = []
    for step in range(STEPS):
        grads = [g.astype(d) for g, d in zip(grads_for(values, step), grad_dtypes)]
        all_grads.append(grads)
        set_grads(params, grads)
        optimizer.step()
    for i, (p, v) in enumerate(zip(params, values)):
        grads = [step_grads[i].astype(numpy.float64) for step_grads in all_grads]
        expected = adamw_reference(v.astype(numpy.float64), grads, lr=1e-2, weight_decay=0.1)[0]
        assert p.dtype == numpy.float32
        numpy.testing.assert_allclose(value(p), expected, rtol=1e-5, atol=1e-6)


def test_param_groups_have_their_own_hyperparameters():
    values, params = make_params()
    groups = [{"params": params[:2], "lr": 0.05, "weight_decay": 0.0},
              {"params": params[2:], "betas": (0.5, 0.9)}]
    optimizer = AdamW(groups, lr=1e-2, weight_decay=0.2)
    run(optimizer, params, values)
    settings = [dict(lr=0.05, weight_decay=0.0)] * 2 + \
        [dict(lr=1e-2, weight_decay=0.2, betas=(0.5, 0.9))] * 2
    for p, v, grads, setting in zip(params, values, history(values), settings):
        numpy.testing.assert_allclose(value(p), adamw_reference(v, grads, **setting)[0],
                                      rtol=1e-12)


def test_sgd_param_groups():
    values, params = make_params()
    optimizer = SGD([{"params": params[:1], "momentum": 0.9}, {"params": params[1:]}], lr=0.1,
                    weight_decay=0.01)
    run(optimizer, params, values)
    for i, (p, v, grads) in enumerate(zip(params, values, history(values))):
        momentum = 0.9 if i == 0 else 0.0
        expected = sgd_reference(v, grads, lr=0.1, momentum=momentum, weight_decay=0.01)[0]
        numpy.testing.assert_allclose(value(p), expected, rtol=1e-12)


def test_decay_groups_decay_matrices_only():
    values, params = make_params()
    decay, no_decay = decay_groups(params, 0.1)
    assert decay == {"params": [params[0], params[3]], "weight_decay": 0.1}
    assert no_decay == {"params": [params[1], params[2]], "weight_decay": 0.0}
    optimizer = AdamW(decay_groups(params, 0.1), lr=1e-2)
    run(optimizer, params, values)
    for p, v, grads in zip(params, values, history(values)):
        expected = adamw_reference(v, grads, lr=1e-2, weight_decay=0.1 if v.ndim >= 2 else 0.0)
        numpy.testing.assert_allclose(value(p), expected[0], rtol=1e-12)


def test_decay_groups_by_name_never_decay_biases():
    """GPT-2's fused q|k|v bias is [3, C]: two dimensions, yet a bias (no decay, as in PyTorch's
    GPT-2 recipe where it is [3C])."""
    _, params = make_params()
    names = ["h.0.attn.c_attn.bias" if p.ndim >= 2 else f"p{i}" for i, p in enumerate(params)]
    names[0] = "h.0.attn.c_attn.weight"
    decay, no_decay = decay_groups(zip(names, params), 0.1)
    assert decay["params"] == [params[0]]
    assert no_decay["params"] == [params[1], params[2], params[3]]


def test_parameters_without_gradients_are_skipped():
    values, params = make_params()
    optimizer = AdamW([{"params": params[:3]}, {"params": params[3:]}], lr=1e-2)
    for step in range(STEPS):
        grads = grads_for(values, step)
        set_grads(params, grads[:2] + [None, None])
        optimizer.step()
    numpy.testing.assert_array_equal(value(params[2]), values[2])
    numpy.testing.assert_array_equal(value(params[3]), values[3])
    assert params[2] not in optimizer.state and params[3] not in optimizer.state
    assert [group["step"] for group in optimizer.param_groups] == [STEPS, 0]
    for p, v, grads in list(zip(params, values, history(values)))[:2]:
        numpy.testing.assert_allclose(value(p), adamw_reference(v, grads, lr=1e-2)[0],
                                      rtol=1e-12)


def test_zero_grad():
    values, params = make_params()
    optimizer = SGD(params, lr=0.1)
    set_grads(params, grads_for(values, 0))
    grads = [p.grad._local for p in params]
    optimizer.zero_grad(set_to_none=False)
    for p, g in zip(params, grads):
        assert p.grad._local is g and not value(p.grad).any()
    optimizer.zero_grad()
    assert all(p.grad is None for p in params)
    optimizer.step()        # no gradients: nothing moves
    for p, v in zip(params, values):
        numpy.testing.assert_array_equal(value(p), v)


# ---- state dict ---------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda params: AdamW(decay_groups(params, 0.1), lr=1e-2, betas=(0.8, 0.9)),
    lambda params: SGD([{"params": params[:2], "nesterov": True}, {"params": params[2:]}],
                       lr=0.1, momentum=0.9),
], ids=["adamw", "sgd"])
def test_resumed_optimizer_continues_identically(make):
    values, params = make_params()
    optimizer = make(params)
    run(optimizer, params, values, steps=3)
    _, resumed_params = make_params()
    for p, q in zip(params, resumed_params):
        q._local[...] = p._local
    resumed = make(resumed_params)
    resumed.load_state_dict(optimizer.state_dict())
    state = resumed.state_dict()
    saved = optimizer.state_dict()
    assert state["param_groups"] == saved["param_groups"]
    assert state["state"].keys() == saved["state"].keys() and state["state"]
    for index, states in state["state"].items():
        assert list(states) == list(saved["state"][index]), "states keep their order"
        for name, tensor in states.items():
            assert tensor._local is not saved["state"][index][name]._local, "loading copies"
            numpy.testing.assert_array_equal(value(tensor), value(saved["state"][index][name]))
    run(optimizer, params, values, steps=3, first=3)
    run(resumed, resumed_params, values, steps=3, first=3)
    for p, q in zip(params, resumed_params):
        numpy.testing.assert_array_equal(value(q), value(p))


def test_state_dict_layout():
    values, params = make_params()
    optimizer = AdamW([{"params": params[:1]}, {"params": params[1:], "lr": 0.5}])
    set_grads(params, [grads_for(values, 0)[0], None, None, None])
    optimizer.step()
    state = optimizer.state_dict()
    assert list(state["state"]) == [0] and sorted(state["state"][0]) == ["exp_avg", "exp_avg_sq"]
    assert state["param_groups"] == [
        dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, step=1, params=[0]),
        dict(lr=0.5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, step=0,
             params=[1, 2, 3])]


def test_load_state_dict_rejects_a_mismatch():
    values, params = make_params()
    sgd = SGD(params, lr=0.1, momentum=0.9)
    run(sgd, params, values, steps=1)
    split = SGD([{"params": params[:1]}, {"params": params[1:]}], lr=0.1)
    with pytest.raises(ValueError, match=r"groups of \[4\] parameters, this optimizer has "
                                         r"\[1, 3\]"):
        split.load_state_dict(sgd.state_dict())
    with pytest.raises(ValueError, match=r"lacks hyperparameters \['betas', 'eps', 'step'\]"):
        AdamW(params).load_state_dict(sgd.state_dict())
    no_momentum = sgd.state_dict()
    no_momentum["param_groups"][0]["momentum"] = 0.0
    with pytest.raises(ValueError, match=r"state of parameter 0 has \['momentum_buffer'\], "
                                         r"this optimizer keeps \[\]"):
        SGD(params, lr=0.1).load_state_dict(no_momentum)
    extra = sgd.state_dict()
    extra["state"][7] = extra["state"][0]
    with pytest.raises(ValueError, match=r"states for parameters \[7\]"):
        SGD(params, lr=0.1).load_state_dict(extra)


# ---- learning-rate schedules --------------------------------------------------------------------

def test_cosine_with_warmup_key_steps():
    def lr(step):
        return cosine_with_warmup(step, max_lr=1.0, warmup_steps=10, total_steps=110, min_lr=0.1)
    assert lr(0) == pytest.approx(0.1)             # warmup starts at max_lr / warmup_steps
    assert lr(4) == pytest.approx(0.5)
    assert lr(9) == pytest.approx(1.0)             # warmup end
    assert lr(10) == pytest.approx(1.0)            # decay start
    assert lr(60) == pytest.approx(0.55)           # middle of the decay: (max + min) / 2
    assert lr(35) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 4)))
    assert lr(110) == pytest.approx(0.1)           # end
    assert lr(1000) == pytest.approx(0.1)          # stays at min_lr


def test_linear_and_constant_key_steps():
    assert linear(9, 2.0, 10, 110) == pytest.approx(2.0)
    assert linear(60, 2.0, 10, 110, min_lr=1.0) == pytest.approx(1.5)
    assert linear(110, 2.0, 10, 110) == 0.0
    assert linear(500, 2.0, 10, 110, min_lr=0.5) == pytest.approx(0.5)
    assert linear(3, 1.0, 0, 4) == pytest.approx(0.25)       # no warmup
    assert constant(0, 0.3) == 0.3 and constant(10 ** 6, 0.3) == 0.3
    assert constant(1, 0.3, warmup_steps=4) == pytest.approx(0.15)
    assert constant(4, 0.3, warmup_steps=4) == 0.3


def test_lr_scheduler_sets_every_group():
    values, params = make_params()
    optimizer = SGD([{"params": params[:2]}, {"params": params[2:], "lr": 5.0}], lr=1.0)
    scheduler = LRScheduler(optimizer, lambda step: linear(step, 1.0, 2, 6))
    seen = []
    for _ in range(8):
        seen.append([group["lr"] for group in optimizer.param_groups])
        scheduler.step()
    expected = [0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    assert seen == [[pytest.approx(lr)] * 2 for lr in expected]
    resumed = LRScheduler(optimizer, lambda step: linear(step, 1.0, 2, 6))
    resumed.load_state_dict({"last_step": 4})
    assert scheduler.state_dict() == {"last_step": 8}
    assert optimizer.param_groups[1]["lr"] == pytest.approx(0.5)


# ---- input errors -------------------------------------------------------------------------------

def test_bad_inputs_raise_clear_errors():
    values, params = make_params()
    cases = [
        (lambda: SGD(params, lr=-0.1), "lr must be >= 0, got -0.1"),
        (lambda: SGD(params, lr=0.1, momentum=-0.5), "momentum must be >= 0"),
        (lambda: SGD(params, lr=0.1, weight_decay=-1), "weight_decay must be >= 0"),
        (lambda: SGD(params, lr=0.1, nesterov=True), "nesterov momentum needs momentum > 0"),
        (lambda: SGD(params, lr=0.1, momentum=0.9, dampening=0.1, nesterov=True),
         "dampening == 0"),
        (lambda: AdamW(params, lr=-1e-3), "lr must be >= 0"),
        (lambda: AdamW(params, eps=-1e-8), "eps must be >= 0"),
        (lambda: AdamW(params, betas=(1.0, 0.999)), r"betas\[0\] must be in \[0, 1\)"),
        (lambda: AdamW(params, betas=(0.9, -0.1)), r"betas\[1\] must be in \[0, 1\)"),
        (lambda: AdamW(params, betas=(0.9,)), r"betas must be \(beta1, beta2\)"),
        (lambda: AdamW(params, weight_decay=-0.01), "weight_decay must be >= 0"),
        (lambda: AdamW([{"params": params, "lr": -1.0}]), "lr must be >= 0"),
        (lambda: AdamW([]), "empty parameter list"),
        (lambda: AdamW(params + params[:1]), "more than once"),
        (lambda: AdamW([{"params": params[:2]}, {"params": params[1:]}]), "more than once"),
        (lambda: cosine_with_warmup(-1, 1.0, 10, 100), "step must be >= 0"),
        (lambda: cosine_with_warmup(0, 1.0, 10, 5), r"total_steps \(5\) must be >= warmup"),
        (lambda: cosine_with_warmup(0, 1.0, 10, 100, min_lr=2.0), r"min_lr \(2.0\) must be <="),
        (lambda: linear(0, -1.0, 10, 100), "max_lr must be >= 0"),
        (lambda: constant(0, -1.0), "lr must be >= 0"),
        (lambda: clip_grad_norm_(params, 1.0, norm_type=1), "norm_type must be 2 or inf"),
        (lambda: clip_grad_norm_(params, -1.0), "max_norm must be >= 0"),
    ]
    for make, message in cases:
        with pytest.raises(ValueError, match=message):
            make()
    with pytest.raises(TypeError, match="iterable of DTensors or of dicts, got one DTensor"):
        SGD(params[0], lr=0.1)
    with pytest.raises(TypeError, match="must be DTensors, got ndarray"):
        SGD([values[0]], lr=0.1)


def test_gradient_laid_out_unlike_its_parameter_is_an_error():
    values, params = make_params()
    optimizer = SGD(params, lr=0.1)
    params[0].grad = lay_out(numpy.ones((4, 3)), params[0].mesh, params[0].placements)
    with pytest.raises(ValueError, match=r"gradient of shape \(4, 3\) \[R\] is not laid out "
                                         r"like its parameter \(3, 4\) \[R\]"):
        optimizer.step()


@pytest.mark.parametrize("make", [lambda p: SGD(p, lr=0.1), lambda p: AdamW(p, lr=0.1)])
def test_parameter_with_a_strided_local_array_is_an_error(make):
    """The kernels update parameters in place as contiguous memory: the optimizer checks its
    lists itself (the kernels trust them) and names the parameter that is not, updating none of
    its group."""
    values, params = make_params()
    optimizer = make(params)
    set_grads(params, grads_for(values, 0))
    params[0]._local = backend.xp.asarray(values[0].T.copy()).T      # (3, 4), strided
    before = [backend.asnumpy(p.to_local()).copy() for p in params]
    with pytest.raises(ValueError, match=r"parameter of shape \(3, 4\) has a local array that "
                                         r"is not C-contiguous"):
        optimizer.step()
    for p, value in zip(params, before):
        numpy.testing.assert_array_equal(backend.asnumpy(p.to_local()), value)
