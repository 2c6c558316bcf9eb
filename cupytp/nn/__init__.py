"""Modules and tensor-parallel layers."""
from cupytp.nn.layers import (
    DAttention, DBlock, DColumnLinear, DEmbedding, DLinear, DLMHead, DMLP, DPackedLinear, DQKV,
    DRowLinear, Dropout, GeLU, LayerNorm, scaled_init, tp_dim, tp_placements)
from cupytp.nn.module import (
    Module, ModuleList, Sequential, assign, is_materialized, materialize)
from cupytp.nn.recompute import recompute
from cupytp.nn.rmsnorm import RMSNorm
from cupytp.nn.rotary import RotaryEmbedding, rope_frequencies
from cupytp.nn.swiglu import SwiGLU
from cupytp.nn.attention import GroupedQueryAttention
from cupytp.nn.kv_cache import KVCache, LayerCache

__all__ = [
    "DAttention", "DBlock", "DColumnLinear", "DEmbedding", "DLinear", "DLMHead", "DMLP",
    "DPackedLinear", "DQKV", "DRowLinear", "Dropout", "GeLU", "LayerNorm", "scaled_init",
    "tp_dim", "tp_placements", "Module", "ModuleList", "Sequential", "assign", "is_materialized",
    "materialize", "recompute", "RMSNorm", "RotaryEmbedding", "rope_frequencies", "SwiGLU",
    "GroupedQueryAttention", "KVCache", "LayerCache",
]
