"""PagedAttentionKVCache against the float64 reference model (relax_kvcache.reference).

Random operation sequences (add, fork at random positions, popn, remove, steps mixing decode and
prefill rows) over several configurations; every attention output of every layer and the stored
K/V of every sequence are compared with the reference. Also the self/cross attention + merge path
and get_query_positions.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm

import relax_kvcache as rk
from relax_kvcache.reference import attention, merge_states
from support.harness import CONFIGS, Harness
from support.workloads import wl_random


@pytest.mark.parametrize("name", list(CONFIGS))
def test_random_workload_matches_reference(cache_factory, name):
    cache = cache_factory(CONFIGS[name])
    wl_random(Harness(cache, np.random.default_rng(abs(hash(name)) % 2 ** 32)), steps=40, max_length=40)


def test_decode_uses_decode_path_and_long_chains(cache_factory):
    """Decode-only batches over prefixes forked more than two levels deep (trailing blocks)."""
    h = Harness(cache_factory(CONFIGS["fp32-gqa-normal"]), np.random.default_rng(7))
    h.add(0)
    h.step([(0, 30)])
    for child in range(1, 7):  # 0 <- 1 <- 2 <- ... each forked at the end, then extended
        h.fork(child - 1, child, -1)
        h.step([(child, 5 + 3 * child)])
    for _ in range(3):
        h.step([(s, 1) for s in range(7)])
    h.check_contents()
    h.step([(6, 20), (3, 1), (0, 7)])
    h.check_contents()


def test_plain_prefill_appends_first_and_attends_over_its_pages(cache_factory):
    """A prefill step whose sequences each have one plain page list appends its K/V first and
    runs one causal paged kernel over the lists grown by its rows (prefixes ending mid-page, on
    a page boundary and empty); outputs and stored K/V equal the float64 reference's."""
    cache = cache_factory(CONFIGS["fp32-gqa-normal"])
    h = Harness(cache, np.random.default_rng(11))
    kernels = cache._attention.kernels
    causal = []
    paged = kernels.attention_prefill
    object.__setattr__(kernels, "attention_prefill", lambda *args: (causal.append(args[10]), paged(*args)))
    for seq in range(3):
        h.add(seq)
    h.step([(0, 37), (1, 16)])  # no prefix yet: the ragged kernel
    assert causal == []
    h.step([(0, 29), (1, 20), (2, 5)])
    assert causal == [1] * cache.config.num_layers
    h.step([(2, 1), (0, 3)])
    h.check_contents()


def test_self_cross_attention_and_merge(cache_factory):
    """cross_attention (cached) + self_attention (new tokens) merged == attention over both."""
    cfg = CONFIGS["fp16-mha-none"]
    h = Harness(cache_factory(cfg), np.random.default_rng(3))
    h.add(0)
    h.add(1)
    h.add(2)
    h.step([(0, 21), (1, 40)])
    batch = [(0, 3), (1, 1), (2, 5)]  # sequence 2 has nothing cached
    n = sum(length for _, length in batch)
    hq, hkv, d = cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim
    q, k, v = h.random((n, hq, d))[0], h.random((n, hkv, d))[0], h.random((n, hkv, d))[0]
    o_self, o_cross = h.poisoned((n, hq, d)), h.poisoned((n, hq, d))
    lse_self, lse_cross = h.poisoned((n, hq), "float32"), h.poisoned((n, hq), "float32")
    h.cache.begin_forward([s for s, _ in batch], [length for _, length in batch])
    positions = h.cache.get_query_positions().numpy()
    np.testing.assert_array_equal(positions, [21, 22, 23, 40, 0, 1, 2, 3, 4])
    h.cache.self_attention(0, q, k, v, o_self, lse_self, h.sm_scale)
    h.cache.cross_attention(0, q, o_cross, lse_cross, h.sm_scale)
    o_merged, lse_merged = h.cache.merge_attn_output_inplace(o_self, lse_self, o_cross, lse_cross)
    h.cache.end_forward()
    offset = 0
    for seq, length in batch:
        rows = slice(offset, offset + length)
        qs, ks, vs = (x.numpy()[rows].astype(np.float64) for x in (q, k, v))
        k_cached, v_cached = h.ref.stored_kv(seq)
        exp_cross, exp_lse_cross = attention(qs, k_cached[0], v_cached[0], h.sm_scale, causal=False)
        exp_self, exp_lse_self = attention(qs, ks, vs, h.sm_scale, causal=True)
        exp_o, exp_lse = merge_states(exp_self, exp_lse_self, exp_cross, exp_lse_cross)
        full, full_lse = attention(qs, np.concatenate([k_cached[0], ks]), np.concatenate([v_cached[0], vs]),
                                   h.sm_scale, causal=True)
        np.testing.assert_allclose(exp_o, full, atol=1e-9)  # the reference merge is exact
        np.testing.assert_allclose(o_merged.numpy()[rows].astype(np.float64), full, atol=h.tolerance)
        np.testing.assert_allclose(lse_merged.numpy()[rows], full_lse, atol=1e-2)
        got_cross_lse = lse_cross.numpy()[rows]
        if length and k_cached.shape[1] == 0:
            assert np.isneginf(got_cross_lse).all()
            assert (o_cross.numpy()[rows] == 0).all()
        else:
            np.testing.assert_allclose(got_cross_lse, exp_lse_cross, atol=1e-2)
        offset += length


def test_creation_function_with_our_kernels_matches_direct_cache(cache_factory):
    """relax_kvcache.paged_attention_kv_cache_create fed our kernels in TVM's argument format."""
    cfg = CONFIGS["fp32-gqa-normal"]
    mod = rk.build_kernels(cfg, rk.runtime.default_target(tvm.cpu()))
    tir = lambda role: ["tirx", mod[role]]  # noqa: E731
    create = tvm.get_global_func("relax_kvcache.paged_attention_kv_cache_create")
    cache = create(
        tvm.runtime.ShapeTuple([cfg.max_num_seqs, cfg.max_total_seq_len, cfg.prefill_chunk_size, cfg.page_size, 0]),
        tvm.runtime.ShapeTuple([0, cfg.num_layers]), cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim,
        cfg.head_dim, tvm.runtime.ShapeTuple([0] * cfg.num_layers), False, int(cfg.rope_mode), cfg.rope_scale,
        cfg.rope_theta, None, tvm.runtime.empty((), cfg.dtype), mod["transpose_append"], None,
        tir("attention_prefill_ragged"), tir("attention_prefill"), tir("attention_decode"), [], [], [], [], [],
        [mod["merge_inplace"]], mod["split_rotary"], mod["copy_single_page"], mod["debug_get_kv"],
        mod["compact_copy"])
    assert isinstance(cache, rk.PagedAttentionKVCache)
    assert cache.config == cfg
    wl_random(Harness(cache, np.random.default_rng(11)), steps=20, max_length=40)
