"""Data parallelism on 1, 2 and 4 ranks, against one rank training the global batch (float64):
replicated parameters with bucketed all-reduces (buckets of one parameter, of several, of the
whole model; gradient accumulation under no_sync; dropout on), on a dp × tp mesh, HSDP as
2 × 2; every split of one global batch over dp, fsdp, tp and micro-batches gives the losses of
one rank, and with dropout too (2, 4 and 5 micro-batches, replicated and fully sharded). Tied
weights are reduced once (CommTracer counts the collectives), buckets are launched while
backward is still running, and without an engine a gradient stays Partial: the tensor layer
moves no bytes for it, and the optimizer says what to do."""
import contextlib
import dataclasses

import numpy
import pytest

import cupytp
from cupytp import nn
from cupytp.autograd import engine
from cupytp.debug import CommTracer
from cupytp.models.gpt2 import GPT2, GPT2Config
from cupytp.optim import AdamW, clip_grad_norm_, decay_groups
from cupytp.parallel import DataParallelModule, fully_shard, replicate
from cupytp.parallel.data_parallel import ReplicateSchedule
from cupytp.tensor import Partial, Replicated, Shard, local_mesh
from dense_reference import full, lay_out

# n_embd 9: uneven shards over 2 and 4 ranks; 12 rows: 1, 2, 4 ranks × 1, 2, 3 micro-batches
CONFIG = GPT2Config(vocab_size=37, block_size=8, n_layer=2, n_head=3, n_embd=9)
TP_CONFIG = dataclasses.replace(CONFIG, n_head=2, n_embd=10)
IDS = numpy.random.default_rng(0).integers(0, CONFIG.vocab_size, size=(12, 9))
STEPS = 5


def gpt2(config=CONFIG, mesh=None):
    cupytp.manual_seed(1)
    return GPT2(config, mesh).to("fp64")


def train(model, mesh, rows, accum=1, steps=STEPS):
    """`steps` clipped AdamW steps on IDS split into `accum` micro-batches (all but the last
    under no_sync when the model is data-parallel; each drawing its dropout as its rows of the
    whole batch, `cupytp.microbatch`: by their number when their rows are equal, else by the
    rows of each); (the loss of each step, the parameters after, full, by name)."""
    optimizer = AdamW(decay_groups(model.named_parameters(), 0.1), lr=3e-3)
    bounds = [k * len(IDS) // accum for k in range(accum + 1)]
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    split = accum if len(set(sizes)) == 1 else sizes
    losses = []
    for _ in range(steps):
        total = 0.0
        for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
            x, y = (lay_out(t, mesh, rows) for t in (IDS[a:b, :-1], IDS[a:b, 1:]))
            sync = k == accum - 1 or not isinstance(model, DataParallelModule)
            share = (b - a) / len(IDS)              # of the whole batch's tokens
            with contextlib.nullcontext() if sync else model.no_sync(), \
                    cupytp.microbatch(k, split):
                _, loss = model(x, y)
                (loss * share).backward()
            total += float(full(loss)) * share
        clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses, {name: full(t) for name, t in model.state_dict().items()}


_dense = {}


def dense(config=CONFIG, dropout=0.0):
    """One rank's training of the whole batch (computed once per configuration)."""
    key = (config, dropout)
    if key not in _dense:
        _dense[key] = train(gpt2(dataclasses.replace(config, dropout=dropout)), local_mesh(),
                            (Replicated(),))
    return _dense[key]


def assert_trains_like(got, expected, rtol=1e-12):
    numpy.testing.assert_allclose(got[0], expected[0], rtol=rtol)
    assert got[1].keys() == expected[1].keys()
    for name, value in expected[1].items():
        numpy.testing.assert_allclose(got[1][name], value, rtol=1e-10, atol=1e-12, err_msg=name)


def dp_mesh(world):
    return cupytp.DeviceMesh((world.world_size,), ("dp",))


@pytest.mark.parametrize("bucket_bytes,accum", [(0, 1), (1 << 12, 1), (1 << 30, 1),
                                                (0, 2), (1 << 12, 3)])
def test_replicated_training_equals_one_rank(world, bucket_bytes, accum):
    mesh = dp_mesh(world)
    model = replicate(gpt2(), mesh, bucket_bytes=bucket_bytes)
    buckets, params = len(model.dp_schedule.buckets), len(model.parameters())
    assert {0: buckets == params, 1 << 30: buckets == 1}.get(bucket_bytes, 1 < buckets < params)
    assert_trains_like(train(model, mesh, (Shard(0),), accum), dense())


def test_replicated_training_with_dropout_equals_one_rank(world):
    """Dropout draws by global element index: every rank's rows get the masks one rank's
    batch would."""
    mesh = dp_mesh(world)
    model = replicate(gpt2(dataclasses.replace(CONFIG, dropout=0.2)), mesh)
    assert_trains_like(train(model, mesh, (Shard(0),)), dense(dropout=0.2))


@pytest.mark.parametrize("data_parallel", [replicate, fully_shard])
@pytest.mark.parametrize("accum,recompute", [(2, False), (4, False), (5, False), (4, True)])
def test_accumulation_with_dropout_equals_one_rank(world, data_parallel, accum, recompute):
    """Gradient accumulation under no_sync with dropout 0.2: each micro-batch (12 rows in 2 or
    4 equal ones, or 5 of 2 or 3 rows) draws its masks as its rows of the whole batch, so the
    steps are one rank's on the whole batch; recomputed blocks draw theirs again alike."""
    mesh = dp_mesh(world)
    model = gpt2(dataclasses.replace(CONFIG, dropout=0.2))
    model.transformer.recompute = recompute
    data_parallel(model, mesh)
    assert_trains_like(train(model, mesh, (Shard(0),), accum), dense(dropout=0.2))


def test_replicated_with_recomputed_blocks_equals_one_rank(world):
    """Blocks recomputed in backward: their parameters' gradients complete inside the
    recomputation's own walk, and their buckets go from there."""
    mesh = dp_mesh(world)
    model = gpt2()
    model.transformer.recompute = True
    replicate(model, mesh, bucket_bytes=0)
    assert_trains_like(train(model, mesh, (Shard(0),), accum=2), dense())


def test_replicated_on_a_dp_tp_mesh_equals_one_rank(world, mesh2d):
    model = replicate(gpt2(TP_CONFIG, mesh2d), mesh2d, bucket_bytes=1 << 12)
    assert_trains_like(train(model, mesh2d, (Shard(0), Replicated()), accum=2),
                       dense(TP_CONFIG))


def test_hsdp_2x2_equals_one_rank(world):
    """Sharded within pairs of ranks, replicated across the pairs: each group's gradient
    reduce-scattered over dp_shard, then the shard all-reduced over dp_replicate."""
    if world.world_size != 4:
        pytest.skip("HSDP 2 x 2 needs 4 ranks")
    mesh = cupytp.DeviceMesh((2, 2), ("dp_replicate", "dp_shard"))
    model = fully_shard(gpt2(), mesh, dim="dp_shard", replicate_dim="dp_replicate",
                        group_bytes=0)
    for p in model.parameters():
        assert p.placements[0] == Replicated() and (p.placements[1].is_shard() or p.ndim == 0)
    assert "replicate dp_replicate=2, shard dp_shard=2" in model.fsdp_summary()
    assert_trains_like(train(model, mesh, (Shard(0), Shard(0)), accum=2), dense())
    x, y = (lay_out(a, mesh, (Shard(0), Shard(0))) for a in (IDS[:, :-1], IDS[:, 1:]))
    with CommTracer() as tracer:
        model(x, y)[1].backward()
    calls = {}
    for r in tracer.rows():
        if r.phase != "forward":        # the last ones at the end of the pass ("other")
            calls[r.op, r.group] = calls.get((r.op, r.group), 0) + r.calls
    sharded = sum(1 for g in model.fsdp_groups if g.sharded)
    shard, replica = (mesh.get_process_group(d).name for d in ("dp_shard", "dp_replicate"))
    assert calls[("reduce_scatter", shard)] == sharded
    assert calls[("all_reduce", replica)] == sharded


@pytest.mark.parametrize("split", ["dp", "dp+accum", "fsdp", "fsdp+accum", "tp", "dp+tp",
                                   "hsdp"])
def test_every_split_of_the_global_batch_trains_alike(world, split):
    """One global batch of 12 rows over the ranks in every way the world allows: the losses
    and parameters of one rank training all 12 at once."""
    n = world.world_size
    accum = 2 if "accum" in split else 1
    if split in ("tp", "dp+tp"):
        config = TP_CONFIG
        shape = (1, n) if split == "tp" else (2, n // 2)
        if n % 2 or TP_CONFIG.n_head % shape[1] or (split == "dp+tp" and n < 4):
            pytest.skip(f"{split} does not fit {n} ranks")
        mesh = cupytp.DeviceMesh(shape, ("dp", "tp"))
        model = gpt2(config, mesh)
        if shape[0] > 1:
            replicate(model, mesh)
        rows = (Shard(0), Replicated())
    elif split == "hsdp":
        if n != 4:
            pytest.skip("hsdp needs 4 ranks")
        config, mesh = CONFIG, cupytp.DeviceMesh((2, 2), ("r", "s"))
        model, rows = fully_shard(gpt2(), mesh, dim="s", replicate_dim="r"), (Shard(0),) * 2
    else:
        config, mesh, rows = CONFIG, dp_mesh(world), (Shard(0),)
        model = (fully_shard if split.startswith("fsdp") else replicate)(gpt2(), mesh)
    assert_trains_like(train(model, mesh, rows, accum), dense(config))


def test_tied_weights_are_reduced_once_and_buckets_launch_during_backward(world):
    if world.world_size == 1:
        pytest.skip("collectives are counted on more than one rank")
    mesh = dp_mesh(world)
    model = replicate(gpt2(), mesh, bucket_bytes=0)
    schedule = model.dp_schedule
    wte = model.transformer.wte.weight
    assert model.lm_head._embedding.weight is wte
    assert sum(p is wte for b in schedule.buckets for p in b.params) == 1
    launched_in_walk = []
    launch = ReplicateSchedule._launch

    def spy(self, bucket):
        launched_in_walk.append(engine.in_backward())     # False at the end-of-pass flush
        return launch(self, bucket)
    x, y = (lay_out(a, mesh, (Shard(0),)) for a in (IDS[:, :-1], IDS[:, 1:]))
    ReplicateSchedule._launch = spy
    try:
        with CommTracer() as tracer:
            model(x, y)[1].backward()
    finally:
        ReplicateSchedule._launch = launch
    reduces = [r for r in tracer.rows() if r.op == "all_reduce" and r.phase == "backward"]
    assert sum(r.calls for r in reduces) == len(schedule.buckets) == len(model.parameters())
    # the forward's one: the mean loss's sum and token count, packed
    forward = [r for r in tracer.rows() if r.phase == "forward"]
    assert [(r.op, r.calls, r.bytes) for r in forward] == [("all_reduce", 1, 16)]
    assert sum(r.bytes for r in reduces) == sum(p.to_local().nbytes
                                                for p in model.parameters())
    # the embedding's bucket waits for its last use (the first layer); the others go while
    # backward still runs
    assert sum(launched_in_walk) >= len(schedule.buckets) - 2, launched_in_walk


def test_no_sync_sums_without_communicating(world):
    mesh = dp_mesh(world)
    model = replicate(gpt2(), mesh)
    halves = [IDS[:6], IDS[6:]]
    with CommTracer() as tracer, model.no_sync():
        for part in halves:
            _, loss = model(*(lay_out(a, mesh, (Shard(0),)) for a in (part[:, :-1],
                                                                       part[:, 1:])))
            (loss * 0.5).backward()
    assert not [r for r in tracer.rows() if r.phase == "backward"]
    for p in model.parameters():
        assert p.grad.placements == (Partial(),)
    partial = {name: full(p.grad) for name, p in model.named_parameters()}
    reference = gpt2()
    _, loss = reference(*(lay_out(a, local_mesh(), (Replicated(),))
                          for a in (IDS[:, :-1], IDS[:, 1:])))
    loss.backward()
    for name, p in reference.named_parameters():       # Partial: full() sums the ranks
        numpy.testing.assert_allclose(partial[name], full(p.grad), rtol=1e-10, atol=1e-13,
                                      err_msg=name)


@pytest.mark.parametrize("data_parallel", [replicate, fully_shard])
def test_finish_gradient_sync_reduces_what_passes_without_sync_summed(world, data_parallel):
    """Two halves of the batch with gradient sync off, then sync on and no backward (a pipeline
    stage whose last pass gives it no gradient): finish_gradient_sync() reduces each bucket or
    group once, into the gradients of one rank on the whole batch; called again it moves
    nothing."""
    mesh = dp_mesh(world)
    model = data_parallel(gpt2(), mesh)
    model.set_requires_gradient_sync(False)
    with CommTracer() as summing:
        for part in (IDS[:6], IDS[6:]):
            _, loss = model(*(lay_out(a, mesh, (Shard(0),)) for a in (part[:, :-1],
                                                                       part[:, 1:])))
            (loss * 0.5).backward()
    model.set_requires_gradient_sync(True)
    with CommTracer() as finishing:
        model.finish_gradient_sync()
    with CommTracer() as again:
        model.finish_gradient_sync()
    reductions = ("all_reduce", "reduce_scatter")
    assert not [r for r in summing.rows() if r.op in reductions and r.phase != "forward"]
    assert not again.rows()
    if world.world_size > 1:
        ops = [r.op for r in finishing.rows() for _ in range(r.calls)]
        if data_parallel is replicate:
            assert ops == ["all_reduce"] * len(model.dp_schedule.buckets)
        else:
            assert ops == ["reduce_scatter"] * sum(1 for g in model.fsdp_groups if g.sharded)
            assert all(g.full is None for g in model.fsdp_groups)
    reference = gpt2()
    _, loss = reference(*(lay_out(a, local_mesh(), (Replicated(),))
                          for a in (IDS[:, :-1], IDS[:, 1:])))
    loss.backward()
    got = dict(model.named_parameters())
    for name, p in reference.named_parameters():
        numpy.testing.assert_allclose(full(got[name].grad), full(p.grad), rtol=1e-10,
                                      atol=1e-13, err_msg=name)


def test_without_an_engine_a_gradient_stays_partial(world):
    """A parameter replicated over dp meets a batch sharded over dp: its gradient is each
    rank's sum, Partial, and nothing is communicated for it; the optimizer refuses it by
    name."""
    if world.world_size == 1:
        pytest.skip("a Partial gradient needs more than one rank")
    mesh = dp_mesh(world)
    w = lay_out(numpy.arange(6.0).reshape(3, 2), mesh, (Replicated(),), requires_grad=True)
    x = lay_out(numpy.ones((8, 3)), mesh, (Shard(0),))
    with CommTracer() as tracer:
        (x @ w).sum().backward()
    assert not tracer.rows()
    assert w.grad.placements == (Partial(),)
    numpy.testing.assert_array_equal(full(w.grad), numpy.full((3, 2), 8.0))
    with pytest.raises(ValueError, match=r"Partial over mesh dimension\(s\) \['dp'\].*"
                                         r"replicate\(model, mesh\)"):
        AdamW([w], lr=0.1).step()


def test_bad_calls_are_clear_errors(world):
    mesh = dp_mesh(world)
    with pytest.raises(ValueError, match="no dimension 'data'"):
        replicate(gpt2(), mesh, dim="data")
    with pytest.raises(ValueError, match="param_dtype and reduce_dtype are for sharded"):
        cupytp.parallel.data_parallel(gpt2(), mesh, replicate="dp", param_dtype="bf16")
    model = replicate(gpt2(), mesh)
    with pytest.raises(ValueError, match="data-parallel already"):
        fully_shard(model, mesh)
    with pytest.raises(ValueError, match="bucket_bytes must be >= 0"):
        replicate(gpt2(), mesh, bucket_bytes=-1)
    if world.world_size > 1:
        on_another_mesh = nn.DLinear(4, 8, cupytp.DeviceMesh((world.world_size,), ("tp",)))
        with pytest.raises(ValueError, match="not on DeviceMesh.*apply tensor parallelism on "
                                             "the same mesh"):
            replicate(on_another_mesh, mesh)


def test_a_dropped_model_takes_its_gradient_sinks_along(world):
    """The sinks are held weakly: a parameter outliving its data-parallel model accumulates
    into .grad again, and nothing of the model stays behind."""
    from cupytp.tensor import dtensor
    before = len(dtensor._grad_sinks)
    model = replicate(gpt2(), dp_mesh(world))
    weight = model.transformer.ln_f.weight
    assert len(dtensor._grad_sinks) == before + len(model.parameters())
    del model
    assert len(dtensor._grad_sinks) == before + 1       # the weight still lives
    (weight * weight).sum().backward()
    numpy.testing.assert_array_equal(full(weight.grad), 2 * full(weight))
    assert len(dtensor._grad_sinks) == before
