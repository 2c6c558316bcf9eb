"""Context parallelism (the sequence split along a "cp" mesh dimension, attention as a ring):
`ProcessGroup.sendrecv` around a ring; ring attention equal to attention over the whole
sequence (causal or not, zigzag or contiguous, uneven chunks, heads split over tp, dropout;
q|k|v packed, and grouped-query heads with key/value heads split or replicated over tp), in
float64 and on the flash kernels' NumPy twin, and over a batch in micro-batches (dropout
drawn as the whole batch's); a GPT-2 with dropout trains exactly like one
rank for cp = 2 and 4, with recomputation, with tensor (and sequence) parallelism beside it and
with fully sharded data parallelism; the ring's messages per layer; clear errors."""
import contextlib
import json

import numpy
import pytest

import cupytp
from cupytp import backend, ops
from cupytp.debug import CommTracer
from cupytp.launchers import cudnn_attention
from cupytp.parallel import ContextParallel
from cupytp.tensor import Replicated, Shard, local_mesh
from dense_reference import full, lay_out, rng_array
from split_model import (
    BATCH, CONFIG, assert_trains_alike, batch, build, dense_run, train, with_config)


def needs(world, ranks):
    if world.world_size < ranks or world.world_size % ranks:
        pytest.skip(f"needs a multiple of {ranks} ranks")


def test_sendrecv_passes_blocks_around_a_ring(world):
    """Every rank sends its block (of its own length) to the next and gets the previous
    rank's, blocking and asynchronously; the tracer sees one sendrecv each."""
    needs(world, 2)
    group = cupytp.DeviceMesh((world.world_size,), ("cp",)).get_process_group("cp")
    n, r = group.size, group.rank
    block = backend.asarray(numpy.full((r + 1, 3), float(r)))
    with CommTracer() as tracer:
        got = group.sendrecv(block, (r + 1) % n, (r - 1) % n, shape=(((r - 1) % n) + 1, 3))
        work = group.sendrecv(got, (r + 1) % n, (r - 1) % n, shape=(((r - 2) % n) + 1, 3),
                              async_op=True)
        again = work.wait()
    numpy.testing.assert_array_equal(backend.asnumpy(got),
                                     numpy.full(((r - 1) % n + 1, 3), (r - 1) % n))
    numpy.testing.assert_array_equal(backend.asnumpy(again),
                                     numpy.full(((r - 2) % n + 1, 3), (r - 2) % n))
    rows = json.loads(tracer.to_json())["rows"]
    assert [(row["op"], row["calls"]) for row in rows] == [("sendrecv", 2)]
    one = cupytp.local_mesh().get_process_group(0)
    assert one.sendrecv(block, 0, 0) is block
    with pytest.raises(ValueError, match="not in group"):
        group.sendrecv(block, n, 0)


def cp_mesh(world, tp=1):
    return cupytp.DeviceMesh((world.world_size // tp, tp), ("cp", "tp"))


@pytest.mark.parametrize("causal,load_balance,dropout", [
    (True, True, 0.0), (True, True, 0.3), (True, False, 0.3), (False, True, 0.0)])
@pytest.mark.parametrize("tp", [1, 2])
def test_ring_attention_is_attention_over_the_whole_sequence(world, tp, causal, load_balance,
                                                            dropout):
    """q|k|v (B, T, 3, H, D) float64, T = 13 split over cp (uneven chunks), heads over tp: the
    output and q|k|v's gradient of one rank's attention, in the ring's order; the same dropout
    mask (drawn by position)."""
    needs(world, 2 * tp)
    mesh = cp_mesh(world, tp)
    cp = ContextParallel(mesh, load_balance=load_balance)
    b, t, h, d = 2, 13, 4, 3
    value, weight = rng_array((b, t, 3, h, d), 1), rng_array((b, t, h, d), 2)
    cupytp.manual_seed(4)
    qkv = lay_out(value, local_mesh(), (Replicated(),), requires_grad=True)
    out = ops.packed_attention(qkv, causal, dropout)
    (out * lay_out(weight, local_mesh(), (Replicated(),))).sum().backward()
    order = cp.order(t)
    cupytp.manual_seed(4)
    ring_qkv = lay_out(value[:, order], mesh, (Shard(1), Shard(3)), requires_grad=True)
    ring_out = cp.attention(ring_qkv, causal, dropout)
    assert ring_out.placements == (Shard(1), Shard(2))
    (ring_out * lay_out(weight[:, order], mesh, (Shard(1), Shard(2)))).sum().backward()
    numpy.testing.assert_allclose(full(ring_out), full(out)[:, order], rtol=1e-12, atol=1e-14)
    assert ring_qkv.grad.placements == ring_qkv.placements
    numpy.testing.assert_allclose(full(ring_qkv.grad), full(qkv.grad)[:, order], rtol=1e-11,
                                  atol=1e-13)


@pytest.mark.parametrize("split", [2, (1, 2)], ids=["equal", "uneven"])
def test_ring_attention_in_microbatches_draws_the_whole_batch(world, split):
    """Two attentions with dropout 0.3 over the batch (4 rows in 2 micro-batches, or 3 in
    1 + 2) through the ring micro-batch by micro-batch, each inside `cupytp.microbatch`: the
    outputs and q|k|v's gradients of one rank's over the whole batch, masks included (the
    ring's draws skip the rows before the micro-batch); outside the contexts they differ."""
    needs(world, 2)
    mesh = cp_mesh(world)
    cp = ContextParallel(mesh)
    sizes = [2, 2] if split == 2 else list(split)
    b, t, h, d = sum(sizes), 13, 4, 3
    value, weight = rng_array((b, t, 3, h, d), 1), rng_array((b, t, h, d), 2)

    def run(attend, mesh, placements, rows, order):
        qkv = lay_out(value[rows][:, order], mesh, placements, requires_grad=True)
        out = attend(qkv, True, 0.3) + 0.5 * attend(qkv, True, 0.3)       # two draws
        (out * lay_out(weight[rows][:, order], mesh, placements)).sum().backward()
        return full(out), full(qkv.grad)

    cupytp.manual_seed(4)
    everything = slice(None)
    whole = run(ops.packed_attention, local_mesh(), (Replicated(),), everything, everything)
    order, starts = cp.order(t), numpy.cumsum([0] + sizes)
    for inside in (True, False):
        cupytp.manual_seed(4)
        parts = []
        for k, (a, z) in enumerate(zip(starts[:-1], starts[1:])):
            with cupytp.microbatch(k, split) if inside else contextlib.nullcontext():
                parts.append(run(cp.attention, mesh, (Shard(1), Replicated()), slice(a, z),
                                 order))
        got = [numpy.concatenate(p) for p in zip(*parts)]
        if not inside:
            assert not numpy.allclose(got[0], whole[0][:, order])
            continue
        numpy.testing.assert_allclose(got[0], whole[0][:, order], rtol=1e-12, atol=1e-14)
        numpy.testing.assert_allclose(got[1], whole[1][:, order], rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize("t,dropout,attention", [(11, 0.0, "auto"), (11, 0.3, "auto"),
                                                 (32, 0.3, "auto"), (32, 0.0, "cudnn")])
def test_ring_attention_on_the_flash_kernels(world, t, dropout, attention, monkeypatch):
    """bf16 with head size 64 takes the flash kernels (their NumPy twin here): the ring's
    merged blocks agree with one rank's flash attention to bf16's rounding, gradients too, with
    dropout drawn by each block's query and key positions (T = 32: chunks of 4s, whose keys
    share Philox calls in the kernels) as the whole sequence's attention draws it. On a GPU
    with the cuDNN frontend, CUPYTP_ATTENTION=cudnn runs the causal diagonal blocks and the
    other ranks' unmasked blocks of unequal lengths there."""
    needs(world, 2)
    if attention == "cudnn" and backend.on_gpu and cudnn_attention._frontend(False) is None:
        pytest.skip("needs the cuDNN frontend")
    monkeypatch.setenv("CUPYTP_ATTENTION", attention)
    mesh = cp_mesh(world)
    cp = ContextParallel(mesh)
    b, h, d = 1, 2, 64
    value = rng_array((b, t, 3, h, d), 5).astype("bfloat16")
    weight = rng_array((b, t, h, d), 6).astype("bfloat16")
    cupytp.manual_seed(3)
    qkv = lay_out(value, local_mesh(), (Replicated(),), requires_grad=True)
    out = ops.packed_attention(qkv, dropout_p=dropout)
    (out * lay_out(weight, local_mesh(), (Replicated(),))).sum().backward()
    order = cp.order(t)
    cupytp.manual_seed(3)
    ring_qkv = lay_out(value[:, order], mesh, (Shard(1), Replicated()), requires_grad=True)
    ring_out = cp.attention(ring_qkv, dropout_p=dropout)
    (ring_out * lay_out(weight[:, order], mesh, (Shard(1), Replicated()))).sum().backward()
    numpy.testing.assert_allclose(full(ring_out).astype(float),
                                  full(out)[:, order].astype(float), atol=2e-2)
    numpy.testing.assert_allclose(full(ring_qkv.grad).astype(float),
                                  full(qkv.grad)[:, order].astype(float), atol=6e-2)


@pytest.mark.parametrize("kv_heads,dropout", [(2, 0.0), (1, 0.3)])
@pytest.mark.parametrize("tp", [1, 2])
def test_grouped_ring_attention_is_attention_over_the_whole_sequence(world, tp, kv_heads,
                                                                    dropout):
    """Queries (B, T, H, D) over fewer key/value heads, float64, T = 13 over cp (uneven
    chunks), query heads over tp: 4 over 2 key/value heads (split over tp like the queries'),
    4 over 1 (the one head on every tp rank, each reading it for its own query heads and giving
    its share of its gradient): the output and every gradient of one rank's grouped-query
    attention, in the ring's order; the same dropout mask."""
    needs(world, 2 * tp)
    mesh = cp_mesh(world, tp)
    cp = ContextParallel(mesh)
    b, t, h, d = 2, 13, 4, 3
    values = [rng_array((b, t, heads, d), seed) for heads, seed in ((h, 1), (kv_heads, 2),
                                                                     (kv_heads, 3))]
    weight = rng_array((b, t, h, d), 4)
    cupytp.manual_seed(4)
    dense = [lay_out(a, local_mesh(), (Replicated(),), requires_grad=True) for a in values]
    out = ops.scaled_dot_product_attention(*(a.transpose(1, 2) for a in dense),
                                           dropout_p=dropout).transpose(1, 2)
    (out * lay_out(weight, local_mesh(), (Replicated(),))).sum().backward()
    order = cp.order(t)
    kv_heads_split = Shard(2) if kv_heads % tp == 0 else Replicated()
    cupytp.manual_seed(4)
    ring = [lay_out(a[:, order], mesh, (Shard(1), Shard(2) if i == 0 else kv_heads_split),
                    requires_grad=True) for i, a in enumerate(values)]
    ring_out = cp.grouped_attention(*ring, dropout_p=dropout)
    assert ring_out.placements == (Shard(1), Shard(2))
    (ring_out * lay_out(weight[:, order], mesh, (Shard(1), Shard(2)))).sum().backward()
    numpy.testing.assert_allclose(full(ring_out), full(out)[:, order], rtol=1e-12, atol=1e-14)
    for name, mine, theirs in zip("qkv", ring, dense):
        numpy.testing.assert_allclose(full(mine.grad), full(theirs.grad)[:, order], rtol=1e-11,
                                      atol=1e-13, err_msg=f"gradient of {name}")


def test_grouped_ring_attention_on_the_flash_kernels(world):
    """bf16 with head size 64, 2 query heads over 1 key/value head: the flash kernels' twin
    reads the key/value head for both query heads in every block; the ring agrees with one
    rank's flash attention to bf16's rounding, gradients too."""
    needs(world, 2)
    mesh = cp_mesh(world)
    cp = ContextParallel(mesh)
    b, t, d = 1, 11, 64
    values = [rng_array((b, t, heads, d), seed).astype("bfloat16")
              for heads, seed in ((2, 5), (1, 6), (1, 7))]
    weight = rng_array((b, t, 2, d), 8).astype("bfloat16")
    dense = [lay_out(a, local_mesh(), (Replicated(),), requires_grad=True) for a in values]
    out = ops.scaled_dot_product_attention(*(a.transpose(1, 2) for a in dense)).transpose(1, 2)
    (out * lay_out(weight, local_mesh(), (Replicated(),))).sum().backward()
    order = cp.order(t)
    ring = [lay_out(a[:, order], mesh, (Shard(1), Replicated()), requires_grad=True)
            for a in values]
    ring_out = cp.grouped_attention(*ring)
    (ring_out * lay_out(weight[:, order], mesh, (Shard(1), Replicated()))).sum().backward()
    numpy.testing.assert_allclose(full(ring_out).astype(float),
                                  full(out)[:, order].astype(float), atol=2e-2)
    for mine, theirs in zip(ring, dense):
        numpy.testing.assert_allclose(full(mine.grad).astype(float),
                                      full(theirs.grad)[:, order].astype(float), atol=6e-2)


@pytest.mark.parametrize("load_balance,recompute", [(True, False), (False, True)])
def test_context_parallel_gpt2_trains_like_one_rank(world, load_balance, recompute):
    """cp = 2 or 4 over T = 13 tokens (uneven chunks), causal, dropout 0.1 on the embeddings,
    the attention and the residuals: two AdamW steps give one rank's losses, every gradient and
    the parameters after."""
    needs(world, 2)
    mesh = cp_mesh(world)
    cp = ContextParallel(mesh, load_balance=load_balance)
    model = build(mesh, cp=cp, recompute=recompute)
    assert_trains_alike(train(model, mesh, cp), dense_run(recompute))


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_context_times_tensor_parallel(world, sequence_parallel):
    """A (cp, tp) = (2, 2) mesh, heads split over tp, with and without sequence parallelism
    (the sequence then split over cp, and within that over tp): one rank's training."""
    needs(world, 4)
    mesh = cupytp.DeviceMesh((2, world.world_size // 2), ("cp", "tp"))
    cp = ContextParallel(mesh)
    model = build(mesh, sequence_parallel=sequence_parallel, cp=cp)
    assert_trains_alike(train(model, mesh, cp), dense_run())


def test_context_parallel_with_fully_sharded_data_parallel(world):
    """A (dp, cp, tp) = (2, 2, 1) mesh, the model fully sharded over dp, the batch split over
    dp and each sequence over cp: one rank's training."""
    needs(world, 4)
    mesh = cupytp.DeviceMesh((2, world.world_size // 2, 1), ("dp", "cp", "tp"))
    cp = ContextParallel(mesh)
    model = build(mesh, cp=cp, fsdp=True)
    assert_trains_alike(train(model, mesh, cp), dense_run())


@pytest.mark.parametrize("dims", [(1, 2), (2, 2)])
def test_parameters_fully_sharded_over_cp(world, dims):
    """The parameters, gradients and optimizer states sharded over cp itself (torchtitan's FSDP
    over its dp×cp ranks), a (dp, cp, tp) mesh with dp replicated: one rank's training."""
    needs(world, dims[0] * dims[1])
    mesh = cupytp.DeviceMesh(dims + (world.world_size // (dims[0] * dims[1]),),
                             ("dp", "cp", "tp"))
    cp = ContextParallel(mesh)
    model = build(mesh, cp=cp, fsdp="cp")
    assert_trains_alike(train(model, mesh, cp), dense_run())


def test_ring_messages_per_layer(world):
    """Per attention layer and step: cp − 1 key/value blocks forward; backward cp − 1 blocks
    again and cp of their gradients (the last one home); each the size of its rank's block, the
    bytes of each call counted both ways (sent and received)."""
    needs(world, 2)
    mesh = cp_mesh(world)
    cp = ContextParallel(mesh)
    model = build(mesh, cp=cp, config=with_config(dropout=0.0))
    ids, targets, positions = batch(mesh, cp)
    with CommTracer() as tracer:
        _, loss = model(ids, targets, positions=positions)
        loss.backward()
    rows = {(r["phase"], r["module"]): r for r in json.loads(tracer.to_json())["rows"]
            if r["op"] == "sendrecv"}
    attention = f"{type(model).__name__}.transformer.DBlock.attn"   # ReplicateGPT2 over cp
    assert set(rows) == {("forward", attention), ("backward", attention)}
    n, r, t = cp.size, cp.rank, ids.shape[1]
    block = [sum(BATCH.shape[0] * (e - a) for a, e in cp.segments(t, j)) * 2 * CONFIG.n_embd * 8
             for j in range(n)]                        # (B, T_j, 2, H, D) float64
    def sent(rank):                                    # forward; backward adds the gradients
        forward = sum(block[(rank - s) % n] for s in range(n - 1))
        return forward, forward + sum(block[(rank - s) % n] for s in range(n))
    # a rank's sendrecv moves what it sends and what it receives, its predecessor's sends
    sent_forward, sent_backward = (a + b for a, b in zip(sent(r), sent((r - 1) % n)))
    forward, backward = (rows[(phase, attention)]
                         for phase in ("forward", "backward"))
    assert (forward["calls"], backward["calls"]) == (CONFIG.n_layer * (n - 1),
                                                     CONFIG.n_layer * (2 * n - 1))
    assert (forward["bytes"], backward["bytes"]) == (CONFIG.n_layer * sent_forward,
                                                     CONFIG.n_layer * sent_backward)


def test_bad_input(world):
    needs(world, 2)
    mesh = cp_mesh(world)
    with pytest.raises(ValueError, match="no dimension 'seq'"):
        ContextParallel(mesh, "seq")
    cp = ContextParallel(mesh)
    model = build(mesh, cp=cp)
    ids, targets, _ = batch(mesh, cp)
    with pytest.raises(ValueError, match="need their positions"):
        model(ids, targets)
    with pytest.raises(ValueError, match="sequence \\(dim 1\\)"):
        cp.shard(ids)
    with pytest.raises(ValueError, match="not on"):
        cp.apply(build())
    sharded_over_cp = cupytp.DeviceMesh((world.world_size,), ("cp",))
    with pytest.raises(ValueError, match="name one 'tp'"):
        ContextParallel(sharded_over_cp).apply(build(sharded_over_cp))
