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
"""

from __future__ import annotations

import collections.abc
import copy
import dataclasses
import typing

import numpy as np

from ..errors import CacheFullError, ConfigError, KVCacheError, SequenceError
from ._checks import as_int, as_seq_id, ceil_div
from .block_pool import Block, BlockPool
from .decode_lane import DecodeLane
from .page_pool import PagePool
from .sequences import Sequence

_INT32_MAX = 2**31 - 1
_TEMP_PAGE = -1  # TVM's kPagedKVCacheTempPageId: a page borrowed until sliding frees one


@dataclasses.dataclass(frozen=True, slots=True)
class PageCopy:
    """Copy the first ``length`` slots of page ``src_page`` into page ``dst_page``.

    TVM's ``CopySinglePage``: the caller performs it on the KV data of every layer, in order.
    """

    src_page: int
    dst_page: int
    length: int


@dataclasses.dataclass(frozen=True, slots=True)
class _PopPlan:
    """What `PagingState.popn` will do, computed before any mutation."""

    freed_blocks: tuple[int, ...]  # unshared blocks dropped whole, last block first
    trim_block: int  # the unshared block trimmed in place, or -1
    trim_pages: int  # pages dropped from the end of ``trim_block``
    trim_length: int  # tokens dropped from ``trim_block``
    remaining: int  # tokens still to pop once a shared block is reached (fork fallback)
    shared_block: int  # the shared block reached when ``remaining > 0``, else -1
    reset_window: bool = False  # the trim pops into a slid block's sink: unslide the block


class _SlidePlan(typing.NamedTuple):
    """What `reserve_append` does to one windowed sequence, computed before any mutation."""

    real: int  # pages taken from the free list before sliding
    temp: int  # temporary (-1) pages borrowed after them
    sink_length: int  # the block's sink length once the slide starts
    first_slid: int  # index of the first page after the sink pages (slid pages start here)
    dropped: int  # pages slid out, from ``first_slid`` on (temporary ones are not freed)
    freed: int  # real pages among the dropped ones: they go back to the pool
    temps_left: int  # temporary pages still in the block after the slide, then replaced
    block_length: int  # the block's length after sliding
    window_offset: int  # the block's sliding-window offset after sliding
    seq_length: int  # the sequence's length after sliding


class _BatchPages:
    """The page pool as one `reserve_append` batch uses it while windows slide: records the
    pages that slide out holding earlier tokens and are handed to new tokens of the same batch
    (``reused``), whose old contents the step's appends overwrite."""

    def __init__(self, pages: PagePool) -> None:
        self._pages = pages
        self._fresh: set[int] = set()  # allocated in this batch: no earlier tokens
        self._slid_out: set[int] = set()
        self.reused: list[int] = []

    def allocate(self, n: int) -> list[int]:
        pages = self._pages.allocate(n)
        self.reused.extend(p for p in pages if p in self._slid_out)
        self._fresh.update(pages)
        return pages

    def release(self, pages: list[int]) -> None:
        self._pages.release(pages)
        self._slid_out.update(p for p in pages if p not in self._fresh)


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
        self._pages = PagePool(num_pages)
        self._blocks = BlockPool()
        self._seqs: dict[int, Sequence] = {}
        self._lanes = np.arange(page_size, dtype=np.int32)  # in-page offsets
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
        return self._trace(self._seq(seq_id).last_block)

    def trace_blocks(self, seq_id: int) -> list[Block]:
        """Return the blocks of sequence ``seq_id``, root first (live objects: read, do not modify)."""
        blocks = self._blocks
        trace = []
        idx = self._seq(seq_id).last_block
        while idx != -1:
            block = blocks[idx]
            trace.append(block)
            idx = block.parent
        trace.reverse()
        return trace

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
        length = self._check_append_length(seq, length)
        return self._block_pages_needed(self._blocks[seq.last_block], length)

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
        start, end = self._check_range(seq, start, end)
        parts: list[np.ndarray] = []
        block_end = seq.seq_length
        idx = seq.last_block
        while idx != -1 and block_end > start:
            block = self._blocks[idx]
            block_start = block_end - block.seq_length
            lo, hi = max(start, block_start), min(end, block_end)
            if hi > lo:
                parts.append(self._block_slots(block, lo - block_start, hi - block_start))
            block_end, idx = block_start, block.parent
        if not parts:
            return np.empty(0, dtype=np.int32)
        return parts[0] if len(parts) == 1 else np.concatenate(parts[::-1])

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
        self._release_path(seq.last_block)
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
        window_size = as_int("sliding window size", window_size)
        sink_size = as_int("attention sink size", sink_size)
        if sink_size < 0:
            raise SequenceError(
                f"attention sink size {sink_size} for sequence {seq.seq_id} is invalid: "
                f"expected >= 0"
            )
        if window_size <= 0:
            raise SequenceError(
                f"sliding window size {window_size} for sequence {seq.seq_id} is invalid: "
                f"expected >= 1"
            )
        if sink_size >= window_size:
            raise SequenceError(
                f"attention sink size {sink_size} for sequence {seq.seq_id} must be less than "
                f"the sliding window size {window_size}"
            )
        if seq.sliding_window_size != -1:
            raise SequenceError(
                f"sequence {seq.seq_id} already has a sliding window (size "
                f"{seq.sliding_window_size}); it cannot be enabled twice"
            )
        prefix = seq.seq_length - self._blocks[seq.last_block].seq_length
        if self._slide_windows and window_size < prefix:
            raise SequenceError(
                f"sliding window size {window_size} for sequence {seq.seq_id} is smaller than its "
                f"{prefix}-token prefix in shared blocks, which cannot slide: expected a window "
                f">= {prefix} (every later append would fail)"
            )
        self._version += 1
        seq.attn_sink_size = sink_size
        seq.sliding_window_size = window_size
        self._recompute_last_sink(seq)
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
        pos = self._check_fork_pos(parent, fork_pos)
        if self._fork_copy_length(parent, pos) > 0:
            self._check_free_pages(1, 0, f"fork sequence {parent.seq_id} at position {pos}")
        self._version += 1
        child_block, copies = self._fork_blocks(parent, pos)
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
        n = self._pop_length(seq, n)
        if n == 0:
            return []
        plan = self._plan_pop(seq, n)
        if plan.remaining:
            self._check_pop_fork(seq, plan)
        self._version += 1
        self._apply_trim(seq, plan)
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
            n = self._pop_length(seq, n)
            refork = refork or (n > 0 and self._plan_pop(seq, n).remaining > 0)
        if refork and len(pops) > 1:
            trial = copy.deepcopy(self)
            for seq_id, n in pops:
                trial.popn(seq_id, n)
        elif refork:
            seq_id, n = pops[0]
            self._check_pop_fork(self._seq(seq_id), self._plan_pop(self._seq(seq_id), n))

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
        items, total = self._plan_reserve(seq_ids, lengths)
        if self._num_windowed and self._slide_windows:
            plans = self._plan_sliding(items)
            self._version += 1
            reused = self._apply_sliding(items, plans)
            self._record_appends(items)
            return reused
        self._check_free_pages(total, 0, f"append to {len(items)} sequence(s)")
        self._version += 1
        pages = self._pages.allocate(total)
        at = 0
        for seq, block, length, need in items:
            if need:
                block.page_ids.extend(pages[at : at + need])
                at += need
            block.seq_length += length
            seq.seq_length += length
            seq.last_append_length = length
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
            self._appendable_block(seq)
        self._check_free_pages(ceil_div(length, self._page_size), 0, f"import {length} token(s) into sequence {seq_id}")
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
        seqs, blocks = [], []
        for seq_id in seq_ids:
            seq = self._seqs.get(seq_id) if type(seq_id) is int else None
            if (seq is None or seq.sliding_window_size != -1 or not seq.accepted_indices_committed
                    or seq.last_append_length != 1):
                return None
            block = self._blocks[seq.last_block]
            if (block.ref_count != 1 or block.sink_length or block.sliding_window_offset
                    or len(block.page_ids) != ceil_div(block.seq_length, self._page_size)):
                return None
            seqs.append(seq)
            blocks.append(block)
        if len(set(map(id, seqs))) != len(seqs):
            return None
        ps = self._page_size
        return DecodeLane(
            version=self._version,
            seq_ids=tuple(seq_ids),
            seq_length=np.array([s.seq_length for s in seqs], dtype=np.int64),
            block_length=np.array([b.seq_length for b in blocks], dtype=np.int64),
            page_capacity=np.array([len(b.page_ids) * ps for b in blocks], dtype=np.int64),
            last_page=np.array([b.page_ids[-1] if b.page_ids else -1 for b in blocks], dtype=np.int64),
            _pairs=tuple(zip(seqs, blocks)),
        )

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
        full = np.flatnonzero(lane.block_length >= lane.page_capacity)
        self._check_free_pages(len(full), 0, f"append to {len(lane.seq_ids)} sequence(s)")
        self._version += 1
        if len(full):
            pages = self._pages.allocate(len(full))
            pairs = lane._pairs
            for i, page in zip(full.tolist(), pages):
                pairs[i][1].page_ids.append(page)
            lane.page_capacity[full] += self._page_size
            lane.last_page[full] = pages
        for seq, block in lane._pairs:  # last_append_length is 1 already (see open_lane)
            seq.seq_length += 1
            block.seq_length += 1
        lane.seq_length += 1
        lane.block_length += 1
        lane.version = self._version

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

    @staticmethod
    def _record_appends(items) -> None:
        for seq, _, length, _ in items:
            seq.last_append_length = length

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

    def _check_free_pages(self, needed: int, extra: int, what: str) -> None:
        available = self._pages.num_free + extra
        if needed > available:
            raise CacheFullError(
                f"the KV cache is full: cannot {what}: {needed} page(s) needed, "
                f"{available} free"
            )

    def _check_range(self, seq: Sequence, start: object, end: object) -> tuple[int, int]:
        start = as_int("start position", start)
        end = seq.seq_length if end is None else as_int("end position", end)
        if not 0 <= start <= end <= seq.seq_length:
            raise SequenceError(
                f"position range [{start}, {end}) is invalid for sequence {seq.seq_id}: "
                f"expected 0 <= start <= end <= {seq.seq_length}"
            )
        return start, end

    def _check_append_length(self, seq: Sequence, length: object) -> int:
        length = as_int("append length", length)
        if length < 1:
            raise SequenceError(
                f"append length {length} for sequence {seq.seq_id} is invalid: expected >= 1"
            )
        return length

    def _appendable_block(self, seq: Sequence) -> Block:
        block = self._blocks[seq.last_block]
        if block.ref_count != 1:
            raise SequenceError(
                f"the last block {block.index} of sequence {seq.seq_id} is referenced by "
                f"{block.ref_count - 1} other block(s) and cannot accept new tokens "
                f"(expected exactly 1 reference)"
            )
        return block

    def _check_fork_pos(self, parent: Sequence, fork_pos: object) -> int:
        fork_pos = as_int("fork position", fork_pos)
        if not -1 <= fork_pos <= parent.seq_length:
            raise SequenceError(
                f"fork position {fork_pos} is out of range [-1, {parent.seq_length}] for "
                f"parent sequence {parent.seq_id}"
            )
        pos = parent.seq_length if fork_pos == -1 else fork_pos
        self._check_forkable(parent, parent.seq_length, self._blocks[parent.last_block], pos)
        return pos

    def _check_committed(self, seq: Sequence) -> None:
        if not seq.accepted_indices_committed:
            raise SequenceError(
                f"sequence {seq.seq_id} has uncommitted token-tree nodes and cannot be forked"
            )

    def _check_forkable(self, seq: Sequence, seq_length: int, last: Block, pos: int) -> None:
        """TVM's ForkSequence state checks on a parent of ``seq_length`` ending at ``last``."""
        self._check_committed(seq)
        if seq.sliding_window_size == -1:
            return
        sink_size = seq_length - last.seq_length + seq.last_block_attn_sink_size
        if pos > sink_size:
            raise SequenceError(
                f"fork position {pos} of sequence {seq.seq_id} is past its attention sink: "
                f"a sliding-window sequence can only be forked within {sink_size} tokens"
            )

    def _plan_reserve(
        self, seq_ids: collections.abc.Sequence[int], lengths: collections.abc.Sequence[int]
    ) -> tuple[list[tuple[Sequence, Block, int, int]], int]:
        if len(seq_ids) != len(lengths):
            raise KVCacheError(
                f"got {len(seq_ids)} sequence ids but {len(lengths)} append lengths"
            )
        items: list[tuple[Sequence, Block, int, int]] = []
        seen: set[int] = set()
        total = 0
        seqs, blocks = self._seqs, self._blocks
        for raw_id, length in zip(seq_ids, lengths):  # per-step hot loop: fast path inline
            seq = seqs.get(raw_id) if type(raw_id) is int else None
            if seq is None or type(length) is not int or length < 1 or seq.seq_id in seen:
                seq, length = self._check_reserve_item(raw_id, length, seen)
            block = blocks[seq.last_block]
            if block.ref_count != 1:
                self._appendable_block(seq)  # raises
            seen.add(seq.seq_id)
            need = self._block_pages_needed(block, length)
            total += need
            items.append((seq, block, length, need))
        return items, total

    def _check_reserve_item(
        self, raw_id: object, length: object, seen: set[int]
    ) -> tuple[Sequence, int]:
        """Slow path of `_plan_reserve`: validate one batch entry, raising on a bad one."""
        seq = self._seq(raw_id)
        if seq.seq_id in seen:
            raise SequenceError(f"sequence {seq.seq_id} appears more than once in the batch")
        return seq, self._check_append_length(seq, length)

    # ------------------------------------------------------------ internals: helpers

    def _block_pages_needed(self, block: Block, length: int) -> int:
        used = block.seq_length - block.sink_length + block.sliding_window_offset + length
        return max(0, -(-used // self._page_size) - len(block.page_ids))

    def _block_slots(self, block: Block, lo: int, hi: int) -> np.ndarray:
        """Slots of the tokens ``[lo, hi)`` of ``block`` (TVM's ``DebugGetKV`` offsets)."""
        sink = block.sink_length
        if lo >= sink:  # no sink token in range: one contiguous run of page slots
            shift = block.sliding_window_offset - sink
            return self._run_slots(block.page_ids, lo + shift, hi + shift)
        if hi <= sink:
            return self._run_slots(block.page_ids, lo, hi)
        shift = block.sliding_window_offset - sink
        head = self._run_slots(block.page_ids, lo, sink)
        return np.concatenate([head, self._run_slots(block.page_ids, sink + shift, hi + shift)])

    def _run_slots(self, page_ids: list[int], lo: int, hi: int) -> np.ndarray:
        """Slots of the contiguous in-block offsets ``[lo, hi)``, as int32."""
        ps = self._page_size
        first = lo // ps
        table = np.array(page_ids[first : ceil_div(hi, ps)], dtype=np.int32) * ps
        grid = (table[:, None] + self._lanes).ravel()
        return grid[lo - first * ps : hi - first * ps]

    def _trace(self, last_block: int) -> list[int]:
        trace = []
        idx = last_block
        while idx != -1:
            trace.append(idx)
            idx = self._blocks[idx].parent
        trace.reverse()
        return trace

    def _insert_sequence(self, seq_id: int, last_block: int, seq_length: int) -> None:
        """Register a sequence ending at ``last_block`` (TVM's ``Sequence`` constructor)."""
        self._blocks.retain(last_block)
        self._seqs[seq_id] = Sequence(seq_id, last_block, seq_length)

    def _release_path(self, last_block: int) -> None:
        """Drop one sequence's hold on the path ending at ``last_block`` (RemoveSequence)."""
        idx = last_block
        while idx != -1 and self._blocks[idx].ref_count == 1:
            block = self._blocks[idx]
            self._pages.release(block.page_ids)
            parent = block.parent
            self._blocks.free(idx)
            idx = parent
        if idx != -1:
            self._blocks.release(idx)

    # ---------------------------------------------------------------- internals: fork

    def _adds_empty_block(self, parent: Sequence, pos: int) -> bool:
        """Whether forking at ``pos`` first gives the parent a new empty last block."""
        return (
            pos == parent.seq_length
            and pos % self._page_size == 0
            and self._blocks[parent.last_block].seq_length > 0
        )

    def _locate(self, last_block: int, pos: int) -> tuple[int, int]:
        """Return the block of the path ending at ``last_block`` a fork at ``pos`` cuts, and
        the offset of ``pos`` in it (non-last blocks are skipped when ``pos`` is past them)."""
        trace = self._trace(last_block)
        offset = pos
        for idx in trace[:-1]:
            length = self._blocks[idx].seq_length
            if length > offset:
                return idx, offset
            offset -= length
        return trace[-1], offset

    def _fork_copy_length(self, parent: Sequence, pos: int) -> int:
        """Tokens a fork of ``parent`` at ``pos`` copies into a fresh page (0: no page)."""
        if self._adds_empty_block(parent, pos):
            return 0
        return self._locate(parent.last_block, pos)[1] % self._page_size

    def _fork_blocks(self, parent: Sequence, pos: int) -> tuple[int, list[PageCopy]]:
        """Build the child's last block for a fork of ``parent`` at ``pos`` (checks done)."""
        if self._adds_empty_block(parent, pos):
            self._append_empty_block(parent)
        child_idx = self._blocks.new_block()
        forked_idx, offset = self._locate(parent.last_block, pos)
        in_page = offset % self._page_size
        moved_pages = offset // self._page_size
        if moved_pages == 0:
            self._link(child_idx, self._blocks[forked_idx].parent)
        else:
            self._split_block(parent, forked_idx, moved_pages, child_idx)
        child = self._blocks[child_idx]
        child.start_pos = pos - in_page
        child.seq_length = in_page
        if in_page == 0:
            return child_idx, []
        page = self._pages.allocate(1)[0]
        child.page_ids.append(page)
        return child_idx, [PageCopy(self._blocks[forked_idx].page_ids[0], page, in_page)]

    def _append_empty_block(self, seq: Sequence) -> None:
        if seq.sliding_window_size != -1:
            # The old last block becomes a prefix block: the new last block's sink is what is
            # left of the old one (TVM keeps the old value, which makes the sink grow).
            old_length = self._blocks[seq.last_block].seq_length
            seq.last_block_attn_sink_size = max(seq.last_block_attn_sink_size - old_length, 0)
        idx = self._blocks.new_block()
        block = self._blocks[idx]
        block.start_pos = seq.seq_length
        block.parent = seq.last_block  # the old last block's reference moves to this block
        self._blocks.retain(idx)
        seq.last_block = idx

    def _link(self, child_idx: int, parent_idx: int) -> None:
        self._blocks[child_idx].parent = parent_idx
        if parent_idx != -1:
            self._blocks.retain(parent_idx)

    def _split_block(
        self, seq: Sequence, forked_idx: int, moved_pages: int, child_idx: int
    ) -> None:
        """Move the first ``moved_pages`` pages of ``forked_idx`` into a new parent block
        shared by ``forked_idx`` and ``child_idx``."""
        head_idx = self._blocks.new_block()
        head, forked = self._blocks[head_idx], self._blocks[forked_idx]
        moved = moved_pages * self._page_size
        head.parent = forked.parent
        forked.parent = head_idx
        self._blocks[child_idx].parent = head_idx
        self._blocks.retain(head_idx, 2)
        head.page_ids = forked.page_ids[:moved_pages]
        del forked.page_ids[:moved_pages]
        head.start_pos = forked.start_pos
        forked.start_pos += moved
        head.seq_length = moved
        forked.seq_length -= moved
        if seq.sliding_window_size != -1 and forked_idx == seq.last_block:
            # ``moved <= last_block_attn_sink_size``: forks stay within the sink.
            seq.last_block_attn_sink_size -= moved
            if forked.sink_length:  # slid already: the moved pages held sink tokens only
                forked.sink_length -= moved
                forked.sliding_window_offset -= moved

    # ------------------------------------------------------- internals: sliding window

    def _plan_sliding(
        self, items: list[tuple[Sequence, Block, int, int]]
    ) -> list[_SlidePlan | None]:
        """Plan `reserve_append` when windows slide, raising before anything changes.

        Sequences are processed in batch order as in TVM, so the pages a slide frees are the
        next ones handed out (LIFO), to the same sequence's borrowed pages or to the next
        sequences of the batch. Returns one plan per item (None: nothing slides or is borrowed).
        """
        free = self._pages.num_free
        taken = freed = 0  # pages taken from / returned to the pool so far in the batch
        plans: list[_SlidePlan | None] = []
        for seq, block, length, need in items:
            window = seq.sliding_window_size
            if window == -1 or (seq.seq_length + length <= window and need <= free):
                plan, got, back = None, need, 0  # nothing slides, nothing is borrowed
            else:
                plan = self._plan_slide(seq, block, length, need, free)
                got, back = plan.real + plan.temps_left, plan.freed
            taken += got
            freed += back
            if got > free + back:
                raise CacheFullError(
                    f"the KV cache is full: cannot append to {len(items)} sequence(s): "
                    f"{taken} page(s) needed, {self._pages.num_free + freed} free (counting "
                    f"{freed} page(s) freed by sliding windows) by sequence {seq.seq_id} of "
                    f"the batch"
                )
            free += back - got
            plans.append(plan)
        return plans

    def _apply_sliding(
        self, items: list[tuple[Sequence, Block, int, int]], plans: list[_SlidePlan | None]
    ) -> tuple[int, ...]:
        """Carry out `_plan_sliding`'s plans, in batch order; return the slid-out pages that
        were allocated again in the batch."""
        pool = _BatchPages(self._pages)
        for (seq, block, length, need), plan in zip(items, plans):
            if plan is None:
                if need:
                    block.page_ids.extend(pool.allocate(need))
                block.seq_length += length
                seq.seq_length += length
            else:
                self._apply_slide(seq, block, plan, pool)
        return tuple(pool.reused)

    def _plan_slide(
        self, seq: Sequence, block: Block, length: int, need: int, free: int
    ) -> _SlidePlan:
        """Plan ``ReserveAppendLengthInSeq`` + ``SlideWindowForSequence`` for one windowed
        sequence with ``free`` pages in the pool at its turn; raise on TVM's internal checks."""
        ps = self._page_size
        real = min(need, free)
        sink, offset = block.sink_length, block.sliding_window_offset
        block_length = block.seq_length + length
        seq_length = seq.seq_length + length
        window = seq.sliding_window_size
        first_slid = dropped = freed = 0
        if seq_length > window:
            slide = seq_length - window
            if seq.last_block_attn_sink_size > 0 and sink == 0:  # first slide: pin the sink
                if offset != 0:
                    raise KVCacheError(
                        f"cannot slide sequence {seq.seq_id}: its last block {block.index} has "
                        f"slid without a sink (window offset {offset}) but the sequence now "
                        f"has a {seq.last_block_attn_sink_size}-token sink"
                    )
                sink = offset = seq.last_block_attn_sink_size
            if block_length - slide < sink:
                prefix = seq.seq_length - block.seq_length
                raise SequenceError(
                    f"cannot slide sequence {seq.seq_id} by {slide} token(s): its window of "
                    f"{window} token(s) is smaller than its {prefix}-token prefix in earlier "
                    f"blocks (which cannot slide) plus its {sink}-token sink; its last block "
                    f"would keep {block_length - slide} token(s)"
                )
            first_slid = -(-sink // ps)
            page_after, in_page = divmod(offset + slide, ps)
            if page_after > first_slid:
                dropped = page_after - first_slid
                page_after = first_slid
                # Temporary pages come after the block's pages and the real new ones.
                real_end = len(block.page_ids) + real
                freed = max(0, min(first_slid + dropped, real_end) - first_slid)
            elif page_after < first_slid - 1:  # TVM's check; cannot fail while offset >= sink
                raise KVCacheError(
                    f"cannot slide sequence {seq.seq_id}: window offset {offset} lies before "
                    f"its {sink}-token sink"
                )
            offset = page_after * ps + in_page
            block_length -= slide
            seq_length = window
        pages_after = len(block.page_ids) + need - dropped
        if pages_after != -(-(block_length - sink + offset) // ps):
            raise KVCacheError(
                f"cannot slide sequence {seq.seq_id}: its last block {block.index} would hold "
                f"{pages_after} page(s) for {block_length} token(s) (sink {sink}, window "
                f"offset {offset})"
            )
        temp = need - real
        return _SlidePlan(
            real, temp, sink, first_slid, dropped, freed, temp - (dropped - freed),
            block_length, offset, seq_length,
        )

    @staticmethod
    def _apply_slide(seq: Sequence, block: Block, plan: _SlidePlan, pool: _BatchPages) -> None:
        """Carry out a `_plan_slide` plan, in TVM's order of page operations."""
        page_ids = block.page_ids
        if plan.real:
            page_ids.extend(pool.allocate(plan.real))
        if plan.temp:
            page_ids.extend([_TEMP_PAGE] * plan.temp)
        if plan.dropped:
            first, last = plan.first_slid, plan.first_slid + plan.dropped
            released = [p for p in page_ids[first:last] if p != _TEMP_PAGE]
            del page_ids[first:last]
            pool.release(released)
        block.sink_length = plan.sink_length
        block.sliding_window_offset = plan.window_offset
        block.seq_length = plan.block_length
        seq.seq_length = plan.seq_length
        if plan.temps_left:
            temps = [i for i, p in enumerate(page_ids) if p == _TEMP_PAGE]
            for i, page in zip(temps, pool.allocate(len(temps))):
                page_ids[i] = page

    # ----------------------------------------------------------------- internals: popn

    @staticmethod
    def _pop_length(seq: Sequence, n) -> int:
        """``n`` as an int in ``[0, seq.seq_length]``, else SequenceError / ArgumentError."""
        n = as_int("pop length", n)
        if not 0 <= n <= seq.seq_length:
            raise SequenceError(
                f"cannot pop {n} tokens from sequence {seq.seq_id} of length {seq.seq_length}: "
                f"expected 0 <= n <= {seq.seq_length}"
            )
        return n

    def _plan_pop(self, seq: Sequence, n: int) -> _PopPlan:
        freed: list[int] = []
        idx = seq.last_block
        while idx != -1 and self._blocks[idx].ref_count == 1:
            block = self._blocks[idx]
            if n > block.seq_length:
                n -= block.seq_length
                freed.append(idx)
                idx = block.parent
                continue
            left = block.seq_length - n
            # popping the whole window of a slid block, or into its sink: only sink tokens are
            # left, at their original slots (a slid block never becomes a prefix block)
            reset = left <= block.sink_length
            used = left if reset else left - block.sink_length + block.sliding_window_offset
            drop = max(0, len(block.page_ids) - ceil_div(used, self._page_size))
            return _PopPlan(tuple(freed), idx, drop, n, 0, -1, reset)
        return _PopPlan(tuple(freed), -1, 0, 0, n, idx)

    def _check_pop_fork(self, seq: Sequence, plan: _PopPlan) -> None:
        """Check, before trimming, that the fork fallback of `popn` will succeed."""
        trimmed = sum(self._blocks[i].seq_length for i in plan.freed_blocks)
        pos = seq.seq_length - trimmed - plan.remaining
        self._check_committed(seq)  # a re-fork inside the prefix blocks: no sink check
        if self._locate(plan.shared_block, pos)[1] % self._page_size == 0:
            return
        freed_pages = sum(len(self._blocks[i].page_ids) for i in plan.freed_blocks)
        self._check_free_pages(
            1, freed_pages, f"pop {plan.remaining} shared tokens from sequence {seq.seq_id}"
        )

    def _apply_trim(self, seq: Sequence, plan: _PopPlan) -> None:
        for idx in plan.freed_blocks:
            block = self._blocks[idx]
            self._pages.release(block.page_ids)
            seq.seq_length -= block.seq_length
            seq.last_block = block.parent  # the freed block's reference passes to the parent
            self._blocks.free(idx)
        if plan.freed_blocks:
            self._recompute_last_sink(seq)
        if plan.trim_block == -1:
            return
        block = self._blocks[plan.trim_block]
        if plan.trim_pages:
            dropped = block.page_ids[-plan.trim_pages :]
            del block.page_ids[-plan.trim_pages :]
            self._pages.release(reversed(dropped))
        block.seq_length -= plan.trim_length
        seq.seq_length -= plan.trim_length
        if plan.reset_window:
            block.sink_length = 0
            block.sliding_window_offset = 0

    def _recompute_last_sink(self, seq: Sequence) -> None:
        """A windowed sequence's last-block sink from its ``attn_sink_size`` and prefix."""
        if seq.sliding_window_size != -1:
            prefix = seq.seq_length - self._blocks[seq.last_block].seq_length
            seq.last_block_attn_sink_size = max(seq.attn_sink_size - prefix, 0)

    def _refork(self, seq: Sequence, pos: int) -> list[PageCopy]:
        """Replace ``seq`` by a fork of its own prefix of length ``pos`` (PopN's fallback)."""
        child_block, copies = self._fork_blocks(seq, pos)
        self._blocks.retain(child_block)
        self._release_path(seq.last_block)
        fresh = Sequence(seq.seq_id, child_block, pos, sliding_window_size=seq.sliding_window_size,
                         attn_sink_size=seq.attn_sink_size)
        self._seqs[seq.seq_id] = fresh
        self._recompute_last_sink(fresh)  # the window is kept (see popn)
        return copies
