"""Training end to end: a tensor-parallel model trained with AdamW and clipping ends where the
dense model ends; replicated parameters stay bit-identical across ranks; Module state round
trips."""
import numpy
import pytest

import cupytp
from cupytp import backend, nn
from cupytp.models.gpt2 import GPT2
from cupytp.optim import AdamW, decay_groups
from cupytp.tensor import Replicated, local_mesh
from dense_reference import full, lay_out
from small_gpt2 import CONFIG, train as train_steps

def train(model, steps):
    """`steps` clipped AdamW steps on small_gpt2's fixed batch; the loss of every step."""
    return train_steps(model, AdamW(decay_groups(model.parameters(), 0.1), lr=3e-3), steps)


def tp_size(mesh):
    return mesh.shape[nn.tp_dim(mesh)]


@pytest.mark.parametrize("steps", [10])
def test_tensor_parallel_training_ends_like_dense(mesh, steps):
    if CONFIG.n_head % tp_size(mesh):
        pytest.skip("heads do not split")
    cupytp.manual_seed(1)
    dense = GPT2(CONFIG).to("fp64")
    cupytp.manual_seed(1)
    parallel = GPT2(CONFIG, mesh).to("fp64")
    dense_losses = train(dense, steps)
    parallel_losses = train(parallel, steps)
    numpy.testing.assert_allclose(parallel_losses, dense_losses, rtol=1e-10)
    assert dense_losses[-1] < dense_losses[0]
    for (name, pd), (_, pp) in zip(dense.named_parameters(), parallel.named_parameters()):
        numpy.testing.assert_allclose(full(pp), full(pd), rtol=1e-9, atol=1e-12, err_msg=name)


def test_replicated_parameters_bit_identical_across_ranks(mesh):
    if CONFIG.n_head % tp_size(mesh):
        pytest.skip("heads do not split")
    cupytp.manual_seed(2)
    model = GPT2(CONFIG, mesh)
    train(model, 5)
    for name, p in model.named_parameters():
        for dim, placement in enumerate(p.placements):
            if placement == Replicated():
                group = mesh.get_process_group(dim)
                copies = group.all_gather_object(backend.asnumpy(p.to_local()).tobytes())
                assert all(c == copies[0] for c in copies), f"{name} drifted on mesh dim {dim}"
    cupytp.distributed.barrier()


def test_state_dict_round_trips(mesh):
    if CONFIG.n_head % tp_size(mesh):
        pytest.skip("heads do not split")
    cupytp.manual_seed(3)
    source = GPT2(CONFIG, mesh)
    cupytp.manual_seed(4)
    target = GPT2(CONFIG, mesh)
    target.load_state_dict(source.state_dict())                      # sharded → sharded
    for (name, a), (_, b) in zip(source.named_parameters(), target.named_parameters()):
        numpy.testing.assert_array_equal(full(b), full(a), err_msg=name)
    cupytp.manual_seed(5)
    dense = GPT2(CONFIG)
    dense.load_state_dict({n: full(t) for n, t in source.state_dict().items()})   # full arrays
    for (name, a), (_, b) in zip(source.named_parameters(), dense.named_parameters()):
        numpy.testing.assert_array_equal(full(b), full(a), err_msg=name)
    with pytest.raises(KeyError, match="missing keys"):
        target.load_state_dict({})


def test_module_modes_and_casts(world):
    block = nn.DBlock(8, 2)
    assert all(m.training for m in block.modules())
    block.eval()
    assert not any(m.training for m in block.modules())
    block.to("fp64")
    assert all(p.dtype == numpy.float64 for p in block.parameters())
    names = [n for n, _ in block.named_parameters()]
    assert names[:2] == ["ln_1.weight", "ln_1.bias"] and "attn.c_attn.weight" in names
    model = nn.Sequential(nn.DLinear(3, 4), nn.GeLU(), nn.DLinear(4, 2))
    assert len(model) == 3 and len(model.parameters()) == 4
    out = model(lay_out(numpy.ones((5, 3), numpy.float32), local_mesh(), (Replicated(),)))
    assert out.shape == (5, 2)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    model.zero_grad()
    assert all(p.grad is None for p in model.parameters())



def test_gradient_buffers_persist_between_steps(mesh):
    """zero_grad(set_to_none=False) keeps every gradient buffer: the next backward adds into the
    same arrays (stable addresses for the fused optimizer), with the same values as fresh ones."""
    if CONFIG.n_head % tp_size(mesh):
        pytest.skip("heads do not split")
    cupytp.manual_seed(6)
    model = GPT2(CONFIG, mesh)
    optimizer = AdamW(decay_groups(model.parameters(), 0.1), lr=1e-3)
    ids = numpy.random.default_rng(1).integers(0, CONFIG.vocab_size, size=(2, 9))
    replicated = (Replicated(),) * mesh.ndim

    def backward():
        _, loss = model(lay_out(ids[:, :-1], mesh, replicated),
                        lay_out(ids[:, 1:], mesh, replicated))
        loss.backward()
    backward()
    buffers = {name: p.grad.to_local() for name, p in model.named_parameters()}
    first = {name: backend.asnumpy(b).copy() for name, b in buffers.items()}
    optimizer.zero_grad(set_to_none=False)
    backward()
    for name, p in model.named_parameters():
        assert p.grad.to_local() is buffers[name], name
        numpy.testing.assert_allclose(backend.asnumpy(p.grad.to_local()), first[name],
                                      rtol=1e-6, atol=1e-7, err_msg=name)
