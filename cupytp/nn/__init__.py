"""Modules and tensor-parallel layers."""
from cupytp.nn.layers import (
    DAttention, DBlock, DColumnLinear, DEmbedding, DLinear, DLMHead, DMLP, DQKV, DRowLinear,
    Dropout, GeLU, LayerNorm, scaled_init, tp_dim, tp_placements)
from cupytp.nn.module import (
    Module, ModuleList, Sequential, assign, is_materialized, materialize)
from cupytp.nn.recompute import recompute

__all__ = [
    "DAttention", "DBlock", "DColumnLinear", "DEmbedding", "DLinear", "DLMHead", "DMLP", "DQKV",
    "DRowLinear", "Dropout", "GeLU", "LayerNorm", "scaled_init", "tp_dim", "tp_placements",
    "Module", "ModuleList", "Sequential", "assign", "is_materialized", "materialize",
    "recompute",
]
