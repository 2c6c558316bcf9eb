"""GPT-2: initial loss, tensor-parallel equals dense, Hugging Face format round trip, padded
vocabulary, bad input."""
import json
import math
import os
import tempfile

import numpy
import pytest

import cupytp
from cupytp import backend
from cupytp.models.gpt2 import GPT2, GPT2Config, preset
from cupytp.tensor import Replicated, local_mesh
from dense_reference import full, lay_out

CONFIG = GPT2Config(vocab_size=61, block_size=16, n_layer=2, n_head=4, n_embd=16)


def tokens(shape, seed):
    return numpy.random.default_rng(seed).integers(0, CONFIG.vocab_size, size=shape)


def loss_and_grads(model, mesh, x, y):
    replicated = (Replicated(),) * mesh.ndim
    logits, loss = model(lay_out(x, mesh, replicated), lay_out(y, mesh, replicated))
    loss.backward()
    return full(loss), {n: full(p.grad) for n, p in model.named_parameters()}, logits


def skip_unless_heads_split(mesh):
    tp = mesh.shape[-1]
    if CONFIG.n_head % tp:
        pytest.skip(f"{CONFIG.n_head} heads do not split over {tp}")


def test_initial_loss_is_log_vocab(world):
    cupytp.manual_seed(0)
    model = GPT2(CONFIG)
    _, loss = model(lay_out(tokens((4, 16), 1), local_mesh(), (Replicated(),)),
                    lay_out(tokens((4, 16), 2), local_mesh(), (Replicated(),)))
    assert abs(full(loss) - math.log(CONFIG.vocab_size)) < 0.1


def test_tensor_parallel_equals_dense(mesh):
    skip_unless_heads_split(mesh)
    x, y = tokens((2, 16), 3), tokens((2, 16), 4)
    cupytp.manual_seed(5)
    dense = GPT2(CONFIG)
    cupytp.manual_seed(5)
    parallel = GPT2(CONFIG, mesh)
    assert dense.vocab == parallel.vocab == 64          # the padding does not depend on tp
    loss_d, grads_d, _ = loss_and_grads(dense, local_mesh(), x, y)
    loss_p, grads_p, logits = loss_and_grads(parallel, mesh, x, y)
    numpy.testing.assert_allclose(loss_p, loss_d, rtol=1e-6)
    for name in grads_d:
        numpy.testing.assert_allclose(grads_p[name], grads_d[name], rtol=1e-4, atol=1e-6,
                                      err_msg=name)
    assert numpy.isneginf(full(logits)[..., CONFIG.vocab_size:]).all()


@pytest.mark.parametrize("dtype", [None, "bf16"])
def test_loss_is_taken_over_the_real_vocabulary(mesh, dtype):
    """The loss equals the float64 cross-entropy of the returned logits' real columns; the padded
    columns read -inf; under bf16 autocast the logits stay bf16 (no fp32 copy) and the loss is
    fp32."""
    skip_unless_heads_split(mesh)
    cupytp.manual_seed(9)
    model = GPT2(CONFIG, mesh)
    x, y = tokens((2, 16), 10), tokens((2, 16), 11)
    replicated = (Replicated(),) * mesh.ndim
    with cupytp.ops.autocast(dtype):
        logits, loss = model(lay_out(x, mesh, replicated), lay_out(y, mesh, replicated))
    assert logits.dtype == (backend.bfloat16 if dtype else numpy.float32)
    assert loss.dtype == numpy.float32
    values = full(logits).astype(numpy.float64)
    assert numpy.isneginf(values[..., CONFIG.vocab_size:]).all()
    z = values[..., :CONFIG.vocab_size]
    lse = z.max(-1) + numpy.log(numpy.exp(z - z.max(-1, keepdims=True)).sum(-1))
    expected = (lse - numpy.take_along_axis(z, y[..., None], -1)[..., 0]).mean()
    numpy.testing.assert_allclose(full(loss), expected, rtol=1e-6)


def test_padded_vocab_never_sampled(world):
    cupytp.manual_seed(6)
    model = GPT2(CONFIG)
    out = model.generate(tokens((2, 3), 7), 12, seed=1)
    assert out.shape == (2, 15) and out.max() < CONFIG.vocab_size


def test_generation_with_a_cache_equals_without(mesh):
    """A KV cache (prefill, then one token per step) gives the logits of running the whole
    sequence, and generate() the tokens of running the whole window every step, past the
    context (16 tokens) too."""
    skip_unless_heads_split(mesh)
    cupytp.manual_seed(11)
    model = GPT2(CONFIG, mesh).to("fp64")
    replicated = (Replicated(),) * mesh.ndim
    ids = tokens((2, 10), 12)
    cache = cupytp.nn.KVCache(16)
    with cupytp.no_grad():
        whole, _ = model(lay_out(ids, mesh, replicated))
        first, _ = model(lay_out(ids[:, :6], mesh, replicated), cache=cache)
        steps = [model(lay_out(ids[:, t:t + 1], mesh, replicated), cache=cache)[0]
                 for t in range(6, 10)]
    numpy.testing.assert_allclose(full(first), full(whole)[:, :6], rtol=1e-10, atol=1e-12)
    for t, step in zip(range(6, 10), steps):
        numpy.testing.assert_allclose(full(step)[:, 0], full(whole)[:, t], rtol=1e-10,
                                      atol=1e-12)
    out = model.generate(ids[:, :3], 20, top_k=7, seed=4)
    rng, expected = numpy.random.default_rng(4), ids[:, :3]
    from cupytp.models.generation import sample
    with cupytp.no_grad():
        for _ in range(20):
            logits, _ = model(lay_out(expected[:, -16:], mesh, replicated))
            nxt = sample(full(logits)[:, -1], CONFIG.vocab_size, 1.0, 7, rng)
            expected = numpy.concatenate([expected, nxt[:, None]], axis=1)
    numpy.testing.assert_array_equal(out, expected)


def test_hugging_face_round_trip(mesh):
    skip_unless_heads_split(mesh)
    cupytp.manual_seed(8)
    model = GPT2(CONFIG)
    first = cupytp.distributed.get_rank() == 0
    path = os.path.join(cupytp.distributed.broadcast_object(tempfile.mkdtemp() if first else None),
                        "ckpt")
    model.save_pretrained(path)
    cupytp.distributed.barrier()
    from safetensors.numpy import load_file
    stored = load_file(os.path.join(path, "model.safetensors"))
    c = CONFIG.n_embd
    assert stored["transformer.h.0.attn.c_attn.weight"].shape == (c, 3 * c)
    assert stored["transformer.h.0.attn.c_attn.bias"].shape == (3 * c,)
    assert stored["transformer.wte.weight"].shape == (CONFIG.vocab_size, c)
    assert stored["transformer.h.1.mlp.c_fc.weight"].shape == (c, 4 * c)
    assert json.load(open(os.path.join(path, "config.json")))["n_layer"] == 2
    # q, k and v keep HF's order: columns [0, C) of c_attn are the q projection
    q_dense = full(model.transformer.h[0].attn.c_attn.weight)[:, 0]
    numpy.testing.assert_array_equal(stored["transformer.h.0.attn.c_attn.weight"][:, :c],
                                     q_dense)
    loaded = GPT2.from_pretrained(path, mesh)
    x = tokens((2, 9), 9)
    logits_a, _ = model(lay_out(x, local_mesh(), (Replicated(),)))
    logits_b, _ = loaded(lay_out(x, mesh, (Replicated(),) * mesh.ndim))
    a, b = full(logits_a)[..., :CONFIG.vocab_size], full(logits_b)[..., :CONFIG.vocab_size]
    numpy.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_float64_end_to_end(mesh):
    """A model cast to float64 computes, returns and loads in float64: N ranks equal one rank
    to 1e-12, and Hugging Face weights load without rounding (the embedding included)."""
    skip_unless_heads_split(mesh)
    x, y = tokens((2, 16), 12), tokens((2, 16), 13)
    cupytp.manual_seed(7)
    dense = GPT2(CONFIG).to("fp64")
    cupytp.manual_seed(7)
    parallel = GPT2(CONFIG, mesh).to("fp64")
    loss_d, grads_d, logits_d = loss_and_grads(dense, local_mesh(), x, y)
    loss_p, grads_p, logits_p = loss_and_grads(parallel, mesh, x, y)
    assert logits_p.dtype == logits_d.dtype == numpy.float64
    assert loss_p.dtype == numpy.float64
    numpy.testing.assert_allclose(loss_p, loss_d, rtol=1e-12)
    for name in grads_d:
        numpy.testing.assert_allclose(grads_p[name], grads_d[name], rtol=1e-9, atol=1e-12,
                                      err_msg=name)
    weights = dense.hf_state_dict()
    cupytp.manual_seed(8)
    loaded = GPT2(CONFIG, mesh).to("fp64")
    loaded.load_hf_state_dict(lambda name, index: weights[name][index])
    for name, value in loaded.hf_state_dict().items():
        assert value.dtype == numpy.float64, name
        numpy.testing.assert_array_equal(value, weights[name], err_msg=name)


def test_bad_input(world, tmp_path):
    with pytest.raises(ValueError, match="unknown GPT-2 preset"):
        preset("13B")
    model = GPT2(CONFIG)
    with pytest.raises(ValueError, match="longer than the model's context"):
        model(lay_out(tokens((1, 17), 1), local_mesh(), (Replicated(),)))
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        GPT2.from_pretrained(str(tmp_path / "missing"))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a readable safetensors"):
        GPT2.from_pretrained(str(bad))
    directory = tmp_path / "hf"           # config.json is read first: the weights do not matter
    directory.mkdir()
    (directory / "model.safetensors").write_bytes(b"weights")
    config = directory / "config.json"
    for text, why in [("{garbage", "config.json is not valid JSON"),
                      ('{"n_layer": 2}', "config.json is not a GPT-2 config.json: it lacks "
                                         "vocab_size, n_head, n_embd"),
                      ("[1, 2]", "it lacks vocab_size"),
                      ('{"vocab_size": "many", "n_layer": 2, "n_head": 4, "n_embd": 16}',
                       "config.json has a value that is not a number")]:
        config.write_text(text)
        with pytest.raises(ValueError, match=why):
            GPT2.from_pretrained(str(directory))
