"""Dynamic loss scaling on sharded parameters (1-D and 2-D meshes, uneven shards): a gradient
that is not finite on one rank's shard only skips the step on every rank, and the parameters
equal those of the same training on one rank with that step left out."""
import numpy
import pytest

import cupytp
from cupytp.optim import AdamW, GradScaler
from cupytp.tensor import Replicated, Shard
from dense_reference import full, lay_out, rng_array, step_on_gradients

S0, S1, R = Shard(0), Shard(1), Replicated()


def specs(mesh):
    if mesh.ndim == 1:
        return [((7, 5), (S0,)), ((5, 3), (S1,)), ((5,), (R,))]
    return [((9, 7), (S0, S1)), ((6, 5), (R, S0)), ((3,), (R, R))]


def train(values, placements, mesh, grad_steps, scaler):
    params = [lay_out(v.copy(), mesh, p, requires_grad=True) for v, p in zip(values, placements)]
    optimizer = AdamW(params, lr=0.05)
    return step_on_gradients(params, optimizer, grad_steps, scaler), optimizer


@pytest.mark.parametrize("dims", ["1d", "2d"])
def test_a_non_finite_shard_skips_the_step_everywhere(mesh1d, mesh2d, dims):
    mesh = mesh1d if dims == "1d" else mesh2d
    layout = specs(mesh)
    values = [rng_array(shape, i, numpy.float32) for i, (shape, _) in enumerate(layout)]
    steps = [[rng_array(shape, 10 * k + i, numpy.float32) for i, (shape, _) in enumerate(layout)]
             for k in range(4)]
    bad = [g.copy() for g in steps[1]]
    bad[0][-1, -1] = numpy.nan          # on the last rank's shard only
    scaler = GradScaler(init_scale=2.0 ** 8, growth_interval=100)
    sharded, optimizer = train(values, [p for _, p in layout], mesh,
                               [steps[0], bad] + steps[2:], scaler)
    local = cupytp.local_mesh()
    reference, _ = train(values, [(R,)] * len(layout), local, [steps[0], None] + steps[2:], None)
    for a, b in zip(sharded, reference):
        numpy.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert optimizer.steps_skipped() == {0: 1}
    assert scaler.get_scale() == 2.0 ** 7


@pytest.mark.filterwarnings("ignore::RuntimeWarning")    # the poisoned step's NumPy math
def test_fully_sharded_training_skips_a_poisoned_step_on_every_rank(world):
    """fully_shard over all ranks (float64, uneven shards): step 2's loss is made infinite, so
    its reduced gradients are not finite; the scaler skips that step everywhere, and training
    ends where one-rank training without that step ends."""
    from cupytp.models.gpt2 import GPT2, GPT2Config
    from cupytp.parallel import fully_shard
    config = GPT2Config(vocab_size=37, block_size=8, n_layer=2, n_head=3, n_embd=9)
    ids = numpy.random.default_rng(0).integers(0, config.vocab_size, size=(4, 9))

    def run(mesh, poison, scaler):
        cupytp.manual_seed(1)
        model = GPT2(config).to("fp64")
        if mesh is None:
            mesh, rows = model.parameters()[0].mesh, (R,)
        else:
            model, rows = fully_shard(model, mesh), (Shard(0),)
        optimizer = AdamW(model.parameters(), lr=3e-3)
        x, y = (lay_out(a, mesh, rows) for a in (ids[:, :-1], ids[:, 1:]))
        for step in range(5):
            if step == 2 and not poison:
                continue
            _, loss = model(x, y)
            if step == 2:
                loss = loss * numpy.inf
            if scaler is None:
                loss.backward()
                optimizer.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            optimizer.zero_grad()
        return {name: full(t) for name, t in model.state_dict().items()}, optimizer

    mesh = cupytp.DeviceMesh((world.world_size,), ("dp",))
    scaler = GradScaler(init_scale=2.0 ** 10, growth_interval=100)
    sharded, optimizer = run(mesh, True, scaler)
    reference, _ = run(None, False, None)
    assert optimizer.steps_skipped() == {0: 1} and scaler.get_scale() == 2.0 ** 9
    for name, value in reference.items():
        numpy.testing.assert_allclose(sharded[name], value, rtol=1e-9, atol=1e-11, err_msg=name)
