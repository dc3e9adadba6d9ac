"""Tests of the pure-Python paging layer (`relax_kvcache.paging`).

Hand-worked scenarios check exact page ids, block indices and reference counts as TVM's
``paged_kv_cache.cc`` produces them; a randomized model test checks the invariants after
arbitrary operation sequences; a differential test (marker ``tvm_native``) replays random
operations on TVM's own C++ cache and compares position maps, page copies and counters.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from relax_kvcache.errors import CacheFullError, KVCacheError, SequenceError
from relax_kvcache.paging import Block, BlockPool, PageCopy, PagePool, PagingState, Sequence

PS = 16


# ----------------------------------------------------------------------------- helpers


def arange(lo: int, hi: int) -> list[int]:
    return list(range(lo, hi))


def pm(state: PagingState, seq_id: int) -> list[int]:
    return state.position_map(seq_id, 0, state.sequence_length(seq_id)).tolist()


def blk(state: PagingState, idx: int) -> tuple:
    """(page_ids, seq_length, start_pos, parent, ref_count) of a block."""
    b = state.block(idx)
    return (b.page_ids, b.seq_length, b.start_pos, b.parent, b.ref_count)


def new_state(num_pages: int = 32, lengths: dict[int, int] | None = None) -> PagingState:
    state = PagingState(num_pages, PS)
    for seq_id, length in (lengths or {}).items():
        state.add_sequence(seq_id)
        if length:
            state.reserve_append([seq_id], [length])
    return state


def assert_rejected(state: PagingState, exc: type, match: str, fn, *args) -> None:
    """``fn(*args)`` raises ``exc`` matching ``match`` and leaves the state exactly unchanged."""
    before = state.debug_snapshot()
    with pytest.raises(exc, match=match):
        fn(*args)
    assert state.debug_snapshot() == before


def free_top(state: PagingState, k: int) -> list[int]:
    """The last ``k`` pages pushed on the free stack, most recent last."""
    return list(state.free_page_ids()[-k:])


# ------------------------------------------------------------------------- page pool


def test_page_pool_order_and_errors():
    pool = PagePool(5)
    assert pool.free_page_ids() == (4, 3, 2, 1, 0)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(0) == []
    with pytest.raises(CacheFullError, match="4 page.*needed but only 3 free"):
        pool.allocate(4)
    assert pool.num_free == 3
    pool.release([1, 0])
    assert pool.allocate(3) == [0, 1, 2]
    with pytest.raises(KVCacheError, match="released twice"):
        pool.release([3])
    with pytest.raises(KVCacheError, match="released twice"):
        pool.release([0, 0])
    with pytest.raises(KVCacheError, match="not in range"):
        pool.release([7])
    assert pool.num_free == 2
    pool.reset()
    assert pool.free_page_ids() == (4, 3, 2, 1, 0) and pool.num_pages == 5


def test_block_pool_reuses_indices_like_tvm():
    pool = BlockPool()
    assert [pool.new_block() for _ in range(3)] == [0, 1, 2]
    for idx in (0, 1, 2):
        pool.retain(idx)
    pool[1].page_ids.append(9)
    pool.free(1)
    pool.free(0)
    assert not pool.is_live(1) and pool.free_block_indices() == (1, 0)
    assert pool.new_block() == 0 and pool.new_block() == 1 and pool.new_block() == 3
    assert pool[1] == Block(1)  # reset on reuse
    pool.retain(2)
    pool.release(2)
    with pytest.raises(KVCacheError, match="expected a shared block"):
        pool.release(2)
    pool.retain(2)
    with pytest.raises(KVCacheError, match="still shared"):
        pool.free(2)
    with pytest.raises(KVCacheError, match="not a live block"):
        pool.get(7)


# ------------------------------------------------------------------ hand-worked scenarios


def test_add_and_reserve():
    state = new_state(32)
    state.add_sequence(0)
    assert blk(state, 0) == ([], 0, 0, -1, 1)
    state.reserve_append([0], [40])
    assert blk(state, 0) == ([0, 1, 2], 40, 0, -1, 1)
    state.add_sequence(1)
    assert state.pages_needed(0, 10) == 1 and state.pages_needed(0, 8) == 0
    state.reserve_append([0, 1], [10, 20])  # batch order: seq 0 gets page 3, seq 1 pages 4, 5
    assert blk(state, 0) == ([0, 1, 2, 3], 50, 0, -1, 1)
    assert blk(state, 1) == ([4, 5], 20, 0, -1, 1)
    assert state.sequence(0).seq_length == 50 and state.sequence_length(1) == 20
    assert state.position_map(0, 38, 50).tolist() == arange(38, 50)
    assert pm(state, 1) == arange(64, 84)
    assert state.position_map(1, 5, 5).dtype == np.int32
    assert state.position_map(1, 5, 5).size == 0
    assert state.num_free_pages == 26 and state.total_sequence_length() == 70
    assert state.seq_ids() == [0, 1]
    assert state.has_sequence(1) and not state.has_sequence(2)
    assert not state.empty()


def test_fork_at_end_on_page_boundary_adds_empty_parent_block():
    state = new_state(32, {0: 32})
    assert state.fork_sequence(0, 1) == []
    # The parent continues in a new empty block 1; the child (block 2) hangs off block 0.
    assert state.block_trace(0) == [0, 1] and state.block_trace(1) == [0, 2]
    assert blk(state, 0) == ([0, 1], 32, 0, -1, 2)
    assert blk(state, 1) == ([], 0, 32, 0, 1)
    assert blk(state, 2) == ([], 0, 32, 0, 1)
    assert state.sequence_length(1) == 32
    state.reserve_append([0, 1], [1, 1])
    assert pm(state, 0) == arange(0, 32) + [32]
    assert pm(state, 1) == arange(0, 32) + [48]
    # Forking again at the end of the (now non-aligned) parent splits nothing new: 33 % 16 != 0.
    assert state.fork_sequence(0, 2) == [PageCopy(2, 4, 1)]


def test_fork_mid_page_copies_partial_page_and_splits_block():
    state = new_state(32, {0: 40})
    copies = state.fork_sequence(0, 1, 20)
    # Block 0 is split: new block 2 takes its first page and is shared by block 0 and block 1.
    assert copies == [PageCopy(src_page=1, dst_page=3, length=4)]
    assert blk(state, 2) == ([0], 16, 0, -1, 2)
    assert blk(state, 0) == ([1, 2], 24, 16, 2, 1)
    assert blk(state, 1) == ([3], 4, 16, 2, 1)
    assert state.block_trace(1) == [2, 1] and state.sequence_length(1) == 20
    assert pm(state, 0) == arange(0, 40)
    assert pm(state, 1) == arange(0, 16) + arange(48, 52)
    state.reserve_append([1], [14])
    assert blk(state, 1) == ([3, 4], 18, 16, 2, 1)
    assert pm(state, 1) == arange(0, 16) + arange(48, 66)


def test_fork_page_aligned_past_first_page_splits_without_copy():
    state = new_state(32, {0: 40})
    assert state.fork_sequence(0, 1, 32) == []
    assert blk(state, 2) == ([0, 1], 32, 0, -1, 2)
    assert blk(state, 0) == ([2], 8, 32, 2, 1)
    assert blk(state, 1) == ([], 0, 32, 2, 1)
    assert state.num_free_pages == 29


def test_fork_at_zero_and_in_first_page():
    state = new_state(32, {0: 40})
    assert state.fork_sequence(0, 1, 0) == []
    assert blk(state, 1) == ([], 0, 0, -1, 1) and blk(state, 0)[4] == 1
    assert state.fork_sequence(0, 2, 5) == [PageCopy(0, 3, 5)]  # first page: no split
    assert blk(state, 2) == ([3], 5, 0, -1, 1)
    assert pm(state, 2) == arange(48, 53)
    state.reserve_append([1], [5])
    assert pm(state, 1) == arange(64, 69)


def test_fork_at_block_boundary_links_child_to_previous_block():
    state = new_state(32, {0: 40})
    state.fork_sequence(0, 1, 32)  # blocks: 2 = [0, 1] (32 tokens) <- 0 = [2] (8 tokens)
    state.remove_sequence(1)  # block 2 is referenced only by block 0 again
    assert blk(state, 2)[4] == 1
    assert state.fork_sequence(0, 3, 32) == []  # lands on block 0 at offset 0: no split
    assert state.block_trace(3) == [2, 1] and blk(state, 2)[4] == 2


def test_fork_chain_aligned():
    state = new_state(32, {0: 16})
    for child in range(1, 5):
        assert state.fork_sequence(child - 1, child) == []
        state.reserve_append([child], [16])
    assert state.block_trace(0) == [0, 1]
    assert state.block_trace(1) == [0, 2, 3]
    assert state.block_trace(2) == [0, 2, 4, 5]
    assert state.block_trace(3) == [0, 2, 4, 6, 7]
    assert state.block_trace(4) == [0, 2, 4, 6, 8]
    assert [state.block(i).ref_count for i in range(9)] == [2, 1, 2, 1, 2, 1, 2, 1, 1]
    assert [state.block(i).page_ids for i in (0, 2, 4, 6, 8)] == [[0], [1], [2], [3], [4]]
    assert pm(state, 4) == arange(0, 80) and pm(state, 0) == arange(0, 16)


def build_unaligned_chain() -> PagingState:
    """Sequences 0 <- 1 <- 2 <- 3 <- 4, each forked at the end of its parent + 20 tokens."""
    state = new_state(32, {0: 20})
    expected_copies = [[PageCopy(1, 2, 4)], [PageCopy(3, 4, 8)], [PageCopy(5, 6, 12)], []]
    for child in range(1, 5):
        assert state.fork_sequence(child - 1, child) == expected_copies[child - 1]
        state.reserve_append([child], [20])
    return state


def test_fork_chain_unaligned():
    state = build_unaligned_chain()
    traces = {0: [2, 0], 1: [2, 4, 1], 2: [2, 4, 6, 3], 3: [2, 4, 6, 5, 7], 4: [2, 4, 6, 5, 8]}
    assert {s: state.block_trace(s) for s in range(5)} == traces
    assert blk(state, 2) == ([0], 16, 0, -1, 2)
    assert blk(state, 0) == ([1], 4, 16, 2, 1)
    assert blk(state, 4) == ([2], 16, 16, 2, 2)
    assert blk(state, 1) == ([3], 8, 32, 4, 1)
    assert blk(state, 6) == ([4], 16, 32, 4, 2)
    assert blk(state, 3) == ([5], 12, 48, 6, 1)
    assert blk(state, 5) == ([6, 7], 32, 48, 6, 2)
    assert blk(state, 7) == ([], 0, 80, 5, 1)
    assert blk(state, 8) == ([8, 9], 20, 80, 5, 1)
    shared = arange(0, 16) + arange(32, 48)
    assert pm(state, 0) == arange(0, 20)
    assert pm(state, 1) == shared + arange(48, 56)
    assert pm(state, 2) == shared + arange(64, 92)
    assert pm(state, 3) == shared + arange(64, 80) + arange(96, 128)
    assert pm(state, 4) == shared + arange(64, 80) + arange(96, 128) + arange(128, 148)
    assert state.position_map(4, 70, 90).tolist() == arange(118, 128) + arange(128, 138)
    assert state.total_sequence_length() == 300 and state.num_free_pages == 22


def test_remove_in_order_returns_exact_pages():
    state = build_unaligned_chain()
    state.remove_sequence(2)
    assert free_top(state, 1) == [5] and blk(state, 6)[4] == 1
    state.remove_sequence(4)
    assert free_top(state, 3) == [5, 8, 9] and blk(state, 5)[4] == 1
    state.remove_sequence(3)  # frees blocks 7, 5, 6 walking up; block 4 loses a reference
    assert free_top(state, 6) == [5, 8, 9, 6, 7, 4] and blk(state, 4)[4] == 1
    state.remove_sequence(0)
    assert free_top(state, 7) == [5, 8, 9, 6, 7, 4, 1] and blk(state, 2)[4] == 1
    assert not state.empty()
    state.remove_sequence(1)
    assert state.free_page_ids() == tuple(range(31, 9, -1)) + (5, 8, 9, 6, 7, 4, 1, 3, 2, 0)
    assert state.empty() and state.num_free_pages == 32
    # Freed blocks are reused last-freed first, pages likewise.
    state.add_sequence(9)
    assert state.block_trace(9) == [2]
    state.reserve_append([9], [40])
    assert state.block(2).page_ids == [0, 2, 3]


def test_remove_root_first_keeps_children_alive():
    state = build_unaligned_chain()
    state.remove_sequence(0)  # only block 0 (page 1) goes
    assert free_top(state, 1) == [1]
    for seq_id in (1, 2, 3, 4):
        assert state.has_sequence(seq_id)
    assert pm(state, 1) == arange(0, 16) + arange(32, 48) + arange(48, 56)
    for seq_id in (4, 3, 2, 1):
        state.remove_sequence(seq_id)
    assert state.empty()


def test_popn_within_block():
    state = new_state(32, {0: 40})
    assert state.popn(0, 0) == []
    assert state.popn(0, 10) == []
    assert blk(state, 0) == ([0, 1], 30, 0, -1, 1) and free_top(state, 1) == [2]
    assert state.popn(0, 14) == [] and blk(state, 0) == ([0], 16, 0, -1, 1)
    assert state.popn(0, 16) == [] and blk(state, 0) == ([], 0, 0, -1, 1)
    assert state.sequence_length(0) == 0 and not state.empty()
    state.remove_sequence(0)
    assert state.empty()


def test_popn_across_blocks_frees_whole_blocks():
    state = new_state(32, {0: 16})
    state.fork_sequence(0, 1)  # seq 0: blocks [0, 1], seq 1: [0, 2]
    state.reserve_append([0], [20])  # block 1 gets pages 1, 2
    state.remove_sequence(1)  # block 0 is unshared again
    assert state.popn(0, 30) == []
    assert free_top(state, 2) == [1, 2]
    assert state.block_trace(0) == [0] and blk(state, 0) == ([0], 6, 0, -1, 1)
    assert state.sequence_length(0) == 6


def shared_prefix_state(num_pages: int = 32) -> PagingState:
    """Seq 0 = 32 shared tokens (block 0) + 8 own tokens (block 1); seq 1 forked at 32."""
    state = new_state(num_pages, {0: 32})
    state.fork_sequence(0, 1)
    state.reserve_append([0], [8])
    assert blk(state, 1) == ([2], 8, 32, 0, 1) and blk(state, 0)[4] == 2
    return state


def test_popn_into_shared_prefix_without_partial_page():
    state = shared_prefix_state()
    assert state.popn(0, 24) == []
    # Block 1 is freed, then the re-fork at 16 reuses it and splits block 0 via a new block 3.
    assert state.block_trace(0) == [3, 1] and state.block_trace(1) == [3, 0, 2]
    assert blk(state, 3) == ([0], 16, 0, -1, 2)
    assert blk(state, 0) == ([1], 16, 16, 3, 1)
    assert blk(state, 1) == ([], 0, 16, 3, 1)
    assert state.sequence(0) == Sequence(0, 1, 16)
    assert pm(state, 0) == arange(0, 16) and pm(state, 1) == arange(0, 32)
    assert free_top(state, 1) == [2]
    state.reserve_append([0], [1])
    assert pm(state, 0) == arange(0, 16) + [32]


def test_popn_into_shared_prefix_with_partial_page_reuses_freed_page():
    state = shared_prefix_state(num_pages=3)
    assert state.num_free_pages == 0
    assert state.popn(0, 20) == [PageCopy(1, 2, 4)]
    assert state.block_trace(0) == [3, 1]
    assert blk(state, 1) == ([2], 4, 16, 3, 1)
    assert pm(state, 0) == arange(0, 16) + arange(32, 36)
    assert pm(state, 1) == arange(0, 32)


def test_popn_fallback_cache_full_is_checked_before_mutating():
    state = new_state(2, {0: 32})
    state.fork_sequence(0, 1)  # seq 0's last block is empty; no page left
    assert_rejected(state, CacheFullError, "1 page.*needed, 0 free", state.popn, 0, 12)
    assert state.popn(0, 16) == []  # page aligned: no copy needed
    assert pm(state, 0) == arange(0, 16)


def test_popn_fallback_with_negative_ids_does_not_collide():
    # TVM would use the temporary id -1 - 3 == -4 here and fail.
    state = new_state(32, {3: 32, -4: 5})
    state.fork_sequence(3, 7)
    state.reserve_append([3], [4])
    assert state.popn(3, 10) == [PageCopy(1, 3, 10)]  # page 3 was just freed
    assert state.sequence_length(3) == 26 and state.sequence_length(-4) == 5
    assert state.seq_ids() == [3, -4, 7]


def test_empty_requires_everything_freed():
    state = new_state(8)
    assert state.empty()
    state.add_sequence(0)
    assert not state.empty()
    state.remove_sequence(0)
    assert state.empty()
    state.add_sequence(0)
    state._blocks.retain(0)  # white box: leak a reference so the block is not freed
    state.remove_sequence(0)
    assert not state.empty() and state.num_free_pages == 8
    state.clear()
    assert state.empty()
    state.add_sequence(1)
    assert state.block_trace(1) == [0]


# ----------------------------------------------------------------------------- errors


def test_error_messages_and_state_unchanged():
    state = new_state(4, {0: 40})
    state.add_sequence(3)
    state.reserve_append([3], [8])
    check = lambda exc, match, fn, *args: assert_rejected(state, exc, match, fn, *args)  # noqa
    check(SequenceError, "sequence 7 is not in the cache", state.remove_sequence, 7)
    check(SequenceError, "sequence 0 is already in the cache", state.add_sequence, 0)
    check(SequenceError, "sequence 7 is not in the cache", state.fork_sequence, 7, 8)
    check(SequenceError, "sequence 3 is already in the cache", state.fork_sequence, 0, 3)
    check(
        SequenceError,
        r"fork position 99 is out of range \[-1, 40\] for parent sequence 0",
        state.fork_sequence, 0, 5, 99,
    )
    check(SequenceError, r"fork position -2 is out of range", state.fork_sequence, 0, 5, -2)
    check(CacheFullError, "cannot fork sequence 0 at position 20", state.fork_sequence, 0, 5, 20)
    check(SequenceError, "sequence 7 is not in the cache", state.popn, 7, 1)
    check(SequenceError, "cannot pop -1 tokens", state.popn, 0, -1)
    check(SequenceError, "cannot pop 41 tokens from sequence 0 of length 40", state.popn, 0, 41)
    check(SequenceError, "sequence 7 is not in the cache", state.reserve_append, [0, 7], [1, 1])
    check(SequenceError, "appears more than once", state.reserve_append, [0, 3, 0], [1, 1, 1])
    check(SequenceError, "append length 0 for sequence 3", state.reserve_append, [0, 3], [1, 0])
    check(SequenceError, "append length -2", state.reserve_append, [0], [-2])
    check(CacheFullError, "2 page.*needed, 0 free", state.reserve_append, [0, 3], [9, 9])
    check(KVCacheError, "2 sequence ids but 1 append lengths", state.reserve_append, [0, 3], [1])
    check(SequenceError, "append length 0", state.pages_needed, 0, 0)
    check(SequenceError, r"position range \[5, 41\) is invalid", state.position_map, 0, 5, 41)
    check(SequenceError, r"position range \[6, 5\)", state.position_map, 0, 6, 5)
    check(SequenceError, r"position range \[-1, 5\)", state.position_map, 0, -1, 5)
    for bad in (True, 1.0, "0", None, np.bool_(True), 2**63, -(2**63) - 1):
        check(KVCacheError, "sequence id", state.add_sequence, bad)
        check(KVCacheError, "sequence id", state.remove_sequence, bad)
        check(KVCacheError, "sequence id", state.fork_sequence, 0, bad)
        check(KVCacheError, "sequence id", state.reserve_append, [0, bad], [1, 1])
    for bad in (True, 1.5, "1", None):
        check(KVCacheError, "append length", state.reserve_append, [0], [bad])
        check(KVCacheError, "fork position", state.fork_sequence, 0, 5, bad)
        check(KVCacheError, "pop length", state.popn, 0, bad)
    with pytest.raises(KVCacheError):
        PagingState(4, 0)
    with pytest.raises(KVCacheError):
        PagingState(2**27, 32)


def test_numpy_ints_and_int64_extremes_are_accepted():
    state = new_state(8)
    big, small = 2**63 - 1, -(2**63)
    state.add_sequence(big)
    state.add_sequence(np.int64(small))
    state.reserve_append(np.array([big, small], dtype=np.int64), np.array([3, 17], dtype=np.int32))
    assert state.sequence_length(small) == 17
    assert state.fork_sequence(np.int64(small), 5, np.int32(17)) == [PageCopy(2, 3, 1)]


def test_reserve_onto_shared_last_block_is_rejected():
    state = new_state(8, {0: 4})
    state._blocks.retain(0)  # white box: the public API never shares a last block
    assert_rejected(
        state, SequenceError, "last block 0 of sequence 0 is referenced by 1 other block",
        state.reserve_append, [0], [1],
    )


def test_uncommitted_token_tree_cannot_fork():
    state = new_state(8, {0: 4})
    state.sequence(0).accepted_indices_committed = False  # set by the token-tree code later
    assert_rejected(state, SequenceError, "uncommitted", state.fork_sequence, 0, 1)


# ------------------------------------------------------------------ randomized model test


class Model:
    """Tokens of each live sequence and the token held by each KV slot."""

    def __init__(self, state: PagingState) -> None:
        self.state = state
        self.tokens: dict[int, list[int]] = {}
        self.slots = np.full(state.num_pages * state.page_size, -1, dtype=np.int64)
        self.next_token = 0

    def apply_copies(self, copies: list[PageCopy]) -> None:
        ps = self.state.page_size
        for c in copies:
            assert 0 < c.length < ps
            self.slots[c.dst_page * ps : c.dst_page * ps + c.length] = self.slots[
                c.src_page * ps : c.src_page * ps + c.length
            ]

    def append(self, seq_ids: list[int], lengths: list[int]) -> None:
        old = [len(self.tokens[s]) for s in seq_ids]
        self.state.reserve_append(seq_ids, lengths)
        for seq_id, start, length in zip(seq_ids, old, lengths):
            new = list(range(self.next_token, self.next_token + length))
            self.next_token += length
            self.slots[self.state.position_map(seq_id, start, start + length)] = new
            self.tokens[seq_id] += new


def expected_pages(state: PagingState, seq_ids: list[int], lengths: list[int]) -> int:
    total = 0
    for seq_id, length in zip(seq_ids, lengths):
        block = state.block(state.sequence(seq_id).last_block)
        total += max(0, -(-(block.seq_length + length) // PS) - len(block.page_ids))
    return total


def check_invariants(model: Model) -> None:
    state = model.state
    assert sorted(state.seq_ids()) == sorted(model.tokens)
    slot_owner: dict[int, tuple[int, int]] = {}
    expected_refs: dict[int, int] = {}
    for seq_id, tokens in model.tokens.items():
        seq = state.sequence(seq_id)
        assert seq.seq_length == len(tokens) == state.sequence_length(seq_id)
        slots = state.position_map(seq_id, 0, len(tokens))
        assert slots.dtype == np.int32 and len(set(slots.tolist())) == len(tokens)
        assert model.slots[slots].tolist() == tokens  # (a) each sequence reads its tokens back
        for pos, slot in enumerate(slots.tolist()):  # (b) shared slots hold shared prefixes
            if slot in slot_owner:
                other, other_pos = slot_owner[slot]
                assert other_pos == pos and model.tokens[other][: pos + 1] == tokens[: pos + 1]
            else:
                slot_owner[slot] = (seq_id, pos)
        trace = state.block_trace(seq_id)
        expected_refs[trace[-1]] = expected_refs.get(trace[-1], 0) + 1
        start = 0
        for i, idx in enumerate(trace):
            block = state.block(idx)
            assert block.start_pos == start and block.parent == (trace[i - 1] if i else -1)
            assert len(block.page_ids) == -(-block.seq_length // PS)
            if i < len(trace) - 1:
                assert block.seq_length > 0 and block.seq_length % PS == 0
            start += block.seq_length
        assert start == len(tokens)
    live = state._blocks.live_indices()
    for idx in live:
        parent = state.block(idx).parent
        if parent != -1:
            expected_refs[parent] = expected_refs.get(parent, 0) + 1
    # (d) ref counts; no live block unreachable from a sequence (no leaked blocks)
    assert {idx: state.block(idx).ref_count for idx in live} == expected_refs
    # (c) every page is either free or owned by exactly one live block
    owned = [p for idx in live for p in state.block(idx).page_ids]
    free = list(state.free_page_ids())
    assert len(owned) + len(free) == state.num_pages
    assert sorted(owned + free) == list(range(state.num_pages))
    assert state.total_sequence_length() == sum(map(len, model.tokens.values()))


def random_length(rng: random.Random, current: int) -> int:
    """An append length, often one that ends the sequence on a page boundary."""
    return rng.choice([1, 1, 2, rng.randint(1, 40), PS - current % PS, 2 * PS - current % PS])


def op_add(rng: random.Random, model: Model, id_pool: list[int]) -> None:
    seq_id = rng.choice(id_pool)
    if seq_id in model.tokens:
        assert_rejected(model.state, SequenceError, "already in", model.state.add_sequence, seq_id)
        return
    model.state.add_sequence(seq_id)
    model.tokens[seq_id] = []


def op_append(rng: random.Random, model: Model, _id_pool: list[int]) -> None:
    state = model.state
    seq_ids = rng.sample(list(model.tokens), rng.randint(1, len(model.tokens)))
    lengths = [random_length(rng, len(model.tokens[s])) for s in seq_ids]
    if expected_pages(state, seq_ids, lengths) > state.num_free_pages:
        assert_rejected(state, CacheFullError, "full", state.reserve_append, seq_ids, lengths)
    else:
        model.append(seq_ids, lengths)


def op_fork(rng: random.Random, model: Model, id_pool: list[int]) -> None:
    state = model.state
    free_ids = [i for i in id_pool if i not in model.tokens]
    if not free_ids:
        return
    parent, child = rng.choice(list(model.tokens)), rng.choice(free_ids)
    length = len(model.tokens[parent])
    pos = rng.choice([-1, length, rng.randint(0, length), (length // PS) * PS])
    before = state.debug_snapshot()
    try:
        copies = state.fork_sequence(parent, child, pos)
    except CacheFullError:
        assert state.debug_snapshot() == before and state.num_free_pages == 0
        return
    model.apply_copies(copies)
    model.tokens[child] = model.tokens[parent][: length if pos == -1 else pos]


def op_popn(rng: random.Random, model: Model, _id_pool: list[int]) -> None:
    state = model.state
    seq_id = rng.choice(list(model.tokens))
    length = len(model.tokens[seq_id])
    n = min(length, rng.choice([0, 1, length, rng.randint(0, length)]))
    before = state.debug_snapshot()
    try:
        copies = state.popn(seq_id, n)
    except CacheFullError:
        assert state.debug_snapshot() == before
        return
    model.apply_copies(copies)
    del model.tokens[seq_id][length - n :]


def op_remove(rng: random.Random, model: Model, _id_pool: list[int]) -> None:
    seq_id = rng.choice(list(model.tokens))
    model.state.remove_sequence(seq_id)
    del model.tokens[seq_id]


RANDOM_OPS = [op_add, op_append, op_append, op_append, op_fork, op_fork, op_popn, op_remove]


def random_invalid_op(rng: random.Random, model: Model) -> None:
    state = model.state
    live = list(model.tokens)
    unknown = max(model.tokens, default=0) + 1000
    cases = [(SequenceError, "not in the cache", state.remove_sequence, unknown)]
    if live:
        seq_id = rng.choice(live)
        length = len(model.tokens[seq_id])
        ones = [1] * len(live)
        cases += [
            (SequenceError, "out of range", state.fork_sequence, seq_id, unknown, length + 1),
            (SequenceError, "cannot pop", state.popn, seq_id, length + 1),
            (SequenceError, "append length 0", state.reserve_append, live, ones[1:] + [0]),
            (SequenceError, "more than once", state.reserve_append, live + [seq_id], ones + [1]),
            (SequenceError, "not in the cache", state.reserve_append, live + [unknown], ones + [1]),
            (KVCacheError, "must be an int", state.popn, seq_id, 1.0),
        ]
    exc, match, fn, *args = rng.choice(cases)
    assert_rejected(state, exc, match, fn, *args)


@pytest.mark.parametrize("seed", range(24))
def test_random_operations_against_model(seed):
    rng = random.Random(seed)
    state = PagingState(rng.choice([4, 10, 24, 64]), PS)
    model = Model(state)
    id_pool = rng.sample(range(-50, 50), 10)
    for _ in range(120):
        op = rng.choice(RANDOM_OPS) if model.tokens else op_add
        op(rng, model, id_pool)
        if rng.random() < 0.15:
            random_invalid_op(rng, model)
        check_invariants(model)
    for seq_id in rng.sample(list(model.tokens), len(model.tokens)):
        state.remove_sequence(seq_id)
        del model.tokens[seq_id]
        check_invariants(model)
    assert state.empty() and state.num_free_pages == state.num_pages  # (e)


# ------------------------------------------------------------ differential test vs TVM


class TvmCache:
    """TVM's native C++ paged KV cache on CPU; callbacks record page copies and position maps."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        tvm = pytest.importorskip("tvm")
        self.tvm = tvm
        self.copies: list[PageCopy] = []
        self.pos_map: np.ndarray | None = None

        def copy_single_page(_pages, src, dst, length):
            self.copies.append(PageCopy(int(src), int(dst), int(length)))

        def debug_get_kv(_pages, pos_map, _k, _v, _layer):
            self.pos_map = pos_map.numpy().copy()

        def noop(*_args):
            pass

        shape = tvm.runtime.ShapeTuple
        create = tvm.get_global_func("vm.builtin.paged_attention_kv_cache_create")
        config = shape([64, (num_pages - 1) * page_size, 1 << 16, page_size, 0])
        init = tvm.runtime.tensor(np.zeros((1,), "float32"))
        self.cache = create(
            config, shape([0, 1]), 1, 1, 4, 4, shape([0]), False, 0, 1.0, 1e4, None, init,
            noop, None, [], [], [], [], [], [], [], [], [noop, noop], noop,
            copy_single_page, debug_get_kv, noop,
        )

    def call(self, name: str, *args):
        return self.tvm.get_global_func("vm.builtin." + name)(self.cache, *args)

    def append(self, seq_ids: list[int], lengths: list[int]) -> None:
        shape = self.tvm.runtime.ShapeTuple
        self.call("kv_state_begin_forward", shape(seq_ids), shape(lengths))
        self.call("kv_state_end_forward")

    def position_map(self, seq_id: int, length: int) -> list[int]:
        data = self.tvm.runtime.tensor(np.zeros((1, length, 1, 4), "float32"))
        self.call("attention_kv_cache_debug_get_kv", seq_id, 0, length, data, data)
        return self.pos_map.tolist()

    def take_copies(self) -> list[PageCopy]:
        copies, self.copies = self.copies, []
        return copies


def make_tvm_cache(num_pages: int) -> TvmCache:
    try:
        return TvmCache(num_pages, PS)
    except Exception as err:  # noqa: BLE001 - a TVM build without this runtime
        pytest.skip(f"TVM's native paged KV cache is unavailable: {err}")


class Twin:
    """A `PagingState` and TVM's native cache driven with the same valid operations."""

    def __init__(self, rng: random.Random, num_pages: int) -> None:
        self.rng = rng
        self.tvm = make_tvm_cache(num_pages)
        self.state = PagingState(num_pages, PS)
        self.lengths: dict[int, int] = {}
        self.next_id = 0

    def add(self) -> None:
        self.state.add_sequence(self.next_id)
        self.tvm.call("kv_state_add_sequence", self.next_id)
        self.lengths[self.next_id] = 0
        self.next_id += 1

    def append(self) -> None:
        live = list(self.lengths)
        seq_ids = self.rng.sample(live, self.rng.randint(1, min(4, len(live))))
        lengths = [random_length(self.rng, self.lengths[s]) for s in seq_ids]
        if expected_pages(self.state, seq_ids, lengths) > self.state.num_free_pages:
            return
        self.state.reserve_append(seq_ids, lengths)
        self.tvm.append(seq_ids, lengths)
        for seq_id, length in zip(seq_ids, lengths):
            self.lengths[seq_id] += length

    def fork(self) -> None:
        parent = self.rng.choice(list(self.lengths))
        length = self.lengths[parent]
        pos = self.rng.choice([-1, length, self.rng.randint(0, length)])
        if self.state.num_free_pages == 0:  # TVM could fail half-way
            return
        copies = self.state.fork_sequence(parent, self.next_id, pos)
        self.tvm.call("kv_state_fork_sequence", parent, self.next_id, pos)
        assert copies == self.tvm.take_copies()
        self.lengths[self.next_id] = length if pos == -1 else pos
        self.next_id += 1

    def popn(self) -> None:
        seq_id = self.rng.choice(list(self.lengths))
        n = self.rng.randint(0, self.lengths[seq_id])
        if self.state.num_free_pages == 0:  # TVM could fail half-way
            return
        copies = self.state.popn(seq_id, n)
        self.tvm.call("kv_state_popn", seq_id, n)
        assert copies == self.tvm.take_copies()
        self.lengths[seq_id] -= n

    def remove(self, seq_id: int | None = None) -> None:
        seq_id = self.rng.choice(list(self.lengths)) if seq_id is None else seq_id
        self.state.remove_sequence(seq_id)
        self.tvm.call("kv_state_remove_sequence", seq_id)
        del self.lengths[seq_id]

    def check(self) -> None:
        state, tvm = self.state, self.tvm
        assert state.num_free_pages == tvm.call("attention_kv_cache_get_num_available_pages")
        total = tvm.call("attention_kv_cache_get_total_sequence_length")
        assert state.total_sequence_length() == total
        assert state.empty() == bool(tvm.call("attention_kv_cache_empty"))
        for seq_id, length in self.lengths.items():
            if length:
                assert pm(state, seq_id) == tvm.position_map(seq_id, length), seq_id


@pytest.mark.tvm_native
@pytest.mark.parametrize("seed", range(6))
def test_matches_tvm_native_cache(seed):
    rng = random.Random(seed)
    twin = Twin(rng, num_pages=48)
    ops = [twin.add, twin.append, twin.append, twin.fork, twin.fork, twin.popn, twin.remove]
    for _ in range(150):
        (rng.choice(ops) if twin.lengths else twin.add)()
        twin.check()
    for seq_id in list(twin.lengths):
        twin.remove(seq_id)
        twin.check()
    assert twin.state.empty()
