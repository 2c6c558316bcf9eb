"""Fully sharded data parallelism on 1, 2 and 4 ranks: N-rank training ends where 1-rank training
of the same global batch ends (float64, AdamW with clipping, uneven shards and batch rows, with
and without grouping, with gradient accumulation under no_sync, on a (dp, tp) mesh); each rank
holds 1/N of parameters, gradients and optimizer states and no full parameter after a group's
forward; grouping gathers 1000 tiny layers in a few collectives, and each group is reduced once
per step; state dicts and checkpoints
move between FSDP, dense and tensor-parallel models."""
import contextlib
import dataclasses
import gc
import re
import weakref

import numpy
import pytest

import cupytp
from cupytp import checkpoint, nn
from cupytp.debug import CommTracer
from cupytp.models.gpt2 import GPT2, GPT2Config
from cupytp.optim import AdamW, clip_grad_norm_, decay_groups
from cupytp.parallel import FSDPModule, fully_shard
from cupytp.tensor import Replicated, Shard
from dense_reference import full, lay_out

# n_embd 9: every parameter splits unevenly over 2 and 4 ranks somewhere; 6 batch rows
CONFIG = GPT2Config(vocab_size=37, block_size=8, n_layer=2, n_head=3, n_embd=9)
# every dimension a multiple of 4: gathered shards join by one strided copy per parameter
EVEN = GPT2Config(vocab_size=40, block_size=8, n_layer=2, n_head=2, n_embd=8)
IDS = numpy.random.default_rng(0).integers(0, CONFIG.vocab_size, size=(6, 9))


def gpt2(config=CONFIG, mesh=None, dtype="fp64"):
    cupytp.manual_seed(1)
    return GPT2(config, mesh).to(dtype)


def train(model, steps=10, accum=1, dp_placements=(Replicated(),)):
    """`steps` clipped AdamW steps on IDS (split into `accum` micro-batches, all but the last
    under no_sync when the model has it); the parameters after them, full, by name."""
    mesh = model.parameters()[0].mesh
    optimizer = AdamW(decay_groups(model.named_parameters(), 0.1), lr=3e-3)
    for _ in range(steps):
        for k in range(accum):
            rows = IDS[k::accum]
            x, y = (lay_out(a, mesh, dp_placements) for a in (rows[:, :-1], rows[:, 1:]))
            last = k == accum - 1
            sync = last or not isinstance(model, FSDPModule)
            with contextlib.nullcontext() if sync else model.no_sync():
                _, loss = model(x, y)
                (loss * (1.0 / accum)).backward()
        clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
    return {name: full(t) for name, t in model.state_dict().items()}, optimizer


def assert_params_close(got, expected, rtol=1e-10, atol=1e-12):
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        numpy.testing.assert_allclose(got[name], value, rtol=rtol, atol=atol, err_msg=name)


def assert_model_close(got, expected, tolerance):
    """All parameters as one vector: |got - expected| <= tolerance |expected|."""
    got, expected = (numpy.concatenate([v.ravel() for v in d.values()]) for d in (got, expected))
    assert numpy.linalg.norm(got - expected) <= tolerance * numpy.linalg.norm(expected)


@pytest.mark.parametrize("group_bytes,accum,dtype,tolerance,config", [
    (0, 1, "fp64", 1e-10, CONFIG), (1 << 20, 1, "fp64", 1e-10, CONFIG),
    (1 << 20, 2, "fp64", 1e-10, CONFIG), (1 << 20, 1, "fp32", 1e-5, CONFIG),
    (0, 2, "fp64", 1e-10, EVEN)])
def test_fsdp_training_ends_like_one_rank(world, group_bytes, accum, dtype, tolerance, config):
    dense, _ = train(gpt2(config, dtype=dtype), accum=accum)
    mesh = cupytp.DeviceMesh((world.world_size,), ("dp",))
    model = fully_shard(gpt2(config, dtype=dtype), mesh, group_bytes=group_bytes)
    got, optimizer = train(model, accum=accum, dp_placements=(Shard(0),))
    if dtype == "fp64":
        assert_params_close(got, dense, tolerance, tolerance * 0.1)
    # fp32 sums in another order; Adam magnifies that where a gradient is ~0 (the key bias)
    assert_model_close(got, dense, tolerance)
    for p in model.parameters():     # masters, gradients' layout, optimizer states: shards
        assert p.placements[0].is_shard() or p.ndim == 0
        assert all(s.placements == p.placements for s in optimizer.state[p].values())


@pytest.mark.parametrize("group_bytes,accum", [(0, 1), (1 << 20, 1), (1 << 20, 2)])
def test_fsdp_with_recomputed_blocks_ends_like_one_rank(world, group_bytes, accum):
    """Blocks recomputed in backward (GPT2 recompute) inside groups of one or several layers:
    the recomputation gathers its group again, and training still ends where one rank's does."""
    dense, _ = train(gpt2(), accum=accum)
    mesh = cupytp.DeviceMesh((world.world_size,), ("dp",))
    recomputing = gpt2()
    recomputing.transformer.recompute = True
    model = fully_shard(recomputing, mesh, group_bytes=group_bytes)
    got, _ = train(model, accum=accum, dp_placements=(Shard(0),))
    assert_params_close(got, dense)


def test_fsdp_on_a_dp_tp_mesh_ends_like_one_rank(world, mesh2d):
    config = dataclasses.replace(CONFIG, n_head=2, n_embd=10)
    tp = mesh2d.shape[1]
    dense, _ = train(gpt2(config))
    model = fully_shard(gpt2(config, mesh2d), mesh2d)
    got, _ = train(model, dp_placements=(Shard(0), Replicated()))
    assert_params_close(got, dense)
    c_fc = model.transformer.h[0].mlp.c_fc
    if tp > 1:   # dp on the dim tp leaves free; a 1-D tp-sharded bias has none: replicated
        assert c_fc.weight.placements == (Shard(0), Shard(1))
        assert c_fc.bias.placements == (Replicated(), Shard(0))


def test_mixed_precision_gathers_bf16_and_keeps_fp32_masters(world):
    mesh = cupytp.DeviceMesh((world.world_size,), ("dp",))
    model = fully_shard(gpt2(dtype="fp32"), mesh, param_dtype="bf16")
    dense = gpt2(dtype="fp32")
    seen = []
    attention = model.transformer.h[0].attn
    forward = attention.forward

    def spy(*args, **kwargs):                  # inside the block: what its layers see
        seen.append(attention.c_attn.weight.dtype)
        return forward(*args, **kwargs)
    object.__setattr__(attention, "forward", spy)
    got, _ = train(model, steps=3, dp_placements=(Shard(0),))
    expected, _ = train(dense, steps=3)
    assert seen and all(d == cupytp.backend.bfloat16 for d in seen)
    for p in model.parameters():
        assert p.dtype == numpy.float32
    assert_model_close(got, expected, 0.01)            # bf16 math


class Probe(nn.DLinear):
    """A linear layer that keeps weak references to the parameter arrays it computes with."""

    def forward(self, x, residual=None):
        self.seen.extend(weakref.ref(p.to_local()) for p in (self.weight, self.bias))
        return super().forward(x, residual)


def test_residency_is_one_nth_and_full_parameters_are_freed(world):
    n = world.world_size
    mesh = cupytp.DeviceMesh((n,), ("dp",))
    cupytp.manual_seed(3)
    model = nn.Sequential(*[Probe(9, 9, dtype="fp64") for _ in range(6)])
    alive = []
    for layer in model:
        object.__setattr__(layer, "seen", alive)
    total = sum(p.to_local().nbytes for p in model.parameters())
    fully_shard(model, mesh, group_bytes=0)
    optimizer = AdamW(model.parameters(), lr=1e-3)
    x = lay_out(numpy.ones((5, 9)), mesh, (Shard(0),))
    loss = (model(x) * model(x)).sum()
    gc.collect()
    assert alive and all(ref() is None for ref in alive)      # freed after each forward
    assert model.fsdp_memory()["gathered"] == 0
    loss.backward()
    optimizer.step()
    memory = model.fsdp_memory(optimizer)
    # 1/N of every tensor, up to one row of an uneven split (a weight's 9, a bias' 1)
    slack = (9 + 1) * 8 * len(model) if n > 1 else 0
    assert total / n <= memory["parameters"] + slack and memory["parameters"] <= total / n + slack
    assert memory["gradients"] == memory["parameters"]
    assert memory["optimizer"] == 2 * memory["parameters"]
    assert memory["gathered"] == 0


def _all_gathers(model, x):
    with CommTracer() as tracer:
        model(x).sum().backward()
    return sum(row.calls for row in tracer.rows() if row.op == "all_gather")


def test_grouping_gathers_1000_tiny_layers_in_few_collectives(world):
    if world.world_size == 1:
        pytest.skip("collectives are counted on more than one rank")
    mesh = cupytp.DeviceMesh((world.world_size,), ("dp",))
    counts = {}
    for group_bytes in (0, 1 << 20):
        model = nn.Sequential(*[nn.DLinear(2, 2, bias=False) for _ in range(1000)])
        fully_shard(model, mesh, group_bytes=group_bytes)
        counts[group_bytes] = _all_gathers(model, lay_out(numpy.ones((4, 2)), mesh, (Shard(0),)))
    assert counts[0] == 2000                    # each layer: forward, and again for backward
    assert counts[0] >= 10 * counts[1 << 20]
    assert "1000 layers -> 1 groups" in model.fsdp_summary()


@pytest.mark.parametrize("group_bytes", [0, 1 << 20])
def test_a_step_reduces_each_group_once(world, group_bytes):
    """Each group's gradient is reduce-scattered once per backward, however many of its
    gathered views the forward pass dropped (the tape keeps their nodes, not the views), and a
    step issues the all-gathers the summary counts."""
    if world.world_size == 1:
        pytest.skip("collectives are counted on more than one rank")
    mesh = cupytp.DeviceMesh((world.world_size,), ("dp",))
    model = fully_shard(gpt2(dataclasses.replace(CONFIG, tie_word_embeddings=False)), mesh,
                        group_bytes=group_bytes)
    x, y = (lay_out(a, mesh, (Shard(0),)) for a in (IDS[:, :-1], IDS[:, 1:]))
    for step in range(2):
        with CommTracer() as tracer:
            model(x, y)[1].backward()
        calls = {op: sum(r.calls for r in tracer.rows() if r.op == op)
                 for op in ("all_gather", "reduce_scatter")}
        assert calls["reduce_scatter"] == sum(1 for g in model.fsdp_groups if g.sharded)
        gathers = int(re.search(r"per step (\d+) all-gathers", model.fsdp_summary()).group(1))
        assert calls["all_gather"] == gathers


def test_micro_batches_reuse_parameters_kept_gathered(world):
    """FSDP2's switches as a pipeline sets them: micro-batches with gradient sync and resharding
    after backward off (and reshard_after_forward=False) sum their gradients with the
    parameters gathered once; the last, with both on, reduces each group once and frees them.
    Ten steps of 3 micro-batches end where one rank's training does (float64)."""
    dense, _ = train(gpt2(), accum=3)
    mesh = cupytp.DeviceMesh((world.world_size,), ("dp",))
    model = fully_shard(gpt2(), mesh, reshard_after_forward=False)
    optimizer = AdamW(decay_groups(model.named_parameters(), 0.1), lr=3e-3)
    sharded = sum(1 for g in model.fsdp_groups if g.sharded)
    for _ in range(10):
        with CommTracer() as tracer:
            for k in range(3):
                rows = IDS[k::3]
                _, loss = model(*(lay_out(a, mesh, (Shard(0),)) for a in (rows[:, :-1],
                                                                           rows[:, 1:])))
                model.set_requires_gradient_sync(k == 2)      # set before a new forward,
                model.set_reshard_after_backward(k == 2)      # True would free the parameters
                (loss * (1.0 / 3)).backward()
                assert all((g.full is None) == (k == 2) for g in model.fsdp_groups if g.sharded)
        if world.world_size > 1:
            calls = {op: sum(r.calls for r in tracer.rows() if r.op == op)
                     for op in ("all_gather", "reduce_scatter")}
            assert calls == {"all_gather": sharded, "reduce_scatter": sharded}
        clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
    assert_params_close({n: full(t) for n, t in model.state_dict().items()}, dense)


def test_checkpoint_saved_sharded_loads_dense_and_tensor_parallel(world, mesh2d, shared_dir):
    mesh = cupytp.DeviceMesh((world.world_size,), ("dp",))
    config = dataclasses.replace(CONFIG, n_head=2, n_embd=10)
    tp = mesh2d.shape[1]
    model = fully_shard(gpt2(config), mesh)
    train(model, steps=2, dp_placements=(Shard(0),))
    expected = {name: full(t) for name, t in model.state_dict().items()}
    checkpoint.save(shared_dir, 2, model)
    for target in (gpt2(config), gpt2(config, mesh2d),
                   fully_shard(gpt2(config, mesh2d), mesh2d)):
        checkpoint.load(shared_dir, target)
        assert_params_close({n: full(t) for n, t in target.state_dict().items()}, expected, 0)
    dense = gpt2(config)
    dense.load_state_dict({n: t.full_tensor() for n, t in model.state_dict().items()})
    assert_params_close({n: full(t) for n, t in dense.state_dict().items()}, expected, 0)


def test_bad_calls_are_clear_errors(world):
    mesh = cupytp.DeviceMesh((world.world_size,), ("dp",))
    with pytest.raises(ValueError, match="no dimension 'data'"):
        fully_shard(gpt2(), mesh, dim="data")
    model = fully_shard(gpt2(), mesh)
    with pytest.raises(ValueError, match="data-parallel already"):
        fully_shard(model, mesh)
    with pytest.raises(ValueError, match="group_bytes"):
        fully_shard(gpt2(), mesh, group_bytes=-1)


def test_as_distributed_is_fully_shard_over_every_rank(world):
    model = gpt2().as_distributed()
    assert model.fsdp_groups[0].state.dims.shard_size == world.world_size
    assert "fully_shard over shard dp=" in model.fsdp_summary()
