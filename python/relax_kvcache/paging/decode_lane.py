"""`DecodeLane`: a batch of sequences that grows by one token per step, as flat arrays that
`advance` updates with numpy; valid while the paging state is at its version."""

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
    """Flat view of a decode batch of B sequences (int64 [B] arrays), advanced by `PagingState`."""

    version: int  # the PagingState.version the arrays describe
    seq_ids: tuple[int, ...]
    seq_length: np.ndarray
    block_length: np.ndarray  # tokens in each last block
    page_capacity: np.ndarray  # token slots of the pages each last block holds
    last_page: np.ndarray  # id of each last block's last page (-1: none)
    _pairs: tuple[tuple[Sequence, Block], ...] = dataclasses.field(repr=False)


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
    def array(values: list[int]) -> np.ndarray:
        return np.array(values, dtype=np.int64)

    return DecodeLane(
        version=version,
        seq_ids=tuple(seq_ids),
        seq_length=array([s.seq_length for s in lane_seqs]),
        block_length=array([b.seq_length for b in lane_blocks]),
        page_capacity=array([len(b.page_ids) * page_size for b in lane_blocks]),
        last_page=array([b.page_ids[-1] if b.page_ids else -1 for b in lane_blocks]),
        _pairs=tuple(zip(lane_seqs, lane_blocks)),
    )


def advance(lane: DecodeLane, full: np.ndarray, pages: PagePool, page_size: int, version: int
            ) -> None:
    """Append one token to every sequence of ``lane``, a page to the last blocks at ``full``."""
    if len(full):
        new_pages = pages.allocate(len(full))
        pairs = lane._pairs
        for i, page in zip(full.tolist(), new_pages):
            pairs[i][1].page_ids.append(page)
        lane.page_capacity[full] += page_size
        lane.last_page[full] = new_pages
    for seq, block in lane._pairs:  # last_append_length is 1 already (see open_lane)
        seq.seq_length += 1
        block.seq_length += 1
    lane.seq_length += 1
    lane.block_length += 1
    lane.version = version
