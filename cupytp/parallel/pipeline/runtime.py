"""`pipeline()`: a decoder cut into stages along the "pp" mesh dimension, held by a
`Pipeline` module that runs a schedule table micro-batch by micro-batch (`executor`).

Each rank of the pp dimension holds its stages (one, or v for interleaved schedules) as
modules on the rest of the mesh (the stage mesh: tensor parallelism inside a stage, data
parallelism across replicas of the pipeline), under the unpipelined model's names; the rest of
the model is deleted on that rank. The last stage's tied copy of the embedding is not one of its
parameters: it is refreshed from the first stage every step, its gradient sent back.
"""
import numpy

from cupytp import backend
from cupytp.nn.module import Module
from cupytp.parallel.data_parallel import fully_shard, replicate
from cupytp.parallel.pipeline import schedules
from cupytp.parallel.pipeline.executor import StepRun
from cupytp.parallel.pipeline.stages import (
    PipelineStage, prune, resolve, skeleton, split_layers, stage_module_names)
from cupytp.parallel.tensor_parallel import relayout
from cupytp.tensor import DTensor, Replicated, is_deferred, local_mesh, materialize_tensor

DATA_PARALLEL = ("replicate", "fully_shard")


def pipeline(model, mesh, dim="pp", schedule="1f1b", microbatches=1, virtual_stages=None,
             layers=None, data_parallel="replicate", parts=None, reshard_after_forward=False,
             param_dtype=None):
    """Cut `model` into pipeline stages over mesh dimension `dim` and return the `Pipeline`
    holding this rank's stages; the model's other blocks are dropped on this rank.

    `model`: built from cupytp.nn with its parameters on the mesh without `dim` (`mesh["dp",
    "tp"]`, tensor parallelism applied there), or on one rank (then Replicated on it); its
    `pipeline_parts()` (or `parts`, a DecoderParts) says where its embeddings, blocks and head
    are. `schedule`: "gpipe", "1f1b", "interleaved_1f1b" (`virtual_stages` per rank, default 2)
    or "zb_h1", or a Schedule; `microbatches` per step. `layers`: blocks per stage (default:
    balanced by parameter count). `data_parallel` on the mesh's "dp" dimension: "replicate"
    (each stage's gradients all-reduced in buckets by `replicate`) or "fully_shard" (each stage
    sharded by `fully_shard`); either reduces a stage's gradients once per step, in its last
    backward. A fully sharded stage gathers its parameters (in `param_dtype`, default the
    masters') once per step and keeps them until then; `reshard_after_forward=True` frees each
    group after its forward instead (less memory, two all-gathers per group and micro-batch).
    Context parallelism composes: a model whose attention runs as a ring
    (`ContextParallel(stage_mesh).apply(model)` first) gets each micro-batch's sequence in the
    ring's order with its positions, and its gradients summed over "cp" as over "dp"."""
    return Pipeline(model, mesh, dim, schedule, microbatches, virtual_stages, layers,
                    data_parallel, parts, reshard_after_forward, param_dtype)


class Pipeline(Module):
    """This rank's stages of a pipelined model (see `pipeline()`). As a Module it holds them
    under the unpipelined model's names (`named_parameters()`, `state_dict()`: what this rank
    trains and saves). `step(inputs, targets)` runs the schedule: forward and backward of every
    micro-batch, gradients accumulated into the parameters, the batch's mean loss returned on
    every rank. `schedule` is the Schedule table, `stages` this rank's PipelineStages,
    `pp_mesh` the 1-D mesh along the pipeline (for clip_grad_norm_ and GradScaler) and
    `pp_group` its ProcessGroup."""

    def __init__(self, model, mesh, dim, schedule, microbatches, virtual_stages, layers,
                 data_parallel, parts, reshard_after_forward, param_dtype):
        super().__init__()
        if dim not in mesh.dim_names:
            raise ValueError(f"pipeline: mesh {mesh} has no dimension {dim!r}; name the pipeline "
                             f"dimension with dim= (its dimensions: {mesh.dim_names})")
        if data_parallel not in DATA_PARALLEL:
            raise ValueError(f"pipeline: data_parallel={data_parallel!r} is not one of "
                             f"{DATA_PARALLEL}")
        others = [d for d in mesh.dim_names if d != dim]
        if data_parallel == "fully_shard" and "dp" not in others:
            raise ValueError("pipeline: data_parallel='fully_shard' needs a 'dp' mesh dimension")
        if data_parallel != "fully_shard" and (reshard_after_forward or param_dtype is not None):
            raise ValueError("pipeline: reshard_after_forward and param_dtype are for "
                             "data_parallel='fully_shard'")
        parts = parts if parts is not None else _parts_of(model)
        pp = mesh.size(dim)
        if not isinstance(schedule, schedules.Schedule):
            schedule = schedules.make_schedule(schedule, pp, microbatches, virtual_stages)
        elif schedule.pp != pp:
            raise ValueError(f"pipeline: the schedule is for pp={schedule.pp}, the mesh has "
                             f"{pp} ranks along {dim!r}")
        set_ = object.__setattr__
        set_(self, "mesh", mesh)
        set_(self, "stage_mesh", mesh[others] if others else local_mesh())
        set_(self, "pp_group", mesh.get_process_group(dim))
        set_(self, "pp_mesh", mesh[dim])
        set_(self, "pp_rank", mesh.get_local_rank(dim))
        set_(self, "context", _context_of(model, self.stage_mesh))
        set_(self, "schedule", schedule)
        set_(self, "stats", None)
        set_(self, "_parts", parts)
        set_(self, "_shapes", {})           # batch signature -> shapes the stages receive
        bounds = _bounds(model, parts, schedule.stages, layers)
        set_(self, "layer_bounds", tuple(bounds))
        mine = schedule.stages_of(self.pp_rank)
        stages = {s: PipelineStage(model, parts, s, schedule.stages, *bounds[s]) for s in mine}
        tied = [resolve(model, name) for name in parts.tied] if schedule.pp > 1 else []
        keep = [name for s in mine for name in stage_module_names(
            parts, s, schedule.stages, *bounds[s])]
        prune(model, set(keep))
        skeleton(model, keep, self)
        for tensor in list(self.parameters()) + [b for _, b in self.named_buffers()] + tied:
            _to_stage_mesh(tensor, self.stage_mesh)
        holds_tie = self.pp_rank in (0, schedule.rank_of(schedule.stages - 1))
        set_(self, "_tied", [(t, t.placements) for t in tied] if holds_tie else [])
        for stage in stages.values():
            _data_parallel(stage, self.stage_mesh, data_parallel, reshard_after_forward,
                           param_dtype)
        own = {id(p) for p in self.parameters()}
        for tensor, _ in self._tied:    # the last stage's copy, none of its parameters, gets
            if id(tensor) not in own and is_deferred(tensor):   # its values every step: made
                materialize_tensor(tensor, initialize=False)    # here, uninitialized
        set_(self, "stages", [stages[s] for s in mine])
        set_(self, "_stage", stages)

    def forward(self, *args, **kwargs):
        raise TypeError("a Pipeline runs whole steps: call step(inputs, targets), not the model")

    def to(self, dtype):
        """Cast every floating parameter and buffer to `dtype`, in place, and the last stage's
        copy of the tied parameters with them."""
        super().to(dtype)
        own = {id(p) for p in self.parameters()}
        for tensor, _ in self._tied:
            if id(tensor) not in own and tensor.dtype != backend.dtype(dtype):
                tensor._local = tensor._local.astype(backend.dtype(dtype))
        return self

    def __repr__(self):
        return (f"Pipeline({self.schedule.name}, pp={self.schedule.pp}, rank {self.pp_rank}: "
                f"{', '.join(map(repr, self.stages))})")

    # ---- a step -------------------------------------------------------------------------------
    def step(self, inputs, targets=None, measure=None, scaler=None):
        """Run one step of the schedule on the batch `inputs` (token ids (B, T): a NumPy or
        device array, the same on every rank) with `targets` (B, T), and return the batch's
        mean loss, a 0-d DTensor on the stage mesh, on every rank. With gradients enabled every
        parameter's gradient is accumulated (zero them between steps, as usual); inside
        `no_grad()` only the forwards run. `measure`: "ticks" or "time" records the step's
        bubble in `stats` (a PipelineStats). `scaler`: a GradScaler (made with this pipeline's
        pp_mesh) whose scale the last stage's losses are multiplied by before their backward
        (the loss returned is not)."""
        if measure not in (None, "ticks", "time"):
            raise ValueError(f"measure={measure!r} is not None, 'ticks' or 'time'")
        if targets is None:
            raise ValueError("step: the pipeline's last stage needs targets to compute the "
                             "loss")
        inputs, targets = _host_or_device(inputs, "inputs"), _host_or_device(targets, "targets")
        m = self.schedule.microbatches
        if inputs.ndim < 1 or inputs.shape[0] < m or targets.shape[:1] != inputs.shape[:1]:
            raise ValueError(f"step: inputs {tuple(inputs.shape)} and targets "
                             f"{tuple(targets.shape)} must share a batch dimension of at least "
                             f"{m} rows (one per micro-batch)")
        run = StepRun(self, inputs, targets, measure, scaler)
        run.execute()
        return run.loss


# ---- construction helpers ---------------------------------------------------------------------
def _parts_of(model):
    parts = getattr(type(model), "pipeline_parts", None)
    if parts is None:
        raise TypeError(f"pipeline: {type(model).__name__} has no pipeline_parts(); pass "
                        "parts=DecoderParts(...) naming its embeddings, blocks and head")
    return model.pipeline_parts()


def _context_of(model, stage_mesh):
    """The ContextParallel the model's attention runs as a ring on (None without), which must
    split the sequence over the stage mesh."""
    contexts = {id(c): c for c in (getattr(m, "context_parallel", None) for m in model.modules())
                if c is not None}
    if not contexts:
        return None
    if len(contexts) > 1:
        raise ValueError("pipeline: the model's attentions run as rings of different "
                         "ContextParallel objects: apply one to the whole model")
    (context,) = contexts.values()
    if context.mesh != stage_mesh:
        raise ValueError(f"pipeline: the model's ContextParallel splits the sequence over "
                         f"{context.mesh}, not over the stage mesh {stage_mesh} (the mesh "
                         "without the pipeline dimension): make it on that mesh")
    return context


def _bounds(model, parts, stages, layers):
    """(start, stop) of every stage's blocks, after checking that every parameter of the model
    belongs to some stage."""
    def params(names):
        return {id(p): p for name in names for p in resolve(model, name).parameters()}

    blocks = resolve(model, parts.layers)
    tied = {id(t): t for t in (resolve(model, name) for name in parts.tied)}
    head = params(parts.head_modules)
    if set(tied) & set(head) or not set(tied) <= set(params(parts.embed_modules)):
        raise ValueError(f"pipeline: the tied parameters {list(parts.tied)} must belong to the "
                         "embedding modules and be reached by the head only through them")
    bounds = split_layers([sum(p.size for p in b.parameters()) for b in blocks], stages,
                          sum(p.size for p in params(parts.embed_modules).values()),
                          sum(p.size for p in list(head.values()) + list(tied.values())),
                          layers)
    held = set(tied)
    for s, (start, stop) in enumerate(bounds):
        for name in stage_module_names(parts, s, stages, start, stop):
            held.update(id(p) for p in resolve(model, name).parameters())
    missing = [name for name, p in model.named_parameters() if id(p) not in held]
    if missing:
        raise ValueError(f"pipeline: parameters {missing[:4]} belong to no stage: name their "
                         "modules in the pipeline parts (embed_modules or head_modules)")
    return bounds


def _to_stage_mesh(tensor, stage_mesh):
    """Put `tensor` on the stage mesh: as it is when it lives there, Replicated when it lives
    on one rank."""
    if tensor.mesh == stage_mesh:
        return
    if tensor.mesh.size() != 1:
        raise ValueError(f"pipeline: a parameter lives on {tensor.mesh}, not on the stage mesh "
                         f"{stage_mesh} (the mesh without the pipeline dimension): build the "
                         "model on it, or on one rank")
    relayout(tensor, stage_mesh, (Replicated(),) * stage_mesh.ndim)


def _data_parallel(stage, stage_mesh, mode, reshard_after_forward, param_dtype):
    """The one place the pipeline applies data parallelism to a stage, over the stage mesh's
    "dp" and "cp" dimensions where it has them (each holds its own share of the batch's
    tokens): "replicate" (gradients all-reduced in buckets as backward completes them) or
    "fully_shard" (the stage sharded over "dp", its shards' gradients all-reduced over "cp")."""
    summed = tuple(d for d in ("dp", "cp") if d in stage_mesh.dim_names)
    if mode == "fully_shard":
        fully_shard(stage, stage_mesh, dim="dp",
                    replicate_dim=tuple(d for d in summed if d != "dp") or None,
                    reshard_after_forward=reshard_after_forward, param_dtype=param_dtype)
    elif summed:
        replicate(stage, stage_mesh, dim=summed)


def _host_or_device(array, what):
    if isinstance(array, DTensor):
        array = array.full_tensor()
    if isinstance(array, (numpy.ndarray, backend.xp.ndarray)):
        return array
    raise TypeError(f"step: {what} must be a NumPy or device array (or a DTensor), got "
                    f"{type(array).__name__}")
