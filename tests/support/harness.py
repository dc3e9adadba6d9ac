"""The cache harness: a ``PagedAttentionKVCache`` and the float64 ``ReferenceCache`` driven with the
same operations (add, fork, popn, remove, forward steps with random inputs and NaN-poisoned
outputs), the outputs and stored K/V compared; the cache configurations of ``test_cache``.
"""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np
import tvm

import relax_kvcache as rk
from reference_model import ReferenceCache

TOLERANCE = {"float32": 2e-3, "float16": 2e-2, "bfloat16": 8e-2}
NP_DTYPE = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def make_config(**overrides) -> rk.KVCacheConfig:
    base = dict(num_layers=2, num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, max_num_seqs=16,
                max_total_seq_len=1536, prefill_chunk_size=96, rope_mode=rk.RopeMode.NORMAL,
                rope_theta=1e4, rope_scale=1.0, dtype="float32")
    base.update(overrides)
    return rk.KVCacheConfig(**base)


CONFIGS = {
    "fp32-gqa-normal": make_config(),
    "fp32-mqa-inline-d128": make_config(num_qo_heads=4, num_kv_heads=1, head_dim=128, rope_mode=rk.RopeMode.INLINE,
                                    rope_theta=5e5, rope_scale=0.5),
    "fp16-mha-none": make_config(num_qo_heads=4, num_kv_heads=4, dtype="float16", rope_mode=rk.RopeMode.NONE),
    "bf16-gqa-normal": make_config(dtype="bfloat16"),
    "fp32-sliding-support-inline": make_config(support_sliding_window=True, rope_mode=rk.RopeMode.NORMAL),
    "fp32-d96-page8": make_config(num_qo_heads=6, num_kv_heads=3, head_dim=96, page_size=8, rope_mode=rk.RopeMode.INLINE),
    "fp32-d256": make_config(num_qo_heads=2, num_kv_heads=1, head_dim=256, num_layers=1),
}


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

    def enable_window(self, seq, window, sink):
        self.cache.enable_sliding_window_for_seq(seq, window, sink)
        self.ref.enable_window(seq, window, sink)

    def expect_equal(self, what, got, expected):
        assert np.array_equal(np.asarray(got), np.asarray(expected)), f"{what}: got {got}, expected {expected}"

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


def layer_window_config(**overrides) -> rk.KVCacheConfig:
    """``make_config`` with per-layer windows: layers 0 and 2 ``MHA_SLIDING`` (window 20), 3 layers."""
    base = dict(num_layers=3, page_size=8, layer_sliding_window_size=20, max_total_seq_len=2048,
                prefill_chunk_size=128,
                attn_kinds=[rk.AttnKind.MHA_SLIDING, rk.AttnKind.MHA, rk.AttnKind.MHA_SLIDING])
    base.update(overrides)
    return make_config(**base)
