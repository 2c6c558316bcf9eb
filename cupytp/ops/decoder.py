"""The sublayers of a Llama-family decoder block (pre-RMSNorm, rotary positions, grouped-query
attention, SwiGLU MLP) as ops, each reading its input through an RMSNorm and adding a residual:

    grouped_attention(x, q_weight, q_bias, kv_weight, kv_bias, o_weight, rope, num_heads,
                      num_kv_heads, norm=None, residual=None, cache=None, attention=None)
        = residual + attention(rotary(norm(x) @ q_weight + q_bias),
                               rotary(k), v of norm(x) · kv_weight + kv_bias) @ o_weight
    swiglu_mlp(x, gate_up_weight, gate_up_bias, down_weight, norm=None, residual=None)
        = residual + silu_mul(norm(x) · gate_up_weight + gate_up_bias) @ down_weight

The output is Replicated where x is (a Partial projection is all-reduced, by the residual
addition when there is one). Shapes: x and residual (B, T, C); q_weight (C, H·D), kv_weight
(C, 2, Hk·D) (k and v side by side), o_weight (H·D, C); gate_up_weight (C, 2, F), down_weight
(F, C); biases optional (None); `rope` = (cos, sin, start): the rotary tables
(`nn.RotaryEmbedding.rope`) and the position of the first token, or a DTensor of every token's
position (`ops.rotary`); `norm` = (weight, eps) of an RMSNorm, or None; `cache` a
`nn.LayerCache` (keys and values appended, queries attend over all of them); `attention(q, k,
v)` how the queries attend when not on this rank alone (context parallelism's ring).

With a residual, no cache, no `attention`, an int start and the layouts below, each is one op
and one tape node (fused; for attention also bf16/fp16 with head dim 64 or 128, the flash
kernels' domain), else the chain of ops. The chain's attention gathers x once for its two
products (`ops.linalg.column_input`): under sequence parallelism one all-gather forward and one
reduce-scatter backward per sublayer, as the MLP's single gate|up product does by itself.

Fused, it keeps for backward only what cannot be remade cheaply: x itself (the residual
stream, held anyway) and the norm's rstd, q, k and v after their rotation, attention's output and
row log-sum-exp, or the gate|up product; the normalized input and the SiLU gate's output are
recomputed in backward (one pass each over an activation, where keeping them would hold one per
layer until backward). The rotation runs in place on the products' output, the inverse rotation
in place on the gradients, and flash attention reads each key/value head in place for all the
query heads of its group.

The layouts the fused forms take, per mesh dimension (as `ops.fused`'s): tensor-parallel, at most
one such dimension, with x and residual Replicated: q_weight Shard(1), kv_weight Shard(2) or
Replicated (key/value heads split, or every rank computing them all: see
`nn.GroupedQueryAttention`), o_weight Shard(0); gate_up_weight Shard(2), down_weight Shard(0);
biases following their weights. The output is all-reduced in forward, x's gradient in backward
(on the communication stream while the weight gradients are computed). Data-parallel or dense:
every parameter Replicated, x and residual both Replicated or both Shard(0), or for the MLP, which
works token by token, both Shard(1) too (a sequence split by context parallelism). The norm's
weight is Replicated everywhere. A sequence sharded along tensor parallelism (sequence
parallelism) runs the chain.
"""

from cupytp.launchers import compute_dtype, flash_attention, rotary as rotary_kernel
from cupytp.launchers.cast import converted
from cupytp.launchers.flash_attention import HeadGroups
from cupytp.launchers.gemm_epilogue import matmul_bias
from cupytp.launchers.rmsnorm import rms_norm_backward, rms_norm_forward
from cupytp.launchers.swiglu import swiglu, swiglu_backward
from cupytp.ops import fused
from cupytp.ops.amp import autocast_local, autocast_operand, operand_dtype
from cupytp.ops.conversion import (
    Partial, Replicated, Shard, backend, cached, is_tensor, reduce_all)
from cupytp.ops.elementwise import silu_mul
from cupytp.ops.functional import (
    attention_setup, rms_norm, scaled_dot_product_attention, unpacked)
from cupytp.ops.fused import (
    _bias_as, _grad_as, _input_grad, _input_info, _projected, _recorded, _reduced_later, _rows,
    _weight_grads)
from cupytp.ops.linalg import column_input, einsum, local_einsum, matmul
from cupytp.ops.rotary import rotary

# the tensor-parallel placements the fused forms take, per parameter (in argument order)
ATTENTION_SPLITS = ((Shard(1), Shard(0), Shard(2), Shard(1), Shard(0)),
                    (Shard(1), Shard(0), Replicated(), Replicated(), Shard(0)))
MLP_SPLITS = ((Shard(2), Shard(1), Shard(0)),)
# the layouts of x along a data-parallel dimension the MLP takes: it works token by token, so
# its tokens may be split by batch or by sequence (context parallelism's); attention by batch
_TOKENWISE = (Replicated(), Shard(0), Shard(1))


def grouped_attention(x, q_weight, q_bias, kv_weight, kv_bias, o_weight, rope, num_heads,
                      num_kv_heads, norm=None, residual=None, cache=None, attention=None):
    """Causal grouped-query self-attention with rotary positions (module docstring).
    `attention(q, k, v)`: how queries (B, T, H, D) attend over keys and values (B, T, Hk, D),
    when not as `scaled_dot_product_attention` (a ring: `ContextParallel.grouped_attention`);
    the chain of ops runs then."""
    params = (q_weight, q_bias, kv_weight, kv_bias, o_weight)
    d = q_weight.shape[-1] // num_heads
    flash = operand_dtype(x) in flash_attention.DTYPES and d in flash_attention.HEAD_DIMS
    chain = residual is None or cache is not None or attention is not None or not flash or \
        is_tensor(rope[2])
    plan = None if chain else \
        _plan(ATTENTION_SPLITS, x, residual, params, norm, (num_heads, num_kv_heads))
    if plan is None:
        y = _attention_chain(x if norm is None else rms_norm(x, *norm), params, rope,
                             num_heads, num_kv_heads, cache, attention)
        return reduce_all("grouped_attention", y) if residual is None else residual + y
    return _fused_attention(x, residual, params, rope, num_heads, num_kv_heads, norm, plan)


def _attention_chain(x, params, rope, num_heads, num_kv_heads, cache, attention):
    """The attention as a chain of ops; (B, T, C), Partial where o_weight is row-parallel. x
    is gathered once for both products (`column_input`: one collective each way under sequence
    parallelism)."""
    q_weight, q_bias, kv_weight, kv_bias, o_weight = params
    b, t, _ = x.shape
    d = q_weight.shape[-1] // num_heads
    x = column_input("btc,cd->btd", x, q_weight)                           # (B, T, C)
    q = matmul(x, q_weight)
    kv = einsum("btc,cjd->btjd", x, kv_weight)
    q = q if q_bias is None else q + autocast_operand(q_bias)
    kv = kv if kv_bias is None else kv + autocast_operand(kv_bias)
    q = rotary(q.reshape(b, t, num_heads, d), *rope)                       # (B, T, H/tp, D)
    kv = kv.reshape(b, t, 2, num_kv_heads, d)                              # (B, T, 2, Hk', D)
    k, v = rotary(kv[:, :, 0], *rope), kv[:, :, 1]
    if cache is not None:
        k, v = cache.append(k, v)                                          # (B, S, Hk', D)
    if attention is None:
        y = scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                         v.transpose(1, 2)).transpose(1, 2)
    else:
        y = attention(q, k, v)                                             # (B, T, H/tp, D)
    return matmul(y.reshape(b, t, num_heads * d), o_weight)


def swiglu_mlp(x, gate_up_weight, gate_up_bias, down_weight, norm=None, residual=None):
    """The SwiGLU MLP (module docstring)."""
    params = (gate_up_weight, gate_up_bias, down_weight)
    plan = None if residual is None else _plan(MLP_SPLITS, x, residual, params, norm)
    if plan is None:
        x = x if norm is None else rms_norm(x, *norm)
        h = einsum("btc,cjd->btjd", x, gate_up_weight, reduce_input_grad=True)   # (B, T, 2, F')
        h = h if gate_up_bias is None else h + autocast_operand(gate_up_bias)
        y = matmul(silu_mul(h), down_weight)                                  # (B, T, C), P
        return reduce_all("swiglu_mlp", y) if residual is None else residual + y
    return _fused_mlp(x, residual, params, norm, plan)


# ---- when the fused forms apply ------------------------------------------------------------------
def _plan(splits, x, residual, params, norm, heads=None):
    """(tensor-parallel mesh dim or None, the gradient placements of the parameters (None where
    absent) and then of the norm's weight) when a fused form takes these inputs, else None.
    `heads`: attention's (query heads, key/value heads), which a tensor-parallel split must
    keep whole."""
    if not fused._enabled:
        return None
    norm_weight = None if norm is None else norm[0]
    key = (splits, x.shape, x.placements, id(x.mesh), residual.shape, residual.placements,
           id(residual.mesh), operand_dtype(x), heads,
           *[None if p is None else (p.shape, p.placements, id(p.mesh), operand_dtype(p))
             for p in params + (norm_weight,)])
    return cached(key, _layouts, splits, x, residual, params, norm_weight, heads) or None


def _layouts(splits, x, residual, params, norm_weight, heads):
    mesh = x.mesh
    present = [p for p in params + (norm_weight,) if p is not None]
    weights = [p for p in params if p is not None and p.ndim > 1]
    if residual.mesh != mesh or any(p.mesh != mesh for p in present) or \
            x.shape != residual.shape or x.ndim != 3 or \
            len({operand_dtype(t) for t in [x] + weights}) > 1:
        return False
    if norm_weight is not None and (norm_weight.shape != x.shape[-1:] or
                                    x.dtype not in (operand_dtype(x), backend.xp.float32)):
        return False            # the norm's kernels give x's dtype, or 16 bits from float32
    tp, grads, norm_grads = None, [[] for _ in params], []
    for dim, (px, pr) in enumerate(zip(x.placements, residual.placements)):
        own = tuple(None if p is None else p.placements[dim] for p in params)
        if norm_weight is not None and norm_weight.placements[dim] != Replicated():
            return False
        split = next((s for s in splits if all(o in (None, want) for o, want in zip(own, s))),
                     None)
        if split is not None and px == pr == Replicated() and tp is None and \
                any(o not in (None, Replicated()) for o in own):
            tp = dim
            for grad, placement in zip(grads, own):     # a Replicated weight: each rank's share
                grad.append(Partial() if placement == Replicated() else placement)
            norm_grads.append(Replicated())  # x's gradient is all-reduced before the norm's
        elif all(o in (None, Replicated()) for o in own) and px == pr and \
                px in (_TOKENWISE if heads is None else (Replicated(), Shard(0))):
            for grad in grads + [norm_grads]:
                grad.append(Replicated() if px == Replicated() else Partial())
        else:
            return False
    if tp is not None and heads is not None and not _whole_heads(
            heads, mesh.shape[tp], params[2].placements[tp] != Replicated()):
        return False
    return tp, tuple(tuple(g) for g in grads) + ((tuple(norm_grads),) if norm_weight is not None
                                                 else ())


def _whole_heads(heads, size, kv_split):
    """True when a tensor-parallel split over `size` ranks gives each rank whole query heads,
    and whole key/value heads where their projection is split (`kv_split`)."""
    num_heads, num_kv_heads = heads
    return num_heads % size == 0 and (not kv_split or num_kv_heads % size == 0)


# ---- the norm in front --------------------------------------------------------------------------
class _RMSNorm:
    """The RMSNorm a fused sublayer reads its input through: its output on x's local array
    (`out`, in the products' dtype, dropped once the first product has read it and made again
    in backward by `recompute`) and rstd; `backward(g, add, cast=None)` gives x's gradient
    (plus `add`) and the weight's, then with `cast` x's gradient's (cast, column sums) as
    `ops.fused`'s norm does. Keeps x's local array (the residual stream)."""

    def __init__(self, x, norm):
        weight, self.eps = norm
        self.params = (weight,)
        self.dtype, self.out_dtype = x.dtype, operand_dtype(x)
        self.x = backend.xp.ascontiguousarray(x._local)
        self.weight = weight._local.astype(x.dtype, copy=False)
        self.out, self.rstd = rms_norm_forward(self.x, self.weight, self.eps, self.out_dtype)

    def recompute(self):
        return rms_norm_forward(self.x, self.weight, self.eps, self.out_dtype)[0]

    def backward(self, g, add, cast=None):
        dx, dw, *made = rms_norm_backward(g.reshape(self.x.shape), self.x, self.rstd,
                                          self.weight, self.dtype, add, weight_grad=True,
                                          cast=cast)
        return (dx, dw.astype(self.params[0].dtype, copy=False), *made)


def _input(x, norm):
    """(the local array the first products read, the _RMSNorm or None)."""
    if norm is None:
        return autocast_local(x), None
    normed = _RMSNorm(x, norm)
    return normed.out, normed


def _read_again(x_local, normed):
    """The first products' input in backward: x's (kept), or the norm's output made again."""
    return x_local if normed is None else normed.recompute()


def _product(a, w, bias):
    """a @ w on local arrays, plus a bias parameter (or None) in the product's epilogue."""
    if bias is None:
        return local_einsum("xy", "yz", "xz", a, w)
    return matmul_bias(a, w, _bias_as(bias, a.dtype).reshape(-1))


# ---- the fused forms ----------------------------------------------------------------------------
def _fused_mlp(x, residual, params, norm, plan):
    gate_up_weight, gate_up_bias, down_weight = params
    tp, placements = plan
    x_local, normed = _input(x, norm)
    rows_in = _rows(x_local)
    wgu = autocast_local(gate_up_weight)
    wgu2 = wgu.reshape(wgu.shape[0], -1)                                   # (C, 2 F')
    wd = autocast_local(down_weight)
    h = _product(rows_in, wgu2, gate_up_bias)                               # (rows, 2 F')
    h = h.reshape(h.shape[0], 2, -1)
    if normed is not None:
        normed.out = None                       # made again in backward
    out, _ = _projected(swiglu(h), wd, None, residual, tp, None)
    x_info = _input_info(x, x_local, normed, tp)
    x_local = None if normed is not None else x_local

    def input_part(g):
        gy = _grad_as(g, h.dtype)
        dy = local_einsum("xz", "yz", "xy", gy, wd)                        # (rows, F')
        dh, y = swiglu_backward(h, dy, recompute=True)
        dh = dh.reshape(dh.shape[0], -1)                                   # (rows, 2 F')
        return _input_grad(dh, wgu2, x_info), (gy, dh, y)

    def weight_part(state):
        gy, dh, y = state
        gwd, _ = _weight_grads(y, gy, down_weight, None)
        inputs = _rows(_read_again(x_local, normed))
        gwgu, gbgu = _weight_grads(inputs, dh, gate_up_weight, gate_up_bias)
        return (None if gwgu is None else gwgu.reshape(wgu.shape),
                None if gbgu is None else gbgu.reshape(gate_up_bias.local_shape), gwd)
    return _recorded(out, (x, residual, *params), input_part, weight_part, "swiglu_mlp",
                     placements, normed, (h.dtype, None))


def _fused_attention(x, residual, params, rope, num_heads, num_kv_heads, norm, plan):
    q_weight, q_bias, kv_weight, kv_bias, o_weight = params
    cos, sin, start = rope
    tp, placements = plan
    xp = backend.xp
    b, t, _ = x.shape
    d = q_weight.shape[-1] // num_heads
    x_local, normed = _input(x, norm)
    rows = x_local.shape[0]                                                # this rank's batch
    rows_in = _rows(x_local)
    wq, wo = autocast_local(q_weight), autocast_local(o_weight)
    wkv = autocast_local(kv_weight)
    wkv2 = wkv.reshape(wkv.shape[0], -1)                                   # (C, 2 Hk' D)
    q = _product(rows_in, wq, q_bias)                                      # (B T, H' D)
    kv = _product(rows_in, wkv2, kv_bias)                                  # (B T, 2 Hk' D)
    if normed is not None:
        normed.out = None                       # made again in backward
    heads, kv_heads = q.shape[-1] // d, kv.shape[-1] // (2 * d)
    q4 = q.reshape(rows, t, heads, d)
    kv5 = kv.reshape(rows, t, 2, kv_heads, d)
    rotary_kernel.rotary(q4, cos, sin, start, out=q4)                     # in place
    rotary_kernel.rotary(kv5[:, :, 0], cos, sin, start, out=kv5[:, :, 0])
    group = num_heads // num_kv_heads
    groups = HeadGroups(group, q_weight.layout.offsets[1] // d -
                        kv_weight.layout.offsets[2] // d * group)
    (qv,), (kv_v, vv) = unpacked(q4[:, :, None]), unpacked(kv5)           # (B, H', T, D) views
    kernels, scale, _ = attention_setup(qv, kv_v, 0.0, None, (b, num_heads, t, t),
                                        (x.layout.offsets[0], q_weight.layout.offsets[1] // d),
                                        groups)
    o, lse = kernels.attention_forward(qv, kv_v, vv, True, scale, None, groups=groups)
    a = o.transpose(0, 2, 1, 3).reshape(rows * t, heads * d)               # (B T, H' D)
    out, _ = _projected(a, wo, None, residual, tp, None)
    x_info = _input_info(x, x_local, normed, tp)
    x_local = None if normed is not None else x_local

    def input_part(g):
        gy = _grad_as(g, a.dtype)
        ga = local_einsum("xz", "yz", "xy", gy, wo)                        # (B T, H' D)
        dq, dkv = xp.empty_like(q), xp.empty_like(kv)
        dq4, dkv5 = dq.reshape(q4.shape), dkv.reshape(kv5.shape)
        do = ga.reshape(rows, t, heads, d).astype(o.dtype, copy=False).transpose(0, 2, 1, 3)
        kernels.attention_backward(qv, kv_v, vv, o, lse, do, True, scale, None,
                                   grads=unpacked(dq4[:, :, None]) + unpacked(dkv5),
                                   groups=groups)
        rotary_kernel.rotary(dq4, cos, sin, start, inverse=True, out=dq4)
        rotary_kernel.rotary(dkv5[:, :, 0], cos, sin, start, inverse=True, out=dkv5[:, :, 0])
        return _attention_input_grad(dq, dkv, wq, wkv2, x_info, normed), \
            (gy, dq, dkv)

    def weight_part(state):
        gy, dq, dkv = state
        gwo, _ = _weight_grads(a, gy, o_weight, None)
        inputs = _rows(_read_again(x_local, normed))
        gwq, gbq = _weight_grads(inputs, dq, q_weight, q_bias)
        gwkv, gbkv = _weight_grads(inputs, dkv, kv_weight, kv_bias)
        return (gwq, gbq, None if gwkv is None else gwkv.reshape(wkv.shape),
                None if gbkv is None else gbkv.reshape(kv_bias.local_shape), gwo)
    return _recorded(out, (x, residual, *params), input_part, weight_part,
                     "grouped_attention", placements, normed, (a.dtype, None))


def _attention_input_grad(dq, dkv, wq, wkv2, x, normed):
    """`fused._input_grad` for attention's two products: dq wq^T + dkv wkv^T, the second adding
    the first in its epilogue, both unrounded where the norm in front (`normed`, or None) keeps
    a float32 residual stream (its backward takes float32 then; the residual's dtype
    otherwise)."""
    needed, dtype, layout, tp = x
    if not needed:
        return lambda: None
    first = local_einsum("xz", "yz", "xy", dq, wq, compute_dtype(dtype))
    gx = matmul_bias(dkv, wkv2.T, None, first).reshape(layout.local_shape)
    unrounded = normed is not None and normed.dtype == gx.dtype
    return _reduced_later(gx if unrounded else converted(gx, dtype), layout, tp)
