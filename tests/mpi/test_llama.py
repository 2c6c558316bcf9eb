"""Llama-family models (float64): logits, loss and every parameter's gradient equal the NumPy
reference (itself held to transformers) and, where PyTorch is installed, transformers'
LlamaForCausalLM and Qwen2ForCausalLM, within 1e-9 on 1, 2 and 4 ranks and on 2-D meshes (8
query heads over 2 or 4 key/value heads: split where tp divides them, replicated otherwise;
Llama 3's rope scaling; tied and untied heads; Qwen2's q, k and v biases), loaded by
from_pretrained from one or several safetensors files and saved by save_pretrained into files
transformers loads; tensor-parallel, replicated, fully sharded (built deferred too, then
materialized per rank), hybrid-sharded and 2-D training equal one-rank training;
generation with a KV cache equals generation without; bad input is one clear error."""
import json
import os

import numpy
import pytest

import cupytp
from cupytp import nn
from cupytp.distributed import barrier
from cupytp.models.llama import Llama, config_from_hf, hf_arrays, preset
from cupytp.optim import AdamW, clip_grad_norm_, decay_groups
from cupytp.parallel import fully_shard, replicate
from cupytp.tensor import Replicated, Shard, local_mesh
from dense_reference import full, lay_out
from llama_reference import loss_and_grads
from small_llama import CONFIGS, random_weights, write_checkpoint

NAMES = list(CONFIGS)
IDS = numpy.random.default_rng(0).integers(0, 61, size=(4, 11))


def tp_size(mesh):
    return mesh.shape[nn.tp_dim(mesh)]


def checkpoint(directory, name, files=1, seed=1):
    """(path, weights) of a checkpoint of CONFIGS[name] with random weights, written by rank 0
    into `directory` (shared by every rank)."""
    config = CONFIGS[name]
    weights = random_weights(config, seed)
    path = os.path.join(directory, f"{name}-{files}")
    if cupytp.distributed.get_rank() == 0:
        write_checkpoint(path, config, weights, files)
    barrier()
    return path, weights


def run(model, mesh):
    """(logits, loss, {Hugging Face key: gradient}) of the model on IDS (every position against
    the next token's id, as the reference does), full float64 arrays."""
    replicated = (Replicated(),) * mesh.ndim
    x, y = (lay_out(a, mesh, replicated) for a in (IDS[:, :-1], IDS[:, 1:]))
    logits, loss = model(x, y)
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        grads.update(hf_arrays(name, full(p.grad)))
    return full(logits), float(full(loss)), grads


def assert_matches(got, want, what):
    logits, loss, grads = got
    want_logits, want_loss, want_grads = want
    numpy.testing.assert_allclose(logits, want_logits, rtol=1e-9, atol=1e-12,
                                  err_msg=f"logits ({what})")
    assert abs(loss - want_loss) <= 1e-9 * abs(want_loss), what
    assert grads.keys() == want_grads.keys(), what
    for key, value in want_grads.items():
        numpy.testing.assert_allclose(grads[key], value, rtol=1e-9,
                                      atol=1e-9 * numpy.abs(value).max(),
                                      err_msg=f"gradient of {key} ({what})")


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_from_pretrained_matches_reference(mesh, shared_dir, name, sequence_parallel):
    """Loaded on this mesh (two files for one config: the index), the model computes the
    reference's logits, loss and gradients, with and without sequence parallelism; k and v
    split by heads where tp divides them."""
    if sequence_parallel and tp_size(mesh) == 1:
        pytest.skip("sequence parallelism needs 2 tensor-parallel ranks")
    config = CONFIGS[name]
    path, weights = checkpoint(shared_dir, name, files=2 if "tied" in name else 1)
    model = Llama.from_pretrained(path, mesh, dtype="fp64", sequence_parallel=sequence_parallel)
    assert model.model.embed_tokens.sequence_parallel == sequence_parallel
    reference = loss_and_grads(weights, config, IDS[:, :-1], IDS[:, 1:])
    assert_matches(run(model, mesh), reference, f"{name} on {mesh}")
    kv = model.model.layers[0].self_attn.kv_proj.weight
    split = tp_size(mesh) > 1 and config.num_key_value_heads % tp_size(mesh) == 0
    assert kv.placements == nn.tp_placements(mesh, Shard(2) if split else Replicated())
    assert model.model.embed_tokens.weight.placements == nn.tp_placements(mesh, Shard(0))


@pytest.mark.parametrize("name", NAMES)
def test_matches_transformers(mesh, shared_dir, name):
    """The same against transformers' own model of the checkpoint's weights (float64, its
    rotary tables and RMSNorm computed in float64: see tests/hf_llama.py)."""
    from hf_llama import float64_model, logits_loss_grads
    config = CONFIGS[name]
    path, weights = checkpoint(shared_dir, name)
    hf = float64_model(config, weights)
    model = Llama.from_pretrained(path, mesh, dtype="fp64")
    assert_matches(run(model, mesh), logits_loss_grads(hf, IDS[:, :-1], IDS[:, 1:]),
                   f"{name} on {mesh} against transformers")


@pytest.mark.parametrize("name", NAMES)
def test_save_pretrained_round_trips(mesh, shared_dir, name):
    """save_pretrained writes Hugging Face's keys and shapes, bit for bit (float64 kept), in
    several files with an index above max_shard_bytes, and bf16 when asked; from_pretrained
    reads them back."""
    config = CONFIGS[name]
    path, weights = checkpoint(shared_dir, name)
    model = Llama.from_pretrained(path, mesh, dtype="fp64")
    out = os.path.join(shared_dir, f"{name}-saved")
    model.save_pretrained(out, max_shard_bytes=40000)
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert len(files) > 1 and os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
    from safetensors.numpy import load_file
    stored = {}
    for f in files:
        stored.update(load_file(os.path.join(out, f)))
    assert stored.keys() == weights.keys()
    for key, value in weights.items():
        numpy.testing.assert_array_equal(stored[key], value, err_msg=key)
    assert config_from_hf(os.path.join(out, "config.json")) == config
    again = Llama.from_pretrained(out, mesh, dtype="fp64")
    for key, value in again.hf_state_dict().items():
        numpy.testing.assert_array_equal(value, weights[key], err_msg=key)
    model.save_pretrained(out + "-bf16", dtype="bf16")
    assert json.load(open(os.path.join(out + "-bf16", "config.json")))["torch_dtype"] == \
        "bfloat16"
    if cupytp.distributed.get_rank() == 0:
        assert load_file(os.path.join(out + "-bf16", "model.safetensors"))[
            "model.norm.weight"].dtype == cupytp.backend.bfloat16


@pytest.mark.parametrize("name", NAMES)
def test_transformers_loads_save_pretrained(mesh, shared_dir, name):
    """transformers' AutoModelForCausalLM loads what save_pretrained wrote (several files),
    as the right class, with every weight bit for bit."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    config = CONFIGS[name]
    path, weights = checkpoint(shared_dir, name)
    out = os.path.join(shared_dir, f"{name}-for-transformers")
    Llama.from_pretrained(path, mesh, dtype="fp64").save_pretrained(out, max_shard_bytes=40000)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
    loaded = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    for key, value in weights.items():
        numpy.testing.assert_array_equal(loaded[key], value, err_msg=key)
    assert hf.config.num_key_value_heads == config.num_key_value_heads
    assert type(hf).__name__ == {"llama": "LlamaForCausalLM",
                                 "qwen2": "Qwen2ForCausalLM"}[config.model_type]


# ---- training ---------------------------------------------------------------------------------
def llama(name, mesh=None, tp=None, seed=3):
    cupytp.manual_seed(seed)
    return Llama(CONFIGS[name], mesh, tp=tp).to("fp64")


def train(model, steps=4, dp_placements=(Replicated(),)):
    """`steps` clipped AdamW steps on IDS; (the losses, the parameters after, full, by name)."""
    mesh = model.parameters()[0].mesh
    optimizer = AdamW(decay_groups(model.named_parameters(), 0.1), lr=3e-3)
    losses = []
    for _ in range(steps):
        x, y = (lay_out(a, mesh, dp_placements) for a in (IDS[:, :-1], IDS[:, 1:]))
        _, loss = model(x, y)
        loss.backward()
        clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(full(loss)))
    return losses, {name: full(t) for name, t in model.state_dict().items()}


def assert_trained_alike(got, expected):
    numpy.testing.assert_allclose(got[0], expected[0], rtol=1e-10)
    assert expected[0][-1] < expected[0][0]
    assert got[1].keys() == expected[1].keys()
    for name, value in expected[1].items():
        numpy.testing.assert_allclose(got[1][name], value, rtol=1e-9, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("name", ["llama-kv2-scaled", "qwen2-kv2-bias"])
def test_tensor_parallel_training_equals_one_rank(mesh, name):
    """Tensor-parallel (and on a 2-D mesh, data-parallel too: the batch on dp) training ends
    where the dense model does."""
    dp = mesh.ndim == 2
    placements = (Shard(0), Replicated()) if dp else (Replicated(),)
    expected = train(llama(name, tp=tp_size(mesh)))
    model = llama(name, mesh)
    if dp:
        replicate(model, mesh)          # gradients summed over dp
    assert_trained_alike(train(model, dp_placements=placements), expected)


@pytest.mark.parametrize("name", ["llama-kv4-tied", "qwen2-kv2-bias"])
def test_fully_sharded_training_equals_one_rank(world, mesh2d, name):
    """Fully sharded over every rank, and over dp on a (dp, tp) mesh with tensor parallelism,
    training ends where one rank's does."""
    expected = train(llama(name))
    mesh = cupytp.DeviceMesh((world.world_size,), ("dp",))
    assert_trained_alike(train(fully_shard(llama(name), mesh), dp_placements=(Shard(0),)),
                         expected)
    tp = mesh2d.shape[1]
    expected = train(llama(name, tp=tp))
    model = fully_shard(llama(name, mesh2d), mesh2d)
    assert_trained_alike(train(model, dp_placements=(Shard(0), Replicated())), expected)


@pytest.mark.parametrize("name", ["llama-kv2-scaled", "qwen2-kv2-bias"])
def test_replicated_and_hybrid_sharded_training_equals_one_rank(world, name):
    """Replicated over every rank (gradients all-reduced in buckets), and on 4 ranks HSDP 2 x 2
    (sharded within pairs, replicated across them): training ends where one rank's does."""
    expected = train(llama(name))
    mesh = cupytp.DeviceMesh((world.world_size,), ("dp",))
    model = replicate(llama(name), mesh, bucket_bytes=1 << 12)
    assert_trained_alike(train(model, dp_placements=(Shard(0),)), expected)
    if world.world_size != 4:
        return
    mesh = cupytp.DeviceMesh((2, 2), ("dp_replicate", "dp_shard"))
    model = fully_shard(llama(name), mesh, dim="dp_shard", replicate_dim="dp_replicate")
    assert "replicate dp_replicate=2, shard dp_shard=2" in model.fsdp_summary()
    assert_trained_alike(train(model, dp_placements=(Shard(0), Shard(0))), expected)


@pytest.mark.parametrize("name", ["llama-kv4-tied", "qwen2-kv2-bias"])
def test_built_deferred_and_fully_sharded_equals_the_dense_model(world, mesh2d, name):
    """Llama built inside deferred_init(), fully sharded (over every rank; over dp on a (dp, tp)
    mesh, tensor-parallel there), then materialized: each rank holds its blocks only, the
    parameters are the dense model's bit for bit, and it trains like one rank."""
    for mesh, placements in ((cupytp.DeviceMesh((world.world_size,), ("dp",)), (Shard(0),)),
                             (mesh2d, (Shard(0), Replicated()))):
        tp = tp_size(mesh) if "tp" in mesh.dim_names else 1
        cupytp.manual_seed(3)
        with cupytp.deferred_init():
            model = Llama(CONFIGS[name], mesh if tp > 1 else None).to("fp64")
        fully_shard(model, mesh)
        assert not nn.is_materialized(model)
        cupytp.materialize(model)
        dense = llama(name, tp=tp)
        got = dict(model.named_parameters())
        for key, value in dense.named_parameters():
            assert got[key].local_shape == got[key].layout.local_shape, key
            numpy.testing.assert_array_equal(full(got[key]), full(value), err_msg=key)
        assert_trained_alike(train(model, dp_placements=placements), train(dense))


# ---- generation -------------------------------------------------------------------------------
def test_generation_with_a_cache_equals_without(mesh):
    """Prefill then one token per step (a KV cache) gives the logits of running the whole
    sequence, and generate() the tokens of running the whole window every step, past the
    context too (where the window moves)."""
    if 8 % tp_size(mesh):
        pytest.skip("heads do not split")
    model = llama("llama-kv2-scaled", mesh)
    replicated = (Replicated(),) * mesh.ndim
    prompt = IDS[:2, :5]
    cache = nn.KVCache(12)
    with cupytp.no_grad():
        whole, _ = model(lay_out(IDS[:2, :9], mesh, replicated))
        first, _ = model(lay_out(prompt, mesh, replicated), cache=cache)
        steps = [model(lay_out(IDS[:2, t:t + 1], mesh, replicated), cache=cache)[0]
                 for t in range(5, 9)]
    assert cache.length == 9
    numpy.testing.assert_allclose(full(first), full(whole)[:, :5], rtol=1e-10, atol=1e-12)
    for t, step in zip(range(5, 9), steps):
        numpy.testing.assert_allclose(full(step)[:, 0], full(whole)[:, t], rtol=1e-10,
                                      atol=1e-12)
    with pytest.raises(ValueError, match="holds 12 tokens: 9 cached and 4 more do not fit"):
        with cupytp.no_grad():
            model(lay_out(IDS[:2, :4], mesh, replicated), cache=cache)
    out = model.generate(prompt, 40, temperature=0.7, top_k=5, seed=2)    # context: 32
    rng = numpy.random.default_rng(2)
    expected = prompt
    from cupytp.models.generation import sample
    with cupytp.no_grad():
        for _ in range(40):
            window = expected[:, -32:]
            logits, _ = model(lay_out(window, mesh, replicated))
            nxt = sample(full(logits)[:, -1], 61, 0.7, 5, rng)
            expected = numpy.concatenate([expected, nxt[:, None]], axis=1)
    numpy.testing.assert_array_equal(out, expected)


# ---- bad input --------------------------------------------------------------------------------
def test_bad_input(world, tmp_path):
    with pytest.raises(ValueError, match="unknown Llama preset"):
        preset("70B")
    assert preset("8B").num_parameters() == pytest.approx(8.03e9, rel=1e-3)
    assert preset("1B").num_parameters() == pytest.approx(1.236e9, rel=1e-3)
    model = llama("llama-kv4-tied")
    with pytest.raises(ValueError, match="longer than the model's context of 32 tokens"):
        model(lay_out(numpy.zeros((1, 33), int), local_mesh(), (Replicated(),)))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        Llama.from_pretrained(str(tmp_path))
    config = tmp_path / "config.json"
    fields = json.dumps({"vocab_size": 61, "hidden_size": 64, "intermediate_size": 96,
                         "num_hidden_layers": 2, "num_attention_heads": 8})
    for text, why in [("{garbage", "is not valid JSON"),
                      ('{"hidden_size": 2}', "lacks vocab_size, intermediate_size"),
                      (fields[:-1] + ', "model_type": "gpt2"}', "'gpt2' is not a Llama-family"),
                      (fields[:-1] + ', "mlp_bias": true}', "MLP biases"),
                      (fields[:-1] + ', "attention_bias": true}', "bias on o_proj"),
                      (fields[:-1] + ', "hidden_act": "gelu"}', "not SwiGLU's silu"),
                      (fields[:-1] + ', "vocab_size": "many"}', "not a number")]:
        config.write_text(text)
        with pytest.raises(ValueError, match=why):
            Llama.from_pretrained(str(tmp_path))
    config.write_text(fields[:-1] + ', "rope_scaling": {"rope_type": "yarn", "factor": 4}}')
    with pytest.raises(ValueError, match="'yarn' is not supported"):
        Llama.from_pretrained(str(tmp_path))
    config.write_text(fields)
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor"):
        Llama.from_pretrained(str(tmp_path))
    weights = random_weights(config_from_hf(str(config)), 0)
    del weights["model.layers.1.mlp.up_proj.weight"]
    write_checkpoint(str(tmp_path), config_from_hf(str(config)), weights)
    with pytest.raises(KeyError, match="no tensor 'model.layers.1.mlp.up_proj.weight'"):
        Llama.from_pretrained(str(tmp_path))
    weights = random_weights(config_from_hf(str(config)), 0)
    weights["model.norm.weight"] = weights["model.norm.weight"][:10]
    write_checkpoint(str(tmp_path), config_from_hf(str(config)), weights)
    with pytest.raises(ValueError, match=r"model.norm.weight: the checkpoint in .* holds shape "
                                         r"\(10,\), this model needs \(64,\)"):
        Llama.from_pretrained(str(tmp_path))
    windowed = Llama(CONFIGS["llama-kv4-tied"].__class__(
        **{**CONFIGS["llama-kv4-tied"].__dict__, "sliding_window": 8}))
    with pytest.raises(ValueError, match="sliding window"):
        windowed(lay_out(numpy.zeros((1, 9), int), local_mesh(), (Replicated(),)))
