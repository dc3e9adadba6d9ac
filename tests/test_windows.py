"""Sliding windows: per-layer windows (MHA_SLIDING), per-sequence windows with attention sinks,
and shared-KV attention, against the float64 reference model."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import tvm

import relax_kvcache as rk
from relax_kvcache import metadata as md
from relax_kvcache.config import LayerSpan
from relax_kvcache.reference import attention

from support.harness import Harness, layer_window_config, make_config
from support.workloads import wl_seq_windows
from support.small_cache import CFG, assert_refused


@pytest.mark.parametrize("rows_in_python", [0, md.WINDOW_ROWS_IN_PYTHON])
@pytest.mark.parametrize("rope_mode", [rk.RopeMode.NONE, rk.RopeMode.NORMAL, rk.RopeMode.INLINE])
def test_layer_windows_match_reference(rope_mode, rows_in_python, monkeypatch):
    """Chunks longer than the window, decode, forks (prefixes at several depths), popn; window
    pages computed with numpy (0) and, for the few chunks of these steps, row by row."""
    monkeypatch.setattr(md, "WINDOW_ROWS_IN_PYTHON", rows_in_python)
    cache = rk.PagedAttentionKVCache(layer_window_config(rope_mode=rope_mode), tvm.cpu())
    h = Harness(cache, np.random.default_rng(int(rope_mode) + 10))
    h.add(0)
    h.add(1)
    h.step([(0, 50), (1, 7)])          # 50 > window 20: the window applies inside the chunk
    h.step([(0, 1), (1, 1)])           # decode (append before attention)
    h.fork(0, 2, 33)                   # mid-page fork: prefix block + own block
    h.fork(2, 3, -1)
    h.step([(2, 30), (3, 4), (1, 12)])
    for _ in range(3):
        h.step([(0, 1), (2, 1), (3, 1)])
    h.fork(1, 4, 8)                    # page-aligned fork
    h.step([(4, 3), (1, 25), (0, 2)])
    h.popn(0, 5)
    h.step([(0, 1), (4, 1)])
    h.check_contents()


@pytest.mark.parametrize("seed", range(300))
def test_window_pages_row_by_row_equal_numpy(seed, monkeypatch):
    """`metadata.windowed` row by row (small batches) gives what its numpy path gives: random page
    lists (some empty), last-page lengths, starts and query positions, sliding windows and local
    chunks, with and without the result of the step before to reuse."""
    r = np.random.default_rng(seed)
    page_size = int(r.choice([1, 4, 16]))
    span = LayerSpan(window=int(r.integers(1, 80))) if r.random() < 0.5 else LayerSpan(chunk=int(r.integers(1, 80)))
    rows = int(r.integers(1, 9))
    npages = r.integers(0, 6, rows) * (r.random(rows) < 0.85)
    page_indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
    page_indices = r.permutation(int(page_indptr[-1]) + 4)[:int(page_indptr[-1])].astype(np.int32)
    last = np.where(npages > 0, r.integers(1, page_size + 1, rows), 0).astype(np.int32)
    starts = r.integers(0, 100, rows).astype(np.int32)
    lengths = np.maximum(npages * page_size + last - page_size, 0)
    positions = (starts + lengths - r.integers(0, 3, rows)).clip(0).astype(np.int32)
    args = (page_indptr, page_indices, last, starts, positions, span, page_size)
    results = []
    for in_python in (md.WINDOW_ROWS_IN_PYTHON, 0):
        monkeypatch.setattr(md, "WINDOW_ROWS_IN_PYTHON", in_python)
        first = md.windowed(*args)
        later = md.windowed(*args[:4], positions + 1, span, page_size, reuse=first)
        results.append((first, later))
    for (got, want) in zip(results[0], results[1]):
        for a, b in zip((*dataclasses.astuple(got[0]), got[1]), (*dataclasses.astuple(want[0]), want[1])):
            assert a.dtype == b.dtype == np.int32 and np.array_equal(a, b), (seed, a, b)


def test_layer_window_longer_than_everything_is_plain_attention():
    """A window longer than every sequence sees everything: equal to plain MHA layers."""
    cfg = layer_window_config(layer_sliding_window_size=4096, rope_mode=rk.RopeMode.NORMAL)
    h = Harness(rk.PagedAttentionKVCache(cfg, tvm.cpu()), np.random.default_rng(3))
    h.ref.layer_windows = [0, 0, 0]
    h.add(0)
    h.step([(0, 40)])
    h.step([(0, 1)])
    h.fork(0, 1, 17)
    h.step([(1, 9), (0, 3)])


@pytest.mark.parametrize("kind", [rk.AttnKind.MHA, rk.AttnKind.MHA_SLIDING])
def test_attention_with_shared_kv(kind):
    """A layer attending with its own queries over the KV another layer wrote this step."""
    window = 6
    cfg = make_config(num_layers=2, rope_mode=rk.RopeMode.NONE, layer_sliding_window_size=window,
                  attn_kinds=[kind, rk.AttnKind.MHA], page_size=8)
    cache = rk.PagedAttentionKVCache(cfg, tvm.cpu())
    rng = np.random.default_rng(1)
    hq, hkv, d = cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim
    cache.add_sequence(0)
    keys, values = np.zeros((0, hkv, d)), np.zeros((0, hkv, d))
    for n in [9, 3, 1, 1, 12, 1]:
        past = keys.shape[0]
        q, k, v, q_shared = (rng.standard_normal(shape).astype("float32")
                             for shape in [(n, hq, d), (n, hkv, d), (n, hkv, d), (n, hq, d)])
        cache.begin_forward([0], [n])
        out = tvm.runtime.empty((n, hq, d), "float32")
        cache.attention_with_fused_qkv(0, tvm.runtime.tensor(np.concatenate([q, k, v], axis=1)), out, 0.3)
        shared = tvm.runtime.tensor(np.full((n, hq, d), np.nan, "float32"))
        tvm.get_global_func("vm.builtin.attention_kv_cache_attention_with_shared_kv")(
            cache, 0, 0.3, tvm.runtime.tensor(q_shared), tvm.runtime.tensor(k), tvm.runtime.tensor(v), shared)
        cache.end_forward()
        keys, values = np.concatenate([keys, k]), np.concatenate([values, v])
        positions = np.arange(keys.shape[0])
        mask = None
        if kind == rk.AttnKind.MHA_SLIDING:
            mask = positions[None, :] > (past + np.arange(n))[:, None] - window
        expected, _ = attention(q_shared, keys, values, 0.3, causal=True, mask=mask)
        np.testing.assert_allclose(shared.numpy(), expected, atol=2e-3, rtol=0)


def _seq_window_config(**overrides) -> rk.KVCacheConfig:
    base = dict(support_sliding_window=True, rope_mode=rk.RopeMode.INLINE, page_size=8, max_num_seqs=8,
                max_total_seq_len=512, prefill_chunk_size=96)
    base.update(overrides)
    return make_config(**base)


@pytest.mark.parametrize("rope_mode", [rk.RopeMode.NONE, rk.RopeMode.INLINE])
def test_sequence_windows_with_sinks_match_reference(rope_mode):
    """Windowed and plain sequences in one batch, appends longer than the window, forks in the sink."""
    cfg = _seq_window_config(rope_mode=rope_mode)
    h = Harness(rk.PagedAttentionKVCache(cfg, tvm.cpu()), np.random.default_rng(5))
    wl_seq_windows(h)
    window_pages = math.ceil(33 / cfg.page_size) + 2
    used = cfg.num_total_pages - h.cache.get_num_available_pages()
    plain_pages = math.ceil(h.ref.length(3) / cfg.page_size)
    assert used <= 3 * window_pages + plain_pages + math.ceil(h.ref.length(4) / cfg.page_size) + 1


def test_sequence_window_pages_stay_bounded():
    cfg = _seq_window_config(max_total_seq_len=256)
    cache = rk.PagedAttentionKVCache(cfg, tvm.cpu())
    h = Harness(cache, np.random.default_rng(2))
    h.add(0)
    cache.enable_sliding_window_for_seq(0, 24, 5)
    h.ref.enable_window(0, 24, 5)
    bound = math.ceil(24 / cfg.page_size) + 2
    for step in range(120):  # ~4x the pool's capacity in tokens
        h.step([(0, 3 if step % 7 else 17)])
        assert cfg.num_total_pages - cache.get_num_available_pages() <= bound
        assert cache.get_sequence_length(0) <= 24
    h.check_contents()


WINDOW_ERRORS = {
    "window size zero": (lambda c: c.enable_sliding_window_for_seq(0, 0, 0), "0"),
    "negative sink": (lambda c: c.enable_sliding_window_for_seq(0, 10, -1), "-1"),
    "sink not below window": (lambda c: c.enable_sliding_window_for_seq(0, 10, 10), "10"),
    "unknown sequence": (lambda c: c.enable_sliding_window_for_seq(9, 10, 2), "9"),
    "enabled twice": (lambda c: (c.enable_sliding_window_for_seq(1, 10, 2), c.enable_sliding_window_for_seq(1, 10, 2)),
                      "twice"),
}


@pytest.mark.parametrize("name", list(WINDOW_ERRORS))
def test_window_errors_leave_state_unchanged(name):
    cache = rk.PagedAttentionKVCache(_seq_window_config(), tvm.cpu())
    cache.add_sequence(0)
    cache.add_sequence(1)
    action, fragment = WINDOW_ERRORS[name]
    if name == "enabled twice":
        cache.enable_sliding_window_for_seq(1, 10, 2)
        action = lambda c: c.enable_sliding_window_for_seq(1, 10, 2)  # noqa: E731
    before = cache._paging.debug_snapshot()
    with pytest.raises(rk.KVCacheError) as info:
        action(cache)
    assert fragment in str(info.value)
    assert cache._paging.debug_snapshot() == before


def test_fork_outside_sink_and_windows_without_support_raise():
    cache = rk.PagedAttentionKVCache(_seq_window_config(), tvm.cpu())
    h = Harness(cache, np.random.default_rng(4))
    h.add(0)
    cache.enable_sliding_window_for_seq(0, 20, 6)
    h.ref.enable_window(0, 20, 6)
    h.step([(0, 30)])
    before = cache._paging.debug_snapshot()
    with pytest.raises(rk.SequenceError, match="sink"):
        cache.fork_sequence(0, 1, 7)
    assert cache._paging.debug_snapshot() == before
    cache.fork_sequence(0, 1, 6)
    plain = rk.PagedAttentionKVCache(make_config(), tvm.cpu())
    plain.add_sequence(0)
    with pytest.raises(rk.KVCacheError, match="support_sliding_window"):
        plain.enable_sliding_window_for_seq(0, 20, 6)


def test_slid_window_behind_two_prefix_blocks_attends_over_kept_tokens():
    """A windowed sequence with two prefix blocks before its slid last block: the deepest level
    attends over a chain of blocks, where the last block's sink and window offset must count from
    the chain's start (they were applied to the chain's first page, dropping prefix tokens)."""
    cfg = _seq_window_config(page_size=8)
    h = Harness(rk.PagedAttentionKVCache(cfg, tvm.cpu()), np.random.default_rng(6))
    h.add(0)
    h.step([(0, 16)])
    h.fork(0, 1, 8)    # splits sequence 0's block: [0, 8) shared, [8, 16) its own
    h.fork(0, 2, 16)   # at the aligned end: sequence 0 gets a third, empty block
    h.cache.enable_sliding_window_for_seq(0, 24, 16)  # the sink is the 16-token prefix
    h.ref.enable_window(0, 24, 16)
    h.step([(0, 8)])
    h.step([(0, 3)])   # slides: keeps tokens [0, 16) and the last 8
    for _ in range(3):
        h.step([(0, 1), (1, 2)])
    h.step([(0, 5), (2, 1)])
    h.check_contents()


def test_fork_after_popping_a_slid_window_down_to_its_sink():
    """Popping a slid block down to exactly its sink, then forking at the end, turns the block
    into a prefix block. It used to stay slid (window offset, a page past its tokens), and a
    chain of blocks at the deepest level then read that page as tokens."""
    cfg = _seq_window_config(page_size=8, rope_mode=rk.RopeMode.NONE)
    h = Harness(rk.PagedAttentionKVCache(cfg, tvm.cpu()), np.random.default_rng(9))
    h.add(0)
    h.step([(0, 8)])
    h.fork(0, 9, 8)    # sequence 0 gets a second, empty block at 8
    h.cache.enable_sliding_window_for_seq(0, 20, 16)  # last-block sink: 8 tokens
    h.ref.enable_window(0, 20, 16)
    h.step([(0, 16)])  # 24 > 20: the last block slides (sink 8, window offset 12)
    h.popn(0, 4)       # 20 -> 16: only the sink is left in the last block
    h.fork(0, 1, -1)   # at the aligned end: the last block becomes a prefix block
    h.step([(0, 8), (1, 3)])
    h.step([(0, 1), (1, 1)])
    h.check_contents()
    block = h.cache._paging.trace_blocks(0)[1]
    assert (block.sink_length, block.sliding_window_offset, len(block.page_ids)) == (0, 0, 1)


def _windowed_harness(seed):
    cfg = _seq_window_config(page_size=4, rope_mode=rk.RopeMode.NONE, max_total_seq_len=256)
    return Harness(rk.PagedAttentionKVCache(cfg, tvm.cpu()), np.random.default_rng(seed))


def _enable(h, seq, window, sink):
    h.cache.enable_sliding_window_for_seq(seq, window, sink)
    h.ref.enable_window(seq, window, sink)


def test_popping_a_prefix_back_into_the_last_block_keeps_the_sink():
    """Enabled over an 8-token shared prefix, the last block's sink was 0 (the prefix acted as
    the sink); once the prefix was unshared and popped into, the sequence slid with no sink at
    all (kept tokens 12..23 instead of 0..3 and 16..23)."""
    h = _windowed_harness(21)
    h.add(0)
    h.step([(0, 10)])
    h.fork(0, 1, 8)
    _enable(h, 0, 12, 4)
    h.remove(1)
    h.popn(0, 6)  # 4 tokens left, in what was the prefix block
    assert h.cache._paging.sequence(0).last_block_attn_sink_size == 4
    h.step([(0, 20)])
    h.step([(0, 1)])
    h.check_contents()


@pytest.mark.parametrize("child_alive", [True, False])
def test_popn_into_a_shared_prefix_keeps_the_window(child_alive):
    """``popn`` into a prefix shared with a fork re-forks the sequence: it was refused inside
    the prefix (checked against the last block's sink only), and where it worked it dropped the
    window, so the same pop kept or lost the window depending on whether the fork still lived."""
    h = _windowed_harness(22)
    h.add(0)
    _enable(h, 0, 10, 4)
    h.step([(0, 4)])
    h.fork(0, 1, 4)
    h.step([(0, 3), (1, 2)])
    if not child_alive:
        h.remove(1)
    h.popn(0, 5)  # down to 2 tokens, inside the (possibly shared) first block
    assert h.cache._paging.sequence(0).sliding_window_size == 10
    h.step([(0, 20)])  # slides: the sink of 4 and the last 6
    h.step([(0, 2)] + ([(1, 1)] if child_alive else []))
    h.check_contents()
    assert h.cache.get_sequence_length(0) == 10


# ---------------------------------------------------------------------------- refusals around windows


def test_window_changes_and_partial_merges_are_refused_mid_step():
    win_cfg = dataclasses.replace(CFG, support_sliding_window=True, rope_mode=rk.RopeMode.INLINE)
    c = rk.PagedAttentionKVCache(win_cfg, tvm.cpu())
    c.add_sequence(0)
    c.begin_forward([0], [4])
    assert_refused(c, lambda: c.enable_sliding_window_for_seq(0, 16, 4), rk.ForwardError, "step is active")
    c.end_forward()
    o = tvm.runtime.tensor(np.random.default_rng(2).standard_normal((8, 4, 32)).astype("float32"))
    lse = tvm.runtime.tensor(np.zeros((4, 4), "float32"))
    view = tvm.runtime._ffi_api.TVMTensorCreateView
    o_self, o_cross = view(o, (4, 4, 32), o.dtype, 0), view(o, (4, 4, 32), o.dtype, 0)
    with pytest.raises(rk.ForwardError, match="shares memory"):  # lse_cross is a different tensor
        c.merge_attn_output_inplace(o_self, lse, o_cross, tvm.runtime.tensor(np.zeros((4, 4), "float32")))


def test_layer_windows_without_the_windowed_ragged_kernel_limit_the_chunk():
    """TVM's creation arguments have no windowed ragged kernel: the new tokens of a chunk longer
    than the window would see each other unwindowed. Such steps are refused; the frontend passes
    ours as a 29th creation argument."""

    cfg = layer_window_config()
    full = rk.PagedAttentionKVCache(cfg, tvm.cpu())
    c = rk.PagedAttentionKVCache(cfg, tvm.cpu(), kernels=dataclasses.replace(
        full._kernels, attention_prefill_ragged_sliding_window=None))
    c.add_sequence(0)
    window = cfg.layer_sliding_window_size
    assert_refused(c, lambda: c.begin_forward([0], [window + 1]), rk.ForwardError, "windowed ragged kernel")
    c.begin_forward([0], [window])
    c.end_forward()
    full.add_sequence(0)
    full.begin_forward([0], [min(window + 1, cfg.prefill_chunk_size)])


def test_shared_kv_is_refused_when_slid_out_pages_hold_new_tokens():
    """Steps where windows slide attend before appending. When a page slides out of one sequence's
    window and takes another sequence's new tokens in the same step, the source layer's append
    overwrites what attention_with_shared_kv (and a second call of the same layer) would read:
    they returned wrong attention silently. Now they raise; steps without such pages still work
    and match the layer's own attention."""
    from reference_model import ReferenceCache

    cfg = rk.KVCacheConfig(num_layers=2, num_qo_heads=2, num_kv_heads=1, head_dim=16, page_size=4, max_num_seqs=4,
                           max_total_seq_len=84, prefill_chunk_size=32, rope_mode=rk.RopeMode.NONE,
                           dtype="float32", support_sliding_window=True)
    c = rk.PagedAttentionKVCache(cfg, tvm.cpu())
    ref = ReferenceCache(2, 2, 1, 16, 0)
    rng = np.random.default_rng(0)
    for s in (0, 1):
        c.add_sequence(s)
        ref.add(s)
    c.enable_sliding_window_for_seq(0, 8, 0)
    ref.enable_window(0, 8, 0)
    T = lambda a: tvm.runtime.tensor(np.ascontiguousarray(a))  # noqa: E731
    out = lambda n: tvm.runtime.tensor(np.full((n, 2, 16), np.nan, np.float32))  # noqa: E731
    for ids, lens, reused in [([0, 1], [8, 4], False), ([0, 1], [4, 1], True)]:
        n = sum(lens)
        qkv = rng.standard_normal((n, 4, 16)).astype(np.float32)
        c.begin_forward(ids, lens)
        assert bool(c._step.meta.reused_pages) == reused
        own = out(n)
        c.attention_with_fused_qkv(0, T(qkv), own, 0.3)
        shared_args = (T(qkv[:, :2].copy()), T(qkv[:, 2:3].copy()), T(qkv[:, 3:4].copy()), out(n), 0.3)
        if reused:
            assert_refused(c, lambda: c.attention_with_shared_kv(0, *shared_args), rk.ForwardError, "overwrote page")
            assert_refused(c, lambda: c.attention_with_fused_qkv(0, T(qkv), out(n), 0.3), rk.ForwardError,
                       "a second time")
        else:
            c.attention_with_shared_kv(0, *shared_args)
            np.testing.assert_allclose(shared_args[3].numpy(), own.numpy(), atol=1e-5)
        c.attention_with_fused_qkv(1, T(qkv), out(n), 0.3)
        c.end_forward()
        expected = ref.step(list(zip(ids, lens)), [qkv, qkv], 0.3)[0]
        np.testing.assert_allclose(own.numpy(), expected, atol=1e-4)


def test_cross_attention_after_an_append_that_reused_a_slid_page_is_refused():
    """A page that slid out of a window took new tokens in the step; cross_attention after the
    layer's fused append read them as the window's old tokens (wrong output, no error)."""
    cfg = rk.KVCacheConfig(num_layers=1, num_qo_heads=4, num_kv_heads=2, head_dim=16, page_size=4, max_num_seqs=8,
                           max_total_seq_len=128, prefill_chunk_size=32, support_sliding_window=True,
                           dtype="float32")
    c = rk.PagedAttentionKVCache(cfg, tvm.cpu())
    for seq in (0, 1, 2):
        c.add_sequence(seq)
    c.enable_sliding_window_for_seq(0, 10, 0)
    rng = np.random.default_rng(3)
    refused = 0
    for lens in ([4, 3, 2], [2, 5, 2], [1, 2, 4], [2, 5, 4], [2, 2, 2], [5, 4, 5], [5, 1, 1], [4, 3, 3], [4, 1, 4]):
        n = sum(lens)
        c.begin_forward([0, 1, 2], lens)
        q = tvm.runtime.tensor(rng.standard_normal((n, 4, 16)).astype("float32"))
        o, lse = tvm.runtime.empty((n, 4, 16), "float32"), tvm.runtime.empty((n, 4), "float32")
        c.cross_attention(0, q, o, lse, 0.3)  # before the append: allowed
        qkv = tvm.runtime.tensor(rng.standard_normal((n, 8, 16)).astype("float32"))
        c.attention_with_fused_qkv(0, qkv, tvm.runtime.empty((n, 4, 16), "float32"), 0.3)
        if c._step.meta.reused_pages:
            assert_refused(c, lambda: c.cross_attention(0, q, o, lse, 0.3), rk.ForwardError,
                       r"cross_attention\(0\) would read layer 0's KV after its append overwrote page")
            refused += 1
        else:
            c.cross_attention(0, q, o, lse, 0.3)
        c.end_forward()
    assert refused


def test_reserve_append_reports_slid_out_pages_handed_to_new_tokens():
    from relax_kvcache.paging import PagingState

    state = PagingState(4, 4, slide_windows=True)
    state.add_sequence(0)
    state.add_sequence(1)
    state.enable_sliding_window(0, 8, 0)
    assert state.reserve_append([0, 1], [8, 4]) == ()  # pages 0, 1 | 2
    assert state.reserve_append([0], [4]) == ()  # page 3 allocated, page 0 slides out: nobody takes it
    assert state.num_free_pages == 1
    # seq 0 needs a page (none free but page 0): it takes page 0, then page 1 slides out and is
    # handed to seq 1's new token
    assert state.reserve_append([0, 1], [4, 1]) == (1,)
