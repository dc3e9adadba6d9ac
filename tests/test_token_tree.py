"""Token-tree attention (speculative decoding): trees, commit of accepted nodes, compact copy."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

import relax_kvcache as rk
from relax_kvcache.token_tree import MAX_TREE_SIZE, TokenTree

from support.snapshot import assert_same, snapshot
from support.harness import Harness, make_config
from support.small_cache import CFG, run_step

from support.workloads import TREE_SHAPES, random_tree


@pytest.mark.parametrize("rope_mode", [rk.RopeMode.NONE, rk.RopeMode.NORMAL])
def test_random_trees_commit_and_continue(rope_mode):
    cfg = make_config(rope_mode=rope_mode, page_size=8, max_total_seq_len=2048)
    h = Harness(rk.PagedAttentionKVCache(cfg, tvm.cpu()), np.random.default_rng(int(rope_mode)))
    rng = h.rng
    for seq in range(4):
        h.add(seq)
    h.step([(0, 10), (1, 21), (2, 8), (3, 40)])
    h.fork(1, 4, 13)  # a sequence with a shared prefix (two block depths)
    h.step([(4, 3)])
    for round_ in range(4):
        sizes = {seq: int(rng.integers(1, 20)) for seq in range(5)}
        trees = {seq: random_tree(rng, sizes[seq], TREE_SHAPES[(seq + round_) % len(TREE_SHAPES)])
                 for seq in range(5)}
        batch = [(seq, sizes[seq]) for seq in range(5)]
        h.step(batch, trees)
        free_before = h.cache.get_num_available_pages()
        leaves = {seq: int(rng.integers(-1, sizes[seq])) for seq in range(5)}
        h.commit(leaves)
        h.check_contents()  # accepted path laid out after the prefix, nothing else kept
        assert h.cache.get_num_available_pages() >= free_before
        for _ in range(2):
            h.step([(seq, 1) for seq in range(5)])
    h.check_contents()
    for seq in range(5):
        h.remove(seq)
    assert h.cache.empty()


def test_tree_grown_over_steps_then_committed():
    """A tree extended over several steps (previous nodes in the pages: the paged tree kernel)."""
    cfg = make_config(rope_mode=rk.RopeMode.NORMAL, page_size=8)
    h = Harness(rk.PagedAttentionKVCache(cfg, tvm.cpu()), np.random.default_rng(9))
    for seq in range(3):
        h.add(seq)
    h.step([(0, 10), (1, 17), (2, 5)])
    full = [(k - 1) // 2 for k in range(15)]  # binary tree of 4 levels, appended level by level
    for level in range(4):
        lo, hi = 2 ** level - 1, 2 ** (level + 1) - 1
        h.step([(seq, hi - lo) for seq in range(3)], {seq: full[lo:hi] for seq in range(3)})
    # Leaves in the whole tree's numbering: paths [0, 2, 5, 11], [0, 1] and nothing.
    h.commit({0: 11, 1: 1, 2: -1})
    assert [h.cache.get_sequence_length(seq) for seq in range(3)] == [10 + 4, 17 + 2, 5]
    h.check_contents()
    h.step([(0, 1), (1, 1), (2, 1)])
    h.check_contents()


def test_chain_tree_uses_causal_path_and_decode_after():
    """A chain is plain causal attention; committing its leaf 3 keeps the prefix + 4 nodes."""
    cfg = make_config(rope_mode=rk.RopeMode.NORMAL)
    h = Harness(rk.PagedAttentionKVCache(cfg, tvm.cpu()), np.random.default_rng(2))
    h.add(0)
    h.step([(0, 20)])
    h.step([(0, 6)], {0: [-1, 0, 1, 2, 3, 4]})
    h.commit({0: 3})
    assert h.cache.get_sequence_length(0) == 24
    h.check_contents()
    h.step([(0, 1)])
    h.step([(0, 1)], {0: [-1]})  # a one-node tree (decode with a tree)
    h.commit({0: -1})                 # reject it: the step's token is popped
    assert h.cache.get_sequence_length(0) == 25
    h.step([(0, 1)])
    h.check_contents()


def test_token_tree_validation():
    t = TokenTree.build([-1, 0, 0, 1, 1, 2, 2], seq_id=0)
    assert t.depths == (0, 1, 1, 2, 2, 2, 2) and not t.is_chain and t.path_to(5) == [0, 2, 5]
    assert t.intervals[0] == (0, 7) and t.intervals[1] == (1, 4) and t.intervals[2] == (4, 7)
    assert TokenTree.build([-1, 0, 1], seq_id=0).is_chain


TREE_ERRORS = {
    "parent not before node": (lambda c: c.begin_forward([0], [3], [-1, 2, 0]), rk.ForwardError, "node 1"),
    "parent below -1": (lambda c: c.begin_forward([0], [2], [-1, -2]), rk.ForwardError, "-2"),
    "parent array too short": (lambda c: c.begin_forward([0, 1], [2, 2], [-1, 0, -1]), rk.ForwardError, "3 entries"),
    "tree too large": (lambda c: c.begin_forward([0], [MAX_TREE_SIZE + 1], [-1] + list(range(MAX_TREE_SIZE))),
                       rk.ForwardError, str(MAX_TREE_SIZE)),
    "commit unknown sequence": (lambda c: c.commit_accepted_token_tree_nodes([7], [0]), rk.SequenceError, "7"),
    "commit already committed": (lambda c: c.commit_accepted_token_tree_nodes([0], [0]), rk.SequenceError,
                                 "already committed"),
    "commit leaf below -1": (lambda c: c.commit_accepted_token_tree_nodes([0], [-2]), rk.SequenceError, "-2"),
    "commit mismatched lists": (lambda c: c.commit_accepted_token_tree_nodes([0, 1], [0]), rk.SequenceError,
                                "equal lengths"),
}


@pytest.mark.parametrize("name", list(TREE_ERRORS))
def test_tree_errors_leave_state_unchanged(name):
    cache = rk.PagedAttentionKVCache(make_config(rope_mode=rk.RopeMode.NORMAL, prefill_chunk_size=512), tvm.cpu())
    h = Harness(cache, np.random.default_rng(1))
    h.add(0)
    h.add(1)
    h.step([(0, 5), (1, 5)])
    action, exc, fragment = TREE_ERRORS[name]
    before = cache._paging.debug_snapshot()
    with pytest.raises(exc) as info:
        action(cache)
    assert fragment in str(info.value), str(info.value)
    assert cache._paging.debug_snapshot() == before and cache._step is None


def test_uncommitted_tree_rules():
    cache = rk.PagedAttentionKVCache(make_config(rope_mode=rk.RopeMode.NORMAL), tvm.cpu())
    h = Harness(cache, np.random.default_rng(4))
    h.add(0)
    h.step([(0, 5)])
    h.step([(0, 3)], {0: [-1, 0, 0]})
    before = cache._paging.debug_snapshot()
    with pytest.raises(rk.SequenceError, match="commit"):
        cache.begin_forward([0], [1])  # a step without a tree needs the tree committed first
    with pytest.raises(rk.SequenceError, match="uncommitted"):
        cache.fork_sequence(0, 5)
    with pytest.raises(rk.SequenceError, match="out of range"):
        cache.commit_accepted_token_tree_nodes([0], [3])
    assert cache._paging.debug_snapshot() == before
    h.commit({0: 2})
    with pytest.raises(rk.SequenceError, match="already committed"):
        cache.commit_accepted_token_tree_nodes([0], [1])
    assert cache.get_sequence_length(0) == 7


@pytest.mark.parametrize("config", [dict(rope_mode=rk.RopeMode.INLINE), dict(support_sliding_window=True),
                                    dict(attn_kinds=[rk.AttnKind.MHA_SLIDING, rk.AttnKind.MHA])])
def test_trees_rejected_with_inline_rope_or_windows(config):
    cache = rk.PagedAttentionKVCache(make_config(**config), tvm.cpu())
    cache.add_sequence(0)
    with pytest.raises(rk.ForwardError):
        cache.begin_forward([0], [2], [-1, 0])
    assert cache.get_sequence_length(0) == 0 and cache._step is None


def test_tree_pop_refused_and_multi_step_commit_keeps_the_path():
    """Regressions: popn into an uncommitted tree is refused (a later commit would move
    K/V of positions that no longer belong to the tree, even of another sequence's shared page);
    a commit of a tree grown over two steps keeps exactly the accepted path (TVM resolves it
    against the last step's tokens and keeps earlier steps' rejected nodes)."""
    cfg = make_config(rope_mode=rk.RopeMode.NORMAL, page_size=8)
    h = Harness(rk.PagedAttentionKVCache(cfg, tvm.cpu()), np.random.default_rng(11))
    h.add(1)
    h.step([(1, 8)])
    h.fork(1, 0, 8)
    h.step([(0, 2)])
    h.step([(0, 3)], {0: [-1, 0, 0]})
    h.step([(0, 2)], {0: [1, 3]})
    before = snapshot(h.cache, pages=True)
    with pytest.raises(rk.SequenceError, match="uncommitted token-tree"):
        h.cache.popn(0, 4)
    assert_same(before, snapshot(h.cache, pages=True))
    h.commit({0: 1})  # path [0, 1]: both from the first tree step
    assert h.cache.get_sequence_length(0) == 10 + 2 and h.cache.get_sequence_length(1) == 8
    h.check_contents()
    h.step([(0, 2)], {0: [-1, 0]})
    h.commit({0: -1})  # drops the whole tree
    assert h.cache.get_sequence_length(0) == 12
    h.check_contents()


# ---------------------------------------------------------------------------- commits after pops


def test_commit_minus_one_after_a_popn_into_a_shared_prefix():
    """popn into tokens a fork shares re-forks the sequence; the count of its last step's tokens
    that a commit with leaf -1 pops must survive that (it was reset to 0: nothing popped)."""
    cache = rk.PagedAttentionKVCache(CFG, tvm.cpu())
    cache.add_sequence(0)
    run_step(cache, np.random.default_rng(0), [0], [21])
    rng = np.random.default_rng(7)
    run_step(cache, rng, [0], [5])  # length 26, last step 5
    cache.fork_sequence(0, 1)
    cache.popn(0, 2)  # into the shared tokens: a re-fork
    cache.commit_accepted_token_tree_nodes([0], [-1])
    assert cache.get_sequence_length(0) == 21 and cache.get_sequence_length(1) == 26
