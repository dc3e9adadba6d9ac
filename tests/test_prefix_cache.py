"""Prefix caching of a whole cache (``KVCacheConfig.prefix_caching``) on the CPU kernels.

A token's q / k / v rows are a fixed function of (token id, position, layer), as in a model
whose KV depends only on the tokens before it. A sequence built on cached pages must then give,
bit for bit, the attention outputs and K/V of the same sequence computed fresh with the same
step split and kernels. Also: the hit rules (whole pages, never the last token, salts), LRU
eviction only once no page is free, copy-on-write when ``popn`` reaches a shared page,
statistics, and refusals that change nothing.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tvm

import relax_kvcache as rk
from relax_kvcache.errors import ArgumentError, CacheFullError, ForwardError, KVCacheError
from support.small_cache import CFG as PLAIN, assert_refused

CFG = dataclasses.replace(PLAIN, prefix_caching=True)  # 8-token pages, 26 pages; same kernels as PLAIN
PS = CFG.page_size


def rows(cfg, ids, start, layer):
    """The q / k / v rows of tokens ``ids`` at positions ``start, start + 1, ...``."""
    width = cfg.num_qo_heads + 2 * cfg.num_kv_heads
    out = np.empty((len(ids), width, cfg.head_dim), cfg.dtype)
    for i, token in enumerate(ids):
        out[i] = np.random.default_rng([token, start + i, layer]).standard_normal((width, cfg.head_dim))
    return out


def step(cache, seqs, chunks, with_ids=True, shape_tuples=False):
    """Append ``chunks[i]`` (token ids) to ``seqs[i]``; the outputs of each layer. ``shape_tuples``:
    the batch passed as ``vm.builtin`` passes it (a repeated decode batch is updated in place)."""
    starts = [cache.get_sequence_length(s) for s in seqs]
    n = sum(map(len, chunks))
    batch = (list(seqs), [len(c) for c in chunks])
    cache.begin_forward(*(map(tvm.runtime.ShapeTuple, batch) if shape_tuples else batch),
                        token_ids=[t for c in chunks for t in c] if with_ids else None)
    outs, cfg = [], cache.config
    for layer in range(cfg.num_layers):
        qkv = np.concatenate([rows(cfg, c, s, layer) for c, s in zip(chunks, starts)])
        o = tvm.runtime.tensor(np.full((n, cfg.num_qo_heads, cfg.head_dim), np.nan, cfg.dtype))
        cache.attention_with_fused_qkv(layer, tvm.runtime.tensor(qkv), o, 0.2)
        outs.append(o.numpy())
    cache.end_forward()
    return outs


def fill(cache, seq, ids):
    """Append ``ids`` in steps of at most ``prefill_chunk_size`` tokens."""
    for at in range(0, len(ids), CFG.prefill_chunk_size):
        step(cache, [seq], [ids[at:at + CFG.prefill_chunk_size]])


def kv(cache, seq):
    n, cfg = cache.get_sequence_length(seq), cache.config
    shape = (cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim)
    k, v = (tvm.runtime.tensor(np.full(shape, np.nan, cfg.dtype)) for _ in range(2))
    cache.debug_get_kv(seq, 0, n, k, v)
    return k.numpy(), v.numpy()


def prompt(seed, n):
    return np.random.default_rng(seed).integers(0, 32000, n).tolist()


def bitwise(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def mla_step(c, seq, ids, with_ids=True):
    """One step of MLA cache ``c`` appending ``ids`` to ``seq`` (latent rows a function of token,
    position and layer; fixed queries): each layer's cross-attention output and LSE."""
    cfg = c.config
    start, n, width = c.get_sequence_length(seq), len(ids), cfg.head_dim
    c.begin_forward([seq], [n], token_ids=ids if with_ids else None)
    outs = []
    for layer in range(cfg.num_layers):
        latent = np.stack([np.random.default_rng([t, start + i, layer]).standard_normal(width)
                           for i, t in enumerate(ids)]).astype(np.float32)
        c.append_mla_kv(layer, tvm.runtime.tensor(latent))
        q = tvm.runtime.tensor(np.random.default_rng([n, layer]).standard_normal(
            (n, cfg.num_qo_heads, width)).astype(np.float32))
        o = tvm.runtime.tensor(np.full((n, cfg.num_qo_heads, cfg.v_head_dim), np.nan, np.float32))
        lse = tvm.runtime.tensor(np.full((n, cfg.num_qo_heads), np.nan, np.float32))
        c.cross_attention(layer, q, o, lse, 0.1)
        outs += [o.numpy(), lse.numpy()]
    c.end_forward()
    return outs


@pytest.fixture
def cache():
    return rk.PagedAttentionKVCache(CFG, tvm.cpu())


def test_sequence_on_cached_pages_equals_the_fresh_computation_bit_for_bit(cache):
    system = prompt(0, 43)
    first, second = system + prompt(1, 9), system[:40] + prompt(2, 11)
    assert cache.add_sequence(0, first) == 0
    step(cache, [0], [first])
    assert cache.add_sequence(1, second) == 40  # five whole pages of the shared 43 tokens
    cached_out = step(cache, [1], [second[40:]])
    cached_decode = step(cache, [1], [[7]])

    fresh = rk.PagedAttentionKVCache(PLAIN, tvm.cpu())
    assert fresh.add_sequence(0, second) == 0  # ids are ignored without prefix caching
    step(fresh, [0], [second[:40]])
    fresh_out = step(fresh, [0], [second[40:]])
    fresh_decode = step(fresh, [0], [[7]])
    for got, exp in zip(cached_out + cached_decode, fresh_out + fresh_decode):
        bitwise(got, exp)
    for got, exp in zip(kv(cache, 1), kv(fresh, 0)):
        bitwise(got, exp)
    assert not np.isnan(cached_out[0]).any()


def test_8bit_pages_on_a_cached_prefix_equal_the_fresh_computation_bit_for_bit():
    from test_fp8_cache import config

    cfg = config("float8_e4m3fn", prefix_caching=True)
    cache, fresh = (rk.PagedAttentionKVCache(c, tvm.cpu()) for c in (cfg, dataclasses.replace(cfg, prefix_caching=False)))
    for c in (cache, fresh):
        c.set_kv_scales(0, 0.5, 2.0)
    ps, ids = cfg.page_size, prompt(21, 40)
    cache.add_sequence(0, ids)
    step(cache, [0], [ids])
    assert cache.add_sequence(1, ids[:2 * ps] + [9] * 5) == 2 * ps
    got = step(cache, [1], [[9] * 5]) + step(cache, [1], [[4]])
    fresh.add_sequence(0)
    step(fresh, [0], [ids[:2 * ps]])
    exp = step(fresh, [0], [[9] * 5]) + step(fresh, [0], [[4]])
    for a, b in zip(got + list(kv(cache, 1)), exp + list(kv(fresh, 0))):
        bitwise(a, b)


def test_hits_take_whole_pages_never_the_last_token_and_respect_salts(cache):
    ids = prompt(3, 6 * PS)
    cache.add_sequence(0, ids)
    step(cache, [0], [ids])  # six full pages registered
    assert cache.add_sequence(1, ids) == 5 * PS  # the last token is always computed
    assert cache.add_sequence(2, ids + [1]) == 6 * PS
    assert cache.add_sequence(3, ids[:PS + 3]) == PS
    assert cache.add_sequence(4, ids, salt="tenant-b") == 0  # another salt sees nothing
    assert cache.add_sequence(5, [ids[0] + 1] + ids[1:]) == 0  # the chain starts at the first page
    assert cache.add_sequence(6, ids[:PS] + prompt(4, 2 * PS)) == PS
    assert cache.add_sequence(7) == 0
    stats = cache.prefix_cache_stats()
    assert stats["lookups"] == 7 and stats["hit_tokens"] == (5 + 6 + 1 + 0 + 0 + 1) * PS
    assert stats["registered_pages"] == stats["cached_pages"] == 6 and stats["evictable_pages"] == 0


def test_a_salted_sequence_registers_for_its_salt_only(cache):
    ids = prompt(5, 3 * PS)
    cache.add_sequence(0, ids, salt=b"a")
    step(cache, [0], [ids])
    assert cache.add_sequence(1, ids + [0]) == 0
    assert cache.add_sequence(2, ids + [0], salt=b"a") == 3 * PS


@pytest.mark.parametrize("shape_tuples", [False, True])
def test_pages_registered_as_decode_fills_them_and_forks_keep_the_chain(cache, shape_tuples):
    """Decode steps register the pages they fill; passed as ShapeTuples, the steps after the
    second are updated in place (`DecodePlanner.repeat`) and register the same pages."""
    ids = prompt(6, PS - 3)
    cache.add_sequence(0, ids)
    step(cache, [0], [ids])
    repeat, in_place = cache._planner.decode.repeat, []
    cache._planner.decode.repeat = lambda *args: in_place.append(repeat(*args)) or in_place[-1]
    for token in prompt(7, PS + 3):  # decode: one token a step, the first page fills on the way
        step(cache, [0], [[token]], shape_tuples=shape_tuples)
        ids.append(token)
    assert (sum(s is not None for s in in_place) > PS) == shape_tuples
    cache.fork_sequence(0, 1, 2 * PS - 4)
    child = ids[:2 * PS - 4] + prompt(8, 6)
    step(cache, [1], [child[2 * PS - 4:]])
    assert cache.add_sequence(2, ids + [0]) == 2 * PS  # pages filled by decode steps
    assert cache.add_sequence(3, child + [0]) == 2 * PS  # the child's page, chained on the parent's


def test_unknown_ids_stop_registration(cache):
    ids = prompt(9, 2 * PS)
    cache.add_sequence(0, ids[:PS])
    step(cache, [0], [ids[:PS]])
    step(cache, [0], [ids[PS:]], with_ids=False)  # its second page's ids are unknown
    step(cache, [0], [[1] * PS], with_ids=True)
    assert cache.add_sequence(1, ids + [1] * PS + [0]) == PS


def test_removed_pages_stay_cached_and_count_as_available(cache):
    total = cache.get_num_available_pages()
    ids = prompt(10, 4 * PS + 3)
    cache.add_sequence(0, ids)
    step(cache, [0], [ids])
    assert cache.get_num_available_pages() == total - 5
    cache.remove_sequence(0)
    assert cache.get_num_available_pages() == total and cache.empty()
    assert cache.prefix_cache_stats()["evictable_pages"] == 4  # the partial page is free
    assert cache.add_sequence(1, ids) == 4 * PS
    assert cache.get_num_available_pages() == total - 4
    out = step(cache, [1], [ids[4 * PS:]])
    fresh = rk.PagedAttentionKVCache(CFG, tvm.cpu())
    fresh.add_sequence(0)
    step(fresh, [0], [ids[:4 * PS]])
    bitwise(out, step(fresh, [0], [ids[4 * PS:]]))


def test_eviction_waits_for_an_empty_free_list_and_takes_the_least_recent_deepest_pages(cache):
    old, recent = prompt(11, 6 * PS), prompt(12, 6 * PS)
    for seq, ids in ((0, old), (1, recent)):
        cache.add_sequence(seq, ids)
        step(cache, [seq], [ids])
        cache.remove_sequence(seq)  # 12 cached pages; ``old``'s released first
    free = cache.get_num_available_pages() - 12
    cache.add_sequence(2)
    fill(cache, 2, prompt(13, free * PS))  # takes exactly the free pages
    assert cache.prefix_cache_stats()["evicted_pages"] == 0
    step(cache, [2], [prompt(14, 2 * PS)])  # two more: evicts old's two deepest pages
    stats = cache.prefix_cache_stats()
    assert stats["evicted_pages"] == 2 and stats["evictable_pages"] == 10
    assert cache.add_sequence(3, old + [0]) == 4 * PS
    assert cache.add_sequence(4, recent + [0]) == 6 * PS


def test_every_cached_page_in_use_means_full(cache):
    ids = prompt(15, 3 * PS)
    cache.add_sequence(0, ids)
    step(cache, [0], [ids])
    cache.add_sequence(1, ids + [0])  # shares all three pages
    cache.remove_sequence(0)
    cache.add_sequence(2)
    fill(cache, 2, prompt(16, cache.get_num_available_pages() * PS))
    assert cache.get_num_available_pages() == 0 and cache.prefix_cache_stats()["evicted_pages"] == 0
    assert_refused(cache, lambda: cache.begin_forward([1], [1], token_ids=[0]), CacheFullError, "full")


def test_popn_into_a_shared_page_copies_it_and_leaves_the_other_holders_intact(cache):
    ids = prompt(17, 3 * PS)
    cache.add_sequence(0, ids)
    step(cache, [0], [ids])
    before = kv(cache, 0)
    assert cache.add_sequence(1, ids + [5]) == 3 * PS
    cache.popn(1, PS + 3)  # into the second page, shared with sequence 0
    new = prompt(18, 2 * PS)
    step(cache, [1], [new])
    for got, exp in zip(kv(cache, 0), before):
        bitwise(got, exp)
    assert cache.add_sequence(2, ids + [0]) == 3 * PS  # the cached pages still hold their tokens
    fresh = rk.PagedAttentionKVCache(CFG, tvm.cpu())
    fresh.add_sequence(0)
    step(fresh, [0], [ids[:2 * PS - 3]])
    step(fresh, [0], [new])
    for got, exp in zip(kv(cache, 1), kv(fresh, 0)):
        bitwise(got, exp)


def test_popn_into_an_unshared_registered_page_unregisters_it(cache):
    ids = prompt(19, 3 * PS)
    cache.add_sequence(0, ids)
    step(cache, [0], [ids])
    cache.popn(0, PS + 1)  # into the second page: it will be written again
    stats = cache.prefix_cache_stats()  # the dropped third page stays cached (unreachable until its
    assert stats["cached_pages"] == 2 and stats["evictable_pages"] == 1  # parent is registered again)
    step(cache, [0], [[3] * (PS + 1)])
    assert cache.add_sequence(1, ids + [0]) == PS


def test_bad_input_is_refused_and_changes_nothing(cache):
    ids = prompt(20, 2 * PS)
    cache.add_sequence(0, ids)
    step(cache, [0], [ids])
    assert_refused(cache, lambda: cache.begin_forward([0], [2], token_ids=[1]), ArgumentError, "expected 2")
    assert_refused(cache, lambda: cache.begin_forward([0], [1], token_ids=[-4]), ArgumentError, ">= 0")
    assert_refused(cache, lambda: cache.begin_forward([0], [1], token_ids=["a"]), ArgumentError, "token_ids")
    assert_refused(cache, lambda: cache.begin_forward([0], [1], [-1], token_ids=[1]), ForwardError, "token tree")
    assert_refused(cache, lambda: cache.add_sequence(1, ids, salt=1.5), ArgumentError, "salt")
    assert_refused(cache, lambda: cache.add_sequence(1, [1, -2]), ArgumentError, ">= 0")
    assert_refused(cache, lambda: cache.add_sequence(0, ids), KVCacheError, "already")
    with pytest.raises(KVCacheError, match="prefix_caching"):
        rk.PagedAttentionKVCache(PLAIN, tvm.cpu()).prefix_cache_stats()
    with pytest.raises(rk.errors.ConfigError, match="prefix_caching"):
        dataclasses.replace(PLAIN, prefix_caching="yes")


def test_mla_latent_pages_are_cached_and_reused(kernel_build):
    from relax_kvcache.kernel_set import KernelSet
    from support.mla_kernel_cases import cache_config

    cfg = dataclasses.replace(cache_config("float32"), prefix_caching=True)
    kernels = KernelSet.from_module(kernel_build(cfg))
    cache, fresh = (rk.PagedAttentionKVCache(c, tvm.cpu(), kernels=kernels)
                    for c in (cfg, dataclasses.replace(cfg, prefix_caching=False)))
    ps = cfg.page_size

    ids = prompt(22, 3 * ps + 2)
    cache.add_sequence(0, ids)
    mla_step(cache, 0, ids)
    assert cache.add_sequence(1, ids[:2 * ps] + [1, 2, 3]) == 2 * ps
    got = mla_step(cache, 1, [1, 2, 3]) + mla_step(cache, 1, [4])
    fresh.add_sequence(0)
    mla_step(fresh, 0, ids[:2 * ps])
    exp = mla_step(fresh, 0, [1, 2, 3]) + mla_step(fresh, 0, [4])
    for a, b in zip(got, exp):
        bitwise(a, b)
    n = cache.get_sequence_length(1)
    read = [tvm.runtime.tensor(np.full((cfg.num_layers, n, cfg.head_dim), np.nan, np.float32)) for _ in range(2)]
    cache.debug_get_kv_mla(1, 0, n, read[0])
    fresh.debug_get_kv_mla(0, 0, n, read[1])
    bitwise(read[0].numpy(), read[1].numpy())


def test_sliding_sequences_do_not_take_or_register_cached_pages():
    from relax_kvcache.paging import PagingState

    state = PagingState(16, 4, slide_windows=True, prefix_caching=True)
    ids = list(range(9))
    state.add_sequence(0, ids)
    state.reserve_append([0], [9])
    state.record_tokens([0], [9], ids)
    assert state.add_sequence(1, ids) == 8
    with pytest.raises(rk.errors.SequenceError, match="cached prefix page"):
        state.enable_sliding_window(1, 8, 2)
    state.add_sequence(2)
    state.enable_sliding_window(2, 8, 2)
    state.reserve_append([2], [9])
    state.record_tokens([2], [9], ids)  # a sliding sequence does not register
    assert state.sequence(2).tokens is None and len(state.registered_pages()) == 2


def test_a_marked_window_sequence_copies_a_shared_page_popn_reaches():
    """Caches with per-layer windows only mark windowed sequences: they keep every token, use
    cached pages, and copy a shared page before writing into it."""
    from relax_kvcache.paging import PagingState

    state = PagingState(16, 4, slide_windows=False, prefix_caching=True)
    ids = list(range(12))
    state.add_sequence(0, ids)
    state.reserve_append([0], [12])
    state.record_tokens([0], [12], ids)
    assert state.add_sequence(1, ids + [0]) == 12
    state.enable_sliding_window(1, 8, 2)
    shared = state.position_map(1, 4, 5)[0] // 4
    copies = state.popn(1, 6)  # into the second page, which sequence 0 holds too
    assert [(c.src_page, c.length) for c in copies] == [(shared, 2)]
    assert state.position_map(1, 4, 5)[0] // 4 == copies[0].dst_page != shared
    assert state.position_map(0, 4, 5)[0] // 4 == shared
