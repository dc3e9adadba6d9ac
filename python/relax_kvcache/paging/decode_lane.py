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
    """A decode batch of B sequences, advanced by `PagingState`. The free token slots of each
    last block's pages are ``room - pending`` (``room`` int64 [B] is brought up to date only
    when some block fills up: a step where ``min_room > pending`` appends without a page)."""

    version: int  # the PagingState.version the lane describes
    seq_ids: tuple[int, ...]
    room: np.ndarray  # free slots of each last block's pages, ``pending`` steps ago
    min_room: int  # room.min()
    pending: int  # steps advanced since ``room`` was updated
    _pairs: tuple[tuple[Sequence, Block], ...] = dataclasses.field(repr=False)

    def full_rows(self) -> np.ndarray:
        """The rows whose last block needs a page for the next token (sorted)."""
        if self.min_room > self.pending:
            return _NO_ROWS
        return np.flatnonzero(self.room == self.pending)


_NO_ROWS = np.zeros(0, dtype=np.int64)
_NO_ROWS.flags.writeable = False


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
    room = np.array([len(b.page_ids) * page_size - b.seq_length for b in lane_blocks], dtype=np.int64)
    return DecodeLane(version=version, seq_ids=tuple(seq_ids), room=room, min_room=int(room.min()) if room.size else 0, pending=0,
                      _pairs=tuple(zip(lane_seqs, lane_blocks)))


def last_slots(lane: DecodeLane, page_size: int) -> np.ndarray:
    """int64 [B]: the KV slot of each sequence's last token (page * page_size + offset)."""
    return np.array([b.page_ids[-1] * page_size + (b.seq_length - 1) % page_size if b.page_ids else -1
                     for _, b in lane._pairs], dtype=np.int64)


def advance(lane: DecodeLane, full: np.ndarray, pages: PagePool, page_size: int, version: int) -> list[int]:
    """Append one token to every sequence of ``lane``, a page to the last blocks at ``full``
    (`DecodeLane.full_rows`); the pages, in the order of ``full``."""
    new_pages: list[int] = []
    if len(full):
        new_pages = pages.allocate(len(full))
        pairs = lane._pairs
        for i, page in zip(full.tolist(), new_pages):
            pairs[i][1].page_ids.append(page)
        room = lane.room
        room -= lane.pending
        room[full] += page_size
        room -= 1
        lane.pending, lane.min_room = 0, int(room.min())
    else:
        lane.pending += 1
    for seq, block in lane._pairs:  # last_append_length is 1 already (see open_lane)
        seq.seq_length += 1
        block.seq_length += 1
    lane.version = version
    return new_pages
