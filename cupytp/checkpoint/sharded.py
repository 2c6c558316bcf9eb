"""save() and load(): every rank writes only its own blocks, and any mesh reads them back.

Saving, each tensor is written once: by the ranks at coordinate 0 on every mesh dimension along
which it is Replicated, each its own block (offsets from `Layout.local_block()`); where ranks of
different meshes hold the same block (pipeline stages on meshes of their own, a tensor on one
rank of a larger job), the lowest of them writes it, and the blocks written must cover every
tensor. Ranks may hold different tensors (a pipeline's stages): the index lists every rank's.
Rank 0 writes the index once every rank's file is on disk, then commits the directory
(`storage.commit`).
Loading, each rank reads for each target tensor, from every saved shard that overlaps its block,
exactly the overlapping bytes (`safe_open(...).get_slice(key)[index]`): a checkpoint saved on any
mesh and placements loads on any other. Both are collective (every rank calls them); an error on
any rank is raised on every rank, and load changes nothing unless all was read and verified.
"""
import contextlib
import math
import numbers
import os
import shutil

import numpy
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from cupytp import backend
from cupytp.checkpoint import state, storage
from cupytp.checkpoint.storage import CheckpointError
from cupytp.distributed import runtime as rt
from cupytp.tensor import DTensor
from cupytp.tensor.placement import describe


def save(directory, step, model=None, optimizer=None, extra=None, keep_last=None):
    """Write the checkpoint of `step` as `directory`/step-N and return that path.

    It holds the model's parameters and buffers, the optimizer's states and hyperparameters,
    and `extra`: a JSON dict of the caller's (RNG state, data position, ...) taken from rank 0.
    `keep_last=N` then removes all but the N highest steps (and never the one just saved).
    Collective: every rank calls it.
    """
    rank = rt.get_rank()

    def prepare():
        _check_save_arguments(step, extra, keep_last)
        keys = state.optimizer_keys(model, optimizer) if optimizer is not None else None
        groups = state.saved_param_groups(optimizer, keys) if optimizer is not None else None
        tensors = state.saved_tensors(model, optimizer, keys)
        blocks = {key: _own_block(key, t) for key, t in tensors.items()}
        blocks = {key: block for key, block in blocks.items() if block is not None}
        return tensors, blocks, groups, state.to_json(extra or {}, "extra")
    tensors, blocks, groups, saved_extra = _on_every_rank(prepare)
    views = _on_every_rank(lambda: (_entries(tensors), {k: (list(o), list(a.shape))
                                                        for k, (o, a) in blocks.items()},
                                    groups), gather=True)
    entries, writers, groups = _on_every_rank(lambda: _merged(views))
    blocks = {key: block for key, block in blocks.items()
              if writers[(key, tuple(block[0]))] == rank}
    temp = _on_every_rank(lambda: storage.new_temp_dir(directory, step) if rank == 0 else None,
                          gather=True)[0]
    try:
        records = _on_every_rank(lambda: _write_shards(temp, rank, blocks), gather=True)

        def commit():
            if rank != 0:
                return None
            index = _index(step, entries, records, groups, saved_extra)
            storage.write_json(os.path.join(temp, storage.INDEX), index)
            storage.fault("index", rank)
            final = storage.commit(directory, temp, step)
            storage.clean(directory, keep_last, step)
            return final
        return _on_every_rank(commit, gather=True)[0]
    except CheckpointError:
        if rank == 0:
            shutil.rmtree(temp, ignore_errors=True)
        raise


def read_extra(directory):
    """(the checkpoint directory `load(directory)` would read, its `extra` dict with "step"),
    without reading any tensor: what a run needs to know before it builds its model.
    Collective: every rank calls it."""
    rank = rt.get_rank()
    path = _on_every_rank(lambda: storage.resolve(directory) if rank == 0 else None,
                          gather=True)[0]
    index = _on_every_rank(lambda: storage.read_index(path))
    return path, dict(index["extra"], step=index["step"])


def load(directory, model=None, optimizer=None):
    """Load a checkpoint into `model` and `optimizer` (either may be None), resharded to their
    meshes and placements, and return its `extra` dict with "step" added.

    `directory` is a checkpoint root (its latest complete checkpoint is loaded) or one step-N
    directory. Every shard file is checked against its sha256 first; any error leaves the model
    and optimizer as they were. Collective: every rank calls it.
    """
    rank, world = rt.get_rank(), rt.get_world_size()
    path = _on_every_rank(lambda: storage.resolve(directory) if rank == 0 else None,
                          gather=True)[0]
    index = _on_every_rank(lambda: storage.read_index(path))
    files = sorted(index["files"].items())
    _on_every_rank(lambda: [storage.verify(path, name, record)
                            for name, record in files[rank::world]])
    owned = _on_every_rank(lambda: sorted(state.model_targets(model)) if model is not None
                           else [], gather=True)
    values = _on_every_rank(lambda: _read(path, index, model, optimizer, owned))

    def assign():
        if optimizer is not None:
            saved = {k: v for k, v in values.items() if k.startswith(state.OPTIMIZER)}
            keys = state.optimizer_keys(model if index["version"] >= 2 else None, optimizer)
            try:
                optimizer.load_state_dict(state.optimizer_state_dict(
                    optimizer, keys, index["param_groups"], saved))
            except (ValueError, KeyError) as err:
                raise CheckpointError(f"{path}: the optimizer does not fit the checkpoint: "
                                      f"{err}") from None
        if model is not None:
            model.load_state_dict({k[len(state.MODEL):]: v for k, v in values.items()
                                   if k.startswith(state.MODEL)})
    _on_every_rank(assign)
    return dict(index["extra"], step=index["step"])


# ---- saving -------------------------------------------------------------------------------------
def _check_save_arguments(step, extra, keep_last):
    if not isinstance(step, numbers.Integral) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"step must be an integer >= 0, got {step!r}")
    if keep_last is not None and (not isinstance(keep_last, numbers.Integral) or keep_last < 1):
        raise CheckpointError(f"keep_last must be None or an integer >= 1, got {keep_last!r}")
    if extra is not None and not isinstance(extra, dict):
        raise CheckpointError(f"extra must be a dict, got {type(extra).__name__}")
    if extra is not None and "step" in extra:
        raise CheckpointError("extra must not hold 'step': save() stores the step itself and "
                              "load() returns it as extra['step']")


def _own_block(key, tensor):
    """(offsets, host array) of the block of `tensor` this rank would write, or None."""
    if any(p.is_partial() for p in tensor.placements):
        raise CheckpointError(f"{key} is {describe(tensor.placements)}: a Partial value is not "
                              "saved; redistribute it to Replicated or Shard first")
    coordinate = tensor.mesh.get_coordinate()
    if any(p.is_replicated() and c != 0 for p, c in zip(tensor.placements, coordinate)):
        return None                 # another rank of this replica set writes it
    offsets, shape = tensor.layout.local_block()
    if math.prod(shape) == 0:
        return None
    return offsets, numpy.asarray(backend.asnumpy(tensor.to_local()), order="C")


def _entries(tensors):
    """{key: what the index says of the tensor}: global shape, dtype, mesh and placements."""
    return {key: {"shape": list(t.shape), "dtype": str(t.dtype),
                  "mesh": {"shape": list(t.mesh.shape), "dims": list(t.mesh.dim_names)},
                  "placements": [str(p) for p in t.placements]}
            for key, t in tensors.items()}


def _merged(views):
    """From every rank's (entries, blocks it would write, optimizer groups): every tensor's
    entry, the rank that writes each block ({(key, offsets): rank}: the lowest that holds it),
    and the optimizer's groups. A tensor whose shape or dtype differ between ranks, or whose
    blocks do not cover it exactly once, is an error."""
    entries, writers, extents = {}, {}, {}
    for rank, (theirs, blocks, _) in enumerate(views):
        for key, entry in theirs.items():
            known = entries.setdefault(key, entry)
            if (known["shape"], known["dtype"]) != (entry["shape"], entry["dtype"]):
                raise CheckpointError(f"{key} is {entry['shape']} {entry['dtype']} on rank "
                                      f"{rank} but {known['shape']} {known['dtype']} on a "
                                      "lower rank")
        for key, (offsets, shape) in blocks.items():
            if (key, tuple(offsets)) not in writers:
                writers[(key, tuple(offsets))] = rank
                extents.setdefault(key, []).append((offsets, shape))
    for key, entry in entries.items():
        _check_cover(key, entry["shape"], extents.get(key, []))
    return entries, writers, state.merged_param_groups([groups for _, _, groups in views])


def _check_cover(key, shape, blocks):
    """The blocks (offsets, shape) of a tensor of `shape` cover it, none overlapping."""
    for i, (a, na) in enumerate(blocks):
        for b, nb in blocks[:i]:
            if all(x < y + m and y < x + n for x, n, y, m in zip(a, na, b, nb)):
                raise CheckpointError(f"{key}: ranks hold overlapping blocks at {a} and {b} "
                                      "with other extents: its layouts differ between ranks")
    held = sum(math.prod(n) for _, n in blocks)
    if held != math.prod(shape):
        raise CheckpointError(f"{key}: the ranks hold {held} of its {math.prod(shape)} "
                              "elements: a tensor must be laid out over ranks that together "
                              "hold all of it")


def _write_shards(temp, rank, blocks):
    """Write this rank's blocks into its file in `temp`; the index record of that file."""
    record = None
    if blocks:
        name = storage.shard_file_name(rank)
        path = os.path.join(temp, name)
        save_file({key: array for key, (_, array) in blocks.items()}, path)
        record = {"file": name, **storage.file_record(path),
                  "blocks": {key: {"offsets": list(offsets), "shape": list(array.shape)}
                             for key, (offsets, array) in blocks.items()}}
    storage.fault("shard", rank)
    return record


def _index(step, entries, records, param_groups, extra):
    """The index: each tensor's global shape, dtype, mesh, placements and shards."""
    entries = {key: dict(entry, shards=[]) for key, entry in entries.items()}
    files = {}
    for record in filter(None, records):
        files[record["file"]] = {"sha256": record["sha256"], "bytes": record["bytes"]}
        for key, block in record["blocks"].items():
            entries[key]["shards"].append({"file": record["file"], **block})
    return {"format": storage.FORMAT, "version": storage.VERSION, "step": int(step),
            "world_size": rt.get_world_size(), "tensors": entries, "files": files,
            "param_groups": param_groups, "extra": extra}


# ---- loading ------------------------------------------------------------------------------------
def _read(path, index, model, optimizer, owned):
    """{key: DTensor laid out like its target} for everything `model` and `optimizer` take,
    read into host memory (device arrays on GPU) without touching them. `owned`: every rank's
    model keys."""
    targets = _targets(path, index, model, optimizer, owned)
    with contextlib.ExitStack() as stack:
        handles = {}

        def handle(name):
            if name not in handles:
                file = os.path.join(path, name)
                try:
                    handles[name] = stack.enter_context(safe_open(file, framework="numpy"))
                except (OSError, SafetensorError) as err:
                    raise CheckpointError(f"shard file {file} cannot be read: {err}") from None
            return handles[name]
        return {key: _read_block(path, key, index["tensors"][key], target, handle)
                for key, target in targets.items()}


def _targets(path, index, model, optimizer, owned):
    """{key: tensor whose layout, shape and dtype the loaded value takes}. `owned`: every
    rank's model keys: a saved tensor that no rank's model holds is another model's."""
    saved = index["tensors"]
    targets = {}
    if model is not None:
        own = state.model_targets(model)
        anyone = {key for keys in owned for key in keys}
        missing = [key for key in own if key not in saved]
        unexpected = [key for key in saved if key.startswith(state.MODEL) and key not in anyone]
        if missing or unexpected:
            parts = ([f"it lacks this model's {_few(missing)}"] if missing else []) + \
                ([f"it holds {_few(unexpected)}, which this model lacks"] if unexpected else [])
            raise CheckpointError(f"{path} holds another model: {'; '.join(parts)}")
        targets.update(own)
    if optimizer is not None:
        if index["param_groups"] is None:
            raise CheckpointError(f"{path} holds no optimizer state (it was saved without "
                                  "optimizer=): load it with optimizer=None")
        named = index["version"] >= 2 and any(
            not key.isdigit() for group in index["param_groups"] for key in map(str,
                                                                                 group["params"]))
        if named and model is None:
            raise CheckpointError(f"{path} keeps the optimizer's states by parameter name: "
                                  "load it with model= as well")
        keys = state.optimizer_keys(model if index["version"] >= 2 else None, optimizer)
        targets.update(state.optimizer_targets(
            optimizer, keys, [key for key in saved if key.startswith(state.OPTIMIZER)]))
    return targets


def _read_block(path, key, entry, target, handle):
    """This rank's block of `target` from the saved shards of `key` that overlap it."""
    shape = tuple(entry["shape"])
    if shape != target.shape:
        raise CheckpointError(f"{key}: {path} holds shape {shape}, this model has "
                              f"{target.shape}")
    if any(p.is_partial() for p in target.placements):
        raise CheckpointError(f"{key}: cannot load into a Partial tensor "
                              f"{describe(target.placements)}")
    offsets, local_shape = target.layout.local_block()
    block = numpy.empty(local_shape, dtype=backend.dtype(entry["dtype"]))
    covered = 0
    for shard in entry["shards"]:
        low = [max(a, b) for a, b in zip(offsets, shard["offsets"])]
        high = [min(a + n, b + m) for a, n, b, m in zip(offsets, local_shape, shard["offsets"],
                                                         shard["shape"])]
        if any(h <= lo for lo, h in zip(low, high)):
            continue
        source = tuple(slice(lo - b, h - b) for lo, h, b in zip(low, high, shard["offsets"]))
        block[tuple(slice(lo - a, h - a) for lo, h, a in zip(low, high, offsets))] = \
            _read_slice(path, key, shard, source, handle)
        covered += math.prod(h - lo for lo, h in zip(low, high))
    if covered != math.prod(local_shape):
        raise CheckpointError(f"{key}: the shards in {path} cover {covered} of the "
                              f"{math.prod(local_shape)} elements this rank needs: a shard is "
                              "missing from its index")
    return DTensor(backend.asarray(block.astype(target.dtype, copy=False)), target.layout)


def _read_slice(path, key, shard, index, handle):
    file = os.path.join(path, shard["file"])
    try:
        view = handle(shard["file"]).get_slice(key)
        if list(view.get_shape()) != list(shard["shape"]):
            raise CheckpointError(f"shard file {file} holds {key} with shape "
                                  f"{tuple(view.get_shape())}, its index says "
                                  f"{tuple(shard['shape'])}")
        return view[index]
    except SafetensorError as err:
        raise CheckpointError(f"shard file {file} cannot give {key}: {err}") from None


# ---- every rank together ------------------------------------------------------------------------
def _on_every_rank(action, gather=False):
    """Run `action` here; if it raised on any rank, raise CheckpointError on every rank (so none
    waits in a later collective). Returns its result, or with gather=True every rank's."""
    try:
        result, error = action(), None
    except Exception as err:    # whatever failed, on whichever rank, must fail all ranks alike
        result = None
        error = str(err) if isinstance(err, CheckpointError) else f"{type(err).__name__}: {err}"
    outcomes = rt.all_gather_object((error, result if gather else None))
    failed = {}
    for rank, (message, _) in enumerate(outcomes):
        if message is not None:
            failed.setdefault(message, []).append(rank)
    if failed:
        if len(failed) == 1 and len(next(iter(failed.values()))) == len(outcomes):
            raise CheckpointError(next(iter(failed)))
        raise CheckpointError("; ".join(f"rank {', '.join(map(str, ranks))}: {message}"
                                        for message, ranks in failed.items()))
    return [r for _, r in outcomes] if gather else result


def _few(keys, count=5):
    shown = ", ".join(keys[:count])
    return f"[{shown}{', ...' if len(keys) > count else ''}]"
