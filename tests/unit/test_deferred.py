"""Deferred construction on one process: builders inside deferred_init() allocate nothing and
reserve the random counters an eager build would; materialized, a tensor holds the dense
tensor's block in whatever layout it was given; a deferred tensor's data is refused with one
clear error; the deferred form of a 7B GPT-2 holds no parameter memory."""
import dataclasses
import tracemalloc

import numpy
import pytest

import cupytp
from cupytp import backend, nn
from cupytp.models.gpt2 import GPT2, GPT2Config, preset
from cupytp.tensor import (
    DeferredError, Replicated, Shard, default_generator, deferred, is_deferred, local_mesh)
from cupytp.tensor.layout import Layout

CONFIG = GPT2Config(vocab_size=61, block_size=16, n_layer=2, n_head=4, n_embd=16)


@pytest.fixture(scope="module", autouse=True)
def runtime():
    cupytp.init()


def values(model):
    return {name: backend.asnumpy(t.to_local()).copy() for name, t in model.state_dict().items()}


def test_builders_make_recipes_and_reserve_the_counters():
    mesh = local_mesh()
    cupytp.manual_seed(3)
    eager = [cupytp.randn((5, 7), mesh, std=0.5), cupytp.zeros((4,), mesh),
             cupytp.rand((3, 2), mesh, dtype="fp64"), cupytp.full((2,), 7.0, mesh)]
    after_eager = default_generator.get_state()
    cupytp.manual_seed(3)
    with cupytp.deferred_init():
        lazy = [cupytp.randn((5, 7), mesh, std=0.5), cupytp.zeros((4,), mesh),
                cupytp.rand((3, 2), mesh, dtype="fp64"), cupytp.full((2,), 7.0, mesh)]
    assert default_generator.get_state() == after_eager
    cupytp.manual_seed(99)                 # later draws do not change a recipe's values
    cupytp.randn((11,), mesh)
    for want, got in zip(eager, lazy):
        assert is_deferred(got) and got.dtype == want.dtype and got.local_shape == want.shape
        assert "deferred" in repr(got)
        deferred.materialize_tensor(got)
        assert not is_deferred(got)
        numpy.testing.assert_array_equal(got.numpy(), want.numpy())


@pytest.mark.parametrize("chunk", [deferred.CHUNK_ELEMENTS, 5])
def test_a_block_in_any_layout_is_the_dense_block(monkeypatch, chunk):
    """A deferred tensor relabelled to a (fake) sharded layout materializes exactly its block
    of the dense value, padding included, made whole or in pieces of rows."""
    monkeypatch.setattr(deferred, "CHUNK_ELEMENTS", chunk)
    mesh = local_mesh()
    cupytp.manual_seed(4)
    dense = cupytp.randn((9, 6), mesh).numpy()
    cupytp.manual_seed(4)
    with cupytp.deferred_init():
        t = cupytp.randn((9, 6), mesh)
        deferred.pad(t, (12, 6))
    assert t.shape == (12, 6)
    for offsets, shape in [((0, 0), (12, 6)), ((3, 2), (6, 3)), ((8, 0), (4, 6))]:
        block = backend.asnumpy(t._local.recipe.block(offsets, shape))
        want = numpy.zeros((12, 6), numpy.float32)
        want[:9] = dense
        numpy.testing.assert_array_equal(
            block, want[offsets[0]:offsets[0] + shape[0], offsets[1]:offsets[1] + shape[1]])
    with pytest.raises(ValueError, match="cannot pad"):
        deferred.pad(t, (4, 6))


def test_deferred_gpt2_equals_the_eager_one():
    cupytp.manual_seed(5)
    eager = GPT2(CONFIG)
    state = default_generator.get_state()
    cupytp.manual_seed(5)
    with cupytp.deferred_init():
        lazy = GPT2(CONFIG).to("fp64")
    assert default_generator.get_state() == state
    assert not nn.is_materialized(lazy) and lazy.transformer.wte.weight.shape == (64, 16)
    cupytp.materialize(lazy)
    assert nn.is_materialized(lazy)
    want = values(eager)
    for name, value in values(lazy).items():
        assert value.dtype == numpy.float64
        numpy.testing.assert_array_equal(value, want[name].astype(numpy.float64), err_msg=name)
    assert not want["transformer.wte.weight"][CONFIG.vocab_size:].any()     # padded rows: 0


def test_using_a_deferred_tensor_is_one_clear_error():
    with cupytp.deferred_init():
        model = GPT2(CONFIG)
        x = cupytp.zeros((2, 3), dtype="int64")
    assert is_deferred(x)
    ids = cupytp.from_local(numpy.zeros((1, 4), numpy.int64))
    with pytest.raises(DeferredError, match="call cupytp.materialize"):
        model(ids)
    with pytest.raises(DeferredError, match="has no values yet"):
        x.numpy()
    nn.materialize(model, initialize=False)
    assert nn.is_materialized(model)


def test_relayout_of_a_deferred_tensor_moves_nothing():
    from cupytp.parallel import relayout
    with cupytp.deferred_init():
        t = cupytp.randn((8, 4), requires_grad=True)
    mesh = cupytp.DeviceMesh((1,), ("dp",))
    relayout(t, mesh, (Shard(0),))
    assert is_deferred(t) and t.layout == Layout(mesh, (8, 4), (Shard(0),))
    assert t.requires_grad and t.local_shape == (8, 4)


def test_the_deferred_7b_model_holds_no_parameter_memory():
    """GPT-2 at 32 × 4096 (about 6.6 billion parameters, 26 GB in fp32) built deferred: the
    Python objects only, well under a megabyte per layer."""
    config = preset("124M", n_layer=32, n_head=32, n_embd=4096)
    tracemalloc.start()
    try:
        with cupytp.deferred_init():
            model = GPT2(config)
        allocated, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    parameters = sum(p.size for p in model.parameters())
    assert parameters > 6e9
    assert peak < 32 * 2 ** 20 and allocated < 32 * 2 ** 20, (allocated, peak)


def test_a_replicated_layout_of_the_same_model_on_a_mesh():
    """GPT2(config, mesh) is built deferred, laid out, then materialized block by block."""
    mesh = cupytp.DeviceMesh((1, 1), ("dp", "tp"))
    cupytp.manual_seed(6)
    dense = values(GPT2(CONFIG))
    cupytp.manual_seed(6)
    model = GPT2(dataclasses.replace(CONFIG), mesh)
    assert nn.is_materialized(model)
    assert model.transformer.wte.weight.placements == (Replicated(), Shard(0))
    for name, value in values(model).items():
        numpy.testing.assert_array_equal(value, dense[name], err_msg=name)
