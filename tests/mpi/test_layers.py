"""Every tensor-parallel layer equals the dense single-rank layer: parameters, outputs and all
gradients (float64, biases on, uneven sizes), on 1-D and 2-D meshes, built on the mesh directly
and parallelized from a dense model."""
import math

import numpy
import pytest

import cupytp
from cupytp import backend, nn
from cupytp.parallel import apply_tensor_parallel, parallelize_module
from cupytp.tensor import Replicated, Shard, local_mesh
from dense_reference import full, lay_out, rng_array


def skip_unless_heads_split(mesh, heads=4):
    tp = mesh.shape[nn.tp_dim(mesh)]
    if heads % tp:
        pytest.skip(f"{heads} heads do not split over {tp} ranks")


def build(factory, mesh, seed=0):
    cupytp.manual_seed(seed)
    return factory(mesh)


def compare(dense, parallel, x, mesh, x_placement=None, rtol=1e-10, atol=1e-12):
    """Same parameters, outputs and gradients (inputs and parameters) for the two models."""
    dense_params = dict(dense.named_parameters())
    parallel_params = dict(parallel.named_parameters())
    assert list(dense_params) == list(parallel_params)
    for name in dense_params:
        numpy.testing.assert_array_equal(full(parallel_params[name]), full(dense_params[name]),
                                         err_msg=f"parameter {name}")
    replicated = (Replicated(),) * mesh.ndim
    x_placement = x_placement or replicated
    xd = lay_out(x, local_mesh(), (Replicated(),), requires_grad=True)
    xp = lay_out(x, mesh, x_placement, requires_grad=True)
    yd, yp = dense(xd), parallel(xp)
    numpy.testing.assert_allclose(full(yp), full(yd), rtol=rtol, atol=atol, err_msg="output")
    w = rng_array(yd.shape, 99)
    (yd * lay_out(w, local_mesh(), (Replicated(),))).sum().backward()
    (yp * lay_out(w, mesh, replicated)).sum().backward()
    numpy.testing.assert_allclose(full(xp.grad), full(xd.grad), rtol=rtol, atol=atol,
                                  err_msg="input gradient")
    for name in dense_params:
        numpy.testing.assert_allclose(full(parallel_params[name].grad),
                                      full(dense_params[name].grad), rtol=rtol, atol=atol,
                                      err_msg=f"gradient of {name}")
    return yp


LAYERS = {
    "column": lambda m: nn.DColumnLinear(5, 7, m, dtype="fp64"),
    "column_gather": lambda m: nn.DColumnLinear(5, 7, m, gather_output=True, dtype="fp64"),
    "row": lambda m: nn.DRowLinear(7, 5, m, dtype="fp64"),
    "linear_row_no_bias": lambda m: nn.DLinear(7, 5, m, weight=Shard(0), bias=False,
                                               dtype="fp64"),
    "linear_replicated_bias": lambda m: nn.DLinear(5, 7, m, weight=Shard(1),
                                                   bias_sharding=Replicated(), dtype="fp64"),
    "mlp": lambda m: nn.DMLP(6, 10, mesh=m, dtype="fp64"),
    "attention": lambda m: nn.DAttention(8, 4, m, dtype="fp64"),
    "block": lambda m: nn.DBlock(8, 4, m, dtype="fp64"),
    "layernorm": lambda m: nn.LayerNorm(5, m, dtype="fp64"),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_built_on_mesh_equals_dense(mesh, name):
    if name in ("attention", "block"):
        skip_unless_heads_split(mesh)
    x = rng_array((3, 4, 7 if name.startswith(("row", "linear_row")) else
                   6 if name == "mlp" else 8 if name in ("attention", "block") else 5), 1)
    dense = build(LAYERS[name], local_mesh())
    parallel = build(LAYERS[name], mesh)
    y = compare(dense, parallel, x, mesh)
    if name in ("row", "mlp", "attention", "block", "column_gather"):
        assert all(p == Replicated() for p in y.placements)


def test_mlp_is_the_gpt2_formula(world):
    """DMLP (c_fc's bias fused into the GeLU) is gelu(x W1 + b1) W2 + b2 with nonzero biases,
    and its c_fc bias gradient is the finite-difference one."""
    mlp = build(LAYERS["mlp"], local_mesh())
    for seed, bias in enumerate((mlp.c_fc.bias, mlp.c_proj.bias)):
        bias.to_local()[...] = backend.asarray(rng_array(bias.shape, 31 + seed))
    w1, b1, w2, b2 = (full(p) for p in (mlp.c_fc.weight, mlp.c_fc.bias, mlp.c_proj.weight,
                                        mlp.c_proj.bias))
    x = rng_array((2, 3, 6), 33)

    def formula(b):
        z = x @ w1 + b
        return 0.5 * z * (1 + numpy.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z ** 3))) \
            @ w2 + b2
    y = mlp(lay_out(x, local_mesh(), (Replicated(),)))
    numpy.testing.assert_allclose(full(y), formula(b1), rtol=1e-12)
    y.sum().backward()
    numeric = [(formula(b1 + 1e-6 * e).sum() - formula(b1 - 1e-6 * e).sum()) / 2e-6
               for e in numpy.eye(len(b1))]
    numpy.testing.assert_allclose(full(mlp.c_fc.bias.grad), numeric, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("name", ["mlp", "attention", "block"])
def test_apply_tensor_parallel_equals_dense(mesh, name):
    skip_unless_heads_split(mesh)
    x = rng_array((2, 5, 6 if name == "mlp" else 8), 2)
    dense = build(LAYERS[name], local_mesh())
    parallel = apply_tensor_parallel(build(LAYERS[name], local_mesh()), mesh)
    tp = mesh.shape[nn.tp_dim(mesh)]
    if tp > 1:
        assert any(isinstance(p, Shard) for param in parallel.parameters()
                   for p in param.placements)
    compare(dense, parallel, x, mesh)


def test_batch_sharded_input_on_2d_mesh(mesh2d):
    """dp × tp: input Shard(0) over dp, layer sharded over tp; gradients of replicated
    parameters are summed over dp by the layout rules."""
    skip_unless_heads_split(mesh2d)
    x = rng_array((4, 3, 8), 3)
    dense = build(LAYERS["block"], local_mesh())
    parallel = build(LAYERS["block"], mesh2d)
    compare(dense, parallel, x, mesh2d, x_placement=(Shard(0), Replicated()))


class TinyLM(nn.Module):
    def __init__(self, mesh, vocab=13, dim=8, heads=4):
        super().__init__()
        self.wte = nn.DEmbedding(vocab, dim, mesh, dtype="fp64")
        self.wpe = nn.DEmbedding(6, dim, mesh, dtype="fp64")
        self.h = nn.ModuleList([nn.DBlock(dim, heads, mesh, dtype="fp64") for _ in range(2)])
        self.ln_f = nn.LayerNorm(dim, mesh, dtype="fp64")
        self.lm_head = nn.DLMHead(self.wte)

    def forward(self, ids, targets):
        positions = cupytp.arange(ids.shape[1], ids.mesh, (Replicated(),) * ids.mesh.ndim)
        x = self.wte(ids) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        return cupytp.cross_entropy(self.lm_head(self.ln_f(x)), targets)


def test_tied_vocab_parallel_lm_equals_dense(mesh):
    skip_unless_heads_split(mesh)
    ids = numpy.random.default_rng(4).integers(0, 13, size=(2, 6))
    targets = numpy.random.default_rng(5).integers(0, 13, size=(2, 6))
    dense = build(TinyLM, local_mesh())
    parallel = apply_tensor_parallel(build(TinyLM, local_mesh()), mesh)
    if mesh.shape[nn.tp_dim(mesh)] > 1:
        assert parallel.wte.weight.placements[nn.tp_dim(mesh)] == Shard(0)
    replicated = (Replicated(),) * mesh.ndim
    loss_d = dense(lay_out(ids, local_mesh(), (Replicated(),)),
                   lay_out(targets, local_mesh(), (Replicated(),)))
    loss_p = parallel(lay_out(ids, mesh, replicated), lay_out(targets, mesh, replicated))
    numpy.testing.assert_allclose(full(loss_p), full(loss_d), rtol=1e-12)
    loss_d.backward()
    loss_p.backward()
    for (name, pd), (_, pp) in zip(dense.named_parameters(), parallel.named_parameters()):
        numpy.testing.assert_allclose(full(pp.grad), full(pd.grad), rtol=1e-10, atol=1e-12,
                                      err_msg=name)


def test_heads_not_divisible_raise(mesh1d):
    tp = mesh1d.size()
    if tp == 1:
        pytest.skip("any head count splits over one rank")
    with pytest.raises(ValueError, match="heads cannot be split"):
        nn.DAttention(2 * (tp + 1), tp + 1, mesh1d)


def test_plan_errors(mesh1d):
    model = build(LAYERS["mlp"], local_mesh())
    with pytest.raises(ValueError, match="matches no module"):
        parallelize_module(model, mesh1d, {"nothing.here": "colwise"})
    with pytest.raises(ValueError, match="not one of"):
        parallelize_module(model, mesh1d, {"c_fc": "diagonal"})
    with pytest.raises(ValueError, match="no 'vocab' layout"):
        parallelize_module(model, mesh1d, {"c_fc": "vocab"})


def test_block_under_bf16_autocast_matches_fp32(mesh):
    """A sharded block in bf16 autocast stays within bf16 accuracy of the dense fp32 block, in
    its output and in every gradient; the fp32 parameters get fp32 gradients (cuBLAS's fp32
    output for the weights, the column-parallel input gradient reduced inside the layer)."""
    skip_unless_heads_split(mesh)
    x = rng_array((2, 4, 8), 6).astype(numpy.float32)
    w = rng_array((2, 4, 8), 7).astype(numpy.float32)
    dense = build(lambda m: nn.DBlock(8, 4, m), local_mesh())
    parallel = build(lambda m: nn.DBlock(8, 4, m), mesh)
    replicated = (Replicated(),) * mesh.ndim
    xd = lay_out(x, local_mesh(), (Replicated(),), requires_grad=True)
    xp = lay_out(x, mesh, replicated, requires_grad=True)
    yd = dense(xd)
    with cupytp.autocast("bf16"):
        yp = parallel(xp)
    numpy.testing.assert_allclose(full(yp).astype(numpy.float64), full(yd), rtol=5e-2, atol=5e-2)
    (yd * lay_out(w, local_mesh(), (Replicated(),))).sum().backward()
    (yp.astype("fp32") * lay_out(w, mesh, replicated)).sum().backward()
    pairs = [("input", xp.grad, xd.grad)] + [
        (name, p.grad, dict(dense.named_parameters())[name].grad)
        for name, p in parallel.named_parameters()]
    for name, got, want in pairs:
        assert got.dtype == numpy.float32, name
        want = full(want)
        numpy.testing.assert_allclose(full(got), want, rtol=5e-2,
                                      atol=5e-2 * numpy.abs(want).max(), err_msg=name)
