"""PagedAttentionKVCache against the float64 reference model (relax_kvcache.reference).

Random operation sequences (add, fork at random positions, popn, remove, steps mixing decode and
prefill rows) over several configurations; every attention output of every layer and the stored
K/V of every sequence are compared with the reference. Also the self/cross attention + merge path
and get_query_positions.
"""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np
import pytest
import tvm

import relax_kvcache as rk
from relax_kvcache.reference import attention, merge_states
from reference_model import ReferenceCache

TOLERANCE = {"float32": 2e-3, "float16": 2e-2, "bfloat16": 8e-2}
NP_DTYPE = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def _config(**overrides) -> rk.KVCacheConfig:
    base = dict(num_layers=2, num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, max_num_seqs=16,
                max_total_seq_len=1536, prefill_chunk_size=96, rope_mode=rk.RopeMode.NORMAL,
                rope_theta=1e4, rope_scale=1.0, dtype="float32")
    base.update(overrides)
    return rk.KVCacheConfig(**base)


CONFIGS = {
    "fp32-gqa-normal": _config(),
    "fp32-mqa-inline-d128": _config(num_qo_heads=4, num_kv_heads=1, head_dim=128, rope_mode=rk.RopeMode.INLINE,
                                    rope_theta=5e5, rope_scale=0.5),
    "fp16-mha-none": _config(num_qo_heads=4, num_kv_heads=4, dtype="float16", rope_mode=rk.RopeMode.NONE),
    "bf16-gqa-normal": _config(dtype="bfloat16"),
    "fp32-sliding-support-inline": _config(support_sliding_window=True, rope_mode=rk.RopeMode.NORMAL),
    "fp32-d96-page8": _config(num_qo_heads=6, num_kv_heads=3, head_dim=96, page_size=8, rope_mode=rk.RopeMode.INLINE),
    "fp32-d256": _config(num_qo_heads=2, num_kv_heads=1, head_dim=256, num_layers=1),
}


@pytest.fixture(scope="session")
def cache_factory():
    """``make(config) -> PagedAttentionKVCache``; kernels are built once per config (disk cache)."""
    def make(config: rk.KVCacheConfig) -> rk.PagedAttentionKVCache:
        return rk.PagedAttentionKVCache(config, tvm.cpu())
    return make


@dataclasses.dataclass
class Harness:
    """Drives the cache and the reference model with the same operations."""

    cache: rk.PagedAttentionKVCache
    rng: np.random.Generator

    def __post_init__(self):
        cfg = self.cache.config
        self.cfg = cfg
        self.ref = ReferenceCache(cfg.num_layers, cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim,
                                  int(cfg.effective_rope_mode), cfg.rope_theta, cfg.rope_scale)
        self.tol = TOLERANCE[cfg.dtype]
        self.sm_scale = 1.0 / math.sqrt(cfg.head_dim) * 1.1

    def tensor(self, shape):
        return tvm.runtime.tensor(self.rng.standard_normal(shape).astype(NP_DTYPE[self.cfg.dtype]))

    def nan(self, shape, dtype=None):
        return tvm.runtime.tensor(np.full(shape, np.nan, dtype=dtype or NP_DTYPE[self.cfg.dtype]))

    def add(self, seq):
        self.cache.add_sequence(seq)
        self.ref.add(seq)

    def fork(self, parent, child, pos):
        self.cache.fork_sequence(parent, child, pos)
        self.ref.fork(parent, child, pos)

    def popn(self, seq, n):
        self.cache.popn(seq, n)
        self.ref.popn(seq, n)

    def remove(self, seq):
        self.cache.remove_sequence(seq)
        self.ref.remove(seq)

    def step(self, batch):
        cfg = self.cfg
        n = sum(length for _, length in batch)
        qkvs = [self.tensor((n, cfg.num_qo_heads + 2 * cfg.num_kv_heads, cfg.head_dim)) for _ in range(cfg.num_layers)]
        outs = [self.nan((n, cfg.num_qo_heads, cfg.head_dim)) for _ in range(cfg.num_layers)]
        self.cache.begin_forward([s for s, _ in batch], [length for _, length in batch])
        for layer in range(cfg.num_layers):
            self.cache.attention_with_fused_qkv(layer, qkvs[layer], outs[layer], self.sm_scale)
        self.cache.end_forward()
        expected = self.ref.step(batch, [q.numpy().astype(np.float64) for q in qkvs], self.sm_scale)
        for layer, (out, exp) in enumerate(zip(outs, expected)):
            got = out.numpy().astype(np.float64)
            assert np.isfinite(got).all(), f"layer {layer}: output not fully written"
            np.testing.assert_allclose(got, exp, atol=self.tol, rtol=0, err_msg=f"layer {layer} batch {batch}")

    def check_contents(self):
        cfg = self.cfg
        for seq in self.ref.k:
            length = self.ref.length(seq)
            assert self.cache.get_sequence_length(seq) == length
            if length == 0:
                continue
            shape = (cfg.num_layers, length, cfg.num_kv_heads, cfg.head_dim)
            k, v = self.nan(shape), self.nan(shape)
            self.cache.debug_get_kv(seq, 0, length, k, v)
            k_ref, v_ref = self.ref.stored_kv(seq)
            np.testing.assert_allclose(k.numpy().astype(np.float64), k_ref, atol=self.tol, rtol=0)
            np.testing.assert_allclose(v.numpy().astype(np.float64), v_ref, atol=self.tol, rtol=0)
        assert self.cache.get_total_sequence_length() == sum(self.ref.length(s) for s in self.ref.k)


def _random_workload(h: Harness, steps: int) -> None:
    rng = h.rng
    cfg = h.cfg
    next_id = 0
    live = []
    for _ in range(steps):
        op = rng.choice(["step", "step", "step", "add", "fork", "popn", "remove"])
        if op == "add" or not live:
            h.add(next_id)
            live.append(next_id)
            next_id += 1
            op = "step"
        if op == "fork":
            parent = int(rng.choice(live))
            length = h.ref.length(parent)
            pos = int(rng.choice([-1, 0, length, rng.integers(0, length + 1),
                                  (length // cfg.page_size) * cfg.page_size]))
            h.fork(parent, next_id, pos)
            live.append(next_id)
            next_id += 1
            h.check_contents()
        elif op == "popn":
            seq = int(rng.choice(live))
            h.popn(seq, int(rng.integers(0, h.ref.length(seq) + 1)))
            h.check_contents()
        elif op == "remove" and len(live) > 1:
            seq = int(rng.choice(live))
            h.remove(seq)
            live.remove(seq)
            h.check_contents()
        elif op == "step":
            members = rng.choice(live, size=min(len(live), int(rng.integers(1, 6))), replace=False)
            budget = cfg.prefill_chunk_size
            batch = []
            for seq in members:
                length = 1 if rng.random() < 0.5 else int(rng.integers(2, 40))
                length = min(length, budget - (len(members) - len(batch) - 1))
                if length < 1:
                    break
                budget -= length
                batch.append((int(seq), length))
            if h.cache.get_num_available_pages() < len(batch) * 4 + 8:
                for seq in list(live)[:-1]:
                    h.remove(seq)
                    live.remove(seq)
                continue
            h.step(batch)
    h.check_contents()
    for seq in list(live):
        h.remove(seq)
    assert h.cache.empty()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_random_workload_matches_reference(cache_factory, name):
    cache = cache_factory(CONFIGS[name])
    _random_workload(Harness(cache, np.random.default_rng(abs(hash(name)) % 2 ** 32)), steps=40)


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
    q, k, v = h.tensor((n, hq, d)), h.tensor((n, hkv, d)), h.tensor((n, hkv, d))
    o_self, o_cross = h.nan((n, hq, d)), h.nan((n, hq, d))
    lse_self, lse_cross = h.nan((n, hq), np.float32), h.nan((n, hq), np.float32)
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
        np.testing.assert_allclose(o_merged.numpy()[rows].astype(np.float64), full, atol=h.tol)
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
    _random_workload(Harness(cache, np.random.default_rng(11)), steps=20)
