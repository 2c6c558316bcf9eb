"""Sampling text from a causal language model with a KV cache: one forward over the prompt (the
prefill), then one token per step, each attending to the keys and values cached so far.

`generate(model, ids, max_new_tokens, temperature, top_k, seed)` works for any model whose
`forward(ids, cache=cache)` returns (logits, loss) and advances `cache` (an `nn.KVCache`), with
`context_length` (the longest window it takes) and `config.vocab_size`. While the sequence fits
the context, each step feeds only the newest token; past it the window of the last
`context_length` tokens is run again each step (its positions shift), as without a cache, so the
tokens are those of running the whole window every step.
"""
import numpy

import cupytp
from cupytp import backend
from cupytp.autograd import no_grad
from cupytp.nn import KVCache
from cupytp.tensor import Replicated


def generate(model, ids, max_new_tokens, temperature=1.0, top_k=None, seed=0):
    """`ids` (NumPy (B, T)) with `max_new_tokens` sampled tokens appended; the same on every rank
    (the same seed picks the same tokens)."""
    rng = numpy.random.default_rng(seed)
    ids = numpy.asarray(ids)
    context = model.context_length
    cache = KVCache(context)
    with no_grad():
        logits = _forward(model, ids[:, -context:], cache)
        for step in range(max_new_tokens):
            ids = numpy.concatenate([ids, sample(logits, model.config.vocab_size, temperature,
                                                 top_k, rng)[:, None]], axis=1)
            if step + 1 == max_new_tokens:
                break
            if cache.length < context:
                logits = _forward(model, ids[:, -1:], cache)
            else:                   # the window moves: its positions change, run it again
                cache.reset()
                logits = _forward(model, ids[:, -context:], cache)
    return ids


def _forward(model, ids, cache):
    """The float64 logits (B, vocab) of the last position after feeding `ids` (NumPy (B, T))."""
    mesh = model.mesh
    x = cupytp.from_local(backend.asarray(ids), mesh, (Replicated(),) * mesh.ndim,
                          shape=ids.shape)
    logits, _ = model(x, cache=cache)
    return backend.asnumpy(logits[:, -1].full_tensor()).astype(numpy.float64)


def sample(logits, vocab_size, temperature=1.0, top_k=None, rng=None):
    """One token id per row of `logits` (B, V): softmax(logits / temperature) over the first
    `vocab_size` columns (a padded vocabulary's never win), restricted to the `top_k` largest."""
    rng = rng or numpy.random.default_rng()
    last = logits[:, :vocab_size] / max(temperature, 1e-6)
    if top_k is not None:
        cut = numpy.sort(last, axis=-1)[:, -min(top_k, last.shape[-1])][:, None]
        last = numpy.where(last < cut, -numpy.inf, last)
    probs = numpy.exp(last - last.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return numpy.array([rng.choice(len(p), p=p) for p in probs])
