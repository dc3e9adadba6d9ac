"""Model-based property test of the whole cache (hypothesis ``RuleBasedStateMachine``).

Random sequences of operations, valid and invalid, run against a small cache (4-token pages, 13
pages, or 21 with per-sequence sliding windows) so that running out of pages is common: batches
that run out halfway, forks and pops that need a page when none is free. Token trees
(speculative decoding): tree steps (plain cache; the sliding cache must reject them) and
``commit_accepted_token_tree_nodes``, valid and invalid. The operations, the
model and the checks live in ``state_machine_model`` (shared with ``benchmarks/soak.py``); see its
docstring. After every operation:

* an error is a `KVCacheError` the model allowed, and the cache is exactly as before it: paging
  snapshot, every page's bytes, every sequence's ``debug_get_kv`` K/V, free pages, step state;
* on success, every sequence's length, block starts, window, K/V (``debug_get_kv``, exact) and
  the attention outputs of forward steps (float64 reference) match the model;
* paging invariants (`check_paging_invariants`):

  - every page id in ``[0, num_pages)`` is either in the free list or in the ``page_ids`` of exactly
    one live block, never both, never neither; ``free + owned == num_pages``;
  - ownership rule (``paging/block_pool.py``): a live block's ``ref_count`` equals the number of
    live blocks whose ``parent`` it is plus the number of sequences whose ``last_block`` it is;
    every live block is reachable from some sequence's last block (no leaked blocks); free and
    live block indices partition ``range(num_blocks)``;
  - per sequence: ``seq_length`` is the sum of its blocks' lengths; each block starts where its
    ancestors end; its last block has ``ref_count == 1``; prefix blocks hold whole, unslid pages;
    each block holds ``ceil((length - sink + window_offset) / page_size)`` pages;
  - sequences that share a prefix (forks, whole pages) map it to the same slots;
  - ``empty()`` is true exactly when no sequence is left; the teardown removes every sequence and
    checks that ``empty()`` holds and every page is free.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

import state_machine_model as sm


class HypothesisDraw(sm.Draw):
    def __init__(self, data) -> None:
        self.data = data

    def integer(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi))

    def choice(self, options):
        return self.data.draw(st.sampled_from(list(options)))


class PlainCacheMachine(RuleBasedStateMachine):
    """Operations on a cache without sliding windows (repeated decode steps take the fast path)."""

    kind = "plain"

    def __init__(self) -> None:
        super().__init__()
        self.h: sm.Harness = None  # type: ignore[assignment]
        self.clean = False

    @initialize(seed=st.integers(0, 2**32 - 1), lengths=st.lists(st.integers(1, 8), min_size=1, max_size=4))
    def start(self, seed: int, lengths) -> None:
        """A fresh cache with a few sequences prefilled (so that runs start from a useful state)."""
        self.h = sm.Harness(self.kind, seed)
        for seq_id in range(len(lengths)):
            assert self.h.add(seq_id)
        assert self.h.step(list(range(len(lengths))), lengths)
        self.clean = True

    def has_sequences(self) -> bool:
        return bool(self.h.model.seqs)

    def _do(self, op, data) -> None:
        self.clean = False  # a failing operation leaves it False: the teardown then checks nothing
        op(self.h, HypothesisDraw(data))
        self.clean = True

    @rule(data=st.data())
    def add_sequence(self, data):
        self._do(sm.op_add, data)

    @precondition(has_sequences)
    @rule(data=st.data())
    def remove_sequence(self, data):
        self._do(sm.op_remove, data)

    @precondition(has_sequences)
    @rule(data=st.data())
    def fork_sequence(self, data):
        self._do(sm.op_fork, data)

    @precondition(has_sequences)
    @rule(data=st.data())
    def popn(self, data):
        self._do(sm.op_popn, data)

    @precondition(has_sequences)
    @rule(data=st.data())
    def forward_step(self, data):
        self._do(sm.op_step, data)

    @precondition(has_sequences)
    @rule(data=st.data())
    def repeat_decode(self, data):
        self._do(sm.op_repeat_decode, data)

    @precondition(has_sequences)
    @rule(data=st.data())
    def enable_sliding_window(self, data):
        self._do(sm.op_enable_window, data)

    @precondition(has_sequences)
    @rule(data=st.data())
    def token_tree_step(self, data):
        """A step with token trees (speculative decoding); the sliding cache rejects trees."""
        self._do(sm.op_tree_step, data)

    @rule(data=st.data())
    def commit_accepted_nodes(self, data):
        """commit_accepted_token_tree_nodes, valid or not (without a tree step: "already committed",
        or with leaf -1 the last step popped)."""
        self._do(sm.op_commit, data)

    @precondition(has_sequences)
    @rule(data=st.data())
    def checkpoint_round_trip(self, data):
        """Save a sequence and import it into another id (new or existing)."""
        self._do(sm.op_checkpoint, data)

    @rule(data=st.data())
    def invalid_request(self, data):
        self._do(sm.op_invalid, data)

    def teardown(self) -> None:
        if self.h is not None and self.clean:
            self.h.remove_all(sorted(self.h.model.seqs, key=lambda s: (s * 7919) % 13))


class SlidingCacheMachine(PlainCacheMachine):
    """The same on a cache whose sequences slide once a window is enabled."""

    kind = "sliding"


class ChunkedCacheMachine(PlainCacheMachine):
    """The same on a cache whose first layer is chunked local attention (Llama 4 style)."""

    kind = "chunked"


class Fp8CacheMachine(PlainCacheMachine):
    """The same on a cache over 8-bit pages (K / V on the 8-bit grid: stored exactly)."""

    kind = "fp8"


class PrefixCacheMachine(PlainCacheMachine):
    """The plain cache with prefix caching: prompts often share a stem, so sequences start on
    cached pages; K / V depend only on a token and its position (see ``state_machine_model``)."""

    kind = "prefix"


_SETTINGS = settings(max_examples=80, stateful_step_count=50, deadline=None, derandomize=True, database=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

TestPlainCache = PlainCacheMachine.TestCase
TestPlainCache.settings = _SETTINGS
TestSlidingCache = SlidingCacheMachine.TestCase
TestSlidingCache.settings = _SETTINGS
TestChunkedCache = ChunkedCacheMachine.TestCase
TestChunkedCache.settings = settings(_SETTINGS, max_examples=40)
TestFp8Cache = Fp8CacheMachine.TestCase
TestFp8Cache.settings = settings(_SETTINGS, max_examples=40)
TestPrefixCache = PrefixCacheMachine.TestCase
TestPrefixCache.settings = settings(_SETTINGS, max_examples=30)
