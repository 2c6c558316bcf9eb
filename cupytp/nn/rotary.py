"""Rotary position embeddings (RoPE) in Hugging Face's rotate-half form: the frequencies of a
config (`rope_theta`, and the `llama3` scaling of Llama 3.1 and 3.2) and the tables of their
cosines and sines, applied by `ops.rotary`.

Hugging Face's q_proj and k_proj rows are already in rotate-half order (pair i is (i, i + D/2)
of each head), so its checkpoints load key for key with no permutation; Meta's original
checkpoints interleave the pairs and are permuted by Hugging Face's conversion script, not here.
"""
import math

import numpy

from cupytp import backend, ops
from cupytp.launchers import compute_dtype
from cupytp.nn.module import Module
from cupytp.tensor import DTensor

ROPE_TYPES = ("default", "llama3", "linear")


def rope_frequencies(head_dim, theta=10000.0, scaling=None):
    """The float64 inverse frequencies f_i = theta^(-2i/D), i < D/2, of a head of size D, with
    `scaling` applied: None (or rope_type "default"); {"rope_type": "linear", "factor"}: all
    divided by the factor; {"rope_type": "llama3", "factor", "low_freq_factor",
    "high_freq_factor", "original_max_position_embeddings"}: Llama 3.1's (long wavelengths
    divided by the factor, short ones kept, those between blended smoothly)."""
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head size, got {head_dim}")
    inv_freq = 1.0 / theta ** (numpy.arange(0, head_dim, 2, dtype=numpy.float64) / head_dim)
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_scaling type {kind!r} is not supported: use one of {ROPE_TYPES}")
    try:
        factor = float(scaling["factor"])
        if kind == "linear":
            return inv_freq / factor
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        context = float(scaling["original_max_position_embeddings"])
    except KeyError as err:
        raise ValueError(f"rope_scaling {scaling} lacks {err.args[0]!r}") from None
    wavelength = 2 * math.pi / inv_freq
    scaled = numpy.where(wavelength > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    between = (wavelength >= context / high) & (wavelength <= context / low)
    return numpy.where(between, blended, scaled)


class RotaryEmbedding(Module):
    """The rotary embedding of one head size: `forward(x, start=0)` rotates x (B, T, H, D), its
    tokens at positions start, start + 1, ..., or at the positions of a DTensor `start` (T,)
    (each below T: a permutation of the sequence, as `ContextParallel.positions` gives; see
    `ops.rotary`). The cosine and sine tables are computed in float64 from the frequencies and
    kept per compute dtype (float32, or float64 for float64 x), grown to the longest position
    seen; they are no parameters (nothing to learn or save, as in Hugging Face's models).
    Several attention layers share one."""

    def __init__(self, head_dim, theta=10000.0, scaling=None):
        super().__init__()
        self.head_dim = head_dim
        self.inv_freq = rope_frequencies(head_dim, theta, scaling)
        self._tables = {}           # compute dtype -> (cos, sin), (positions, D/2) each

    def tables(self, dtype, positions):
        """(cos, sin) tables of at least `positions` rows for x of `dtype` (made, or grown to the
        next power of two, when shorter)."""
        compute = compute_dtype(dtype)
        tables = self._tables.get(compute)
        if tables is None or tables[0].shape[0] < positions:
            rows = 1 << max(8, (positions - 1).bit_length())
            angles = numpy.outer(numpy.arange(rows, dtype=numpy.float64), self.inv_freq)
            tables = self._tables[compute] = tuple(
                backend.asarray(numpy.ascontiguousarray(f(angles), dtype=compute))
                for f in (numpy.cos, numpy.sin))
        return tables

    def rope(self, dtype, length, start=0):
        """(cos, sin, start): what `ops.rotary` (and the fused attention) take to rotate
        `length` tokens of `dtype` from position `start`, or at the positions of a DTensor
        `start`."""
        rows = length if isinstance(start, DTensor) else start + length
        return (*self.tables(dtype, rows), start)

    def forward(self, x, start=0):
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"rotary embedding of head size {self.head_dim} given {x.shape}")
        return ops.rotary(x, *self.rope(x.dtype, x.shape[1], start))
