"""Repeated decode steps: update the previous step's metadata with numpy instead of planning
again (the same `StepMetadata` as the full planner's; docs/architecture.md).

A step qualifies when the previous one was a plain decode step of the same batch (decode
kernel at every depth, no token trees, no sliding sequences) and nothing changed the paging
state since; growth adds the same pages to the coalesced and uncoalesced counts, so it cannot
switch a depth to the coalesced prefill kernel.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import numpy as np
from tvm.runtime import ShapeTuple

from . import metadata as md
from .config import LayerSpan
from .paging import DecodeLane, PagingState


class DecodePlanner:
    """Derives a decode step's `StepMetadata` from the previous one (see module docstring)."""

    def __init__(self, page_size: int, layer_span: LayerSpan = LayerSpan()) -> None:
        self._page_size = page_size
        self._span = layer_span
        self._lane: Optional[DecodeLane] = None
        self._step: Optional[md.StepMetadata] = None
        self._last_depth_rows: tuple[np.ndarray, ...] = ()
        self._ones: tuple[int, ...] = ()

    def start(self, paging: PagingState, step: md.StepMetadata, last_depths: Sequence[int]) -> bool:
        """Remember a fully planned step; whether it qualifies (then `next_step` can follow it)."""
        self._lane, self._step = None, None
        qualifies = (step.append_before_attn and step.ragged_tree is None
                     and all(n == 1 for n in step.append_lengths)
                     and all(d.use_decode_kernel and d.tree is None for d in step.depths))
        lane = paging.open_lane(step.seq_ids) if qualifies else None
        if lane is None:
            return False
        depth_of = np.asarray(last_depths, dtype=np.int64)
        self._last_depth_rows = tuple(np.flatnonzero(depth_of == d) for d in range(len(step.depths)))
        self._lane, self._step = lane, step
        self._ones = (1,) * len(step.seq_ids)
        return True

    def next_step(self, paging: PagingState, seq_ids: Any, append_lengths: Any) -> Optional[md.StepMetadata]:
        """The step ``begin_forward(seq_ids, append_lengths)``, its pages reserved, when it repeats
        the remembered batch with one token each; else None (the caller plans it in full)."""
        lane, prev = self._lane, self._step
        if (lane is None or lane.version != paging.version or not _is_int_tuple(seq_ids, lane.seq_ids)
                or not _is_int_tuple(append_lengths, self._ones)):
            return None
        positions = lane.seq_length.astype(np.int32)
        full = lane.block_length >= lane.page_capacity
        paging.advance_lane(lane)
        ps = self._page_size
        append_position = (lane.last_page * ps + (lane.block_length - 1) % ps).astype(np.int32)
        depths = tuple(self._grow_depth(depth, rows, full, lane, positions)
                       for depth, rows in zip(prev.depths, self._last_depth_rows))
        step = dataclasses.replace(prev, k_ragged_rope_pos_offset=positions, q_rope_position=positions,
                                   append_position=append_position, depths=depths)
        self._step = step
        return step

    def _grow_depth(self, depth: md.DepthMetadata, rows: np.ndarray, full: np.ndarray,
                    lane: DecodeLane, positions: np.ndarray) -> md.DepthMetadata:
        """``depth`` after the sequences ``rows`` (whose last block it attends) grew by one."""
        if not rows.size:
            return self._with_window(depth, positions)
        page_indptr, page_indices = depth.page_indptr, depth.page_indices
        grown = rows[full[rows]]
        if grown.size:
            page_indices = np.insert(page_indices, page_indptr[grown + 1], lane.last_page[grown])
            added = np.zeros(page_indptr.size, dtype=np.int32)
            added[grown + 1] = 1
            page_indptr = page_indptr + np.cumsum(added, dtype=np.int32)
        length_info = depth.length_info.copy()
        last_page_len = length_info[0] if length_info.ndim == 2 else length_info
        if rows.size == last_page_len.size:  # every sequence ends at this depth
            last_page_len[:] = (lane.seq_length - depth.k_rope_pos_offset - 1) % self._page_size + 1
        else:
            chain = lane.seq_length[rows] - depth.k_rope_pos_offset[rows]
            last_page_len[rows] = (chain - 1) % self._page_size + 1
        grown_depth = dataclasses.replace(depth, page_indptr=page_indptr, page_indices=page_indices,
                                          length_info=length_info)
        return self._with_window(grown_depth, positions)

    def _with_window(self, depth: md.DepthMetadata, positions: np.ndarray) -> md.DepthMetadata:
        """``depth`` with the window pages of queries at ``positions`` (local layers only)."""
        if depth.window is None:
            return depth
        last_page_len = depth.length_info[0] if depth.length_info.ndim == 2 else depth.length_info
        window = md.window_pages(depth.page_indptr, depth.page_indices, last_page_len, depth.k_rope_pos_offset,
                                 positions, self._span, self._page_size)
        return dataclasses.replace(depth, window=window)

    @property
    def current(self) -> Optional[md.StepMetadata]:
        """The remembered step (the last one planned or derived, when it qualifies)."""
        return self._step


def _is_int_tuple(values: Any, expected: tuple) -> bool:
    """Whether ``values`` holds exactly the ints ``expected`` (not bools or floats, which the full
    planner refuses)."""
    if isinstance(values, ShapeTuple):  # a tuple of Python ints
        return tuple(values) == expected
    return (isinstance(values, (tuple, list)) and len(values) == len(expected)
            and all(type(v) is int for v in values) and tuple(values) == expected)
