"""Partial rotary dims (``KVCacheConfig.rope_rotary_dim``: GPT-NeoX / Phi-2 style RoPE on the
first features of each head only).

References: ``reference_model.rope(..., rotary_dim=R)`` (numpy float64) and TVM's native cache fed
TVM's own ``llama_rope_with_position_map(..., rotary_dim=R)`` (``native_baseline``, test-only). The
kernel alone, in float16 / bfloat16 and on GPUs: ``test_kernels.test_split_rotary_variants``.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm

import relax_kvcache as rk

import native_baseline as tb
from reference_model import CacheModel, rope

HQ, HKV, D, R = 4, 2, 80, 32  # Phi-2's head: 80 features, 32 rotated
THETA = 1e4


def _shape(**overrides) -> tb.Shape:
    fields = dict(num_layers=2, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=16, max_num_seqs=8,
                  max_total_seq_len=512, prefill_chunk_size=64, rope_mode=1, rope_theta=THETA, rotary_dim=R)
    fields.update(overrides)
    return tb.Shape(**fields)


@pytest.mark.parametrize("overrides, match", [
    (dict(rope_rotary_dim=31), "must be even and at most head_dim=80"),
    (dict(rope_rotary_dim=82), "must be even and at most head_dim=80"),
    (dict(rope_rotary_dim=0), "rope_rotary_dim must be a positive int"),
    (dict(rope_rotary_dim=32.0), "rope_rotary_dim must be a positive int"),
    (dict(rope_rotary_dim=32, rope_mode=rk.RopeMode.INLINE), "needs rope_mode NORMAL"),
    (dict(rope_rotary_dim=32, support_sliding_window=True), "needs rope_mode NORMAL"),
    (dict(rope_rotary_dim=32, rope_ext_factors=(1.0,) * 80, rope_original_max_position_embeddings=8),
     "must hold rotary_dim=32 floats"),
    (dict(rope_interleaved=True, rope_mode=rk.RopeMode.INLINE), "rope_interleaved .GPT-J style RoPE. needs"),
    (dict(rope_interleaved=2), "rope_interleaved"),
])
def test_bad_rotary_dims_are_refused(overrides, match):
    with pytest.raises(rk.ConfigError, match=match):
        rk.KVCacheConfig(num_layers=1, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, dtype="float32", **overrides)


def test_full_rotary_dim_is_the_default_kernel():
    """``rope_rotary_dim == head_dim`` builds the same kernels as no rotary dim (one library)."""
    from relax_kvcache.build import kernel_set_spec

    base = dict(num_layers=1, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, dtype="float32")
    assert kernel_set_spec(rk.KVCacheConfig(**base, rope_rotary_dim=D)) == kernel_set_spec(rk.KVCacheConfig(**base))
    assert rk.KVCacheConfig(**base, rope_rotary_dim=R).rotary_dim == R


def _step(b, caches, batch, rng):
    n = sum(length for _, length in batch)
    qkv = [rng.standard_normal((n, HQ + 2 * HKV, D)).astype(np.float32) for _ in range(2)]
    outs = {}
    for name, cache in caches.items():
        b.begin(cache, [s for s, _ in batch], [length for _, length in batch])
        outs[name] = []
        for layer in range(2):
            o = tvm.runtime.tensor(np.full((n, HQ, D), np.nan, np.float32))
            b.attention(cache, layer, 0.3, tvm.runtime.tensor(qkv[layer]), o)
            outs[name].append(o.numpy())
        b.end(cache)
    return qkv, outs


@pytest.mark.tvm_native
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_partial_rotary_matches_tvms_native_cache_and_float64(interleaved):
    """TVM's native cache with TVM's partial-rotary kernel, ours with our kernels (directly and
    through the creation arguments) and ours on TVM's kernels: the same attention outputs and
    stored K; all against float64 through prefill chunks, decode, a fork inside a page and popn.
    ``gptj``: GPT-J style pairs (``rope_interleaved``, TVM's ``rope_type: gptj``)."""
    shape = _shape(rope_interleaved=interleaved)
    b = tb.Builtins()
    caches = {"tvm": tb.create_native(shape), "ours": tb.create_ours_direct(shape),
              "ours_packed": tb.create_ours_packed(shape), "ours_tvmk": tb.create_ours_packed(shape, tvm_kernel_set=True)}
    model = CacheModel(2, HQ, HKV, D, 1, THETA, 1.0)
    model.rope = lambda x, positions: rope(x, positions, THETA, 1.0, rotary_dim=R, interleaved=interleaved)
    rng = np.random.default_rng(0)

    def structure(op, *args):
        for cache in caches.values():
            getattr(b, op)(cache, *args)
        getattr(model, op)(*args)

    def step(batch):
        qkv, outs = _step(b, caches, batch, rng)
        want = model.step(batch, qkv, 0.3)
        for layer in range(2):
            np.testing.assert_allclose(outs["tvm"][layer], want[layer], atol=2e-3)
            for name in ("ours", "ours_packed", "ours_tvmk"):
                np.testing.assert_allclose(outs[name][layer], outs["tvm"][layer], atol=2e-3, err_msg=name)

    structure("add", 0)
    structure("add", 1)
    step([(0, 37), (1, 9)])
    step([(0, 1), (1, 1)])
    structure("fork", 0, 2, 21)
    step([(2, 5), (0, 1)])
    structure("popn", 0, 3)
    step([(0, 2), (2, 1), (1, 30)])
    for seq_id, seq in model.seqs.items():
        for name, cache in caches.items():
            dims = (2, seq.length, HKV, D)
            k, v = tvm.runtime.empty(dims, "float32"), tvm.runtime.empty(dims, "float32")
            b.debug_get_kv(cache, seq_id, 0, seq.length, k, v)
            np.testing.assert_allclose(k.numpy(), seq.k, atol=2e-3, err_msg=f"{name} K of {seq_id}")
            np.testing.assert_array_equal(k.numpy()[..., R:], seq.k[..., R:].astype(np.float32))


def test_frontend_layout_with_partial_rotary():
    """``frontend.CacheLayout(rope_rotary_dim=...)``: the model's kernels rotate the first
    features only (checked through a compiled program against float64)."""
    from support.frontend_program import create, fused_vm
    from relax_kvcache import frontend

    layout = frontend.CacheLayout(num_layers=1, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=16,
                                  rope_mode=rk.RopeMode.NORMAL, rope_theta=THETA, rope_rotary_dim=R, dtype="float32")
    vm = fused_vm(layout, sm_scale=0.3)
    cache = create(vm, 4, 256, 64)
    assert isinstance(cache, rk.PagedAttentionKVCache)  # TVM's creation arguments carry no rotary dim
    model = CacheModel(1, HQ, HKV, D, 1, THETA, 1.0)
    model.rope = lambda x, positions: rope(x, positions, THETA, 1.0, rotary_dim=R)
    b, rng = tb.Builtins(), np.random.default_rng(1)
    b.add(cache, 0)
    model.add(0)
    for n in (19, 1, 6):
        qkv = rng.standard_normal((1, n, HQ + 2 * HKV, D)).astype(np.float32)
        b.begin(cache, [0], [n])
        got = vm["fused"](tvm.runtime.tensor(qkv[None]), cache)[0].numpy()[0]
        b.end(cache)
        np.testing.assert_allclose(got, model.step([(0, n)], [qkv[0]], 0.3)[0], atol=2e-3)
