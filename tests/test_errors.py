"""Bad input: a clear exception naming the bad value, and the cache exactly as it was."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import tvm

import relax_kvcache as rk
from support.snapshot import assert_same as _assert_same, snapshot as _snapshot

CFG = rk.KVCacheConfig(num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=32, page_size=8, max_num_seqs=8,
                       max_total_seq_len=200, prefill_chunk_size=64, rope_mode=rk.RopeMode.NORMAL, dtype="float32")


@pytest.fixture()
def cache():
    """A cache with sequences 0 (length 21) and 1 (forked from 0 at 13, then extended by 4)."""
    c = rk.PagedAttentionKVCache(CFG, tvm.cpu())
    rng = np.random.default_rng(0)
    c.add_sequence(0)
    _step(c, rng, [0], [21])
    c.fork_sequence(0, 1, 13)
    _step(c, rng, [1], [4])
    return c


def _step(cache, rng, seq_ids, lengths):
    n = sum(lengths)
    cache.begin_forward(seq_ids, lengths)
    for layer in range(CFG.num_layers):
        qkv = tvm.runtime.tensor(rng.standard_normal((n, 8, 32)).astype("float32"))
        cache.attention_with_fused_qkv(layer, qkv, tvm.runtime.empty((n, 4, 32), "float32"), 0.2)
    cache.end_forward()


def _t(shape, dtype="float32"):
    return tvm.runtime.tensor(np.random.default_rng(1).standard_normal(shape).astype(dtype))


SEQUENCE_ERRORS = {
    "add duplicate": (lambda c: c.add_sequence(0), rk.SequenceError, "0"),
    "remove unknown": (lambda c: c.remove_sequence(5), rk.SequenceError, "5"),
    "fork unknown parent": (lambda c: c.fork_sequence(9, 2), rk.SequenceError, "9"),
    "fork existing child": (lambda c: c.fork_sequence(0, 1), rk.SequenceError, "1"),
    "fork position below -1": (lambda c: c.fork_sequence(0, 2, -2), rk.SequenceError, "-2"),
    "fork position beyond length": (lambda c: c.fork_sequence(0, 2, 22), rk.SequenceError, "22"),
    "popn unknown": (lambda c: c.popn(7, 1), rk.SequenceError, "7"),
    "popn negative": (lambda c: c.popn(0, -1), rk.SequenceError, "-1"),
    "popn beyond length": (lambda c: c.popn(1, 18), rk.SequenceError, "18"),
    "float sequence id": (lambda c: c.add_sequence(2.5), rk.KVCacheError, "2.5"),
    "string sequence id": (lambda c: c.remove_sequence("0"), rk.KVCacheError, "'0'"),
    "None fork position": (lambda c: c.fork_sequence(0, 2, None), rk.KVCacheError, "None"),
    "get length of unknown": (lambda c: c.get_sequence_length(4), rk.SequenceError, "4"),
}

FORWARD_ERRORS = {
    "begin unknown id": (lambda c: c.begin_forward([0, 3], [1, 1]), rk.SequenceError, "3"),
    "begin duplicate ids": (lambda c: c.begin_forward([0, 0], [1, 1]), rk.SequenceError, "0"),
    "begin length zero": (lambda c: c.begin_forward([0, 1], [1, 0]), rk.ForwardError, "0"),
    "begin negative length": (lambda c: c.begin_forward([0], [-3]), rk.ForwardError, "-3"),
    "begin mismatched lists": (lambda c: c.begin_forward([0, 1], [1]), rk.ForwardError, "2"),
    "begin empty batch": (lambda c: c.begin_forward([], []), rk.ForwardError, "empty"),
    "begin longer than chunk": (lambda c: c.begin_forward([0, 1], [40, 25]), rk.ForwardError, "65"),
    "begin non-int length": (lambda c: c.begin_forward([0], [1.5]), rk.KVCacheError, "1.5"),
    "cache full": (lambda c: c.begin_forward([0, 1], [60, 2]) if False else c.begin_forward([0], [64]),
                   None, None),  # placeholder replaced below
    "attention without begin": (lambda c: c.attention_with_fused_qkv(0, _t((1, 8, 32)), _t((1, 4, 32)), 0.1),
                                rk.ForwardError, "begin_forward"),
    "query positions without begin": (lambda c: c.get_query_positions(), rk.ForwardError, "begin_forward"),
    "self attention without begin": (lambda c: c.self_attention(0, _t((1, 4, 32)), _t((1, 2, 32)), _t((1, 2, 32)),
                                                                _t((1, 4, 32)), _t((1, 4)), 0.1),
                                     rk.ForwardError, "begin_forward"),
    "debug_get_kv range": (lambda c: c.debug_get_kv(0, 5, 30, _t((2, 25, 2, 32)), _t((2, 25, 2, 32))),
                           rk.KVCacheError, "30"),
    "debug_get_kv empty range": (lambda c: c.debug_get_kv(0, 5, 5, _t((2, 0, 2, 32)), _t((2, 0, 2, 32))),
                                 rk.KVCacheError, "[5, 5)"),
    "debug_get_kv wrong shape": (lambda c: c.debug_get_kv(0, 0, 4, _t((2, 4, 2, 16)), _t((2, 4, 2, 32))),
                                 rk.ForwardError, "k_data"),
    "debug_get_kv wrong dtype": (lambda c: c.debug_get_kv(0, 0, 4, _t((2, 4, 2, 32), "float16"), _t((2, 4, 2, 32))),
                                 rk.ForwardError, "float16"),
}
del FORWARD_ERRORS["cache full"]


def _check_error(cache, action, exc_type, fragment):
    before = _snapshot(cache)
    with pytest.raises(exc_type) as info:
        action(cache)
    assert fragment in str(info.value), f"message {str(info.value)!r} does not name {fragment!r}"
    _assert_same(before, _snapshot(cache))


@pytest.mark.parametrize("name", list(SEQUENCE_ERRORS))
def test_sequence_errors_leave_state_unchanged(cache, name):
    _check_error(cache, *SEQUENCE_ERRORS[name])


@pytest.mark.parametrize("name", list(FORWARD_ERRORS))
def test_forward_errors_leave_state_unchanged(cache, name):
    _check_error(cache, *FORWARD_ERRORS[name])


def _in_step(cache, action):
    """Run ``action`` inside an active step of sequences 0 and 1 (one token each)."""
    cache.begin_forward([0, 1], [1, 1])
    return action(cache)


STEP_ERRORS = {
    "qkv wrong head count": (lambda c: c.attention_with_fused_qkv(0, _t((2, 9, 32)), _t((2, 4, 32)), 0.1), "(*, 8, 32)"),
    "qkv wrong head_dim": (lambda c: c.attention_with_fused_qkv(0, _t((2, 8, 16)), _t((2, 4, 32)), 0.1), "16"),
    "qkv wrong dtype": (lambda c: c.attention_with_fused_qkv(0, _t((2, 8, 32), "float16"), _t((2, 4, 32)), 0.1),
                        "float16"),
    "qkv wrong rank": (lambda c: c.attention_with_fused_qkv(0, _t((2, 256)), _t((2, 4, 32)), 0.1), "(2, 256)"),
    "qkv too few rows": (lambda c: c.attention_with_fused_qkv(0, _t((1, 8, 32)), _t((1, 4, 32)), 0.1), "1 rows"),
    "qkv not a tensor": (lambda c: c.attention_with_fused_qkv(0, np.zeros((2, 8, 32), "float32"), _t((2, 4, 32)), 0.1),
                         "ndarray"),
    "o rows differ from qkv": (lambda c: c.attention_with_fused_qkv(0, _t((3, 8, 32)), _t((2, 4, 32)), 0.1), "(2, 4, 32)"),
    "layer out of range": (lambda c: c.attention_with_fused_qkv(2, _t((2, 8, 32)), _t((2, 4, 32)), 0.1), "layer_id 2"),
    "negative layer": (lambda c: c.attention_with_fused_qkv(-1, _t((2, 8, 32)), _t((2, 4, 32)), 0.1), "layer_id -1"),
    "sm_scale not a number": (lambda c: c.attention_with_fused_qkv(0, _t((2, 8, 32)), _t((2, 4, 32)), "x"), "'x'"),
    "self attention wrong k": (lambda c: c.self_attention(0, _t((2, 4, 32)), _t((2, 4, 32)), _t((2, 2, 32)),
                                                          _t((2, 4, 32)), _t((2, 4)), 0.1), "k has shape"),
    "cross attention lse dtype": (lambda c: c.cross_attention(0, _t((2, 4, 32)), _t((2, 4, 32)), _t((2, 4), "float16"),
                                                              0.1), "lse has dtype"),
    "begin while active": (lambda c: c.begin_forward([0], [1]), "active"),
    "remove while active": (lambda c: c.remove_sequence(0), "active"),
    "fork while active": (lambda c: c.fork_sequence(0, 5), "active"),
    "popn while active": (lambda c: c.popn(0, 1), "active"),
}


@pytest.mark.parametrize("name", list(STEP_ERRORS))
def test_errors_inside_a_step_leave_state_unchanged(cache, name):
    action, fragment = STEP_ERRORS[name]
    cache.begin_forward([0, 1], [1, 1])
    paging_before = cache._paging.debug_snapshot()
    pages_before = [p.numpy() for p in cache._pages]
    with pytest.raises(rk.KVCacheError) as info:
        action(cache)
    assert fragment in str(info.value), f"message {str(info.value)!r} does not name {fragment!r}"
    assert cache._paging.debug_snapshot() == paging_before
    for a, p in zip(pages_before, cache._pages):
        np.testing.assert_array_equal(a, p.numpy())
    # The step is still usable after the error.
    rng = np.random.default_rng(5)
    for layer in range(CFG.num_layers):
        o = tvm.runtime.tensor(np.full((2, 4, 32), np.nan, "float32"))
        cache.attention_with_fused_qkv(layer, _t((2, 8, 32)), o, 0.1)
        assert np.isfinite(o.numpy()).all()
    cache.end_forward()


def test_cache_full_changes_nothing(cache):
    rng = np.random.default_rng(2)
    while cache.get_num_available_pages() * CFG.page_size > CFG.prefill_chunk_size:
        _step(cache, rng, [0], [CFG.prefill_chunk_size])
    needed = CFG.prefill_chunk_size
    before = _snapshot(cache)
    with pytest.raises(rk.CacheFullError) as info:
        cache.begin_forward([1, 0], [needed // 2, needed // 2])
    assert "page" in str(info.value)
    _assert_same(before, _snapshot(cache))


def test_cache_full_in_fork_changes_nothing():
    cache = rk.PagedAttentionKVCache(CFG, tvm.cpu())
    rng = np.random.default_rng(3)
    cache.add_sequence(0)
    while cache.get_num_available_pages() > 0:
        take = min(CFG.prefill_chunk_size, cache.get_num_available_pages() * CFG.page_size)
        _step(cache, rng, [0], [take])
    before = _snapshot(cache)
    with pytest.raises(rk.CacheFullError):
        cache.fork_sequence(0, 1, 5)  # mid-page: needs one page for the partial copy
    _assert_same(before, _snapshot(cache))
    cache.fork_sequence(0, 2, 8)  # page-aligned: shares pages, needs none
    assert cache.get_sequence_length(2) == 8


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(num_qo_heads=6, num_kv_heads=4), "multiple"),
    (dict(head_dim=33), "even"),
    (dict(head_dim=512), "256"),
    (dict(dtype="int8"), "int8"),
    (dict(page_size=0), "page_size"),
    (dict(num_layers=-1), "num_layers"),
    (dict(rope_mode=5), "rope_mode"),
    (dict(rope_theta=0.0), "rope_theta"),
    (dict(attn_kinds=[0]), "attn_kinds"),
    (dict(attn_kinds=[0, 7]), "attn_kinds"),
    (dict(v_head_dim=16), "v_head_dim"),
    (dict(max_total_seq_len=True), "max_total_seq_len"),
])
def test_config_validation(kwargs, fragment):
    base = dict(num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=32)
    base.update(kwargs)
    with pytest.raises(rk.ConfigError) as info:
        rk.KVCacheConfig(**base)
    assert fragment in str(info.value)


def test_config_is_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        rk.KVCacheConfig(2, 4, 2, 32)  # noqa
    cfg = rk.KVCacheConfig(num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=32, support_sliding_window=True)
    assert cfg.effective_rope_mode == rk.RopeMode.INLINE
    assert cfg.num_total_pages == math.ceil(4096 / 16) + 1 + 2 * 32
    with pytest.raises(Exception):
        cfg.head_dim = 64  # type: ignore[misc]


def test_mla_config_without_its_head_dims_cannot_build_kernels():
    """An MLA config without the decompressed head dims is valid (for caches created with given
    kernels) but cannot build ours; building says what is missing and creates nothing."""
    cfg = rk.KVCacheConfig(num_layers=1, num_qo_heads=4, num_kv_heads=1, head_dim=96, v_head_dim=64,
                           attn_kinds=[rk.AttnKind.MLA])
    with pytest.raises(rk.errors.ConfigError, match="mla_original_qk_head_dim"):
        rk.PagedAttentionKVCache(cfg, tvm.cpu())


# ----------------------------------------------------------------- regressions found by test_property

SLIDING_CFG = dataclasses.replace(CFG, support_sliding_window=True)


def test_step_that_slides_every_new_token_out_succeeds():
    """A window equal to the sequence's unslidable prefix keeps none of a step's tokens; when the
    step fills whole pages, the last block ends with no page at all. begin_forward used to reserve
    the pages, then crash with an IndexError building the append slots (cache left changed)."""
    cache = rk.PagedAttentionKVCache(SLIDING_CFG, tvm.cpu())
    rng = np.random.default_rng(7)
    cache.add_sequence(0)
    _step(cache, rng, [0], [16])
    cache.fork_sequence(0, 1, 16)  # at the aligned end: sequence 0 gets an empty last block
    cache.enable_sliding_window_for_seq(0, 16, 0)  # the 16-token prefix cannot slide: it is the sink
    before = _snapshot(cache).contents
    _step(cache, rng, [0], [CFG.page_size])  # all new tokens slide out at once
    assert cache.get_sequence_length(0) == 16
    after = _snapshot(cache).contents  # the kept tokens are the prefix, untouched
    for seq in before:
        for a, b in zip(before[seq], after[seq]):
            np.testing.assert_array_equal(a, b)
    _step(cache, rng, [0, 1], [1, 1])


def test_window_smaller_than_the_shared_prefix_is_refused():
    """TVM accepts a window smaller than the prefix in earlier (shared) blocks, which cannot
    slide; every later append of the sequence then fails. It is refused when enabled."""
    cache = rk.PagedAttentionKVCache(SLIDING_CFG, tvm.cpu())
    rng = np.random.default_rng(11)
    cache.add_sequence(0)
    _step(cache, rng, [0], [20])
    cache.fork_sequence(0, 1, 16)  # sequence 1's last block starts after a 16-token shared prefix
    before = _snapshot(cache)
    with pytest.raises(rk.SequenceError, match="window size 15 for sequence 1 is smaller than its 16-token prefix"):
        cache.enable_sliding_window_for_seq(1, 15, 2)
    _assert_same(before, _snapshot(cache))
    cache.enable_sliding_window_for_seq(1, 16, 2)  # the prefix is the sink; new tokens slide
    _step(cache, rng, [1, 0], [5, 1])
    assert cache.get_sequence_length(1) == 16


def test_failed_sliding_reservation_keeps_the_paging_version():
    """A batch that cannot be reserved while windows slide used to bump the paging state's version
    (which invalidates decode lanes) before raising; a failed request changes nothing."""
    cache = rk.PagedAttentionKVCache(SLIDING_CFG, tvm.cpu())
    rng = np.random.default_rng(8)
    cache.add_sequence(0)
    cache.add_sequence(1)
    cache.enable_sliding_window_for_seq(0, 8, 2)
    while cache.get_num_available_pages() * CFG.page_size > CFG.prefill_chunk_size:
        _step(cache, rng, [1], [CFG.prefill_chunk_size])
    before, version = _snapshot(cache), cache._paging.version
    with pytest.raises(rk.CacheFullError):
        cache.begin_forward([0, 1], [1, CFG.prefill_chunk_size - 1])
    _assert_same(before, _snapshot(cache))
    assert cache._paging.version == version


def test_commit_failing_on_a_later_sequence_changes_nothing(cache):
    """commit_accepted_token_tree_nodes is check-then-mutate across sequences: a commit that fails
    on a later sequence must not leave earlier sequences popped, compacted or committed
    (regression: the earlier sequences were popped before the later one raised)."""
    rng = np.random.default_rng(3)
    cache.add_sequence(2)
    _step(cache, rng, [2], [6])  # no tree: a leaf other than -1 is refused
    before = _snapshot(cache, pages=True)
    with pytest.raises(rk.SequenceError, match="already committed"):
        cache.commit_accepted_token_tree_nodes([1, 2], [-1, 3])
    _assert_same(before, _snapshot(cache, pages=True))
    # A tree with a non-chain accepted path (compaction) followed by a failing sequence: no move either.
    _step_tree = lambda seq, parents: (cache.begin_forward([seq], [len(parents)], parents),  # noqa: E731
                                       [cache.attention_with_fused_qkv(l, _t((len(parents), 8, 32)),
                                                                       tvm.runtime.empty((len(parents), 4, 32), "float32"),
                                                                       0.2) for l in range(CFG.num_layers)],
                                       cache.end_forward())
    _step_tree(0, [-1, -1, 1])
    before = _snapshot(cache, pages=True)
    with pytest.raises(rk.SequenceError):
        cache.commit_accepted_token_tree_nodes([0, 2], [2, 0])
    _assert_same(before, _snapshot(cache, pages=True))
    cache.commit_accepted_token_tree_nodes([0], [2])
    assert cache.get_sequence_length(0) == 23
    # A sequence committed without a pop (its tree cleared) before a later one fails: nothing changes.
    _step_tree(0, [-1])
    before = _snapshot(cache, pages=True)
    with pytest.raises(rk.SequenceError, match="already committed"):
        cache.commit_accepted_token_tree_nodes([0, 2], [0, 1])
    _assert_same(before, _snapshot(cache, pages=True))
    assert not cache._paging.sequence(0).accepted_indices_committed


def test_commit_minus_one_pops_only_what_the_last_step_left():
    """Regression (red-team round 2): leaf -1 on a sequence without a tree popped the remembered
    last-step length again and again (a second commit, or one after popn, ate committed tokens)."""
    c = rk.PagedAttentionKVCache(CFG, tvm.cpu())
    rng = np.random.default_rng(5)
    c.add_sequence(0)
    _step(c, rng, [0], [20])
    _step(c, rng, [0], [5])
    c.commit_accepted_token_tree_nodes([0], [-1])  # TVM's rule for chains: the last step goes
    assert c.get_sequence_length(0) == 20
    c.commit_accepted_token_tree_nodes([0], [-1])  # consumed: nothing more
    assert c.get_sequence_length(0) == 20
    _step(c, rng, [0], [5])
    c.popn(0, 3)
    c.commit_accepted_token_tree_nodes([0], [-1])  # the 2 tokens of the last step that are left
    assert c.get_sequence_length(0) == 20
    c.begin_forward([0], [4], [-1, 0, 0, 1])
    for layer in range(CFG.num_layers):
        c.attention_with_fused_qkv(layer, _t((4, 8, 32)), tvm.runtime.empty((4, 4, 32), "float32"), 0.2)
    c.end_forward()
    c.commit_accepted_token_tree_nodes([0], [1])  # path [0, 1]
    c.commit_accepted_token_tree_nodes([0], [-1])
    assert c.get_sequence_length(0) == 22


def test_commit_popping_into_a_shared_prefix_copies_the_partial_page(cache):
    """A commit that pops into a shared prefix re-forks the sequence (popn semantics); the partial
    page of the re-fork must be copied (regression: commit dropped popn's page copies, leaving the
    re-forked sequence's last page unwritten)."""
    rng = np.random.default_rng(5)
    _step(cache, rng, [0], [3])    # sequence 0: length 24, last step appended 3
    cache.fork_sequence(0, 2)      # sequence 2 shares all 24 tokens, the last step's too
    k = tvm.runtime.empty((2, 24, 2, 32), "float32")
    v = tvm.runtime.empty((2, 24, 2, 32), "float32")
    cache.debug_get_kv(0, 0, 24, k, v)
    expected_k, expected_v = k.numpy()[:, :21], v.numpy()[:, :21]
    cache.commit_accepted_token_tree_nodes([0], [-1])  # pops the last step's 3 tokens: into the share
    assert cache.get_sequence_length(0) == 21 and cache.get_sequence_length(2) == 24
    k, v = tvm.runtime.empty((2, 21, 2, 32), "float32"), tvm.runtime.empty((2, 21, 2, 32), "float32")
    cache.debug_get_kv(0, 0, 21, k, v)
    np.testing.assert_array_equal(k.numpy(), expected_k)
    np.testing.assert_array_equal(v.numpy(), expected_v)


def test_commit_with_moves_next_to_a_sequence_with_nothing_to_move(cache):
    """A commit that compacts one sequence's path succeeds next to a sequence with nothing to
    move (regression, found by the soak run when popn into a tree was allowed: the compaction
    asked the paging state for that sequence's positions). popn into an uncommitted tree is
    refused now; the tree is dropped by its commit (leaf -1)."""
    def tree_step(seq, parents):
        cache.begin_forward([seq], [len(parents)], parents)
        for layer in range(CFG.num_layers):
            cache.attention_with_fused_qkv(layer, _t((len(parents), 8, 32)),
                                           tvm.runtime.empty((len(parents), 4, 32), "float32"), 0.2)
        cache.end_forward()

    cache.add_sequence(2)
    tree_step(2, [-1])
    with pytest.raises(rk.SequenceError, match="uncommitted token-tree"):
        cache.popn(2, 1)
    tree_step(0, [-1, -1, 1])  # accepted path to node 2: nodes 1, 2 move to slots 0, 1
    k = tvm.runtime.empty((2, 24, 2, 32), "float32")
    v = tvm.runtime.empty((2, 24, 2, 32), "float32")
    cache.debug_get_kv(0, 0, 24, k, v)
    expect_k = np.concatenate([k.numpy()[:, :21], k.numpy()[:, 22:24]], axis=1)
    cache.commit_accepted_token_tree_nodes([2, 0], [-1, 2])
    assert (cache.get_sequence_length(2), cache.get_sequence_length(0)) == (0, 23)
    k = tvm.runtime.empty((2, 23, 2, 32), "float32")
    cache.debug_get_kv(0, 0, 23, k, tvm.runtime.empty((2, 23, 2, 32), "float32"))
    np.testing.assert_array_equal(k.numpy(), expect_k)
