"""GPT-2 from cupytp.nn, tensor-parallel by apply_tensor_parallel, with Hugging Face weights.

Read bottom-up: config → model (embeddings, blocks, final norm, tied head) → weights in and out.
Parameter names are Hugging Face GPT2LMHeadModel's (`transformer.h.0.attn.c_attn.weight`, ...).
Two native shapes differ: the vocabulary is padded to a multiple of 64 whatever the mesh (the
loss skips the padded columns; the returned logits read -inf there; tensor-parallel ranks take
array_split shares of it, so one checkpoint loads on any mesh), and the fused q|k|v weight is
`[C, 3, C]` (heads on the last axis, to keep tensor parallelism exact).

The model is born sharded: its parameters are built inside `cupytp.deferred_init()` (recipes,
no memory), laid out by `apply_tensor_parallel`, then each rank materializes only its blocks.
Built inside the caller's own `deferred_init()`, it stays deferred, so that `fully_shard` (or
any other layout) can be chosen before `cupytp.materialize(model)` allocates anything.

`hf_state_dict()` and `save_pretrained` give exactly Hugging Face's keys and shapes;
`load_hf_state_dict` and `from_pretrained` take them, each rank reading only its own slices from
a safetensors file.
"""
import json
import math
import os
from dataclasses import asdict, dataclass, replace

import numpy

import cupytp
from cupytp import backend, nn, ops
from cupytp.models import generation
from cupytp.parallel import DecoderParts, apply_tensor_parallel
from cupytp.tensor import Replicated, deferred, deferred_init, is_deferring
from cupytp.tensor.layout import Layout


@dataclass(frozen=True)
class GPT2Config:
    vocab_size: int = 50257
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    tie_word_embeddings: bool = True    # False: the LM head has its own [vocab, C] weight

    def padded_vocab(self):
        """vocab_size rounded up to a multiple of 64, on every mesh (tensor-parallel ranks take
        array_split shares)."""
        return math.ceil(self.vocab_size / 64) * 64

    def flops_per_token(self, seq_len):
        """Training FLOPs per token (forward + backward), as in the PaLM appendix."""
        n = 12 * self.n_layer * self.n_embd ** 2 + (self.vocab_size + self.block_size) * \
            self.n_embd
        return 6 * n + 12 * self.n_layer * self.n_embd * seq_len


PRESETS = {
    "tiny": GPT2Config(vocab_size=257, block_size=256, n_layer=4, n_head=4, n_embd=128),
    "10M": GPT2Config(vocab_size=257, block_size=256, n_layer=6, n_head=6, n_embd=384),
    "124M": GPT2Config(),
    "350M": GPT2Config(n_layer=24, n_head=16, n_embd=1024),
    "774M": GPT2Config(n_layer=36, n_head=20, n_embd=1280),
    "1558M": GPT2Config(n_layer=48, n_head=25, n_embd=1600),
}


def preset(name, **overrides):
    """A GPT2Config by preset name ("tiny", "10M", "124M", "350M", "774M", "1558M")."""
    if name not in PRESETS:
        raise ValueError(f"unknown GPT-2 preset {name!r}: choose one of {', '.join(PRESETS)}")
    return replace(PRESETS[name], **overrides)


class GPT2Transformer(nn.Module):
    """Token and position embeddings, the blocks, the final LayerNorm. With `recompute`, each
    block keeps only its input and is run again in backward (`nn.recompute`)."""

    def __init__(self, config, vocab, recompute=False):
        super().__init__()
        self.recompute = recompute
        std = config.initializer_range
        proj_std = nn.scaled_init(std, config.n_layer)
        self.wte = _padded(nn.DEmbedding(config.vocab_size, config.n_embd, init_std=std,
                                         vocab_parallel=True), vocab)
        self.wpe = nn.DEmbedding(config.block_size, config.n_embd, init_std=std)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList([
            nn.DBlock(config.n_embd, config.n_head, None, config.bias, config.dropout,
                      init_std=std, proj_init_std=proj_std, eps=config.layer_norm_epsilon)
            for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, None, config.layer_norm_epsilon, config.bias)
        self._position_ids = {}                # (T, mesh) -> 0, 1, ..., T-1, made once

    def forward(self, ids, positions=None, cache=None):
        """The final norm's output (B, T, C) for token `ids` (B, T) (see `embed`); with an
        `nn.KVCache` each block attends over the keys and values it holds too."""
        x = self.embed(ids, positions, 0 if cache is None else cache.length)     # (B, T, C)
        for i, block in enumerate(self.h):
            x = block(x, cache.layer(i)) if cache is not None else self.run_block(block, x)
        return self.ln_f(x)

    def embed(self, ids, positions=None, start=0):
        """Token plus position embeddings of `ids` (B, T) at `positions` (T,), after dropout:
        (B, T, C). Positions default to start, ..., start+T-1 (start: the tokens a KV cache
        holds already); ids whose sequence is split across ranks (context parallelism) need
        theirs given (`ContextParallel.positions`)."""
        if positions is None:
            if any(p.is_shard(1) and n > 1 for p, n in zip(ids.placements, ids.mesh.shape)):
                raise ValueError("ids sharded on the sequence need their positions: pass "
                                 "positions= (cupytp.parallel.ContextParallel.positions(T) for "
                                 "ids from its shard())")
            positions = self.positions(ids.shape[1], ids.mesh, start)
        return self.drop(self.wte(ids) + self.wpe(positions))

    def run_block(self, block, x, positions=None):
        """`block(x)`, recomputed in backward with `recompute` (GPT-2's blocks take no
        positions: its embedding adds them)."""
        return nn.recompute(block, x) if self.recompute else block(x)

    def positions(self, t, mesh, start=0):
        """The position ids start, ..., start + t - 1 (Replicated on `mesh`); those from 0 built
        once per length."""
        replicated = (Replicated(),) * mesh.ndim
        if start:
            return cupytp.arange(start + t, mesh, replicated)[start:]
        key = (t, mesh)
        if key not in self._position_ids:
            self._position_ids[key] = cupytp.arange(t, mesh, replicated)
        return self._position_ids[key]


def _padded(embedding, rows):
    """`embedding` (deferred) with zero rows appended up to `rows`; drawn at its real size, so
    the random initialization of the whole model does not depend on the padding."""
    deferred.pad(embedding.weight, (rows, embedding.embedding_dim))
    embedding.num_embeddings = rows
    return embedding


def _mask_padding(logits, vocab_size):
    """`logits` with this rank's padded vocabulary columns (global index >= vocab_size) set to
    -inf in place, so they never win a softmax or a sample; no full-size pass. The loss has
    already been taken and its backward never reads those columns."""
    local = logits.to_local()
    start = min(max(vocab_size - logits.layout.offsets[-1], 0), local.shape[-1])
    local[..., start:] = local.dtype.type(-math.inf)
    return logits


class GPT2(nn.Module):
    """GPT-2 language model; `forward(ids, targets=None)` returns (logits, loss or None), the
    logits vocab-sharded (Shard(-1)) when tensor-parallel. `recompute=True` keeps only each
    block's input for backward and runs the block again there (less memory, one more forward)."""

    def __init__(self, config, mesh=None, recompute=False):
        super().__init__()
        self.config = config
        self.vocab = config.padded_vocab()
        with deferred_init():       # recipes until every parameter has its layout
            self.transformer = GPT2Transformer(config, self.vocab, recompute)
            head = self.transformer.wte
            if not config.tie_word_embeddings:
                head = self.lm_head_embedding = _padded(nn.DEmbedding(
                    config.vocab_size, config.n_embd, init_std=config.initializer_range),
                    self.vocab)
            self.lm_head = nn.DLMHead(head)
            if mesh is not None:
                apply_tensor_parallel(self, mesh)
        if not is_deferring():      # else the caller lays it out further, then materializes
            nn.materialize(self)

    def forward(self, ids, targets=None, positions=None, cache=None):
        """(logits, loss): `positions` as in GPT2Transformer.forward. With an `nn.KVCache` the
        tokens follow those cached (positions from cache.length), which the cache then holds
        too."""
        start = 0 if cache is None else cache.length
        if start + ids.shape[1] > self.config.block_size:
            raise ValueError(f"sequence length {start + ids.shape[1]} is longer than the model's "
                             f"context of {self.config.block_size} tokens")
        logits = self.lm_head(self.transformer(ids, positions, cache))    # (B, T, V/tp)
        if cache is not None:
            cache.advance(ids.shape[1])
        loss = None if targets is None else ops.cross_entropy(
            logits, targets, vocab_size=self.config.vocab_size)       # fp32, padding excluded
        return _mask_padding(logits, self.config.vocab_size), loss

    @property
    def mesh(self):
        return self.transformer.wte.weight.mesh

    @property
    def context_length(self):
        """The longest window the model takes (its learned positions)."""
        return self.config.block_size

    def pipeline_parts(self):
        """The pieces `cupytp.parallel.pipeline` cuts into stages: the embeddings, the blocks
        `transformer.h`, the final norm and LM head (its weight tied to the token embedding
        unless `tie_word_embeddings=False`), and the loss."""
        t, tied = self.transformer, self.config.tie_word_embeddings
        return DecoderParts(
            embed=t.embed, embed_modules=("transformer.wte", "transformer.wpe", "transformer.drop"),
            layers="transformer.h", run_layer=t.run_block,
            head=lambda x: self.lm_head(t.ln_f(x)),
            head_modules=("transformer.ln_f", "lm_head") + (() if tied else ("lm_head_embedding",)),
            loss=lambda logits, y: ops.cross_entropy(logits, y, vocab_size=self.config.vocab_size),
            tied=("transformer.wte.weight",) if tied else ())

    def generate(self, ids, max_new_tokens, temperature=1.0, top_k=None, seed=0):
        """Append `max_new_tokens` sampled tokens to `ids` (NumPy (B, T)), with a KV cache
        (`models.generation`); the same on every rank (the same seed picks the same tokens)."""
        return generation.generate(self, ids, max_new_tokens, temperature, top_k, seed)

    # ---- Hugging Face weights -------------------------------------------------------------------
    def hf_state_dict(self):
        """{Hugging Face key: full NumPy array}, HF shapes (gathers every shard)."""
        out = {}
        c, v = self.config.n_embd, self.config.vocab_size
        for name, tensor in self.state_dict().items():
            value = backend.asnumpy(tensor.full_tensor())
            if name.endswith("attn.c_attn.weight"):
                value = value.reshape(c, 3 * c)
            elif name.endswith("attn.c_attn.bias"):
                value = value.reshape(3 * c)
            elif name in ("transformer.wte.weight", "lm_head_embedding.weight"):
                value = value[:v]
            out[name] = value
        out["lm_head.weight"] = out.pop("lm_head_embedding.weight", out["transformer.wte.weight"])
        return out

    def load_hf_state_dict(self, read):
        """Load from Hugging Face keys; `read(key, index)` returns the array `file[key][index]`
        so each rank reads only its block. Missing or mis-shaped keys are errors."""
        c, v = self.config.n_embd, self.config.vocab_size
        for name, tensor in self.sharded_state_dict().items():     # this rank's blocks
            layout = Layout(tensor.mesh, tensor.shape, tensor.placements)
            offsets, local_shape = layout.local_block()
            block = tuple(slice(o, o + n) for o, n in zip(offsets, local_shape))
            if name.endswith("attn.c_attn.weight"):      # [C, 3C] file -> [C, 3, C] blocks
                rows, _, cols = block
                value = numpy.stack([read(name, (rows, slice(j * c + cols.start,
                                                              j * c + cols.stop)))
                                     for j in range(3)], axis=1)
            elif name.endswith("attn.c_attn.bias"):
                _, cols = block
                value = numpy.stack([read(name, (slice(j * c + cols.start, j * c + cols.stop),))
                                     for j in range(3)])
            elif name == "transformer.wte.weight":      # padded rows past the vocabulary are 0
                rows, cols = block
                value = numpy.zeros(local_shape, dtype=tensor.dtype)   # the model's dtype
                stop = min(rows.stop, v)
                if stop > rows.start:
                    value[:stop - rows.start] = read(name, (slice(rows.start, stop), cols))
            else:
                value = read(name, block)
            if tuple(value.shape) != local_shape:
                raise ValueError(f"{name}: the checkpoint gives a block of shape {value.shape}, "
                                 f"this model needs {local_shape}")
            tensor._local[...] = backend.asarray(value.astype(tensor.dtype))

    def save_pretrained(self, path):
        """Write `model.safetensors` and `config.json` (Hugging Face GPT2LMHeadModel format) into
        directory `path` from rank 0; written to temporary names, then renamed."""
        from safetensors.numpy import save_file
        tensors = self.hf_state_dict()
        if cupytp.distributed.get_rank() != 0:
            return
        os.makedirs(path, exist_ok=True)
        tensors.pop("lm_head.weight")                  # tied: HF stores it once
        tensors = {k: numpy.ascontiguousarray(a, dtype=numpy.float32) for k, a in tensors.items()}
        weights, config = os.path.join(path, "model.safetensors"), os.path.join(path,
                                                                                "config.json")
        save_file(tensors, weights + ".tmp", metadata={"format": "pt"})
        with open(config + ".tmp", "w") as f:
            json.dump(hf_config(self.config), f, indent=2)
        os.replace(weights + ".tmp", weights)
        os.replace(config + ".tmp", config)

    @classmethod
    def from_pretrained(cls, path, mesh=None, config=None):
        """A GPT2 from a local Hugging Face checkpoint (a `model.safetensors` file or a directory
        with it and `config.json`), laid out on `mesh`; each rank reads only its slices."""
        from safetensors import safe_open
        weights = os.path.join(path, "model.safetensors") if os.path.isdir(path) else path
        if not os.path.isfile(weights):
            raise FileNotFoundError(f"no checkpoint at {weights}: give a model.safetensors "
                                    "file or a directory holding one")
        if config is None:
            config_path = os.path.join(os.path.dirname(weights), "config.json")
            config = config_from_hf(config_path) if os.path.isfile(config_path) else None
        try:
            handle = safe_open(weights, framework="numpy")
        except Exception as err:   # safetensors raises its own error types
            raise ValueError(f"{weights} is not a readable safetensors file: {err}") from None
        with handle as f:
            keys = set(f.keys())
            config = config or _infer_config(f)
            with deferred_init():
                model = cls(config, mesh)
            nn.materialize(model, initialize=False)       # every value is read next
            prefix = "" if "transformer.wte.weight" in keys else "transformer."

            def read(name, index):
                key = name if prefix == "" else name.replace("transformer.", "", 1)
                if key not in keys:
                    raise KeyError(f"{weights} has no tensor {key!r}")
                return f.get_slice(key)[index]
            model.load_hf_state_dict(read)
        return model


def hf_config(config):
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": config.vocab_size, "n_positions": config.block_size,
            "n_ctx": config.block_size, "n_embd": config.n_embd, "n_layer": config.n_layer,
            "n_head": config.n_head, "layer_norm_epsilon": config.layer_norm_epsilon,
            "initializer_range": config.initializer_range, "resid_pdrop": config.dropout,
            "embd_pdrop": config.dropout, "attn_pdrop": config.dropout,
            "activation_function": "gelu_new", "cupytp": asdict(config)}


def config_from_hf(path):
    """The GPT2Config of a Hugging Face `config.json`; a file that is not one is a ValueError
    naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            hf = json.load(f)
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    missing = [k for k in ("vocab_size", "n_layer", "n_head", "n_embd")
               if not isinstance(hf, dict) or k not in hf]
    if missing:
        raise ValueError(f"{path} is not a GPT-2 config.json: it lacks {', '.join(missing)}")
    try:
        return GPT2Config(vocab_size=int(hf["vocab_size"]),
                          block_size=int(hf.get("n_positions", 1024)),
                          n_layer=int(hf["n_layer"]), n_head=int(hf["n_head"]),
                          n_embd=int(hf["n_embd"]),
                          layer_norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-5)))
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path} has a value that is not a number: {err}") from None


def _infer_config(f):
    keys = set(f.keys())
    prefix = "transformer." if "transformer.wte.weight" in keys else ""
    vocab, embd = f.get_slice(prefix + "wte.weight").get_shape()
    positions = f.get_slice(prefix + "wpe.weight").get_shape()[0]
    layers = len({k.split(".")[2 if prefix else 1] for k in keys if ".h." in f".{k}"})
    heads = max(1, embd // 64)
    return GPT2Config(vocab_size=vocab, block_size=positions, n_layer=layers, n_head=heads,
                      n_embd=embd)
