"""Tensor-parallel layers. Each says which dimension of its weight is split and what that does
to its input and output; the collectives come from the DTensor rules, not from the layer.

A layer's `mesh` may have several dimensions: its tensor-parallel placement goes on the mesh
dimension named "tp" (the last one when none is named so), and it is Replicated on the others.
Layers built without a mesh are dense (one rank); `cupytp.parallel` re-lays them onto a mesh.
"""
import math

from cupytp import ops
from cupytp.ops.linalg import autocast_operand
from cupytp.nn.module import Module
from cupytp.tensor import Replicated, Shard, ones, randn, zeros
from cupytp.tensor.factory import local_mesh


def tp_dim(mesh):
    """The mesh dimension tensor parallelism splits over: the one named "tp", else the last."""
    return mesh.dim_names.index("tp") if "tp" in mesh.dim_names else mesh.ndim - 1


def tp_placements(mesh, placement):
    """`placement` on the tensor-parallel mesh dimension, Replicated on the others; a full tuple
    of placements is taken as it is."""
    if isinstance(placement, (tuple, list)):
        return tuple(placement)
    placements = [Replicated()] * mesh.ndim
    placements[tp_dim(mesh)] = placement
    return tuple(placements)


def _mesh(mesh):
    return local_mesh() if mesh is None else mesh


class DLinear(Module):
    """y = x @ weight + bias, weight `[in, out]` (the GPT-2 Conv1D layout); inside `autocast`
    the bias joins the product in the autocast dtype, so the output stays 16-bit.

    weight Shard(1) (column-parallel): weight `[in, out/tp]`, output Shard(-1), no communication.
    weight Shard(0) (row-parallel): weight `[in/tp, out]`, input Shard(-1) (a Replicated input is
    sliced), output Partial; the bias (Replicated) is added once, after the all-reduce that the
    addition itself triggers. Without a bias the output stays Partial until something needs it.
    In backward a column-parallel layer all-reduces its input's (Partial) gradient itself, while
    it computes its weight's gradient. Sequence parallelism: a column-parallel layer all-gathers
    an input sharded on its sequence (and reduce-scatters the gradient back); a row-parallel
    one's output is reduce-scattered into a sequence-sharded residual stream (see forward).
    """

    def __init__(self, in_features, out_features, mesh=None, weight=Replicated(), bias=True,
                 bias_sharding=None, dtype="fp32", init_std=0.02):
        super().__init__()
        mesh = _mesh(mesh)
        self.in_features, self.out_features = in_features, out_features
        self.weight = randn((in_features, out_features), mesh, tp_placements(mesh, weight),
                            dtype=dtype, std=init_std, requires_grad=True)
        if bias:
            if bias_sharding is None:
                bias_sharding = Shard(0) if isinstance(weight, Shard) and weight.dim == 1 \
                    else Replicated()
            self.bias = zeros((out_features,), mesh, tp_placements(mesh, bias_sharding),
                              dtype=dtype, requires_grad=True)
        else:
            self.bias = None

    def forward(self, x, residual=None, placements=None):
        """x @ weight + bias, plus `residual` when given (`ops.bias_residual_add`: the bias and
        the residual joined in one pass, with the fp32 bias; a Partial product is reduced to the
        residual's layout there). `placements`: the layout a row-parallel (Partial) product is
        reduced to before the bias joins (a reduce-scatter into a sequence-sharded stream)."""
        y = ops.matmul(x, self.weight, reduce_input_grad=True)
        if placements is not None and y.placements != placements:
            y = y.redistribute(placements)
        if residual is not None:
            return residual + y if self.bias is None else \
                ops.bias_residual_add(y, self.bias, residual)
        return y + autocast_operand(self.bias) if self.bias is not None else y

    def parallel_layout(self, style):
        """Placements of (weight, bias) on the tensor-parallel dim for a parallel style."""
        return {"colwise": (Shard(1), Shard(0)), "rowwise": (Shard(0), Replicated()),
                "replicate": (Replicated(), Replicated())}[style]


class DColumnLinear(DLinear):
    """Column-parallel: weight `[in, out/tp]` Shard(1); output Shard(-1), or Replicated with
    `gather_output` (one all-gather)."""

    def __init__(self, in_features, out_features, mesh=None, bias=True, gather_output=False,
                 dtype="fp32", init_std=0.02):
        super().__init__(in_features, out_features, mesh, Shard(1), bias, dtype=dtype,
                         init_std=init_std)
        self.gather_output = gather_output

    def forward(self, x):
        """x @ weight + bias, Shard(-1) (all-gathered with `gather_output`)."""
        y = super().forward(x)
        if self.gather_output:
            y = y.redistribute((Replicated(),) * y.mesh.ndim)
        return y


class DRowLinear(DLinear):
    """Row-parallel: weight `[in/tp, out]` Shard(0); input Shard(-1), or Replicated (then each
    rank slices its part locally, so no `input_is_parallel` flag is needed); output Replicated
    after one all-reduce."""

    def __init__(self, in_features, out_features, mesh=None, bias=True, dtype="fp32",
                 init_std=0.02):
        super().__init__(in_features, out_features, mesh, Shard(0), bias, dtype=dtype,
                         init_std=init_std)

    def forward(self, x, residual=None):
        y = super().forward(x, residual)
        if any(p.is_partial() for p in y.placements):
            y = y.redistribute(tuple(Replicated() if p.is_partial() else p
                                     for p in y.placements))
        return y


class DEmbedding(Module):
    """Rows of weight `[vocab, dim]` at integer ids.

    weight Shard(0) (vocab-parallel): `[vocab/tp, dim]`; ids out of this rank's range give zeros
    and the output is Partial, reduced by the next op that needs it. Replicated: plain lookup.
    `vocab_parallel`: a token embedding, which the Megatron plan splits by vocabulary even when
    no LM head shares its weight (an untied model's input embedding).
    `sequence_parallel` (set by the tensor-parallel plan): the output is sharded along tp on the
    ids' last dimension, the sequence (a Partial one reduce-scattered there): the residual
    stream of sequence parallelism starts here.
    """

    def __init__(self, num_embeddings, embedding_dim, mesh=None, weight=Replicated(),
                 dtype="fp32", init_std=0.02, vocab_parallel=False):
        super().__init__()
        mesh = _mesh(mesh)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = randn((num_embeddings, embedding_dim), mesh, tp_placements(mesh, weight),
                            dtype=dtype, std=init_std, requires_grad=True)
        self.vocab_parallel = vocab_parallel
        self.sequence_parallel = False

    def forward(self, ids):
        y = ops.embedding(ids, self.weight)
        if self.sequence_parallel:      # (B, T/tp, C)
            y = y.redistribute(sequence_sharded(y.placements, tp_dim(y.mesh), ids.ndim - 1))
        return y

    def parallel_layout(self, style):
        return {"vocab": (Shard(0),), "colwise": (Shard(1),), "replicate": (Replicated(),)}[style]


class LayerNorm(Module):
    """Normalization over the last dimension (never sharded); weight and bias Replicated."""

    def __init__(self, dim, mesh=None, eps=1e-5, bias=True, dtype="fp32"):
        super().__init__()
        mesh = _mesh(mesh)
        replicated = (Replicated(),) * mesh.ndim
        self.eps = eps
        self.weight = ones((dim,), mesh, replicated, dtype=dtype, requires_grad=True)
        self.bias = zeros((dim,), mesh, replicated, dtype=dtype, requires_grad=True) \
            if bias else None

    def forward(self, x):
        return ops.layer_norm(x, self.weight, self.bias, self.eps)


class GeLU(Module):
    """GeLU, tanh form; any layout."""

    def forward(self, x):
        return ops.gelu(x)


class Dropout(Module):
    """Dropout with the sharding-invariant generator: the same mask on any mesh.
    `context_parallel` (set by cupytp.parallel.ContextParallel.apply): on a sequence permuted by
    it, the mask is drawn by token position (`ops.dropout`'s order)."""

    def __init__(self, p=0.0):
        super().__init__()
        self.p = p
        self.context_parallel = None

    @property
    def active(self):
        """True when forward changes its input (training with p > 0)."""
        return self.training and self.p > 0

    @property
    def effective_p(self):
        """The probability forward drops with: p while training, else 0."""
        return self.p if self.training else 0.0

    def forward(self, x):
        order = None if self.context_parallel is None or not self.active else \
            self.context_parallel.order_of(x)
        return ops.dropout(x, self.p, self.training, order=order)


class DMLP(Module):
    """c_fc (column-parallel, `[C, 4C/tp]`) → GeLU → c_proj (row-parallel, `[4C/tp, C]`):
    Replicated in, Replicated out, one all-reduce forward (at c_proj's bias) and one backward
    (the Partial input gradient of c_fc). c_fc's bias and the GeLU are one fused op."""

    def __init__(self, in_features, hidden_features, out_features=None, mesh=None, bias=True,
                 dropout=0.0, dtype="fp32", init_std=0.02, proj_init_std=None):
        super().__init__()
        out_features = out_features or in_features
        self.c_fc = DLinear(in_features, hidden_features, mesh, Shard(1), bias, dtype=dtype,
                            init_std=init_std)
        self.c_proj = DLinear(hidden_features, out_features, mesh, Shard(0), bias, dtype=dtype,
                              init_std=proj_init_std or init_std)
        self.dropout = Dropout(dropout)

    def forward(self, x, residual=None, norm=None):
        """The MLP of x (of norm(x) with a LayerNorm module `norm`), its dropout, plus `residual`
        when given: then one fused op with the norm, `ops.mlp_residual`."""
        if residual is not None and _fusable(x):
            return ops.mlp_residual(x, residual, self.c_fc.weight, self.c_fc.bias,
                                    self.c_proj.weight, self.c_proj.bias, _norm_args(norm),
                                    self.dropout.effective_p)
        x = x if norm is None else norm(x)
        h = ops.matmul(x, self.c_fc.weight, reduce_input_grad=True)  # (B, T, 4C/tp)
        h = ops.gelu(h) if self.c_fc.bias is None else ops.bias_gelu(h, self.c_fc.bias)
        return project(self.c_proj, self.dropout, h, residual)

    def parallel_plan(self):
        return {"c_fc": "colwise", "c_proj": "rowwise"}


class DAttention(Module):
    """Causal multi-head self-attention with heads split across the tensor-parallel ranks.

    c_attn.weight is `[C, 3, C]`: the `[C, 3C]` fused q|k|v weight of GPT-2 with q, k and v on
    their own axis, sharded on the last (heads: `[C, 3, C/tp]`), so every rank holds q, k and v
    of the same heads. c_proj is row-parallel. Heads must divide by the tensor-parallel size.
    `context_parallel` (a cupytp.parallel.ContextParallel, set by its `apply`): the sequence is
    split across that mesh dimension's ranks, and the attention runs as its ring.
    """

    def __init__(self, embed_dim, num_heads, mesh=None, bias=True, dropout=0.0, dtype="fp32",
                 init_std=0.02, proj_init_std=None):
        super().__init__()
        mesh = _mesh(mesh)
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} is not a multiple of num_heads {num_heads}")
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.c_attn = DQKV(embed_dim, mesh, bias, dtype, init_std)
        self.c_proj = DLinear(embed_dim, embed_dim, mesh, Shard(0), bias, dtype=dtype,
                              init_std=proj_init_std or init_std)
        self.attn_dropout = Dropout(dropout)
        self.resid_dropout = Dropout(dropout)
        self.context_parallel = None
        check_heads(self)

    def forward(self, x, residual=None, norm=None, cache=None):
        """Attention over x (over norm(x) with a LayerNorm module `norm`), its dropouts, plus
        `residual` when given: then one fused op with the norm, `ops.attention_residual`. With
        a `nn.LayerCache` the new keys and values are appended to it and the queries attend over
        everything cached."""
        b, t, c = x.shape
        h = self.num_heads
        p = self.attn_dropout.effective_p
        if residual is not None and cache is None and _fusable(x):
            return ops.attention_residual(x, residual, self.c_attn.weight, self.c_attn.bias,
                                          self.c_proj.weight, self.c_proj.bias, h, p,
                                          norm=_norm_args(norm),
                                          resid_dropout_p=self.resid_dropout.effective_p)
        x = x if norm is None else norm(x)
        qkv = self.c_attn(x).reshape(b, t, 3, h, c // h)            # (B, T, 3, H/tp, D)
        if cache is not None:
            k, v = cache.append(qkv[:, :, 1], qkv[:, :, 2])         # (B, S, H/tp, D)
            y = ops.scaled_dot_product_attention(qkv[:, :, 0].transpose(1, 2),
                                                 k.transpose(1, 2), v.transpose(1, 2),
                                                 dropout_p=p).transpose(1, 2)
        else:
            attend = ops.packed_attention if self.context_parallel is None else \
                self.context_parallel.attention
            y = attend(qkv, causal=True, dropout_p=p)                # (B, T, H/tp, D)
        y = y.reshape(b, t, c)                                       # (B, T, C/tp)
        return project(self.c_proj, self.resid_dropout, y, residual)

    def parallel_plan(self):
        return {"c_attn": "heads", "c_proj": "rowwise"}


def _fusable(x):
    """True when a sublayer may run as one fused op on x: not when x is sharded on its
    sequence (sequence and context parallelism run the chain)."""
    return not any(p.is_shard(1) for p in x.placements)


def sequence_sharded(placements, mesh_dim, dim):
    """`placements` with Shard(dim) on `mesh_dim`: an activation's sequence-parallel layout."""
    return placements[:mesh_dim] + (Shard(dim),) + placements[mesh_dim + 1:]


def _norm_args(norm):
    """A fused op's `norm` argument, (weight, bias, eps), of a LayerNorm module (or None)."""
    return None if norm is None else (norm.weight, norm.bias, norm.eps)


def project(proj, dropout, x, residual):
    """dropout(proj(x)), plus `residual` when given: then the projection's bias, the dropout
    and the residual in one pass (`ops.bias_dropout_add`, the Partial product reduced to the
    residual's layout there), or, for masks drawn by token position (context parallelism), the
    projection reduced to the residual's layout, its dropout, and the sum."""
    if residual is None:
        return dropout(proj(x))
    if dropout.context_parallel is not None and dropout.active:
        return residual + dropout(proj(x, placements=residual.placements))
    y = ops.matmul(x, proj.weight, reduce_input_grad=True)
    return ops.bias_dropout_add(y, proj.bias, residual, dropout.effective_p)


def check_heads(attention):
    """Heads split over the tensor-parallel ranks: they must divide evenly."""
    mesh = attention.c_attn.weight.mesh
    size = mesh.shape[tp_dim(mesh)]
    sharded = attention.c_attn.weight.placements[tp_dim(mesh)] != Replicated()
    if sharded and attention.num_heads % size:
        raise ValueError(f"{attention.num_heads} attention heads cannot be split over {size} "
                         "tensor-parallel ranks: use a tp size that divides the heads")


class DPackedLinear(Module):
    """`parts` projections of one input side by side, one product: weight `[in, parts, out]`,
    bias `[parts, out]`; output `[B, T, parts, out]`. Column-parallel on the last axis (weight
    Shard(2), bias Shard(1)): every rank holds the same columns of each part (a SwiGLU's gate
    and up, attention's k and v), so splitting never mixes the parts. Its input's gradient is
    all-reduced in backward as a column-parallel DLinear's is."""

    def __init__(self, in_features, parts, out_features, mesh=None, bias=True, weight=Shard(2),
                 dtype="fp32", init_std=0.02):
        super().__init__()
        mesh = _mesh(mesh)
        bias_sharding = Shard(1) if weight == Shard(2) else Replicated()
        self.weight = randn((in_features, parts, out_features), mesh,
                            tp_placements(mesh, weight), dtype=dtype, std=init_std,
                            requires_grad=True)
        self.bias = zeros((parts, out_features), mesh, tp_placements(mesh, bias_sharding),
                          dtype=dtype, requires_grad=True) if bias else None

    def forward(self, x):
        y = ops.einsum("btc,cjd->btjd", x, self.weight, reduce_input_grad=True)
        return y + autocast_operand(self.bias) if self.bias is not None else y

    def parallel_layout(self, style):
        split = (Shard(2), Shard(1))
        return {"heads": split, "colwise": split, "replicate": (Replicated(), Replicated())}[style]


class DQKV(DPackedLinear):
    """The fused q|k|v projection: weight `[C, 3, C]` and bias `[3, C]`, heads on the last axis
    (Shard(2) / Shard(1) when tensor-parallel); output `[B, T, 3, C]`."""

    def __init__(self, embed_dim, mesh, bias, dtype, init_std):
        super().__init__(embed_dim, 3, embed_dim, mesh, bias, dtype=dtype, init_std=init_std)


class DBlock(Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, embed_dim, num_heads, mesh=None, bias=True, dropout=0.0, dtype="fp32",
                 init_std=0.02, proj_init_std=None, eps=1e-5):
        super().__init__()
        self.ln_1 = LayerNorm(embed_dim, mesh, eps, bias, dtype)
        self.attn = DAttention(embed_dim, num_heads, mesh, bias, dropout, dtype, init_std,
                               proj_init_std)
        self.ln_2 = LayerNorm(embed_dim, mesh, eps, bias, dtype)
        self.mlp = DMLP(embed_dim, 4 * embed_dim, embed_dim, mesh, bias, dropout, dtype, init_std,
                        proj_init_std)

    def forward(self, x, cache=None):
        x = self.attn(x, residual=x, norm=self.ln_1, cache=cache)
        return self.mlp(x, residual=x, norm=self.ln_2)


class DLMHead(Module):
    """Logits `x @ weightᵀ` with the weight tied to an embedding `[vocab, C]`: vocab-parallel
    embedding → vocab-sharded logits (Shard(-1)), fed to cross_entropy without gathering; the
    input's gradient is all-reduced in backward while the weight's is computed. Given no
    embedding, the head holds a `[vocab, C]` weight of its own (an untied head, Hugging Face's
    `lm_head.weight`), laid out as an embedding's (vocab-parallel: Shard(0))."""

    def __init__(self, embedding=None, vocab_size=None, embedding_dim=None, mesh=None,
                 dtype="fp32", init_std=0.02):
        super().__init__()
        if embedding is None:
            self.weight = randn((vocab_size, embedding_dim), _mesh(mesh),
                                (Replicated(),) * _mesh(mesh).ndim, dtype=dtype, std=init_std,
                                requires_grad=True)
            embedding = self
        object.__setattr__(self, "_embedding", embedding)

    def forward(self, x):
        return ops.einsum("btc,vc->btv", x, self._embedding.weight, reduce_input_grad=True)

    def parallel_layout(self, style):
        return {"vocab": (Shard(0),), "replicate": (Replicated(),)}[style]


def scaled_init(init_std, n_layer):
    """GPT-2's init for projections into the residual stream: std / sqrt(2 * n_layer)."""
    return init_std / math.sqrt(2 * n_layer)


__all__ = ["DLinear", "DColumnLinear", "DRowLinear", "DEmbedding", "LayerNorm", "GeLU",
           "Dropout", "DMLP", "DAttention", "DPackedLinear", "DQKV", "DBlock", "DLMHead",
           "tp_dim", "tp_placements", "sequence_sharded", "scaled_init"]
