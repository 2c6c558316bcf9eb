"""Sharded checkpoints on 1, 2 and 4 ranks: tensors saved with any placements load with any
others (uneven sizes; each element written once, by one rank of its replica set), a GPT-2 saved
at TP=2 loads at TP=1, TP=N and on a 2-D mesh with the same values and the same next training
steps, and an error on one rank is raised on every rank, with nothing loaded."""
import json
import math
import os

import numpy
import pytest

import cupytp
from cupytp import checkpoint, nn
from cupytp.checkpoint import CheckpointError
from cupytp.distributed.runtime import barrier
from cupytp.parallel import fully_shard, replicate
from cupytp.tensor import Partial, Replicated, Shard, local_mesh
from small_gpt2 import assert_same, check_continues, gpt2, reference, snapshot, train
from dense_reference import full, lay_out, rng_array

ARRAYS = {"a": rng_array((5, 7), 1), "b": rng_array((3,), 2, numpy.float32),
          "c": rng_array((2, 3, 5), 3), "ids": numpy.arange(22).reshape(11, 2)}
R, S = Replicated(), Shard
LAYOUTS = {    # name -> (which mesh, placements of each array)
    "dense": ("local", {"a": (R,), "b": (R,), "c": (R,), "ids": (R,)}),
    "1d": ("1d", {"a": (S(1),), "b": (S(0),), "c": (S(2),), "ids": (S(0),)}),
    "2d": ("2d", {"a": (S(0), S(1)), "b": (R, S(0)), "c": (S(2), S(2)), "ids": (S(0), R)}),
    "2d-swapped": ("2d", {"a": (S(1), S(0)), "b": (S(0), R), "c": (R, S(0)), "ids": (R, S(1))}),
}


class Tensors(nn.Module):
    """Floating tensors as parameters, the others as buffers."""

    def __init__(self, tensors):
        super().__init__()
        for name, tensor in tensors.items():
            if tensor.requires_grad:
                setattr(self, name, tensor)
            else:
                self.register_buffer(name, tensor)


def laid_out(arrays, mesh, placements):
    return Tensors({name: lay_out(array, mesh, placements[name],
                                  requires_grad=array.dtype.kind == "f")
                    for name, array in arrays.items()})


@pytest.mark.parametrize("source", ["1d", "2d"])
def test_any_placements_load_as_any_others(world, mesh1d, mesh2d, shared_dir, source):
    meshes = {"local": local_mesh(), "1d": mesh1d, "2d": mesh2d}
    mesh, placements = LAYOUTS[source]
    path = checkpoint.save(shared_dir, 0, laid_out(ARRAYS, meshes[mesh], placements))
    with open(os.path.join(path, "index.json")) as f:
        index = json.load(f)
    for name, array in ARRAYS.items():       # every element written exactly once
        written = numpy.zeros(array.shape, numpy.int64)
        for shard in index["tensors"][f"model/{name}"]["shards"]:
            written[tuple(slice(o, o + n) for o, n in zip(shard["offsets"], shard["shape"]))] += 1
        assert (written == 1).all(), name
    for target, (mesh, placements) in LAYOUTS.items():
        zeros = {name: numpy.zeros_like(array) for name, array in ARRAYS.items()}
        model = laid_out(zeros, meshes[mesh], placements)
        assert checkpoint.load(shared_dir, model) == {"step": 0}
        for name, tensor in model.state_dict().items():
            assert tensor.dtype == ARRAYS[name].dtype
            numpy.testing.assert_array_equal(full(tensor), ARRAYS[name],
                                             err_msg=f"{name}: {source} -> {target}")


def test_gpt2_saved_at_tp2_continues_alike_on_every_layout(world, mesh1d, mesh2d, shared_dir):
    """Saved at TP=2 (on 2 and 4 ranks; TP=1 on 1), it loads at TP=1, TP=N, on the (dp, tp)
    mesh, fully sharded over every rank and replicated over dp, with the same parameters and
    optimizer states and the same next losses (the vocabulary's padding does not depend on
    the mesh)."""
    source = mesh2d if mesh2d.shape[-1] == 2 else mesh1d    # TP=2 on 2 and 4 ranks, 1 on 1
    model, optimizer = gpt2(source, seed=1)
    train(model, optimizer, 2)
    checkpoint.save(shared_dir, 2, model, optimizer)
    expected = reference(model, optimizer)
    dp = cupytp.DeviceMesh((world.world_size,), ("dp",))
    layouts = [(local_mesh(), None), (mesh1d, None), (mesh2d, None),
               (local_mesh(), lambda m: fully_shard(m, dp)),
               (mesh2d, lambda m: replicate(m, mesh2d))]
    for mesh, parallel in layouts:
        check_continues(expected, shared_dir, mesh, step=2, parallel=parallel)


def test_an_error_on_one_rank_fails_every_rank_and_loads_nothing(world, mesh1d, shared_dir):
    model, optimizer = gpt2(mesh1d, seed=3)
    train(model, optimizer, 1)
    path = checkpoint.save(shared_dir, 1, model, optimizer)
    files = sorted(name for name in os.listdir(path) if name.endswith(".safetensors"))
    checker = (len(files) - 1) % world.world_size     # the rank that verifies the last file
    barrier()
    if world.rank == 0:
        with open(os.path.join(path, files[-1]), "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 0xFF]))
    barrier()
    other, other_optimizer = gpt2(mesh1d, seed=4)
    train(other, other_optimizer, 1)
    before = snapshot(other, other_optimizer)
    with pytest.raises(CheckpointError, match=f"{files[-1]} is corrupt") as error:
        checkpoint.load(shared_dir, other, other_optimizer)
    if world.world_size > 1:
        assert f"rank {checker}: " in str(error.value)
    assert_same(snapshot(other, other_optimizer), before)


def test_partial_values_are_not_saved(world, mesh1d, shared_dir):
    model = Tensors({"p": lay_out(rng_array((4,), 5), mesh1d, (Partial(),), requires_grad=True)})
    with pytest.raises(CheckpointError, match=r"model/p is \[P\].*redistribute it"):
        checkpoint.save(shared_dir, 0, model)
    assert os.listdir(shared_dir) == []


def test_shards_of_a_replicated_dimension_come_from_one_rank(world, mesh2d, shared_dir):
    model = laid_out({"a": ARRAYS["a"]}, mesh2d, {"a": (R, S(0))})
    path = checkpoint.save(shared_dir, 0, model)
    with open(os.path.join(path, "index.json")) as f:
        shards = json.load(f)["tensors"]["model/a"]["shards"]
    writers = sorted(int(shard["file"][5:10]) for shard in shards)
    assert writers == sorted(mesh2d.mesh[0].tolist())     # dp coordinate 0, every tp rank
    assert sum(math.prod(shard["shape"]) for shard in shards) == ARRAYS["a"].size
