"""Per-step batch metadata: what the kernels of one forward step read, built once on the host.

A step appends ``append_lengths[i]`` tokens to sequence ``seq_ids[i]``. Attention over the
cached KV is organised by *block depth*: sequences that share a prefix block at depth d attend
to it together (their queries can be coalesced into one prefill chunk), and blocks deeper than
:data:`MAX_BLOCK_DEPTH` - 1 are concatenated into the last depth. The per-depth results are
merged by log-sum-exp. This is TVM's scheme (``GetBlockIdsOnDepth``, ``GetChunkedBlockIds`` and
``BeginForward`` in its ``paged_kv_cache.cc``), built here with numpy.

All arrays are int32 numpy arrays; shapes are given in the docstrings (B = batch size,
n = tokens appended in the step, c = chunks at a depth).
"""

from __future__ import annotations

import dataclasses
from typing import List, Sequence, Tuple

import numpy as np

from .paging import PagingState

#: Deepest block level attended separately; deeper blocks are concatenated into the last level.
MAX_BLOCK_DEPTH = 2
#: Below this ratio of (uncoalesced pages / coalesced pages), a decode batch uses the decode kernel.
COALESCE_RATIO_THRESHOLD = 32


@dataclasses.dataclass(frozen=True)
class DepthMetadata:
    """Paged KV of one block depth, laid out for the paged attention kernels.

    Attributes
    ----------
    qo_indptr : int32 [c + 1]
        Query token ranges of the chunks (prefill kernel); covers all n tokens of the step.
    page_indptr : int32 [c + 1]
        Page ranges of the chunks in ``page_indices``.
    page_indices : int32 [nnz]
        Page ids of the chunks, in sequence order.
    length_info : int32 [c] or [3, c]
        Last page length, or (last page length, sliding-window offset, sink size) rows when the
        cache supports sliding windows.
    k_rope_pos_offset : int32 [c]
        RoPE position of each chunk's first KV row (its block's start position).
    use_decode_kernel : bool
        Whether this depth runs the decode kernel (then c == B and every chunk has one query).
    """

    qo_indptr: np.ndarray
    page_indptr: np.ndarray
    page_indices: np.ndarray
    length_info: np.ndarray
    k_rope_pos_offset: np.ndarray
    use_decode_kernel: bool

    @property
    def has_pages(self) -> bool:
        return self.page_indices.size > 0


@dataclasses.dataclass(frozen=True)
class StepMetadata:
    """Everything the kernels of one forward step read.

    Attributes
    ----------
    seq_ids, append_lengths : tuple of int
        The batch, as given to ``begin_forward``.
    append_indptr : int32 [B + 1]
        Token ranges of the sequences in the step's q/k/v.
    k_ragged_rope_pos_offset : int32 [B]
        Sequence length before the step (RoPE position of each sequence's first new token).
    q_rope_position : int32 [n]
        RoPE position of every new token.
    append_position : int32 [n]
        Pool position (``page * page_size + slot``) each new token's K/V is written to.
    depths : tuple of DepthMetadata
        One entry per block depth, root first.
    append_before_attn : bool
        Append new K/V before attention and attend to pages only (decode batches); otherwise
        attend to the new tokens with the ragged kernel, merge with the pages, then append.
    """

    seq_ids: Tuple[int, ...]
    append_lengths: Tuple[int, ...]
    append_indptr: np.ndarray
    k_ragged_rope_pos_offset: np.ndarray
    q_rope_position: np.ndarray
    append_position: np.ndarray
    depths: Tuple[DepthMetadata, ...]
    append_before_attn: bool

    @property
    def batch_size(self) -> int:
        return len(self.seq_ids)

    @property
    def total_tokens(self) -> int:
        return int(self.append_indptr[-1])


@dataclasses.dataclass(frozen=True)
class BatchStructure:
    """Block layout of a batch before its tokens are reserved (read-only snapshot).

    ``chunks[d]`` lists ``(block_id or -1, query tokens)`` per chunk at depth d; at the deepest
    level there is one chunk per sequence and ``trailing[i]`` holds sequence i's blocks below it.
    """

    seq_ids: Tuple[int, ...]
    append_lengths: Tuple[int, ...]
    seq_lengths_before: Tuple[int, ...]
    chunks: Tuple[Tuple[Tuple[int, int], ...], ...]
    trailing: Tuple[Tuple[int, ...], ...]
    use_decode_kernel: Tuple[bool, ...]

    @classmethod
    def collect(cls, paging: PagingState, seq_ids: Sequence[int], append_lengths: Sequence[int]) -> "BatchStructure":
        traces = [paging.block_trace(s) for s in seq_ids]
        heads = [t[:MAX_BLOCK_DEPTH] for t in traces]
        trailing = tuple(tuple(t[MAX_BLOCK_DEPTH:]) for t in traces)
        num_depths = max(len(h) for h in heads)
        is_decode = all(n == 1 for n in append_lengths)
        chunks, use_decode = [], []
        for d in range(num_depths):
            block_ids = [h[d] if d < len(h) else -1 for h in heads]
            depth_chunks, decode = _chunk_depth(paging, block_ids, append_lengths, is_decode,
                                                coalesce=d != MAX_BLOCK_DEPTH - 1)
            chunks.append(depth_chunks)
            use_decode.append(decode)
        return cls(
            seq_ids=tuple(seq_ids),
            append_lengths=tuple(append_lengths),
            seq_lengths_before=tuple(paging.sequence_length(s) for s in seq_ids),
            chunks=tuple(chunks),
            trailing=trailing,
            use_decode_kernel=tuple(use_decode),
        )


def _chunk_depth(paging: PagingState, block_ids: List[int], append_lengths: Sequence[int],
                 is_decode: bool, *, coalesce: bool) -> Tuple[Tuple[Tuple[int, int], ...], bool]:
    """Chunks of one depth and whether it uses the decode kernel (TVM's ``GetChunkedBlockIds``).

    Adjacent sequences on the same block can be coalesced into one prefill chunk. A decode batch
    keeps one chunk per sequence (decode kernel) unless coalescing saves at least
    ``COALESCE_RATIO_THRESHOLD`` times the page reads.
    """
    def num_pages(block_id: int) -> int:
        return len(paging.block(block_id).page_ids) if block_id != -1 else 0

    uncoalesced = tuple(zip(block_ids, append_lengths))
    coalesced: List[Tuple[int, int]] = []
    for block_id, length in uncoalesced:
        if coalesced and coalesced[-1][0] == block_id:
            coalesced[-1] = (block_id, coalesced[-1][1] + length)
        else:
            coalesced.append((block_id, length))
    pages_uncoalesced = sum(num_pages(b) for b in block_ids)
    pages_coalesced = sum(num_pages(b) for b, _ in coalesced)
    ratio = pages_uncoalesced / pages_coalesced if pages_coalesced > 0 else 0.0
    use_decode = is_decode and ratio < COALESCE_RATIO_THRESHOLD
    return (uncoalesced if use_decode or not coalesce else tuple(coalesced)), use_decode


def _last_page_len(seq_length: int, sink_length: int, window_offset: int, page_size: int) -> int:
    if seq_length == 0:
        return 0
    return (seq_length - sink_length + window_offset - 1) % page_size + 1


def build_depths(paging: PagingState, structure: BatchStructure, *, sliding_window: bool) -> Tuple[DepthMetadata, ...]:
    """Depth arrays of the batch from the current page tables (TVM's ``BeginForward`` loop)."""
    page_size = paging.page_size
    depths = []
    for d, chunks in enumerate(structure.chunks):
        deepest = d == MAX_BLOCK_DEPTH - 1
        lengths = [n for _, n in chunks]
        page_lists: List[Sequence[int]] = []
        info = np.zeros((3, len(chunks)), dtype=np.int32)  # last_page_len, window offset, sink
        k_rope = np.zeros(len(chunks), dtype=np.int32)
        for i, (block_id, _) in enumerate(chunks):
            if block_id == -1:
                page_lists.append(())
                continue
            block = paging.block(block_id)
            chain = [block] + ([paging.block(b) for b in structure.trailing[i]] if deepest else [])
            last = chain[-1]
            page_lists.append(block.page_ids if len(chain) == 1 else [p for blk in chain for p in blk.page_ids])
            info[0, i] = _last_page_len(sum(blk.seq_length for blk in chain), last.sink_length,
                                        last.sliding_window_offset, page_size)
            info[1, i] = last.sliding_window_offset
            info[2, i] = last.sink_length
            k_rope[i] = block.start_pos
        depths.append(DepthMetadata(
            qo_indptr=_indptr(lengths),
            page_indptr=_indptr([len(p) for p in page_lists]),
            page_indices=_concat(page_lists),
            length_info=info if sliding_window else info[0].copy(),
            k_rope_pos_offset=k_rope,
            use_decode_kernel=structure.use_decode_kernel[d],
        ))
    return tuple(depths)


def build_token_maps(paging: PagingState, structure: BatchStructure,
                     last_block_lengths_before: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
    """RoPE positions and pool positions of the step's new tokens, after their reservation.

    Returns ``(q_rope_position [n], append_position [n])``. A token whose slot is pinned by an
    attention sink gets position -1 (not written), as in TVM.
    """
    page_size = paging.page_size
    q_pos: List[int] = []
    a_pos: List[int] = []
    for i, seq_id in enumerate(structure.seq_ids):
        n = structure.append_lengths[i]
        before = structure.seq_lengths_before[i]
        q_pos.extend(range(before, before + n))
        block = paging.block(paging.sequence(seq_id).last_block)
        if block.sink_length == 0 and n <= page_size:
            # Common case (no attention sink): slots follow the window offset contiguously.
            pages = block.page_ids
            for off in range(block.seq_length - n + block.sliding_window_offset,
                             block.seq_length + block.sliding_window_offset):
                a_pos.append(pages[off // page_size] * page_size + off % page_size)
        else:
            a_pos.extend(_sink_aware_positions(block, n, last_block_lengths_before[i], page_size).tolist())
    return np.array(q_pos, dtype=np.int32), np.array(a_pos, dtype=np.int32)


def _sink_aware_positions(block, n: int, last_block_length_before: int, page_size: int) -> np.ndarray:
    """Pool positions of the last n tokens of a block, honouring its attention sink."""
    pos = np.arange(n, dtype=np.int64)
    in_block = block.seq_length - n + pos
    in_sink = last_block_length_before + pos < block.sink_length
    pinned = ~in_sink & (in_block < block.sink_length)
    offset = np.where(in_sink, last_block_length_before + pos,
                      in_block - block.sink_length + block.sliding_window_offset)
    offset = np.where(pinned, 0, offset)
    pages = np.asarray(block.page_ids, dtype=np.int64)
    slots = pages[offset // page_size] * page_size + offset % page_size
    return np.where(pinned, -1, slots)


def _indptr(lengths: Sequence[int]) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=out[1:])
    return out


def _concat(parts: Sequence[Sequence[int]]) -> np.ndarray:
    if not parts:
        return np.zeros(0, dtype=np.int32)
    if all(isinstance(p, np.ndarray) for p in parts):
        return np.concatenate(parts).astype(np.int32, copy=False)
    return np.fromiter((x for p in parts for x in p), dtype=np.int32)
