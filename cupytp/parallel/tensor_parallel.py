"""One-line tensor parallelism: re-lay a model's parameters onto a mesh by a plan.

`parallelize_module(model, mesh, plan)` takes a plan {module-name pattern: style}; styles are
"colwise" (weight Shard(1), bias Shard(0)), "rowwise" (weight Shard(0)), "vocab" (embedding
Shard(0)), "heads" (fused q|k|v sharded by heads), "replicate", and "auto" for a module that
carries its own plan (DMLP, DAttention). Parameters the plan does not name become Replicated on
the mesh. Each rank keeps its block of the value the parameter already had: no communication
from a dense model, and the parallel model computes exactly what the dense one did.

`apply_tensor_parallel(model, mesh)` builds the Megatron plan by itself: column → row in every
MLP and attention, vocab-parallel embedding for an embedding tied to a DLMHead.
"""
from fnmatch import fnmatchcase

from cupytp import backend
from cupytp.nn.attention import GroupedQueryAttention
from cupytp.nn.layers import DAttention, DLMHead, DMLP, check_heads, tp_dim, tp_placements
from cupytp.nn.swiglu import SwiGLU
from cupytp.tensor import Replicated
from cupytp.tensor.layout import Layout

STYLES = ("colwise", "rowwise", "vocab", "heads", "replicate", "auto")


def relayout(tensor, mesh, placements):
    """Move `tensor` in place to `placements` on `mesh`, keeping its global value."""
    full = tensor.full_tensor()
    layout = Layout(mesh, tensor.shape, placements)
    offsets, local_shape = layout.local_block()
    block = full[tuple(slice(o, o + n) for o, n in zip(offsets, local_shape))]
    tensor._local = backend.xp.array(block, order="C", copy=True)  # a view would keep `full`
    tensor.layout = layout
    tensor.grad = None


def _apply_style(module, name, mesh, style):
    if style not in STYLES:
        raise ValueError(f"plan style {style!r} for {name!r} is not one of {STYLES}")
    if style == "auto":
        if not hasattr(module, "parallel_plan"):
            raise ValueError(f"{name!r} ({type(module).__name__}) has no plan of its own: give "
                             "it a style such as 'colwise' or 'rowwise'")
        for child, child_style in module.parallel_plan().items():
            _apply_style(getattr(module, child), f"{name}.{child}", mesh, child_style)
    else:
        layout = getattr(module, "parallel_layout", None)
        try:
            placements = layout(style) if layout else None
        except KeyError:
            placements = None
        if placements is None:
            raise ValueError(f"{name!r} ({type(module).__name__}) has no {style!r} layout")
        tensors = [module.weight, getattr(module, "bias", None)]
        for tensor, placement in zip(tensors, placements):
            if tensor is not None:
                relayout(tensor, mesh, tp_placements(mesh, placement))
    if isinstance(module, DAttention):
        check_heads(module)
    elif isinstance(module, GroupedQueryAttention):
        module.check_tp(mesh.shape[tp_dim(mesh)])


def parallelize_module(model, mesh, plan):
    """Re-lay `model` onto `mesh` by `plan` ({pattern: style}, patterns as in fnmatch over
    dotted module names). Returns the model."""
    replicated = (Replicated(),) * mesh.ndim
    for _, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        relayout(tensor, mesh, replicated)
    modules = list(model.named_modules())
    for pattern, style in plan.items():
        matched = [(name, module) for name, module in modules if fnmatchcase(name, pattern)]
        if not matched:
            raise ValueError(f"plan entry {pattern!r} matches no module; module names look like "
                             f"{[name for name, _ in modules[1:4]]}")
        for name, module in matched:
            _apply_style(module, name, mesh, style)
    return model


def megatron_plan(model):
    """The plan apply_tensor_parallel uses: every MLP and attention (DMLP, DAttention, SwiGLU,
    GroupedQueryAttention) by its own plan, and vocab-parallel embeddings for those tied to an
    LM head (and an LM head's own weight)."""
    plan = {}
    tied = {id(module._embedding) for _, module in model.named_modules()
            if isinstance(module, DLMHead)}
    for name, module in model.named_modules():
        if isinstance(module, (DMLP, DAttention, SwiGLU, GroupedQueryAttention)):
            plan[name] = "auto"
        elif id(module) in tied:
            plan[name] = "vocab"
    return plan


def apply_tensor_parallel(model, mesh):
    """Megatron-style tensor parallelism for a model built from cupytp.nn, in one call."""
    return parallelize_module(model, mesh, megatron_plan(model))
