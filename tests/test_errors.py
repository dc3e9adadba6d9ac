"""Bad input: a clear exception naming the bad value, and the cache exactly as it was."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import tvm
import tvm_ffi

import relax_kvcache as rk
from relax_kvcache.tensors import view
from support.small_cache import CFG, assert_refused, create_with, one_sequence_cache, rand, run_step
from support.snapshot import assert_same as _assert_same, snapshot as _snapshot


@pytest.fixture()
def cache():
    """A cache with sequences 0 (length 21) and 1 (forked from 0 at 13, then extended by 4)."""
    c = rk.PagedAttentionKVCache(CFG, tvm.cpu())
    rng = np.random.default_rng(0)
    c.add_sequence(0)
    run_step(c, rng, [0], [21])
    c.fork_sequence(0, 1, 13)
    run_step(c, rng, [1], [4])
    return c


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
    "attention without begin": (lambda c: c.attention_with_fused_qkv(0, rand((1, 8, 32)), rand((1, 4, 32)), 0.1),
                                rk.ForwardError, "begin_forward"),
    "query positions without begin": (lambda c: c.get_query_positions(), rk.ForwardError, "begin_forward"),
    "self attention without begin": (lambda c: c.self_attention(0, rand((1, 4, 32)), rand((1, 2, 32)), rand((1, 2, 32)),
                                                                rand((1, 4, 32)), rand((1, 4)), 0.1),
                                     rk.ForwardError, "begin_forward"),
    "debug_get_kv range": (lambda c: c.debug_get_kv(0, 5, 30, rand((2, 25, 2, 32)), rand((2, 25, 2, 32))),
                           rk.KVCacheError, "30"),
    "debug_get_kv empty range": (lambda c: c.debug_get_kv(0, 5, 5, rand((2, 0, 2, 32)), rand((2, 0, 2, 32))),
                                 rk.KVCacheError, "[5, 5)"),
    "debug_get_kv wrong shape": (lambda c: c.debug_get_kv(0, 0, 4, rand((2, 4, 2, 16)), rand((2, 4, 2, 32))),
                                 rk.ForwardError, "k_data"),
    "debug_get_kv wrong dtype": (lambda c: c.debug_get_kv(0, 0, 4, rand((2, 4, 2, 32), "float16"), rand((2, 4, 2, 32))),
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
    "qkv wrong head count": (lambda c: c.attention_with_fused_qkv(0, rand((2, 9, 32)), rand((2, 4, 32)), 0.1), "(*, 8, 32)"),
    "qkv wrong head_dim": (lambda c: c.attention_with_fused_qkv(0, rand((2, 8, 16)), rand((2, 4, 32)), 0.1), "16"),
    "qkv wrong dtype": (lambda c: c.attention_with_fused_qkv(0, rand((2, 8, 32), "float16"), rand((2, 4, 32)), 0.1),
                        "float16"),
    "qkv wrong rank": (lambda c: c.attention_with_fused_qkv(0, rand((2, 256)), rand((2, 4, 32)), 0.1), "(2, 256)"),
    "qkv too few rows": (lambda c: c.attention_with_fused_qkv(0, rand((1, 8, 32)), rand((1, 4, 32)), 0.1), "1 rows"),
    "qkv not a tensor": (lambda c: c.attention_with_fused_qkv(0, np.zeros((2, 8, 32), "float32"), rand((2, 4, 32)), 0.1),
                         "ndarray"),
    "o rows differ from qkv": (lambda c: c.attention_with_fused_qkv(0, rand((3, 8, 32)), rand((2, 4, 32)), 0.1), "(2, 4, 32)"),
    "layer out of range": (lambda c: c.attention_with_fused_qkv(2, rand((2, 8, 32)), rand((2, 4, 32)), 0.1), "layer_id 2"),
    "negative layer": (lambda c: c.attention_with_fused_qkv(-1, rand((2, 8, 32)), rand((2, 4, 32)), 0.1), "layer_id -1"),
    "sm_scale not a number": (lambda c: c.attention_with_fused_qkv(0, rand((2, 8, 32)), rand((2, 4, 32)), "x"), "'x'"),
    "self attention wrong k": (lambda c: c.self_attention(0, rand((2, 4, 32)), rand((2, 4, 32)), rand((2, 2, 32)),
                                                          rand((2, 4, 32)), rand((2, 4)), 0.1), "k has shape"),
    "cross attention lse dtype": (lambda c: c.cross_attention(0, rand((2, 4, 32)), rand((2, 4, 32)), rand((2, 4), "float16"),
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
    for layer in range(CFG.num_layers):
        o = tvm.runtime.tensor(np.full((2, 4, 32), np.nan, "float32"))
        cache.attention_with_fused_qkv(layer, rand((2, 8, 32)), o, 0.1)
        assert np.isfinite(o.numpy()).all()
    cache.end_forward()


def test_cache_full_changes_nothing(cache):
    rng = np.random.default_rng(2)
    while cache.get_num_available_pages() * CFG.page_size > CFG.prefill_chunk_size:
        run_step(cache, rng, [0], [CFG.prefill_chunk_size])
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
        run_step(cache, rng, [0], [take])
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
    run_step(cache, rng, [0], [16])
    cache.fork_sequence(0, 1, 16)  # at the aligned end: sequence 0 gets an empty last block
    cache.enable_sliding_window_for_seq(0, 16, 0)  # the 16-token prefix cannot slide: it is the sink
    before = _snapshot(cache).contents
    run_step(cache, rng, [0], [CFG.page_size])  # all new tokens slide out at once
    assert cache.get_sequence_length(0) == 16
    after = _snapshot(cache).contents  # the kept tokens are the prefix, untouched
    for seq in before:
        for a, b in zip(before[seq], after[seq]):
            np.testing.assert_array_equal(a, b)
    run_step(cache, rng, [0, 1], [1, 1])


def test_window_smaller_than_the_shared_prefix_is_refused():
    """TVM accepts a window smaller than the prefix in earlier (shared) blocks, which cannot
    slide; every later append of the sequence then fails. It is refused when enabled."""
    cache = rk.PagedAttentionKVCache(SLIDING_CFG, tvm.cpu())
    rng = np.random.default_rng(11)
    cache.add_sequence(0)
    run_step(cache, rng, [0], [20])
    cache.fork_sequence(0, 1, 16)  # sequence 1's last block starts after a 16-token shared prefix
    before = _snapshot(cache)
    with pytest.raises(rk.SequenceError, match="window size 15 for sequence 1 is smaller than its 16-token prefix"):
        cache.enable_sliding_window_for_seq(1, 15, 2)
    _assert_same(before, _snapshot(cache))
    cache.enable_sliding_window_for_seq(1, 16, 2)  # the prefix is the sink; new tokens slide
    run_step(cache, rng, [1, 0], [5, 1])
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
        run_step(cache, rng, [1], [CFG.prefill_chunk_size])
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
    run_step(cache, rng, [2], [6])  # no tree: a leaf other than -1 is refused
    before = _snapshot(cache, pages=True)
    with pytest.raises(rk.SequenceError, match="already committed"):
        cache.commit_accepted_token_tree_nodes([1, 2], [-1, 3])
    _assert_same(before, _snapshot(cache, pages=True))
    # A tree with a non-chain accepted path (compaction) followed by a failing sequence: no move either.
    _step_tree = lambda seq, parents: (cache.begin_forward([seq], [len(parents)], parents),  # noqa: E731
                                       [cache.attention_with_fused_qkv(l, rand((len(parents), 8, 32)),
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
    """Regression: leaf -1 on a sequence without a tree popped the remembered
    last-step length again and again (a second commit, or one after popn, ate committed tokens)."""
    c = rk.PagedAttentionKVCache(CFG, tvm.cpu())
    rng = np.random.default_rng(5)
    c.add_sequence(0)
    run_step(c, rng, [0], [20])
    run_step(c, rng, [0], [5])
    c.commit_accepted_token_tree_nodes([0], [-1])  # TVM's rule for chains: the last step goes
    assert c.get_sequence_length(0) == 20
    c.commit_accepted_token_tree_nodes([0], [-1])  # consumed: nothing more
    assert c.get_sequence_length(0) == 20
    run_step(c, rng, [0], [5])
    c.popn(0, 3)
    c.commit_accepted_token_tree_nodes([0], [-1])  # the 2 tokens of the last step that are left
    assert c.get_sequence_length(0) == 20
    c.begin_forward([0], [4], [-1, 0, 0, 1])
    for layer in range(CFG.num_layers):
        c.attention_with_fused_qkv(layer, rand((4, 8, 32)), tvm.runtime.empty((4, 4, 32), "float32"), 0.2)
    c.end_forward()
    c.commit_accepted_token_tree_nodes([0], [1])  # path [0, 1]
    c.commit_accepted_token_tree_nodes([0], [-1])
    assert c.get_sequence_length(0) == 22


def test_commit_popping_into_a_shared_prefix_copies_the_partial_page(cache):
    """A commit that pops into a shared prefix re-forks the sequence (popn semantics); the partial
    page of the re-fork must be copied (regression: commit dropped popn's page copies, leaving the
    re-forked sequence's last page unwritten)."""
    rng = np.random.default_rng(5)
    run_step(cache, rng, [0], [3])    # sequence 0: length 24, last step appended 3
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
            cache.attention_with_fused_qkv(layer, rand((len(parents), 8, 32)),
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


# ---------------------------------------------------------------------------- tensors, scales, ids and ranges


@pytest.fixture()
def one_seq():
    """A cache holding only sequence 0 (21 tokens)."""
    return one_sequence_cache()


def test_tensors_that_share_memory_are_refused(one_seq):
    n = 2
    one_seq.begin_forward([0], [n])
    q = rand((n, 4, 32))
    for call, what in [
        (lambda: one_seq.cross_attention(0, q, q, rand((n, 4)), 0.2), "o shares memory with q"),
        (lambda: one_seq.self_attention(0, q, rand((n, 2, 32)), rand((n, 2, 32)), q, rand((n, 4)), 0.2),
         "o shares memory with q"),
    ]:
        assert_refused(one_seq, call, rk.ForwardError, what)
    o = tvm.runtime.empty((n, 4, 32), "float32")
    lse_over_o = tvm.runtime._ffi_api.TVMTensorCreateView(o, (n, 4), o.dtype, 0)
    assert_refused(one_seq, lambda: one_seq.cross_attention(0, q, o, lse_over_o, 0.2), rk.ForwardError,
               "o shares memory with lse")
    one_seq.end_forward()
    k = tvm.runtime.empty((2, 5, 2, 32), "float32")
    assert_refused(one_seq, lambda: one_seq.debug_get_kv(0, 0, 5, k, k), rk.ForwardError,
                   "k_data shares memory with v_data")


def test_float32_overflowing_scales(one_seq):
    one_seq.begin_forward([0], [1])
    for scale in (1e39, -1e39):
        assert_refused(one_seq, lambda: one_seq.attention_with_fused_qkv(0, rand((1, 8, 32)), rand((1, 4, 32)), scale),
                   rk.ForwardError, "float32")
    one_seq.end_forward()


def test_shared_kv_needs_the_source_layer_appended_first(one_seq):
    """Before the source layer's attention a decode step read the stale slot of its new token."""
    one_seq.begin_forward([0], [1])
    args = (rand((1, 4, 32)), rand((1, 2, 32)), rand((1, 2, 32)), tvm.runtime.empty((1, 4, 32), "float32"), 0.2)
    assert_refused(one_seq, lambda: one_seq.attention_with_shared_kv(1, *args), rk.ForwardError, "not appended yet")
    one_seq.attention_with_fused_qkv(1, rand((1, 8, 32)), tvm.runtime.empty((1, 4, 32), "float32"), 0.2)
    one_seq.attention_with_shared_kv(1, *args)


def test_merge_with_itself_still_checks_o_against_lse(one_seq):
    o = tvm.runtime.tensor(np.random.default_rng(2).standard_normal((8, 4, 32)).astype("float32"))
    lse = tvm.runtime._ffi_api.TVMTensorCreateView(o, (8, 4), o.dtype, 0)
    with pytest.raises(rk.ForwardError, match="o_self_attn shares memory with lse_self_attn"):
        one_seq.merge_attn_output_inplace(o, lse, o, lse)


def test_sequence_ids_beyond_int64_raise_sequence_error(one_seq):
    for bad in (2**63, -(2**63) - 1):
        assert_refused(one_seq, lambda: one_seq.add_sequence(bad), rk.SequenceError, "outside the int64 range")


def test_huge_ranges_are_refused_before_they_are_expanded(one_seq):
    """``range`` is an accepted id / length container; a huge one was expanded first (MemoryError
    or OverflowError, not a KVCacheError; gigabytes for range(10**8))."""
    assert_refused(one_seq, lambda: one_seq.begin_forward(range(10**15), [1]), rk.SequenceError,
               r"seq_ids has 1000000000000000 entries, more than 1 \(the number of sequences")
    assert_refused(one_seq, lambda: one_seq.begin_forward([0], range(2**70)), rk.SequenceError, "append_lengths has")
    assert_refused(one_seq, lambda: one_seq.commit_accepted_token_tree_nodes(range(10**15), [0]), rk.SequenceError,
               "seq_ids has")
    begin = tvm_ffi.get_global_func("vm.builtin.kv_state_begin_forward")
    assert_refused(one_seq, lambda: begin(one_seq, range(10**15), [1]), rk.SequenceError, "seq_ids has")
    with pytest.raises(rk.ConfigError, match="attn_kinds .argument 6. has 1000000000000000 entries"):
        create_with(one_seq._kernels, a6=range(10**15))
    one_seq.begin_forward(range(1), range(4, 5))  # small ranges still work
    one_seq.end_forward()


def test_negative_device_index_is_refused():
    with pytest.raises(rk.ConfigError, match="negative index"):
        rk.PagedAttentionKVCache(CFG, tvm.cpu(-1))


def test_constructor_arguments_of_the_wrong_type_or_device_kind():
    for config in (None, "cfg", CFG.__dict__):
        with pytest.raises(rk.ArgumentError, match="config must be a KVCacheConfig"):
            rk.PagedAttentionKVCache(config)
    with pytest.raises(rk.ArgumentError, match="target must be a tvm.target.Target or None, got 'cuda'"):
        rk.PagedAttentionKVCache(CFG, tvm.cpu(), target="cuda")
    with pytest.raises(rk.ConfigError, match="target cuda compiles for another kind of device than cpu"):
        rk.PagedAttentionKVCache(CFG, tvm.cpu(), target=tvm.target.Target("cuda"))
    # a device this process cannot use: refused before kernels are compiled for it (a bare
    # RuntimeError from TVM's allocator after compiling, before)
    absent = tvm.metal(0) if not tvm.metal(0).exist else tvm.vulkan(0)
    for target in (None, tvm.target.Target("metal" if absent == tvm.metal(0) else "vulkan")):
        with pytest.raises(rk.ConfigError, match=f"device {absent} does not exist in this process"):
            rk.PagedAttentionKVCache(CFG, absent, target=target)


def test_valid_inputs_of_numpy_and_container_types(one_seq):
    """Valid inputs: numpy scalar types as dtypes, list / tuple subclasses and
    memmaps as attn_kinds, 0-d arrays as scales were refused after the exact-type checks came
    in. (A rope_ext_factors that is not a tensor is refused unless it carries no factors: TVM's
    null value ``0`` and lists of ones are read as none, as TVM reads them.)"""
    import collections

    import ml_dtypes

    base = dict(num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=16)
    for dtype, name in ((np.float16, "float16"), (np.float32, "float32"), (ml_dtypes.bfloat16, "bfloat16"),
                        (np.str_("float16"), "float16")):
        assert rk.KVCacheConfig(**base, dtype=dtype).dtype == name
    pair = collections.namedtuple("Pair", "a b")
    for kinds in (pair(0, 3), np.array([0, 3], dtype=object), tvm_ffi.Array([0, 3])):
        cfg = rk.KVCacheConfig(**base, attn_kinds=kinds, layer_sliding_window_size=8)
        assert cfg.attn_kinds == (rk.AttnKind.MHA, rk.AttnKind.MHA_SLIDING)
    assert rk.KVCacheConfig(**base, rope_theta=np.array(5e5)).rope_theta == 5e5
    one_seq.begin_forward([0], [1])
    one_seq.attention_with_fused_qkv(0, rand((1, 8, 32)), rand((1, 4, 32)), np.array(0.2))
    one_seq.end_forward()
    for factors in (0, [1.0]):
        assert create_with(one_seq._kernels, a11=factors).config.rope_ext_factors is None
    for factors in ([], [2.0], 1):
        with pytest.raises(rk.ArgumentError, match="rope_ext_factors .argument 11. must be None, 0 .TVM's null value."):
            create_with(one_seq._kernels, a11=factors)


# ---------------------------------------------------------------------------- config values


@pytest.mark.parametrize("changes, message", [
    (dict(rope_theta=10**400), "rope_theta must be a finite float32"),
    (dict(rope_theta=1e-320), "rope_theta must be positive"),
    (dict(rope_scale=1e39), "rope_scale must be a finite float32"),
    (dict(rope_mode=1.0), "rope_mode must be"),
    (dict(rope_mode=True), "rope_mode must be"),
    (dict(dtype=np.dtype("int8")), "dtype must be one of"),
])
def test_config_values_the_kernels_cannot_hold(changes, message):
    with pytest.raises(rk.ConfigError, match=message):
        dataclasses.replace(CFG, **changes)


def test_config_accepts_numpy_and_dtype_objects():
    cfg = dataclasses.replace(CFG, num_layers=np.int64(2), dtype=np.dtype("float32"), rope_theta=np.float32(1e4),
                              rope_mode=np.int64(1))
    assert (cfg.num_layers, cfg.dtype, cfg.rope_theta, cfg.rope_mode) == (2, "float32", 1e4, rk.RopeMode.NORMAL)
    assert type(cfg.num_layers) is int and cfg == CFG


def test_config_mla_dims_become_python_ints():
    """numpy MLA dims stayed numpy (their size check wrapped around int64)."""
    mla = dict(num_layers=1, num_qo_heads=4, num_kv_heads=1, head_dim=576, v_head_dim=512, attn_kinds=[1],
               rope_mode=0, dtype="float16")
    cfg = rk.KVCacheConfig(**mla, mla_original_qk_head_dim=np.int64(192), mla_original_v_head_dim=np.int32(128))
    assert (type(cfg.mla_original_qk_head_dim), type(cfg.mla_original_v_head_dim)) == (int, int)
    huge = dict(mla, num_qo_heads=2**31 - 1, max_total_seq_len=2**25, context_chunk_size=2**25, prefill_chunk_size=1)
    for dims in ((192, 128), (np.int64(192), np.int64(128))):
        with pytest.raises(rk.ConfigError, match="MLA context workspace would take"):
            rk.KVCacheConfig(**huge, mla_original_qk_head_dim=dims[0], mla_original_v_head_dim=dims[1])


@pytest.mark.parametrize("factors", [("2.0",) * 16, (True,) * 16, (b"1.5",) * 16, np.ones(16, bool)])
def test_factor_values_must_be_numbers(factors):
    """Numpy converted strings, bools and bytes into factors."""
    with pytest.raises(rk.ConfigError, match="must hold numbers"):
        rk.KVCacheConfig(num_layers=1, num_qo_heads=4, num_kv_heads=2, head_dim=16, rope_ext_factors=factors,
                         rope_original_max_position_embeddings=8)


def test_fused_qkv_check_of_our_library_refuses_what_the_python_checks_refuse(cache):
    """Our libraries check ``attention_with_fused_qkv``'s tensors in one host call
    (``check_fused_qkv``): it passes the step's tensors and refuses each wrong one; the cache
    then names the argument (the Python checks) and changes nothing."""
    check = cache._kernels.check_fused_qkv
    assert check is not None, "our MHA library has no check_fused_qkv"
    cache.begin_forward([0, 1], [1, 1])
    positions = cache._step.device.q_rope_position
    good_qkv, good_o = rand((2, 8, 32)), rand((2, 4, 32))
    check(good_qkv, good_o, positions)
    base = tvm.runtime.empty((2 * 8 * 32 + 64,), "float32")
    wrong = {"dtype": (rand((2, 8, 32), "float16"), good_o, "float16"),
             "heads": (rand((2, 9, 32)), good_o, r"\(\*, 8, 32\)"),
             "o rows": (good_qkv, rand((3, 4, 32)), r"\(2, 4, 32\)"),
             "device": (good_qkv, tvm.runtime.empty((2, 4, 32), "float32", tvm.cpu(1)), "cpu:1"),
             "byte offset": (view(base, (2, 8, 32), 64), good_o, "offset")}
    for name, (qkv, o, fragment) in wrong.items():
        with pytest.raises(Exception):
            check(qkv, o, positions)
        assert_refused(cache, lambda: cache.attention_with_fused_qkv(0, qkv, o, 0.1), rk.KVCacheError, fragment)
    # qkv / o with more rows than the step's tokens: refused by the library check, then served
    # by views of their first rows
    o = tvm.runtime.tensor(np.full((3, 4, 32), np.nan, "float32"))
    cache.attention_with_fused_qkv(0, rand((3, 8, 32)), o, 0.1)
    assert np.isfinite(o.numpy()[:2]).all() and np.isnan(o.numpy()[2]).all()
    cache.end_forward()


def test_fused_qkv_fast_path_runs_no_python_tensor_check(cache, monkeypatch):
    """With our library, a call whose tensors pass ``check_fused_qkv`` skips the Python checks."""
    monkeypatch.setattr(cache._tensor_checks, "fused_qkv", lambda *a: pytest.fail("Python check ran"))
    cache.begin_forward([0, 1], [1, 1])
    for layer in range(CFG.num_layers):
        o = tvm.runtime.tensor(np.full((2, 4, 32), np.nan, "float32"))
        cache.attention_with_fused_qkv(layer, rand((2, 8, 32)), o, 0.1)
        assert np.isfinite(o.numpy()).all()
    cache.end_forward()
