"""Construction on the mesh, on 1, 2 and 4 ranks: a GPT-2 built deferred, fully sharded, then
materialized allocates on each rank at most its shard plus one group's parameters (measured by
tracemalloc, which sees every NumPy array), and equals the dense model built on one rank:
the same parameters, then the same five training steps (float64)."""
import dataclasses
import tracemalloc

import numpy
import pytest

import cupytp
from cupytp import backend, memory, nn
from cupytp.models.gpt2 import GPT2, GPT2Config
from cupytp.optim import AdamW, decay_groups
from cupytp.parallel import fully_shard, replicate
from cupytp.tensor import Replicated, Shard, deferred
import small_gpt2
from dense_reference import full, lay_out

# every parameter splits unevenly over 4 ranks somewhere; 8 layers: a group is 1/8 of them
CONFIG = GPT2Config(vocab_size=101, block_size=16, n_layer=8, n_head=3, n_embd=48)
IDS = numpy.random.default_rng(0).integers(0, CONFIG.vocab_size, size=(8, 17))


def train(model, rows):
    """Five clipped AdamW steps on IDS laid out with `rows`; the losses."""
    optimizer = AdamW(decay_groups(model.named_parameters(), 0.1), lr=3e-3)
    return small_gpt2.train(model, optimizer, 5, IDS, rows)


def build_sharded(mesh):
    """The model built deferred in float64, fully sharded (one layer per group), materialized:
    (model, peak traced bytes of the deferred phases, peak traced bytes overall)."""
    cupytp.manual_seed(1)
    tracemalloc.start()
    try:
        with cupytp.deferred_init():
            model = GPT2(CONFIG).to("fp64")
        fully_shard(model, mesh, group_bytes=0)
        objects = tracemalloc.get_traced_memory()[1]     # Python objects, no parameter data
        cupytp.materialize(model)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return model, objects, peak


def test_fsdp_construction_allocates_a_shard_and_equals_the_dense_model(world, monkeypatch):
    monkeypatch.setattr(deferred, "CHUNK_ELEMENTS", 1 << 10)    # a fill's working arrays
    mesh = cupytp.DeviceMesh((world.world_size,), ("dp",))
    model, objects, peak = build_sharded(mesh)
    dense_bytes = sum(p.size for p in model.parameters()) * 8
    shard = sum(p.to_local().nbytes for p in model.parameters())
    group = max(g.nbytes() for g in model.fsdp_groups[1:])
    assert peak - objects <= shard + group, (peak - objects, shard, group)
    if world.world_size == 4:
        assert shard + group < dense_bytes / 2      # the bound says something
    cupytp.manual_seed(1)
    dense = GPT2(CONFIG).to("fp64")
    got = {name: full(t) for name, t in model.state_dict().items()}
    for name, t in dense.state_dict().items():
        numpy.testing.assert_array_equal(got[name], full(t), err_msg=name)
    numpy.testing.assert_allclose(train(model, (Shard(0),)), train(dense, (Replicated(),)),
                                  rtol=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not backend.on_gpu, reason="the memory pool is on GPUs")
def test_fsdp_construction_peak_of_the_pool_is_a_shard(world, monkeypatch):
    """On GPUs: the pool's peak while building a 24 x 256 GPT (fp32) under FSDP is this rank's
    shard plus one group, and the pool holds no more than the shard after."""
    monkeypatch.setattr(deferred, "CHUNK_ELEMENTS", 1 << 14)
    mesh = cupytp.DeviceMesh((world.world_size,), ("dp",))
    config = dataclasses.replace(CONFIG, n_layer=24, n_embd=256, n_head=4, vocab_size=5000)
    memory.empty_cache()
    before = memory.memory_stats()["allocated_bytes"]
    memory.reset_peak_memory_stats()
    with cupytp.deferred_init():
        model = GPT2(config)
    fully_shard(model, mesh, group_bytes=0)
    cupytp.materialize(model)
    stats = memory.memory_stats()
    shard = sum(p.to_local().nbytes for p in model.parameters())
    group = max(g.nbytes() for g in model.fsdp_groups[1:])
    slack = 64 * 2 ** 10 * 8 * 16      # a fill's working arrays, and block rounding
    assert stats["allocated_bytes_peak"] - before <= shard + group + slack
    assert stats["allocated_bytes"] - before <= shard + slack


def test_tensor_and_data_parallel_construction_on_a_2d_mesh(world, mesh2d):
    """GPT2(config, mesh) inside deferred_init(), then replicated over dp and materialized:
    each rank holds only its tensor-parallel blocks, equal to the dense model's."""
    config = dataclasses.replace(CONFIG, n_head=2, n_embd=10)
    cupytp.manual_seed(2)
    with cupytp.deferred_init():
        model = GPT2(config, mesh2d).to("fp64")
    replicate(model, mesh2d)
    assert not nn.is_materialized(model)
    cupytp.materialize(model)
    cupytp.manual_seed(2)
    dense = GPT2(config).to("fp64")
    for (name, p), (_, q) in zip(model.named_parameters(), dense.named_parameters()):
        numpy.testing.assert_array_equal(full(p), full(q), err_msg=name)
        assert p.local_shape == p.layout.local_shape
    numpy.testing.assert_allclose(train(model, (Shard(0), Replicated())),
                                  train(dense, (Replicated(),)), rtol=1e-12)


def test_layouts_are_chosen_only_before_materializing(world):
    mesh = cupytp.DeviceMesh((world.world_size,), ("dp",))
    with cupytp.deferred_init():
        model = GPT2(CONFIG)
    x = lay_out(IDS[:, :-1], mesh, (Shard(0),))
    with pytest.raises(cupytp.tensor.DeferredError, match="materialize"):
        model(x)
    fully_shard(model, mesh)
    cupytp.materialize(model)
    with pytest.raises(ValueError, match="materialized already"):
        deferred.pad(model.transformer.wpe.weight, (32, CONFIG.n_embd))
