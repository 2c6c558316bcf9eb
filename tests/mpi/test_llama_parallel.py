"""A Llama with grouped-query heads (8 query heads over 2 key/value heads; Qwen2's q, k and v
biases and an untied head in some cases) trains exactly like one rank (float64: losses, every
gradient of every step, the parameters after) in each parallel dimension GPT-2 has: sequence
parallelism at tp = 2 (key/value heads split) and tp = 4 (replicated), on 1-D and (dp, tp)
meshes; context parallelism at cp = 2 and 4 over an uneven sequence, zigzag and contiguous, and
beside tensor (and sequence) parallelism; pipelines under every schedule, tied and untied, and
beside tensor (and sequence) parallelism. The collectives of sequence parallelism are the
design's (one all-gather per sublayer's input, not one per product), and the ring's blocks carry
the key/value heads only."""
import json

import pytest

import cupytp
from cupytp import nn
from cupytp.debug import CommTracer
from cupytp.models.llama import Llama
from cupytp.parallel import ContextParallel, pipeline
from cupytp.tensor import Replicated, Shard
from split_model import (
    BATCH, LLAMA, QWEN2, assert_trains_alike, batch, build, dense_run, train, train_pipeline)
from test_sequence_parallel import calls, traced_rows, wire_bytes

CONFIGS = {"llama": LLAMA, "qwen2": QWEN2}


def needs(world, ranks):
    if world.world_size < ranks or world.world_size % ranks:
        pytest.skip(f"needs a multiple of {ranks} ranks")


# ---- sequence parallelism ----------------------------------------------------------------------
@pytest.mark.parametrize("name,recompute", [("llama", False), ("qwen2", True)])
def test_sequence_parallel_trains_like_one_rank(mesh, name, recompute):
    """T = 13 tokens over tp = 2 or 4 (uneven shards), on a tp mesh and a (dp, tp) mesh: the
    stream starts sharded at the vocab-parallel embedding (tied or not), RMSNorm runs on T/tp
    rows, and every loss and gradient is one rank's."""
    tp = mesh.shape[nn.tp_dim(mesh)]
    if tp == 1:
        pytest.skip("needs 2 tensor-parallel ranks")
    config = CONFIGS[name]
    model = build(mesh, sequence_parallel=True, recompute=recompute, config=config)
    assert model.model.embed_tokens.sequence_parallel
    kv = model.model.layers[0].self_attn.kv_proj.weight
    assert kv.placements == nn.tp_placements(
        mesh, Shard(2) if config.num_key_value_heads % tp == 0 else Replicated())
    assert_trains_alike(train(model, mesh), dense_run(recompute, config))


def layer_rows(model, mesh):
    """The tracer's rows on the tp group of one training step on 12 tokens (even shards: every
    rank moves the same bytes): the decoder layers', and those of the end of the backward pass
    (module "-", phase "other": the gradients reduced there)."""
    rows = traced_rows(model, mesh)
    return ([r for r in rows if "LlamaDecoderLayer" in r["module"]],
            [r for r in rows if r["module"] == "-" and r["phase"] == "other"])


def test_sequence_parallel_gathers_once_per_sublayer(mesh1d):
    """Per layer and direction, each sublayer all-gathers its input once (attention's q and
    k|v products share one gather; its backward, one reduce-scatter of their summed gradient)
    and reduce-scatters its output once, the same bytes on the wire as tensor parallelism's two
    all-reduces. The gradients Partial along tp (the RMSNorms' weights under sequence
    parallelism and, where key/value heads are replicated (tp = 4), kv_proj's weight and bias)
    are all-reduced at the end of the backward pass, all in one collective."""
    n = mesh1d.size("tp")
    if n == 1:
        pytest.skip("needs 2 ranks")
    config, layers, itemsize = QWEN2, QWEN2.num_hidden_layers, 8
    c, kv = config.hidden_size, 2 * config.num_key_value_heads * config.head_size
    replicated = [c * kv, kv] if config.num_key_value_heads % n else []   # kv_proj's gradients
    plain, plain_end = layer_rows(build(mesh1d, config=config), mesh1d)
    split, split_end = layer_rows(build(mesh1d, sequence_parallel=True, config=config), mesh1d)
    assert {r["op"] for r in plain} == {"all_reduce"}
    assert (calls(plain, "forward", "all_reduce"), calls(plain, "backward", "all_reduce")) == \
        (2 * layers, 2 * layers)
    assert [(r["op"], r["calls"], r["bytes"]) for r in plain_end] == \
        ([("all_reduce", 1, sum(replicated) * layers * itemsize)] if replicated else [])
    for sublayer in ("self_attn", "mlp"):
        rows = [r for r in split if r["module"].endswith(sublayer)]
        for phase in ("forward", "backward"):
            assert calls(rows, phase, "all_gather") == calls(rows, phase, "reduce_scatter") == \
                layers, (sublayer, phase)
    assert "all_reduce" not in {r["op"] for r in split}
    assert [(r["op"], r["calls"], r["bytes"]) for r in split_end] == \
        [("all_reduce", 1, (2 * c * layers + c + sum(replicated) * layers) * itemsize)]
    assert sum(wire_bytes(r, n) for r in split) == pytest.approx(
        sum(wire_bytes(r, n) for r in plain))


# ---- context parallelism -----------------------------------------------------------------------
@pytest.mark.parametrize("name,load_balance,recompute", [("llama", True, False),
                                                         ("qwen2", False, True)])
def test_context_parallel_trains_like_one_rank(world, name, load_balance, recompute):
    """cp = 2 or 4 over T = 13 tokens (uneven chunks): rotary angles at the permuted positions,
    grouped-query attention as a ring, the MLP fused on the sequence-sharded rows."""
    needs(world, 2)
    mesh = cupytp.DeviceMesh((world.world_size, 1), ("cp", "tp"))
    cp = ContextParallel(mesh, load_balance=load_balance)
    model = build(mesh, cp=cp, recompute=recompute, config=CONFIGS[name])
    assert model.model.layers[1].self_attn.context_parallel is cp
    assert_trains_alike(train(model, mesh, cp), dense_run(recompute, CONFIGS[name]))


@pytest.mark.parametrize("name,sequence_parallel", [("llama", True), ("qwen2", False)])
def test_context_times_tensor_parallel(world, name, sequence_parallel):
    """A (cp, tp) = (2, 2) mesh, query and key/value heads split over tp, with and without
    sequence parallelism (the sequence split over cp, and within that over tp)."""
    needs(world, 4)
    mesh = cupytp.DeviceMesh((2, world.world_size // 2), ("cp", "tp"))
    cp = ContextParallel(mesh)
    model = build(mesh, sequence_parallel=sequence_parallel, cp=cp, config=CONFIGS[name])
    assert_trains_alike(train(model, mesh, cp), dense_run(config=CONFIGS[name]))


def test_ring_blocks_carry_the_key_value_heads(world):
    """Per layer the ring's forward passes cp − 1 key/value blocks of (B, T_j, 2, Hk, D): 2
    key/value heads, not the 8 query heads."""
    needs(world, 2)
    mesh = cupytp.DeviceMesh((world.world_size, 1), ("cp", "tp"))
    cp = ContextParallel(mesh)
    model = build(mesh, cp=cp, config=LLAMA)
    ids, targets, positions = batch(mesh, cp)
    with CommTracer() as tracer:
        model(ids, targets, positions=positions)
    rows = [r for r in json.loads(tracer.to_json())["rows"] if r["op"] == "sendrecv"]
    n, r, t = cp.size, cp.rank, ids.shape[1]
    block = [sum(BATCH.shape[0] * (e - a) for a, e in cp.segments(t, j)) * 2 *
             LLAMA.num_key_value_heads * LLAMA.head_size * 8 for j in range(n)]
    sent = [sum(block[(rank - s) % n] for s in range(n - 1)) for rank in (r, (r - 1) % n)]
    assert [r["module"] for r in rows] == [f"{type(model).__name__}.model.LlamaDecoderLayer."
                                           "self_attn"]          # ReplicateLlama over cp
    assert (rows[0]["calls"], rows[0]["bytes"]) == (LLAMA.num_hidden_layers * (n - 1),
                                                    LLAMA.num_hidden_layers * sum(sent))


def test_bad_input(world):
    needs(world, 2)
    mesh = cupytp.DeviceMesh((world.world_size, 1), ("cp", "tp"))
    cp = ContextParallel(mesh)
    model = build(mesh, cp=cp, config=LLAMA)
    ids, targets, positions = batch(mesh, cp)
    with pytest.raises(ValueError, match="need their positions"):
        model(ids, targets)
    with pytest.raises(ValueError, match="either positions= or cache="):
        model(ids, positions=positions, cache=nn.KVCache(16))
    with pytest.raises(ValueError, match="one position per token"):
        model(ids, targets, positions=cp.positions(ids.shape[1] - 1))
    with pytest.raises(ValueError, match="sequence_parallel needs a mesh"):
        Llama(LLAMA, sequence_parallel=True)


# ---- pipelines ---------------------------------------------------------------------------------
PIPELINES = [("gpipe", "llama", 2), ("1f1b", "qwen2", 4), ("zb_h1", "llama", 2),
             ("interleaved_1f1b", "qwen2", 2)]


def test_pipeline_trains_like_one_rank(world):
    """pp = every rank: each schedule, with the embedding tied to the head (its copy on the
    last stage) and untied, 2 or 4 micro-batches; interleaved 1F1B where its 2·pp stages fit
    the 2 layers (pp ≤ 2)."""
    n = world.world_size
    mesh = cupytp.DeviceMesh((n,), ("pp",))
    for schedule, name, microbatches in PIPELINES:
        config = CONFIGS[name]
        if schedule == "interleaved_1f1b" and 2 * n - 2 > config.num_hidden_layers:
            continue
        pipe = pipeline(build(config=config), mesh, schedule=schedule,
                        microbatches=microbatches)
        names = [name for name, _ in pipe.named_parameters()]
        assert all(name.startswith(("model.", "lm_head.")) for name in names)
        assert_trains_alike(train_pipeline(pipe), dense_run(config=config))


@pytest.mark.parametrize("schedule,name", [("1f1b", "llama"), ("zb_h1", "qwen2")])
def test_pipeline_times_context_parallel(world, schedule, name):
    """A (pp, cp, tp) = (2, 2, 1) mesh: each stage's attention a ring over cp, the pipeline
    laying out every micro-batch's sequence in the ring's order (T = 13: uneven chunks) and
    giving every stage its positions (the rotary angles), gradients summed over cp."""
    if world.world_size != 4:
        pytest.skip("needs 4 ranks")
    mesh = cupytp.DeviceMesh((2, 2, 1), ("pp", "cp", "tp"))
    config = CONFIGS[name]
    model = build(mesh["cp", "tp"], config=config)      # cp applied, gradients not summed yet:
    ContextParallel(mesh["cp", "tp"]).apply(model)      # the pipeline sums them over cp
    pipe = pipeline(model, mesh, schedule=schedule, microbatches=2)
    assert_trains_alike(train_pipeline(pipe), dense_run(config=config))


@pytest.mark.parametrize("schedule,name,sequence_parallel", [("1f1b", "llama", False),
                                                            ("interleaved_1f1b", "qwen2", True)])
def test_pipeline_times_tensor_parallel(world, schedule, name, sequence_parallel):
    """A (pp, tp) = (2, 2) mesh: tensor parallelism inside each stage, with and without
    sequence parallelism (the stages pass activations sharded on the sequence)."""
    if world.world_size != 4:
        pytest.skip("needs 4 ranks")
    mesh = cupytp.DeviceMesh((2, 2), ("pp", "tp"))
    config = CONFIGS[name]
    model = build(mesh["tp"], sequence_parallel=sequence_parallel, config=config)
    pipe = pipeline(model, mesh, schedule=schedule, microbatches=2)
    assert pipe.parameters()[0].mesh == mesh["tp"]
    assert_trains_alike(train_pipeline(pipe), dense_run(config=config))
