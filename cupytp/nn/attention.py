"""Grouped-query self-attention with rotary positions: the attention of Llama-family models."""
from cupytp import ops
from cupytp.ops.amp import operand_dtype
from cupytp.nn.layers import DLinear, DPackedLinear, tp_dim
from cupytp.nn.module import Module
from cupytp.nn.rmsnorm import norm_arguments
from cupytp.tensor import Replicated, Shard


class GroupedQueryAttention(Module):
    """Causal self-attention of `num_heads` query heads over `num_kv_heads` key/value heads
    (H / Hk query heads share each), positions by a shared `nn.RotaryEmbedding`, heads of size D.

    Tensor parallelism, over `tp` ranks: q_proj `[C, H·D]` column-parallel (heads split,
    `[C, H·D/tp]`); kv_proj `[C, 2, Hk·D]` (k and v side by side) split by heads too (Shard(2))
    when tp divides Hk, else Replicated: every rank then computes all Hk key/value heads and
    attends with those its query heads need (rank r holds query heads r·H/tp ... (r+1)·H/tp - 1,
    which read key/value heads h // (H / Hk): with tp a multiple of Hk, the one head
    r // (tp / Hk)), and their gradient is each rank's share, summed when it is accumulated;
    o_proj row-parallel (`[H·D/tp, C]`). H must divide by tp, and Hk by tp or tp by Hk. q and kv
    biases are optional (Qwen2's); o_proj has none.

    `forward(x, residual=None, norm=None, start=0, cache=None, positions=None)`: tokens at
    positions start, ..., or at `positions` (a DTensor (T,) laid out as x's sequence: a
    sequence split by context parallelism, `ContextParallel.positions`); with a `LayerCache`
    the new keys and values are appended to it and the queries attend over everything cached
    (`nn.KVCache`). `context_parallel` (a cupytp.parallel.ContextParallel, set by its `apply`):
    the sequence is split across that mesh dimension's ranks, and the attention runs as its
    ring, the key/value heads (Hk, fewer than the query heads) travelling."""

    def __init__(self, dim, num_heads, num_kv_heads, rotary, head_dim=None, mesh=None, tp=None,
                 qkv_bias=False, dtype="fp32", init_std=0.02, proj_init_std=None):
        super().__init__()
        head_dim = head_dim or dim // num_heads
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.tp = tp or (mesh.shape[tp_dim(mesh)] if mesh is not None else 1)
        check_heads(num_heads, num_kv_heads, self.tp)
        self.q_proj = DLinear(dim, num_heads * head_dim, mesh, Shard(1), qkv_bias, dtype=dtype,
                              init_std=init_std)
        self.kv_proj = DPackedLinear(dim, 2, num_kv_heads * head_dim, mesh, qkv_bias,
                                     self.kv_placement(), dtype=dtype, init_std=init_std)
        self.o_proj = DLinear(num_heads * head_dim, dim, mesh, Shard(0), False, dtype=dtype,
                              init_std=proj_init_std or init_std)
        object.__setattr__(self, "_rotary", rotary)     # shared by the layers: not a child
        self.context_parallel = None

    def kv_placement(self):
        """kv_proj's weight placement on the tensor-parallel dim: heads split where tp (> 1)
        divides them, else Replicated."""
        return Shard(2) if self.tp > 1 and self.num_kv_heads % self.tp == 0 else Replicated()

    def forward(self, x, residual=None, norm=None, start=0, cache=None, positions=None):
        """Attention over x (over norm(x) with an RMSNorm module `norm`), plus `residual` when
        given (`ops.grouped_attention`: one fused op where it takes these layouts)."""
        if positions is not None and (start or cache is not None):
            raise ValueError("attention takes either positions or a start and a KV cache")
        rope = self._rotary.rope(operand_dtype(x), x.shape[1],
                                 start if positions is None else positions)
        ring = None if self.context_parallel is None else self.context_parallel.grouped_attention
        return ops.grouped_attention(
            x, self.q_proj.weight, self.q_proj.bias, self.kv_proj.weight, self.kv_proj.bias,
            self.o_proj.weight, rope, self.num_heads, self.num_kv_heads, norm_arguments(norm),
            residual, cache, ring)

    def check_tp(self, size):
        """A plan laid out over `size` tensor-parallel ranks must be the one this attention was
        built for (it decided whether key/value heads split)."""
        if size != self.tp:
            raise ValueError(f"this attention was built for tp={self.tp} and is being laid out "
                             f"over {size} tensor-parallel ranks: build it with tp={size}")

    def parallel_plan(self):
        return {"q_proj": "colwise", "o_proj": "rowwise",
                "kv_proj": "colwise" if self.kv_placement() == Shard(2) else "replicate"}


def check_heads(num_heads, num_kv_heads, tp):
    """Query heads split over tp ranks; key/value heads too, or each one shared by tp / Hk."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} key/value "
                         "heads: the key/value heads must divide the query heads")
    if num_heads % tp or (num_kv_heads % tp and tp % num_kv_heads):
        raise ValueError(f"{num_heads} query and {num_kv_heads} key/value heads cannot be split "
                         f"over {tp} tensor-parallel ranks: tp must divide the query heads, and "
                         "divide or be a multiple of the key/value heads")
