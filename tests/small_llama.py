"""Small Llama-family configurations (8 query heads; 2 or 4 key/value heads; Llama 3's rope
scaling; tied and untied heads; Qwen2's q, k and v biases; uneven vocabulary and MLP shares),
random weights in Hugging Face's names and shapes, and a checkpoint directory of them."""
import json
import os

import numpy

from cupytp.models.llama import LlamaConfig, hf_config

SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
CONFIGS = {
    "llama-kv2-scaled": LlamaConfig(
        vocab_size=61, hidden_size=64, intermediate_size=90, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=32,
        rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=SCALING),
    "llama-kv4-tied": LlamaConfig(
        vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=32,
        tie_word_embeddings=True),
    "qwen2-kv2-bias": LlamaConfig(
        vocab_size=63, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=32,
        rope_theta=1000000.0, attention_bias=True, model_type="qwen2"),
}


def random_weights(config, seed):
    """{Hugging Face key: float64 array} of a model of `config`: matrices N(0, 0.15²), norm
    weights 1 + N(0, 0.1²), biases N(0, 0.1²)."""
    rng = numpy.random.default_rng(seed)
    c, f, d = config.hidden_size, config.intermediate_size, config.head_size
    h, hk = config.num_attention_heads, config.num_key_value_heads
    shapes = {"model.embed_tokens.weight": (config.vocab_size, c), "model.norm.weight": (c,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, c)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (c,),
                       p + "post_attention_layernorm.weight": (c,),
                       p + "self_attn.q_proj.weight": (h * d, c),
                       p + "self_attn.k_proj.weight": (hk * d, c),
                       p + "self_attn.v_proj.weight": (hk * d, c),
                       p + "self_attn.o_proj.weight": (c, h * d),
                       p + "mlp.gate_proj.weight": (f, c), p + "mlp.up_proj.weight": (f, c),
                       p + "mlp.down_proj.weight": (c, f)})
        if config.attention_bias:
            shapes.update({p + f"self_attn.{n}_proj.bias": (m * d,)
                           for n, m in (("q", h), ("k", hk), ("v", hk))})
    weights = {}
    for key, shape in shapes.items():
        noise = rng.standard_normal(shape)
        weights[key] = 1 + 0.1 * noise if key.endswith("norm.weight") else \
            (0.1 if key.endswith("bias") else 0.15) * noise
    return weights


def write_checkpoint(path, config, weights, files=1):
    """A Hugging Face checkpoint directory: config.json and the weights in one safetensors file,
    or in `files` of them with model.safetensors.index.json."""
    from safetensors.numpy import save_file
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config(config, numpy.float64), f)
    keys = list(weights)
    if files == 1:
        save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, chunk in enumerate(numpy.array_split(numpy.arange(len(keys)), files)):
        name = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        save_file({keys[j]: weights[keys[j]] for j in chunk}, os.path.join(path, name),
                  metadata={"format": "pt"})
        weight_map.update({keys[j]: name for j in chunk})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
