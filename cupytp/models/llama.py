"""Llama-family decoders (Llama 3.x, Qwen2/2.5, Mistral, SmolLM) from cupytp.nn: RMSNorm, rotary
positions, grouped-query attention, SwiGLU; tensor-parallel by apply_tensor_parallel; Hugging
Face weights both ways.

Read bottom-up: config → decoder layer → model → weights in and out. Parameter names are Hugging
Face LlamaForCausalLM's (`model.layers.0.self_attn.q_proj.weight`, ...), with three native
layouts, converted where weights cross the boundary (`hf_state_dict`, `save_pretrained`,
`from_pretrained`, each rank reading only its slices of the files):
- weights are `[in, out]` (products x @ w, as every cupytp layer); Hugging Face's nn.Linear
  stores `[out, in]`: transposed;
- k_proj and v_proj are one `self_attn.kv_proj` `[C, 2, Hk·D]`, gate_proj and up_proj one
  `mlp.gate_up_proj` `[C, 2, F]` (one product each, both parts of the same heads or columns on
  every tensor-parallel rank);
- q and k rows keep Hugging Face's order, the rotate-half layout its rotary embedding uses (pair i
  of a head is (i, i + D/2)): no permutation (Meta's original checkpoints interleave the pairs;
  Hugging Face's conversion script permutes them once, and checkpoints on the Hub are converted).
The vocabulary is not padded: the embedding and an untied head are vocab-parallel with numpy
array_split shares, and the loss reads the sharded logits without gathering them.
"""
import json
import math
import os
from dataclasses import asdict, dataclass, field, replace

import numpy

from cupytp import backend, nn, ops
from cupytp.distributed import broadcast_object, get_rank
from cupytp.models import generation
from cupytp.parallel import DecoderParts, apply_tensor_parallel
from cupytp.tensor import Replicated, deferred_init, is_deferring, local_mesh
from cupytp.tensor.layout import Layout

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "mistral": "MistralForCausalLM"}


@dataclass(frozen=True)
class LlamaConfig:
    """The fields of a Hugging Face config.json that shape the model (Llama, Qwen2, Mistral and
    SmolLM name them alike). `attention_bias`: q, k and v biases (Qwen2's; never on o_proj);
    `sliding_window`: sequences may not be longer (the attention is the full causal one)."""
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = None                 # None: hidden_size / num_attention_heads
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict = None            # e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int = None
    initializer_range: float = 0.02
    model_type: str = "llama"
    bos_token_id: int = None
    eos_token_id: object = None          # an id, or a list of ids (Llama 3's instruct models)
    extra: dict = field(default_factory=dict, compare=False)   # other config.json fields, kept

    def __post_init__(self):
        """Errors in the shape or the rotary scaling, at once (nothing is built with them)."""
        nn.attention.check_heads(self.num_attention_heads, self.num_key_value_heads, 1)
        nn.rope_frequencies(self.head_size, self.rope_theta, self.rope_scaling)

    @property
    def head_size(self):
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def num_parameters(self):
        c, d = self.hidden_size, self.head_size
        attention = c * d * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
        if self.attention_bias:
            attention += d * (self.num_attention_heads + 2 * self.num_key_value_heads)
        layer = attention + 3 * c * self.intermediate_size + 2 * c
        embeddings = self.vocab_size * c * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + embeddings + c

    def flops_per_token(self, seq_len):
        """Training FLOPs per token (forward + backward), as in the PaLM appendix and the
        PyTorch anchor: 6 · parameters + 12 · layers · heads · head size · seq_len."""
        return 6 * self.num_parameters() + 12 * self.num_hidden_layers * \
            self.num_attention_heads * self.head_size * seq_len


_LLAMA3_SCALING = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}
PRESETS = {
    "tiny": LlamaConfig(vocab_size=257, hidden_size=128, intermediate_size=352,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=256, rms_norm_eps=1e-5,
                        tie_word_embeddings=True),
    "125M": LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                        num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                        max_position_embeddings=2048, rms_norm_eps=1e-5),
    "1B": LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                      num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                      max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                      rope_scaling=dict(_LLAMA3_SCALING, factor=32.0),
                      tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001),
    "1.5B": LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0),
    "8B": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                      rope_scaling=dict(_LLAMA3_SCALING, factor=8.0), bos_token_id=128000,
                      eos_token_id=128001),
}


def preset(name, **overrides):
    """A LlamaConfig by preset name: "tiny", "125M", "1B" (Llama 3.2 1B's shape), "1.5B" (16
    layers x 2048, untied: the benchmark's), "8B" (Llama 3.1 8B's)."""
    if name not in PRESETS:
        raise ValueError(f"unknown Llama preset {name!r}: choose one of {', '.join(PRESETS)}")
    return replace(PRESETS[name], **overrides)


# ---- the model --------------------------------------------------------------------------------
class LlamaDecoderLayer(nn.Module):
    """x + self_attn(input_layernorm(x)), then x + mlp(post_attention_layernorm(x)); each
    sublayer one fused op with its norm and residual where the layouts allow."""

    def __init__(self, config, rotary, mesh, tp):
        super().__init__()
        c, std = config.hidden_size, config.initializer_range
        self.input_layernorm = nn.RMSNorm(c, mesh, config.rms_norm_eps)
        self.self_attn = nn.GroupedQueryAttention(
            c, config.num_attention_heads, config.num_key_value_heads, rotary, config.head_size,
            mesh, tp, config.attention_bias, init_std=std)
        self.post_attention_layernorm = nn.RMSNorm(c, mesh, config.rms_norm_eps)
        self.mlp = nn.SwiGLU(c, config.intermediate_size, mesh, init_std=std)

    def forward(self, x, positions=None, start=0, cache=None):
        """The layer of x (B, T, C), its tokens at `positions` (see GroupedQueryAttention), or
        from `start`."""
        x = self.self_attn(x, residual=x, norm=self.input_layernorm, start=start, cache=cache,
                           positions=positions)
        return self.mlp(x, residual=x, norm=self.post_attention_layernorm)


class LlamaModel(nn.Module):
    """Token embeddings, the decoder layers, the final RMSNorm (Hugging Face's `model.`); one
    rotary embedding shared by the layers. With `recompute`, each layer keeps only its input
    and runs again in backward (`nn.recompute`)."""

    def __init__(self, config, mesh, tp, recompute=False):
        super().__init__()
        self.recompute = recompute
        self.embed_tokens = nn.DEmbedding(config.vocab_size, config.hidden_size, mesh,
                                          init_std=config.initializer_range,
                                          vocab_parallel=True)
        self.rotary_emb = nn.RotaryEmbedding(config.head_size, config.rope_theta,
                                             config.rope_scaling)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, self.rotary_emb, mesh, tp)
                                     for _ in range(config.num_hidden_layers)])
        self.norm = nn.RMSNorm(config.hidden_size, mesh, config.rms_norm_eps)

    def forward(self, ids, positions=None, start=0, cache=None):
        """The final norm's output (B, T, C) for token ids (B, T) at `positions` (a DTensor
        (T,): a sequence split by context parallelism) or from `start` (the tokens an
        `nn.KVCache` holds already, whose layers' caches each layer then uses)."""
        x = self.embed(ids)                                         # (B, T, C)
        for i, layer in enumerate(self.layers):
            if cache is not None:
                x = layer(x, start=start, cache=cache.layer(i))
            else:
                x = self.run_layer(layer, x, positions)
        return self.norm(x)

    def embed(self, ids, positions=None):
        """The token embeddings of ids (B, T): (B, T, C), Replicated along tp, or sharded on
        the sequence there with sequence parallelism (`DEmbedding.sequence_parallel`). No
        positions are added: the layers' rotary angles take them."""
        x = self.embed_tokens(ids)                                  # Partial if vocab-parallel
        return x.redistribute(tuple(Replicated() if p.is_partial() else p for p in x.placements))

    def run_layer(self, layer, x, positions=None):
        """`layer(x)` (its tokens at `positions`), recomputed in backward with `recompute`."""
        if not self.recompute:
            return layer(x, positions)
        return nn.recompute(lambda h: layer(h, positions), x)


class Llama(nn.Module):
    """A Llama-family causal language model (Hugging Face's LlamaForCausalLM); `forward(ids,
    targets=None, positions=None, cache=None)` returns (logits, loss or None), the logits
    vocab-sharded (Shard(-1)) when tensor-parallel. `positions`: the position ids of ids whose
    sequence is split across ranks (context parallelism: `ContextParallel.positions(T)`). With
    an `nn.KVCache` the tokens follow those cached (positions from cache.length), which the
    cache then holds too. `tp`: the tensor-parallel size a model built dense (mesh None) is meant
    for (it decides whether key/value heads split), by default the mesh's. `sequence_parallel`:
    on a mesh, the activations between the tensor-parallel regions are sharded on the sequence
    along tp (`apply_tensor_parallel`'s)."""

    def __init__(self, config, mesh=None, tp=None, recompute=False, sequence_parallel=False):
        super().__init__()
        self.config = config
        if tp is None:
            tp = mesh.shape[nn.tp_dim(mesh)] if mesh is not None else 1
        _build(self, config, mesh, tp, recompute, sequence_parallel)

    def forward(self, ids, targets=None, positions=None, cache=None):
        start = 0 if cache is None else cache.length
        self._check(ids, positions, cache, start + ids.shape[1])
        logits = self.lm_head(self.model(ids, positions, start, cache))        # (B, T, V/tp)
        if cache is not None:
            cache.advance(ids.shape[1])
        loss = None if targets is None else ops.cross_entropy(logits, targets)
        return logits, loss

    def pipeline_parts(self):
        """The pieces `cupytp.parallel.pipeline` cuts into stages: the token embedding, the
        layers `model.layers`, the final norm and LM head (its weight tied to the embedding
        with `tie_word_embeddings`), and the loss."""
        tied = self.config.tie_word_embeddings
        return DecoderParts(
            embed=self.model.embed, embed_modules=("model.embed_tokens",),
            layers="model.layers", run_layer=self.model.run_layer,
            head=lambda x: self.lm_head(self.model.norm(x)), head_modules=("model.norm", "lm_head"),
            loss=ops.cross_entropy, tied=("model.embed_tokens.weight",) if tied else ())

    def _check(self, ids, positions, cache, length):
        """A forward's inputs, before any work: positions where the sequence is split (and one
        per token), not beside a cache; at most the context's length."""
        if positions is None and any(p.is_shard(1) and n > 1
                                     for p, n in zip(ids.placements, ids.mesh.shape)):
            raise ValueError("ids sharded on the sequence need their positions: pass positions= "
                             "(cupytp.parallel.ContextParallel.positions(T) for ids from its "
                             "shard())")
        if positions is not None and cache is not None:
            raise ValueError("a forward with a KV cache takes its positions from the cache: "
                             "pass either positions= or cache=")
        if positions is not None and tuple(positions.shape) != (ids.shape[1],):
            raise ValueError(f"positions must hold one position per token: shape "
                             f"({ids.shape[1]},) for ids {tuple(ids.shape)}, got "
                             f"{tuple(positions.shape)}")
        limit = self.context_length
        if length > limit:
            why = "sliding window (not implemented: the attention here is full)" \
                if self.config.sliding_window and limit == self.config.sliding_window \
                else "context"
            raise ValueError(f"sequence length {length} is longer than the model's {why} of "
                             f"{limit} tokens")

    @property
    def mesh(self):
        return self.model.embed_tokens.weight.mesh

    @property
    def context_length(self):
        """The longest window the model takes."""
        config = self.config
        return min(config.max_position_embeddings, config.sliding_window or math.inf)

    def generate(self, ids, max_new_tokens, temperature=1.0, top_k=None, seed=0):
        """Append `max_new_tokens` sampled tokens to `ids` (NumPy (B, T)), with a KV cache
        (`models.generation`); the same on every rank."""
        return generation.generate(self, ids, max_new_tokens, temperature, top_k, seed)

    # ---- Hugging Face weights ---------------------------------------------------------------
    def hf_state_dict(self):
        """{Hugging Face key: full NumPy array}, Hugging Face's shapes (gathers every shard);
        a tied head's weight is left out, as Hugging Face stores it."""
        out = {}
        for name, tensor in self.state_dict().items():
            out.update(hf_arrays(name, backend.asnumpy(tensor.full_tensor())))
        return out

    def load_hf_state_dict(self, read):
        """Load from Hugging Face keys; `read(key, index)` returns the array `file[key][index]`
        (index: a tuple of slices), so each rank reads only its block. Missing or mis-shaped
        tensors are errors; nothing but the blocks is read."""
        for name, tensor in self.sharded_state_dict().items():
            offsets, local_shape = Layout(tensor.mesh, tensor.shape,
                                          tensor.placements).local_block()
            block = tuple(slice(o, o + n) for o, n in zip(offsets, local_shape))
            value = _read_block(read, name, block)
            if tuple(value.shape) != local_shape:
                raise ValueError(f"{name}: the checkpoint gives a block of shape {value.shape}, "
                                 f"this model needs {local_shape}")
            tensor._local[...] = backend.asarray(value.astype(tensor.dtype))

    def save_pretrained(self, path, dtype=None, max_shard_bytes=5 * 2 ** 30):
        """Write `config.json` and the weights in Hugging Face's format into directory `path`:
        `model.safetensors`, or above `max_shard_bytes` numbered files and
        `model.safetensors.index.json`. `dtype` ("bf16", "fp32", ...): the stored one (the
        parameters' by default). Every rank gathers one parameter at a time; rank 0 writes each
        file under a temporary name and renames it, the index and config last."""
        _save(self, path, dtype, max_shard_bytes)

    @classmethod
    def from_pretrained(cls, path, mesh=None, config=None, dtype=None, recompute=False,
                        sequence_parallel=False):
        """A Llama from a local Hugging Face checkpoint directory (config.json and
        model.safetensors, or a sharded model.safetensors.index.json), laid out on `mesh`;
        each rank reads only its slices. `dtype`: the parameters' (float32 by default)."""
        config = config or config_from_hf(os.path.join(path, "config.json"))
        with _CheckpointReader(path) as read:
            with deferred_init():
                model = cls(config, mesh, recompute=recompute,
                            sequence_parallel=sequence_parallel)
            for name, tensor in model.sharded_state_dict().items():     # before any memory
                for key, shape in hf_shapes(name, tensor.shape).items():
                    if read.shape(key) != shape:
                        raise ValueError(f"{key}: the checkpoint in {path} holds shape "
                                         f"{read.shape(key)}, this model needs {shape}")
            if dtype is not None:
                model.to(dtype)
            nn.materialize(model, initialize=False)       # every value is read next
            model.load_hf_state_dict(read)
        return model


def _build(model, config, mesh, tp, recompute, sequence_parallel):
    """The one place the model is constructed: its layers as recipes (`deferred_init`), laid
    onto `mesh` by the Megatron plan (the input embedding vocab-parallel), then each rank's
    blocks made (unless the caller defers too, to lay the model out further first)."""
    if sequence_parallel and mesh is None:
        raise ValueError("sequence_parallel needs a mesh: build the model on one, or call "
                         "apply_tensor_parallel(model, mesh, sequence_parallel=True)")
    with deferred_init():
        model.model = LlamaModel(config, local_mesh(), tp, recompute)
        model.lm_head = nn.DLMHead(model.model.embed_tokens) if config.tie_word_embeddings \
            else nn.DLMHead(vocab_size=config.vocab_size, embedding_dim=config.hidden_size,
                            init_std=config.initializer_range)
        if mesh is not None:
            apply_tensor_parallel(model, mesh, sequence_parallel)
    if not is_deferring():
        nn.materialize(model)


# ---- names and layouts at the Hugging Face boundary --------------------------------------------
def _hf_keys(name):
    """(how a native parameter maps to Hugging Face's, their keys): "same", "transposed" (an
    `[in, out]` weight of an `[out, in]` one), "packed" (`[in, parts, out]` of one `[out, in]`
    per part) or "packed_bias" (`[parts, out]` of one `[out]` per part)."""
    for fused, parts in (("self_attn.kv_proj.", ("self_attn.k_proj.", "self_attn.v_proj.")),
                         ("mlp.gate_up_proj.", ("mlp.gate_proj.", "mlp.up_proj."))):
        if fused in name:
            prefix, kind = name.split(fused)
            return ("packed" if kind == "weight" else "packed_bias",
                    tuple(prefix + part + kind for part in parts))
    if name.endswith("_proj.weight"):
        return "transposed", (name,)
    return "same", (name,)


def hf_arrays(name, value):
    """{Hugging Face key: array} of the full value of the native parameter (or of its
    gradient) `name`."""
    kind, keys = _hf_keys(name)
    if kind == "transposed":
        return {keys[0]: value.T}
    if kind == "packed":
        return {key: value[:, j].T for j, key in enumerate(keys)}
    if kind == "packed_bias":
        return dict(zip(keys, value))
    return {keys[0]: value}


def hf_shapes(name, shape):
    """{Hugging Face key: shape} of the native parameter `name` of `shape`."""
    kind, keys = _hf_keys(name)
    if kind == "transposed":
        return {keys[0]: shape[::-1]}
    if kind == "packed":
        return {key: (shape[2], shape[0]) for key in keys}
    if kind == "packed_bias":
        return {key: shape[1:] for key in keys}
    return {keys[0]: shape}


def _read_block(read, name, block):
    """This rank's block (a tuple of slices of the native parameter `name`) read from Hugging
    Face's tensors through `read(key, index)`."""
    kind, keys = _hf_keys(name)
    if kind == "transposed":
        rows, cols = block
        return read(keys[0], (cols, rows)).T
    if kind == "packed":
        rows, parts, cols = block
        return numpy.stack([read(keys[j], (cols, rows)).T for j in range(parts.start,
                                                                         parts.stop)], axis=1)
    if kind == "packed_bias":
        parts, cols = block
        return numpy.stack([read(keys[j], (cols,)) for j in range(parts.start, parts.stop)])
    return read(keys[0], block)


class _CheckpointReader:
    """`read(key, index)` over a checkpoint directory's safetensors files (one, or those named
    by model.safetensors.index.json), each opened once; a context manager."""

    def __init__(self, path):
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.isfile(index):
            try:
                with open(index, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(f"{index} is not a safetensors index (a weight_map of "
                                 f"files): {err}") from None
            self.files = {key: os.path.join(path, name) for key, name in weight_map.items()}
        elif os.path.isfile(single):
            self.files = None
            self.single = single
        else:
            raise FileNotFoundError(f"no checkpoint in {path}: it holds neither "
                                    "model.safetensors nor model.safetensors.index.json")
        self.path, self.handles = path, {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for handle, _ in self.handles.values():
            handle.__exit__(None, None, None)
        self.handles.clear()

    def _handle(self, key):
        filename = self.single if self.files is None else self.files.get(key)
        if filename is None:
            raise KeyError(f"the checkpoint in {self.path} has no tensor {key!r}")
        if filename not in self.handles:
            from safetensors import safe_open
            try:
                handle = safe_open(filename, framework="numpy").__enter__()
            except Exception as err:        # safetensors raises its own error types
                raise ValueError(f"{filename} is not a readable safetensors file: "
                                 f"{err}") from None
            self.handles[filename] = (handle, set(handle.keys()))
        return self.handles[filename]

    def _slice(self, key):
        handle, keys = self._handle(key)
        if key not in keys:
            raise KeyError(f"the checkpoint in {self.path} has no tensor {key!r}")
        return handle.get_slice(key)

    def shape(self, key):
        return tuple(self._slice(key).get_shape())

    def __call__(self, key, index):
        return self._slice(key)[index]


def _save(model, path, dtype, max_shard_bytes):
    """save_pretrained's body (see there). A failure to write on rank 0 is the same OSError on
    every rank, raised once every rank has taken part in the gathers (none is left waiting)."""
    from safetensors.numpy import save_file
    first = get_rank() == 0
    dtype = None if dtype is None else backend.dtype(dtype)
    params = list(model.state_dict().items())
    stored = [(name, tensor) for name, tensor in params
              if not (name == "lm_head.weight" and model.config.tie_word_embeddings)]
    sizes = [tensor.size * (dtype or tensor.dtype).itemsize for _, tensor in stored]
    last_of_file = _file_ends(sizes, max_shard_bytes)
    names = ["model.safetensors"] if len(last_of_file) == 1 else \
        [f"model-{i + 1:05d}-of-{len(last_of_file):05d}.safetensors"
         for i in range(len(last_of_file))]
    weight_map, pending, error = {}, {}, None
    for index, (name, tensor) in enumerate(stored):
        value = backend.asnumpy(tensor.full_tensor())         # every rank: a collective
        if not first or error:
            continue
        file = sum(1 for end in last_of_file if end < index)
        for key, array in hf_arrays(name, value).items():
            pending[key] = numpy.ascontiguousarray(array, dtype=dtype or array.dtype)
            weight_map[key] = names[file]
        if index == last_of_file[file]:
            error = _attempt(lambda: _write_file(save_file, pending, path, names[file]))
            pending = {}
    if first and not error:
        error = _attempt(lambda: _write_indexes(model.config, path, names, weight_map,
                                                sum(sizes), dtype or params[0][1].dtype))
    error = broadcast_object(error)
    if error:
        raise OSError(f"save_pretrained could not write {path}: {error}")


def _attempt(write):
    """None when `write()` succeeds, else what went wrong (a line)."""
    try:
        write()
    except OSError as err:
        return f"{type(err).__name__}: {err}"
    return None


def _file_ends(sizes, max_bytes):
    """The index of the last parameter of each file, files filled in order up to `max_bytes`
    (a larger parameter alone); one file at least."""
    ends, total = [], 0
    for index, size in enumerate(sizes):
        if index and total + size > max_bytes:
            ends.append(index - 1)
            total = 0
        total += size
    return ends + [len(sizes) - 1]


def _write_file(save_file, tensors, path, name):
    os.makedirs(path, exist_ok=True)
    _write(save_file, tensors, os.path.join(path, name))


def _write_indexes(config, path, names, weight_map, total, dtype):
    """The index of a sharded checkpoint (when it has several files), then config.json."""
    os.makedirs(path, exist_ok=True)
    if len(names) > 1:
        _write_json({"metadata": {"total_size": total}, "weight_map": weight_map},
                    os.path.join(path, "model.safetensors.index.json"))
    _write_json(hf_config(config, dtype), os.path.join(path, "config.json"))


def _write(save_file, tensors, filename):
    save_file(tensors, filename + ".tmp", metadata={"format": "pt"})
    os.replace(filename + ".tmp", filename)


def _write_json(value, filename):
    with open(filename + ".tmp", "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2)
    os.replace(filename + ".tmp", filename)


# ---- config.json --------------------------------------------------------------------------------
def hf_config(config, dtype=numpy.float32):
    """The Hugging Face config.json of a LlamaConfig (rope in both the old rope_theta /
    rope_scaling fields and transformers 5's rope_parameters)."""
    out = dict(config.extra)
    out.update({
        "architectures": [ARCHITECTURES.get(config.model_type, "LlamaForCausalLM")],
        "model_type": config.model_type, "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads, "head_dim": config.head_size,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "rope_parameters": {"rope_type": "default", **(config.rope_scaling or {}),
                            "rope_theta": config.rope_theta},
        "tie_word_embeddings": config.tie_word_embeddings, "hidden_act": "silu",
        "initializer_range": config.initializer_range, "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id, "torch_dtype": _TORCH_DTYPES[numpy.dtype(dtype)]})
    if config.model_type == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    if config.model_type in ("qwen2", "mistral"):
        out.update(sliding_window=config.sliding_window,
                   use_sliding_window=config.sliding_window is not None)
    return out


_TORCH_DTYPES = {numpy.dtype(numpy.float32): "float32", numpy.dtype(numpy.float64): "float64",
                 numpy.dtype(numpy.float16): "float16", backend.bfloat16: "bfloat16"}
_READ = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
         "num_attention_heads")


def config_from_hf(source):
    """The LlamaConfig of a Hugging Face config.json (a path, or its parsed dict); a file that is
    not one, or a model this module does not build, is a ValueError naming what is wrong."""
    hf = source if isinstance(source, dict) else _load_json(source)
    where = "the config" if isinstance(source, dict) else source
    missing = [k for k in _READ if not isinstance(hf, dict) or k not in hf]
    if missing:
        raise ValueError(f"{where} is not a Llama-family config.json: it lacks "
                         f"{', '.join(missing)}")
    model_type = hf.get("model_type", "llama")
    if model_type not in ("llama", "qwen2", "mistral"):
        raise ValueError(f"{where}: model_type {model_type!r} is not a Llama-family model "
                         "(llama, qwen2, mistral)")
    for flag, why in (("mlp_bias", "MLP biases"),):
        if hf.get(flag):
            raise ValueError(f"{where}: {why} ({flag}) are not supported")
    if model_type == "llama" and hf.get("attention_bias"):
        raise ValueError(f"{where}: attention_bias puts a bias on o_proj too, which is not "
                         "supported (Qwen2's q, k and v biases are)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {hf['hidden_act']!r} is not SwiGLU's silu")
    rope = dict(hf.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default"
                                         else None)
    window = hf.get("sliding_window") if hf.get("use_sliding_window", model_type == "mistral") \
        else None
    known = set(_READ) | {"num_key_value_heads", "head_dim", "max_position_embeddings",
                          "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
                          "tie_word_embeddings", "sliding_window", "use_sliding_window",
                          "initializer_range", "model_type", "bos_token_id", "eos_token_id",
                          "architectures", "attention_bias", "mlp_bias", "hidden_act",
                          "torch_dtype", "dtype", "transformers_version"}
    try:
        return LlamaConfig(
            vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=int(hf["num_attention_heads"]),
            num_key_value_heads=int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
            head_dim=_head_dim(hf),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
            rope_scaling=scaling, tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2", sliding_window=window,
            initializer_range=float(hf.get("initializer_range", 0.02)), model_type=model_type,
            bos_token_id=hf.get("bos_token_id"), eos_token_id=hf.get("eos_token_id"),
            extra={k: v for k, v in hf.items() if k not in known})
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where} has a value that is not a number: {err}") from None


def _head_dim(hf):
    """config.json's head_dim, None where it is hidden_size / num_attention_heads (the
    default, which then follows the other two)."""
    given = hf.get("head_dim")
    default = int(hf["hidden_size"]) // int(hf["num_attention_heads"])
    return None if given is None or int(given) == default else int(given)


def _load_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"no config.json at {path}: a Hugging Face checkpoint "
                                "directory holds one") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None


__all__ = ["Llama", "LlamaConfig", "LlamaModel", "LlamaDecoderLayer", "PRESETS", "preset",
           "config_from_hf", "hf_config", "hf_arrays"]
