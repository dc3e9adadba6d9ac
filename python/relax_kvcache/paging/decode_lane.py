"""`DecodeLane`: a batch of sequences that grows by one token per step, advanced without
re-reading its blocks; valid while the paging state is at its version."""

from __future__ import annotations

import collections.abc
import dataclasses

import numpy as np

from ._checks import ceil_div
from .block_pool import Block, BlockPool
from .page_pool import PagePool
from .sequences import Sequence


@dataclasses.dataclass(eq=False)
class DecodeLane:
    """A decode batch of B sequences, advanced by `PagingState`. ``fills[t]`` lists (ascending)
    the rows whose last block is full before the lane's ``t``-th token: those take a page then,
    and fill again ``page_size`` tokens later; a step with no entry appends without a page."""

    version: int  # the PagingState.version the lane describes
    seq_ids: tuple[int, ...]
    steps: int  # tokens appended to each sequence since the lane opened
    lagging: int  # steps advanced whose token is not in the lengths yet (`settle`)
    fills: dict[int, list[int]] = dataclasses.field(repr=False)
    _pairs: tuple[tuple[Sequence, Block], ...] = dataclasses.field(repr=False)

    def full_rows(self) -> collections.abc.Sequence[int]:
        """The rows whose last block needs a page for the next token (ascending)."""
        return self.fills.get(self.steps, ())


def open_lane(seqs: dict[int, Sequence], blocks: BlockPool, page_size: int, version: int,
              seq_ids: collections.abc.Sequence[int]) -> DecodeLane | None:
    """A lane over ``seq_ids``, or None unless every sequence is live, distinct, plain (no window,
    no uncommitted tree), grew by one token last step and owns its unslid last block."""
    lane_seqs, lane_blocks = [], []
    for seq_id in seq_ids:
        seq = seqs.get(seq_id) if type(seq_id) is int else None
        if (seq is None or seq.sliding_window_size != -1 or not seq.accepted_indices_committed
                or seq.last_append_length != 1):
            return None
        block = blocks[seq.last_block]
        if (block.ref_count != 1 or block.sink_length or block.sliding_window_offset
                or len(block.page_ids) != ceil_div(block.seq_length, page_size)):
            return None
        lane_seqs.append(seq)
        lane_blocks.append(block)
    if len(set(map(id, lane_seqs))) != len(lane_seqs):
        return None
    fills: dict[int, list[int]] = {}
    for row, block in enumerate(lane_blocks):  # a last block fills after its free slots
        fills.setdefault(len(block.page_ids) * page_size - block.seq_length, []).append(row)
    return DecodeLane(version=version, seq_ids=tuple(seq_ids), steps=0, lagging=0, fills=fills,
                      _pairs=tuple(zip(lane_seqs, lane_blocks)))


def last_slots(lane: DecodeLane, page_size: int) -> np.ndarray:
    """int64 [B]: the KV slot of each sequence's last token (page * page_size + offset)."""
    return np.array([b.page_ids[-1] * page_size + (b.seq_length - 1) % page_size if b.page_ids else -1
                     for _, b in lane._pairs], dtype=np.int64)


def advance(lane: DecodeLane, full: collections.abc.Sequence[int], pages: PagePool, page_size: int,
            version: int) -> list[int]:
    """Append one token to every sequence of ``lane``, a page to the last blocks at ``full``
    (`DecodeLane.full_rows`); the pages, in its order. The lengths are left to `settle`."""
    new_pages: list[int] = []
    if full:
        new_pages = pages.allocate(len(full))
        pairs = lane._pairs
        for row, page in zip(full, new_pages):
            pairs[row][1].page_ids.append(page)
        del lane.fills[lane.steps]
        lane.fills[lane.steps + page_size] = list(full)  # each new page holds this token and page_size - 1 more
    lane.steps += 1
    lane.lagging += 1
    lane.version = version
    return new_pages


def settle(lane: DecodeLane) -> None:
    """Add the tokens `advance` appended to the lengths of the lane's sequences and blocks."""
    n, lane.lagging = lane.lagging, 0
    if n:
        for seq, block in lane._pairs:
            seq.seq_length += n
            block.seq_length += n
