"""Pipeline stages: a decoder (embeddings, a list of blocks, a final norm and head) cut into
contiguous runs of blocks, each run a module under the model's own parameter names.

`DecoderParts` says where a model's pieces are and how to call them; a model offers its own
(`GPT2.pipeline_parts()`), so the pipeline knows no model by name. `split_layers` cuts the
blocks into stages, balanced by parameter count (the first stage also holds the embeddings, the
last the norm and head, so they may get fewer blocks) or as given. `PipelineStage` is one
stage: a module whose children mirror the model's tree down to the modules it runs
(`transformer.h.4...`), so its parameters keep the unpipelined names and a checkpoint does not
depend on how the model is cut.
"""
import dataclasses
from typing import Callable

from cupytp.nn.module import Module, ModuleList


@dataclasses.dataclass(frozen=True)
class DecoderParts:
    """A decoder as `pipeline()` cuts it. Module names are dotted paths in the model.

    embed: inputs -> hidden state, run by the first stage; embed_modules: the modules it uses.
    layers: the name of the ModuleList of blocks; run_layer(block, hidden) -> hidden (default:
    block(hidden); a model that recomputes its blocks passes its own). Under context
    parallelism both are called with the tokens' positions as well (embed(inputs, positions),
    run_layer(block, hidden, positions)).
    head: hidden -> outputs (the final norm, the LM head's logits), run by the last stage;
    head_modules: the modules it uses.
    loss: (outputs, targets) -> the mean loss over the targets that count (those other than
    `ignore_index`); the pipeline weighs each micro-batch's by its share of them, so the loss
    of a step is the mean over the whole batch, as without a pipeline.
    tied: parameters of `embed_modules` that `head` uses too (tied embeddings): the last stage
    holds a copy, refreshed from the first stage at every step, whose gradient goes back to it.
    """
    embed: Callable
    embed_modules: tuple
    layers: str
    head: Callable
    head_modules: tuple
    loss: Callable
    tied: tuple = ()
    run_layer: Callable = None
    ignore_index: int = -100


def resolve(model, name):
    """The module (or tensor) at dotted path `name` in `model`; a clear error if none."""
    value = model
    for part in name.split("."):
        child = vars(value).get(part) if isinstance(value, Module) else None
        if child is None:
            raise ValueError(f"{type(model).__name__} has no {name!r} (its pipeline parts name "
                             "a module that is not there)")
        value = child
    return value


def split_layers(costs, stages, first_cost=0, last_cost=0, layers=None):
    """(start, stop) of each stage's blocks. `layers`: blocks per stage, given; else the split of
    blocks costing `costs` into `stages` contiguous runs whose largest cost (the first run
    adding `first_cost`, the last `last_cost`) is least, every stage but the first and last
    holding at least one block."""
    n = len(costs)
    if layers is not None:
        layers = list(layers)
        if len(layers) != stages or sum(layers) != n or any(c < 0 for c in layers):
            raise ValueError(f"layers={layers}: give {stages} block counts (one per stage) that "
                             f"add up to the model's {n} blocks")
        starts = [sum(layers[:i]) for i in range(stages + 1)]
        return list(zip(starts[:-1], starts[1:]))
    if n < max(stages - 2, 1):
        raise ValueError(f"{n} blocks cannot fill {stages} pipeline stages: use fewer stages")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(stage, start, stop):
        extra = (first_cost if stage == 0 else 0) + (last_cost if stage == stages - 1 else 0)
        return prefix[stop] - prefix[start] + extra

    # best[s][i]: the least largest cost of stages 0..s-1 holding blocks 0..i-1
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    choice = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        least = 0 if s in (1, stages) else 1
        for i in range(n + 1):
            for j in range(i - least + 1):
                value = max(best[s - 1][j], cost(s - 1, j, i))
                if value < best[s][i]:
                    best[s][i], choice[s][i] = value, j
    bounds, stop = [], n
    for s in range(stages, 0, -1):
        start = choice[s][stop]
        bounds.append((start, stop))
        stop = start
    return bounds[::-1]


def skeleton(model, names, root=None):
    """`root` (a new Module by default) holding the modules `names` of `model` under the same
    dotted paths, through new containers (a ModuleList where the model has one, so data
    parallelism still finds the blocks); the modules themselves are shared, not copied."""
    root = Module() if root is None else root
    for name in names:
        node, source = root, model
        parts = name.split(".")
        for part in parts[:-1]:
            source = vars(source)[part]
            child = vars(node).get(part)
            if child is None:
                child = ModuleList() if isinstance(source, ModuleList) else Module()
                object.__setattr__(node, part, child)
            node = child
        object.__setattr__(node, parts[-1], vars(source)[parts[-1]])
    return root


def prune(model, keep):
    """Delete from `model`, in place, every module that is neither in `keep` (dotted names) nor
    on the way to one: what other ranks' stages hold is freed here."""
    def visit(module, prefix):
        for name, child in list(module.named_children()):
            full = f"{prefix}.{name}" if prefix else name
            if full in keep:
                continue
            if any(k.startswith(full + ".") for k in keep):
                visit(child, full)
            else:
                object.__delattr__(module, name)
    visit(model, "")


class PipelineStage(Module):
    """Stage `index` of the pipeline: the blocks `start:stop` of the decoder, after its
    embeddings if it is the first stage, before its head if it is the last. `forward(x)` takes
    the first stage's inputs (token ids) or the previous stage's hidden state and returns the
    next stage's input, or the last stage's outputs (logits); `positions`: the tokens'
    positions where the sequence is split over cp (ContextParallel.positions), else None."""

    def __init__(self, model, parts, index, count, start, stop):
        super().__init__()
        object.__setattr__(self, "_parts", parts)
        object.__setattr__(self, "index", index)
        object.__setattr__(self, "is_first", index == 0)
        object.__setattr__(self, "is_last", index == count - 1)
        object.__setattr__(self, "layer_range", (start, stop))
        names = stage_module_names(parts, index, count, start, stop)
        skeleton(model, names, self)
        blocks = resolve(model, parts.layers)
        object.__setattr__(self, "_blocks", [vars(blocks)[str(i)] for i in range(start, stop)])

    def forward(self, x, positions=None):
        parts = self._parts
        at = () if positions is None else (positions,)
        if self.is_first:
            x = parts.embed(x, *at)
        for block in self._blocks:
            x = block(x) if parts.run_layer is None else parts.run_layer(block, x, *at)
        return parts.head(x) if self.is_last else x

    def __repr__(self):
        start, stop = self.layer_range
        return (f"PipelineStage({self.index}: blocks {start}:{stop}"
                f"{', embeddings' if self.is_first else ''}{', head' if self.is_last else ''})")


def stage_module_names(parts, index, count, start, stop):
    """The dotted names of the modules stage `index` of `count` runs."""
    names = list(parts.embed_modules) if index == 0 else []
    names += [f"{parts.layers}.{i}" for i in range(start, stop)]
    if index == count - 1:
        names += [name for name in parts.head_modules if name not in names]
    return names
