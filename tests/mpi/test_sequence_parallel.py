"""Sequence parallelism (activations Shard(1) along tp between the tensor-parallel regions): a
GPT-2 with dropout trains exactly like one rank (1-D and 2-D meshes, uneven sequence shards,
with and without recomputation); the collectives of a block are the design's (all-gather and
reduce-scatter where tensor parallelism all-reduces, the same bytes on the wire, plus the norms'
and row-parallel biases' gradients reduced over tp); the column-parallel rule alone, nested
inside a context-parallel shard of the same dimension."""
import json

import numpy
import pytest

import cupytp
from cupytp import nn
from cupytp.debug import CommTracer
from cupytp.tensor import Replicated, Shard
from dense_reference import full, lay_out, rng_array
from split_model import (BATCH, CONFIG, assert_trains_alike, batch, build, dense_run, train,
                         with_config)


def tensor_parallel(mesh):
    if mesh.size("tp") == 1:
        pytest.skip("needs 2 tensor-parallel ranks")
    if CONFIG.n_head % mesh.size("tp"):
        pytest.skip("the heads do not split")


@pytest.mark.parametrize("recompute,tied", [(False, True), (True, True), (False, False)])
def test_sequence_parallel_gpt2_trains_like_one_rank(mesh, recompute, tied):
    """T = 13 tokens over tp = 2 or 4 (uneven shards), dropout 0.1 everywhere, on a tp mesh
    and a (dp, tp) mesh, the LM head tied or with its own weight (the token embedding is
    vocab-parallel either way, so it starts the sequence-sharded stream): every loss and
    gradient of one rank's training."""
    tensor_parallel(mesh)
    config = with_config(tie_word_embeddings=tied)
    model = build(mesh, sequence_parallel=True, recompute=recompute, config=config)
    assert model.transformer.wte.sequence_parallel
    assert_trains_alike(train(model, mesh), dense_run(recompute, config))


def tp_group(mesh):
    """The name the tracer gives tp's group (one communicator per set of ranks: a group over
    the same ranks made earlier for another mesh keeps that mesh's name)."""
    return mesh.get_process_group("tp").name


def wire_bytes(row, ranks):
    """Bytes a ring algorithm puts on each rank's link for a CommTracer row (its bytes are
    this rank's input): all-reduce 2(n−1)/n, reduce-scatter (n−1)/n of the input, all-gather
    (n−1) times it."""
    factor = {"all_reduce": 2 * (ranks - 1) / ranks, "reduce_scatter": (ranks - 1) / ranks,
              "all_gather": ranks - 1}[row["op"]]
    return factor * row["bytes"]


def traced_rows(model, mesh):
    """The tracer's rows on the tp group of one training step on 12 tokens (even shards: every
    rank moves the same bytes)."""
    ids, targets, _ = batch(mesh, tokens=BATCH[:, :13])
    with CommTracer() as tracer:
        _, loss = model(ids, targets)
        loss.backward()
    return [r for r in json.loads(tracer.to_json())["rows"] if r["group"] == tp_group(mesh)]


def block_rows(model, mesh):
    """traced_rows' rows of the blocks (module GPT2.transformer.DBlock...), and those of the
    end of the backward pass (module "-", phase "other": the gradients reduced there)."""
    rows = traced_rows(model, mesh)
    return ([r for r in rows if r["module"].startswith("GPT2.transformer.DBlock")],
            [r for r in rows if r["module"] == "-" and r["phase"] == "other"])


def calls(rows, phase, op):
    return sum(r["calls"] for r in rows if r["phase"] == phase and r["op"] == op)


def test_sequence_parallel_moves_the_same_bytes_per_block(mesh1d):
    """Per block: tensor parallelism all-reduces twice forward and twice backward; sequence
    parallelism all-gathers and reduce-scatters instead (forward and backward, twice each),
    the same bytes on the wire. The gradients of the two LayerNorms' weight and bias and of the
    two row-parallel biases (C each), Partial along tp once the rows they sum over are split,
    are all-reduced at the end of the backward pass, every block's and the final LayerNorm's in
    one collective."""
    tensor_parallel(mesh1d)
    n, layers, itemsize = mesh1d.size("tp"), CONFIG.n_layer, 8
    plain, plain_end = block_rows(build(mesh1d), mesh1d)
    split, split_end = block_rows(build(mesh1d, sequence_parallel=True), mesh1d)
    assert {r["op"] for r in plain} == {"all_reduce"} and not plain_end
    assert (calls(plain, "forward", "all_reduce"), calls(plain, "backward", "all_reduce")) == \
        (2 * layers, 2 * layers)
    for phase in ("forward", "backward"):
        assert calls(split, phase, "all_gather") == calls(split, phase, "reduce_scatter") == \
            2 * layers
    assert "all_reduce" not in {r["op"] for r in split}
    assert [(r["op"], r["calls"], r["bytes"]) for r in split_end] == \
        [("all_reduce", 1, (6 * layers + 2) * CONFIG.n_embd * itemsize)]
    assert sum(wire_bytes(r, n) for r in split) == \
        pytest.approx(sum(wire_bytes(r, n) for r in plain))


def backward_all_reduces(model, mesh):
    """([(mesh dim, phase)] of each all-reduce of more than a scalar in one training step but
    its forward, the tracer's table) on 12 tokens of a (dp, tp) mesh."""
    ids, targets, _ = batch(mesh, tokens=BATCH[:, :13])
    with CommTracer() as tracer:
        _, loss = model(ids, targets)
        loss.backward()
    dims = {mesh.get_process_group(d).name: d for d in ("dp", "tp")}
    return ([(dims.get(group), phase) for phase, _, op, group, nbytes, _, _ in tracer.events
             if op == "all_reduce" and nbytes > 8 and phase != "forward"], tracer.table())


def test_replicated_data_parallel_reduces_the_norms_in_its_buckets(world):
    """On a (dp, tp) = (2, 2) mesh, replicated data parallelism over sequence parallelism packs
    the parameters whose gradients are Partial along tp (norms, row-parallel biases, the
    position table) into buckets all-reduced over dp and tp together: one tp all-reduce per
    such bucket in a step, none per parameter, and one dp all-reduce per bucket. (That training
    is one rank's: test_sequence_parallel_gpt2_trains_like_one_rank on the 2-D mesh.)"""
    if world.world_size != 4:
        pytest.skip("needs 4 ranks")
    mesh = cupytp.DeviceMesh((2, 2), ("dp", "tp"))
    model = build(mesh, sequence_parallel=True)
    schedule = model.dp_schedule
    joint = [b for b in schedule.buckets if schedule.bucket_dims[b.index] is not schedule.dims]
    tp = mesh.dim_names.index("tp")
    assert joint and {id(p) for b in joint for p in b.params} == \
        {id(p) for p in model.parameters() if p.placements[tp].is_replicated()}
    reductions, table = backward_all_reduces(model, mesh)
    assert sorted(reductions) == sorted([("dp", "backward")] * len(schedule.buckets) +
                                        [("tp", "backward")] * len(joint)), table


def test_sequence_parallel_fully_sharded_over_dp_trains_like_one_rank(world):
    """On a (dp, tp) = (2, 2) mesh the model is fully sharded over dp on top of sequence
    parallelism: every loss and gradient of one rank's training."""
    if world.world_size != 4:
        pytest.skip("needs 4 ranks")
    mesh = cupytp.DeviceMesh((2, 2), ("dp", "tp"))
    model = build(mesh, sequence_parallel=True, fsdp=True)
    assert_trains_alike(train(model, mesh), dense_run())


def test_fully_shard_reduces_the_norms_once_per_group(world):
    """Fully sharded over dp on a (dp, tp) = (2, 2) mesh: the gradients Partial along tp (norms,
    row-parallel biases, the position table) are all-reduced over tp once per group and
    backward pass, every such parameter of the group in one collective, before the group's
    reduce-scatter over dp."""
    if world.world_size != 4:
        pytest.skip("needs 4 ranks")
    mesh = cupytp.DeviceMesh((2, 2), ("dp", "tp"))
    model = build(mesh, sequence_parallel=True, fsdp=True)
    groups = model.dp_schedule.groups
    joint = [g for g in groups if g.joint]
    tp = mesh.dim_names.index("tp")
    assert {id(s.master) for g in joint for s in g.slots if s.joint} == \
        {id(p) for p in model.parameters() if p.placements[tp].is_replicated()}
    reductions, table = backward_all_reduces(model, mesh)
    assert [dim for dim, _ in reductions].count("tp") == len(joint), table


def test_column_parallel_gathers_a_sequence_sharded_input(world):
    """A column-parallel layer on x (B, T, C) sharded on T along tp — and along cp too, outside
    it, on a (cp, tp) mesh: one all-gather over tp forward, one reduce-scatter over tp
    backward (not an all-reduce and a slice), the dense values and gradients, x's gradient
    laid out like x."""
    n = world.world_size
    if n == 1:
        pytest.skip("needs 2 ranks")
    shape = (2, n // 2) if n % 2 == 0 and n > 2 else (1, n)
    mesh = cupytp.DeviceMesh(shape, ("cp", "tp"))
    xv, gv = rng_array((2, 7, 6), 1), rng_array((2, 7, 10), 2)
    cupytp.manual_seed(3)
    dense = nn.DLinear(6, 10, dtype="fp64")
    cupytp.manual_seed(3)
    layer = nn.DColumnLinear(6, 10, mesh, dtype="fp64")
    expected = full(dense(cupytp.from_local(xv)))
    x = lay_out(xv, mesh, (Shard(1), Shard(1)), requires_grad=True)
    with CommTracer() as tracer:
        y = layer(x)
        (y * lay_out(gv, mesh, (Replicated(), Replicated()))).sum().backward()
    numpy.testing.assert_allclose(full(y), expected, rtol=1e-13)
    assert y.placements == (Shard(1), Shard(2))
    assert x.grad.placements == x.placements
    numpy.testing.assert_allclose(full(x.grad), gv @ full(layer.weight).T, rtol=1e-12)
    numpy.testing.assert_allclose(full(layer.weight.grad),
                                  numpy.einsum("btc,btd->cd", xv, gv), rtol=1e-12)
    ops = [(r["phase"], r["op"]) for r in json.loads(tracer.to_json())["rows"]
           if r["group"] == tp_group(mesh)]
    assert ops == [("forward", "all_gather"), ("backward", "reduce_scatter")]
