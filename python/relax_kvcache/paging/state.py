"""`PagingState`: sequences, the block tree and the page pool of a paged KV cache.

TVM's C++ bookkeeping (same page and block ids), each operation checked whole before anything
changes (docs/compatibility.md lists the differences). KV data is never touched: partial pages
to copy are returned as `PageCopy` records.
"""

from __future__ import annotations

import collections.abc
import copy
import dataclasses

import numpy as np

from ..errors import ConfigError, KVCacheError, SequenceError
from . import appends, decode_lane
from ._checks import as_int, as_seq_id, ceil_div, check_pop_length
from .block_pool import Block
from .decode_lane import DecodeLane
from .host_tier import HostTier
from .prefix import PrefixIndex, PrefixStats, check_salt, check_token_ids
from .prefix_cache import PrefixCache
from .sequences import Sequence
from .tree import BlockTree, PageCopy

__all__ = ["PageCopy", "PagingState"]

_INT32_MAX = 2**31 - 1


class PagingState:
    """Paging bookkeeping of a paged KV cache, over ``num_pages`` pages of ``page_size``
    tokens. ``slide_windows`` (TVM's ``support_sliding_window_``): whether sequences with a
    window really slide, or are only marked; ``prefix_caching``: whether full pages are kept and
    reused by their token ids (`paging.prefix`); ``host_pages``: host slots that keep evicted
    cached pages (`paging.host_tier`; the copies are left to the caller, `take_host_moves`)."""

    def __init__(self, num_pages: int, page_size: int, *, slide_windows: bool = False,
                 prefix_caching: bool = False, host_pages: int = 0) -> None:
        num_pages = as_int("number of pages", num_pages)
        page_size = as_int("page size", page_size)
        if num_pages < 0 or page_size < 1:
            raise ConfigError(f"expected num_pages >= 0 and page_size >= 1, got {num_pages} and "
                              f"{page_size}")
        if num_pages * page_size > _INT32_MAX:
            raise ConfigError(f"num_pages * page_size = {num_pages * page_size} exceeds the int32 "
                              "slot range")
        host_pages = as_int("host pages", host_pages)
        if host_pages < 0 or (host_pages and not prefix_caching):
            raise ConfigError(f"host pages must be >= 0, and 0 without prefix caching; got {host_pages}")
        self._page_size = page_size
        index = PrefixIndex(page_size) if prefix_caching else None
        self._host = HostTier(host_pages, index.stats) if host_pages else None  # type: ignore[union-attr]
        self._tree = BlockTree(num_pages, page_size, index, self._host)
        self._prefix = None if index is None else PrefixCache(self._tree, index, self._host)
        self._pages, self._blocks = self._tree.pages, self._tree.blocks
        self._seqs: dict[int, Sequence] = {}
        self._slide_windows = bool(slide_windows)
        self._num_windowed = 0  # live sequences with a window: 0 keeps the fast append path
        self._version = 0  # bumped by every change; a DecodeLane is valid at one version
        self._lagging: DecodeLane | None = None  # a lane whose last tokens are not in its lengths yet

    # ------------------------------------------------------------------ queries

    @property
    def num_pages(self) -> int:
        return self._pages.num_pages

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def slide_windows(self) -> bool:
        return self._slide_windows

    @property
    def version(self) -> int:  # incremented by every change
        return self._version

    @property
    def num_free_pages(self) -> int:
        """Pages available to new tokens (free, and cached ones no sequence holds)."""
        return self._pages.num_free

    @property
    def prefix_caching(self) -> bool:
        return self._prefix is not None

    def prefix_stats(self) -> tuple[PrefixStats, int, int, int]:
        """Prefix caching's counters, the registered pages, the cached pages no sequence
        holds and the pages on the host (prefix caching only)."""
        assert self._prefix is not None
        host = 0 if self._host is None else len(self._host)
        return self._prefix.stats, len(self._prefix.index), self._pages.num_cached, host

    def host_pages(self) -> list[tuple[int, object]]:
        """(host slot, `paging.prefix.PageEntry`) of every page on the host tier."""
        return [] if self._host is None else self._host.items()

    def take_host_moves(self) -> list:
        """The page copies between device and host (`paging.host_tier.HostMove`) that the
        operations since the last call need, in the order they must run: before any kernel
        reads or writes the pages again."""
        return [] if self._host is None else self._host.take_moves()

    def registered_pages(self) -> list[tuple[int, object]]:
        """(page, `paging.prefix.PageEntry`) of every registered page (empty without prefix
        caching)."""
        return [] if self._prefix is None else self._prefix.index.items()

    def free_page_ids(self) -> tuple[int, ...]:
        """The free page stack, bottom first (the last entry is allocated next)."""
        return self._pages.free_page_ids()

    def has_sequence(self, seq_id: int) -> bool:
        return as_seq_id(seq_id) in self._seqs

    def sequence(self, seq_id: int) -> Sequence:
        """The live record of sequence ``seq_id`` (read it, do not modify it)."""
        return self._seq(seq_id)

    def sequence_length(self, seq_id: int) -> int:
        return self._seq(seq_id).seq_length

    def seq_ids(self) -> list[int]:
        """The ids of the live sequences, in insertion order."""
        return list(self._seqs)

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    def total_sequence_length(self) -> int:
        self._settle()
        return sum(seq.seq_length for seq in self._seqs.values())

    def block(self, idx: int) -> Block:
        """Live block ``idx`` (a live object: read it, do not modify it)."""
        self._settle()
        return self._blocks.get(as_int("block index", idx))

    def block_trace(self, seq_id: int) -> list[int]:
        """The block indices of sequence ``seq_id``, root first (TVM's ``GetBlockTrace``)."""
        return [block.index for block in self.trace_blocks(seq_id)]

    def trace_blocks(self, seq_id: int) -> list[Block]:
        """The blocks of sequence ``seq_id``, root first (live objects: read, do not modify)."""
        return self._tree.trace_blocks(self._seq(seq_id).last_block)

    def trace_batch(self, seq_ids: collections.abc.Sequence[int]) -> tuple[list[list[Block]], tuple[int, ...]]:
        """`trace_blocks` and the length of each sequence of ``seq_ids``."""
        seqs = [self._seq(seq_id) for seq_id in seq_ids]
        trace = self._tree.trace_blocks
        return [trace(seq.last_block) for seq in seqs], tuple(seq.seq_length for seq in seqs)

    def empty(self) -> bool:
        """Whether no sequence, block or page is in use (TVM's ``Empty``)."""
        return not self._seqs and self._blocks.all_free() and self._pages.num_free == self.num_pages

    def position_map(self, seq_id: int, start: int = 0, end: int | None = None) -> np.ndarray:
        """int32 KV slots of the positions ``[start, end)`` (TVM's ``DebugGetKV`` map)."""
        seq = self._seq(seq_id)
        start = as_int("start position", start)
        end = seq.seq_length if end is None else as_int("end position", end)
        if not 0 <= start <= end <= seq.seq_length:
            raise SequenceError(f"position range [{start}, {end}) is invalid for sequence "
                                f"{seq.seq_id}: expected 0 <= start <= end <= {seq.seq_length}")
        return self._tree.slots(seq, start, end)

    def debug_snapshot(self) -> dict[str, object]:
        """A deep, plain-data copy of the whole state (for tests and debugging)."""
        self._settle()
        live = self._blocks.live_indices()
        return {
            "free_pages": self._pages.free_page_ids(),
            "free_blocks": self._blocks.free_block_indices(),
            "num_blocks": len(self._blocks),
            "blocks": {i: dataclasses.astuple(self._blocks[i]) for i in live},
            "sequences": tuple((k, dataclasses.astuple(s)) for k, s in self._seqs.items()),
            "cached_pages": self._pages.cached_page_ids(),
            "registered": tuple(self.registered_pages()),
            "host": tuple(self.host_pages()),
        }

    # ------------------------------------------------------------- mutations

    def clear(self) -> None:
        """Drop every sequence and block and free every page (TVM's ``Clear``)."""
        self._settle()
        self._version += 1
        self._seqs.clear()
        self._num_windowed = 0
        self._pages.reset()
        self._blocks.reset()

    def add_sequence(self, seq_id: int, token_ids: object = None, salt: object = None) -> int:
        """Add sequence ``seq_id`` (new) with a fresh root block (``AddSequence``). With prefix
        caching and ``token_ids`` (its prompt), the block starts with the cached pages of the
        prompt's leading full pages (not its last token); returns the tokens it holds."""
        seq_id = self._check_absent(seq_id)
        ids = None
        if self._prefix is not None:
            salt = check_salt(salt)
            ids = None if token_ids is None else check_token_ids("token_ids", token_ids)
        self._version += 1
        self._insert_sequence(seq_id, self._blocks.new_block(), 0)
        if self._prefix is None:
            return 0
        return self._prefix.attach(self._seqs[seq_id], ids, salt)

    def record_tokens(self, seq_ids: collections.abc.Sequence[int], lengths: collections.abc.Sequence[int],
                      token_ids: list[int] | None) -> None:
        """After a step appended ``lengths[i]`` tokens to ``seq_ids[i]`` with ids ``token_ids``
        (all of them, in batch order; None: unknown), register the pages they filled (prefix
        caching; nothing otherwise)."""
        if self._prefix is None:
            return
        self._settle()
        at = 0
        for seq_id, n in zip(seq_ids, lengths):
            ids = None if token_ids is None else token_ids[at:at + n]
            self._prefix.record(self._seqs[seq_id], n, ids)
            at += n

    def remove_sequence(self, seq_id: int) -> None:
        """Remove a sequence (``RemoveSequence``), freeing the blocks only it references."""
        seq = self._seq(seq_id)
        self._version += 1
        self._tree.release_path(seq.last_block)
        del self._seqs[seq.seq_id]
        if seq.sliding_window_size != -1:
            self._num_windowed -= 1

    def enable_sliding_window(self, seq_id: int, window_size: int, sink_size: int) -> None:
        """Give sequence ``seq_id`` a sliding window (TVM's ``EnableSlidingWindowForSeq``);
        earlier blocks cannot slide and count as sink."""
        seq = self._seq(seq_id)
        prefix = seq.seq_length - self._blocks[seq.last_block].seq_length
        window_size, sink_size = appends.check_window(
            seq, window_size, sink_size, prefix, self._slide_windows
        )
        if self._prefix is not None and self._slide_windows:
            self._prefix.check_window(seq)
        self._version += 1
        if self._slide_windows:
            seq.tokens = None  # slid pages do not hold a prefix
        seq.attn_sink_size = sink_size
        seq.sliding_window_size = window_size
        self._tree.recompute_last_sink(seq)
        self._num_windowed += 1

    def fork_sequence(self, parent_id: int, child_id: int, fork_pos: int = -1) -> list[PageCopy]:
        """Create ``child_id`` sharing the first ``fork_pos`` tokens (-1: all) of ``parent_id``
        (TVM's ``ForkSequence``); returns the partial page to copy, if any."""
        parent = self._seq(parent_id)
        child_id = self._check_absent(child_id)
        pos = self._tree.fork_position(parent, fork_pos)
        if self._tree.fork_copy_length(parent, pos) > 0:
            self._tree.check_free_pages(1, 0, f"fork sequence {parent.seq_id} at position {pos}")
        self._version += 1
        child_block, copies = self._tree.fork_blocks(parent, pos)
        self._insert_sequence(child_id, child_block, pos)
        if self._prefix is not None:
            self._seqs[child_id].tokens = self._prefix.forked_log(parent, pos)
        return copies

    def popn(self, seq_id: int, n: int) -> list[PageCopy]:
        """Drop the last ``n`` tokens of sequence ``seq_id`` (TVM's ``PopN``): unshared blocks are
        trimmed, then a shared prefix is re-forked (its partial page returned, as a fork's)."""
        seq = self._seq(seq_id)
        n = check_pop_length(seq, n)
        if n == 0:
            return []
        plan = self._tree.plan_pop(seq, n)
        if plan.remaining:
            self._tree.check_pop_fork(seq, plan)
        new_length = seq.seq_length - n
        shared_page = -1
        if self._prefix is not None:
            shared_page, freed = self._prefix.pop_copy_needed(seq, plan, new_length)
            if shared_page != -1 and self._pages.refs(shared_page) > 1:
                self._tree.check_free_pages(1, freed, f"pop {n} tokens from sequence {seq.seq_id} (its last page "
                                            "is shared and is copied)")
        self._version += 1
        self._tree.apply_trim(seq, plan)
        left_of_last_step = max(0, seq.last_append_length - n)  # what commit's leaf -1 would pop
        seq.last_append_length = left_of_last_step
        copies = self._refork(seq, seq.seq_length - plan.remaining) if plan.remaining else []
        seq = self._seqs[seq.seq_id]
        seq.last_append_length = left_of_last_step
        if self._prefix is not None:
            copies += self._prefix.after_pop(seq, shared_page, new_length)
        return copies

    def check_pops(self, pops: list[tuple[int, int]]) -> None:
        """Raise what ``popn(seq_id, n)`` for each pair, in order, would raise; change nothing
        (a batch with a re-forking pop is tried on a copy)."""
        refork = False
        for seq_id, n in pops:
            seq = self._seq(seq_id)
            n = check_pop_length(seq, n)
            refork = refork or (n > 0 and self._tree.plan_pop(seq, n).remaining > 0)
        if refork and len(pops) > 1:
            trial = copy.deepcopy(self)
            for seq_id, n in pops:
                trial.popn(seq_id, n)
        elif refork:
            seq = self._seq(pops[0][0])
            self._tree.check_pop_fork(seq, self._tree.plan_pop(seq, pops[0][1]))

    def reserve_append(
        self, seq_ids: collections.abc.Sequence[int], lengths: collections.abc.Sequence[int]
    ) -> tuple[int, ...]:
        """Make room for ``lengths[i]`` new tokens of each sequence ``seq_ids[i]`` (TVM's
        ``ReserveAppendLengthInSeq`` and ``SlideWindowForSequence``, in batch order); returns
        the pages that slid out of a window and were handed to new tokens of the batch."""
        self._settle()
        items, total = appends.plan(self._seqs, self._tree, seq_ids, lengths, self._seq)
        if self._num_windowed and self._slide_windows:
            plans = appends.plan_sliding(items, self._pages, self._page_size)
            self._version += 1
            return appends.apply_sliding(items, plans, self._pages)
        self._tree.check_free_pages(total, 0, f"append to {len(items)} sequence(s)")
        self._version += 1
        appends.apply(items, self._pages.allocate(total))
        return ()

    def import_sequence(self, seq_id: int, length: int) -> np.ndarray:
        """Give sequence ``seq_id`` (new, or empty without a window, tree or fork) ``length``
        tokens on fresh pages for a checkpoint import; their int32 slots."""
        self._settle()
        seq_id, length = as_seq_id(seq_id), as_int("length", length)
        if length < 0:
            raise SequenceError(f"a sequence cannot hold {length} tokens; expected at least 0")
        seq = self._seqs.get(seq_id)
        if seq is not None:
            if seq.seq_length or seq.sliding_window_size != -1 or seq.token_tree is not None:
                window = " and a sliding window" if seq.sliding_window_size != -1 else ""
                raise SequenceError(f"sequence {seq_id} has {seq.seq_length} token(s){window}; a "
                                    "checkpoint imports into a new or empty sequence, no window")
            self._tree.appendable_block(seq)
        pages = ceil_div(length, self._page_size)
        self._tree.check_free_pages(pages, 0, f"import {length} token(s) into sequence {seq_id}")
        if seq is None:
            self.add_sequence(seq_id)
        if length:
            self.reserve_append([seq_id], [length])
        self._seqs[seq_id].last_append_length = 0
        self._seqs[seq_id].tokens = None  # its token ids are unknown: it does not register pages
        return self.position_map(seq_id)

    def open_lane(self, seq_ids: collections.abc.Sequence[int], fresh: bool = False) -> DecodeLane | None:
        """Snapshot a decode batch for `advance_lane`, or None (see `decode_lane.open_lane`)."""
        self._settle()
        return decode_lane.open_lane(self._seqs, self._blocks, self._page_size, self._version,
                                     seq_ids, fresh)

    def advance_lane(self, lane: DecodeLane) -> tuple[collections.abc.Sequence[int], list[int]]:
        """Append one token to every sequence of ``lane`` (`reserve_append` with lengths 1);
        the rows whose last block took a page and those pages."""
        if lane.version != self._version:
            raise KVCacheError(f"decode lane is stale: opened at state version {lane.version}, the "
                               f"state is at version {self._version}; open a new lane")
        full = lane.fills.get(lane.steps, ())  # last blocks needing a page now
        if full and len(full) > self._pages.num_free:
            self._tree.check_free_pages(len(full), 0, f"append to {len(lane.seq_ids)} sequence(s)")  # raises
        if self._lagging is not lane:  # the lengths catch up when the state is next read (`_settle`)
            self._settle()
            self._lagging = lane
        self._version += 1
        return full, decode_lane.advance(lane, full, self._pages, self._page_size, self._version)

    def set_token_tree(self, seq_id: int, tree: object) -> None:
        """Record the uncommitted token tree of ``seq_id`` (opaque here)."""
        seq = self._seq(seq_id)
        self._version += 1
        seq.token_tree = tree
        seq.accepted_indices_committed = False

    def clear_token_tree(self, seq_id: int) -> None:
        """Mark the tree of ``seq_id`` committed (a later commit with leaf -1 pops nothing)."""
        seq = self._seq(seq_id)
        self._version += 1
        seq.token_tree = None
        seq.accepted_indices_committed = True
        seq.last_append_length = 0

    # ------------------------------------------------------------- internals

    def _settle(self) -> None:
        """Add the tokens the lagging lane appended to its sequences' and blocks' lengths."""
        lane, self._lagging = self._lagging, None
        if lane is not None:
            decode_lane.settle(lane)

    def _seq(self, seq_id: object) -> Sequence:
        if self._lagging is not None:
            self._settle()
        seq = self._seqs.get(seq_id) if type(seq_id) is int else None
        if seq is None:
            seq_id = as_seq_id(seq_id)
            seq = self._seqs.get(seq_id)
            if seq is None:
                raise SequenceError(f"sequence {seq_id} is not in the cache")
        return seq

    def _check_absent(self, seq_id: object) -> int:
        self._settle()
        seq_id = as_seq_id(seq_id)
        if seq_id in self._seqs:
            raise SequenceError(f"sequence {seq_id} is already in the cache")
        return seq_id

    def _insert_sequence(self, seq_id: int, last_block: int, seq_length: int) -> None:
        self._blocks.retain(last_block)
        self._seqs[seq_id] = Sequence(seq_id, last_block, seq_length)

    def _refork(self, seq: Sequence, pos: int) -> list[PageCopy]:
        """Replace ``seq`` by a fork of its own prefix of length ``pos`` (PopN's fallback)."""
        child_block, copies = self._tree.fork_blocks(seq, pos)
        self._blocks.retain(child_block)
        self._tree.release_path(seq.last_block)
        fresh = Sequence(seq.seq_id, child_block, pos, sliding_window_size=seq.sliding_window_size,
                         attn_sink_size=seq.attn_sink_size, tokens=seq.tokens)
        self._seqs[seq.seq_id] = fresh
        self._tree.recompute_last_sink(fresh)  # the window is kept (see popn)
        return copies
