"""Ops on DTensors: each a sharding rule, a local forward and a local backward.

The rule chooses the output placements from the inputs' and may reduce a Partial input or slice
a Replicated one by itself; anything needing a gather is a ShardingError that says which
redistribute to call.
"""
from cupytp.ops import methods  # noqa: F401  (DTensor's operators and math methods)
from cupytp.ops.conversion import ShardingError
from cupytp.ops.elementwise import (
    add, astype, bias_gelu, bias_residual_add, div, exp, gelu, log, masked_fill, mul, neg, pow,
    silu_mul, sqrt, sub, tanh)
from cupytp.ops.amp import autocast
from cupytp.ops.linalg import einsum, matmul
from cupytp.ops.functional import (
    bias_dropout_add, causal_softmax, cross_entropy, dropout, embedding, layer_norm, log_softmax,
    packed_attention, rms_norm, scaled_dot_product_attention, softmax, take_along_last)
from cupytp.ops.rotary import rotary
from cupytp.ops.fused import attention_residual, fusion, mlp_residual
from cupytp.ops.decoder import grouped_attention, swiglu_mlp
from cupytp.ops.reduction import broadcast_to, max, mean, sum, sum_to_shape
from cupytp.ops.shape import (
    concat, getitem, permute, reshape, split, stack, transpose, unsqueeze)
from cupytp.tensor.redistribute import redistribute

__all__ = [
    "ShardingError", "causal_softmax", "autocast", "redistribute", "add", "astype", "bias_gelu",
    "bias_residual_add", "bias_dropout_add",
    "div", "exp", "gelu", "log", "masked_fill", "mul", "neg", "pow", "silu_mul", "sqrt", "sub",
    "tanh",
    "einsum", "matmul",
    "cross_entropy", "dropout", "embedding", "layer_norm", "log_softmax", "packed_attention",
    "rms_norm", "rotary",
    "scaled_dot_product_attention", "softmax", "take_along_last", "broadcast_to", "max", "mean",
    "sum", "sum_to_shape", "concat", "getitem", "permute", "reshape", "split", "stack",
    "transpose", "unsqueeze", "attention_residual", "fusion", "mlp_residual",
    "grouped_attention", "swiglu_mlp",
]
