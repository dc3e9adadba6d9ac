"""A small float32 cache and the helpers the refusal tests share: a step with random inputs, a
random tensor, a check that a refused call changed nothing, and TVM's creation arguments.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm.runtime import ShapeTuple

import relax_kvcache as rk
from relax_kvcache.kernel_set import KernelSet
from support.snapshot import assert_same, snapshot

#: 2 layers, 4 query / 2 KV heads of 32, pages of 8, RoPE NORMAL (``create_args`` matches it)
CFG = rk.KVCacheConfig(num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=32, page_size=8, max_num_seqs=8,
                       max_total_seq_len=200, prefill_chunk_size=64, rope_mode=rk.RopeMode.NORMAL, dtype="float32")


def run_step(cache, rng, seq_ids, lengths):
    """One forward step of ``CFG``'s shape with random q / k / v on every layer."""
    n = sum(lengths)
    cache.begin_forward(seq_ids, lengths)
    for layer in range(CFG.num_layers):
        qkv = tvm.runtime.tensor(rng.standard_normal((n, 8, 32)).astype("float32"))
        cache.attention_with_fused_qkv(layer, qkv, tvm.runtime.empty((n, 4, 32), "float32"), 0.2)
    cache.end_forward()


def one_sequence_cache() -> rk.PagedAttentionKVCache:
    """A cache of ``CFG`` holding sequence 0 (21 tokens of random K/V)."""
    cache = rk.PagedAttentionKVCache(CFG, tvm.cpu())
    cache.add_sequence(0)
    run_step(cache, np.random.default_rng(0), [0], [21])
    return cache


def rand(shape, dtype="float32"):
    """A random (standard normal) tensor of ``shape``, the same values on every call."""
    return tvm.runtime.tensor(np.random.default_rng(1).standard_normal(shape).astype(dtype))


def assert_refused(cache, call, error, match):
    """``call()`` raises ``error`` matching ``match`` and leaves ``cache`` exactly as it was
    (paging state, step state, raw pages, every sequence's K/V)."""
    before = snapshot(cache, pages=True)
    with pytest.raises(error, match=match):
        call()
    assert_same(before, snapshot(cache, pages=True))


def create_args(kernels: KernelSet) -> list:
    """Valid arguments of ``relax_kvcache.paged_attention_kv_cache_create`` for ``CFG``'s kernels
    (TVM's 28 creation arguments)."""
    k = kernels
    return [ShapeTuple([8, 200, 64, 8, 0]), ShapeTuple([0, 2]), 4, 2, 32, 32, ShapeTuple([0, 0]), False, 1, 1.0, 1e4,
            None, tvm.runtime.empty((), "float32"), k.transpose_append, None, ["tirx", k.attention_prefill_ragged],
            ["tirx", k.attention_prefill], ["tirx", k.attention_decode], [], [], [], [], [], [k.merge_inplace],
            k.split_rotary, k.copy_single_page, k.debug_get_kv, k.compact_copy]


def create_with(kernels: KernelSet, **replaced):
    """The creation function with some of ``create_args`` replaced (``a<index>=value``)."""
    import relax_kvcache.ffi_registry.create as create_module

    args = create_args(kernels)
    for index, value in replaced.items():
        args[int(index.lstrip("a"))] = value
    return create_module.paged_attention_kv_cache_create(*args)


def tiny_cache(**fields) -> rk.PagedAttentionKVCache:
    """A CPU cache of 2 layers, 4 query / 2 KV heads of 16, 4-token pages, 64 tokens, RoPE
    NORMAL; ``fields`` change its config."""
    base = dict(num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=16, page_size=4, max_num_seqs=4,
                max_total_seq_len=64, prefill_chunk_size=32, dtype="float32", rope_mode=rk.RopeMode.NORMAL)
    base.update(fields)
    return rk.PagedAttentionKVCache(rk.KVCacheConfig(**base), tvm.cpu())
