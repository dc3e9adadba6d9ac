"""Model, invariants and random operation mix shared by ``test_property.py`` and ``benchmarks/soak.py``.

A `Harness` drives one small `PagedAttentionKVCache` (4-token pages, a few dozen pages, so the cache
runs out of pages often) and a pure-Python `Model` of what the cache should hold. Every operation
(``add``, ``remove``, ``fork``, ``popn``, ``enable_window``, ``step``) first derives from the model
what must happen (`Expect`): succeed, raise one of some error types, or (where the model cannot
tell exactly, see below) either. Then it runs the operation and checks:

* an operation that raises raises a `KVCacheError` subclass it was allowed to, and leaves the cache
  exactly as it was: the paging state (``debug_snapshot``), every page's bytes in every layer, the
  K/V of every sequence read with ``debug_get_kv``, the free page count and whether a step is active;
* an operation that succeeds changes the model the same way; a forward step's attention outputs
  match a float64 reference (``reference_model.attend``) over the model's tokens;
* after every operation, `check_paging_invariants` and `check_against_model` hold.

The model, per sequence: its K/V tokens as stored (RoPE NONE, so K is stored as given), the start
positions of the blocks of its path in the prefix tree (``bounds``: derived from the fork/pop rules,
compared with the cache's block trace), its sliding window and the sink of its last block, and per
pair of sequences the length of the prefix they physically share (whole pages, set by forks). The
model predicts every error exactly except the page needs of sequences that have slid (their pages
depend on the window offset): a batch with a sliding sequence must succeed when the pages it could
need at most are free and may raise `CacheFullError` otherwise.

Sliding-window model (caches with ``support_sliding_window``): a windowed sequence keeps its first
``sink_limit = prefix + last-block sink`` tokens (``prefix``: start of its last block; the blocks
before it cannot slide) and its most recent ``window - sink_limit`` ones; a window smaller than
``prefix`` is refused (``SequenceError``), and a step that must slide a sequence whose window is
smaller than ``sink_limit`` raises `SequenceError`; forks must be within
``sink_limit``; a fork keeps ``sink_limit`` (the last block's sink shrinks by what the fork moves into
prefix blocks); ``popn`` that frees whole blocks recomputes the last block's sink from the sink the
window was enabled with (``max(sink - prefix, 0)``), and a ``popn`` into a shared prefix re-forks the
sequence, keeping its window and sink the same way (no sink check: the re-fork is inside prefix
blocks, which never slide).

Chunked local attention (the ``chunked`` cache: layer 0 is ``MHA_CHUNKED_LOCAL`` with chunks of
``ATTENTION_CHUNK`` tokens, not a multiple of the page size): a step's token at position p of layer 0
attends to the keys at positions ``[p - p % ATTENTION_CHUNK, p]``; paging is the plain cache's.
``enable_window`` marks a sequence there without sliding it (as TVM does on caches with local
layers): the window and sink are recorded and bound forks and checkpoints as on the sliding cache,
the sequence keeps every token, and a window smaller than its prefix is accepted.

Token trees (``tree_step`` with ``token_tree_parent_ptr``, plain cache only: caches with sliding
windows or chunked layers raise `ForwardError`) and ``commit`` (``commit_accepted_token_tree_nodes``), with
``reference_model``'s semantics: a sequence's uncommitted tree nodes follow its tokens; a node attends to
the tokens before its tree, its ancestors and itself; a commit keeps, after the tokens before the
tree, the accepted path's nodes (indices in the whole tree, over all its steps) and pops the rest
(``popn`` rules; leaf -1 drops the tree, and on a committed sequence pops its last step). While a
tree is uncommitted the sequence cannot be forked, stepped without a tree, or popped
(`SequenceError`).

Modules, imported in this order (each uses only those before it): ``sm_cache`` (configs, building,
reading and snapshotting a cache, paging invariants), ``sm_model`` (`Model`, `check_against_model`),
``sm_harness`` (`Expect`, `Harness`), ``sm_ops`` (`Draw`, the ``op_*`` operations, `random_op`).
This module re-exports their names.
"""

from __future__ import annotations

from sm_cache import (ATTENTION_CHUNK, CHUNK, FP8_SCALES, HEAD_DIM, KINDS, NUM_KV_HEADS, NUM_LAYERS, NUM_QO_HEADS,
                      PAGE_SIZE, SM_SCALE, STEMS, Mismatch, assert_unchanged, check_paging_invariants, ensure,
                      make_cache, make_config, read_all_kv, read_kv, snapshot, token_kv)
from sm_model import Model, SeqModel, check_against_model
from sm_harness import Expect, Harness
from sm_ops import (ID_RANGE, OPERATIONS, UNKNOWN_IDS, Draw, NumpyDraw, draw_id, draw_length, draw_new_id,
                    draw_position, draw_tree, op_add, op_checkpoint, op_commit, op_enable_window, op_fork, op_invalid,
                    op_popn, op_remove, op_repeat_decode, op_step, op_tree_step, random_op)

__all__ = [
    "ATTENTION_CHUNK", "CHUNK", "FP8_SCALES", "HEAD_DIM", "KINDS", "NUM_KV_HEADS", "NUM_LAYERS", "NUM_QO_HEADS",
    "PAGE_SIZE", "SM_SCALE", "STEMS", "Mismatch", "assert_unchanged", "check_paging_invariants", "ensure",
    "make_cache", "make_config", "read_all_kv", "read_kv", "snapshot", "token_kv", "Model", "SeqModel",
    "check_against_model", "Expect", "Harness", "ID_RANGE", "OPERATIONS", "UNKNOWN_IDS", "Draw", "NumpyDraw",
    "draw_id", "draw_length", "draw_new_id", "draw_position", "draw_tree", "op_add", "op_checkpoint",
    "op_commit", "op_enable_window", "op_fork", "op_invalid", "op_popn", "op_remove", "op_repeat_decode",
    "op_step", "op_tree_step", "random_op"
]
