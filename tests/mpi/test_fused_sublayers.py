"""The fused sublayers (ops.mlp_residual, ops.attention_residual): one tape node each, the
outputs and gradients of their chains of ops to bf16 rounding (the fused products round once,
after their epilogues), equal to the dense single-rank block (float64 to rounding), on 1-D and 2-D
meshes with uneven batch shards, with biases and without, with dropout and without (the fused
kernels draw the chain's masks, the same on every mesh); layouts they do not take run the chain;
under no_grad nothing is kept for a backward."""
import numpy
import pytest

import cupytp
from cupytp import nn, ops
from cupytp.autograd import engine
from cupytp.ops import fused
from cupytp.tensor import Replicated, Shard, local_mesh
from dense_reference import full, lay_out, rng_array
from test_layers import build, skip_unless_heads_split

WIDTH, HEADS = 128, 2          # head dim 64: bf16 attention takes the flash path (the twin)
SEED = 5                       # the dropout's generator state before each forward


def run(block, x, w, mesh, placements, fused, dtype="bf16"):
    """(output, {name: gradient}, names of the recorded nodes) of sum(block(x) * w), the
    generator seeded alike before each run (the same dropout masks)."""
    for p in block.parameters():
        p.grad = None
    xt = lay_out(x, mesh, placements, requires_grad=True)
    names = []
    record = engine.record

    def spy(output, inputs, backward, name, **options):
        names.append(name)
        return record(output, inputs, backward, name, **options)
    engine.record = spy
    cupytp.manual_seed(SEED)
    try:
        with ops.fusion(fused), ops.autocast(dtype):
            y = block(xt)
    finally:
        engine.record = record
    (y.astype("fp32") * lay_out(w, mesh, placements)).sum().backward()
    grads = {name: full(p.grad) for name, p in block.named_parameters()}
    grads["input"] = full(xt.grad)
    return full(y), grads, names


def placements_of(mesh, batch_sharded):
    if batch_sharded and mesh.ndim == 2:
        return (Shard(0), Replicated())
    return (Replicated(),) * mesh.ndim


@pytest.mark.parametrize("batch_sharded", [False, True])
@pytest.mark.parametrize("bias,dropout", [(True, 0.0), (False, 0.0), (True, 0.2), (False, 0.2)])
def test_fused_block_matches_its_chain(mesh, batch_sharded, bias, dropout):
    """A bf16 block on the mesh: both sublayers fused with their LayerNorms (two nodes), the
    chain of ops's output and every gradient to a few bf16 roundings; uneven batch over dp;
    biases or none, dropout (attention and residual) or none."""
    skip_unless_heads_split(mesh, HEADS)
    x = rng_array((3, 4, WIDTH), 1).astype(numpy.float32)
    w = rng_array((3, 4, WIDTH), 2).astype(numpy.float32)
    block = build(lambda m: nn.DBlock(WIDTH, HEADS, m, bias=bias, dropout=dropout), mesh)
    for p in block.parameters():            # nonzero biases and LayerNorm parameters
        p.to_local()[...] += cupytp.backend.asarray(
            0.1 * rng_array(p.to_local().shape, 3).astype(p.dtype))
    placements = placements_of(mesh, batch_sharded)
    y, grads, names = run(block, x, w, mesh, placements, fused=True)
    y_chain, grads_chain, names_chain = run(block, x, w, mesh, placements, fused=False)
    assert names == ["attention_residual", "mlp_residual"]
    assert "packed_attention" in names_chain and names_chain.count("layer_norm") == 2
    assert ("bias_gelu" in names_chain) == bias and ("bias_dropout_add" in names_chain) == \
        (dropout > 0)
    close(y, y_chain, "output")
    for name in grads:
        assert grads[name].dtype == grads_chain[name].dtype, name
        close(grads[name], grads_chain[name], name)


@pytest.mark.parametrize("bias", [True, False])
def test_the_norm_backward_after_a_sublayer_casts_its_gradient(mesh, bias, monkeypatch):
    """bf16: the attention sublayer reads its output's gradient as the MLP's LayerNorm backward
    cast it (and summed its columns for the projection's bias) in its own pass, instead of
    casting it again; every gradient is the one of the attention casting it itself (the bias's
    to float32 summation order)."""
    skip_unless_heads_split(mesh, HEADS)
    x = rng_array((3, 4, WIDTH), 1).astype(numpy.float32)
    w = rng_array((3, 4, WIDTH), 2).astype(numpy.float32)
    block = build(lambda m: nn.DBlock(WIDTH, HEADS, m, bias=bias), mesh)
    placements = placements_of(mesh, True)
    taken, given = [], fused._given_cast

    def spy(g, dtype, with_sum):
        made = given(g, dtype, with_sum)
        taken.append((made is not None, with_sum))
        return made
    monkeypatch.setattr(fused, "_given_cast", spy)
    y, grads, _ = run(block, x, w, mesh, placements, fused=True)
    assert taken == [(False, bias), (True, bias)]    # the MLP's (the loss's gradient), then
    #                                                  the attention's, made by the MLP's norm
    monkeypatch.setattr(fused, "_cast_wanted", lambda x: None)
    taken.clear()
    y_own, grads_own, _ = run(block, x, w, mesh, placements, fused=True)
    assert taken == [(False, bias)] * 2
    numpy.testing.assert_array_equal(y, y_own)
    for name in grads:
        numpy.testing.assert_allclose(grads[name], grads_own[name], rtol=1e-6,
                                      atol=1e-6 * numpy.abs(grads_own[name]).max(),
                                      err_msg=name)
    assert not fused._given_casts           # none left over after the pass


def close(got, want, name):
    """Within 2% of want's largest magnitude: a few bf16 roundings (2^-8 relative each)."""
    scale = numpy.abs(want).max()
    assert scale > 0, name
    numpy.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * scale, err_msg=name)


def test_fused_block_matches_the_dense_fp32_block(mesh):
    """The sharded bf16 block (fused) within bf16 accuracy of the dense fp32 block, output and
    gradients, the fp32 parameters getting fp32 gradients."""
    skip_unless_heads_split(mesh, HEADS)
    x = rng_array((2, 4, WIDTH), 4).astype(numpy.float32)
    w = rng_array((2, 4, WIDTH), 5).astype(numpy.float32)
    dense = build(lambda m: nn.DBlock(WIDTH, HEADS, m), local_mesh())
    block = build(lambda m: nn.DBlock(WIDTH, HEADS, m), mesh)
    y, grads, _ = run(block, x, w, mesh, (Replicated(),) * mesh.ndim, fused=True)
    y_dense, grads_dense, _ = run(dense, x, w, local_mesh(), (Replicated(),), fused=False,
                                  dtype=None)
    numpy.testing.assert_allclose(y.astype(numpy.float64), y_dense, rtol=5e-2, atol=5e-2)
    for name, want in grads_dense.items():
        assert grads[name].dtype == numpy.float32, name
        numpy.testing.assert_allclose(grads[name], want, rtol=5e-2,
                                      atol=5e-2 * numpy.abs(want).max(), err_msg=name)


@pytest.mark.parametrize("bias,dropout", [(True, 0.0), (False, 0.0), (True, 0.3), (False, 0.3)])
def test_float64_block_fused_chain_and_dense_agree(mesh, bias, dropout):
    """float64, the batch sharded over dp (uneven): the block with the fused MLP (attention takes
    the chain: no flash kernel for float64), the block's chain of ops and the dense block on one
    rank give one output and the same gradients to rounding, biases or none, dropout or none
    (one mask on every mesh)."""
    skip_unless_heads_split(mesh, 4)
    x, w = rng_array((5, 3, 8), 6), rng_array((5, 3, 8), 7)
    make = lambda m: nn.DBlock(8, 4, m, bias=bias, dropout=dropout, dtype="fp64")  # noqa: E731
    dense = build(make, local_mesh())
    y_dense, grads_dense, _ = run(dense, x, w, local_mesh(), (Replicated(),), False, None)
    block = build(make, mesh)
    placements = placements_of(mesh, True)
    for fused_form in (True, False):
        y, grads, names = run(block, x, w, mesh, placements, fused_form, None)
        assert ("mlp_residual" in names) == fused_form
        # every draw made: the attention's (B, H, T, T) and the two residual (B, T, C) masks,
        # each rounded up to dropout's groups of eight (5 * 4 * 3 * 3 = 180 -> 184)
        drawn = cupytp.tensor.default_generator.offset
        assert drawn == (184 + 2 * 5 * 3 * 8 if dropout else 0)
        numpy.testing.assert_allclose(y, y_dense, rtol=1e-10, atol=1e-12)
        for name, want in grads_dense.items():
            numpy.testing.assert_allclose(grads[name], want, rtol=1e-10, atol=1e-12,
                                          err_msg=name)
    block.eval()                            # no dropout: other values where it dropped some
    y_eval, _, _ = run(block, x, w, mesh, placements, True, None)
    assert cupytp.tensor.default_generator.offset == 0
    assert numpy.allclose(y_eval, y) != bool(dropout)


def test_layouts_it_does_not_take_run_the_chain(world):
    """A residual sharded on its features (no fused layout) runs the chain of ops: same values
    as the fused form on Replicated inputs."""
    mesh = cupytp.DeviceMesh((world.world_size,), ("tp",))
    mlp = build(lambda m: nn.DMLP(6, 8 * world.world_size, mesh=m, dtype="fp64"), mesh)
    x = rng_array((2, 3, 6), 7)
    replicated = (Replicated(),)
    y = mlp(lay_out(x, mesh, replicated), residual=lay_out(x, mesh, replicated))
    nodes = []
    record = engine.record
    engine.record = lambda out, inputs, backward, name, **options: (
        nodes.append(name) or record(out, inputs, backward, name, **options))
    try:
        sharded = mlp(lay_out(x, mesh, replicated, requires_grad=True),
                      residual=lay_out(x, mesh, (Shard(2),), requires_grad=True))
    finally:
        engine.record = record
    assert "mlp_residual" not in nodes and "bias_gelu" in nodes
    numpy.testing.assert_allclose(full(sharded), full(y), rtol=1e-12, atol=1e-12)


def test_fusion_can_be_turned_off(world):
    """Inside fusion(False) a block records its chain of ops; the switch is restored after."""
    mlp = build(lambda m: nn.DMLP(6, 8, mesh=m, dtype="fp64"), local_mesh())
    x = lay_out(rng_array((2, 3, 6), 8), local_mesh(), (Replicated(),), requires_grad=True)
    with ops.fusion(False):
        assert mlp(x, residual=x)._node.name == "bias_residual_add"
    assert mlp(x, residual=x)._node.name == "mlp_residual"


@pytest.mark.parametrize("x_is_residual", [True, False])
def test_norm_joins_the_fused_op_with_exact_gradients(world, x_is_residual):
    """mlp_residual(x, residual, ..., norm=(weight, None, eps)) in float64 on a tensor-parallel
    mesh: one node, and the output and the gradients of x, the residual and the norm's weight
    those of layer_norm then the chain, to rounding; x the residual itself, or apart."""
    mesh = cupytp.DeviceMesh((world.world_size,), ("tp",))
    mlp = build(lambda m: nn.DMLP(6, 4 * world.world_size, mesh=m, dtype="fp64"), mesh)
    replicated = (Replicated(),)
    weight = lay_out(1 + 0.1 * rng_array((6,), 9), mesh, replicated, requires_grad=True)
    values = [rng_array((3, 5, 6), seed) for seed in (10, 11)]
    w = lay_out(rng_array((3, 5, 6), 12), mesh, replicated)

    def grads(fused):
        x = lay_out(values[0], mesh, replicated, requires_grad=True)
        residual = x if x_is_residual else lay_out(values[1], mesh, replicated,
                                                   requires_grad=True)
        weight.grad = None
        with ops.fusion(fused):
            y = ops.mlp_residual(x, residual, mlp.c_fc.weight, mlp.c_fc.bias,
                                 mlp.c_proj.weight, mlp.c_proj.bias, (weight, None, 1e-5))
        assert (y._node.name == "mlp_residual") == fused
        (y * w).sum().backward()
        return [full(t) for t in (y, x.grad, residual.grad, weight.grad)]
    for got, want in zip(grads(True), grads(False)):
        numpy.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_without_a_backward_nothing_is_kept(world, monkeypatch):
    """Under no_grad a block with dropout records nothing and writes no GeLU pre-activation,
    LayerNorm statistics or dropout mask, and gives the output of a forward that records."""
    kept = []

    def spy(function, flag):
        def call(*args, **kwargs):
            out = function(*args, **kwargs)
            kept.append((function.__name__, flag(args, kwargs, out)))
            return out
        return call
    monkeypatch.setattr(fused, "matmul_bias_gelu", spy(
        fused.matmul_bias_gelu, lambda args, kwargs, out: out[1] is not None))
    monkeypatch.setattr(fused, "layer_norm_forward", spy(
        fused.layer_norm_forward, lambda args, kwargs, out: out[1] is not None))
    monkeypatch.setattr(fused.dropouts, "dropout", spy(
        fused.dropouts.dropout, lambda args, kwargs, out: out[1] is not None))
    block = build(lambda m: nn.DBlock(WIDTH, HEADS, m, dropout=0.2), local_mesh())
    x = lay_out(rng_array((2, 4, WIDTH), 8).astype(numpy.float32), local_mesh(), (Replicated(),))
    outputs = []
    for recording in (False, True):
        kept.clear()
        cupytp.manual_seed(SEED)
        with ops.autocast("bf16"), (engine.enable_grad() if recording else engine.no_grad()):
            y = block(x)
        assert (y._node is not None) == recording
        assert sorted(kept) == sorted([("layer_norm_forward", recording)] * 2 + [
            ("matmul_bias_gelu", recording), ("dropout", recording), ("dropout", recording)])
        outputs.append(full(y))
    numpy.testing.assert_array_equal(*outputs)
