"""A small GPT-2 trained with clipped AdamW on one fixed batch (training and checkpoint tests),
and what it computes after a checkpoint: the reference that a loaded copy must reproduce."""
import dataclasses

import numpy

import cupytp
from cupytp import checkpoint
from cupytp.models.gpt2 import GPT2, GPT2Config
from cupytp.optim import AdamW, clip_grad_norm_, decay_groups
from cupytp.tensor import Replicated
from dense_reference import full, lay_out

CONFIG = GPT2Config(vocab_size=37, block_size=8, n_layer=2, n_head=4, n_embd=8)
IDS = numpy.random.default_rng(0).integers(0, CONFIG.vocab_size, size=(3, 9))


def gpt2(mesh, seed, dropout=0.0):
    """A float64 GPT-2 on `mesh` and its AdamW."""
    cupytp.manual_seed(seed)
    model = GPT2(dataclasses.replace(CONFIG, dropout=dropout), mesh).to("fp64")
    return model, AdamW(decay_groups(model.parameters(), 0.1), lr=3e-3)


def train(model, optimizer, steps, ids=IDS, rows=None):
    """`steps` clipped AdamW steps on the fixed batch `ids`, laid out with `rows` (default
    Replicated) on the model's mesh; the loss of each."""
    mesh = model.parameters()[0].mesh
    rows = rows or (Replicated(),) * mesh.ndim
    losses = []
    for _ in range(steps):
        _, loss = model(lay_out(ids[:, :-1], mesh, rows), lay_out(ids[:, 1:], mesh, rows))
        loss.backward()
        clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(full(loss)))
    return losses


def snapshot(model, optimizer=None, prefix=""):
    """Copies of the full values of the model's parameters and buffers and the optimizer's
    states, by name."""
    result = {prefix + name: full(t).copy() for name, t in model.state_dict().items()}
    per_parameter = optimizer.state_dict()["state"] if optimizer is not None else {}
    for index, states in per_parameter.items():
        result.update((f"{prefix}{index}/{name}", full(t).copy()) for name, t in states.items())
    return result


def assert_same(got, expected, rtol=0.0, what=""):
    """The same keys, and values equal (rtol=0: bit for bit) or within rtol."""
    assert got.keys() == expected.keys(), what
    for key, want in expected.items():
        if rtol:
            numpy.testing.assert_allclose(got[key], want, rtol=rtol, atol=1e-12,
                                          err_msg=f"{key} {what}")
        else:
            numpy.testing.assert_array_equal(got[key], want, err_msg=f"{key} {what}")


def reference(model, optimizer):
    """What the model holds now ("now/", see snapshot), then what it computes: its logits, two
    more steps' losses and the parameters after them."""
    result = snapshot(model, optimizer, "now/")
    mesh = model.parameters()[0].mesh
    with cupytp.no_grad():
        logits, _ = model(lay_out(IDS[:, :-1], mesh, (Replicated(),) * mesh.ndim))
    result["logits"] = full(logits)
    result["losses"] = numpy.array(train(model, optimizer, 2))
    result.update((f"after/{name}", full(p).copy()) for name, p in model.named_parameters())
    return result


def check_continues(expected, directory, mesh, step, rtol=1e-10, parallel=None):
    """Load `directory` into a fresh model on `mesh` (made data-parallel by `parallel(model)`
    when given): the values it held, bit for bit, then the logits and next steps of `expected`
    (within rtol: other meshes sum in another order)."""
    model, optimizer = gpt2(mesh, seed=99)
    if parallel is not None:
        parallel(model)
    assert checkpoint.load(directory, model, optimizer)["step"] == step
    got = reference(model, optimizer)
    now = [key for key in expected if key.startswith("now/")]
    assert_same({k: got.pop(k) for k in now}, {k: expected[k] for k in now}, 0.0, f"on {mesh}")
    assert_same(got, {k: v for k, v in expected.items() if k not in now}, rtol, f"on {mesh}")
