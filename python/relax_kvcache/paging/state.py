"""`PagingState`: sequences, the block tree and the page pool of a paged KV cache.

The semantics are those of TVM's C++ ``PagedAttentionKVCacheObj`` (``AddSequence``,
``RemoveSequence``, ``ForkSequence``, ``PopN``, ``ReserveAppendLengthInSeq``, ``Empty``,
``DebugGetKV``'s position map), including the order in which page and block ids are handed out,
so page ids match TVM's exactly. Unlike TVM, every operation validates the whole request first
and raises a `KVCacheError` subclass with the state untouched (check-then-mutate). The paging
layer never touches KV data: the partial pages to copy are returned as `PageCopy` records.
"""

from __future__ import annotations

import collections.abc
import dataclasses

import numpy as np

from ..errors import CacheFullError, ConfigError, KVCacheError, SequenceError
from ._checks import as_int, as_seq_id, ceil_div
from .block_pool import Block, BlockPool
from .page_pool import PagePool
from .sequences import Sequence

_INT32_MAX = 2**31 - 1


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


class PagingState:
    """Paging bookkeeping of a paged KV cache: the façade the cache uses.

    Parameters
    ----------
    num_pages : int
        Number of pages in the pool, ``>= 0``.
    page_size : int
        Tokens per page, ``>= 1``.

    Raises
    ------
    ConfigError
        If a parameter is out of range or ``num_pages * page_size`` exceeds the int32 range.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
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
        self._seqs.clear()
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
        self._release_path(seq.last_block)
        del self._seqs[seq.seq_id]

    def fork_sequence(self, parent_id: int, child_id: int, fork_pos: int = -1) -> list[PageCopy]:
        """Create ``child_id`` sharing the first ``fork_pos`` tokens of ``parent_id``.

        TVM's ``ForkSequence``. Whole shared pages are shared through the block tree; a
        partial last page is copied into a fresh page of the child.

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
            Unknown parent, existing child, or ``fork_pos`` out of range.
        CacheFullError
            The partial-page copy needs a page and none is free.
        """
        parent = self._seq(parent_id)
        child_id = self._check_absent(child_id)
        pos = self._check_fork_pos(parent, fork_pos)
        if self._fork_copy_length(parent, pos) > 0:
            self._check_free_pages(1, 0, f"fork sequence {parent.seq_id} at position {pos}")
        child_block, copies = self._fork_blocks(parent, pos)
        self._insert_sequence(child_id, child_block, pos)
        return copies

    def popn(self, seq_id: int, n: int) -> list[PageCopy]:
        """Drop the last ``n`` tokens of sequence ``seq_id`` (TVM's ``PopN``).

        Unshared blocks are trimmed from the end. If tokens remain to pop once a shared block
        is reached, the sequence is re-forked from its own prefix of length ``length - n``
        (TVM forks a temporary sequence, removes the original and renames it); the record is
        then a fresh one, as in TVM.

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
        n = as_int("pop length", n)
        if not 0 <= n <= seq.seq_length:
            raise SequenceError(
                f"cannot pop {n} tokens from sequence {seq.seq_id} of length {seq.seq_length}: "
                f"expected 0 <= n <= {seq.seq_length}"
            )
        if n == 0:
            return []
        plan = self._plan_pop(seq, n)
        if plan.remaining:
            self._check_pop_fork(seq, plan)
        self._apply_trim(seq, plan)
        if not plan.remaining:
            return []
        return self._refork(seq, seq.seq_length - plan.remaining)

    def reserve_append(
        self, seq_ids: collections.abc.Sequence[int], lengths: collections.abc.Sequence[int]
    ) -> None:
        """Make room for ``lengths[i]`` new tokens at the end of each sequence ``seq_ids[i]``.

        TVM's ``ReserveAppendLengthInSeq`` over a batch (plus the ``Sequence.seq_length`` bump
        that TVM does in ``BeginForward``): pages are allocated to each last block, in batch
        order, and both the block and the sequence grow by the length.

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
            Unknown or repeated sequence, length < 1, or a last block shared with other blocks.
        CacheFullError
            The batch needs more pages than are free.
        """
        items, total = self._plan_reserve(seq_ids, lengths)
        pages = self._pages.allocate(total)
        at = 0
        for seq, block, length, need in items:
            if need:
                block.page_ids.extend(pages[at : at + need])
                at += need
            block.seq_length += length
            seq.seq_length += length

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

    def _check_forkable(self, seq: Sequence, seq_length: int, last: Block, pos: int) -> None:
        """TVM's ForkSequence state checks on a parent of ``seq_length`` ending at ``last``."""
        if not seq.accepted_indices_committed:
            raise SequenceError(
                f"sequence {seq.seq_id} has uncommitted token-tree nodes and cannot be forked"
            )
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
        self._check_free_pages(total, 0, f"append to {len(items)} sequence(s)")
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
            seq.last_block_attn_sink_size -= moved

    # ----------------------------------------------------------------- internals: popn

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
            keep = ceil_div(block.seq_length - n, self._page_size)
            drop = max(0, len(block.page_ids) - keep)
            return _PopPlan(tuple(freed), idx, drop, n, 0, -1)
        return _PopPlan(tuple(freed), -1, 0, 0, n, idx)

    def _check_pop_fork(self, seq: Sequence, plan: _PopPlan) -> None:
        """Check, before trimming, that the fork fallback of `popn` will succeed."""
        trimmed = sum(self._blocks[i].seq_length for i in plan.freed_blocks)
        pos = seq.seq_length - trimmed - plan.remaining
        shared = self._blocks[plan.shared_block]
        self._check_forkable(seq, seq.seq_length - trimmed, shared, pos)
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
        if plan.trim_block == -1:
            return
        block = self._blocks[plan.trim_block]
        if plan.trim_pages:
            dropped = block.page_ids[-plan.trim_pages :]
            del block.page_ids[-plan.trim_pages :]
            self._pages.release(reversed(dropped))
        block.seq_length -= plan.trim_length
        seq.seq_length -= plan.trim_length

    def _refork(self, seq: Sequence, pos: int) -> list[PageCopy]:
        """Replace ``seq`` by a fork of its own prefix of length ``pos`` (PopN's fallback)."""
        child_block, copies = self._fork_blocks(seq, pos)
        self._blocks.retain(child_block)
        self._release_path(seq.last_block)
        self._seqs[seq.seq_id] = Sequence(seq.seq_id, child_block, pos)
        return copies
