"""The plan of data parallelism, made before any memory exists: which mesh dimensions replicate
and which shard, where each parameter is split, and how parameters are packed into the units
that move together (groups for sharding, buckets for replicated gradients).

- `DPDims`: the data-parallel mesh dimensions of a model. `replicate` dims hold whole copies of
  a parameter (its gradient all-reduced there); the `shard` dim, if any, splits it (ZeRO-3:
  gathered before use, its gradient reduce-scattered). Both: HSDP, shard within a group of
  ranks, replicate across the groups.
- `shard_dim(layout, dim)`: the tensor dimension the shard mesh dim splits.
- `plan_groups(model, group_bytes)`: the parameter analyzer of sharding: layers (the elements
  of ModuleLists) packed into groups of up to `group_bytes` of parameters.
- `plan_buckets(params, bucket_bytes)`: replicated parameters packed, in the reverse of their
  order (about the order backward finishes their gradients), into buckets of up to
  `bucket_bytes` of gradient.
- `joint_dims(p, dims)`: the mesh dims besides the data-parallel ones that `p`'s gradient is
  summed over in the same reduction (sequence parallelism's norms along tp).
"""
from cupytp.nn.module import ModuleList
from cupytp.tensor.dtensor import grad_reduction


class DPDims:
    """The data-parallel dimensions of `mesh`: `replicate` (names) and `shard` (a name or None),
    with each one's index, size and this rank's coordinate along it."""

    def __init__(self, mesh, replicate=(), shard=None):
        replicate = (replicate,) if isinstance(replicate, str) else tuple(replicate)
        names = replicate + ((shard,) if shard is not None else ())
        if not names:
            raise ValueError("data parallelism needs a mesh dimension to replicate or shard over")
        missing = [name for name in names if name not in mesh.dim_names]
        if missing:
            raise ValueError(f"mesh {mesh} has no dimension {missing[0]!r}; name the "
                             f"data-parallel ones (its dimensions: {mesh.dim_names})")
        if len(set(names)) != len(names):
            raise ValueError(f"the data-parallel dimensions {names} repeat")
        self.mesh = mesh
        self.replicate = tuple(mesh.dim_names.index(name) for name in replicate)
        self.shard = None if shard is None else mesh.dim_names.index(shard)
        self.all = self.replicate + (() if shard is None else (self.shard,))
        coordinate = mesh.get_coordinate()
        self.first = all(coordinate[d] == 0 for d in self.all)   # coordinate 0 along each
        self.shard_size = 1 if shard is None else mesh.shape[self.shard]
        self.shard_rank = 0 if shard is None else coordinate[self.shard]
        self.shard_mesh = None if shard is None else mesh[shard]
        self.replicate_mesh = mesh[replicate] if replicate else None

    def names(self):
        return tuple(self.mesh.dim_names[d] for d in self.all)

    def describe(self):
        parts = [f"replicate {self.mesh.dim_names[d]}={self.mesh.shape[d]}"
                 for d in self.replicate]
        if self.shard is not None:
            parts.append(f"shard {self.mesh.dim_names[self.shard]}={self.shard_size}")
        return ", ".join(parts)

    def counts_once(self, placements):
        """Whether this rank adds a gradient laid out with `placements` into a flat gradient
        that is summed over the data-parallel ranks: always for a Partial one along every dp
        dim; a Replicated one only at coordinate 0 along the dims where it is Replicated (it
        counts once, as Replicated → Partial keeps it on one rank)."""
        coordinate = self.mesh.get_coordinate()
        return all(placements[d].is_partial() or coordinate[d] == 0 for d in self.all)


def shard_dim(layout, dim):
    """The tensor dimension mesh dim `dim` splits: among those no other mesh dimension of more
    than one rank shards, the outermost of the local block's leading dimensions when it has a
    row for every rank along `dim` (each shard is then one contiguous piece of the full block:
    gathered rows become full parameters by one strided copy), else the largest; None if none
    is free."""
    taken = {p.dim for d, p in enumerate(layout.placements)
             if d != dim and p.is_shard() and layout.mesh.shape[d] > 1}
    free = [d for d in range(len(layout.shape)) if d not in taken]
    if not free:
        return None
    local = layout.local_shape
    leading = next(d for d in range(len(local) + 1) if d == len(local) or local[d] > 1)
    if leading in free and local[leading] >= layout.mesh.shape[dim]:
        return leading
    return max(free, key=lambda d: (layout.shape[d], -d))


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
    first layer that holds it (tied weights once). Sizes are the parameters' local blocks as
    laid out now (a deferred model's included: no memory is needed)."""
    _check_bytes("group_bytes", group_bytes)
    groups, current, size, seen = [], [], 0, set()
    for name, layer in layers(model):
        params = [p for p in layer.parameters() if id(p) not in seen]
        if not params:
            continue
        seen.update(id(p) for p in params)
        nbytes = sum(p.to_local().nbytes for p in params)
        if current and size + nbytes > group_bytes:
            groups.append(current)
            current, size = [], 0
        current.append((name, layer))
        size += nbytes
    if current:
        groups.append(current)
    return groups


def plan_buckets(params, bucket_bytes, kind=None):
    """`params` (tied ones once) in reverse order, packed into consecutive buckets of one dtype
    (and one `kind(p)`, where given: the mesh dims a bucket is reduced over) and up to
    `bucket_bytes` of local gradient each (a larger parameter alone): a list of lists of
    parameters. Backward finishes the gradients of a model's last parameters first, so the
    first bucket is ready first."""
    _check_bytes("bucket_bytes", bucket_bytes)
    current, size = {}, {}          # kind -> the bucket being filled, its bytes
    seen, order = set(), []
    for p in reversed(list(params)):
        if id(p) in seen:
            continue
        seen.add(id(p))
        key = (p.dtype, None if kind is None else kind(p))
        nbytes = p.to_local().nbytes
        if current.get(key) and size[key] + nbytes > bucket_bytes:
            order.append(current.pop(key))
        if not current.get(key):
            current[key], size[key] = [], 0
        current[key].append(p)
        size[key] += nbytes
    order += [ps for ps in current.values() if ps]
    return order


def _check_bytes(name, value):
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def joint_dims(p, dims):
    """The mesh dims besides the data-parallel ones (`dims`, a DPDims) over which `p`'s gradient
    is summed together with its data-parallel reduction: those along which its plan's layout
    makes every contribution Partial (`grad_reduction`: a norm under sequence parallelism, key/
    value heads kept whole over tp), reduced with the others of its bucket or group instead of
    one by one. () for the rest."""
    reduction = grad_reduction(p)
    if reduction is None or not reduction[1] or p.mesh != dims.mesh:
        return ()
    return tuple(sorted(d for d in reduction[0] if d not in dims.all and p.mesh.shape[d] > 1))
