"""One-line tensor parallelism: re-lay a model's parameters onto a mesh by a plan.

`parallelize_module(model, mesh, plan)` takes a plan {module-name pattern: style}; styles are
"colwise" (weight Shard(1), bias Shard(0)), "rowwise" (weight Shard(0)), "vocab" (embedding
Shard(0)), "heads" (fused q|k|v sharded by heads), "replicate", and "auto" for a module that
carries its own plan (DMLP, DAttention). Parameters the plan does not name become Replicated on
the mesh. Each rank keeps its block of the value the parameter already had: no communication
from a dense model, and the parallel model computes exactly what the dense one did. A model
built inside `cupytp.deferred_init()` is only relabelled (nothing is allocated): materialized
afterwards, each rank makes only its own blocks.

`apply_tensor_parallel(model, mesh)` builds the Megatron plan by itself: column → row in every
MLP and attention, vocab-parallel embedding for an embedding tied to a DLMHead or built as a
token embedding (`DEmbedding(..., vocab_parallel=True)`).

Sequence parallelism (`sequence_parallel=True`, Megatron's, arXiv 2205.05198): between the
tensor-parallel regions the activations (B, T, C) are Shard(1) along tp instead of Replicated,
so norms, dropout and the residual stream hold T/tp tokens per rank. The plan only starts that
stream: the vocab-parallel embeddings reduce-scatter their output on the sequence. The rest is
the layout rules: a column-parallel product all-gathers its sequence-sharded input (its
gradient reduce-scattered back), a row-parallel output is reduce-scattered into the
sequence-sharded residual (Partial → Shard), and a norm's weight gradient, Partial along tp,
is all-reduced there (every plan marks the parameters Replicated along tp: `reduce_grad_over`;
so are those of key/value heads kept whole on every rank): at the end of the backward pass,
all of them in one flat all-reduce, or, under replicated data parallelism, in its buckets,
reduced over tp and dp together. The same bytes move as without it.
"""
from fnmatch import fnmatchcase

from cupytp import backend
from cupytp.nn.attention import GroupedQueryAttention
from cupytp.nn.layers import (
    DAttention, DEmbedding, DLMHead, DMLP, check_heads, tp_dim, tp_placements)
from cupytp.nn.swiglu import SwiGLU
from cupytp.tensor import Replicated, deferred
from cupytp.tensor.dtensor import reduce_grad_over
from cupytp.tensor.layout import Layout

STYLES = ("colwise", "rowwise", "vocab", "heads", "replicate", "auto")


def relayout(tensor, mesh, placements):
    """Move `tensor` in place to `placements` on `mesh`, keeping its global value (a deferred
    tensor is relabelled: no data exists to move)."""
    layout = Layout(mesh, tensor.shape, placements)
    tensor.grad = None
    if deferred.is_deferred(tensor):
        deferred.relabel(tensor, layout)
        return
    full = tensor.full_tensor()
    offsets, local_shape = layout.local_block()
    block = full[tuple(slice(o, o + n) for o, n in zip(offsets, local_shape))]
    tensor._local = backend.xp.array(block, order="C", copy=True)  # a view would keep `full`
    tensor.layout = layout


def _apply_style(module, name, mesh, style, sequence_parallel=False, nested=False):
    """Lay `module` out by `style`; returns the ids of the tensors kept whole ("replicate") by
    the plan of a module split by its own ("auto": `nested` children): their gradients are
    Partial along tp (each rank's share: key/value heads kept whole)."""
    if style not in STYLES:
        raise ValueError(f"plan style {style!r} for {name!r} is not one of {STYLES}")
    if style == "auto":
        if not hasattr(module, "parallel_plan"):
            raise ValueError(f"{name!r} ({type(module).__name__}) has no plan of its own: give "
                             "it a style such as 'colwise' or 'rowwise'")
        whole = set()
        for child, child_style in module.parallel_plan().items():
            whole |= _apply_style(getattr(module, child), f"{name}.{child}", mesh, child_style,
                                  sequence_parallel, nested=True)
    else:
        layout = getattr(module, "parallel_layout", None)
        try:
            placements = layout(style) if layout else None
        except KeyError:
            placements = None
        if placements is None:
            raise ValueError(f"{name!r} ({type(module).__name__}) has no {style!r} layout")
        tensors = [t for t in (module.weight, getattr(module, "bias", None)) if t is not None]
        for tensor, placement in zip(tensors, placements):
            relayout(tensor, mesh, tp_placements(mesh, placement))
        whole = {id(t) for t in tensors} if style == "replicate" and nested else set()
        if style == "vocab":
            module.sequence_parallel = sequence_parallel
    if isinstance(module, DAttention):
        check_heads(module)
    elif isinstance(module, GroupedQueryAttention):
        module.check_tp(mesh.shape[tp_dim(mesh)])
    return whole


def parallelize_module(model, mesh, plan, sequence_parallel=False):
    """Re-lay `model` onto `mesh` by `plan` ({pattern: style}, patterns as in fnmatch over
    dotted module names). `sequence_parallel`: the "vocab" embeddings start a residual stream
    sharded on the sequence along tp (module docstring). Returns the model."""
    replicated = (Replicated(),) * mesh.ndim
    for _, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        relayout(tensor, mesh, replicated)
    modules = list(model.named_modules())
    whole = set()                   # kept whole inside a split layer
    for pattern, style in plan.items():
        matched = [(name, module) for name, module in modules if fnmatchcase(name, pattern)]
        if not matched:
            raise ValueError(f"plan entry {pattern!r} matches no module; module names look like "
                             f"{[name for name, _ in modules[1:4]]}")
        for name, module in matched:
            whole |= _apply_style(module, name, mesh, style, sequence_parallel)
    tp = tp_dim(mesh)           # a parameter replicated along tp may meet activations split
    for p in model.parameters():    # there (sequence parallelism; key/value heads kept whole):
        if p.placements[tp].is_replicated():    # its Partial gradient is TP's to reduce
            reduce_grad_over(p, (tp,), partial=sequence_parallel or id(p) in whole)
    return model


def megatron_plan(model):
    """The plan apply_tensor_parallel uses: every MLP and attention (DMLP, DAttention, SwiGLU,
    GroupedQueryAttention) by its own plan, and vocab-parallel embeddings for those tied to an
    LM head (and an LM head's own weight) and for token embeddings built `vocab_parallel` (an
    untied Llama's input embedding)."""
    plan = {}
    tied = {id(module._embedding) for _, module in model.named_modules()
            if isinstance(module, DLMHead)}
    for name, module in model.named_modules():
        if isinstance(module, (DMLP, DAttention, SwiGLU, GroupedQueryAttention)):
            plan[name] = "auto"
        elif id(module) in tied or (isinstance(module, DEmbedding) and module.vocab_parallel):
            plan[name] = "vocab"
    return plan


def apply_tensor_parallel(model, mesh, sequence_parallel=False):
    """Megatron-style tensor parallelism for a model built from cupytp.nn, in one call; with
    `sequence_parallel`, the activations between its regions sharded on the sequence along tp."""
    return parallelize_module(model, mesh, megatron_plan(model), sequence_parallel)
