"""Repeated decode steps: update the previous step's metadata instead of planning again (the
same `StepMetadata` as the full planner's; docs/architecture.md).

A step qualifies when the previous one was a plain decode step of the same batch (decode kernel
at every depth, no token trees, no sliding sequences) and nothing changed the paging state since.
Each new token sits one position and slot after the previous one (a page's first slot where the
last block took a page); each last page at the sequences' last depth holds one more token.
"""

from __future__ import annotations

import itertools
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np
from tvm.runtime import ShapeTuple

from . import metadata as md
from .config import LayerSpan
from .paging import DecodeLane, PagingState
from .paging.decode_lane import first_step, last_slots


class DecodePlanner:
    """Derives a decode step's `StepMetadata` from the previous one (see module docstring)."""

    def __init__(self, page_size: int, layer_span: LayerSpan = LayerSpan()) -> None:
        self._page_size = page_size
        self._span = layer_span
        self._lane: Optional[DecodeLane] = None
        self._step: Optional[md.StepMetadata] = None
        self._opening: Optional[Tuple[int, Sequence[int]]] = None  # (paging version, last depths) of _step
        # per depth: the rows (sequences) whose last block it attends, and whether that is all
        self._last_depth_rows: Tuple[Tuple[np.ndarray, bool], ...] = ()
        self._ones: Tuple[int, ...] = ()
        self._tokens = np.zeros(0, dtype=np.int32)  # the last step's `plain_tokens` (a plain step's)
        self._plain = False
        self._plain_step: Optional[md.StepMetadata] = None
        self._ones_like_tokens = self._tokens
        # window pages of the step before, by its page lists: id -> (page_indices, WindowPages, drop)
        self._windows: Dict[int, Tuple[np.ndarray, md.WindowPages, np.ndarray]] = {}
        self._next_windows: Dict[int, Tuple[np.ndarray, md.WindowPages, np.ndarray]] = {}
        self._ps = np.int32(page_size)  # numpy scalars: cheaper operands than Python ints
        # a plain step's window pages (local layers): its length_info [3, B] and k_rope_pos_offset
        # [B], views of one array (None without a window), and the pages dropped from each list
        self._win: Optional[np.ndarray] = None
        self._win_drop = np.zeros(0, dtype=np.int32)
        # until the lane's step _win_until, `_win` gains _win_step [4B] a step (`_window_events`),
        # and the windows of the rows _win_drops[step] lose their first page at that step
        self._win_until, self._win_step = 0, np.zeros(0, dtype=np.int32)
        self._win_drops: Dict[int, Tuple[int, ...]] = {}
        # by batch size: `fresh`'s step (its constant arrays shared, read-only), and the ones and
        # last-depth rows a lane of that size needs
        self._fresh: Dict[int, Tuple[md.StepMetadata, np.ndarray, Tuple[Tuple[np.ndarray, bool]]]] = {}
        # what page lists' indptr of a size gains when a group of rows takes pages (`_shift`); the
        # lane's rows fill in the same groups every page_size steps
        self._shifts: Dict[Tuple[int, Tuple[int, ...]], np.ndarray] = {}

    def start(self, paging: PagingState, step: md.StepMetadata, last_depths: Sequence[int]) -> bool:
        """Remember a fully planned step; whether it may be followed by `next_step` (its lane,
        whose sequences must qualify too, opens when the batch repeats)."""
        self._lane, self._step, self._opening, self._windows, self._plain_step = None, None, None, {}, None
        self._win = None
        qualifies = (step.append_before_attn and step.ragged_tree is None
                     and all(n == 1 for n in step.append_lengths)
                     and all(d.use_decode_kernel and d.tree is None for d in step.depths))
        if qualifies:
            self._step, self._opening = step, (paging.version, last_depths)
            self._ones = (1,) * len(step.seq_ids)
        return qualifies

    def _open(self, paging: PagingState, last_depths: Sequence[int]) -> Optional[DecodeLane]:
        """The lane of the remembered step's batch (see `PagingState.open_lane`), or None."""
        step = self._step
        lane = paging.open_lane(step.seq_ids)
        if lane is None:
            return None
        depth_of = np.asarray(last_depths, dtype=np.int64)
        rows = [np.flatnonzero(depth_of == d) for d in range(len(step.depths))]
        self._last_depth_rows = tuple((r, r.size == depth_of.size) for r in rows)
        # one depth holding every sequence's last block: the common case
        depth = step.depths[0]
        self._plain = len(step.depths) == 1 and self._last_depth_rows[0][1] and depth.length_info.ndim == 1
        positions = step.q_rope_position.astype(np.int32)
        parts = [positions, positions, last_slots(lane, self._page_size)]
        if self._plain:  # and the last-page lengths
            parts.append(depth.length_info)
        self._tokens = np.concatenate(parts).astype(np.int32)
        self._win = None
        if self._plain and depth.window is not None:
            window = depth.window
            self._start_window(np.concatenate((window.length_info.ravel(), window.k_rope_pos_offset)).astype(np.int32))
            self._win_drop = (np.diff(depth.page_indptr) - np.diff(window.page_indptr)).astype(np.int32)
        self._ones_like_tokens = np.ones_like(self._tokens)
        self._lane, self._shifts = lane, {}
        return lane

    def repeat(self, paging: PagingState, seq_ids: Any, append_lengths: Any) -> Optional[md.StepMetadata]:
        """`next_step`'s common case, or None: a batch (a ``ShapeTuple``, as ``vm.builtin``
        passes it) that repeats a plain step (`plain_tokens`). Its token arrays and last-page
        lengths (views of one array) were made here and are no one else's: they are updated in
        place (the step before has ended). Where no last page fills, the step is the one
        before; else a new one with those lists grown."""
        prev, lane = self._plain_step, self._lane
        if (prev is None or type(seq_ids) is not ShapeTuple or type(append_lengths) is not ShapeTuple
                or lane.version != paging.version or seq_ids != prev.seq_ids or append_lengths != self._ones):
            return None
        full, new_pages = paging.advance_lane(lane)
        self._tokens += self._ones_like_tokens
        if not full and self._win is None:
            return prev
        self._new_pages(self._tokens, full, new_pages)
        depth = self._plain_depth(prev, full, new_pages)
        if depth is prev.depths[0]:  # window pages updated in place
            return prev
        self._step = self._plain_step = md.evolve(prev, depths=(depth,))
        return self._step

    def next_step(self, paging: PagingState, seq_ids: Any, append_lengths: Any) -> Optional[md.StepMetadata]:
        """The step ``begin_forward(seq_ids, append_lengths)``, its pages reserved, when it repeats
        the remembered batch with one token each; else None (the caller plans it in full)."""
        lane, prev = self._lane, self._step
        if prev is None or not _is_int_tuple(seq_ids, prev.seq_ids) or not _is_int_tuple(append_lengths, self._ones):
            return None
        if lane is None:  # the first repeat of a planned step
            if self._opening is None or self._opening[0] != paging.version:
                return None
            lane = self._open(paging, self._opening[1])
            self._opening = None
            if lane is None:
                return None
        elif lane.version != paging.version:
            return None
        full, new_pages = paging.advance_lane(lane)
        tokens = self._tokens + self._ones_like_tokens
        self._new_pages(tokens, full, new_pages)
        b = len(lane.seq_ids)
        positions = tokens[:b]
        self._next_windows = {}
        self._tokens = tokens
        if self._plain:
            depths: Tuple[md.DepthMetadata, ...] = (self._plain_depth(prev, full, new_pages, copy=True),)
        else:
            full_rows = np.asarray(full, dtype=np.int64)
            depths = tuple(self._grow_depth(depth, rows, every, full_rows, new_pages, positions)
                           for depth, (rows, every) in zip(prev.depths, self._last_depth_rows))
        step = md.evolve(prev, k_ragged_rope_pos_offset=positions, q_rope_position=tokens[b:2 * b],
                         append_position=tokens[2 * b:3 * b], depths=depths)
        self._step, self._windows = step, self._next_windows
        self._plain_step = step if self._plain else None
        return step

    def fresh(self, paging: PagingState, seq_ids: Any, append_lengths: Any,
              max_tokens: int) -> Optional[md.StepMetadata]:
        """A decode step of sequences with one block each (one token each; no window, tree or
        shared block) planned from their blocks directly, its pages reserved, and remembered as
        a plain step for `repeat` / `next_step`; None where the batch is not such a step (the
        caller plans it in full). For caches whose sequences do not slide."""
        n = len(seq_ids) if isinstance(seq_ids, (ShapeTuple, tuple, list)) else 0
        if not 0 < n <= max_tokens or not _is_int_tuple(append_lengths, (1,) * n):
            return None
        lane = paging.open_lane(seq_ids, fresh=True)
        if lane is None:
            return None
        paging.advance_lane(lane)
        tokens, page_indptr, page_indices = first_step(lane, self._page_size)
        made = self._fresh.get(n)
        if made is None:
            made = self._fresh[n] = (_fresh_template(n), np.ones(4 * n, dtype=np.int32), ((np.arange(n), True),))
        template, self._ones_like_tokens, self._last_depth_rows = made
        depth = md.evolve(template.depths[0], page_indptr=page_indptr, page_indices=page_indices,
                          length_info=tokens[3 * n:])
        self._tokens, self._ones, self._win = tokens, template.append_lengths, None
        if self._span:  # local layers: the pages the new tokens' windows see
            self._start_window(np.zeros(4 * n, dtype=np.int32))
            depth = md.evolve(depth, window=self._slide_window(depth, None, (), False))
        step = md.evolve(template, seq_ids=tuple(seq_ids), k_ragged_rope_pos_offset=tokens[:n],
                         q_rope_position=tokens[n:2 * n], append_position=tokens[2 * n:3 * n], depths=(depth,))
        self._lane, self._step, self._plain_step, self._plain, self._opening, self._windows = (
            lane, step, step, True, None, {})
        self._shifts = {}
        return step

    def _start_window(self, win: np.ndarray) -> None:
        """Make ``win`` a new lane's `_win`; its next step computes every row (`_slide_window`)."""
        self._win, self._win_until, self._win_step, self._win_drops = win, 0, np.zeros_like(win), {}

    def _new_pages(self, tokens: np.ndarray, full: Sequence[int], new_pages: Sequence[int]) -> None:
        """Put the new tokens of the rows ``full`` at the start of ``new_pages`` in ``tokens``
        (`plain_tokens`' layout: the last-page lengths only for plain steps)."""
        b, ps, plain = len(self._ones), self._page_size, self._plain
        for row, page in zip(full, new_pages):
            tokens[2 * b + row] = page * ps
            if plain:
                tokens[3 * b + row] = 1

    def _plain_depth(self, prev: md.StepMetadata, full: Sequence[int], new_pages: Sequence[int],
                     copy: bool = False) -> md.DepthMetadata:
        """The only depth of a plain step after ``prev``: last-page lengths from `_tokens`, the
        page lists of the rows ``full`` grown by ``new_pages``, the window pages (`_slide_window`;
        ``copy``: in new arrays). ``prev``'s depth itself where nothing but arrays it holds
        changed."""
        depth, b = prev.depths[0], len(self._ones)
        changes: Dict[str, Any] = {}
        if depth.length_info.base is not self._tokens:
            changes["length_info"] = self._tokens[3 * b:]
        if full:
            changes["page_indptr"], changes["page_indices"] = _append_pages(
                depth.page_indptr, depth.page_indices, full, new_pages, self._shift(full, depth.page_indptr.size))
        if self._win is not None:
            window = self._slide_window(md.evolve(depth, **changes) if changes else depth, full, new_pages, copy)
            if window is not None:
                changes["window"] = window
        return md.evolve(depth, **changes) if changes else depth

    def _slide_window(self, depth: md.DepthMetadata, full: Optional[Sequence[int]], new_pages: Sequence[int],
                      copy: bool) -> Optional[md.WindowPages]:
        """The window pages of a plain step's only ``depth`` (local layers) for the tokens of
        `_tokens`, in `_win` (a new array with ``copy``), the rows ``full`` having taken
        ``new_pages``: the window's page lists grown by those pages and cut by the pages that
        dropped out of view (computed anew for ``full`` None, a new step); None where
        ``depth.window`` stands, its arrays `_win`'s, updated in place. No chunk is empty: a
        decode token sees itself."""
        b, ps, win = len(self._ones), self._ps, self._win
        if copy:
            win = self._win = win.copy()
        positions, last_page_len, start = self._tokens[:b], self._tokens[3 * b:], depth.k_rope_pos_offset
        if full is None:
            window, self._win_drop = md.windowed(depth.page_indptr, depth.page_indices, last_page_len, start,
                                                 positions, self._span, self._page_size)
            win[:3 * b] = window.length_info.ravel()
            win[3 * b:] = window.k_rope_pos_offset
            return md.evolve(window, length_info=win[:3 * b].reshape(3, b), k_rope_pos_offset=win[3 * b:])
        window, steps, scheduled = depth.window, self._lane.steps, ()
        if not copy and steps < self._win_until:  # no window starts to move; starts cross pages on schedule
            win += self._win_step
            for row in full:
                win[row] = 1  # the filled rows' new last pages
            dropped = scheduled = self._win_drops.pop(steps, ())
            if dropped:  # these windows' first pages drop out of view, again page_size steps later
                self._win_drops[steps + self._page_size] = dropped
                for row in dropped:
                    win[b + row] = 0
                    self._win_drop[row] += 1
        else:
            unclamped = self._span.first_visible(positions)
            unclamped -= start
            skip = np.maximum(unclamped, 0)
            drop = skip // ps
            win[:b] = last_page_len
            np.remainder(skip, ps, out=win[b:2 * b])
            np.add(start, skip, out=win[3 * b:])
            dropped = np.flatnonzero(drop != self._win_drop)
            events = self._window_events(unclamped, positions)
            periodic_drops = events is None  # at the steps where each offset in its first page reaches page_size
            self._win_drops = _rows_by(steps + self._page_size - win[b:2 * b]) if periodic_drops else {}
            self._win_until = _FOREVER if periodic_drops else steps + events
        if not (full or len(dropped)) and window.k_rope_pos_offset.base is win:
            return None
        page_indptr, page_indices = window.page_indptr, window.page_indices
        if full:
            page_indptr, page_indices = _append_pages(page_indptr, page_indices, full, new_pages,
                                                      self._shift(full, page_indptr.size))
        if scheduled:
            page_indptr, page_indices = _drop_first_pages(page_indptr, page_indices, scheduled,
                                                          self._shift(scheduled, page_indptr.size))
        elif len(dropped):  # positions only grow: pages only drop out of view
            page_indptr, page_indices = _drop_pages(page_indptr, page_indices, dropped,
                                                    drop[dropped] - self._win_drop[dropped])
            self._win_drop = drop
        return md.evolve(window, page_indptr=page_indptr, page_indices=page_indices,
                         length_info=win[:3 * b].reshape(3, b), k_rope_pos_offset=win[3 * b:])

    def _window_events(self, unclamped: np.ndarray, positions: np.ndarray) -> Optional[int]:
        """Steps until some window of a plain step starts to move or its start crosses a page
        (``unclamped``: first visible key minus the list's first key, per row, this step), or
        None where every window moves (then each crosses a page every page_size steps, on
        schedule); and `_win_step`, what `_win` gains each step until then: a window's start
        moves by one a step once it does; a chunk's start moves only at the next chunk."""
        b, ps, step = len(self._ones), self._ps, self._win_step
        step[:b] = 1  # last-page lengths (rows taking a page set theirs to 1)
        if not self._span.window:
            step[b:] = 0
            return int(self._span.chunk - (positions % np.int32(self._span.chunk)).max())
        if unclamped.min() >= 1:  # every window moves (sequences longer than it): the common case
            step[b:2 * b] = step[3 * b:] = 1
            return None
        moving = unclamped >= 1
        step[b:2 * b] = step[3 * b:] = moving
        return int(np.where(moving, ps - unclamped % ps, 1 - unclamped).min())

    def plain_tokens(self, step: md.StepMetadata) -> Optional[np.ndarray]:
        """For ``step``, the last one derived, when it is plain (one depth, every last block
        in it): the array its token arrays and last-page lengths are views
        of (RoPE offsets, positions, append slots and last-page lengths, in that order); else
        None."""
        return self._tokens if step is self._plain_step and step is not None else None

    def plain_window(self, step: md.StepMetadata) -> Optional[np.ndarray]:
        """For a plain ``step`` (`plain_tokens`) with window pages, the array its window's
        length_info and k_rope_pos_offset are views of, in that order; else None."""
        return self._win if step is self._plain_step and step is not None else None

    def _grow_depth(self, depth: md.DepthMetadata, rows: np.ndarray, every: bool, full: np.ndarray,
                    new_pages: Sequence[int], positions: np.ndarray) -> md.DepthMetadata:
        """``depth`` after the sequences ``rows`` (whose last block it attends; ``every``: all of
        them) grew by one token, the last blocks of the sequences ``full`` taking ``new_pages``."""
        if not rows.size:
            return self._with_window(depth, positions)
        ps, length_info = self._ps, depth.length_info
        if every and length_info.ndim == 1:
            length_info = length_info % ps
            length_info += _ONE
        else:
            length_info = length_info.copy()
            last_page_len = length_info[0] if length_info.ndim == 2 else length_info
            last_page_len[rows] = last_page_len[rows] % ps + 1
        changes = {"length_info": length_info}
        if len(full):
            if every:
                grown, pages = full, new_pages
            else:
                page_of = np.full(len(self._ones), -1, dtype=np.int64)
                page_of[full] = new_pages
                grown = rows[page_of[rows] >= 0]
                pages = page_of[grown]
            if len(grown):
                changes["page_indptr"], changes["page_indices"] = _append_pages(
                    depth.page_indptr, depth.page_indices, grown, pages, self._shift(grown, depth.page_indptr.size))
        return self._with_window(md.evolve(depth, **changes), positions)

    def _shift(self, rows: Sequence[int], size: int) -> np.ndarray:
        """`grow_shifts` of ``rows`` for an indptr of ``size``; on a miss, made for every group
        of rows that fill together in the lane (at once)."""
        key = (size, tuple(rows))
        shift = self._shifts.get(key)
        if shift is None:
            groups = {key[1]}
            if size == len(self._ones) + 1:  # a batch's page lists
                groups.update(tuple(g) for g in self._lane.fills.values())
            self._shifts.update(((size, g), s) for g, s in zip(groups, grow_shifts(groups, size)))
            shift = self._shifts[key]
        return shift

    def _with_window(self, depth: md.DepthMetadata, positions: np.ndarray) -> md.DepthMetadata:
        """``depth`` with the window pages of queries at ``positions`` (local layers only); the
        kept page lists of the step before stand while the same pages drop from the same lists."""
        if depth.window is None:
            return depth
        last_page_len = depth.length_info[0] if depth.length_info.ndim == 2 else depth.length_info
        before = self._windows.get(id(depth.page_indices))
        reuse = before[1:] if before is not None and before[0] is depth.page_indices else None
        window, drop = md.windowed(depth.page_indptr, depth.page_indices, last_page_len, depth.k_rope_pos_offset,
                                   positions, self._span, self._page_size, reuse)
        self._next_windows[id(depth.page_indices)] = (depth.page_indices, window, drop)
        return md.evolve(depth, window=window)

    @property
    def current(self) -> Optional[md.StepMetadata]:
        """The remembered step (the last one planned or derived, when it qualifies)."""
        return self._step


_ONE = np.int32(1)
_FOREVER = 1 << 62  # a lane step no lane reaches


#: Most rows `_append_pages` grows by slice copies (memcpy speed); masks above it.
GROW_ROWS_BY_SLICES = 48


def grow_shifts(groups: Sequence[Sequence[int]], size: int) -> np.ndarray:
    """int32 [len(groups), size]: what an indptr of ``size`` entries gains when each list of
    a group of ``rows`` grows by one (one row per group)."""
    shifts = np.zeros((len(groups), size), dtype=np.int32)
    counts = [len(g) for g in groups]
    shifts[np.repeat(np.arange(len(groups)), counts),
           np.fromiter(itertools.chain.from_iterable(groups), dtype=np.int64, count=sum(counts)) + 1] = 1
    return np.cumsum(shifts, axis=1, dtype=np.int32, out=shifts)


def _append_pages(indptr: np.ndarray, indices: np.ndarray, rows: Sequence[int], pages: Sequence[int],
                  shift: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Page lists ``(indptr, indices)`` with ``pages[j]`` appended to the list of ``rows[j]``
    (ascending; ``shift``: their `grow_shifts`), in one new array: indptr, then indices
    (`StepUploader` writes it in one run)."""
    b1, k = indptr.size, len(rows)
    block = np.empty(b1 + indices.size + k, dtype=np.int32)
    new_indptr, new_indices = block[:b1], block[b1:]
    np.add(indptr, shift, out=new_indptr)
    if k > GROW_ROWS_BY_SLICES:
        at = new_indptr[np.asarray(rows, dtype=np.int64) + 1] - _ONE  # the new pages' places
        keep = np.ones(new_indices.size, dtype=bool)
        keep[at] = False
        new_indices[keep] = indices
        new_indices[at] = pages
        return new_indptr, new_indices
    done = at = 0
    for row, page in zip(rows, pages):
        cut = int(indptr[row + 1])
        end = at + cut - done
        new_indices[at:end] = indices[done:cut]
        new_indices[end] = page
        at, done = end + 1, cut
    new_indices[at:] = indices[done:]
    return new_indptr, new_indices


def _drop_first_pages(indptr: np.ndarray, indices: np.ndarray, rows: Sequence[int],
                      shift: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Page lists ``(indptr, indices)`` without the first page of the lists of ``rows``
    (ascending; ``shift``: their `grow_shifts`), in one new array as `_append_pages` makes."""
    b1, k = indptr.size, len(rows)
    block = np.empty(b1 + indices.size - k, dtype=np.int32)
    new_indptr, new_indices = block[:b1], block[b1:]
    np.subtract(indptr, shift, out=new_indptr)
    done = at = 0
    for row in rows:
        cut = int(indptr[row])
        end = at + cut - done
        new_indices[at:end] = indices[done:cut]
        at, done = end, cut + 1
    new_indices[at:] = indices[done:]
    return new_indptr, new_indices


def _rows_by(keys: np.ndarray) -> Dict[int, Tuple[int, ...]]:
    """The rows of ``keys`` (ascending) by their key."""
    rows: Dict[int, list] = {}
    for row, key in enumerate(keys.tolist()):
        rows.setdefault(key, []).append(row)
    return {key: tuple(group) for key, group in rows.items()}


def _drop_pages(indptr: np.ndarray, indices: np.ndarray, rows: np.ndarray,
                counts: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Page lists ``(indptr, indices)`` without the first ``counts[j]`` pages of the list of
    ``rows[j]`` (ascending)."""
    keep = np.ones(indices.size, dtype=bool)
    ends = np.cumsum(counts)  # row j's pages go at [indptr[rows[j]], + counts[j]) (one numpy pass for all)
    keep[np.repeat(indptr[rows] - (ends - counts), counts) + np.arange(int(ends[-1]))] = False
    return _resized(indptr, rows, -counts), indices[keep]


def _resized(indptr: np.ndarray, rows: np.ndarray, change: Any) -> np.ndarray:
    """``indptr`` after the lists ``rows`` changed length by ``change`` (one value or one each)."""
    shift = np.zeros(indptr.size, dtype=indptr.dtype)
    shift[rows + 1] = change
    return indptr + np.cumsum(shift, dtype=indptr.dtype)


def _fresh_template(n: int) -> md.StepMetadata:
    """A decode step of ``n`` sequences with one block each, its per-step arrays to be set."""
    counts, unset = np.arange(n + 1, dtype=np.int32), np.zeros(0, dtype=np.int32)
    depth = md.DepthMetadata(qo_indptr=counts, page_indptr=unset, page_indices=unset, length_info=unset,
                             k_rope_pos_offset=np.zeros(n, dtype=np.int32), use_decode_kernel=True)
    return md.StepMetadata(seq_ids=(), append_lengths=(1,) * n, append_indptr=counts, k_ragged_rope_pos_offset=unset,
                           q_rope_position=unset, append_position=unset, depths=(depth,), append_before_attn=True)


def _is_int_tuple(values: Any, expected: tuple) -> bool:
    """Whether ``values`` holds exactly the ints ``expected`` (not bools or floats, which the full
    planner refuses)."""
    if isinstance(values, ShapeTuple):  # a tuple of Python ints
        return values == expected
    return (isinstance(values, (tuple, list)) and len(values) == len(expected)
            and all(type(v) is int for v in values) and tuple(values) == expected)
