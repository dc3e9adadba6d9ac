"""`PagingState`: sequences, the block tree and the page pool of a paged KV cache.

The semantics are those of TVM's C++ ``PagedAttentionKVCacheObj`` (``AddSequence``,
``RemoveSequence``, ``ForkSequence``, ``PopN``, ``ReserveAppendLengthInSeq``,
``EnableSlidingWindowForSeq``, ``SlideWindowForSequence``, ``Empty``, ``DebugGetKV``'s position
map), including the order in which page and block ids are handed out, so page ids match TVM's
exactly. Unlike TVM, every operation validates the whole request first and raises a
`KVCacheError` subclass with the state untouched (check-then-mutate). The paging layer never
touches KV data: the partial pages to copy are returned as `PageCopy` records.

Sliding windows (StreamingLLM-style attention sinks): once a windowed sequence is longer than
its window, its last block keeps its first ``sink_length`` tokens and the most recent ones;
pages that slide out entirely return to the pool. Deliberate departures from TVM, both where
TVM's own bookkeeping would become inconsistent, are documented on `fork_sequence` and `popn`.

`PagingState` owns the sequences and checks every request; the block tree and page pool
(:mod:`.tree`), sliding windows (:mod:`.windows`), batches of appends (:mod:`.appends`) and
decode lanes (:mod:`.decode_lane`) are carried out by their own modules.
"""

from __future__ import annotations

import collections.abc
import copy
import dataclasses

import numpy as np

from ..errors import ConfigError, KVCacheError, SequenceError
from . import appends, decode_lane, windows
from ._checks import as_int, as_seq_id, ceil_div, check_append_length, check_pop_length, check_range
from .block_pool import Block
from .decode_lane import DecodeLane
from .sequences import Sequence
from .tree import BlockTree, PageCopy

__all__ = ["PageCopy", "PagingState"]

_INT32_MAX = 2**31 - 1


class PagingState:
    """Paging bookkeeping of a paged KV cache: the façade the cache uses.

    Parameters
    ----------
    num_pages : int
        Number of pages in the pool, ``>= 0``.
    page_size : int
        Tokens per page, ``>= 1``.
    slide_windows : bool
        TVM's ``support_sliding_window_``: whether sequences with a sliding window enabled
        (`enable_sliding_window`) really slide. When False they are only marked (fork is still
        restricted to their sink), as TVM does for models with per-layer sliding-window layers.

    Raises
    ------
    ConfigError
        If a parameter is out of range or ``num_pages * page_size`` exceeds the int32 range.
    """

    def __init__(self, num_pages: int, page_size: int, *, slide_windows: bool = False) -> None:
        num_pages = as_int("number of pages", num_pages)
        page_size = as_int("page size", page_size)
        if num_pages < 0 or page_size < 1:
            raise ConfigError(
                f"expected num_pages >= 0 and page_size >= 1, got {num_pages} and {page_size}"
            )
        if num_pages * page_size > _INT32_MAX:
            raise ConfigError(
                f"num_pages * page_size = {num_pages * page_size} exceeds the int32 slot range"
            )
        self._page_size = page_size
        self._tree = BlockTree(num_pages, page_size)
        self._pages, self._blocks = self._tree.pages, self._tree.blocks
        self._seqs: dict[int, Sequence] = {}
        self._slide_windows = bool(slide_windows)
        self._num_windowed = 0  # live sequences with a window: 0 keeps the fast append path
        self._version = 0  # bumped by every change; a DecodeLane is valid at one version

    # ------------------------------------------------------------------ queries

    @property
    def num_pages(self) -> int:
        """Total number of pages."""
        return self._pages.num_pages

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self._page_size

    @property
    def slide_windows(self) -> bool:
        """Whether windowed sequences slide (TVM's ``support_sliding_window_``)."""
        return self._slide_windows

    @property
    def version(self) -> int:
        """A counter that every change of the state increments."""
        return self._version

    @property
    def num_free_pages(self) -> int:
        """Number of free pages (TVM's ``GetNumAvailablePages``)."""
        return self._pages.num_free

    def free_page_ids(self) -> tuple[int, ...]:
        """Return the free page stack, bottom first (the last entry is allocated next)."""
        return self._pages.free_page_ids()

    def has_sequence(self, seq_id: int) -> bool:
        """Return True if sequence ``seq_id`` is in the cache."""
        return as_seq_id(seq_id) in self._seqs

    def sequence(self, seq_id: int) -> Sequence:
        """Return the record of sequence ``seq_id`` (live object: read it, do not modify it)."""
        return self._seq(seq_id)

    def sequence_length(self, seq_id: int) -> int:
        """Return the number of tokens of sequence ``seq_id``."""
        return self._seq(seq_id).seq_length

    def seq_ids(self) -> list[int]:
        """Return the ids of the live sequences, in insertion order."""
        return list(self._seqs)

    @property
    def num_sequences(self) -> int:
        """Number of live sequences."""
        return len(self._seqs)

    def total_sequence_length(self) -> int:
        """Return the sum of the lengths of all sequences (TVM's ``GetTotalSequenceLength``)."""
        return sum(seq.seq_length for seq in self._seqs.values())

    def block(self, idx: int) -> Block:
        """Return live block ``idx`` (live object: read it, do not modify it)."""
        return self._blocks.get(as_int("block index", idx))

    def block_trace(self, seq_id: int) -> list[int]:
        """Return the block indices of sequence ``seq_id``, root first (TVM's ``GetBlockTrace``)."""
        return self._tree.trace(self._seq(seq_id).last_block)

    def trace_blocks(self, seq_id: int) -> list[Block]:
        """Return the blocks of sequence ``seq_id``, root first (live objects: read, do not modify)."""
        return self._tree.trace_blocks(self._seq(seq_id).last_block)

    def empty(self) -> bool:
        """Return True if no sequence, block or page is in use (TVM's ``Empty``)."""
        return (
            not self._seqs
            and self._blocks.all_free()
            and self._pages.num_free == self._pages.num_pages
        )

    def pages_needed(self, seq_id: int, length: int) -> int:
        """Return the pages `reserve_append` would allocate to append ``length`` tokens.

        For a sequence that slides, this is the allocation before sliding: the slide may then
        return pages to the pool (and a full pool can lend the pages it is about to get back).

        Parameters
        ----------
        seq_id : int
            A live sequence.
        length : int
            Tokens to append, ``>= 1``.
        """
        seq = self._seq(seq_id)
        length = check_append_length(seq, length)
        return self._tree.block_pages_needed(self._blocks[seq.last_block], length)

    def position_map(self, seq_id: int, start: int = 0, end: int | None = None) -> np.ndarray:
        """Return the KV slot (``page_id * page_size + in_page_offset``) of each position.

        The mapping of TVM's ``DebugGetKV``, honouring each block's sink length and sliding
        window offset.

        Parameters
        ----------
        seq_id : int
            A live sequence.
        start, end : int
            The positions ``[start, end)``, ``0 <= start <= end <= length``; ``end`` defaults
            to the sequence length.

        Returns
        -------
        numpy.ndarray
            int32 array of ``end - start`` slots.
        """
        seq = self._seq(seq_id)
        start, end = check_range(seq, start, end)
        return self._tree.slots(seq, start, end)

    def debug_snapshot(self) -> dict[str, object]:
        """Return a deep, plain-data copy of the whole state (for tests and debugging)."""
        return {
            "free_pages": self._pages.free_page_ids(),
            "free_blocks": self._blocks.free_block_indices(),
            "num_blocks": len(self._blocks),
            "blocks": {
                i: dataclasses.astuple(self._blocks[i]) for i in self._blocks.live_indices()
            },
            "sequences": tuple((k, dataclasses.astuple(s)) for k, s in self._seqs.items()),
        }

    # ------------------------------------------------------------- mutations

    def clear(self) -> None:
        """Drop every sequence and block and free every page (TVM's ``Clear``)."""
        self._version += 1
        self._seqs.clear()
        self._num_windowed = 0
        self._pages.reset()
        self._blocks.reset()

    def add_sequence(self, seq_id: int) -> None:
        """Add an empty sequence ``seq_id`` with a fresh root block (TVM's ``AddSequence``).

        Raises
        ------
        SequenceError
            If ``seq_id`` is already in the cache.
        """
        seq_id = self._check_absent(seq_id)
        self._version += 1
        self._insert_sequence(seq_id, self._blocks.new_block(), 0)

    def remove_sequence(self, seq_id: int) -> None:
        """Remove sequence ``seq_id`` and free what no other sequence uses (``RemoveSequence``).

        Blocks referenced only by this sequence are freed walking up from its last block
        (their pages are released block by block, each in page order); the first shared
        ancestor loses one reference.

        Raises
        ------
        SequenceError
            If ``seq_id`` is not in the cache.
        """
        seq = self._seq(seq_id)
        self._version += 1
        self._tree.release_path(seq.last_block)
        del self._seqs[seq.seq_id]
        if seq.sliding_window_size != -1:
            self._num_windowed -= 1

    def enable_sliding_window(self, seq_id: int, window_size: int, sink_size: int) -> None:
        """Give sequence ``seq_id`` a sliding window (TVM's ``EnableSlidingWindowForSeq``).

        Once the sequence is longer than ``window_size`` (and the state was created with
        ``slide_windows=True``), each append keeps its first ``sink_size`` tokens and the most
        recent ``window_size - sink_size`` ones. The blocks before the last one cannot slide
        and already act as a sink: the last block's sink is ``max(sink_size - prefix, 0)``
        where ``prefix`` is their length. Whether the cache supports windows at all is the
        caller's check.

        Parameters
        ----------
        seq_id : int
            A live sequence without a window.
        window_size : int
            Tokens kept once the sequence slides, ``>= 1``.
        sink_size : int
            Attention-sink tokens, ``0 <= sink_size < window_size``.

        Raises
        ------
        SequenceError
            Unknown sequence, sizes out of range, a window already enabled, or (when windows
            slide) a window smaller than the sequence's prefix in earlier blocks.
        """
        seq = self._seq(seq_id)
        prefix = seq.seq_length - self._blocks[seq.last_block].seq_length
        window_size, sink_size = windows.check_window(seq, window_size, sink_size, prefix, self._slide_windows)
        self._version += 1
        seq.attn_sink_size = sink_size
        seq.sliding_window_size = window_size
        self._tree.recompute_last_sink(seq)
        self._num_windowed += 1

    def fork_sequence(self, parent_id: int, child_id: int, fork_pos: int = -1) -> list[PageCopy]:
        """Create ``child_id`` sharing the first ``fork_pos`` tokens of ``parent_id``.

        TVM's ``ForkSequence``. Whole shared pages are shared through the block tree; a
        partial last page is copied into a fresh page of the child. A sequence with a sliding
        window can only be forked within its sink (prefix blocks plus the last block's sink);
        the child has no window. When the fork splits the last block of such a parent, the
        parent's ``last_block_attn_sink_size`` shrinks by the tokens moved to the new shared
        block, as in TVM; if that block has already slid, its ``sink_length`` and
        ``sliding_window_offset`` shrink likewise (TVM leaves them, which corrupts the
        parent's position map). When the fork gives the parent a new empty last block
        (``fork_pos`` at its end, on a page boundary), the sink left to that block is
        ``max(last_block_attn_sink_size - old last block length, 0)``, so the sink keeps its
        size; TVM keeps ``last_block_attn_sink_size`` as it was, which enlarges the sink.

        Parameters
        ----------
        parent_id : int
            A live sequence.
        child_id : int
            A new sequence id.
        fork_pos : int
            Tokens of the parent the child starts with, ``0 <= fork_pos <= parent length``,
            or -1 for the whole parent.

        Returns
        -------
        list of PageCopy
            The partial-page copies the caller must perform (zero or one), in order.

        Raises
        ------
        SequenceError
            Unknown parent, existing child, ``fork_pos`` out of range, or past the sink of a
            windowed parent.
        CacheFullError
            The partial-page copy needs a page and none is free.
        """
        parent = self._seq(parent_id)
        child_id = self._check_absent(child_id)
        pos = self._tree.fork_position(parent, fork_pos)
        if self._tree.fork_copy_length(parent, pos) > 0:
            self._tree.check_free_pages(1, 0, f"fork sequence {parent.seq_id} at position {pos}")
        self._version += 1
        child_block, copies = self._tree.fork_blocks(parent, pos)
        self._insert_sequence(child_id, child_block, pos)
        return copies

    def popn(self, seq_id: int, n: int) -> list[PageCopy]:
        """Drop the last ``n`` tokens of sequence ``seq_id`` (TVM's ``PopN``).

        Unshared blocks are trimmed from the end. If tokens remain to pop once a shared block
        is reached, the sequence is re-forked from its own prefix of length ``length - n``
        (TVM forks a temporary sequence, removes the original and renames it). A sliding window
        is kept through the re-fork with its sink (TVM drops it, so whether a pop keeps the
        window depended on whether another sequence shared the prefix); the re-fork is inside
        the sequence's prefix blocks, which never slide, so it needs no sink check (TVM applies
        a fork's).

        Sliding windows: the trimmed block keeps
        ``ceil((seq_length - n - sink_length + sliding_window_offset) / page_size)`` pages, the
        count `reserve_append` uses, where TVM keeps ``ceil((seq_length - n) / page_size)``
        (the same unless the block has slid; after a slide TVM's count is wrong and leaves the
        position map pointing into freed pages, or keeps pages past the tokens). ``n`` may
        reach into the sink of a slid block (TVM allows ``n`` up to the sequence length): when
        the tokens left are all sink tokens (still at their original slots), the block is
        reset to an unslid one (``sink_length = sliding_window_offset = 0``, keeping
        ``ceil(remaining / page_size)`` pages); the sink is pinned again when it next slides.
        This keeps prefix blocks unslid: a fork at the end of a windowed sequence turns its
        last block into a prefix block and must be within the sink, so the block then holds
        sink tokens only, and a slid block left with sink tokens only is reset here.
        When popping frees whole blocks, the new last block's sink is recomputed from the
        sequence's ``attn_sink_size`` and its new prefix (TVM keeps the old last block's value,
        which loses the sink when the window was enabled over a longer prefix).

        Returns
        -------
        list of PageCopy
            The partial-page copies the caller must perform (zero or one), in order.

        Raises
        ------
        SequenceError
            Unknown sequence or ``n`` outside ``[0, length]``.
        CacheFullError
            The re-fork needs a page for a partial page and none is free (counting the pages
            the trimming frees).
        """
        seq = self._seq(seq_id)
        n = check_pop_length(seq, n)
        if n == 0:
            return []
        plan = self._tree.plan_pop(seq, n)
        if plan.remaining:
            self._tree.check_pop_fork(seq, plan)
        self._version += 1
        self._tree.apply_trim(seq, plan)
        left_of_last_step = max(0, seq.last_append_length - n)  # what commit's leaf -1 would pop
        seq.last_append_length = left_of_last_step
        if not plan.remaining:
            return []
        copies = self._refork(seq, seq.seq_length - plan.remaining)
        self._seqs[seq.seq_id].last_append_length = left_of_last_step
        return copies

    def check_pops(self, pops: list[tuple[int, int]]) -> None:
        """Raise what ``popn(seq_id, n)`` for each pair, in order, would raise; change nothing.

        Pops that only trim their sequences' unshared blocks cannot fail once each is valid on
        its own, nor change each other (no two sequences own the same unshared block); checking
        each one is enough. A pop that reaches a shared prefix re-forks the sequence, which
        depends on what the pops before it freed and unshared: those batches are tried on a
        copy of this state.
        """
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
            seq_id, n = pops[0]
            self._tree.check_pop_fork(self._seq(seq_id), self._tree.plan_pop(self._seq(seq_id), n))

    def reserve_append(
        self, seq_ids: collections.abc.Sequence[int], lengths: collections.abc.Sequence[int]
    ) -> tuple[int, ...]:
        """Make room for ``lengths[i]`` new tokens at the end of each sequence ``seq_ids[i]``.

        TVM's ``ReserveAppendLengthInSeq`` over a batch (plus the ``Sequence.seq_length`` bump
        that TVM does in ``BeginForward``): pages are allocated to each last block, in batch
        order, and both the block and the sequence grow by the length.

        A windowed sequence (with ``slide_windows``) then slides, in its turn in the batch, as
        TVM's ``SlideWindowForSequence``: on the first slide the last block pins its first
        ``last_block_attn_sink_size`` tokens; pages after the sink pages that slide out
        entirely go back to the pool (available to the next sequences of the batch); the
        sequence length becomes the window size. When the pool runs dry while a windowed
        sequence allocates, it borrows temporary pages that are replaced by real ones after the
        slide, so a full cache can still slide. The whole batch is planned first: on any error
        nothing changes.

        Parameters
        ----------
        seq_ids : sequence of int
            Distinct live sequences.
        lengths : sequence of int
            Tokens to append to each, each ``>= 1``.

        Raises
        ------
        KVCacheError
            ``seq_ids`` and ``lengths`` differ in length, or a value is not an int.
        SequenceError
            Unknown or repeated sequence, length < 1, a last block shared with other blocks, or
            a window that cannot slide (smaller than the sequence's shared prefix plus sink).
        CacheFullError
            The batch needs more pages than are free (counting the pages sliding frees).

        Returns
        -------
        tuple of int
            Pages that slid out of a window and were handed to new tokens in the same batch
            (their old contents are overwritten by this step's appends), in allocation order;
            empty when nothing slides.
        """
        items, total = appends.plan(self._seqs, self._tree, seq_ids, lengths, self._seq)
        if self._num_windowed and self._slide_windows:
            plans = windows.plan_sliding(items, self._pages, self._page_size)
            self._version += 1
            reused = windows.apply_sliding(items, plans, self._pages)
            appends.record(items)
            return reused
        self._tree.check_free_pages(total, 0, f"append to {len(items)} sequence(s)")
        self._version += 1
        appends.apply(items, self._pages.allocate(total))
        return ()

    def import_sequence(self, seq_id: int, length: int) -> np.ndarray:
        """Give sequence ``seq_id`` ``length`` tokens on fresh pages, for a checkpoint import.

        The sequence is added when absent; an existing one must be empty, without a window or
        a token tree, and not forked from. The tokens are not a step's append (a later commit
        with leaf -1 pops nothing). Checked first: on any error nothing changes.

        Returns
        -------
        numpy.ndarray
            int32 slots of the ``length`` positions, in order.

        Raises
        ------
        SequenceError
            An existing sequence that is not empty, has a window or a tree, or was forked from.
        CacheFullError
            Fewer than ``ceil(length / page_size)`` free pages.
        """
        seq_id, length = as_seq_id(seq_id), as_int("length", length)
        if length < 0:
            raise SequenceError(f"a sequence cannot hold {length} tokens; expected at least 0")
        seq = self._seqs.get(seq_id)
        if seq is not None:
            if seq.seq_length or seq.sliding_window_size != -1 or seq.token_tree is not None:
                raise SequenceError(f"sequence {seq_id} has {seq.seq_length} token(s)"
                                    + (" and a sliding window" if seq.sliding_window_size != -1 else "")
                                    + "; a checkpoint imports into a new or empty sequence without a window")
            self._tree.appendable_block(seq)
        self._tree.check_free_pages(ceil_div(length, self._page_size), 0, f"import {length} token(s) into sequence {seq_id}")
        if seq is None:
            self.add_sequence(seq_id)
        if length:
            self.reserve_append([seq_id], [length])
        self._seqs[seq_id].last_append_length = 0
        return self.position_map(seq_id)

    def open_lane(self, seq_ids: collections.abc.Sequence[int]) -> DecodeLane | None:
        """Snapshot a batch for `advance_lane`, or None when a sequence cannot use one.

        Every sequence must be live and distinct, have no sliding window and no uncommitted
        token tree, have grown by one token in its last step, and own its last block (no other block or sequence refers to it); the last
        block must not have slid (no sink pinned, no window offset) and must hold just the
        pages its tokens fill.
        """
        return decode_lane.open_lane(self._seqs, self._blocks, self._page_size, self._version, seq_ids)

    def advance_lane(self, lane: DecodeLane) -> None:
        """Append one token to every sequence of ``lane``: `reserve_append` with lengths 1.

        Pages go to the last blocks that are full, in batch order, as `reserve_append` hands
        them out; ``lane``'s arrays describe the state after the step.

        Raises
        ------
        KVCacheError
            The state changed since the lane was opened or last advanced.
        CacheFullError
            More last blocks are full than pages are free (nothing changes).
        """
        if lane.version != self._version:
            raise KVCacheError(
                f"decode lane is stale: opened at state version {lane.version}, the state is at "
                f"version {self._version}; open a new lane"
            )
        full = np.flatnonzero(lane.block_length >= lane.page_capacity)  # last blocks that need a page
        self._tree.check_free_pages(len(full), 0, f"append to {len(lane.seq_ids)} sequence(s)")
        self._version += 1
        decode_lane.advance(lane, full, self._pages, self._page_size, self._version)

    def set_token_tree(self, seq_id: int, tree: object) -> None:
        """Record the (accumulated) token tree of the last steps of ``seq_id``; it stays
        uncommitted until `clear_token_tree`. ``tree`` is opaque here (see ``token_tree``)."""
        seq = self._seq(seq_id)
        self._version += 1
        seq.token_tree = tree
        seq.accepted_indices_committed = False

    def clear_token_tree(self, seq_id: int) -> None:
        """Mark the token tree of ``seq_id`` committed (TVM's ``accepted_indices_committed``); the
        commit consumed the last step, so a second commit with leaf -1 pops nothing."""
        seq = self._seq(seq_id)
        self._version += 1
        seq.token_tree = None
        seq.accepted_indices_committed = True
        seq.last_append_length = 0

    # ------------------------------------------------------------- internals: checks

    def _seq(self, seq_id: object) -> Sequence:
        seq = self._seqs.get(seq_id) if type(seq_id) is int else None
        if seq is None:
            seq_id = as_seq_id(seq_id)
            seq = self._seqs.get(seq_id)
            if seq is None:
                raise SequenceError(f"sequence {seq_id} is not in the cache")
        return seq

    def _check_absent(self, seq_id: object) -> int:
        seq_id = as_seq_id(seq_id)
        if seq_id in self._seqs:
            raise SequenceError(f"sequence {seq_id} is already in the cache")
        return seq_id


    # ------------------------------------------------------------ internals: helpers
    def _insert_sequence(self, seq_id: int, last_block: int, seq_length: int) -> None:
        """Register a sequence ending at ``last_block`` (TVM's ``Sequence`` constructor)."""
        self._blocks.retain(last_block)
        self._seqs[seq_id] = Sequence(seq_id, last_block, seq_length)

    # ----------------------------------------------------------------- internals: popn

    def _refork(self, seq: Sequence, pos: int) -> list[PageCopy]:
        """Replace ``seq`` by a fork of its own prefix of length ``pos`` (PopN's fallback)."""
        child_block, copies = self._tree.fork_blocks(seq, pos)
        self._blocks.retain(child_block)
        self._tree.release_path(seq.last_block)
        fresh = Sequence(seq.seq_id, child_block, pos, sliding_window_size=seq.sliding_window_size,
                         attn_sink_size=seq.attn_sink_size)
        self._seqs[seq.seq_id] = fresh
        self._tree.recompute_last_sink(fresh)  # the window is kept (see popn)
        return copies
