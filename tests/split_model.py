"""Tiny float64 decoders trained a few AdamW steps on one fixed batch, on one rank or split
(the sequence by sequence parallelism along tp or context parallelism along cp, the batch over
dp, the layers over a pipeline), and the comparison of the two: losses, every gradient of every
step, the parameters after. `CONFIG`: a GPT-2 with dropout; `LLAMA`: a Llama with grouped-query
heads (8 query heads over 2 key/value heads: split over tp = 2, replicated over tp = 4), tied;
`QWEN2`: the same with q, k and v biases and an untied head."""
import dataclasses

import numpy

import cupytp
from cupytp import nn
from cupytp.models.gpt2 import GPT2, GPT2Config
from cupytp.models.llama import Llama, LlamaConfig
from cupytp.optim import AdamW
from cupytp.parallel import ContextParallel, apply_tensor_parallel, fully_shard, replicate
from cupytp.tensor import Replicated, Shard, local_mesh
from dense_reference import full, lay_out

CONFIG = GPT2Config(vocab_size=37, block_size=16, n_layer=2, n_head=4, n_embd=8, dropout=0.1)
LLAMA = LlamaConfig(vocab_size=37, hidden_size=32, intermediate_size=44, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=16,
                    rms_norm_eps=1e-5, tie_word_embeddings=True)
QWEN2 = dataclasses.replace(LLAMA, attention_bias=True, model_type="qwen2", rope_theta=1e6,
                            tie_word_embeddings=False)
BATCH = numpy.random.default_rng(2).integers(0, CONFIG.vocab_size, size=(4, 14))  # T = 13


def build(mesh=None, sequence_parallel=False, cp=None, recompute=False, fsdp=False,
          config=CONFIG):
    """The model of `config` (float64) on `mesh` (None: one rank), tensor-parallel over its
    "tp" dim (the same parameters on every mesh: GPT-2 pads its vocabulary alike everywhere,
    and the Llama family does not pad), its gradients summed over dp and cp. `fsdp`: True
    shards the parameters over dp, a dim's name over that dim; the other batch dims replicate."""
    cupytp.manual_seed(0)
    model = dense_model(config, mesh, recompute).to("fp64")
    if mesh is not None:
        apply_tensor_parallel(model, mesh, sequence_parallel=sequence_parallel)
        if cp is not None:
            cp.apply(model)
        batch_dims = tuple(d for d in mesh.dim_names                        # gradients summed
                           if d == "dp" or (d == "cp" and cp is not None))
        if fsdp:
            shard = "dp" if fsdp is True else fsdp
            fully_shard(model, mesh, dim=shard,
                        replicate_dim=tuple(d for d in batch_dims if d != shard) or None)
        elif batch_dims:
            replicate(model, mesh, dim=batch_dims)
    return model


def batch(mesh, cp=None, tokens=BATCH):
    """(ids, targets, positions): the batch split over "dp" (when the mesh has it), the
    sequence over cp in its order (positions None without cp)."""
    if mesh is None:
        mesh = local_mesh()
    placements = tuple(Shard(0) if name == "dp" else Replicated() for name in mesh.dim_names)
    ids, targets = (lay_out(a, mesh, placements) for a in (tokens[:, :-1], tokens[:, 1:]))
    if cp is None:
        return ids, targets, None
    return cp.shard(ids), cp.shard(targets), cp.positions(ids.shape[1])


def train(model, mesh=None, cp=None, steps=2):
    """`steps` AdamW steps with dropout: per step the loss and {name: full gradient}; then the
    parameters."""
    optimizer = AdamW(model.parameters(), lr=1e-2)
    cupytp.manual_seed(7)                               # the dropout masks
    losses, grads = [], []
    for _ in range(steps):
        ids, targets, positions = batch(mesh, cp)
        _, loss = model(ids, targets, positions=positions)
        loss.backward()
        losses.append(float(full(loss)))
        grads.append({name: full(p.grad) for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads, {name: full(p) for name, p in model.named_parameters()}


def assert_trains_alike(got, expected, rtol=1e-12, atol=1e-12):
    """Losses, every gradient of every step and the parameters after: equal to float64's last
    bits (sums taken in another order)."""
    numpy.testing.assert_allclose(got[0], expected[0], rtol=rtol)
    for step, (mine, theirs) in enumerate(zip(got[1], expected[1])):
        assert mine.keys() == theirs.keys()
        for name, want in theirs.items():
            numpy.testing.assert_allclose(mine[name], want, rtol=rtol, atol=atol,
                                          err_msg=f"gradient of {name}, step {step}")
    for name, want in expected[2].items():
        numpy.testing.assert_allclose(got[2][name], want, rtol=rtol, atol=atol, err_msg=name)


def dense_model(config, mesh=None, recompute=False):
    """The dense model of `config` (a Llama meant for the tensor-parallel size of `mesh`)."""
    if isinstance(config, GPT2Config):
        return GPT2(config, recompute=recompute)
    tp = 1 if mesh is None else mesh.shape[nn.tp_dim(mesh)]
    return Llama(config, tp=tp, recompute=recompute)


def dense_run(recompute=False, config=CONFIG):
    return train(build(recompute=recompute, config=config))


def train_pipeline(pipe, steps=2):
    """As `train`, for a Pipeline stepping the whole batch: every parameter's gradient and value
    gathered from the ranks holding it."""
    optimizer = AdamW(pipe.parameters(), lr=1e-2)
    cupytp.manual_seed(7)
    losses, grads = [], []
    for _ in range(steps):
        loss = pipe.step(BATCH[:, :-1], BATCH[:, 1:])
        losses.append(float(full(loss)))
        grads.append(_gathered(pipe, lambda p: p.grad))
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads, _gathered(pipe, lambda p: p)


def _gathered(pipe, value):
    """{name: full value(parameter)} of every parameter of the pipelined model."""
    mine = {name: full(value(p)) for name, p in pipe.named_parameters()}
    everyone = {}
    for theirs in pipe.pp_group.all_gather_object(mine):
        everyone.update(theirs)
    return everyone


def with_config(**changes):
    return dataclasses.replace(CONFIG, **changes)


__all__ = ["CONFIG", "LLAMA", "QWEN2", "BATCH", "ContextParallel", "build", "batch", "train",
           "train_pipeline", "assert_trains_alike", "dense_model", "dense_run", "with_config"]
