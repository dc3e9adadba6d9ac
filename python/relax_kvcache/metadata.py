"""Per-step batch metadata: what the kernels of one forward step read, built on the host.

Attention over the cached KV is organised by block depth, as in TVM's ``BeginForward``
(docs/architecture.md). Arrays are int32 (B = batch size, n = tokens of the step, c = chunks
at a depth).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import List, Optional, Sequence, Tuple, TypeVar

import numpy as np

from .config import LayerSpan
from .paging import Block, PagingState
from .token_tree import TokenTree

_Record = TypeVar("_Record")

#: Deepest block level attended separately; deeper blocks are concatenated into the last level.
MAX_BLOCK_DEPTH = 2
#: Below this ratio of (uncoalesced pages / coalesced pages), a decode batch uses the decode kernel.
COALESCE_RATIO_THRESHOLD = 32


@dataclasses.dataclass(frozen=True)
class TreeMask:
    """Token-tree masks of a kernel call's chunks (TVM's ``tree_attn_mn_indptr`` / mask):
    ``mn_indptr [c + 1]`` and each node's DFS interval ``mask [nodes, 2]``."""

    mn_indptr: np.ndarray
    mask: np.ndarray

    @classmethod
    def of(cls, trees: Sequence[Optional[TokenTree]]) -> "TreeMask":
        present = [t for t in trees if t is not None]
        mask = np.array([iv for t in present for iv in t.intervals], dtype=np.int32).reshape(-1, 2)
        return cls(mn_indptr=indptr([len(t) if t is not None else 0 for t in trees]), mask=mask)


@dataclasses.dataclass(frozen=True)
class WindowPages:
    """The part of a depth's pages a local layer reads (see ``LayerSpan``): per chunk, keys
    before the first one its earliest query sees are dropped, whole pages from ``page_indices``
    and the rest through the window offset of ``length_info [3, c]``."""

    page_indptr: np.ndarray
    page_indices: np.ndarray
    length_info: np.ndarray
    k_rope_pos_offset: np.ndarray


@dataclasses.dataclass(frozen=True)
class GrownPages:
    """The only depth's page lists with the step's own rows (a prefill step of plain
    sequences appends first, then attends over its pages causally in one kernel)."""

    page_indptr: np.ndarray  # [B + 1]
    page_indices: np.ndarray  # [nnz]
    length_info: np.ndarray  # [B] last page length


@dataclasses.dataclass(frozen=True)
class DepthMetadata:
    """Paged KV of one block depth, laid out for the paged attention kernels."""

    qo_indptr: np.ndarray  # [c + 1] query token ranges of the chunks; covers all n tokens
    page_indptr: np.ndarray  # [c + 1] page ranges of the chunks in page_indices
    page_indices: np.ndarray  # [nnz] page ids of the chunks, in sequence order
    length_info: np.ndarray  # [c] last page length, or [3, c] with window offset and sink
    k_rope_pos_offset: np.ndarray  # [c] RoPE position of each chunk's first KV row
    use_decode_kernel: bool  # then c == B and every chunk has one query
    window: Optional[WindowPages] = None  # what local layers read (caches with such layers)
    tree: Optional[TreeMask] = None  # masks of the paged tree kernel (a step extending a tree)


@dataclasses.dataclass(frozen=True)
class StepMetadata:
    """Everything the kernels of one forward step read. ``append_before_attn``: append the new
    K/V, then attend to pages only (decode batches, tree extensions). ``reused_pages``: pages
    that slid out of a window in this step and hold some of its new tokens. The arrays stay as
    they are while the step runs; once it ended, `decode_plan.DecodePlanner.repeat` may update
    a plain decode step's token arrays and last-page lengths in place for the next one."""

    seq_ids: Tuple[int, ...]
    append_lengths: Tuple[int, ...]
    append_indptr: np.ndarray  # [B + 1] token ranges of the sequences in the step's q/k/v
    k_ragged_rope_pos_offset: np.ndarray  # [B] RoPE position of each sequence's first new token
    q_rope_position: np.ndarray  # [n] RoPE position of every new token
    append_position: np.ndarray  # [n] slot (page * page_size + offset) of every new token
    depths: Tuple[DepthMetadata, ...]  # root first
    append_before_attn: bool
    ragged_tree: Optional[TreeMask] = None  # masks of the ragged kernel (non-chain trees)
    reused_pages: Tuple[int, ...] = ()
    grown: Optional[GrownPages] = None  # see GrownPages (prefill steps of one plain depth)

    @property
    def batch_size(self) -> int:
        return len(self.seq_ids)

    @property
    def total_tokens(self) -> int:
        return int(self.append_indptr[-1])


@dataclasses.dataclass(frozen=True)
class BatchStructure:
    """Block layout of a batch before its tokens are reserved. ``chunks[d]``: ``(block or
    None, query tokens, smallest query position)`` per chunk at depth d; ``trailing[i]``:
    sequence i's blocks below the deepest level; ``last_blocks[i]``: its live last block."""

    seq_ids: Tuple[int, ...]
    append_lengths: Tuple[int, ...]
    last_block_lengths_before: Tuple[int, ...]
    last_blocks: Tuple[Block, ...]
    chunks: Tuple[Tuple[Tuple[Optional[Block], int, int], ...], ...]
    trailing: Tuple[Tuple[Block, ...], ...]
    use_decode_kernel: Tuple[bool, ...]
    trees: Tuple[Optional[TokenTree], ...] = ()
    rope_offsets: Tuple[int, ...] = ()
    last_depths: Tuple[int, ...] = ()

    @classmethod
    def collect(cls, paging: PagingState, seq_ids: Sequence[int], append_lengths: Sequence[int],
                trees: Optional[Sequence[TokenTree]] = None) -> "BatchStructure":
        traces, positions = paging.trace_batch(seq_ids)
        if trees is None:
            rope_offsets = positions
        else:  # an uncommitted tree's nodes sit at the root's position + depth
            rope_offsets = tuple(p - (len(t) - n) for p, t, n in zip(positions, trees, append_lengths))
        num_depths = min(max(len(t) for t in traces), MAX_BLOCK_DEPTH)
        is_decode = all(n == 1 for n in append_lengths)
        chunks, use_decode = [], []
        for d in range(num_depths):
            blocks = [t[d] if d < len(t) else None for t in traces]
            # Tree masks are per sequence: no coalescing when the step carries trees.
            depth_chunks, decode = _chunk_depth(blocks, append_lengths, positions, is_decode,
                                                coalesce=d != MAX_BLOCK_DEPTH - 1 and trees is None)
            chunks.append(depth_chunks)
            use_decode.append(decode)
        last_blocks = tuple(t[-1] for t in traces)
        return cls(
            seq_ids=tuple(seq_ids),
            append_lengths=tuple(append_lengths),
            trees=tuple(trees) if trees is not None else (),
            rope_offsets=rope_offsets,
            last_depths=tuple(min(len(t), MAX_BLOCK_DEPTH) - 1 for t in traces),
            last_block_lengths_before=tuple(b.seq_length for b in last_blocks),
            last_blocks=last_blocks,
            chunks=tuple(chunks),
            trailing=tuple(tuple(t[MAX_BLOCK_DEPTH:]) for t in traces),
            use_decode_kernel=tuple(use_decode),
        )


def plan_step(paging: PagingState, seq_ids: List[int], append_lengths: List[int],
              trees: Optional[List[TokenTree]], *, sliding_window: bool, layer_span: LayerSpan,
              grow_pages: bool = False) -> Tuple[StepMetadata, Tuple[int, ...]]:
    """Plan a checked step in full (its pages reserved); the step and the depth each
    sequence's last block is attended at. Depth arrays are built after the reservation when
    the step appends before attention, else before it. Without ``trees`` every sequence's token
    tree is committed (the planner checks)."""
    structure = BatchStructure.collect(paging, seq_ids, append_lengths, trees)
    extends_tree = trees is not None and any(not paging.sequence(s).accepted_indices_committed for s in seq_ids)
    append_before_attn = (not sliding_window and structure.use_decode_kernel[-1]) or extends_tree
    reused = paging.reserve_append(seq_ids, append_lengths) if append_before_attn else None
    depths = build_depths(paging, structure, sliding_window=sliding_window, layer_span=layer_span)
    if reused is None:
        reused = paging.reserve_append(seq_ids, append_lengths)
    if trees is not None:
        for seq_id, tree in zip(seq_ids, trees):
            paging.set_token_tree(seq_id, tree)
    ragged_tree, depth_trees = build_tree_masks(structure, append_before_attn=append_before_attn)
    q_rope_position, append_position = build_token_maps(paging, structure)
    step = StepMetadata(
        seq_ids=tuple(seq_ids),
        append_lengths=tuple(append_lengths),
        append_indptr=indptr(append_lengths),
        k_ragged_rope_pos_offset=np.asarray(structure.rope_offsets, dtype=np.int32),
        q_rope_position=q_rope_position,
        append_position=append_position,
        depths=tuple(d if t is None else evolve(d, tree=t) for d, t in zip(depths, depth_trees)),
        append_before_attn=append_before_attn,
        ragged_tree=ragged_tree,
        reused_pages=tuple(reused),
    )
    if grow_pages and not (append_before_attn or sliding_window or trees is not None):
        step = evolve(step, grown=grown_pages(step, paging.page_size))
    return step, tuple(structure.last_depths)


def grown_pages(step: StepMetadata, page_size: int) -> Optional[GrownPages]:
    """``step``'s `GrownPages`, where its one depth has a chunk per sequence, in order, with
    a plain page list (else None)."""
    if len(step.depths) != 1:
        return None
    depth = step.depths[0]
    if (depth.use_decode_kernel or depth.length_info.ndim != 1 or depth.page_indices.size == 0
            or not np.array_equal(depth.qo_indptr, step.append_indptr)):
        return None
    pages_of, ends = step.append_position // page_size, step.append_indptr
    lists = []  # per sequence: its cached pages, then the pages its new rows fill
    for i in range(len(ends) - 1):
        own = depth.page_indices[depth.page_indptr[i]:depth.page_indptr[i + 1]]
        new = pages_of[ends[i]:ends[i + 1]]
        new = new[np.concatenate(([True], new[1:] != new[:-1]))]  # each page once (rows fill pages in order)
        lists.append(np.concatenate((own, new[1:] if own.size and new[0] == own[-1] else new)))
    return GrownPages(page_indptr=indptr([len(pages) for pages in lists]),
                      page_indices=np.concatenate(lists).astype(np.int32),
                      length_info=(step.append_position[ends[1:] - 1] % page_size + 1).astype(np.int32))


def _chunk_depth(blocks: List[Optional[Block]], append_lengths: Sequence[int], positions: Sequence[int],
                 is_decode: bool, *, coalesce: bool) -> Tuple[Tuple[Tuple[Optional[Block], int, int], ...], bool]:
    """Chunks of one depth and whether it uses the decode kernel (TVM's
    ``GetChunkedBlockIds``): adjacent sequences on one block coalesce, unless a decode batch
    saves less than ``COALESCE_RATIO_THRESHOLD`` times the page reads."""
    uncoalesced = tuple(zip(blocks, append_lengths, positions))
    coalesced: List[Tuple[Optional[Block], int, int]] = []
    for block, length, position in uncoalesced:
        if coalesced and coalesced[-1][0] is block:
            coalesced[-1] = (block, coalesced[-1][1] + length, min(coalesced[-1][2], position))
        else:
            coalesced.append((block, length, position))
    if len(coalesced) == len(uncoalesced):  # nothing coalesced: the page ratio is 1 (or 0 / 0)
        return uncoalesced, is_decode
    pages_uncoalesced = sum(len(b.page_ids) for b in blocks if b is not None)
    pages_coalesced = sum(len(b.page_ids) for b, _, _ in coalesced if b is not None)
    ratio = pages_uncoalesced / pages_coalesced if pages_coalesced > 0 else 0.0
    use_decode = is_decode and ratio < COALESCE_RATIO_THRESHOLD
    return (uncoalesced if use_decode or not coalesce else tuple(coalesced)), use_decode


_EMPTY_BLOCK = Block(index=-1)


def build_depths(paging: PagingState, structure: BatchStructure, *, sliding_window: bool,
                 layer_span: LayerSpan = LayerSpan()) -> Tuple[DepthMetadata, ...]:
    """Depth arrays of the batch from the current page tables (TVM's ``BeginForward`` loop);
    at the deepest level a chunk reads its block and the sequence's trailing blocks."""
    page_size = paging.page_size
    depths = []
    for d, chunks in enumerate(structure.chunks):
        heads = [b if b is not None else _EMPTY_BLOCK for b, _, _ in chunks]
        if d == MAX_BLOCK_DEPTH - 1:  # a chunk reads its block and the trailing ones
            chains = [[h, *trail] for h, trail in zip(heads, structure.trailing)]
            page_lists = [[p for blk in chain for p in blk.page_ids] for chain in chains]
            lengths = [sum(blk.seq_length for blk in chain) for chain in chains]
            lasts = [chain[-1] for chain in chains]
        else:
            page_lists, lengths, lasts = [h.page_ids for h in heads], [h.seq_length for h in heads], heads
        last_page_len = [(n - b.sink_length + b.sliding_window_offset - 1) % page_size + 1 if n > 0 else 0
                         for n, b in zip(lengths, lasts)]
        if sliding_window:
            length_info = np.array([last_page_len, *_window_info(lengths, lasts)], dtype=np.int32)
        else:
            length_info = np.array(last_page_len, dtype=np.int32)
        page_indptr = indptr([len(p) for p in page_lists])
        page_indices = np.fromiter(itertools.chain.from_iterable(page_lists), dtype=np.int32)
        k_rope_pos_offset = np.array([h.start_pos for h in heads], dtype=np.int32)
        window = None
        if layer_span:
            window = windowed(page_indptr, page_indices, np.asarray(last_page_len), k_rope_pos_offset,
                              np.array([p for _, _, p in chunks]), layer_span, page_size)[0]
        depths.append(DepthMetadata(
            qo_indptr=indptr([n for _, n, _ in chunks]),
            page_indptr=page_indptr,
            page_indices=page_indices,
            length_info=length_info,
            k_rope_pos_offset=k_rope_pos_offset,
            use_decode_kernel=structure.use_decode_kernel[d],
            window=window,
        ))
    return tuple(depths)


def _window_info(lengths: List[int], lasts: List[Block]) -> Tuple[List[int], List[int]]:
    """(window offset, sink size) of each page list, in slots of the list (only a chain's last
    block may have slid; the kernels skip slots ``[sink, offset)``)."""
    offsets, sinks = [], []
    for n, block in zip(lengths, lasts):
        before = n - block.seq_length if block.sliding_window_offset else 0
        offsets.append(block.sliding_window_offset + before)
        sinks.append(block.sink_length + before)
    return offsets, sinks


#: Most chunks `windowed` takes row by row in Python (fewer numpy calls than rows above it).
WINDOW_ROWS_IN_PYTHON = 8


def windowed(page_indptr: np.ndarray, page_indices: np.ndarray, last_page_len: np.ndarray, starts: np.ndarray,
             min_positions: np.ndarray, span: LayerSpan, page_size: int,
             reuse: Optional[Tuple[WindowPages, np.ndarray]] = None) -> Tuple[WindowPages, np.ndarray]:
    """The `WindowPages` of chunks whose earliest queries are at ``min_positions``, from their full
    page lists whose first keys are at ``starts``, and the whole pages dropped from each list.
    ``reuse``: the result for the same page lists and earlier queries, whose kept pages stand where
    the same pages drop. int32 throughout: positions and slots fit it (first visible > -2**31)."""
    if len(starts) <= WINDOW_ROWS_IN_PYTHON:
        return _windowed_rows(page_indptr, page_indices, last_page_len, starts, min_positions, span, page_size,
                              reuse)
    i32 = np.int32
    page_indptr = np.asarray(page_indptr, dtype=i32)
    npages = page_indptr[1:] - page_indptr[:-1]
    last = np.asarray(last_page_len, dtype=i32)
    starts = np.asarray(starts, dtype=i32)
    lengths = npages * i32(page_size)
    lengths += last
    lengths -= i32(page_size)
    skip = span.first_visible(np.asarray(min_positions, dtype=i32))
    skip -= starts
    np.maximum(skip, 0, out=skip)
    empty = skip >= lengths  # no key of the chunk is visible
    empty |= npages == 0
    any_empty = empty.any()
    drop = skip // i32(page_size)  # whole pages no query sees
    if any_empty:
        drop[empty] = npages[empty]
    if reuse is not None and (drop == reuse[1]).all():
        new_indptr, kept = reuse[0].page_indptr, reuse[0].page_indices
    elif drop.any():
        new_indptr = np.zeros(npages.size + 1, dtype=i32)
        np.cumsum(npages - drop, out=new_indptr[1:])
        first_kept = np.repeat(page_indptr[:-1] + drop, npages)
        kept = page_indices[np.arange(page_indices.size, dtype=i32) >= first_kept]
    else:
        new_indptr = page_indptr - page_indptr[0]
        kept = page_indices
    length_info = np.zeros((3, npages.size), dtype=i32)
    length_info[0] = last
    np.remainder(skip, i32(page_size), out=length_info[1])
    k_rope_pos_offset = starts + skip
    if any_empty:
        length_info[:2, empty] = 0
        k_rope_pos_offset[empty] = 0
    return WindowPages(page_indptr=new_indptr, page_indices=np.asarray(kept, dtype=i32), length_info=length_info,
                       k_rope_pos_offset=k_rope_pos_offset), drop


def _windowed_rows(page_indptr: np.ndarray, page_indices: np.ndarray, last_page_len: np.ndarray,
                   starts: np.ndarray, min_positions: np.ndarray, span: LayerSpan, page_size: int,
                   reuse: Optional[Tuple[WindowPages, np.ndarray]]) -> Tuple[WindowPages, np.ndarray]:
    """`windowed` chunk by chunk on Python ints (the same results)."""
    ptr = np.asarray(page_indptr).tolist()
    drop, info, k_rope_pos_offset = [], [[], [], []], []  # info: last page length, window offset, sink
    for begin, end, last, start, position in zip(ptr, ptr[1:], np.asarray(last_page_len).tolist(),
                                                 np.asarray(starts).tolist(), np.asarray(min_positions).tolist()):
        skip = max(span.first_visible(position) - start, 0)
        empty = begin == end or skip >= (end - begin - 1) * page_size + last  # no key of the chunk is visible
        drop.append(end - begin if empty else skip // page_size)
        info[0].append(0 if empty else last)
        info[1].append(0 if empty else skip % page_size)
        info[2].append(0)
        k_rope_pos_offset.append(0 if empty else start + skip)
    if reuse is not None and reuse[1].tolist() == drop:
        new_indptr, kept = reuse[0].page_indptr, reuse[0].page_indices
    elif any(drop):
        new_indptr = indptr([end - begin - d for begin, end, d in zip(ptr, ptr[1:], drop)])
        kept = np.concatenate([page_indices[begin + d:end] for begin, end, d in zip(ptr, ptr[1:], drop)])
    else:
        new_indptr, kept = np.asarray(page_indptr, dtype=np.int32) - np.int32(ptr[0]), page_indices
    return WindowPages(page_indptr=new_indptr, page_indices=np.asarray(kept, dtype=np.int32),
                       length_info=np.array(info, dtype=np.int32),
                       k_rope_pos_offset=np.array(k_rope_pos_offset, dtype=np.int32)), np.array(drop, dtype=np.int32)


def build_token_maps(paging: PagingState, structure: BatchStructure) -> Tuple[np.ndarray, np.ndarray]:
    """``(q_rope_position [n], append_position [n])`` of the step's new tokens after their
    reservation, vectorised over the batch: token t of sequence i is at in-block offset
    ``len - n_i + t`` of its last block, its slot -1 where a sink pins it or the window slid it
    out within the step (as in TVM)."""
    ps, blocks, counts = paging.page_size, structure.last_blocks, structure.append_lengths
    rope_offsets = np.array(structure.rope_offsets, dtype=np.int64)
    if all(n == 1 and b.seq_length and not b.sink_length for n, b in zip(counts, blocks)):  # decode
        slots = [b.seq_length - 1 + b.sliding_window_offset for b in blocks]
        a_pos = np.array([b.page_ids[s // ps] * ps + s % ps for b, s in zip(blocks, slots)],
                         dtype=np.int32)
        return _tree_positions(structure, rope_offsets.astype(np.int32)), a_pos
    lengths = np.array(counts, dtype=np.int64)
    local = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    # each sequence's pages from the first one a new token can use (all of them with a sink)
    firsts = [0 if b.sink_length else (max(b.seq_length - n, 0) + b.sliding_window_offset) // ps
              for b, n in zip(blocks, counts)]
    tables = [b.page_ids[first:] for b, first in zip(blocks, firsts)]
    table = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int64)
    columns = ([b.seq_length - n for b, n in zip(blocks, counts)], [b.sink_length for b in blocks],
               [b.sliding_window_offset for b in blocks], structure.last_block_lengths_before,
               indptr([len(t) * ps for t in tables])[:-1] - np.array(firsts, dtype=np.int64) * ps)
    start, sink, shift, before, base = (np.repeat(np.asarray(column, dtype=np.int64), lengths)
                                        for column in columns)
    in_sink = before + local < sink
    kept = in_sink | (start + local >= sink)
    offset = np.where(in_sink, before + local, start + local - sink + shift)[kept] + base[kept]
    a_pos = np.full(local.size, -1, dtype=np.int64)
    a_pos[kept] = table[offset // ps] * ps + offset % ps
    q_pos = np.repeat(rope_offsets, lengths) + local
    return _tree_positions(structure, q_pos.astype(np.int32)), a_pos.astype(np.int32)


def _tree_positions(structure: BatchStructure, q_pos: np.ndarray) -> np.ndarray:
    """Token-tree nodes sit at their root's position plus their depth."""
    if not structure.trees:
        return q_pos
    lo = 0
    for offset, n, tree in zip(structure.rope_offsets, structure.append_lengths, structure.trees):
        q_pos[lo:lo + n] = offset + np.asarray(tree.depths[len(tree) - n:], dtype=np.int32)
        lo += n
    return q_pos


def build_tree_masks(structure: BatchStructure, *, append_before_attn: bool
                     ) -> Tuple[Optional[TreeMask], Tuple[Optional[TreeMask], ...]]:
    """``(ragged_tree, per-depth trees)``: the ragged kernel masks the new tokens, or (after an
    append before attention) the paged kernel at each tree's last depth; chains need no mask."""
    trees = structure.trees
    num_depths = len(structure.chunks)
    if not trees:
        return None, (None,) * num_depths
    if not append_before_attn:
        return (None if all(t.is_chain for t in trees) else TreeMask.of(trees)), (None,) * num_depths
    depth_trees = []
    for d in range(num_depths):
        here = [t if last == d else None for t, last in zip(trees, structure.last_depths)]
        present = [t for t in here if t is not None]
        plain = all(t.is_chain for t in present) and structure.use_decode_kernel[d]
        depth_trees.append(TreeMask.of(here) if present and not plain else None)
    return None, tuple(depth_trees)


def evolve(record: _Record, **changes: object) -> _Record:
    """``dataclasses.replace`` for the per-step hot path: a shallow copy of a metadata record
    with ``changes`` (names of its fields; the records have no ``__post_init__``)."""
    new = object.__new__(type(record))
    fields = new.__dict__
    fields.update(record.__dict__)
    fields.update(changes)
    return new


def indptr(lengths: Sequence[int]) -> np.ndarray:
    """int32 ``[0, l0, l0 + l1, ...]``."""
    return np.array(list(itertools.accumulate(lengths, initial=0)), dtype=np.int32)
