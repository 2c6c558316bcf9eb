"""cupytp.debug: the CommTracer counts exactly the collectives a known layer issues, forward and
backward; visualize_sharding draws every rank's block as numpy.array_split places it."""
import json

import numpy
import pytest

import cupytp
from cupytp import nn
from cupytp.debug import CommTracer, visualize_sharding
from cupytp.parallel import replicate
from cupytp.parallel.data_parallel.buffers import aligned
from cupytp.tensor import Partial, Replicated, Shard
from dense_reference import lay_out, rng_array


@pytest.fixture(scope="module")
def dp_tp_mesh(world):
    """(world/2, 2): tensor parallelism over 2 ranks, data parallelism over the rest."""
    if world.world_size % 2:
        pytest.skip("needs an even number of ranks")
    return cupytp.DeviceMesh((world.world_size // 2, 2), ("dp", "tp"))


def counts(tracer):
    """{(phase, op, group): (calls, bytes)} from the tracer's JSON."""
    table = {}
    for row in json.loads(tracer.to_json())["rows"]:
        calls, nbytes = table.get((row["phase"], row["op"], row["group"]), (0, 0))
        table[row["phase"], row["op"], row["group"]] = (calls + row["calls"],
                                                       nbytes + row["bytes"])
    return table


def test_tracer_counts_the_collectives_of_a_tp_mlp(dp_tp_mesh):
    """DMLP at TP=2 (Megatron's f/g pair) under replicated data parallelism: forward, one
    all-reduce over tp of the output (B/dp, T, C); backward, one all-reduce over tp of the input
    gradient, and, when dp > 1, one all-reduce over dp of the bucket of the four parameters'
    gradients (Replicated over dp; each region starting at a multiple of ALIGN elements).
    Nothing else, every byte counted."""
    batch, seq, dim, hidden, item = 6, 5, 8, 20, 8
    dp = dp_tp_mesh.shape[0]
    mlp = replicate(nn.DMLP(dim, hidden, mesh=dp_tp_mesh, dtype="fp64"), dp_tp_mesh)
    x = lay_out(rng_array((batch, seq, dim), 1), dp_tp_mesh, (Shard(0), Replicated()),
                requires_grad=True)
    activation = batch // dp * seq * dim * item
    with CommTracer() as forward:
        y = mlp(x)
    with CommTracer() as backward:
        (y * y).sum().backward()
    tp_group, dp_group = (dp_tp_mesh.get_process_group(d).name for d in ("tp", "dp"))
    assert counts(forward) == {("forward", "all_reduce", tp_group): (1, activation)}
    expected = {("backward", "all_reduce", tp_group): (1, activation)}
    if dp > 1:      # c_proj's bias, c_proj's weight, c_fc's bias, c_fc's weight
        elements = aligned(aligned(aligned(dim) + dim * hidden // 2) + hidden // 2) + \
            dim * hidden // 2
        expected["backward", "all_reduce", dp_group] = (1, elements * item)
    assert counts(backward) == expected
    rows = json.loads(forward.to_json())["rows"] + json.loads(backward.to_json())["rows"]
    assert [r["module"] for r in rows if r["phase"] == "forward"] == ["ReplicateDMLP.c_proj"]
    assert all(r["module"].startswith("ReplicateDMLP") and r["time_ms"] >= 0 for r in rows)
    title, header, *lines = backward.table().splitlines()
    assert f": {1 + (dp > 1)} calls" in title, title
    assert header.split() == ["phase", "module", "op", "group", "calls", "bytes", "time", "(ms)"]
    assert len(lines) == len(json.loads(backward.to_json())["rows"])


def test_tracer_sees_async_and_outside_modules(mesh1d):
    x = lay_out(rng_array((4, 3), 2), mesh1d, (Partial(),))
    with CommTracer() as tracer:
        x.redistribute((Replicated(),), async_op=True).wait()
    expected = {("other", "all_reduce", mesh1d.get_process_group(0).name): (1, x.to_local().nbytes)}
    assert counts(tracer) == (expected if mesh1d.size() > 1 else {})


def spans(length, parts):
    """(start, stop) of each numpy.array_split chunk."""
    chunks = numpy.array_split(numpy.arange(length), parts)
    return [(int(c[0]), int(c[-1]) + 1) if c.size else None for c in chunks]


def test_visualize_sharding_1d_mesh(mesh1d):
    n = mesh1d.size()
    t = lay_out(rng_array((n + 1, 4), 3), mesh1d, (Shard(0),))
    text = visualize_sharding(t)
    for rank, span in enumerate(spans(n + 1, n)):
        assert f"rows {span[0]}:{span[1]}  rank {rank}" in text, text
    columns = lay_out(rng_array((3, 2 * n), 3), mesh1d, (Shard(1),))
    for rank, span in enumerate(spans(2 * n, n)):
        assert f"cols {span[0]}:{span[1]}" in visualize_sharding(columns)
    partial = visualize_sharding(lay_out(rng_array((5,), 4), mesh1d, (Partial(),)))
    ranks = ", ".join(map(str, range(n)))
    assert f"rank{'s' if n > 1 else ''} {ranks} (P)" in partial, partial
    assert "their sum over mesh dimension 'tp'" in partial


def test_visualize_sharding_2d_mesh(mesh2d, tmp_path):
    dp, tp = mesh2d.shape
    t = lay_out(rng_array((5, 7), 5), mesh2d, (Shard(0), Shard(1)))
    lines = visualize_sharding(t).splitlines()
    rows, cols = spans(5, dp), spans(7, tp)
    header = lines[1].split()
    assert header == [w for c in cols for w in ("cols", f"{c[0]}:{c[1]}")], lines
    for i, row in enumerate(rows):
        cells = lines[2 + i].split("  ")
        assert cells[0] == f"rows {row[0]}:{row[1]}"
        ranks = [int(c.split()[-1]) for c in cells[1:] if c.strip()]
        assert ranks == [int(mesh2d.mesh[i, j]) for j in range(tp)], lines
    mixed = visualize_sharding(lay_out(rng_array((4, 3, 2), 6), mesh2d, (Partial(), Shard(2))))
    for j, span in enumerate(spans(2, tp)):
        if span is None:
            continue
        holders = ", ".join(str(int(r)) for r in mesh2d.mesh[:, j])
        assert f"[0:4, 0:3, {span[0]}:{span[1]}]  rank{'s' if dp > 1 else ''} {holders} (P)" \
            in mixed, mixed
    picture = tmp_path / f"blocks{cupytp.distributed.get_rank()}.png"
    visualize_sharding(t, png=str(picture))
    assert picture.stat().st_size > 1000
