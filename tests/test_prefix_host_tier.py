"""Prefix caching's host tier (``KVCacheConfig.host_cache_pages``) on the CPU kernels.

Cached pages evicted from the device go to host slots and come back on a hit. A sequence whose
prefix made that round trip must give, bit for bit, the attention outputs and K/V of the same
sequence computed fresh (same step split, same kernels), for 32-bit, 8-bit and MLA latent pages. Also:
the host memory holds the evicted pages' exact bytes, the oldest host pages are dropped when
the tier is full, a hit loads only as many pages as are available, and bad settings are
refused.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tvm

import relax_kvcache as rk
from relax_kvcache.errors import ConfigError
from relax_kvcache.paging import PagingState
from support.small_cache import CFG as PLAIN
from test_prefix_cache import bitwise, kv, mla_step, prompt, step

CFG = dataclasses.replace(PLAIN, prefix_caching=True, host_cache_pages=12)  # 26 device pages of 8 tokens
PS = CFG.page_size


def evict_everything(cache, seq, seed):
    """Fill the cache with sequence ``seq`` of fresh tokens until every cached page is evicted
    (appended without ids, so that its own pages are freed, not cached, when it goes)."""
    cache.add_sequence(seq)
    ids, chunk = prompt(seed, cache.get_num_available_pages() * cache.config.page_size), cache.config.prefill_chunk_size
    for at in range(0, len(ids), chunk):
        step(cache, [seq], [ids[at:at + chunk]], with_ids=False)
    assert cache.prefix_cache_stats()["evictable_pages"] == 0
    cache.remove_sequence(seq)


def evict_by_decode(cache, seq, seed):
    """`evict_everything` by one-token steps passed as ShapeTuples (as ``vm.builtin`` passes them):
    the in-place decode path, whose page fills evict the cached pages."""
    cache.add_sequence(seq)
    step(cache, [seq], [prompt(seed, 3)], with_ids=False)
    token = 0
    while cache.prefix_cache_stats()["evictable_pages"]:
        step(cache, [seq], [[token % 97]], with_ids=False, shape_tuples=True)
        token += 1
    assert cache._planner.decode.current is not None  # the steps were derived, not planned in full
    cache.remove_sequence(seq)


def round_trip(cfg, scales=None, evict=evict_everything):
    """A prompt computed, evicted to the host, loaded back and continued; and the same fresh."""
    cache = rk.PagedAttentionKVCache(cfg, tvm.cpu())
    fresh = rk.PagedAttentionKVCache(dataclasses.replace(cfg, prefix_caching=False, host_cache_pages=0), tvm.cpu())
    for c in (cache, fresh):
        for layer, pair in enumerate(scales or []):
            c.set_kv_scales(layer, *pair)
    ids = prompt(30, 5 * cfg.page_size + 3)
    cache.add_sequence(0, ids)
    step(cache, [0], [ids])
    pages = [int(p) for p in cache._paging.position_map(0)[::cfg.page_size] // cfg.page_size][:5]
    stored = [[layer.numpy().view(np.uint8)[p].reshape(-1).copy() for p in pages] for layer in cache._pages]
    cache.remove_sequence(0)
    evict(cache, 1, 31)
    stats = cache.prefix_cache_stats()
    assert stats["spilled_pages"] == stats["host_pages"] == 5 and stats["loaded_pages"] == 0
    on_host = {entry.depth: slot for slot, entry in cache._paging.host_pages()}
    for layer, rows in enumerate(stored):  # the host holds the evicted pages' bytes
        for depth, row in enumerate(rows):
            np.testing.assert_array_equal(cache._host.read(layer, on_host[depth]), row)

    tail = prompt(32, 6)
    assert cache.add_sequence(2, ids[:5 * cfg.page_size] + tail) == 5 * cfg.page_size
    stats = cache.prefix_cache_stats()
    assert stats["loaded_pages"] == 5 and stats["host_pages"] == 0
    got = step(cache, [2], [tail]) + step(cache, [2], [[11]])
    fresh.add_sequence(0)
    step(fresh, [0], [ids[:5 * cfg.page_size]])
    exp = step(fresh, [0], [tail]) + step(fresh, [0], [[11]])
    for a, b in zip(got + list(kv(cache, 2)), exp + list(kv(fresh, 0))):
        bitwise(a, b)
    assert not np.isnan(got[0]).any()


def test_pages_back_from_the_host_equal_the_fresh_computation_bit_for_bit():
    round_trip(CFG)


def test_pages_evicted_by_repeated_decode_steps_come_back_bit_for_bit():
    round_trip(CFG, evict=evict_by_decode)


def test_8bit_pages_back_from_the_host_equal_the_fresh_computation_bit_for_bit():
    from test_fp8_cache import config

    round_trip(config("float8_e4m3fn", prefix_caching=True, host_cache_pages=12, prefill_chunk_size=128),
               scales=[(0.5, 2.0)])


def test_a_full_host_tier_drops_its_oldest_pages():
    cache = rk.PagedAttentionKVCache(dataclasses.replace(CFG, host_cache_pages=4), tvm.cpu())
    old, recent = prompt(33, 3 * PS), prompt(34, 3 * PS)
    for seq, ids in ((0, old), (1, recent)):
        cache.add_sequence(seq, ids)
        step(cache, [seq], [ids])
        cache.remove_sequence(seq)
    evict_everything(cache, 2, 35)  # six pages evicted, four fit: old's two deepest are dropped
    stats = cache.prefix_cache_stats()
    assert (stats["spilled_pages"], stats["host_pages"], stats["host_dropped_pages"]) == (6, 4, 2)
    assert cache.add_sequence(3, old + [0]) == PS  # its first page survived on the host
    assert cache.add_sequence(4, recent + [0]) == 3 * PS


def test_a_hit_loads_only_as_many_pages_as_are_available():
    state = PagingState(7, 4, prefix_caching=True, host_pages=6)
    ids = list(range(100, 120))  # five pages
    state.add_sequence(0, ids + [0])
    state.reserve_append([0], [20])
    state.record_tokens([0], [20], ids)
    state.remove_sequence(0)
    state.add_sequence(1)
    state.reserve_append([1], [24])  # two free pages, then the four deepest cached ones go to the host
    state.remove_sequence(1)
    assert len(state.host_pages()) == 4 and len(state.take_host_moves()) == 4
    state.add_sequence(3)
    state.reserve_append([3], [20])  # one free page and the first cached one left
    assert state.add_sequence(2, ids + [0]) == 8  # the cached page, and one loaded into the free page
    moves = state.take_host_moves()
    assert [m.to_host for m in moves] == [False] and len(state.host_pages()) == 3
    assert state.num_free_pages == 0


def test_copies_are_merged_into_runs_of_consecutive_pages():
    from relax_kvcache.cache.host_pages import Run, runs
    from relax_kvcache.paging.host_tier import HostMove

    moves = [HostMove(True, 3, 0), HostMove(True, 4, 1), HostMove(True, 6, 2), HostMove(False, 7, 3),
             HostMove(False, 8, 4), HostMove(True, 9, 5)]
    assert runs(moves) == [Run(True, 3, 0, 2), Run(True, 6, 2, 1), Run(False, 7, 3, 2), Run(True, 9, 5, 1)]


def test_clear_empties_the_host_tier():
    cache = rk.PagedAttentionKVCache(CFG, tvm.cpu())
    ids = prompt(36, 2 * PS)
    cache.add_sequence(0, ids)
    step(cache, [0], [ids])
    cache.remove_sequence(0)
    evict_everything(cache, 1, 37)
    assert cache.prefix_cache_stats()["host_pages"] == 2
    cache.clear()
    assert cache.prefix_cache_stats()["host_pages"] == 0 and cache.add_sequence(0, ids + [1]) == 0


@pytest.mark.parametrize("changes, match", [
    (dict(host_cache_pages=4), "0 without prefix_caching"),
    (dict(prefix_caching=True, host_cache_pages=-1), "host_cache_pages"),
    (dict(prefix_caching=True, host_cache_pages=2.5), "host_cache_pages"),
])
def test_bad_host_tier_settings_are_refused(changes, match):
    with pytest.raises(ConfigError, match=match):
        dataclasses.replace(PLAIN, **changes)


def test_mla_latent_pages_back_from_the_host_equal_the_fresh_computation(kernel_build):
    from relax_kvcache.kernel_set import KernelSet
    from support.mla_kernel_cases import cache_config

    base = dataclasses.replace(cache_config("float32"), max_total_seq_len=512)
    cfg = dataclasses.replace(base, prefix_caching=True, host_cache_pages=8)
    kernels = KernelSet.from_module(kernel_build(base))
    cache, fresh = (rk.PagedAttentionKVCache(c, tvm.cpu(), kernels=kernels) for c in (cfg, base))
    ps = cfg.page_size

    ids = prompt(38, 3 * ps + 2)
    cache.add_sequence(0, ids)
    mla_step(cache, 0, ids)
    cache.remove_sequence(0)
    cache.add_sequence(1)  # fill the cache without ids: the three cached pages go to the host
    while cache.get_num_available_pages():
        mla_step(cache, 1, prompt(39, min(cfg.prefill_chunk_size, cache.get_num_available_pages() * ps)), False)
    cache.remove_sequence(1)
    assert cache.prefix_cache_stats()["host_pages"] == 3
    assert cache.add_sequence(2, ids[:3 * ps] + [1, 2]) == 3 * ps
    assert cache.prefix_cache_stats()["loaded_pages"] == 3
    got = mla_step(cache, 2, [1, 2]) + mla_step(cache, 2, [4])
    fresh.add_sequence(0)
    mla_step(fresh, 0, ids[:3 * ps])
    exp = mla_step(fresh, 0, [1, 2]) + mla_step(fresh, 0, [4])
    for a, b in zip(got, exp):
        bitwise(a, b)
