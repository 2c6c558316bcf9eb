"""Fully sharded data parallelism (ZeRO-3): every rank keeps only its shard of each parameter,
of its gradient and of its optimizer state; full parameters exist only while their layers run.

Layout: a parameter's master is Shard(d) on the data-parallel mesh dimension ("dp") (uneven
sizes by array_split), composed with its tensor-parallel placement on "tp": d the outermost
dimension of the local block when every dp rank gets rows of it (each shard is then one
contiguous piece of the block), else the largest one no other mesh dimension shards. Gradients
and optimizer states are laid out like it, so optimizers and clip_grad_norm_ run on the shards
unchanged. A 1-D parameter that tensor
parallelism already splits has no free dimension: it stays Replicated on "dp" and its gradient
is all-reduced.

Groups (the parameter analyzer, `plan_groups`): the layers are the elements of the model's
ModuleLists (Sequential included); consecutive layers are packed into one group up to
`group_bytes` of parameters, a larger layer is a group of its own, and everything outside the
layers forms the root group (embeddings, final norm, a tied head). Each group moves its
parameters in one collective from one flat buffer: every rank's row holds its shard of each
parameter at the same offset (padded to the longest shard).

One step, per group:
- forward: all-gather (shards → full, cast to `param_dtype`) before its first layer runs, the
  next group's all-gather issued asynchronously at the same time (prefetch); the full
  parameters are freed after its last layer (`reshard_after_forward`; the root group stays);
- backward: gathered again when the gradient reaches the group's output (the previous group's
  gather prefetched), and once every parameter of the group has its gradient, one async
  reduce-scatter of the flat gradient in `reduce_dtype` (its result waited for when the next
  group reduces, so it overlaps that group's backward) into each shard's `.grad`.
Inside `no_sync()` the flat gradient is kept and summed instead, and reduced on the first
backward outside it. Every collective goes through `redistribute` (on the NCCL backend async
ones run on the communication stream, ordered by events); nothing waits on the host, so a step
can be captured by `cupytp.cuda_graph`.
"""
import itertools
import weakref
from contextlib import contextmanager

import numpy

from cupytp import backend
from cupytp.autograd import engine
from cupytp.distributed import runtime
from cupytp.distributed.device_mesh import DeviceMesh
from cupytp.launchers import cast
from cupytp.nn.module import Module, ModuleList
from cupytp.parallel.tensor_parallel import relayout
from cupytp.tensor import DTensor, Partial, Replicated, Shard
from cupytp.tensor.layout import Layout
from cupytp.tensor.redistribute import grad_placements, redistribute_local


# ---- the parameter analyzer -----------------------------------------------------------------------
def layers(module, prefix=""):
    """(name, module) of the layers of `module`: the elements of its ModuleLists (Sequential
    included; a list inside a list is looked into), in definition order. The module itself
    may be one."""
    for name, child in module.named_children():
        full = f"{prefix}.{name}" if prefix else name
        if isinstance(module, ModuleList) and not isinstance(child, ModuleList):
            yield full, child
        else:
            yield from layers(child, full)


def plan_groups(model, group_bytes):
    """Consecutive layers packed up to `group_bytes` of parameters each (a larger layer alone):
    a list of groups, each a list of (name, layer) with parameters. A parameter belongs to the
    first layer that holds it (tied weights once)."""
    if group_bytes < 0:
        raise ValueError(f"group_bytes must be >= 0, got {group_bytes}")
    groups, current, size, seen = [], [], 0, set()
    for name, layer in layers(model):
        params = [p for p in layer.parameters() if id(p) not in seen]
        if not params:
            continue
        seen.update(id(p) for p in params)
        nbytes = sum(p.to_local().nbytes for p in params)   # dense: the whole parameter
        if current and size + nbytes > group_bytes:
            groups.append(current)
            current, size = [], 0
        current.append((name, layer))
        size += nbytes
    if current:
        groups.append(current)
    return groups


# ---- one parameter in a group -------------------------------------------------------------------
class _Slot:
    """A parameter of a group: its master (this rank's shard), the modules' attributes that hold
    it, the layout of its gathered value (Replicated on dp), the tensor dim dp splits (None:
    Replicated on dp) with every dp rank's shard shape, and its offset in the group's rows."""

    def __init__(self, master, places, dp, offset):
        self.master, self.places = master, places
        layout = master.layout
        self.full_layout = layout.with_placements(tuple(
            Replicated() if d == dp else p for d, p in enumerate(layout.placements)))
        self.dim = layout.placements[dp].dim if layout.placements[dp].is_shard() else None
        coordinate = list(layout.mesh.get_coordinate())
        self.shapes = []
        for rank in range(layout.mesh.shape[dp]):
            coordinate[dp] = rank
            self.shapes.append(layout.local_block(coordinate)[1])
        self.sizes = [int(numpy.prod(s, dtype=numpy.int64)) for s in self.shapes]
        self.width = max(self.sizes) if self.dim is not None else self.sizes[0]
        self.offset = offset
        self.contiguous = (self.dim is not None and len(set(self.sizes)) == 1 and
                           all(n == 1 for n in self.full_layout.local_shape[:self.dim]))

    def split(self, full):
        """`full` (the gathered local block) cut along dim into every dp rank's shard."""
        starts = numpy.cumsum([0] + [s[self.dim] for s in self.shapes])
        index = [slice(None)] * full.ndim
        for a, b in zip(starts[:-1], starts[1:]):
            index[self.dim] = slice(a, b)
            yield full[tuple(index)]

    def join(self, rows):
        """The full local block from `rows` ([dp, width]: every rank's shard at this offset)."""
        xp = backend.xp
        if self.contiguous:     # rank r's shard is the r-th piece of the block
            full = xp.empty(self.full_layout.local_shape, rows.dtype)
            backend.copy_rows(full.reshape(len(self.sizes), -1),
                              rows[:, self.offset:self.offset + self.sizes[0]])
            return full
        if len(set(self.sizes)) == 1:
            block = rows[:, self.offset:self.offset + self.sizes[0]]
            block = block.reshape((len(self.sizes),) + self.shapes[0])
            return xp.moveaxis(block, 0, self.dim).reshape(self.full_layout.local_shape)
        return xp.concatenate([rows[r, self.offset:self.offset + n].reshape(shape)
                               for r, (n, shape) in enumerate(zip(self.sizes, self.shapes))],
                              axis=self.dim)


def _dp_shard_dim(layout, dp):
    """The tensor dimension dp splits: among those no other mesh dimension of more than one
    rank shards, the outermost of the local block's leading dimensions when it has a row for
    every dp rank (each shard is then one contiguous piece of the full block: gathered rows
    become full parameters by one strided copy), else the largest; None if none is free."""
    taken = {p.dim for d, p in enumerate(layout.placements)
             if d != dp and p.is_shard() and layout.mesh.shape[d] > 1}
    free = [d for d in range(len(layout.shape)) if d not in taken]
    if not free:
        return None
    local = layout.local_shape
    leading = next(d for d in range(len(local) + 1) if d == len(local) or local[d] > 1)
    if leading in free and local[leading] >= layout.mesh.shape[dp]:
        return leading
    return max(free, key=lambda d: (layout.shape[d], -d))


# ---- a group ------------------------------------------------------------------------------------
class FSDPGroup:
    """Parameters gathered with one all-gather and reduced with one reduce-scatter.

    `names`: its layers ("" for the root group); `slots`: its parameters. State: `full` (the
    gathered local arrays, or None when resharded), `pending` (an all-gather in flight), the
    gathered views handed to the layers (`_views`: weak references to each view and to its
    autograd node, until its gradient is in: the tape keeps the node, not the view, so a live
    node is a gradient still to come), the gradients received (`_held`) and the flat gradient
    they are folded into (`_rows`, `_replicated`).
    """

    def __init__(self, state, names, modules, masters):
        self.state, self.names, self.modules = state, names, modules
        dp = state.dp
        self.slots, self.sharded, self.replicated = [], [], []
        width = {True: 0, False: 0}
        for master, places in masters:
            sharded = master.placements[dp].is_shard()
            slot = _Slot(master, places, dp, width[sharded])
            width[sharded] += slot.width
            (self.sharded if sharded else self.replicated).append(slot)
        self.slots = self.sharded + self.replicated
        self.width, self.replicated_width = width[True], width[False]
        dtypes = {s.master.dtype for s in self.slots}
        if len(dtypes) > 1:
            raise ValueError(f"fully_shard: the parameters of group {names} have dtypes "
                             f"{sorted(str(d) for d in dtypes)}: cast the model to one dtype "
                             "first (model.to(...))")
        master_dtype = dtypes.pop() if dtypes else None     # a root group may be empty
        self.param_dtype = backend.dtype(state.param_dtype or master_dtype or "fp32")
        self.reduce_dtype = backend.dtype(state.reduce_dtype or master_dtype or "fp32")
        for index, slot in enumerate(self.slots):
            slot.index = index
        self.places = {id(m): _member_places(m, self.slots, names == [""]) for m in modules}
        self.full = None
        self.pending = None
        self.forward_views = None   # the views handed to the layers of the forward running
        self._views = {}            # key -> (view ref, node ref, slot index): grads to come
        self._keys = itertools.count()
        self._held = {}             # slot index -> [full gradients not yet folded]
        self._rows = None           # [dp, width] flat gradient (reduce dtype)
        self._replicated = None     # [replicated_width] flat gradient of dp-replicated slots
        self._received = False

    def __repr__(self):
        what = ", ".join(self.names) if self.names != [""] else "root"
        return (f"FSDPGroup({what}: {len(self.slots)} parameters, "
                f"{self.nbytes() / 2**20:.2f} MiB)")

    def nbytes(self):
        """Bytes of the group's full parameters (masters' dtype)."""
        return sum(s.master.size * s.master.dtype.itemsize for s in self.slots)

    # ---- gathering ------------------------------------------------------------------------------
    def prefetch(self):
        """Start the all-gather of the full parameters (async) unless they are here or coming."""
        if self.full is not None or self.pending is not None or not self.width:
            return
        row = backend.xp.empty(self.width, dtype=self.param_dtype)
        for s in self.sharded:      # cast-copied in place; the padding of a shorter shard zeroed
            local = s.master.to_local()
            cast.assign(row[s.offset:s.offset + local.size], local.reshape(-1), add=False)
            if local.size < s.width:
                row[s.offset + local.size:s.offset + s.width] = 0
        layout = Layout(self.state.dp_mesh, (self.state.dp_size * self.width,), (Shard(0),))
        self.pending, _ = redistribute_local(row, layout, (Replicated(),), async_op=True)

    def unshard(self):
        """The full parameters, gathered now if not already; gathered views of this group that
        autograd still holds get them back (their memory was freed after the forward)."""
        if self.full is None:
            self.prefetch()
            full = []
            if self.sharded:
                rows = self.pending.wait().reshape(self.state.dp_size, self.width)
                full = [s.join(rows) for s in self.sharded]
            self.pending = None
            self.full = full + [cast.converted(s.master.to_local(), self.param_dtype)
                                for s in self.replicated]
            for ref, _, index in self._views.values():
                view = ref()
                if view is not None:
                    view._local = self.full[index]
        return self.full

    def reshard(self):
        """Free the full parameters (the views autograd holds keep no memory)."""
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
        self.full = None
        for ref, _, _ in self._views.values():
            view = ref()
            if view is not None:
                view._local = None

    def views(self, anchor):
        """Gathered DTensors of the parameters for one forward. Each is recorded as computed from
        its master and from `anchor` (the group's input: so backward reaches it before any
        earlier layer); its gradient goes to `collect`, not to the master."""
        full = self.unshard()
        views = []
        for slot, local in zip(self.slots, full):
            view = DTensor._make(local, slot.full_layout)
            if slot.master.requires_grad:
                inputs = (slot.master,) if anchor is None else (slot.master, anchor)
                key = next(self._keys)
                engine.record(view, inputs, self._grad_fn(slot, key, len(inputs)),
                              "fsdp_all_gather")
                if view._node is not None:
                    self._views[key] = (weakref.ref(view), weakref.ref(view._node), slot.index)
            views.append(view)
        return views

    def _grad_fn(self, slot, key, inputs):
        def backward(g):
            self.collect(slot, key, g)
            return (None,) * inputs
        return backward

    # ---- gradients ------------------------------------------------------------------------------
    def collect(self, slot, key, g):
        """Keep the full gradient `g` of view `key` (in its own dtype: a group whose gradients
        arrive far apart, like the root's head and embedding, holds no reduce-dtype buffer in
        between); once every live view of the group has its gradient, fold and reduce them."""
        self.state.queue_flush()
        dp = self.state.dp
        target = list(grad_placements(slot.full_layout.placements))
        target[dp] = g.placements[dp] if not g.placements[dp].is_shard() else Replicated()
        local = g.to_local()
        if tuple(target) != g.placements:
            local, _ = redistribute_local(local, g.layout, tuple(target))
        # a Replicated gradient counts once: the reduction sums over dp
        if target[dp].is_partial() or self.state.dp_rank == 0:
            self._held.setdefault(slot.index, []).append(local)
        self._received = True
        self._views.pop(key, None)
        for dead in [k for k, (_, node, _) in self._views.items() if node() is None]:
            del self._views[dead]
        if not self._views:
            self.finish_backward()

    def fold(self):
        """Add the gradients held into the flat gradient (`_rows` [dp, width], `_replicated`;
        reduce dtype), each with one cast-copy or in-place add: made on the first fold of an
        accumulation, with the regions of slots that got no gradient and the padding of uneven
        shards zeroed, and summed into by the folds of later micro-batches (no_sync)."""
        xp, dp_size = backend.xp, self.state.dp_size
        fresh = self._rows is None and self._replicated is None
        if fresh:
            if self.width:
                self._rows = xp.empty((dp_size, self.width), self.reduce_dtype)
            if self.replicated_width:
                self._replicated = xp.empty(self.replicated_width, self.reduce_dtype)
        for slot in self.slots:
            parts = self._held.pop(slot.index, [])
            if fresh and not parts:
                self._region(slot)[...] = 0
                continue
            for i, local in enumerate(parts):
                self._write(slot, local, add=i > 0 or not fresh)
            if fresh and slot.dim is not None and len(set(slot.sizes)) > 1:
                for r, n in enumerate(slot.sizes):      # the padding past a shorter shard
                    if n < slot.width:
                        self._rows[r, slot.offset + n:slot.offset + slot.width] = 0

    def _region(self, slot):
        if slot.dim is None:
            return self._replicated[slot.offset:slot.offset + slot.sizes[0]]
        return self._rows[:, slot.offset:slot.offset + slot.width]

    def _write(self, slot, local, add):
        """Store (or add) the full gradient `local` in the slot's place of the flat gradient:
        rank r's shard in row r."""
        if slot.dim is None:
            targets = [(self._region(slot), local.reshape(-1))]
        elif len(set(slot.sizes)) == 1:
            n, shape = slot.sizes[0], local.shape
            split = local.reshape(shape[:slot.dim] + (len(slot.sizes), shape[slot.dim] //
                                                      len(slot.sizes)) + shape[slot.dim + 1:])
            targets = [(self._rows[:, slot.offset:slot.offset + n],
                        backend.xp.moveaxis(split, slot.dim, 0).reshape(len(slot.sizes), n))]
        else:
            targets = [(self._rows[r, slot.offset:slot.offset + chunk.size], chunk.reshape(-1))
                       for r, chunk in enumerate(slot.split(local))]
        for target, value in targets:
            cast.assign(target, value, add)

    def finish_backward(self):
        """This group's gradients are in: fold them, reduce (unless inside no_sync), free the
        full parameters."""
        if self._received:
            self.fold()
            if self.state.sync:
                self.state.reduce(self)
        self._received = False
        self.reshard()

    def start_reduce(self):
        """Start the reduce-scatter (and the all-reduce of dp-replicated slots) of the flat
        gradient; returns the Works."""
        mesh, size = self.state.dp_mesh, self.state.dp_size
        works = [None, None]
        if self._rows is not None:
            layout = Layout(mesh, (size * self.width,), (Partial(),))
            works[0], _ = redistribute_local(self._rows.reshape(-1), layout, (Shard(0),),
                                             async_op=True)
        if self._replicated is not None:
            layout = Layout(mesh, (self.replicated_width,), (Partial(),))
            works[1], _ = redistribute_local(self._replicated, layout, (Replicated(),),
                                             async_op=True)
        self._rows = self._replicated = None
        return works

    def accumulate(self, works):
        """Wait for the reductions `works` and add each shard's part into its master's grad."""
        rank = self.state.dp_rank
        if works[0] is not None:
            row = works[0].wait()
            for s in self.sharded:
                _add_grad(s.master, row[s.offset:s.offset + s.sizes[rank]].reshape(
                    s.shapes[rank]))
        if works[1] is not None:
            flat = works[1].wait()
            for s in self.replicated:
                _add_grad(s.master, flat[s.offset:s.offset + s.sizes[0]].reshape(s.shapes[0]))


def _add_grad(master, local):
    """Accumulate `local` (this rank's part of the gradient) into `master.grad`."""
    local = local.astype(master.dtype, copy=False)
    if master.grad is None:
        master.grad = DTensor._make(local, master.layout.with_placements(
            grad_placements(master.placements)))
    else:
        master.grad._local += local


# ---- the whole model ----------------------------------------------------------------------------
class FSDPState:
    """What fully_shard keeps for one model: its groups (root first), the dp mesh dimension and
    the reductions in flight."""

    def __init__(self, mesh, dim, param_dtype, reduce_dtype, reshard_after_forward):
        self.mesh = mesh
        self.dp = mesh.dim_names.index(dim)
        self.dp_mesh = mesh[dim]
        self.dp_size = mesh.shape[self.dp]
        self.dp_rank = mesh.get_local_rank(self.dp)
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.reshard_after_forward = reshard_after_forward
        self.groups = []
        self.sync = True
        self._reducing = []         # (group, works) in flight
        self._flush_queued = False

    # forward ----------------------------------------------------------------------------------
    def enter(self, group, module, args, kwargs):
        """A layer of `group` starts: its parameters gathered (the next group's prefetched) and
        its attributes pointed at the gathered views."""
        if module is group.modules[0] and group is self.groups[0]:
            for g in self.groups:       # a new forward: nothing gathered before is reused
                g.reshard()             # (a recomputation in backward may have left views)
                g.forward_views = None
        if group.forward_views is None:
            anchor = next((a for a in list(args) + list(kwargs.values())
                           if isinstance(a, DTensor) and a.requires_grad), None)
            group.forward_views = group.views(anchor)
            index = self.groups.index(group)
            if index + 1 < len(self.groups):
                self.groups[index + 1].prefetch()
        for owner, name, index in group.places[id(module)]:
            object.__setattr__(owner, name, group.forward_views[index])

    def leave(self, group, module, out):
        """A layer of `group` ends: attributes back to the masters; after its last layer the
        full parameters are freed (not the root group's, needed first in backward)."""
        for owner, name, index in group.places[id(module)]:
            object.__setattr__(owner, name, group.slots[index].master)
        if module is group.modules[-1]:
            group.forward_views = None
            root = group is self.groups[0]
            if not engine.is_grad_enabled() or (self.reshard_after_forward and not root):
                group.reshard()
        return self.hook_outputs(group, out)

    def hook_outputs(self, group, out):
        """`out` with every DTensor that requires a gradient passed through an identity whose
        backward gathers `group` again before its layers' backward runs."""
        if isinstance(out, (tuple, list)):
            return type(out)(self.hook_outputs(group, o) for o in out)
        if not isinstance(out, DTensor) or not out.requires_grad or \
                not engine.is_grad_enabled():
            return out
        hooked = DTensor._make(out.to_local(), out.layout)

        def backward(g):
            self.pre_backward(group)
            return (g,)
        return engine.record(hooked, (out,), backward, "fsdp_pre_backward")

    # backward ---------------------------------------------------------------------------------
    def queue_flush(self):
        """Have `flush` run at the end of the backward pass in progress (once)."""
        if not self._flush_queued:
            self._flush_queued = True
            engine.queue_callback(self.flush)

    def pre_backward(self, group):
        self.queue_flush()
        group.unshard()
        index = self.groups.index(group)
        if index > 1:
            self.groups[index - 1].prefetch()

    def reduce(self, group):
        """Start `group`'s reduction; finish the one started before (it overlapped this group's
        backward)."""
        self.finish_reductions()
        self._reducing.append((group, group.start_reduce()))

    def finish_reductions(self):
        while self._reducing:
            group, works = self._reducing.pop(0)
            group.accumulate(works)

    def flush(self):
        """End of backward: reduce what is left (gradients of parameters some layer did not
        use), wait for every reduction, free every group."""
        for group in self.groups:
            if group._received:
                group.finish_backward()
            group.reshard()
        self.finish_reductions()
        self._flush_queued = False


class FSDPModule:
    """Mixed into a fully sharded model's class: the groups, no_sync, full and sharded state."""

    @property
    def fsdp_groups(self):
        """The groups, root first, each an FSDPGroup (names of its layers, its parameters)."""
        return list(self._fsdp.groups)

    def fsdp_summary(self):
        """One line: layers → groups, and the collectives of one training step."""
        state = self._fsdp
        layer_count = sum(len(g.names) for g in state.groups[1:])
        gathers = sum(1 for g in state.groups if g.sharded)
        regathers = sum(1 for g in state.groups[1:] if g.sharded) \
            if state.reshard_after_forward else 0
        reductions = sum(bool(g.sharded) + bool(g.replicated) for g in state.groups)
        return (f"fully_shard over dp={state.dp_size}: {layer_count} layers -> "
                f"{len(state.groups) - 1} groups + root ({len(state.groups[0].slots)} "
                f"parameters); per step {gathers + regathers} all-gathers, {reductions} "
                "reductions")

    @contextmanager
    def no_sync(self):
        """Backward passes inside sum the full local gradients without communication; the first
        backward after it reduces them (gradient accumulation)."""
        state = self._fsdp
        previous, state.sync = state.sync, False
        try:
            yield
        finally:
            state.sync = previous

    def state_dict(self):
        """{name: DTensor}: the parameters gathered over the dp dimension (full, or this rank's
        tensor-parallel block) and the buffers."""
        dp = self._fsdp.dp
        result = Module.sharded_state_dict(self)
        for name, tensor in result.items():
            if tensor.placements[dp].is_shard():
                placements = list(tensor.placements)
                placements[dp] = Replicated()
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
            "gathered": sum(a.nbytes for g in self._fsdp.groups if g.full for a in g.full),
        }


def _places(model):
    """{id(parameter): [(module, attribute)]}: every module attribute that holds a parameter."""
    places = {}
    for _, module in model.named_modules():
        for name, value in module._own():
            if isinstance(value, DTensor):
                places.setdefault(id(value), []).append((module, name))
    return places


def _member_places(member, slots, root):
    """(module, attribute, slot index) of every place inside `member` (anywhere for the root
    group) that holds one of `slots`' parameters."""
    inside = None if root else {id(m) for m in member.modules()}
    return [(owner, name, slot.index) for slot in slots for owner, name in slot.places
            if inside is None or id(owner) in inside]


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


def _shard(tensor, mesh, dp):
    """Move `tensor` onto `mesh`, Shard(d) on mesh dimension `dp` (see _dp_shard_dim)."""
    if tensor.mesh == mesh:
        placements = list(tensor.placements)
    elif tensor.mesh.size() == 1:
        placements = [Replicated()] * mesh.ndim
    else:
        raise ValueError(f"fully_shard: a parameter lives on {tensor.mesh}, not on {mesh}: "
                         "apply tensor parallelism on the same mesh first")
    if not placements[dp].is_replicated():
        raise ValueError(f"fully_shard: a parameter is already {placements[dp]} on mesh "
                         f"dimension {mesh.dim_names[dp]!r}; it must be Replicated there")
    dim = _dp_shard_dim(Layout(mesh, tensor.shape, placements), dp)
    if dim is not None:
        placements[dp] = Shard(dim)
    relayout(tensor, mesh, tuple(placements))


def fully_shard(model, mesh=None, dim="dp", group_bytes=1 << 20, reshard_after_forward=True,
                param_dtype=None, reduce_dtype=None):
    """Shard `model`'s parameters over mesh dimension `dim` (ZeRO-3) and return the model.

    `mesh`: default, one dimension named `dim` over every rank. On a 2-D (dp, tp) mesh call it
    after apply_tensor_parallel(model, mesh). `group_bytes`: layers are packed into groups of
    up to this many parameter bytes (0: one group per layer). `param_dtype`: the dtype of the
    gathered parameters ("bf16" for mixed precision; default the masters'). `reduce_dtype`: the
    dtype gradients are reduced in (default the masters', fp32 for fp32 masters). Feed it
    batches sharded on `dim` (Shard(0)), like data parallelism.
    """
    if isinstance(model, FSDPModule):
        raise ValueError("fully_shard: this model is sharded already")
    if mesh is None:
        mesh = DeviceMesh((runtime.get_world_size(),), (dim,))
    if dim not in mesh.dim_names:
        raise ValueError(f"fully_shard: mesh {mesh} has no dimension {dim!r}; name the "
                         f"data-parallel one with dim= (its dimensions: {mesh.dim_names})")
    state = FSDPState(mesh, dim, param_dtype, reduce_dtype, reshard_after_forward)
    places = _places(model)
    plan = plan_groups(model, group_bytes)
    for _, tensor in model.named_buffers():
        if tensor.mesh != mesh:
            relayout(tensor, mesh, (Replicated(),) * mesh.ndim)
    owned = set()
    members = []
    for group in plan:
        params = [p for _, layer in group for p in layer.parameters() if id(p) not in owned]
        owned.update(id(p) for p in params)
        members.append(([name for name, _ in group], [layer for _, layer in group], params))
    rest = [p for p in model.parameters() if id(p) not in owned]
    members.insert(0, ([""], [model], rest))
    for names, modules, params in members:
        for p in params:
            _shard(p, mesh, state.dp)
        state.groups.append(FSDPGroup(state, names, modules,
                                      [(p, places[id(p)]) for p in params]))
    for group in state.groups:
        for module in group.modules:
            _wrap_forward(state, group, module)
    object.__setattr__(model, "_fsdp", state)
    model.__class__ = type(f"FullyShard{type(model).__name__}", (FSDPModule, type(model)), {})
    return model
