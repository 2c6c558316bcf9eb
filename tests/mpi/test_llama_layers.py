"""The layers and ops of Llama-family models equal their dense single-rank selves on 1-D and 2-D
meshes (float64; key/value heads split where tp divides them, replicated otherwise; uneven
columns): RMSNorm, the rotary op (tokens in order, or at given positions), the SiLU gate,
SwiGLU, grouped-query attention (the fused sublayers and the chain, biases on and off),
grouped-query scaled_dot_product_attention on both
paths (bf16 flash twin against the float64 matmul path), and the fused forms against the chains
they replace."""
import numpy
import pytest

import cupytp
from cupytp import nn, ops
from cupytp.backend import bfloat16
from cupytp.tensor import Replicated, Shard, local_mesh
from dense_reference import check_against_dense, full, lay_out, rng_array
from test_layers import build, compare


def tp_size(mesh):
    return mesh.shape[nn.tp_dim(mesh)]


def tp_placement(mesh, placement):
    return nn.tp_placements(mesh, placement)


class Sublayer(nn.Module):
    """x + sublayer(norm(x)): how a decoder layer calls its attention and MLP (the fused ops)."""

    def __init__(self, make, mesh, dim):
        super().__init__()
        self.norm = nn.RMSNorm(dim, mesh, dtype="fp64")
        self.inner = make(mesh)

    def forward(self, x):
        return self.inner(x, residual=x, norm=self.norm)


def attention(kv_heads, bias=False, sublayer=False, dim=16, heads=4):
    def make(mesh):
        rotary = nn.RotaryEmbedding(dim // heads, theta=100.0)
        return nn.GroupedQueryAttention(dim, heads, kv_heads, rotary, mesh=mesh, qkv_bias=bias,
                                        dtype="fp64", init_std=0.3)
    return (lambda m: Sublayer(make, m, dim)) if sublayer else make


LAYERS = {
    "rmsnorm": (lambda m: nn.RMSNorm(5, m, dtype="fp64"), 5),
    "swiglu": (lambda m: nn.SwiGLU(6, 10, m, dtype="fp64"), 6),
    "swiglu_bias_sublayer": (lambda m: Sublayer(
        lambda m_: nn.SwiGLU(6, 10, m_, bias=True, dtype="fp64", init_std=0.3), m, 6), 6),
    "gqa_kv2": (attention(2), 16),
    "gqa_kv4_bias": (attention(4, bias=True), 16),
    "gqa_kv1_sublayer": (attention(1, sublayer=True), 16),
    "gqa_kv2_bias_sublayer": (attention(2, bias=True, sublayer=True), 16),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_llama_layer_built_on_mesh_equals_dense(mesh, name):
    make, dim = LAYERS[name]
    if "gqa" in name and 4 % tp_size(mesh):
        pytest.skip("4 query heads do not split")
    x = rng_array((3, 5, dim), 1)
    dense = build(make, local_mesh())
    parallel = build(make, mesh)
    y = compare(dense, parallel, x, mesh)
    assert all(p == Replicated() for p in y.placements)
    if "gqa" in name:
        inner = parallel.inner if "sublayer" in name else parallel
        kv_heads = inner.num_kv_heads
        split = tp_size(mesh) > 1 and kv_heads % tp_size(mesh) == 0
        assert inner.kv_proj.weight.placements == tp_placement(
            mesh, Shard(2) if split else Replicated())


def test_attention_heads_that_cannot_split_are_an_error(world):
    rotary = nn.RotaryEmbedding(4)
    with pytest.raises(ValueError, match="cannot be split over 4 tensor-parallel ranks"):
        nn.GroupedQueryAttention(24, 6, 3, rotary, tp=4)
    with pytest.raises(ValueError, match="key/value heads must divide the query heads"):
        nn.GroupedQueryAttention(24, 6, 4, rotary)
    built = nn.GroupedQueryAttention(16, 4, 2, rotary, tp=2)
    with pytest.raises(ValueError, match="built for tp=2 and is being laid out over 4"):
        built.check_tp(4)


@pytest.mark.parametrize("op", ["rms_norm", "rotary", "silu_mul"])
def test_llama_ops_equal_dense(mesh, op):
    """Each op on every placement it takes, outputs and input gradients (float64)."""
    tp = nn.tp_dim(mesh)
    if op == "rms_norm":
        arrays, fn = [rng_array((4, 3, 6), 2), rng_array((6,), 3)], ops.rms_norm
        layouts = [[Shard(0), Replicated()], [Replicated()]]
    elif op == "rotary":
        rotary = nn.RotaryEmbedding(8, theta=50.0)
        arrays = [rng_array((3, 5, 4, 8), 4)]

        def fn(x):
            return ops.rotary(x, *rotary.tables(x.dtype, 7), 2)
        layouts = [[Shard(0), Shard(2), Replicated()]]
    else:
        arrays, fn = [rng_array((3, 4, 2, 7), 5)], ops.silu_mul
        layouts = [[Shard(0), Shard(3), Replicated()]]
    for placement in layouts[0]:
        placements = [nn.tp_placements(mesh, placement)] + \
            [nn.tp_placements(mesh, p[0]) for p in layouts[1:]]
        if mesh.ndim == 2:         # the batch on dp as well
            placements[0] = tuple(Shard(0) if d != tp else p for d, p in
                                  enumerate(placements[0])) if placement != Shard(0) else \
                placements[0]
        check_against_dense(fn, arrays, placements, mesh)


def test_rotary_at_given_positions(mesh):
    """Tokens in another order, with their positions, the sequence and the positions sharded
    alike (context parallelism's layout): each token rotated by the angles of its own position,
    as the tokens in order are; gradients as one rank's. Positions laid out otherwise, or not
    one per token, are errors."""
    rotary = nn.RotaryEmbedding(8, theta=50.0)
    t = 7
    order = numpy.random.default_rng(3).permutation(t)
    x = rng_array((3, t, 4, 8), 4)
    in_order = full(rotary(lay_out(x, local_mesh(), (Replicated(),))))
    got = check_against_dense(rotary, [x[:, order], order],
                              [tp_placement(mesh, Shard(1)), tp_placement(mesh, Shard(0))], mesh)
    numpy.testing.assert_allclose(got, in_order[:, order], rtol=1e-14, atol=1e-15)
    if tp_size(mesh) == 1:
        return
    whole = lay_out(x, mesh, tp_placement(mesh, Replicated()))
    with pytest.raises(cupytp.ShardingError, match="rotary"):
        rotary(whole, lay_out(order, mesh, tp_placement(mesh, Shard(0))))
    with pytest.raises(ValueError, match="one per token"):
        rotary(whole, lay_out(order[:5], mesh, tp_placement(mesh, Replicated())))


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 1), (4, 4), (2, 2)])
@pytest.mark.parametrize("kv_split", [True, False])
def test_grouped_attention_op_equals_dense(mesh, heads, kv_heads, kv_split):
    """q's heads sharded, k's and v's sharded alike or Replicated (each rank reading the
    key/value heads its query heads need), the batch on dp: float64 matmul path, gradients
    included (a Replicated k's gradient is each rank's share)."""
    n = tp_size(mesh)
    if heads % n or (kv_split and kv_heads % n):
        pytest.skip("heads do not split")
    q, k, v = (rng_array((2, h, 5, 4), seed) for h, seed in ((heads, 6), (kv_heads, 7),
                                                               (kv_heads, 8)))
    kv = Shard(1) if kv_split else Replicated()
    placements = [nn.tp_placements(mesh, Shard(1))] + [nn.tp_placements(mesh, kv)] * 2
    check_against_dense(ops.scaled_dot_product_attention, [q, k, v], placements, mesh)


def test_grouped_flash_node_equals_float64_path(mesh):
    """bf16 grouped-query attention takes the flash node (the twin on CPU) on a tensor-parallel
    mesh and agrees with the float64 matmul path, gradients included."""
    if 8 % tp_size(mesh):
        pytest.skip("heads do not split")
    b, t, d = 2, 9, 64
    arrays = [rng_array((b, h, t, d), seed) for h, seed in ((8, 1), (2, 2), (2, 3))]
    weight = rng_array((b, 8, t, d), 4)

    def run(dtype, placements):
        inputs = [lay_out(a.astype(dtype), mesh, p, requires_grad=True)
                  for a, p in zip(arrays, placements)]
        y = ops.scaled_dot_product_attention(*inputs)
        (y * lay_out(weight.astype(dtype), mesh, y.placements)).sum().backward()
        return [full(y).astype(numpy.float64)] + [full(x.grad).astype(numpy.float64)
                                                  for x in inputs]

    heads = nn.tp_placements(mesh, Shard(1))
    kv = nn.tp_placements(mesh, Shard(1) if 2 % tp_size(mesh) == 0 else Replicated())
    got = run(bfloat16, [heads, kv, kv])
    want = run(numpy.float64, [heads, kv, kv])
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert numpy.linalg.norm(g - w) < 2e-2 * numpy.linalg.norm(w), name


@pytest.mark.parametrize("kv_heads,bias,dtype", [(2, False, "fp32"), (4, True, "fp32"),
                                                  (1, False, "fp32"), (2, False, "bf16")])
def test_fused_attention_equals_chain_in_bf16(mesh, kv_heads, bias, dtype):
    """The fused attention sublayer (norm, products, in-place rotation, flash with grouped
    heads, projection and residual in one node) against the chain of ops, under bf16 autocast
    on fp32 parameters, or with bf16 parameters and residual stream (as fully_shard gathers
    them): outputs and every gradient within bf16 error."""
    if 4 % tp_size(mesh):
        pytest.skip("heads do not split")
    make = attention(kv_heads, bias, sublayer=True, dim=256, heads=4)     # head size 64
    x = rng_array((2, 6, 256), 9) * 0.5
    stored = numpy.float32 if dtype == "fp32" else bfloat16

    def run(fused):
        cupytp.manual_seed(3)
        layer = make(mesh).to(dtype)
        xt = lay_out(x.astype(stored), mesh, (Replicated(),) * mesh.ndim, requires_grad=True)
        with ops.fusion(fused), ops.autocast("bf16" if dtype == "fp32" else None):
            y = layer(xt)
        assert (y._node.name == "grouped_attention") == fused
        (y * lay_out(rng_array(y.shape, 10).astype(numpy.float32), mesh,
                     y.placements)).sum().backward()
        return [full(y)] + [full(xt.grad)] + [full(p.grad) for p in layer.parameters()]

    for got, want in zip(run(True), run(False)):
        got, want = got.astype(numpy.float64), want.astype(numpy.float64)
        assert numpy.linalg.norm(got - want) <= 2e-2 * numpy.linalg.norm(want) + 1e-6


def test_the_mlps_norm_backward_casts_the_attentions_gradient(mesh, monkeypatch):
    """bf16 autocast on fp32 parameters, an attention sublayer then an MLP sublayer (both fused
    with their RMSNorms): the attention reads its output's gradient as the MLP's norm backward
    cast it in its own pass, not by a cast of its own; every gradient is the one of the
    attention casting it itself, bit for bit."""
    if 4 % tp_size(mesh):
        pytest.skip("heads do not split")
    from cupytp.ops import fused
    make_attention = attention(2, sublayer=True, dim=256, heads=4)

    class Pair(nn.Module):
        def __init__(self, mesh):
            super().__init__()
            self.attention = make_attention(mesh)
            self.mlp = Sublayer(lambda m: nn.SwiGLU(256, 512, m, dtype="fp64", init_std=0.3),
                                mesh, 256)

        def forward(self, x):
            return self.mlp(self.attention(x))
    x = rng_array((2, 6, 256), 9) * 0.5
    taken, given = [], fused._given_cast

    def spy(g, dtype, with_sum):
        made = given(g, dtype, with_sum)
        taken.append(made is not None)
        return made
    monkeypatch.setattr(fused, "_given_cast", spy)

    def run():
        cupytp.manual_seed(3)
        pair = Pair(mesh).to("fp32")
        xt = lay_out(x.astype(numpy.float32), mesh, (Replicated(),) * mesh.ndim,
                     requires_grad=True)
        with ops.autocast("bf16"):
            y = pair(xt)
        assert y._node.name == "swiglu_mlp"
        (y * lay_out(rng_array(y.shape, 10).astype(numpy.float32), mesh,
                     y.placements)).sum().backward()
        return [full(xt.grad)] + [full(p.grad) for p in pair.parameters()]
    handed = run()
    assert taken == [False, True]           # the MLP's (the loss's gradient), the attention's
    monkeypatch.setattr(fused, "_cast_wanted", lambda x: None)
    taken.clear()
    own = run()
    assert taken == [False, False]
    for got, want in zip(handed, own):
        numpy.testing.assert_array_equal(got, want)


def test_fused_mlp_equals_chain_in_float64(mesh):
    """The fused SwiGLU sublayer computes in the parameters' float64 on the CPU: it equals the
    chain to rounding."""
    make = LAYERS["swiglu_bias_sublayer"][0]
    x = rng_array((3, 4, 6), 11)

    def run(fused):
        cupytp.manual_seed(4)
        layer = make(mesh)
        xt = lay_out(x, mesh, (Replicated(),) * mesh.ndim, requires_grad=True)
        with ops.fusion(fused):
            y = layer(xt)
        assert (y._node.name == "swiglu_mlp") == fused
        (y * lay_out(rng_array(y.shape, 12), mesh, y.placements)).sum().backward()
        return [full(y), full(xt.grad)] + [full(p.grad) for p in layer.parameters()]

    for got, want in zip(run(True), run(False)):
        numpy.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-13)
