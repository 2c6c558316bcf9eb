"""Pipeline parallelism on 1, 2 and 4 ranks: every schedule (GPipe, 1F1B, interleaved 1F1B,
ZB-H1) with 1, 2, 4 and 8 micro-batches, tied and untied embeddings, dropout 0.1, trains a GPT-2
like one rank training the same global batch (losses and every parameter after 5 clipped AdamW
steps, float64, 1e-12), with uneven micro-batches and recomputed blocks too; pp x tp and pp x dp
(replicated and fully sharded, each stage's gradients reduced once per step) on 4 ranks; each
schedule's bubble
measured in ticks is its table's and within 10% of its theory; CommTracer counts the
point-to-point traffic; a checkpoint saved at pp=2 loads at pp=1 and pp=4."""
import dataclasses
import json

import numpy
import pytest

import cupytp
from cupytp import checkpoint
from cupytp.debug import CommTracer
from cupytp.models.gpt2 import GPT2, GPT2Config
from cupytp.optim import AdamW, GradScaler, clip_grad_norm_, decay_groups
from cupytp.parallel import ContextParallel, pipeline
from cupytp.parallel.pipeline import PipelineError, format_schedule
from cupytp.tensor import Replicated, default_generator, local_mesh
from dense_reference import full, lay_out

CONFIG = GPT2Config(vocab_size=37, block_size=8, n_layer=8, n_head=2, n_embd=16, dropout=0.1)
UNTIED = dataclasses.replace(CONFIG, tie_word_embeddings=False)
IDS = numpy.random.default_rng(0).integers(0, CONFIG.vocab_size, size=(8, 9))
STEPS = 5
SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1"]
TOLERANCE = dict(rtol=1e-12, atol=1e-12)


def gpt2(config, mesh=None):
    """The float64 model every run starts from."""
    cupytp.manual_seed(1)
    return GPT2(config, mesh).to("fp64")


def optimizer(named):
    return AdamW(decay_groups(named, 0.1), lr=3e-3)


_dense = {}


def dense(config):
    """Losses and full parameters by name of one rank training the whole batch (kept per
    config: every rank computes the same)."""
    if config not in _dense:
        model = gpt2(config)
        adam = optimizer(model.named_parameters())
        losses = []
        mesh = local_mesh()
        for _ in range(STEPS):
            _, loss = model(lay_out(IDS[:, :-1], mesh, (Replicated(),)),
                            lay_out(IDS[:, 1:], mesh, (Replicated(),)))
            loss.backward()
            clip_grad_norm_(model.parameters(), 0.5)
            adam.step()
            adam.zero_grad()
            losses.append(full(loss))
        _dense[config] = numpy.array(losses), {n: full(p) for n, p in model.named_parameters()}
    return _dense[config]


def train(pipe, steps=STEPS, measure=None, adam=None):
    """`steps` clipped AdamW steps of a pipeline on IDS (with `adam`, else a new AdamW); the
    losses and the optimizer."""
    adam = adam or optimizer(pipe.named_parameters())
    losses = []
    for _ in range(steps):
        loss = pipe.step(IDS[:, :-1], IDS[:, 1:], measure=measure)
        clip_grad_norm_(pipe.parameters(), 0.5, pp_mesh=pipe.pp_mesh)
        adam.step()
        adam.zero_grad()
        losses.append(full(loss))
    return numpy.array(losses), adam


def gathered(pipe):
    """{name: full value} of every parameter of the whole pipelined model (every rank's)."""
    mine = {name: full(p) for name, p in pipe.named_parameters()}
    everyone = {}
    for theirs in pipe.pp_group.all_gather_object(mine):
        everyone.update(theirs)
    return everyone


def assert_trains_like_one_rank(pipe, config, measure=None):
    losses, _ = train(pipe, measure=measure)
    expected_losses, expected = dense(config)
    numpy.testing.assert_allclose(losses, expected_losses, **TOLERANCE)
    got = gathered(pipe)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        numpy.testing.assert_allclose(got[name], value, err_msg=name, **TOLERANCE)


@pytest.fixture(scope="module")
def pp_mesh(world):
    return cupytp.DeviceMesh((world.world_size,), ("pp",))


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("config", [CONFIG, UNTIED], ids=["tied", "untied"])
def test_every_schedule_trains_like_one_rank(pp_mesh, schedule, config):
    """pp = every rank, 1, 2, 4 and 8 micro-batches; the measured bubble (ticks) is the
    table's and within 10% of the schedule's theory."""
    for microbatches in (1, 2, 4, 8):
        pipe = pipeline(gpt2(config), pp_mesh, schedule=schedule, microbatches=microbatches)
        assert_trains_like_one_rank(pipe, config, measure="ticks")
        stats = pipe.stats
        assert stats.bubble == pytest.approx(pipe.schedule.timeline.bubble, abs=1e-12)
        assert abs(stats.bubble - stats.theoretical) <= 0.1 * stats.theoretical + 1e-12, stats
        assert stats.timeline.span == pipe.schedule.timeline.span
        assert format_schedule(pipe.schedule, stats.timeline) == str(pipe.schedule)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b", "zb_h1"])
def test_uneven_microbatches_and_recomputed_blocks_train_like_one_rank(pp_mesh, schedule):
    """The 8 rows in 3 micro-batches (3, 3, 2), the blocks recomputed in the backward (which
    runs outside the micro-batch's forward): dropout draws each micro-batch's masks as its rows
    of the whole batch's, the recomputation as its forward did."""
    model = gpt2(CONFIG)
    model.transformer.recompute = True
    pipe = pipeline(model, pp_mesh, schedule=schedule, microbatches=3)
    assert_trains_like_one_rank(pipe, CONFIG)


def test_names_and_stages(pp_mesh, world):
    """Every parameter lives on exactly one rank under its unpipelined name, the tied embedding
    once (the last stage's copy is not a parameter); the blocks are split contiguously."""
    pipe = pipeline(gpt2(CONFIG), pp_mesh, schedule="interleaved_1f1b", microbatches=2)
    names = pipe.pp_group.all_gather_object([n for n, _ in pipe.named_parameters()])
    flat = [n for theirs in names for n in theirs]
    assert sorted(flat) == sorted(n for n, _ in gpt2(CONFIG).named_parameters())
    bounds = pipe.layer_bounds
    assert len(bounds) == 2 * world.world_size and bounds[0][0] == 0
    assert bounds[-1][1] == CONFIG.n_layer
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert [s.index for s in pipe.stages] == pipe.schedule.stages_of(pipe.pp_rank)
    assert pipe.stages[0].is_first == (pipe.pp_rank == 0)


def test_a_cast_pipeline_trains_like_a_cast_model(pp_mesh):
    """`to()` casts the last stage's copy of the tied embedding too (float64 built, then
    float32: the losses of one rank's float32 model)."""
    mesh = local_mesh()
    with cupytp.no_grad():
        _, expected = gpt2(CONFIG).to("fp32")(*(lay_out(a, mesh, (Replicated(),))
                                                for a in (IDS[:, :-1], IDS[:, 1:])))
        pipe = pipeline(gpt2(CONFIG), pp_mesh, microbatches=2).to("fp32")
        loss = pipe.step(IDS[:, :-1], IDS[:, 1:])
    assert loss.dtype == numpy.float32
    numpy.testing.assert_allclose(full(loss), full(expected), rtol=1e-6)


def test_forward_only_step_gives_the_loss(pp_mesh):
    """Inside no_grad() a step runs only forwards, and gives the unpipelined loss."""
    model = gpt2(CONFIG)
    mesh = local_mesh()
    with cupytp.no_grad():
        _, expected = model(lay_out(IDS[:, :-1], mesh, (Replicated(),)),
                            lay_out(IDS[:, 1:], mesh, (Replicated(),)))
        for schedule in ("1f1b", "zb_h1"):
            pipe = pipeline(gpt2(CONFIG), pp_mesh, schedule=schedule, microbatches=3)
            loss = pipe.step(IDS[:, :-1], IDS[:, 1:])
            numpy.testing.assert_allclose(full(loss), full(expected), **TOLERANCE)
            assert all(p.grad is None for p in pipe.parameters())


def test_loss_scaling_scales_every_stage_and_skips_everywhere(pp_mesh):
    """With a GradScaler the last stage's losses are scaled before their backward, so every
    stage's gradients are scale times the unscaled ones; a non-finite gradient on the first
    stage only makes every stage skip the step and halve the scale."""
    plain = pipeline(gpt2(CONFIG), pp_mesh, microbatches=2)
    plain.step(IDS[:, :-1], IDS[:, 1:])
    pipe = pipeline(gpt2(CONFIG), pp_mesh, microbatches=2)
    scaler = GradScaler(init_scale=8.0, pp_mesh=pipe.pp_mesh)
    adam = optimizer(pipe.named_parameters())
    before = {n: full(p) for n, p in pipe.named_parameters()}
    loss = pipe.step(IDS[:, :-1], IDS[:, 1:], scaler=scaler)
    numpy.testing.assert_allclose(full(loss), dense(CONFIG)[0][0], **TOLERANCE)
    for p, q in zip(pipe.parameters(), plain.parameters()):
        # equal but for the last bits: on a GPU the embedding gradient's atomic sums
        numpy.testing.assert_allclose(full(p.grad), 8.0 * full(q.grad), rtol=1e-14,
                                      atol=1e-16)     # take another order in each run
    if pipe.pp_rank == 0:
        pipe.parameters()[0].grad.to_local()[0] = numpy.inf
    scaler.step(adam)
    scaler.update()
    assert scaler.get_scale() == 4.0
    for name, p in pipe.named_parameters():
        numpy.testing.assert_array_equal(full(p), before[name], err_msg=name)


def test_comm_tracer_counts_the_point_to_point_traffic(pp_mesh, world):
    """One 1F1B step moves each activation forward and its gradient back once per stage
    boundary: 2 (pp - 1) m transfers of (B/m, T, C) float64 in all, each counted by the ranks
    on both sides (sent and received)."""
    if world.world_size == 1:
        pytest.skip("point-to-point needs 2 ranks")
    m = 4
    pipe = pipeline(gpt2(CONFIG), pp_mesh, schedule="1f1b", microbatches=m)
    pipe.step(IDS[:, :-1], IDS[:, 1:])                   # shapes learned; tied weights moved
    with CommTracer() as tracer:
        pipe.step(IDS[:, :-1], IDS[:, 1:])
    rows = [r for r in json.loads(tracer.to_json())["rows"] if r["op"] == "batch_isend_irecv"]
    moved = sum(r["bytes"] for r in rows)
    counts = pipe.pp_group.all_gather_object(moved)
    activation = IDS.shape[0] // m * (IDS.shape[1] - 1) * CONFIG.n_embd * 8
    tied = CONFIG.padded_vocab() * CONFIG.n_embd * 8     # weight forward, gradient back
    boundaries = world.world_size - 1
    assert sum(counts) == 2 * (2 * boundaries * m * activation) + 2 * 2 * tied
    assert {r["group"] for r in rows} == {pipe.pp_group.name}


def test_a_stage_error_is_named():
    """On every rank a one-stage pipeline of its own (pp=1): the error names the stage, the
    action and the micro-batch (tests/unit/test_pipeline_failures.py: on several ranks)."""
    pipe = pipeline(gpt2(CONFIG), local_mesh(), dim="self", schedule="1f1b", microbatches=2)
    with pytest.raises(ValueError, match="at least 2 rows"):
        pipe.step(IDS[:1, :-1], IDS[:1, 1:])
    with pytest.raises(TypeError, match="step"):
        pipe(IDS)
    stage = pipe.stages[0]
    object.__setattr__(stage, "_parts", dataclasses.replace(stage._parts, embed=lambda x: 1 / 0))
    with pytest.raises(PipelineError, match="stage 0 .* forward.* of micro-batch 0: "
                                            "ZeroDivisionError"):
        pipe.step(IDS[:, :-1], IDS[:, 1:])


def test_dropout_switched_off_after_the_shapes_were_learned_is_named(world):
    """The stages' draws are learned with the shapes: a dropout switched off by hand before a
    later step of the same batch shape is an error naming the stage (on every rank a one-stage
    pipeline of its own)."""
    pipe = pipeline(gpt2(CONFIG), local_mesh(), dim="self", microbatches=2)
    pipe.step(IDS[:, :-1], IDS[:, 1:])
    for module in pipe.modules():
        if isinstance(module, cupytp.nn.Dropout):
            module.p = 0.0
    with pytest.raises(PipelineError, match="stage 0 .* micro-batch 0: .* drew 0 random "
                                            "counters .* where [0-9]+ were learned"):
        pipe.step(IDS[:, :-1], IDS[:, 1:])


def test_bad_arguments_are_one_clear_error(pp_mesh, world):
    with pytest.raises(ValueError, match="no dimension 'stages'"):
        pipeline(gpt2(CONFIG), pp_mesh, dim="stages")
    with pytest.raises(ValueError, match="unknown pipeline schedule 'pipedream'"):
        pipeline(gpt2(CONFIG), pp_mesh, schedule="pipedream")
    with pytest.raises(ValueError, match="give .* block counts"):
        pipeline(gpt2(CONFIG), pp_mesh, layers=[1] * (world.world_size + 1))
    with pytest.raises(ValueError, match="data_parallel='fully_shard' needs a 'dp'"):
        pipeline(gpt2(CONFIG), pp_mesh, data_parallel="fully_shard")
    with pytest.raises(TypeError, match="has no pipeline_parts"):
        pipeline(cupytp.nn.DLinear(4, 4), pp_mesh)


# ---- 2-D meshes (4 ranks) ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def four(world):
    if world.world_size != 4:
        pytest.skip("needs 4 ranks")


@pytest.mark.parametrize("schedule,microbatches", [("1f1b", 4), ("zb_h1", 2),
                                                   ("interleaved_1f1b", 2)])
def test_pp_x_tp_trains_like_one_rank(four, schedule, microbatches):
    """A 3-D (pp, dp, tp) mesh of 2 x 1 x 2: tensor parallelism inside each stage."""
    mesh = cupytp.DeviceMesh((2, 1, 2), ("pp", "dp", "tp"))
    pipe = pipeline(gpt2(CONFIG, mesh["dp", "tp"]), mesh, schedule=schedule,
                    microbatches=microbatches)
    assert pipe.parameters()[0].mesh == mesh["dp", "tp"]
    assert_trains_like_one_rank(pipe, CONFIG)


@pytest.mark.parametrize("schedule,data_parallel,reshard_after_forward", [
    ("1f1b", "replicate", False), ("zb_h1", "replicate", False),
    ("1f1b", "fully_shard", False), ("zb_h1", "fully_shard", False),
    ("interleaved_1f1b", "fully_shard", False), ("1f1b", "fully_shard", True)])
def test_pp_x_dp_trains_like_one_rank(four, schedule, data_parallel, reshard_after_forward):
    mesh = cupytp.DeviceMesh((2, 2), ("pp", "dp"))
    pipe = pipeline(gpt2(CONFIG), mesh, schedule=schedule, microbatches=2,
                    data_parallel=data_parallel, reshard_after_forward=reshard_after_forward)
    if data_parallel == "fully_shard":
        assert all(p.placements[0].is_shard() for p in pipe.parameters() if p.ndim == 2)
    assert_trains_like_one_rank(pipe, CONFIG)


@pytest.mark.parametrize("data_parallel", ["replicate", "fully_shard"])
@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1", "interleaved_1f1b"])
def test_pp_x_dp_reduces_each_stage_once_per_step(four, schedule, data_parallel):
    """Over 4 micro-batches, data parallelism moves each stage's gradients once per step, in
    its last backward (earlier ones only sum them): one all-reduce per bucket, or one
    reduce-scatter per group after one all-gather per group (the parameters gathered once are
    kept for every micro-batch), not one per micro-batch. Untied embeddings: no tied-weight
    traffic on dp."""
    mesh = cupytp.DeviceMesh((2, 2), ("pp", "dp"))
    pipe = pipeline(gpt2(UNTIED), mesh, schedule=schedule, microbatches=4,
                    data_parallel=data_parallel)
    pipe.step(IDS[:, :-1], IDS[:, 1:])
    with CommTracer() as tracer:
        pipe.step(IDS[:, :-1], IDS[:, 1:])
    # on dp (a group keeps the name of the first mesh over its ranks), apart from the loss's
    # packed float64 pair (its sum and count, one all-reduce each micro-batch)
    dp = pipe.stage_mesh.get_process_group("dp").name
    events = [(op, nbytes) for _, _, op, group, nbytes, _, _ in tracer.events if group == dp]
    ops = [op for op, nbytes in events if nbytes > 16]
    assert events.count(("all_reduce", 16)) in (0, 4)      # on the last stage's ranks
    calls = {op: ops.count(op) for op in ("all_reduce", "all_gather", "reduce_scatter")}
    if data_parallel == "replicate":
        buckets = sum(len(stage.dp_schedule.buckets) for stage in pipe.stages)
        assert calls == {"all_reduce": buckets, "all_gather": 0, "reduce_scatter": 0}
    else:
        groups = sum(1 for stage in pipe.stages for g in stage.fsdp_groups if g.sharded)
        assert calls == {"all_reduce": 0, "all_gather": groups, "reduce_scatter": groups}
        assert all(g.full is None for stage in pipe.stages for g in stage.fsdp_groups)


@pytest.mark.parametrize("schedule,data_parallel", [("1f1b", "replicate"), ("zb_h1", "replicate"),
                                                    ("interleaved_1f1b", "replicate")])
@pytest.mark.parametrize("config", [CONFIG, UNTIED], ids=["tied", "untied"])
def test_pp_x_cp_trains_like_one_rank(four, schedule, data_parallel, config):
    """A (pp, cp, tp) mesh of 2 x 2 x 1: each stage's attention a ring over cp (T = 8 in zigzag
    chunks of 2), the sequence and its positions laid out by the pipeline, dropout 0.1 drawn
    by position, gradients summed over cp (the last stage's tied copy's too)."""
    mesh = cupytp.DeviceMesh((2, 2, 1), ("pp", "cp", "tp"))
    stage_mesh = mesh["cp", "tp"]
    model = gpt2(config, stage_mesh)
    ContextParallel(stage_mesh).apply(model)
    pipe = pipeline(model, mesh, schedule=schedule, microbatches=2, data_parallel=data_parallel)
    assert pipe.context is not None and pipe.context.mesh == stage_mesh
    assert_trains_like_one_rank(pipe, config)


@pytest.mark.parametrize("dp", [1, 2])
def test_pp_x_cp_x_dp_fully_sharded_trains_like_one_rank(world, dp):
    """(pp, dp, cp) = (2, dp, 2) on 4 or 8 ranks: stages fully sharded over dp, their shards'
    gradients all-reduced over cp."""
    if world.world_size != 4 * dp:
        pytest.skip(f"needs {4 * dp} ranks")
    mesh = cupytp.DeviceMesh((2, dp, 2, 1), ("pp", "dp", "cp", "tp"))
    stage_mesh = mesh["dp", "cp", "tp"]
    model = gpt2(CONFIG, stage_mesh)
    ContextParallel(stage_mesh).apply(model)
    pipe = pipeline(model, mesh, schedule="1f1b", microbatches=2, data_parallel="fully_shard")
    assert_trains_like_one_rank(pipe, CONFIG)


def test_tied_copy_is_read_as_sent_under_autocast(pp_mesh):
    """bf16 autocast, the model built deferred (the last stage's copy of the tied embedding
    starts uninitialized): learning the shapes of a batch, in the step's autocast region, casts
    the copy before the first stage sends its values; the step reads the values sent. Two
    AdamW steps and an evaluation of a new batch shape give one rank's losses."""
    config = dataclasses.replace(CONFIG, dropout=0.0)

    def run(model, step):
        adam, losses = AdamW(model.parameters(), lr=0.05), []
        for _ in range(2):
            with cupytp.autocast("bf16"):
                losses.append(float(full(step(IDS, True))))
            adam.step()
            adam.zero_grad()
        with cupytp.no_grad(), cupytp.autocast("bf16"):
            losses.append(float(full(step(IDS[:4], False))))
        return losses

    cupytp.manual_seed(1)
    dense_model, mesh = GPT2(config), local_mesh()

    def dense_step(rows, training):
        _, loss = dense_model(*(lay_out(a, mesh, (Replicated(),)) for a in (rows[:, :-1],
                                                                           rows[:, 1:])))
        if training:
            loss.backward()
        return loss
    expected = run(dense_model, dense_step)
    cupytp.manual_seed(1)
    with cupytp.deferred_init():
        model = GPT2(config)
    pipe = cupytp.materialize(pipeline(model, pp_mesh, microbatches=1))
    got = run(pipe, lambda rows, training: pipe.step(rows[:, :-1], rows[:, 1:]))
    numpy.testing.assert_allclose(got, expected, rtol=1e-6)


# ---- checkpoints ---------------------------------------------------------------------------------
def test_checkpoint_saved_at_pp2_loads_at_pp1_and_pp4(world, shared_dir):
    """Saved by a pp=2 pipeline (pp x dp on 4 ranks), a checkpoint holds the unpipelined names
    and loads into a model without pipeline and into a pp=4 pipeline, which then take the same
    next steps as the pp=2 run."""
    if world.world_size % 2:
        pytest.skip("needs an even number of ranks")
    mesh = cupytp.DeviceMesh((2, world.world_size // 2), ("pp", "dp"))
    pipe = pipeline(gpt2(CONFIG), mesh, schedule="1f1b", microbatches=2)
    _, adam = train(pipe, steps=2)
    checkpoint.save(shared_dir, 2, pipe, adam)
    rng = default_generator.get_state()         # the dropout masks go on from here
    with open(f"{shared_dir}/step-00000002/index.json") as f:
        saved = json.load(f)["tensors"]
    assert sorted(k[len("model/"):] for k in saved if k.startswith("model/")) == \
        sorted(n for n, _ in gpt2(CONFIG).named_parameters())
    default_generator.set_state(rng)
    later, _ = train(pipe, steps=2, adam=adam)
    # pp=1: the model without pipeline, whole on every rank
    model = gpt2(CONFIG)
    plain = optimizer(model.named_parameters())
    assert checkpoint.load(shared_dir, model, plain)["step"] == 2
    losses, mesh = [], local_mesh()
    default_generator.set_state(rng)
    for _ in range(2):
        _, loss = model(*(lay_out(a, mesh, (Replicated(),)) for a in (IDS[:, :-1], IDS[:, 1:])))
        loss.backward()
        clip_grad_norm_(model.parameters(), 0.5)
        plain.step()
        plain.zero_grad()
        losses.append(full(loss))
    numpy.testing.assert_allclose(losses, later, **TOLERANCE)
    if world.world_size == 4:
        four_stages = pipeline(gpt2(CONFIG), cupytp.DeviceMesh((4,), ("pp",)), microbatches=2)
        adam4 = optimizer(four_stages.named_parameters())
        checkpoint.load(shared_dir, four_stages, adam4)
        default_generator.set_state(rng)
        numpy.testing.assert_allclose(train(four_stages, 2, adam=adam4)[0], later,
                                      **TOLERANCE)


# ---- GPUs ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not cupytp.backend.on_gpu, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_captured_pipeline_steps_equal_eager_ones(pp_mesh, schedule):
    """A whole step (the schedule's transfers on NCCL, clipping over pp, AdamW) captured as a
    CUDA graph and replayed gives the eager steps' losses and parameters (device inputs: the
    loss weights are counted on the device)."""
    xp = cupytp.backend.xp

    def run(captured):
        pipe = pipeline(gpt2(UNTIED), pp_mesh, schedule=schedule, microbatches=2)
        adam = optimizer(pipe.named_parameters())

        def step(x, y):
            loss = pipe.step(x, y)
            clip_grad_norm_(pipe.parameters(), 0.5, pp_mesh=pipe.pp_mesh)
            adam.step()
            adam.zero_grad()
            return loss
        fn = cupytp.cuda_graph(step, warmup=2) if captured else step
        losses = [full(fn(xp.asarray(IDS[:, :-1]), xp.asarray(IDS[:, 1:]))) for _ in range(6)]
        return numpy.array(losses), gathered(pipe)
    eager, captured = run(False), run(True)
    numpy.testing.assert_allclose(captured[0], eager[0], rtol=1e-10)
    for name, value in eager[1].items():    # atol: the key bias, rounding noise (its gradient
        numpy.testing.assert_allclose(captured[1][name], value, rtol=1e-10, atol=1e-14,
                                      err_msg=name)           # is 0, summed in another order)
    assert eager[0][-1] < eager[0][0]


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_autocast_micro_batches_cast_for_themselves(pp_mesh, schedule):
    """bf16 autocast over 4 micro-batches, no recomputation: each micro-batch's forward makes
    its own recorded parameter casts (one cast shared by all would be freed by the first
    backward that walks it), and two steps' losses follow one rank's bf16 training."""
    config = dataclasses.replace(CONFIG, dropout=0.0)
    cupytp.manual_seed(1)
    model = GPT2(config)
    adam, mesh, expected = optimizer(model.named_parameters()), local_mesh(), []
    for _ in range(2):
        with cupytp.autocast("bf16"):
            _, loss = model(lay_out(IDS[:, :-1], mesh, (Replicated(),)),
                            lay_out(IDS[:, 1:], mesh, (Replicated(),)))
        loss.backward()
        adam.step()
        adam.zero_grad()
        expected.append(float(full(loss)))
    cupytp.manual_seed(1)
    pipe = pipeline(GPT2(config), pp_mesh, schedule=schedule, microbatches=4)
    adam, got = optimizer(pipe.named_parameters()), []
    for _ in range(2):
        with cupytp.autocast("bf16"):
            loss = pipe.step(IDS[:, :-1], IDS[:, 1:])
        adam.step()
        adam.zero_grad()
        got.append(float(full(loss)))
    numpy.testing.assert_allclose(got, expected, rtol=1e-2)
