"""Context parallelism's pieces on one process: the zigzag order (every token once, the causal
work balanced), the blocks of each ring step against the causal mask, and the log-sum-exp merge
of partial attention against a NumPy twin (softmax attention over all the keys at once), and
every rank's blocks on the flash kernels against one flash attention (on a GPU: the kernels on
strided block views)."""
import math

import numpy
import pytest

import cupytp
from cupytp.backend import asnumpy, bfloat16, xp
from cupytp.distributed.process_group import split_sizes
from cupytp.launchers.flash_attention import attention_backward, attention_forward
from cupytp.ops.functional import unpacked
from cupytp.parallel.context import _Flash, block_plan, merge, positions_of, segments


@pytest.mark.parametrize("parts", [1, 2, 3, 4])
@pytest.mark.parametrize("length", [1, 5, 8, 13, 16, 31])
def test_zigzag_holds_every_token_once_in_chunks_r_and_2cp_minus_1_minus_r(parts, length):
    held = [segments(length, parts, r) for r in range(parts)]
    assert sorted(numpy.concatenate([positions_of(s) for s in held]).tolist()) == \
        list(range(length))
    assert [sum(b - a for a, b in s) for s in held] == split_sizes(length, parts)
    chunks = sorted((a, b, r, half) for r, s in enumerate(held) for half, (a, b) in enumerate(s)
                    if b > a)                        # in sequence order (empty ones left out)
    order = [r if half == 0 else 2 * parts - 1 - r for _, _, r, half in chunks]
    assert order == sorted(order)                    # chunk r, then chunk 2·cp−1−r
    assert len(chunks) == 2 * parts or length < 2 * parts
    for s in held:
        assert list(positions_of(s)) == sorted(positions_of(s))      # ascending on each rank


def causal_work(length, parts, rank, load_balance):
    """Query-key pairs a rank computes under a causal mask."""
    return int((positions_of(segments(length, parts, rank, load_balance)) + 1).sum())


def test_zigzag_balances_the_causal_work():
    length, parts = 4096, 4
    zigzag = [causal_work(length, parts, r, True) for r in range(parts)]
    contiguous = [causal_work(length, parts, r, False) for r in range(parts)]
    assert max(zigzag) / min(zigzag) < 1.001
    assert max(contiguous) / min(contiguous) > 6


@pytest.mark.parametrize("load_balance", [True, False])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("length,parts", [(13, 4), (16, 2), (7, 3), (3, 2)])
def test_blocks_of_each_step_are_the_attention_mask(length, parts, causal, load_balance):
    """Every (query, key) pair the mask allows is in exactly one block, no other pair is, and
    a block is causal only on the diagonal of a rank with itself."""
    for rank in range(parts):
        mine = segments(length, parts, rank, load_balance)
        for source in range(parts):
            theirs = segments(length, parts, source, load_balance)
            q, k = positions_of(mine), positions_of(theirs)
            allowed = (k[None, :] <= q[:, None]) if causal else numpy.ones((q.size, k.size), bool)
            covered = numpy.zeros((q.size, k.size), int)
            for rows, cols, diagonal in block_plan(mine, theirs, causal):
                cells = numpy.ones((rows.stop - rows.start, cols.stop - cols.start), bool)
                if diagonal:
                    assert source == rank
                    cells = numpy.tril(cells)
                covered[rows, cols] += cells
            numpy.testing.assert_array_equal(covered, allowed.astype(int))
            if load_balance and causal:
                assert len(block_plan(mine, theirs, causal)) <= 1   # one launch per step


def attention(q, k, v, visible):
    """NumPy twin: softmax attention of q (H, T, D) over k, v (H, S, D) where `visible`
    (T, S); returns (o, lse) with lse −inf on a row that sees nothing."""
    s = numpy.where(visible, numpy.einsum("htd,hsd->hts", q, k), -numpy.inf)
    m = s.max(-1, keepdims=True)
    e = numpy.exp(s - numpy.where(numpy.isfinite(m), m, 0))
    total = e.sum(-1, keepdims=True)
    with numpy.errstate(divide="ignore", invalid="ignore"):
        o = numpy.where(total > 0, numpy.einsum("hts,hsd->htd", e, v) / total, 0)
        lse = numpy.where(total > 0, m + numpy.log(total), -numpy.inf)[..., 0]
    return o, lse


def test_merge_of_partial_results_is_attention_over_all_keys():
    """Keys in four blocks, merged in a scrambled order, some rows seeing nothing in some
    blocks (and one row nothing at all): the merged output and log-sum-exp are those of one
    softmax over every key."""
    rng = numpy.random.default_rng(0)
    h, t, s, d = 3, 9, 20, 5
    q, k, v = (rng.standard_normal(shape) for shape in ((h, t, d), (h, s, d), (h, s, d)))
    visible = rng.random((t, s)) < 0.6
    visible[:, 5:10] &= numpy.arange(t)[:, None] < 4       # rows 4.. see nothing in block 1
    visible[7] = False                                       # row 7 sees no key at all
    expected_o, expected_lse = attention(q, k, v, visible)
    o = numpy.zeros((h, t, d))
    lse = numpy.full((h, t), -numpy.inf)
    for block in (slice(10, 20), slice(5, 10), slice(0, 3), slice(3, 5)):
        o_block, lse_block = attention(q, k[:, block], v[:, block], visible[:, block])
        merge(o, lse, o_block, lse_block)
    numpy.testing.assert_allclose(o, expected_o, rtol=1e-12, atol=1e-14)
    numpy.testing.assert_array_equal(numpy.isfinite(lse), numpy.isfinite(expected_lse))
    finite = numpy.isfinite(expected_lse)
    numpy.testing.assert_allclose(lse[finite], expected_lse[finite], rtol=1e-12)
    assert not o[:, 7].any()


@pytest.mark.parametrize("parts,length", [(2, 37), (4, 130)])
def test_ring_blocks_on_the_flash_kernels(parts, length):
    """Every rank's ring, played on one device: its blocks (strided views into the packed
    q|k|v, causal on its own, unmasked against the others) on the flash kernels (their NumPy
    twin on the CPU), merged by log-sum-exp, then the backward from the merged output and
    log-sum-exp: one flash attention over the whole sequence, gradients summed, to bf16's
    rounding."""
    cupytp.init()
    b, h, d = 2, 2, 64
    scale = 1 / math.sqrt(d)
    rng = numpy.random.default_rng(1)
    packed = xp.asarray(rng.standard_normal((b, length, 3, h, d)).astype(bfloat16))
    grad_out = xp.asarray(rng.standard_normal((b, length, h, d)).astype(bfloat16))
    q, k, v = unpacked(packed)
    o_ref, lse_ref = attention_forward(q, k, v, True, scale)
    grads_ref = attention_backward(q, k, v, o_ref, lse_ref, grad_out.transpose(0, 2, 1, 3),
                                   True, scale)
    held = [segments(length, parts, r) for r in range(parts)]
    where = [xp.asarray(positions_of(s)) for s in held]
    kv = [xp.ascontiguousarray(packed[:, w, 1:]) for w in where]
    grad_q, grad_kv = xp.zeros(q.shape, numpy.float32), xp.zeros(packed.shape, numpy.float32)
    kernels = _Flash()
    for r in range(parts):
        local_q = unpacked(xp.ascontiguousarray(packed[:, where[r]]))[0]     # (B, H, T/cp, D)
        o = xp.zeros(local_q.shape, numpy.float32)
        lse = xp.full(local_q.shape[:3], -numpy.inf, numpy.float32)
        steps = [(s, block_plan(held[r], held[s], True)) for s in range(parts)]
        for s, blocks in steps:
            keys, values = (kv[s][:, :, i].transpose(0, 2, 1, 3) for i in (0, 1))
            for rows, cols, diagonal in blocks:
                merge(o[:, :, rows], lse[:, :, rows], *kernels.forward(
                    local_q[:, :, rows], keys[:, :, cols], values[:, :, cols], diagonal, scale,
                    None))
        numpy.testing.assert_allclose(asnumpy(o), asnumpy(o_ref[:, :, where[r]]).astype(float),
                                      atol=2e-2)
        numpy.testing.assert_allclose(asnumpy(lse), asnumpy(lse_ref[:, :, where[r]]), rtol=1e-4)
        o = xp.ascontiguousarray(o.transpose(0, 2, 1, 3)).astype(bfloat16).transpose(0, 2, 1, 3)
        do = xp.ascontiguousarray(grad_out[:, where[r]]).transpose(0, 2, 1, 3)
        for s, blocks in steps:
            keys, values = (kv[s][:, :, i].transpose(0, 2, 1, 3) for i in (0, 1))
            for rows, cols, diagonal in blocks:
                dq, dk, dv = kernels.backward(local_q[:, :, rows], keys[:, :, cols],
                                              values[:, :, cols], o[:, :, rows], lse[:, :, rows],
                                              do[:, :, rows], diagonal, scale, None)
                grad_q[:, :, where[r][rows]] += dq
                grad_kv[:, where[s][cols], 1] += dk.transpose(0, 2, 1, 3)
                grad_kv[:, where[s][cols], 2] += dv.transpose(0, 2, 1, 3)
    got = (grad_q, grad_kv[:, :, 1].transpose(0, 2, 1, 3), grad_kv[:, :, 2].transpose(0, 2, 1, 3))
    for name, mine, want in zip("qkv", got, grads_ref):
        numpy.testing.assert_allclose(asnumpy(mine), asnumpy(want).astype(float), atol=5e-2,
                                      err_msg=f"d{name}")
