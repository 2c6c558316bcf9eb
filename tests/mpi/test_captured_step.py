"""A training step captured as a CUDA graph against the same step run eagerly (GPU only): a small
GPT-2 on the mesh with dropout (replicated over dp on a 2-D mesh: bucketed all-reduces on the
communication stream inside the graph), a cosine schedule with warm-up, clipping that triggers
and gradient accumulation (under no_sync, the dropout of each micro-batch drawn as the whole
batch's: the micro-batch loop captured whole) gives bit for bit the same losses, norms and
parameters for 20 steps, with the gradients kept between steps or dropped at the end of each
(made inside the graph), and in fp16 with dynamic loss scaling whose skips and growth happen
inside the replays; replays allocate nothing; the capture refuses a host synchronization and
other input shapes with a clear error."""
import contextlib

import numpy
import pytest

import cupytp
from cupytp import backend, memory, nn
from cupytp.models.gpt2 import GPT2, GPT2Config
from cupytp.optim import (
    AdamW, GradScaler, LRScheduler, clip_grad_norm_, cosine_with_warmup, decay_groups)
from cupytp.parallel import replicate
from cupytp.tensor import Replicated, Shard
from dense_reference import full, lay_out

pytestmark = pytest.mark.skipif(not backend.on_gpu, reason="CUDA graphs need a GPU")

CONFIG = GPT2Config(vocab_size=67, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.1)
STEPS, MICRO = 20, 2


def batches(step, mesh):
    """MICRO (x, y) micro-batches of step `step`, one row per data-parallel rank. No token id
    repeats within a micro-batch and each rank has one row, so the embedding gradients (atomic
    adds) are exact sums of one term: eager runs are then bit-reproducible too."""
    rng = numpy.random.default_rng(step)
    placements = [Replicated()] * mesh.ndim
    placements[0] = Shard(0) if mesh.ndim == 2 else Replicated()
    rows = mesh.shape[0] if mesh.ndim == 2 else 1
    out = []
    for _ in range(MICRO):
        ids = rng.permutation(CONFIG.vocab_size)[:rows * 17].reshape(rows, 17)
        out.append((lay_out(ids[:, :-1], mesh, tuple(placements)),
                    lay_out(ids[:, 1:], mesh, tuple(placements))))
    return out


def train(mesh, captured, dtype=None, set_to_none=False):
    cupytp.manual_seed(3)
    model = GPT2(CONFIG, mesh)
    if mesh.ndim == 2:
        replicate(model, mesh, bucket_bytes=1 << 14)      # several buckets
    optimizer = AdamW(decay_groups(model.parameters(), 0.1), lr=1e-3)
    scheduler = LRScheduler(optimizer, lambda s: cosine_with_warmup(s, 3e-3, 5, STEPS))

    # fp16: a scale so large that the first steps overflow, are skipped and back it off, and a
    # short growth interval, so replays both skip and grow
    scaler = GradScaler(init_scale=2.0 ** 20, growth_interval=3, enabled=dtype == "fp16")

    def step(micro_batches):
        for i, (x, y) in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with contextlib.nullcontext() if last or mesh.ndim == 1 else model.no_sync():
                with cupytp.autocast(dtype), cupytp.microbatch(i, len(micro_batches)):
                    _, loss = model(x, y)
                scaler.scale(loss * (1.0 / len(micro_batches))).backward()
        scaler.unscale_(optimizer)
        norm = clip_grad_norm_(model.parameters(), 0.05)     # small: clipping triggers
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=set_to_none)
        return loss, norm

    run = cupytp.cuda_graph(step, warmup=2) if captured else step
    losses, norms, allocated = [], [], []
    for i in range(STEPS):
        loss, norm = run(batches(i % 3, mesh))     # three fixed batches: the loss falls
        losses.append(float(full(loss)))
        norms.append(float(norm))
        scheduler.step()
        allocated.append(memory.memory_stats()["allocated_bytes"])
    if scaler.is_enabled():
        assert 0 < optimizer.steps_skipped()[0] < STEPS // 2, optimizer.steps_skipped()
    return losses, norms, [full(p) for p in model.parameters()], allocated


@pytest.mark.parametrize("dtype,set_to_none", [(None, False), ("bf16", False), ("bf16", True),
                                               ("fp16", True)])
def test_captured_training_equals_eager(mesh, dtype, set_to_none):
    if CONFIG.n_head % mesh.shape[nn.tp_dim(mesh)]:
        pytest.skip("heads do not split")
    eager = train(mesh, False, dtype, set_to_none)
    captured = train(mesh, True, dtype, set_to_none)
    assert numpy.nanmax(eager[1]) > 0.05, "clipping never triggered"   # NaN: a skipped step
    assert eager[0][-1] < eager[0][0]
    numpy.testing.assert_array_equal(captured[0], eager[0])
    numpy.testing.assert_array_equal(captured[1], eager[1])
    for a, b in zip(captured[2], eager[2]):
        numpy.testing.assert_array_equal(a, b)
    replays = captured[3][3:]
    assert max(replays) == min(replays), f"memory grew across replays: {replays}"


@pytest.mark.parametrize("dtype", [None, "bf16"])
def test_captured_evaluation_equals_eager(mesh, dtype):
    """The loss of a model in eval mode (dropout configured, so off) under no_grad, captured
    and replayed: the eager forward's losses bit for bit, on batches and after parameter updates
    that come between replays; it draws no random numbers, records nothing, and replays
    allocate nothing."""
    if CONFIG.n_head % mesh.shape[nn.tp_dim(mesh)]:
        pytest.skip("heads do not split")
    cupytp.manual_seed(3)
    model = GPT2(CONFIG, mesh)
    if mesh.ndim == 2:
        replicate(model, mesh)          # the batch is split over dp: its gradients summed there
    optimizer = AdamW(model.parameters(), lr=1e-2)

    def loss_of(x, y):
        with cupytp.no_grad(), cupytp.autocast(dtype):
            return model(x, y)[1]
    captured = cupytp.cuda_graph(loss_of)
    for update in range(3):
        model.eval()
        drawn = cupytp.tensor.default_generator.offset
        for i in range(4):
            x, y = batches(i, mesh)[0]
            eager = full(loss_of(x, y))
            before, replay = memory.memory_stats()["allocated_bytes"], captured.graph is not None
            replayed = captured(x, y)
            if replay:                              # nothing allocated
                assert memory.memory_stats()["allocated_bytes"] == before
            assert replayed._node is None
            numpy.testing.assert_array_equal(full(replayed), eager)
        assert cupytp.tensor.default_generator.offset == drawn
        model.train()                       # a training step changes the parameters
        with cupytp.autocast(dtype):
            _, loss = model(*batches(update, mesh)[0])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def test_host_sync_inside_the_step_is_a_clear_error(mesh):
    model = nn.DLinear(8, 8, mesh)
    x = lay_out(numpy.ones((2, 8)), mesh, (Replicated(),) * mesh.ndim)

    def step(x):
        loss = model(x).sum()
        return loss.item()            # a host synchronization

    run = cupytp.cuda_graph(step, warmup=1)
    run(x)
    with pytest.raises(cupytp.GraphCaptureError,
                       match=r"host synchronization.*test_captured_step.py:\d+ in step"):
        run(x)


def test_other_input_shapes_are_a_clear_error(mesh):
    model = nn.DLinear(8, 8, mesh)
    replicated = (Replicated(),) * mesh.ndim
    run = cupytp.cuda_graph(lambda x: model(x).sum(), warmup=0)
    run(lay_out(numpy.ones((2, 8)), mesh, replicated))
    with pytest.raises(cupytp.GraphCaptureError, match="captured for inputs"):
        run(lay_out(numpy.ones((3, 8)), mesh, replicated))
