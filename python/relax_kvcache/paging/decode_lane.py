"""`DecodeLane`: a batch of sequences that grows by one token per step, advanced without
re-reading its blocks; valid while the paging state is at its version."""

from __future__ import annotations

import collections.abc
import dataclasses
import itertools
import operator
import struct

import numpy as np

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
    _seqs: tuple[Sequence, ...] = dataclasses.field(repr=False)
    _blocks: tuple[Block, ...] = dataclasses.field(repr=False)  # each sequence's last block


def open_lane(seqs: dict[int, Sequence], blocks: BlockPool, page_size: int, version: int,
              seq_ids: collections.abc.Sequence[int], fresh: bool = False) -> DecodeLane | None:
    """A lane over ``seq_ids``, or None unless every sequence is live, distinct, plain (no window,
    no uncommitted tree) and owns its unslid last block, which is its only block (``fresh``) or
    else grew by one token last step."""
    lane_seqs: list[Sequence] = []
    lane_blocks: list[Block] = []
    fills: dict[int, list[int]] = {}  # rows by the free slots of their last blocks
    get, ps, table = seqs.get, page_size, blocks.table
    for row, seq_id in enumerate(seq_ids):  # per-step hot loop
        seq = get(seq_id) if type(seq_id) is int else None
        if (seq is None or seq.sliding_window_size != -1 or not seq.accepted_indices_committed
                or (seq.last_append_length != 1 and not fresh)):
            return None
        block = table[seq.last_block]
        free = len(block.page_ids) * ps - block.seq_length
        if (block.ref_count != 1 or block.sink_length or block.sliding_window_offset or not 0 <= free < ps
                or (fresh and (block.parent != -1 or block.start_pos))):
            return None
        lane_seqs.append(seq)
        lane_blocks.append(block)
        if free in fills:
            fills[free].append(row)
        else:
            fills[free] = [row]
    if len(set(seq_ids)) != len(lane_seqs):
        return None
    return DecodeLane(version=version, seq_ids=tuple(seq_ids), steps=0, lagging=0, fills=fills,
                      _seqs=tuple(lane_seqs), _blocks=tuple(lane_blocks))


def last_slots(lane: DecodeLane, page_size: int) -> np.ndarray:
    """int64 [B]: the KV slot of each sequence's last token (page * page_size + offset)."""
    return np.array([b.page_ids[-1] * page_size + (b.seq_length - 1) % page_size if b.page_ids else -1
                     for b in lane._blocks], dtype=np.int64)


#: Most rows whose token arrays `first_step` computes in Python (numpy pays off above it).
PYTHON_ROWS = 24
_PAGE_IDS, _SEQ_LENGTH = operator.attrgetter("page_ids"), operator.attrgetter("seq_length")


def int32_array(values: collections.abc.Iterable[int], count: int) -> np.ndarray:
    """A new int32 array of the ``count`` Python ints ``values`` (packed above a few dozen:
    faster than numpy's conversion of Python ints)."""
    if count < 48:
        return np.array(values if type(values) is list else list(values), dtype=np.int32)
    return np.frombuffer(bytearray(struct.pack(f"{count}i", *values)), dtype=np.int32)


def first_step(lane: DecodeLane, page_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The int32 arrays of the step a lane of single-block sequences has just advanced by its
    first token: its tokens (positions [B], positions again, slots [B], last-page lengths [B]),
    page_indptr [B + 1] and page_indices."""
    blocks, b = lane._blocks, len(lane._blocks)
    pages = list(map(_PAGE_IDS, blocks))
    positions = list(map(_SEQ_LENGTH, blocks))  # the lengths lag the new token
    lasts = list(map(operator.itemgetter(-1), pages))
    if b <= PYTHON_ROWS:
        offsets = [position % page_size for position in positions]
        tokens = int32_array(positions + positions + [last * page_size + offset for last, offset in zip(lasts, offsets)]
                             + [offset + 1 for offset in offsets], 4 * b)
    else:
        both, ps = int32_array(positions + lasts, 2 * b), np.int32(page_size)
        offsets, slots = both[:b] % ps, both[b:]
        slots *= ps
        slots += offsets
        offsets += np.int32(1)
        tokens = np.concatenate((both[:b], both[:b], slots, offsets))
    page_indptr = int32_array(itertools.accumulate(map(len, pages), initial=0), b + 1)
    page_indices = int32_array(itertools.chain.from_iterable(pages), int(page_indptr[-1]))
    return tokens, page_indptr, page_indices


def advance(lane: DecodeLane, full: collections.abc.Sequence[int], pages: PagePool, page_size: int,
            version: int) -> list[int]:
    """Append one token to every sequence of ``lane``, a page to the last blocks at ``full``
    (``lane.fills[lane.steps]``; no more than the free pages); the pages, in its order. The
    lengths are left to `settle`."""
    if not lane.steps:  # a fresh lane's sequences may have appended more tokens last step
        for seq in lane._seqs:
            seq.last_append_length = 1
    new_pages: list[int] = []
    if full:
        new_pages = pages.take(len(full))
        blocks = lane._blocks
        for row, page in zip(full, new_pages):
            blocks[row].page_ids.append(page)
        fills = lane.fills  # each new page holds this token and page_size - 1 more:
        fills[lane.steps + page_size] = fills.pop(lane.steps)  # the same rows fill again then
    lane.steps += 1
    lane.lagging += 1
    lane.version = version
    return new_pages


def settle(lane: DecodeLane) -> None:
    """Add the tokens `advance` appended to the lengths of the lane's sequences and blocks."""
    n, lane.lagging = lane.lagging, 0
    if n:
        for seq, block in zip(lane._seqs, lane._blocks):
            seq.seq_length += n
            block.seq_length += n
