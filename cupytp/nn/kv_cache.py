"""A key/value cache for incremental decoding: the keys and values of the tokens a model has
already seen, so that a new token attends to them without the whole window being run again.

`KVCache(capacity)` serves one batch of sequences through every attention layer of a model:
`length` tokens are cached (so the next token's position is `length`), and `layer(i)` is the
`LayerCache` of attention layer i. In a forward with a cache each attention layer computes the
keys and values of the new tokens only, appends them (`LayerCache.append`) and attends over all
that is cached, its queries aligned to the last keys (causal: query t sees keys up to
length + t); the model then advances the cache (`advance(t)`). A layer's buffers are made at its
first append, each rank holding its part of the keys as the layer lays them out (heads split or
replicated: (B, capacity, Hk/tp, D) local arrays), so attention reads the layouts it reads
without a cache.
"""
from cupytp import backend
from cupytp.tensor import from_local


class KVCache:
    """The cache of one batch of sequences for a whole model (module docstring)."""

    def __init__(self, capacity):
        if capacity < 1:
            raise ValueError(f"a KV cache holds at least one token, got capacity {capacity}")
        self.capacity = capacity
        self.length = 0
        self._layers = {}

    def layer(self, index):
        """The LayerCache of attention layer `index` (made on first use)."""
        if index not in self._layers:
            self._layers[index] = LayerCache(self)
        return self._layers[index]

    def advance(self, tokens):
        """Count `tokens` more as cached (the model calls it after its layers appended them)."""
        self.length += tokens

    def reset(self):
        """Forget every cached token (the buffers stay for the next prefill)."""
        self.length = 0


class LayerCache:
    """One attention layer's cached keys and values."""

    def __init__(self, owner):
        self.owner = owner
        self.keys = self.values = None

    def append(self, k, v):
        """Append k and v (B, T, Hk, D) of the new tokens at the cache's length; returns the
        keys and values of every cached token, (B, length + T, Hk, D), views of the buffers laid
        out like k."""
        start, t = self.owner.length, k.shape[1]
        if start + t > self.owner.capacity:
            raise ValueError(f"the KV cache holds {self.owner.capacity} tokens: {start} cached "
                             f"and {t} more do not fit (reset it, or make a larger one)")
        local = k.to_local()
        if self.keys is None or self.keys.dtype != local.dtype or \
                self.keys.shape[:1] + self.keys.shape[2:] != local.shape[:1] + local.shape[2:]:
            shape = local.shape[:1] + (self.owner.capacity,) + local.shape[2:]
            self.keys, self.values = (backend.xp.empty(shape, local.dtype) for _ in range(2))
        self.keys[:, start:start + t] = local
        self.values[:, start:start + t] = v.to_local()
        shape = k.shape[:1] + (start + t,) + k.shape[2:]
        return tuple(from_local(buffer[:, :start + t], k.mesh, k.placements, shape=shape)
                     for buffer in (self.keys, self.values))
