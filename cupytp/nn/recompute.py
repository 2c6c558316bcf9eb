"""Activation recomputation: run a piece of the forward pass without keeping its activations,
and run it again in the backward pass to get its gradients.

`recompute(fn, *inputs)` returns `fn(*inputs)` (one DTensor) computed without recording; one
node keeps only the inputs. Its backward reruns `fn` on detached copies of the inputs with
gradients on, from the random generator's state of the first run (`Generator.replaying`: its
offset and the micro-batch it drew for, so dropout draws the same masks, wherever the backward
runs), and walks that small graph at once: parameters get their gradients there, the inputs'
are handed on. The memory of a transformer block's activations becomes that of its input,
for about one more forward pass of compute. Collectives inside `fn` run again in the
recomputation, in the same order on every rank. The rerun is in the autocast region of the first
run (a backward pass usually runs outside any).
"""
from cupytp.autograd import engine
from cupytp.ops.amp import autocast, autocast_dtype
from cupytp.tensor import DTensor
from cupytp.tensor.random import default_generator


def recompute(fn, *inputs, generator=None):
    """`fn(*inputs)` whose activations are recomputed in backward instead of kept."""
    tensors = [x for x in inputs if isinstance(x, DTensor)]
    if not engine.is_grad_enabled() or not any(x.requires_grad for x in tensors):
        return fn(*inputs)
    generator = generator or default_generator
    state, dtype = generator.snapshot(), autocast_dtype()
    with engine.no_grad():
        out = fn(*inputs)
    if not isinstance(out, DTensor):
        raise TypeError(f"recompute: {getattr(fn, '__name__', type(fn).__name__)} must return "
                        f"one DTensor, got {type(out).__name__}")

    def backward(g):
        detached = [_detached(x) for x in inputs]
        with generator.replaying(state), engine.enable_grad(), autocast(dtype):
            again = fn(*detached)
        engine.backward_within(again, g)
        return tuple(x.grad if isinstance(x, DTensor) and x.requires_grad else None
                     for x in detached if isinstance(x, DTensor))
    return engine.record(out, tensors, backward, "recompute")


def _detached(x):
    """A leaf sharing x's values that collects its own gradient (x itself if not a DTensor)."""
    if not isinstance(x, DTensor):
        return x
    leaf = x.detach()
    leaf.requires_grad = x.requires_grad
    return leaf
