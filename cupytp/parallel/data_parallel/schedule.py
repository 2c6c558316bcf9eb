"""When bytes move in data parallelism: the one place that decides when a gradient is reduced
and when a sharded parameter is gathered.

`ReplicateSchedule` (replicated parameters, PyTorch DDP's reducer, Megatron's grad buffer):
every parameter's gradient contributions go to its bucket's flat buffer (a gradient sink, see
`DTensor.accumulate_grad`). The autograd engine says when a parameter's gradient of this
backward is complete; once every parameter of a bucket is complete (and every bucket before it
was launched: each rank launches the same collectives in the same order) the bucket is
all-reduced in place, asynchronously (on the GPU on the group's communication stream), while
backward goes on with the layers below. At the end of backward the current stream is made to
wait for the reductions (no host synchronization) and each `.grad` becomes a view of its
region. Inside `no_sync()` the buffers only sum, and `.grad` is shown Partial over the dp dims.

`ShardSchedule` (sharded parameters, FSDP; HSDP with replicate dims): a group's parameters are
gathered before its first layer runs (the next group's gather issued at the same time), freed
after its last one, gathered again when the gradient reaches the group's output; once every
gathered view of the group has its gradient they are folded into the group's rows and
reduce-scattered over the shard dim (async; waited for when the next group reduces, so it
overlaps that group's backward), then, for HSDP, the shard is all-reduced over the replicate
dims (async again, waited for at the end of backward) and added into the masters' `.grad`.

Every collective goes through `redistribute_local` on a data-parallel sub-mesh; nothing waits
on the host, so a step can be captured by `cupytp.cuda_graph`.
"""
import itertools
import weakref

from cupytp import backend
from cupytp.autograd import engine
from cupytp.launchers import cast
from cupytp.parallel.data_parallel.buffers import ShardRows, Slot, add_grad, gather_row
from cupytp.parallel.data_parallel.plan import DPDims, joint_dims
from cupytp.tensor import DTensor, Partial, Replicated, Shard
from cupytp.tensor.dtensor import set_grad_sink
from cupytp.tensor.layout import Layout
from cupytp.tensor.redistribute import grad_placements, redistribute_local


class Schedule:
    """What both schedules share: the data-parallel dims, whether backward reduces (`sync`,
    False inside no_sync()), and one flush at the end of each backward pass."""

    def __init__(self, dims):
        self.dims = dims
        self.sync = True
        self._flush_queued = False
        self._targets = {}          # (placements, contribution's) -> (target, counts here)

    def queue_flush(self):
        """Have `flush` run at the end of the backward pass in progress (once)."""
        if not self._flush_queued:
            self._flush_queued = True
            engine.queue_callback(self._flush)

    def _flush(self):
        self._flush_queued = False
        self.flush()

    def flush(self):
        raise NotImplementedError

    def pending(self):
        """True when backward passes without sync summed gradients that none has reduced."""
        raise NotImplementedError

    def finish(self):
        """Outside a backward pass, with sync on: reduce what passes without it summed and no
        pass reduced since (a pass that gives this model no gradient flushes nothing)."""
        if self.sync and self.pending():
            self.flush()

    def local_contribution(self, placements, g, dims=None):
        """This rank's part of the flat gradient from a contribution `g` to a value laid out with
        `placements`: `g` laid out like it off the reduced dims (`dims`, a DPDims; default the
        data-parallel ones; moved there if it is not), and on them Partial or Replicated; None
        where a Replicated one counts on another rank (see DPDims.counts_once)."""
        dims = dims or self.dims
        key = (placements, g.placements, dims.all)
        known = self._targets.get(key)
        if known is None:
            target = list(grad_placements(placements))
            for d in dims.all:
                target[d] = g.placements[d] if g.placements[d].is_partial() else Replicated()
            target = tuple(target)
            known = self._targets[key] = (target, dims.counts_once(target))
        target, counts = known
        local = g.to_local()
        if target != g.placements:
            local, _ = redistribute_local(local, g.layout, target)
        return local if counts else None


def _all_reduced(mesh, flat, async_op=False, in_place=False):
    """`flat` (1-D, a Partial sum over every dimension of `mesh`) all-reduced there (into
    `flat` itself with `in_place`); with `async_op` a Work."""
    layout = Layout(mesh, (flat.size,), (Partial(),) * mesh.ndim)
    return redistribute_local(flat, layout, (Replicated(),) * mesh.ndim, async_op,
                              in_place=in_place)[0]


# ---- replicated parameters ----------------------------------------------------------------------
class ReplicateSchedule(Schedule):
    """Bucketed, overlapped all-reduce of replicated parameters' gradients (module docstring).
    `buckets`: Bucket objects in launch order; `joint`: per bucket, the mesh dims besides the
    data-parallel ones its all-reduce spans (those a plan reduces a layout's Partial
    gradients over, `grad_reduction`: sequence parallelism's norms along tp), or ()."""

    def __init__(self, dims, buckets, joint=None):
        super().__init__(dims)
        self.buckets = buckets
        self.bucket_dims, self.meshes = [], []
        for extra in joint or [()] * len(buckets):
            names = dims.names() + tuple(dims.mesh.dim_names[d] for d in extra)
            self.bucket_dims.append(DPDims(dims.mesh, replicate=names) if extra else dims)
            self.meshes.append(dims.mesh[names])
        self.where = {}
        self.reduced, self.partial = {}, {}     # id(param) -> its gradient's placements
        for bucket in buckets:
            summed = self.bucket_dims[bucket.index].all
            for i, p in enumerate(bucket.params):
                self.where[id(p)] = (bucket, i)
                reduced = grad_placements(p.placements)
                self.reduced[id(p)] = reduced
                self.partial[id(p)] = tuple(Partial() if d in summed else q
                                            for d, q in enumerate(reduced))
                set_grad_sink(p, self.receive)
        self._summed = False        # regions hold sums of passes without sync, not reduced
        self._reset()

    def _reset(self):
        self._begun = [set() for _ in self.buckets]       # params with a gradient this backward
        self._complete = [set() for _ in self.buckets]    # params whose gradient is complete
        self._next = 0                                    # the next bucket to launch
        self._works = []
        self._late = []                                   # (bucket, i, local) past its launch

    def pending(self):
        return self._summed

    def receive(self, p, g, complete):
        """The gradient sink of every parameter: contribution `g` (or None) of `p`; `complete`
        with the last of this backward."""
        self.queue_flush()
        bucket, i = self.where[id(p)]
        k = bucket.index
        if g is not None:
            local = self.local_contribution(p.placements, g, self.bucket_dims[k])
            local = None if local is None else local.reshape(-1)     # regions are flat
            if k < self._next:                  # its bucket is on its way already
                self._late.append((bucket, i, local))
            elif i in self._begun[k]:
                if local is not None:
                    cast.assign(bucket.region(i), local, add=True)
            else:
                self._begin(bucket, i, local)
        if complete and k >= self._next:
            self._complete[k].add(i)
            if self.sync:
                while self._next < len(self.buckets) and \
                        len(self._complete[self._next]) == len(self.buckets[self._next].params):
                    self._launch(self.buckets[self._next])

    def _begin(self, bucket, i, local):
        """The first contribution `local` (None: none) of parameter i in this backward: its
        region becomes what `.grad` held that still counts on this rank (a Partial sum of
        earlier no_sync passes; a reduced gradient kept on the first rank along the dp dims
        only, so that it counts once), plus `local`."""
        self._begun[bucket.index].add(i)
        p, region = bucket.params[i], bucket.region(i)
        old = p.grad
        kept = old is not None and self.bucket_dims[bucket.index].counts_once(old.placements)
        if kept and old is not bucket.view(i, old.placements):
            cast.assign(region, old.to_local().reshape(-1), add=False)
        elif not kept:
            if local is not None:
                cast.assign(region, local, add=False)
                return
            region[...] = 0
        if local is not None:
            cast.assign(region, local, add=True)

    def _launch(self, bucket):
        """Start the in-place all-reduce of `bucket` (async); regions that got nothing this
        backward get what still counts of their `.grad`, or zeros."""
        for i in range(len(bucket.params)):
            if i not in self._begun[bucket.index]:
                self._begin(bucket, i, None)
        bucket.region(0)        # the buffer exists
        self._works.append(_all_reduced(self.meshes[bucket.index], bucket.buffer,
                                        async_op=True, in_place=True))
        self._next = bucket.index + 1

    def flush(self):
        """End of a backward pass: launch what is left and wait for every reduction (the
        current stream waits, not the host); each `.grad` is then a view of its reduced region.
        Inside no_sync the regions are only shown, Partial over the dp dims."""
        if self.sync:
            while self._next < len(self.buckets):
                self._launch(self.buckets[self._next])
            for work in self._works:
                work.wait()
            for bucket, i, local in self._late:     # a parameter used again after its launch
                region = bucket.region(i)
                local = backend.xp.zeros(region.shape, bucket.dtype) if local is None else \
                    backend.xp.ascontiguousarray(local)
                cast.assign(region, _all_reduced(self.meshes[bucket.index], local), add=True)
            for bucket in self.buckets:
                for i, p in enumerate(bucket.params):
                    p.grad = bucket.view(i, self.reduced[id(p)])
            self._summed = False
        else:
            for bucket, begun in zip(self.buckets, self._begun):
                for i in begun:
                    p = bucket.params[i]
                    p.grad = bucket.view(i, self.partial[id(p)])
                    self._summed = True
        self._reset()


# ---- sharded parameters -------------------------------------------------------------------------
class FSDPGroup:
    """Parameters gathered with one all-gather and reduced with one reduce-scatter.

    `names`: its layers ("" for the root group); `slots`: its parameters. State: `full` (the
    gathered local arrays, or None when resharded), `pending` (an all-gather in flight), the
    gathered views handed to the layers (`_views`: weak references to each view and to its
    autograd node, until its gradient is in: the tape keeps the node, not the view, so a live
    node is a gradient still to come), the gradients received (`_held`) and the flat gradient
    they are folded into (`rows`, a ShardRows).
    """

    def __init__(self, state, names, modules, masters):
        self.state, self.names, self.modules = state, names, modules
        dim = state.dims.shard
        self.sharded, self.replicated = [], []
        width = {True: 0, False: 0}
        for master, places in masters:
            sharded = master.placements[dim].is_shard()
            slot = Slot(master, places, dim, width[sharded])
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
        self.joint = {}     # extra dims -> (DPDims over them too, the mesh of those, slots)
        mesh = state.dims.mesh
        for index, slot in enumerate(self.slots):
            slot.index = index
            slot.joint = joint_dims(slot.master, state.dims)
            if slot.joint and slot.joint not in self.joint:
                extra = tuple(mesh.dim_names[d] for d in slot.joint)
                self.joint[slot.joint] = (DPDims(mesh, replicate=state.dims.names() + extra),
                                          mesh[extra], [])
            if slot.joint:
                self.joint[slot.joint][2].append(slot)
        self.places = {id(m): _member_places(m, self.slots, names == [""]) for m in modules}
        self.full = None
        self.pending = None
        self.forward_views = None   # the views handed to the layers of the forward running
        self._views = {}            # key -> (view ref, node ref, slot index): grads to come
        self._keys = itertools.count()
        self._held = {}             # slot index -> [full gradients not yet folded]
        self._joint_seen = set()    # slots of `joint` that received a gradient this pass
        self.rows = None            # the flat gradient (ShardRows) of this accumulation
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
        dims = self.state.dims
        row = gather_row(self.sharded, self.width, self.param_dtype)
        layout = Layout(dims.shard_mesh, (dims.shard_size * self.width,), (Shard(0),))
        self.pending, _ = redistribute_local(row, layout, (Replicated(),), async_op=True)

    def unshard(self):
        """The full parameters, gathered now if not already; gathered views of this group that
        autograd still holds get them back (their memory was freed after the forward)."""
        if self.full is None:
            self.prefetch()
            full = []
            if self.sharded:
                rows = self.pending.wait().reshape(self.state.dims.shard_size, self.width)
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
        if slot.joint:          # kept Partial there too: summed with the group's others
            self._joint_seen.add(slot.index)
        local = self.state.local_contribution(slot.full_layout.placements, g,
                                              self.joint[slot.joint][0] if slot.joint else None)
        if local is not None:
            self._held.setdefault(slot.index, []).append(local)
        self._received = True
        self._views.pop(key, None)
        for dead in [k for k, (_, node, _) in self._views.items() if node() is None]:
            del self._views[dead]
        if not self._views:
            self.finish_backward()

    def finish_backward(self):
        """This group's gradients are in: fold them, reduce (unless inside no_sync), free the
        full parameters."""
        if self._received:
            self._reduce_joint()
            if self.rows is None:
                self.rows = ShardRows(self.sharded, self.replicated, self.state.dims.shard_size,
                                      self.width, self.replicated_width, self.reduce_dtype)
            self.rows.fold(self.slots, self._held)
            if self.state.sync:
                self.state.reduce(self)
        self._received = False
        if self.state.reshard_after_backward:
            self.reshard()

    def _reduce_joint(self):
        """The gradients kept Partial along joint dims (sequence parallelism's norms along tp),
        summed there in one all-reduce per set of dims: each slot's contributions added (zeros
        where this rank counted none), packed flat in the reduce dtype."""
        for _, mesh, slots in self.joint.values():
            seen = [s for s in slots if s.index in self._joint_seen]
            if not seen:
                continue
            xp = backend.xp
            parts = []
            for slot in seen:
                held = self._held.pop(slot.index, [])
                total = xp.zeros(slot.full_layout.local_shape, dtype=self.reduce_dtype)
                for local in held:
                    total += local
                parts.append(total)
            flat = _all_reduced(mesh, xp.concatenate([part.reshape(-1) for part in parts]),
                                in_place=True)
            start = 0
            for slot, part in zip(seen, parts):
                self._held[slot.index] = [flat[start:start + part.size].reshape(part.shape)]
                start += part.size
        self._joint_seen.clear()


class _Reduction:
    """A group's flat gradient on its way: reduce-scatter of the rows over the shard dim and
    all-reduce of the unsharded slots over every dp dim; for HSDP, then the all-reduce of the
    shard over the replicate dims. `advance()` moves it one stage on (waiting for the one in
    flight); `finish()` takes it to the end and adds into the masters' `.grad`."""

    def __init__(self, group):
        self.group, dims, rows = group, group.state.dims, group.rows
        group.rows = None
        self.row = self.flat = None
        if rows.rows is not None:
            layout = Layout(dims.shard_mesh, (dims.shard_size * group.width,), (Partial(),))
            self.row, _ = redistribute_local(rows.rows.reshape(-1), layout, (Shard(0),),
                                             async_op=True)
        if rows.replicated is not None:
            self.flat = _all_reduced(dims.mesh[dims.names()], rows.replicated, async_op=True,
                                    in_place=True)
        self.replicating = not dims.replicate     # nothing to replicate: that stage is done

    def advance(self):
        """One stage on; True when done."""
        if not self.replicating and self.row is not None:
            self.row = _all_reduced(self.group.state.dims.replicate_mesh, self.row.wait(),
                                   async_op=True, in_place=True)
            self.replicating = True
            return False
        self.finish()
        return True

    def finish(self):
        dims, group = self.group.state.dims, self.group
        if self.row is not None:
            row = self.row.wait()
            if not self.replicating:
                row = _all_reduced(dims.replicate_mesh, row, in_place=True)
            for s in group.sharded:
                add_grad(s.master, row[s.offset:s.offset + s.sizes[dims.shard_rank]].reshape(
                    s.shapes[dims.shard_rank]))
        if self.flat is not None:
            flat = self.flat.wait()
            for s in group.replicated:
                add_grad(s.master, flat[s.offset:s.offset + s.sizes[0]].reshape(s.shapes[0]))


class ShardSchedule(Schedule):
    """What fully_shard keeps for one model: its groups (root first), the dims, the dtypes,
    and the reductions in flight."""

    def __init__(self, dims, param_dtype, reduce_dtype, reshard_after_forward):
        super().__init__(dims)
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        self.groups = []
        self._reducing = []         # _Reductions in flight

    # forward ----------------------------------------------------------------------------------
    def enter(self, group, module, args, kwargs):
        """A layer of `group` starts: its parameters gathered (the next group's prefetched) and
        its attributes pointed at the gathered views."""
        if module is group.modules[0] and group is self.groups[0]:
            for g in self.groups:       # a new forward makes views of its own; what an earlier
                g.forward_views = None  # pass left gathered (a recomputation in backward) is
                if self.reshard_after_backward:     # freed, unless kept on purpose
                    g.reshard()
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
    def pre_backward(self, group):
        self.queue_flush()
        group.unshard()
        index = self.groups.index(group)
        if index > 1:
            self.groups[index - 1].prefetch()

    def pending(self):
        return any(group.rows is not None for group in self.groups)

    def finish(self):
        """As Schedule.finish, and the gathered parameters freed (unless kept on purpose)."""
        super().finish()
        if self.reshard_after_backward:
            for group in self.groups:
                group.reshard()

    def reduce(self, group):
        """Start `group`'s reduction; move those in flight one stage on (they overlapped this
        group's backward)."""
        self._reducing = [r for r in self._reducing if not r.advance()]
        self._reducing.append(_Reduction(group))

    def flush(self):
        """End of backward: reduce what is left (gradients of parameters some layer did not
        use, and, outside no_sync, what earlier passes inside it summed into a group this pass
        gave nothing), wait for every reduction, free every group (unless
        `reshard_after_backward` is off)."""
        for group in self.groups:
            if group._received:
                group.finish_backward()
            elif self.sync and group.rows is not None:
                self.reduce(group)
            if self.reshard_after_backward:
                group.reshard()
        for reduction in self._reducing:
            reduction.finish()
        self._reducing = []


def _member_places(member, slots, root):
    """(module, attribute, slot index) of every place inside `member` (anywhere for the root
    group) that holds one of `slots`' parameters."""
    inside = None if root else {id(m) for m in member.modules()}
    return [(owner, name, slot.index) for slot in slots for owner, name in slot.places
            if inside is None or id(owner) in inside]
