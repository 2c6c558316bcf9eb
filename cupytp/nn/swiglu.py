"""SwiGLU: the MLP of Llama-family models, down_proj(silu(gate_proj(x)) · up_proj(x))."""
from cupytp import ops
from cupytp.nn.layers import DLinear, DPackedLinear
from cupytp.nn.module import Module
from cupytp.nn.rmsnorm import norm_arguments
from cupytp.tensor import Shard


class SwiGLU(Module):
    """gate_proj and up_proj column-parallel, fused into one product: gate_up_proj.weight
    `[C, 2, F]` (gate and up on their own axis; tensor-parallel `[C, 2, F/tp]`, Shard(2), so every
    rank holds gate and up of the same columns); down_proj row-parallel (`[F/tp, C]`, Shard(0)).
    Replicated in, Replicated out: one all-reduce forward (down_proj's Partial output, reduced by
    whatever adds it) and one backward (x's Partial gradient, while gate_up's weight gradient is
    computed). Biases optional on gate and up (none in Llama's); down_proj has none."""

    def __init__(self, dim, hidden, mesh=None, bias=False, dtype="fp32", init_std=0.02,
                 proj_init_std=None):
        super().__init__()
        self.gate_up_proj = DPackedLinear(dim, 2, hidden, mesh, bias, dtype=dtype,
                                          init_std=init_std)
        self.down_proj = DLinear(hidden, dim, mesh, Shard(0), False, dtype=dtype,
                                 init_std=proj_init_std or init_std)

    def forward(self, x, residual=None, norm=None):
        """The MLP of x (of norm(x) with an RMSNorm module `norm`), plus `residual` when given
        (`ops.swiglu_mlp`: one fused op where it takes these layouts)."""
        return ops.swiglu_mlp(x, self.gate_up_proj.weight, self.gate_up_proj.bias,
                              self.down_proj.weight, norm_arguments(norm), residual)

    def parallel_plan(self):
        return {"gate_up_proj": "colwise", "down_proj": "rowwise"}
