"""A batch of appends of the paging layer (`PagingState.reserve_append`): planned whole, then
applied. Windowed sequences that slide are applied by :mod:`relax_kvcache.paging.windows`."""

from __future__ import annotations

import collections.abc
from typing import Callable

from ..errors import KVCacheError, SequenceError
from ._checks import check_append_length
from .sequences import Sequence
from .tree import BlockTree
from .windows import Item


def plan(seqs: dict[int, Sequence], tree: BlockTree, seq_ids: collections.abc.Sequence[int],
         lengths: collections.abc.Sequence[int], lookup: Callable[[object], Sequence]
         ) -> tuple[list[Item], int]:
    """The batch as items, and the pages they need in all (before sliding); ``lookup`` finds a
    sequence by id or raises. Raises on any bad entry."""
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
            length = check_append_length(seq, length)
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
