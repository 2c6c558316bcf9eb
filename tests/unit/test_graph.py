"""cupytp.graph: the captured-step API on the CPU backend (runs eagerly, same results), and the
host bookkeeping that a replay relies on (RNG offsets, optimizer scalars), checked by driving
the GraphState hooks as a capture would. The capture itself runs on GPUs (tests/mpi/test_graph.py).
"""
import numpy
import pytest

import cupytp
from cupytp import backend, graph, nn
from cupytp.launchers.adamw import adamw_scalars
from cupytp.optim import AdamW, LRScheduler, clip_grad_norm_, constant
from cupytp.tensor import Generator, Replicated, from_local

cpu_only = pytest.mark.skipif(backend.on_gpu, reason="drives the capture hooks on NumPy arrays")


@pytest.fixture(autouse=True)
def runtime():
    return cupytp.init()


class FakeCapture:
    """Run code as if a capture were in progress (the hooks only; nothing is recorded)."""

    def __enter__(self):
        self.capture = graph._Capture()
        graph._state.capture = self.capture
        return self.capture

    def __exit__(self, *exc):
        graph._state.capture = None
        self.capture.end()


def small_model(seed=0):
    cupytp.manual_seed(seed)
    return nn.DMLP(6, 10, dropout=0.25)


def batch(seed):
    rng = numpy.random.default_rng(seed)
    mesh = cupytp.local_mesh()
    return from_local(backend.asarray(rng.standard_normal((4, 6))), mesh, (Replicated(),))


def make_step(model, optimizer):
    def step(x):
        loss = (model(x) ** 2).mean()
        loss.backward()
        clip_grad_norm_(model.parameters(), 0.1)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        return loss
    return step


def test_cuda_graph_on_cpu_gives_eager_losses():
    runs = []
    for wrap in (lambda f: f, cupytp.cuda_graph):
        model = small_model()
        optimizer = AdamW(model.parameters(), lr=1e-2)
        step = wrap(make_step(model, optimizer))
        runs.append([step(batch(i)).item() for i in range(5)])
    assert runs[0] == runs[1]
    assert len(set(runs[0])) == 5


def test_cuda_graph_rejects_negative_warmup():
    with pytest.raises(ValueError, match="warmup must be >= 0"):
        cupytp.cuda_graph(lambda: None, warmup=-1)


@cpu_only
def test_generator_draws_in_a_capture_count_from_the_replay_base():
    eager, captured = Generator(7), Generator(7)
    shape, offsets = (3, 5), (0, 0)
    expected = [eager.uniform(shape, offsets, shape) for _ in range(6)]
    captured.uniform(shape, offsets, shape)           # one eager draw before the capture
    captured._bases[1] = 16         # as the first replay sets it (15 counters, rounded up to 4s)
    with FakeCapture() as capture:
        inside = [captured.uniform(shape, offsets, shape) for _ in range(2)]
    for drawn, reference in zip(inside, expected[1:3]):
        numpy.testing.assert_array_equal(drawn, reference)
    assert captured.offset == 16                     # the capture drew nothing for real
    (state, record), = capture.states
    assert state is captured and record["per_replay"] == 32
    for replay in range(2):                          # each replay: base = the eager offset
        capture.before_replay()
        assert int(captured._bases[1]) == 16 + 32 * replay
        assert captured.offset == 16 + 32 * (replay + 1)
    numpy.testing.assert_array_equal(captured.uniform(shape, offsets, shape), expected[5])


@cpu_only
def test_generator_reseeded_after_capture_is_an_error():
    generator = Generator(1)
    with FakeCapture() as capture:
        generator.uniform((2,), (0,), (2,))
    generator.manual_seed(2)
    with pytest.raises(cupytp.GraphCaptureError, match="reseeded"):
        capture.before_replay()


@cpu_only
def test_optimizer_in_a_capture_writes_its_scalars_before_each_replay():
    model = small_model()
    optimizer = AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    step = make_step(model, optimizer)
    step(batch(0))                                   # eager: states exist, step count 1
    group = optimizer.param_groups[0]
    with FakeCapture() as capture:
        step(batch(1))
    assert group["step"] == 1                        # the capture advanced nothing on the host
    scalars = optimizer._device_scalars[0]
    for replay, lr in ((2, 5e-3), (3, 1e-3)):
        group["lr"] = lr                             # a schedule outside the graph
        capture.before_replay()
        assert group["step"] == replay
        expected = adamw_scalars(lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                                 step=replay)
        numpy.testing.assert_array_equal(scalars, expected)


@cpu_only
def test_capture_errors_name_what_cannot_be_recorded():
    model = small_model()
    optimizer = AdamW(model.parameters(), lr=1e-2)
    scheduler = LRScheduler(optimizer, lambda s: constant(s, 1e-2))
    step = make_step(model, optimizer)
    with FakeCapture(), pytest.raises(cupytp.GraphCaptureError, match="first step"):
        step(batch(0))                               # no eager step: the states would be made
    step(batch(0))
    with FakeCapture(), pytest.raises(cupytp.GraphCaptureError, match="scheduler.step"):
        scheduler.step()


@cpu_only
def test_zero_grad_in_a_capture_drops_or_keeps_the_buffers_as_asked():
    """A captured step may drop its gradients (their memory then serves the next replay's
    forward pass) or zero them in place (they keep their addresses)."""
    model = small_model()
    optimizer = AdamW(model.parameters(), lr=1e-2)
    make_step(model, optimizer)(batch(0))
    buffers = [p.grad._local for p in model.parameters()]
    with FakeCapture():
        optimizer.zero_grad(set_to_none=False)
    assert all(p.grad._local is b for p, b in zip(model.parameters(), buffers))
    assert all(not b.any() for b in buffers)
    with FakeCapture():
        optimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert graph.capture_memo() is None
    with FakeCapture() as capture:
        assert graph.capture_memo() is capture.memo == {}


