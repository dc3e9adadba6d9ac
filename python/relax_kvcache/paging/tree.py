"""`BlockTree`: blocks over the page pool, token slots, and the block surgery of forks and pops
(TVM's ``ForkSequence`` splits and ``PopN`` trims); callers check requests first."""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from ..errors import CacheFullError, SequenceError
from ._checks import as_int, ceil_div
from .block_pool import Block, BlockPool
from .host_tier import HostTier
from .page_pool import PagePool
from .prefix import PrefixIndex
from .sequences import Sequence


@dataclasses.dataclass(frozen=True, slots=True)
class PageCopy:
    """Copy the first ``length`` slots of page ``src_page`` into ``dst_page``, in every layer."""

    src_page: int
    dst_page: int
    length: int


@dataclasses.dataclass(frozen=True, slots=True)
class PopPlan:
    """What `PagingState.popn` will do, computed before any mutation."""

    freed_blocks: tuple[int, ...]  # unshared blocks dropped whole, last block first
    trim_block: int  # the unshared block trimmed in place, or -1
    trim_pages: int  # pages dropped from the end of ``trim_block``
    trim_length: int  # tokens dropped from ``trim_block``
    remaining: int  # tokens still to pop once a shared block is reached (fork fallback)
    shared_block: int  # the shared block reached when ``remaining > 0``, else -1
    reset_window: bool = False  # the trim pops into a slid block's sink: unslide the block


class BlockTree:
    """Blocks (a tree through their ``parent`` links) and the pool of the pages they hold."""

    def __init__(self, num_pages: int, page_size: int, index: Optional[PrefixIndex] = None,
                 host: Optional[HostTier] = None) -> None:
        self.page_size = page_size
        self.pages = PagePool(num_pages, index, host)
        self.blocks = BlockPool()
        self._lanes = np.arange(page_size, dtype=np.int32)  # in-page offsets

    def slots(self, seq: Sequence, start: int, end: int) -> np.ndarray:
        """int32 KV slots of the positions ``[start, end)`` of ``seq`` (checked range)."""
        parts: list[np.ndarray] = []
        block_end = seq.seq_length
        idx = seq.last_block
        while idx != -1 and block_end > start:
            block = self.blocks[idx]
            block_start = block_end - block.seq_length
            lo, hi = max(start, block_start), min(end, block_end)
            if hi > lo:
                parts.append(self._block_slots(block, lo - block_start, hi - block_start))
            block_end, idx = block_start, block.parent
        if not parts:
            return np.empty(0, dtype=np.int32)
        return parts[0] if len(parts) == 1 else np.concatenate(parts[::-1])

    def trace_blocks(self, last_block: int) -> list[Block]:
        """The blocks of the path ending at ``last_block``, root first."""
        trace = []
        while last_block != -1:
            trace.append(self.blocks[last_block])
            last_block = trace[-1].parent
        return trace[::-1]

    # ------------------------------------------------------------------ checks

    def check_free_pages(self, needed: int, extra: int, what: str) -> None:
        available = self.pages.num_free + extra
        if needed > available:
            raise CacheFullError(f"the KV cache is full: cannot {what}: {needed} page(s) needed, "
                                 f"{available} free")

    def appendable_block(self, seq: Sequence) -> None:
        block = self.blocks[seq.last_block]
        if block.ref_count != 1:
            raise SequenceError(f"the last block {block.index} of sequence {seq.seq_id} is "
                                f"referenced by {block.ref_count - 1} other block(s) and cannot "
                                "accept new tokens (expected exactly 1 reference)")

    def check_committed(self, seq: Sequence) -> None:
        if not seq.accepted_indices_committed:
            raise SequenceError(f"sequence {seq.seq_id} has uncommitted token-tree nodes and "
                                "cannot be forked")

    def fork_position(self, parent: Sequence, fork_pos: object) -> int:
        """``fork_pos`` as a position (-1: the length), after TVM's ForkSequence checks."""
        fork_pos = as_int("fork position", fork_pos)
        if not -1 <= fork_pos <= parent.seq_length:
            raise SequenceError(f"fork position {fork_pos} is out of range [-1, "
                                f"{parent.seq_length}] for parent sequence {parent.seq_id}")
        pos = parent.seq_length if fork_pos == -1 else fork_pos
        self.check_committed(parent)
        if parent.sliding_window_size == -1:
            return pos
        last = self.blocks[parent.last_block]
        sink_size = parent.seq_length - last.seq_length + parent.last_block_attn_sink_size
        if pos > sink_size:
            raise SequenceError(f"fork position {pos} of sequence {parent.seq_id} is past its "
                                "attention sink: a sliding-window sequence can only be forked "
                                f"within {sink_size} tokens")
        return pos

    # ------------------------------------------------------------------ slots

    def block_pages_needed(self, block: Block, length: int) -> int:
        used = block.seq_length - block.sink_length + block.sliding_window_offset + length
        return max(0, -(-used // self.page_size) - len(block.page_ids))

    def _block_slots(self, block: Block, lo: int, hi: int) -> np.ndarray:
        """Slots of the tokens ``[lo, hi)`` of ``block`` (TVM's ``DebugGetKV`` offsets)."""
        sink, shift = block.sink_length, block.sliding_window_offset - block.sink_length
        if lo >= sink:  # no sink token in range: one contiguous run of page slots
            return self._run_slots(block.page_ids, lo + shift, hi + shift)
        if hi <= sink:
            return self._run_slots(block.page_ids, lo, hi)
        head = self._run_slots(block.page_ids, lo, sink)
        return np.concatenate([head, self._run_slots(block.page_ids, sink + shift, hi + shift)])

    def _run_slots(self, page_ids: list[int], lo: int, hi: int) -> np.ndarray:
        """Slots of the contiguous in-block offsets ``[lo, hi)``, as int32."""
        ps = self.page_size
        first = lo // ps
        table = np.array(page_ids[first : ceil_div(hi, ps)], dtype=np.int32) * ps
        grid = (table[:, None] + self._lanes).ravel()
        return grid[lo - first * ps : hi - first * ps]

    def release_path(self, last_block: int) -> None:
        """Drop one sequence's hold on the path ending at ``last_block`` (RemoveSequence)."""
        idx = last_block
        while idx != -1 and self.blocks[idx].ref_count == 1:
            block = self.blocks[idx]
            self.pages.release(block.page_ids)
            parent = block.parent
            self.blocks.free(idx)
            idx = parent
        if idx != -1:
            self.blocks.release(idx)

    # ---------------------------------------------------------------- internals: fork

    def _adds_empty_block(self, parent: Sequence, pos: int) -> bool:
        """Whether forking at ``pos`` first gives the parent a new empty last block."""
        last = self.blocks[parent.last_block]
        return pos == parent.seq_length and pos % self.page_size == 0 and last.seq_length > 0

    def _locate(self, last_block: int, pos: int) -> tuple[int, int]:
        """The block of the path ending at ``last_block`` a fork at ``pos`` cuts, and the offset."""
        trace = self.trace_blocks(last_block)
        for block in trace[:-1]:
            if block.seq_length > pos:
                return block.index, pos
            pos -= block.seq_length
        return trace[-1].index, pos

    def fork_copy_length(self, parent: Sequence, pos: int) -> int:
        """Tokens a fork of ``parent`` at ``pos`` copies into a fresh page (0: no page)."""
        if self._adds_empty_block(parent, pos):
            return 0
        return self._locate(parent.last_block, pos)[1] % self.page_size

    def fork_blocks(self, parent: Sequence, pos: int) -> tuple[int, list[PageCopy]]:
        """Build the child's last block for a fork of ``parent`` at ``pos`` (checks done)."""
        if self._adds_empty_block(parent, pos):
            self._append_empty_block(parent)
        child_idx = self.blocks.new_block()
        forked_idx, offset = self._locate(parent.last_block, pos)
        in_page = offset % self.page_size
        moved_pages = offset // self.page_size
        if moved_pages == 0:
            parent_idx = self.blocks[child_idx].parent = self.blocks[forked_idx].parent
            if parent_idx != -1:
                self.blocks.retain(parent_idx)
        else:
            self._split_block(parent, forked_idx, moved_pages, child_idx)
        child = self.blocks[child_idx]
        child.start_pos = pos - in_page
        child.seq_length = in_page
        if in_page == 0:
            return child_idx, []
        page = self.pages.allocate(1)[0]
        child.page_ids.append(page)
        return child_idx, [PageCopy(self.blocks[forked_idx].page_ids[0], page, in_page)]

    def _append_empty_block(self, seq: Sequence) -> None:
        if seq.sliding_window_size != -1:
            # The old last block becomes a prefix block: the new last block's sink is what is
            # left of the old one (TVM keeps the old value, which makes the sink grow).
            old_length = self.blocks[seq.last_block].seq_length
            seq.last_block_attn_sink_size = max(seq.last_block_attn_sink_size - old_length, 0)
        idx = self.blocks.new_block()
        block = self.blocks[idx]
        block.start_pos = seq.seq_length
        block.parent = seq.last_block  # the old last block's reference moves to this block
        self.blocks.retain(idx)
        seq.last_block = idx

    def _split_block(self, seq: Sequence, forked_idx: int, moved_pages: int, child_idx: int
                     ) -> None:
        """Move the first ``moved_pages`` pages of ``forked_idx`` into a new shared parent."""
        head_idx = self.blocks.new_block()
        head, forked = self.blocks[head_idx], self.blocks[forked_idx]
        moved = moved_pages * self.page_size
        head.parent = forked.parent
        forked.parent = head_idx
        self.blocks[child_idx].parent = head_idx
        self.blocks.retain(head_idx, 2)
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

    # ------------------------------------------------------------------- popn

    def plan_pop(self, seq: Sequence, n: int) -> PopPlan:
        freed: list[int] = []
        idx = seq.last_block
        while idx != -1 and self.blocks[idx].ref_count == 1:
            block = self.blocks[idx]
            if n > block.seq_length:
                n -= block.seq_length
                freed.append(idx)
                idx = block.parent
                continue
            left = block.seq_length - n
            # popping to or into a slid block's sink: only sink tokens are left, at their slots
            reset = left <= block.sink_length
            used = left if reset else left - block.sink_length + block.sliding_window_offset
            drop = max(0, len(block.page_ids) - ceil_div(used, self.page_size))
            return PopPlan(tuple(freed), idx, drop, n, 0, -1, reset)
        return PopPlan(tuple(freed), -1, 0, 0, n, idx)

    def check_pop_fork(self, seq: Sequence, plan: PopPlan) -> None:
        """Check, before trimming, that the fork fallback of `popn` will succeed."""
        trimmed = sum(self.blocks[i].seq_length for i in plan.freed_blocks)
        pos = seq.seq_length - trimmed - plan.remaining
        self.check_committed(seq)  # a re-fork inside the prefix blocks: no sink check
        if self._locate(plan.shared_block, pos)[1] % self.page_size == 0:
            return
        freed_pages = sum(len(self.blocks[i].page_ids) for i in plan.freed_blocks)
        what = f"pop {plan.remaining} shared tokens from sequence {seq.seq_id}"
        self.check_free_pages(1, freed_pages, what)

    def apply_trim(self, seq: Sequence, plan: PopPlan) -> None:
        for idx in plan.freed_blocks:
            block = self.blocks[idx]
            self.pages.release(block.page_ids)
            seq.seq_length -= block.seq_length
            seq.last_block = block.parent  # the freed block's reference passes to the parent
            self.blocks.free(idx)
        if plan.freed_blocks:
            self.recompute_last_sink(seq)
        if plan.trim_block == -1:
            return
        block = self.blocks[plan.trim_block]
        if plan.trim_pages:
            dropped = block.page_ids[-plan.trim_pages :]
            del block.page_ids[-plan.trim_pages :]
            self.pages.release(reversed(dropped))
        block.seq_length -= plan.trim_length
        seq.seq_length -= plan.trim_length
        if plan.reset_window:
            block.sink_length = 0
            block.sliding_window_offset = 0

    def recompute_last_sink(self, seq: Sequence) -> None:
        """A windowed sequence's last-block sink from its ``attn_sink_size`` and prefix."""
        if seq.sliding_window_size != -1:
            prefix = seq.seq_length - self.blocks[seq.last_block].seq_length
            seq.last_block_attn_sink_size = max(seq.attn_sink_size - prefix, 0)
