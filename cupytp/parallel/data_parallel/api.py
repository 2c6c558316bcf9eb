"""Data parallelism in one call: `replicate` (DDP), `fully_shard` (FSDP / ZeRO-3; HSDP with a
replicate dim), both the general `data_parallel`.

Each lays the model's parameters out over the data-parallel mesh dims (Replicated, or
Shard(d) over the shard dim: `plan.shard_dim`), builds the units that move together (buckets
or groups, `plan`), and hands gradient synchronization to a schedule (`schedule`): the model's
class gains `no_sync()` and a one-line summary. Called on a model built inside
`cupytp.deferred_init()`, it only relabels the parameters; `cupytp.materialize(model)` then
allocates each rank's blocks.
"""
from contextlib import contextmanager

from cupytp.distributed import runtime
from cupytp.distributed.device_mesh import DeviceMesh
from cupytp.nn.module import Module
from cupytp.parallel.data_parallel.buffers import Bucket
from cupytp.parallel.data_parallel.plan import (
    DPDims, joint_dims, plan_buckets, plan_groups, shard_dim)
from cupytp.parallel.data_parallel.schedule import FSDPGroup, ReplicateSchedule, ShardSchedule
from cupytp.parallel.tensor_parallel import relayout
from cupytp.tensor import DTensor, Replicated, Shard
from cupytp.tensor.layout import Layout
from cupytp.tensor.redistribute import redistribute_local

BUCKET_BYTES = 25 << 20         # PyTorch DDP's default
GROUP_BYTES = 1 << 20


def data_parallel(model, mesh=None, replicate=None, shard=None, bucket_bytes=BUCKET_BYTES,
                  group_bytes=GROUP_BYTES, reshard_after_forward=True, param_dtype=None,
                  reduce_dtype=None):
    """Make `model` data-parallel over mesh dims `replicate` (a name or names: whole
    parameters, gradients all-reduced in buckets of up to `bucket_bytes`, overlapped with
    backward) and/or `shard` (a name: parameters, gradients and optimizer states sharded, layers
    gathered in groups of up to `group_bytes`); both: HSDP (sharded within a shard group,
    replicated across groups). Returns the model; feed it batches sharded on the dp dims.

    `mesh`: default, one dimension "dp" over every rank (replicated when neither is named). On
    a mesh with a tensor-parallel dim, call it after apply_tensor_parallel. `param_dtype`,
    `reduce_dtype`, `reshard_after_forward`: sharded parameters only (see fully_shard).
    """
    if isinstance(model, DataParallelModule):
        raise ValueError("data_parallel: this model is data-parallel already")
    if mesh is None:
        mesh = DeviceMesh((runtime.get_world_size(),), ("dp",))
    if replicate is None and shard is None:
        replicate = "dp"
    dims = DPDims(mesh, replicate or (), shard)
    if shard is None:
        if param_dtype is not None or reduce_dtype is not None:
            raise ValueError("data_parallel: param_dtype and reduce_dtype are for sharded "
                             "parameters; replicated ones compute in autocast's dtype and "
                             "reduce in their own")
        return _replicated(model, dims, bucket_bytes)
    return _sharded(model, dims, group_bytes, reshard_after_forward, param_dtype, reduce_dtype)


def replicate(model, mesh=None, dim="dp", bucket_bytes=BUCKET_BYTES):
    """Replicated data parallelism (PyTorch DDP) over mesh dim `dim`: every rank holds whole
    parameters; gradients are all-reduced in place, in buckets of up to `bucket_bytes`, each as
    soon as backward has finished it (overlapping the rest of backward). Tied parameters are
    reduced once. Returns the model."""
    return data_parallel(model, mesh, replicate=dim, bucket_bytes=bucket_bytes)


def fully_shard(model, mesh=None, dim="dp", replicate_dim=None, group_bytes=GROUP_BYTES,
                reshard_after_forward=True, param_dtype=None, reduce_dtype=None):
    """Shard `model`'s parameters over mesh dimension `dim` (ZeRO-3) and return the model.

    `mesh`: default, one dimension named `dim` over every rank. On a 2-D (dp, tp) mesh call it
    after apply_tensor_parallel(model, mesh). `replicate_dim`: a mesh dimension (or several)
    to replicate over as well (HSDP: the shards' gradients all-reduced there). `group_bytes`:
    layers are packed into groups of up to this many parameter bytes (0: one group per layer).
    `param_dtype`: the dtype of the gathered parameters ("bf16" for mixed precision; default
    the masters'). `reduce_dtype`: the dtype gradients are reduced in (default the masters',
    fp32 for fp32 masters). Feed it batches sharded on the dp dims (Shard(0)).
    """
    if mesh is None and not isinstance(model, DataParallelModule):
        mesh = DeviceMesh((runtime.get_world_size(),), (dim,))
    return data_parallel(model, mesh, replicate=replicate_dim, shard=dim,
                         group_bytes=group_bytes, reshard_after_forward=reshard_after_forward,
                         param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def as_distributed(self, **options):
    """Fully shard this model over every rank of the job (after cupytp.init()): one line
    instead of per-layer wrapping. `options` go to cupytp.parallel.fully_shard."""
    return fully_shard(self, **options)


class DataParallelModule:
    """Mixed into a data-parallel model's class: `no_sync()` and the schedule."""

    @property
    def dp_schedule(self):
        """The schedule that synchronizes this model's gradients."""
        return self._dp

    @contextmanager
    def no_sync(self):
        """Backward passes inside sum the gradients without communication; the first backward
        after it reduces them (gradient accumulation)."""
        schedule = self._dp
        previous = schedule.sync
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(previous)

    def set_requires_gradient_sync(self, sync):
        """Whether the backward passes from now on reduce the gradients (FSDP2's name). False:
        they only sum them on each rank, as inside `no_sync()`; the first backward with True
        reduces everything summed since."""
        self._dp.sync = bool(sync)

    def finish_gradient_sync(self):
        """Reduce now what backward passes summed without reducing and none has reduced since
        (nothing if nothing is left); a fully sharded model also frees its gathered parameters
        (unless `set_reshard_after_backward(False)`). For a backward pass that may give this
        model no gradient, as a pipeline stage's last one can: a pass that gives it one
        reduces by itself."""
        self._dp.finish()

    def dp_summary(self):
        """One line: the dims, the units that move together, the collectives of one step."""
        schedule = self._dp
        if isinstance(schedule, ReplicateSchedule):
            nbytes = max(b.nbytes for b in schedule.buckets) if schedule.buckets else 0
            return (f"data parallel ({schedule.dims.describe()}): "
                    f"{sum(len(b.params) for b in schedule.buckets)} parameters in "
                    f"{len(schedule.buckets)} buckets of up to {nbytes / 2**20:.2f} MiB; per "
                    f"step {len(schedule.buckets)} all-reduces")
        return self.fsdp_summary()


class FSDPModule(DataParallelModule):
    """Mixed into a fully sharded model's class: the groups, full and sharded state."""

    @property
    def fsdp_groups(self):
        """The groups, root first, each an FSDPGroup (names of its layers, its parameters)."""
        return list(self._dp.groups)

    def set_reshard_after_forward(self, reshard):
        """Whether a group's full parameters are freed after its layers' forward (and gathered
        again for their backward), or kept until its backward; the root group is always kept."""
        self._dp.reshard_after_forward = bool(reshard)

    def set_reshard_after_backward(self, reshard):
        """Whether a group's full parameters are freed once its gradients are in (FSDP2's name).
        False: they stay gathered, and later forward and backward passes (the next
        micro-batches) reuse them without gathering again, until a backward with True ends.
        The masters must not change meanwhile (no optimizer step)."""
        self._dp.reshard_after_backward = bool(reshard)

    def fsdp_summary(self):
        """One line: layers → groups, and the collectives of one training step."""
        state = self._dp
        layer_count = sum(len(g.names) for g in state.groups[1:])
        gathers = sum(1 for g in state.groups if g.sharded)
        regathers = sum(1 for g in state.groups[1:] if g.sharded) \
            if state.reshard_after_forward else 0
        reductions = sum(bool(g.sharded) + bool(g.replicated) for g in state.groups)
        replicas = sum(1 for g in state.groups if g.sharded) if state.dims.replicate else 0
        return (f"fully_shard over {state.dims.describe()}: {layer_count} layers -> "
                f"{len(state.groups) - 1} groups + root ({len(state.groups[0].slots)} "
                f"parameters); per step {gathers + regathers} all-gathers, {reductions} "
                f"reductions" + (f", {replicas} replica all-reduces" if replicas else ""))

    def state_dict(self):
        """{name: DTensor}: the parameters gathered over the shard dimension (full, or this
        rank's tensor-parallel block) and the buffers."""
        dim = self._dp.dims.shard
        result = Module.sharded_state_dict(self)
        for name, tensor in result.items():
            if tensor.placements[dim].is_shard():
                placements = list(tensor.placements)
                placements[dim] = Replicated()
                local, layout = redistribute_local(tensor.to_local(), tensor.layout,
                                                   tuple(placements))
                result[name] = DTensor._make(local, layout)
        return result

    def fsdp_memory(self, optimizer=None):
        """Bytes this rank holds, by the framework's accounting: parameter shards, gradients,
        the optimizer's states, and full parameters gathered now."""
        params = self.parameters()
        states = [] if optimizer is None else [
            t for p in params for t in optimizer.state.get(p, {}).values()]
        return {
            "parameters": sum(p.to_local().nbytes for p in params),
            "gradients": sum(p.grad.to_local().nbytes for p in params if p.grad is not None),
            "optimizer": sum(t.to_local().nbytes for t in states),
            "gathered": sum(a.nbytes for g in self._dp.groups if g.full for a in g.full),
        }


# ---- laying parameters out -----------------------------------------------------------------------
def _placements_on(tensor, dims, what):
    """`tensor`'s placements on the data-parallel mesh (all Replicated if it is dense), checked
    Replicated along the dp dims."""
    mesh = dims.mesh
    if tensor.mesh == mesh:
        placements = list(tensor.placements)
    elif tensor.mesh.size() == 1:
        placements = [Replicated()] * mesh.ndim
    else:
        raise ValueError(f"{what}: a parameter lives on {tensor.mesh}, not on {mesh}: apply "
                         "tensor parallelism on the same mesh first")
    for d in dims.all:
        if not placements[d].is_replicated():
            raise ValueError(f"{what}: a parameter is already {placements[d]} on mesh "
                             f"dimension {mesh.dim_names[d]!r}; it must be Replicated there")
    return placements


def _onto_mesh(model, dims, what, layout_of):
    """Every parameter relaid by `layout_of(tensor, placements)`, every buffer Replicated on the
    mesh (a deferred model is only relabelled)."""
    for p in model.parameters():
        placements = layout_of(p, _placements_on(p, dims, what))
        if p.mesh != dims.mesh or tuple(placements) != p.placements:
            relayout(p, dims.mesh, tuple(placements))
    for _, tensor in model.named_buffers():
        if tensor.mesh != dims.mesh:
            relayout(tensor, dims.mesh, (Replicated(),) * dims.mesh.ndim)


def _replicated(model, dims, bucket_bytes):
    _onto_mesh(model, dims, "replicate", lambda p, placements: placements)
    params = [p for p in model.parameters() if p.requires_grad]
    joint = {id(p): joint_dims(p, dims) for p in params}
    planned = plan_buckets(params, bucket_bytes, kind=lambda p: joint[id(p)])
    buckets = [Bucket(i, ps) for i, ps in enumerate(planned)]
    object.__setattr__(model, "_dp", ReplicateSchedule(dims, buckets,
                                                       [joint[id(ps[0])] for ps in planned]))
    model.__class__ = type(f"Replicate{type(model).__name__}", (DataParallelModule,
                                                                  type(model)), {})
    return model


def _sharded(model, dims, group_bytes, reshard_after_forward, param_dtype, reduce_dtype):
    def sharded(p, placements):
        dim = shard_dim(Layout(dims.mesh, p.shape, placements), dims.shard)
        if dim is not None:
            placements[dims.shard] = Shard(dim)
        return placements

    state = ShardSchedule(dims, param_dtype, reduce_dtype, reshard_after_forward)
    places = _places(model)
    plan = plan_groups(model, group_bytes)
    _onto_mesh(model, dims, "fully_shard", sharded)
    owned, members = set(), []
    for group in plan:
        params = [p for _, layer in group for p in layer.parameters() if id(p) not in owned]
        owned.update(id(p) for p in params)
        members.append(([name for name, _ in group], [layer for _, layer in group], params))
    rest = [p for p in model.parameters() if id(p) not in owned]
    members.insert(0, ([""], [model], rest))
    for names, modules, params in members:
        state.groups.append(FSDPGroup(state, names, modules,
                                      [(p, places[id(p)]) for p in params]))
    for group in state.groups:
        for module in group.modules:
            _wrap_forward(state, group, module)
    object.__setattr__(model, "_dp", state)
    model.__class__ = type(f"FullyShard{type(model).__name__}", (FSDPModule, type(model)), {})
    return model


def _places(model):
    """{id(parameter): [(module, attribute)]}: every module attribute that holds a parameter."""
    places = {}
    for _, module in model.named_modules():
        for name, value in module._own():
            if isinstance(value, DTensor):
                places.setdefault(id(value), []).append((module, name))
    return places


def _wrap_forward(state, group, module):
    forward = module.forward

    def run(*args, **kwargs):
        state.enter(group, module, args, kwargs)
        out = None
        try:
            out = forward(*args, **kwargs)
        finally:
            out = state.leave(group, module, out)
        return out
    object.__setattr__(module, "forward", run)
