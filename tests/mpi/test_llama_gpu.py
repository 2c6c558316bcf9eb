"""A Llama training step on GPUs (bf16 autocast: the fused sublayers with the RMSNorm, rotary and
SiLU-gate kernels and flash attention over grouped key/value heads): captured as a CUDA graph it
gives bit for bit the eager step's losses and parameters; its loss and gradients agree with the
float32 model's within bf16 error, also under sequence and context parallelism."""
import dataclasses

import numpy
import pytest

import cupytp
from cupytp import backend, nn
from cupytp.models.llama import Llama
from cupytp.optim import AdamW, clip_grad_norm_, decay_groups
from cupytp.parallel import ContextParallel, replicate
from cupytp.tensor import Replicated, Shard
from dense_reference import full, lay_out
from small_llama import CONFIGS

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not backend.on_gpu, reason="the kernels' path needs a GPU")]

# head size 64 (the flash kernels'), 4 query heads over 2 key/value heads
CONFIG = dataclasses.replace(CONFIGS["llama-kv2-scaled"], vocab_size=67, hidden_size=256,
                             intermediate_size=160, num_attention_heads=4)


def test_config_takes_the_flash_path():
    assert CONFIG.head_size == 64 and CONFIG.num_key_value_heads == 2


def batch(step, mesh):
    """One row per data-parallel rank, no token id repeated within it (so the embedding's
    atomic adds are sums of one term: eager runs are bit-reproducible too)."""
    rows = mesh.shape[0] if mesh.ndim == 2 else 1
    placements = (Shard(0), Replicated()) if mesh.ndim == 2 else (Replicated(),)
    ids = numpy.random.default_rng(step).permutation(CONFIG.vocab_size)[:rows * 17]
    ids = ids.reshape(rows, 17)
    return lay_out(ids[:, :-1], mesh, placements), lay_out(ids[:, 1:], mesh, placements)


def train(mesh, captured, steps=6):
    cupytp.manual_seed(5)
    model = Llama(CONFIG, mesh)
    if mesh.ndim == 2:
        replicate(model, mesh)          # the batch is split over dp: its gradients summed there
    optimizer = AdamW(decay_groups(model.parameters(), 0.1), lr=1e-3)

    def step(x, y):
        with cupytp.autocast("bf16"):
            _, loss = model(x, y)
        loss.backward()
        clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    run = cupytp.cuda_graph(step) if captured else step
    losses = [float(full(run(*batch(i, mesh)))) for i in range(steps)]
    return losses, {name: full(p) for name, p in model.named_parameters()}


def test_captured_llama_step_equals_eager(mesh):
    if CONFIG.num_attention_heads % mesh.shape[nn.tp_dim(mesh)]:
        pytest.skip("heads do not split")
    eager, captured = train(mesh, False), train(mesh, True)
    assert eager[0] == captured[0]
    for name, value in eager[1].items():
        numpy.testing.assert_array_equal(captured[1][name], value, err_msg=name)


def test_bf16_step_agrees_with_float32(mesh):
    """The fused bf16 path (GPU kernels) against the float32 chain: loss and every gradient."""
    if CONFIG.num_attention_heads % mesh.shape[nn.tp_dim(mesh)]:
        pytest.skip("heads do not split")
    x, y = batch(0, mesh)

    def run(dtype):
        cupytp.manual_seed(7)
        model = Llama(CONFIG, mesh)
        with cupytp.autocast(dtype):
            _, loss = model(x, y)
        loss.backward()
        return float(full(loss)), {n: full(p.grad) for n, p in model.named_parameters()}

    loss16, grads16 = run("bf16")
    loss32, grads32 = run(None)
    assert abs(loss16 - loss32) < 2e-2 * abs(loss32)
    for name, want in grads32.items():
        got = grads16[name]
        assert numpy.linalg.norm(got - want) <= 5e-2 * numpy.linalg.norm(want) + 1e-6, name


@pytest.mark.parametrize("split", ["sequence", "context"])
def test_bf16_sequence_and_context_parallel_agree_with_float32(world, split):
    """Sequence parallelism over tp = 2 (attention as the chain, its input gathered once) and
    context parallelism over cp = 2 (the ring on the flash kernels over grouped heads, rotary
    angles at the permuted positions, the fused MLP on sequence-sharded rows), bf16 autocast:
    the loss and every gradient within bf16 error of one rank's float32 model."""
    if world.world_size != 2:
        pytest.skip("needs 2 ranks")
    tokens = numpy.random.default_rng(0).permutation(CONFIG.vocab_size)[:2 * 17].reshape(2, 17)
    cupytp.manual_seed(7)
    dense = Llama(CONFIG)
    one = cupytp.local_mesh()
    _, loss = dense(*(lay_out(a, one, (Replicated(),)) for a in (tokens[:, :-1], tokens[:, 1:])))
    loss.backward()
    loss32, grads32 = float(full(loss)), {n: full(p.grad) for n, p in dense.named_parameters()}
    cupytp.manual_seed(7)
    positions = None
    if split == "sequence":
        mesh = cupytp.DeviceMesh((2,), ("tp",))
        model = Llama(CONFIG, mesh, sequence_parallel=True)
        x, y = (lay_out(a, mesh, (Replicated(),)) for a in (tokens[:, :-1], tokens[:, 1:]))
    else:
        mesh = cupytp.DeviceMesh((2, 1), ("cp", "tp"))
        model = Llama(CONFIG, mesh)
        cp = ContextParallel(mesh)
        replicate(cp.apply(model), mesh, dim=("cp",))
        x, y = (cp.shard(lay_out(a, mesh, (Replicated(),) * 2))
                for a in (tokens[:, :-1], tokens[:, 1:]))
        positions = cp.positions(16)
    with cupytp.autocast("bf16"):
        _, loss = model(x, y, positions=positions)
    loss.backward()
    assert abs(float(full(loss)) - loss32) < 2e-2 * abs(loss32)
    for name, p in model.named_parameters():
        got, want = full(p.grad), grads32[name]
        assert numpy.linalg.norm(got - want) <= 5e-2 * numpy.linalg.norm(want) + 1e-6, name
