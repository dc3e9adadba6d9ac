"""Prefill kernels on batches that span many query tiles and KV chunks, against float64.

``test_kernels.py`` covers every edge of the kernels' contracts on small shapes; here the shapes
are large enough for the tiled schedules' own edges: several query tiles per sequence (GQA rows
packed into one tile), several KV chunks per tile (128 rows on Hopper), causal diagonals inside
and across chunks, a chunk ring refilled many times, query tiles past the end. On an sm_90a GPU
(``RELAX_KVCACHE_TEST_DEVICE=cuda``, libraries from ``tests/gpu_kernel_libs.py``) these run the
warpgroup-MMA tile with ``rotary_mode`` 0 and the ``mma.sync`` tile with inline RoPE; on CPU
they run the CPU kernels against the same references.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import tvm

from support.kernel_cases import (DEV, TILE_CONFIGS, PagedBatch, check_attention_outputs, nan_like, plain_layout, randn,
                                  reference_attention, rope_args, seed_of, tensor)

#: (q_len, kv_len): kv_len >= q_len (the cache's causal steps); a sequence without queries and
#: one decode row among them
SHAPES = [(200, 333), (1, 700), (129, 129), (0, 50), (70, 300), (300, 300), (33, 161)]


def _inputs(rng, cfg, q_lens):
    nq = sum(q_lens)
    q = randn(rng, (nq, cfg.num_qo_heads, cfg.head_dim), cfg.dtype)
    q_pos = rng.integers(0, 3000, nq).astype(np.int32)
    theta, scale = rope_args(rng)
    return q, q_pos, theta, scale


@pytest.mark.parametrize("name", list(TILE_CONFIGS))
@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize("rotary", [0, 1])
def test_ragged_prefill_many_tiles(kernel_build, name, causal, rotary):
    cfg = TILE_CONFIGS[name]
    mod = kernel_build(cfg)
    rng = np.random.default_rng(seed_of("ragged_tiles", name, causal, rotary))
    q_lens, kv_lens = [s[0] for s in SHAPES], [s[1] for s in SHAPES]
    qo_indptr = np.cumsum([0] + q_lens).astype(np.int32)
    kv_indptr = np.cumsum([0] + kv_lens).astype(np.int32)
    q, q_pos, theta, scale = _inputs(rng, cfg, q_lens)
    k = randn(rng, (int(kv_indptr[-1]), cfg.num_kv_heads, cfg.head_dim), cfg.dtype)
    v = randn(rng, (int(kv_indptr[-1]), cfg.num_kv_heads, cfg.head_dim), cfg.dtype)
    k_pos0 = rng.integers(0, 3000, len(SHAPES)).astype(np.int32)
    sm_scale = 1.3 / math.sqrt(cfg.head_dim)
    o, lse = tensor(nan_like(q.shape, cfg.dtype)), tensor(nan_like(q.shape[:2], np.float32))
    mod["attention_prefill_ragged"](tensor(q), tensor(qo_indptr), tensor(k), tensor(v), tensor(kv_indptr),
                                    tensor(q_pos), tensor(k_pos0), o, lse, causal, rotary, scale, theta, sm_scale)
    got_o, got_lse = o.numpy(), lse.numpy()
    for b, (nq, nkv) in enumerate(SHAPES):
        qs, ks = slice(qo_indptr[b], qo_indptr[b + 1]), slice(kv_indptr[b], kv_indptr[b + 1])
        exp_o, exp_lse = reference_attention(q[qs], k[ks], v[ks], causal=causal, rotary=rotary, q_pos=q_pos[qs],
                                             k_pos0=k_pos0[b], theta=theta, scale=scale, sm_scale=sm_scale)
        check_attention_outputs(got_o[qs], got_lse[qs], exp_o, exp_lse, cfg.dtype, f"seq {b} ({nq} x {nkv})",
                                rotary)


#: Query tokens of one sequence long enough that CUDA prefill grids take bf16_gqa128's tiles head
#: by head (above 8 MiB of K/V over its 2 KV heads of 128 dims); shorter batches take a tile's
#: heads side by side (every other test here).
LONG = 8200


@pytest.mark.skipif(DEV.dlpack_device_type() != tvm.cpu().dlpack_device_type(),
                    reason="imports the kernel compiler, which a runtime-only GPU host lacks")
def test_long_sequence_takes_heads_one_by_one():
    from relax_kvcache.kernel_specs import KernelSetSpec
    from relax_kvcache.targets import make_target
    from relax_kvcache.tir_kernels import schedule_for
    from relax_kvcache.tir_kernels.attention_gpu import heads_fastest_tokens

    spec = KernelSetSpec.from_config(TILE_CONFIGS["bf16_gqa128"]).attention
    tokens = heads_fastest_tokens(spec, schedule_for(make_target("cuda", arch="sm_90a")))
    assert max(s[0] for s in SHAPES) <= tokens < LONG


@pytest.mark.skipif(DEV.dlpack_device_type() == tvm.cpu().dlpack_device_type(),
                    reason="the order of a GPU grid's blocks (a CPU would take minutes over 8200 tokens)")
def test_ragged_prefill_long_sequence(kernel_build):
    """One causal sequence of LONG tokens (blocks take the tiles head by head): sampled rows
    against float64."""
    cfg = TILE_CONFIGS["bf16_gqa128"]
    mod = kernel_build(cfg)
    rng = np.random.default_rng(seed_of("ragged_long"))
    q, q_pos, theta, scale = _inputs(rng, cfg, [LONG])
    k = randn(rng, (LONG, cfg.num_kv_heads, cfg.head_dim), cfg.dtype)
    v = randn(rng, (LONG, cfg.num_kv_heads, cfg.head_dim), cfg.dtype)
    indptr = np.array([0, LONG], np.int32)
    o, lse = tensor(nan_like(q.shape, cfg.dtype)), tensor(nan_like(q.shape[:2], np.float32))
    sm_scale = 1.3 / math.sqrt(cfg.head_dim)
    mod["attention_prefill_ragged"](tensor(q), tensor(indptr), tensor(k), tensor(v), tensor(indptr), tensor(q_pos),
                                    tensor(np.zeros(1, np.int32)), o, lse, 1, 0, scale, theta, sm_scale)
    got_o, got_lse = o.numpy(), lse.numpy()
    rows = {0, 1, 127, 128, 4095, LONG - 129, LONG - 2, LONG - 1, *rng.integers(0, LONG, 8).tolist()}
    for i in sorted(rows):
        exp_o, exp_lse = reference_attention(q[i:i + 1], k[:i + 1], v[:i + 1], causal=1, rotary=0,
                                             q_pos=q_pos[i:i + 1], k_pos0=0, theta=theta, scale=scale,
                                             sm_scale=sm_scale)
        check_attention_outputs(got_o[i:i + 1], got_lse[i:i + 1], exp_o, exp_lse, cfg.dtype, f"row {i}")


def _layouts(rng, cfg, sliding: bool):
    """Page layouts of SHAPES' KV lengths; with ``sliding``, sinks and windows that start
    mid-page (``(num_pages, last_page_len, window_offset, sink)``)."""
    ps, layouts = cfg.page_size, []
    for i, (nq, nkv) in enumerate(SHAPES):
        if not sliding or nkv < 2 * ps:
            layouts.append(plain_layout(nkv, ps))
            continue
        sink = int(rng.integers(0, ps + 1)) if i % 2 else 0
        off = sink + int(rng.integers(1, 2 * ps))  # evicted rows after the sink
        total = nkv - sink + off  # rows in the page list
        npg = -(-total // ps)
        layouts.append((npg, total - (npg - 1) * ps, off, sink))
    return layouts


@pytest.mark.parametrize("name,sliding", [("bf16_gqa128", False), ("f16_gqa64_sw", False), ("f16_gqa64_sw", True)])
@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize("rotary", [0, 1])
def test_paged_prefill_many_tiles(kernel_build, name, sliding, causal, rotary):
    cfg = TILE_CONFIGS[name]
    mod = kernel_build(cfg)
    rng = np.random.default_rng(seed_of("paged_tiles", name, sliding, causal, rotary))
    layouts = _layouts(rng, cfg, sliding)
    batch = PagedBatch(rng, cfg, layouts, sliding)
    q_lens = [min(nq, kv) for (nq, _), kv in zip(SHAPES, batch.kv_lens)]
    qo_indptr = np.cumsum([0] + q_lens).astype(np.int32)
    q, q_pos, theta, scale = _inputs(rng, cfg, q_lens)
    k_pos0 = rng.integers(0, 3000, len(SHAPES)).astype(np.int32)
    sm_scale = 1.3 / math.sqrt(cfg.head_dim)
    o, lse = tensor(nan_like(q.shape, cfg.dtype)), tensor(nan_like(q.shape[:2], np.float32))
    role = "attention_prefill_sliding_window" if sliding else "attention_prefill"
    mod[role](tensor(q), tensor(qo_indptr), tensor(batch.pages), tensor(batch.page_indptr),
              tensor(batch.page_indices), tensor(batch.length_info), tensor(k_pos0), tensor(q_pos), o, lse, causal,
              rotary, scale, theta, sm_scale)
    got_o, got_lse = o.numpy(), lse.numpy()
    for b in range(len(SHAPES)):
        qs = slice(qo_indptr[b], qo_indptr[b + 1])
        K, V = batch.kv(b)
        exp_o, exp_lse = reference_attention(q[qs], K, V, causal=causal, rotary=rotary, q_pos=q_pos[qs],
                                             k_pos0=k_pos0[b], theta=theta, scale=scale, sm_scale=sm_scale)
        check_attention_outputs(got_o[qs], got_lse[qs], exp_o, exp_lse, cfg.dtype, f"seq {b} (layout {layouts[b]})",
                                rotary)


#: (cached prefix, new tokens) per sequence of a prefixed batch: empty prefixes, one decode row,
#: prefixes ending mid-page, new rows crossing KV chunks of both sources
PREFIXED = [(333, 200), (0, 70), (700, 1), (16, 129), (5, 0), (129, 33), (48, 300)]


@pytest.mark.parametrize("name", ["bf16_gqa128", "f16_gqa64_sw"])
@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize("rotary", [0, 1])
def test_prefixed_prefill_many_tiles(kernel_build, name, causal, rotary):
    """attention_prefill_prefixed: keys = the sequence's cached pages, then its new rows."""
    cfg = TILE_CONFIGS[name]
    mod = kernel_build(cfg)
    rng = np.random.default_rng(seed_of("prefixed_tiles", name, causal, rotary))
    batch = PagedBatch(rng, cfg, [plain_layout(p, cfg.page_size) for p, _ in PREFIXED], False)
    q_lens = [n for _, n in PREFIXED]
    qo_indptr = np.cumsum([0] + q_lens).astype(np.int32)
    q, q_pos, theta, scale = _inputs(rng, cfg, q_lens)
    k = randn(rng, (int(qo_indptr[-1]), cfg.num_kv_heads, cfg.head_dim), cfg.dtype)
    v = randn(rng, (int(qo_indptr[-1]), cfg.num_kv_heads, cfg.head_dim), cfg.dtype)
    k_pos0 = rng.integers(0, 3000, len(PREFIXED)).astype(np.int32)
    sm_scale = 1.3 / math.sqrt(cfg.head_dim)
    o, lse = tensor(nan_like(q.shape, cfg.dtype)), tensor(nan_like(q.shape[:2], np.float32))
    mod["attention_prefill_prefixed"](tensor(q), tensor(qo_indptr), tensor(batch.pages), tensor(batch.page_indptr),
                                      tensor(batch.page_indices), tensor(batch.length_info), tensor(k_pos0),
                                      tensor(q_pos), tensor(k), tensor(v), o, lse, causal, rotary, scale, theta,
                                      sm_scale)
    got_o, got_lse = o.numpy(), lse.numpy()
    for b, (prefix, n) in enumerate(PREFIXED):
        qs = slice(qo_indptr[b], qo_indptr[b + 1])
        K, V = batch.kv(b)
        K, V = np.concatenate([K, k[qs]]), np.concatenate([V, v[qs]])
        exp_o, exp_lse = reference_attention(q[qs], K, V, causal=causal, rotary=rotary, q_pos=q_pos[qs],
                                             k_pos0=k_pos0[b], theta=theta, scale=scale, sm_scale=sm_scale)
        check_attention_outputs(got_o[qs], got_lse[qs], exp_o, exp_lse, cfg.dtype, f"seq {b} ({prefix} + {n})",
                                rotary)


#: decode KV lengths: empty, one row, a chunk edge, and contexts that split across many blocks
#: (each block's warps taking many 16-row chunks) on a GPU
DECODE_KV = [0, 1, 15, 16, 17, 333, 700, 4000, 9001]


@pytest.mark.parametrize("name,sliding", [("bf16_gqa128", False), ("f16_gqa64_sw", False), ("f16_gqa64_sw", True)])
@pytest.mark.parametrize("rotary", [0, 1])
def test_decode_many_splits(kernel_build, name, sliding, rotary):
    """Paged decode over long contexts: on sm_80+ GPUs these GQA configs run the tensor-core
    decode item (``rotary`` 0) and the CUDA-core one (inline RoPE), both split across blocks."""
    cfg = TILE_CONFIGS[name]
    mod = kernel_build(cfg)
    rng = np.random.default_rng(seed_of("decode_splits", name, sliding, rotary))
    ps, layouts = cfg.page_size, []
    for i, nkv in enumerate(DECODE_KV):
        if not sliding or nkv < 2 * ps:
            layouts.append(plain_layout(nkv, ps))
            continue
        sink = int(rng.integers(0, ps + 1)) if i % 2 else 0
        off = sink + int(rng.integers(1, 2 * ps))
        total = nkv - sink + off
        npg = -(-total // ps)
        layouts.append((npg, total - (npg - 1) * ps, off, sink))
    batch = PagedBatch(rng, cfg, layouts, sliding)
    B = len(layouts)
    q = randn(rng, (B, cfg.num_qo_heads, cfg.head_dim), cfg.dtype)
    q_pos = rng.integers(0, 3000, B).astype(np.int32)
    k_pos0 = rng.integers(0, 3000, B).astype(np.int32)
    theta, scale = rope_args(rng)
    sm_scale = 1.3 / math.sqrt(cfg.head_dim)
    o, lse = tensor(nan_like(q.shape, cfg.dtype)), tensor(nan_like(q.shape[:2], np.float32))
    role = "attention_decode_sliding_window" if sliding else "attention_decode"
    mod[role](tensor(q), tensor(batch.pages), tensor(batch.page_indptr), tensor(batch.page_indices),
              tensor(batch.length_info), tensor(k_pos0), tensor(q_pos), o, lse, rotary, scale, theta, sm_scale)
    got_o, got_lse = o.numpy(), lse.numpy()
    for b in range(B):
        K, V = batch.kv(b)
        exp_o, exp_lse = reference_attention(q[b:b + 1], K, V, causal=False, rotary=rotary, q_pos=q_pos[b:b + 1],
                                             k_pos0=k_pos0[b], theta=theta, scale=scale, sm_scale=sm_scale)
        check_attention_outputs(got_o[b:b + 1], got_lse[b:b + 1], exp_o, exp_lse, cfg.dtype,
                                f"seq {b} (layout {layouts[b]})", rotary)
