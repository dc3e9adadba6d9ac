"""A batch of appends (`PagingState.reserve_append`): planned whole, then applied; windowed
sequences slide as TVM's ``SlideWindowForSequence`` (with attention sinks). Also the checks of
``EnableSlidingWindowForSeq``."""

from __future__ import annotations

import collections.abc
import typing
from typing import Callable

from ..errors import CacheFullError, KVCacheError, SequenceError
from ._checks import as_int
from .block_pool import Block
from .page_pool import PagePool
from .sequences import Sequence
from .tree import BlockTree

TEMP_PAGE = -1  # TVM's kPagedKVCacheTempPageId: a page borrowed until sliding frees one

#: A `reserve_append` entry: sequence, last block, tokens to append, pages needed before sliding.
Item = typing.Tuple[Sequence, Block, int, int]


class SlidePlan(typing.NamedTuple):
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


class BatchPages:
    """The page pool of one `reserve_append` batch: records the slid-out pages handed to new
    tokens of the same batch (``reused``)."""

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


def check_window(seq: Sequence, window_size: object, sink_size: object, prefix: int,
                 slides: bool) -> tuple[int, int]:
    """``(window_size, sink_size)`` checked for ``seq``, whose earlier blocks hold ``prefix``."""
    window_size = as_int("sliding window size", window_size)
    sink_size = as_int("attention sink size", sink_size)
    checks = (("attention sink", sink_size, 0), ("sliding window", window_size, 1))
    for name, value, least in checks:
        if value < least:
            raise SequenceError(f"{name} size {value} for sequence {seq.seq_id} is invalid: "
                                f"expected >= {least}")
    if sink_size >= window_size:
        raise SequenceError(f"attention sink size {sink_size} for sequence {seq.seq_id} must be "
                            f"less than the sliding window size {window_size}")
    if seq.sliding_window_size != -1:
        raise SequenceError(f"sequence {seq.seq_id} already has a sliding window (size "
                            f"{seq.sliding_window_size}); it cannot be enabled twice")
    if slides and window_size < prefix:
        raise SequenceError(f"sliding window size {window_size} for sequence {seq.seq_id} is "
                            f"smaller than its {prefix}-token prefix in shared blocks, which "
                            f"cannot slide: expected a window >= {prefix} (every later append "
                            "would fail)")
    return window_size, sink_size


def plan_sliding(items: list[Item], pages: PagePool, page_size: int) -> list[SlidePlan | None]:
    """Plan `reserve_append` when windows slide, in batch order as TVM (freed pages are handed
    out next); one plan per item (None: nothing slides or is borrowed)."""
    free = pages.num_free
    taken = freed = 0  # pages taken from / returned to the pool so far in the batch
    plans: list[SlidePlan | None] = []
    for seq, block, length, need in items:
        window = seq.sliding_window_size
        if window == -1 or (seq.seq_length + length <= window and need <= free):
            plan, got, back = None, need, 0  # nothing slides, nothing is borrowed
        else:
            plan = plan_slide(seq, block, length, need, free, page_size)
            got, back = plan.real + plan.temps_left, plan.freed
        taken += got
        freed += back
        if got > free + back:
            raise CacheFullError(f"the KV cache is full: cannot append to {len(items)} "
                                 f"sequence(s): {taken} page(s) needed, {pages.num_free + freed} "
                                 f"free (counting {freed} page(s) freed by sliding windows) by "
                                 f"sequence {seq.seq_id} of the batch")
        free += back - got
        plans.append(plan)
    return plans


def apply_sliding(items: list[Item], plans: list[SlidePlan | None], pages: PagePool
                  ) -> tuple[int, ...]:
    """Carry out `plan_sliding`'s plans; the slid-out pages allocated again in the batch."""
    pool = BatchPages(pages)
    for (seq, block, length, need), plan in zip(items, plans):
        seq.last_append_length = length
        if plan is None:
            if need:
                block.page_ids.extend(pool.allocate(need))
            block.seq_length += length
            seq.seq_length += length
        else:
            apply_slide(seq, block, plan, pool)
    return tuple(pool.reused)


def plan_slide(seq: Sequence, block: Block, length: int, need: int, free: int, page_size: int
               ) -> SlidePlan:
    """Plan one windowed sequence's append and slide with ``free`` pages left at its turn."""
    ps = page_size
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
                raise KVCacheError(f"cannot slide sequence {seq.seq_id}: its last block "
                                   f"{block.index} has slid without a sink (window offset "
                                   f"{offset}) but the sequence now has a "
                                   f"{seq.last_block_attn_sink_size}-token sink")
            sink = offset = seq.last_block_attn_sink_size
        if block_length - slide < sink:
            prefix = seq.seq_length - block.seq_length
            raise SequenceError(f"cannot slide sequence {seq.seq_id} by {slide} token(s): its "
                                f"window of {window} token(s) is smaller than its {prefix}-token "
                                "prefix in earlier blocks (which cannot slide) plus its "
                                f"{sink}-token sink; its last block would keep "
                                f"{block_length - slide} token(s)")
        first_slid = -(-sink // ps)
        page_after, in_page = divmod(offset + slide, ps)
        if page_after > first_slid:
            dropped = page_after - first_slid
            page_after = first_slid
            # Temporary pages come after the block's pages and the real new ones.
            real_end = len(block.page_ids) + real
            freed = max(0, min(first_slid + dropped, real_end) - first_slid)
        elif page_after < first_slid - 1:  # TVM's check; cannot fail while offset >= sink
            raise KVCacheError(f"cannot slide sequence {seq.seq_id}: window offset {offset} lies "
                               f"before its {sink}-token sink")
        offset = page_after * ps + in_page
        block_length -= slide
        seq_length = window
    pages_after = len(block.page_ids) + need - dropped
    if pages_after != -(-(block_length - sink + offset) // ps):
        raise KVCacheError(f"cannot slide sequence {seq.seq_id}: its last block {block.index} "
                           f"would hold {pages_after} page(s) for {block_length} token(s) (sink "
                           f"{sink}, window offset {offset})")
    temp = need - real
    return SlidePlan(
        real, temp, sink, first_slid, dropped, freed, temp - (dropped - freed),
        block_length, offset, seq_length,
    )


def apply_slide(seq: Sequence, block: Block, plan: SlidePlan, pool: BatchPages) -> None:
    """Carry out a `plan_slide` plan, in TVM's order of page operations."""
    page_ids = block.page_ids
    if plan.real:
        page_ids.extend(pool.allocate(plan.real))
    if plan.temp:
        page_ids.extend([TEMP_PAGE] * plan.temp)
    if plan.dropped:
        first, last = plan.first_slid, plan.first_slid + plan.dropped
        released = [p for p in page_ids[first:last] if p != TEMP_PAGE]
        del page_ids[first:last]
        pool.release(released)
    block.sink_length = plan.sink_length
    block.sliding_window_offset = plan.window_offset
    block.seq_length = plan.block_length
    seq.seq_length = plan.seq_length
    if plan.temps_left:
        temps = [i for i, p in enumerate(page_ids) if p == TEMP_PAGE]
        for i, page in zip(temps, pool.allocate(len(temps))):
            page_ids[i] = page


def plan(seqs: dict[int, Sequence], tree: BlockTree, seq_ids: collections.abc.Sequence[int],
         lengths: collections.abc.Sequence[int], lookup: Callable[[object], Sequence]
         ) -> tuple[list[Item], int]:
    """The batch as items, and the pages they need in all (before sliding)."""
    if len(seq_ids) != len(lengths):
        raise KVCacheError(f"got {len(seq_ids)} sequence ids but {len(lengths)} append lengths")
    items: list[Item] = []
    seen: set[int] = set()
    total = 0
    blocks = tree.blocks
    for raw_id, length in zip(seq_ids, lengths):  # per-step hot loop: the checks only on a miss
        seq = seqs.get(raw_id) if type(raw_id) is int else None
        if seq is None or type(length) is not int or length < 1 or seq.seq_id in seen:
            seq = lookup(raw_id)
            if seq.seq_id in seen:
                raise SequenceError(f"sequence {seq.seq_id} appears more than once in the batch")
            length = as_int("append length", length)
            if length < 1:
                raise SequenceError(f"append length {length} for sequence {seq.seq_id} is invalid: expected >= 1")
        block = blocks[seq.last_block]
        if block.ref_count != 1:
            tree.appendable_block(seq)  # raises
        seen.add(seq.seq_id)
        need = tree.block_pages_needed(block, length)
        total += need
        items.append((seq, block, length, need))
    return items, total


def apply(items: list[Item], pages: list[int]) -> None:
    """Give each item its pages (the batch's, in order) and its tokens (no window slides)."""
    at = 0
    for seq, block, length, need in items:
        if need:
            block.page_ids.extend(pages[at : at + need])
            at += need
        block.seq_length += length
        seq.seq_length += length
        seq.last_append_length = length
