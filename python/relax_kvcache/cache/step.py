"""The forward step in progress (:class:`Step`, kept until ``end_forward``), and the uploader
that copies a planned step's host arrays to the device in one transfer (:class:`DeviceStep`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import tvm

from .. import metadata as md
from ..aux_buffer import AuxBuffer, SlotBuffer
from ..config import KVCacheConfig
from ..errors import ForwardError
from ..tensors import allocate, view

#: Page ids per sequence that fixed decode slots leave free for the page lists to grow into.
DECODE_PAGE_HEADROOM = 32
#: Sets of fixed decode slots kept (one per batch size and page-list structure; the least
#: recently used goes first).
MAX_SLOT_SETS = 16


@dataclasses.dataclass(frozen=True)
class PageViews:
    """Device views of a set of page lists (see `metadata.DepthMetadata` / `WindowPages`)."""

    page_indptr: tvm.runtime.Tensor  # (c + 1,)
    page_indices: tvm.runtime.Tensor  # (nnz,)
    length_info: tvm.runtime.Tensor  # (c,) or (3, c)
    k_rope_pos_offset: tvm.runtime.Tensor  # (c,)
    has_pages: bool  # whether any chunk reads a page (kernels are skipped otherwise)


@dataclasses.dataclass(frozen=True)
class TreeViews:
    """Device views of token-tree masks (see `metadata.TreeMask`)."""

    mn_indptr: tvm.runtime.Tensor  # (c + 1,)
    mask: tvm.runtime.Tensor  # (nodes, 2)


@dataclasses.dataclass(frozen=True)
class DepthViews:
    """Device views of one block depth: all its pages, what local layers read (``window``,
    caches with local layers) and its tree masks (tree steps)."""

    qo_indptr: tvm.runtime.Tensor  # (c + 1,)
    use_decode_kernel: bool
    pages: PageViews
    window: Optional[PageViews]
    tree: Optional[TreeViews]


@dataclasses.dataclass(frozen=True)
class DeviceStep:
    """What a step's kernels read and write on the device (see `metadata.StepMetadata`)."""

    append_indptr: tvm.runtime.Tensor  # (B + 1,)
    k_ragged_rope_pos_offset: tvm.runtime.Tensor  # (B,)
    q_rope_position: tvm.runtime.Tensor  # (n,)
    append_position: tvm.runtime.Tensor  # (n,) page slot of each new token
    depths: Tuple[DepthViews, ...]  # root depth first
    ragged_tree: Optional[TreeViews]  # masks of the ragged tree kernel
    q: Optional[tvm.runtime.Tensor]  # split_rotary's output (n, Hq, D); None for MLA, and:
    k: Optional[tvm.runtime.Tensor]  # (n, Hkv, D)
    v: Optional[tvm.runtime.Tensor]  # (n, Hkv, Dv)
    tmp_o: tvm.runtime.Tensor  # (n, Hq, Dv): a depth's partial output before it is merged
    tmp_lse: tvm.runtime.Tensor  # (n, Hq) float32
    merged_lse: tvm.runtime.Tensor  # (n, Hq) float32: LSE of attention_with_fused_qkv's output
    grown: Optional[PageViews] = None  # `metadata.GrownPages` (with the depth's k_rope_pos_offset)
    # depths_with_pages(False), depths_with_pages(True)
    _with_pages: Tuple[Any, Any] = dataclasses.field(default=((), ()), repr=False, compare=False)

    def __post_init__(self) -> None:
        views = [tuple((d, p) for d, p in ((d, d.window if windowed else d.pages) for d in self.depths)
                       if p is not None and p.has_pages) for windowed in (False, True)]
        object.__setattr__(self, "_with_pages", tuple(views))

    def depths_with_pages(self, windowed: bool) -> Tuple[Tuple[DepthViews, PageViews], ...]:
        """(depth, the page views a layer reads) for the depths where it reads any page."""
        return self._with_pages[windowed]


@dataclasses.dataclass(frozen=True)
class Step:
    """The forward step in progress, from ``begin_forward`` to ``end_forward``."""

    meta: md.StepMetadata  # the plan as host arrays
    device: DeviceStep  # its device arrays and scratch views (repeated decode steps share one)
    fixed_slots: bool  # whether device lives in fixed slots (a CUDA graph may capture it)
    buffer: Any  # the AuxBuffer or SlotBuffer; buffer.wait() orders the compute stream after it
    total_tokens: int  # meta.total_tokens
    # layers whose K/V the step has appended so far
    appended: Set[int] = dataclasses.field(default_factory=set)

    def check_not_overwritten(self, what: str, layer: int, layer_id: int) -> None:
        """Refuse ``what``, a read of ``layer``'s KV, once its append overwrote slid-out pages."""
        if self.meta.reused_pages and layer in self.appended:
            raise ForwardError(self.reused_pages_message(what, layer_id))

    def reused_pages_message(self, what: str, layer_id: int) -> str:
        return (f"{what} would read layer {layer_id}'s KV after its append overwrote page(s) "
                f"{list(dict.fromkeys(self.meta.reused_pages))[:8]}: in this step they slid out of a sequence's window, "
                "whose attention reads their old tokens, and hold new tokens of this step. Steps where "
                "windows slide attend before appending, so a layer's KV can be read only by its own "
                "attention_with_fused_qkv call (a batch whose windows free no page for others avoids this)")


@dataclasses.dataclass(frozen=True)
class Scratch:
    """Per-step scratch tensors of ``prefill_chunk_size`` rows (a step uses its first ``n``):
    q, k, v (MHA only: MLA layers take them from the model), o, float32 lse and merged_lse."""

    q: Optional[tvm.runtime.Tensor]
    k: Optional[tvm.runtime.Tensor]
    v: Optional[tvm.runtime.Tensor]
    o: tvm.runtime.Tensor
    lse: tvm.runtime.Tensor
    merged_lse: tvm.runtime.Tensor

    @classmethod
    def allocate(cls, config: KVCacheConfig, device: tvm.runtime.Device) -> "Scratch":
        chunk, hq, hkv, dt = config.prefill_chunk_size, config.num_qo_heads, config.num_kv_heads, config.dtype
        split = not config.is_mla
        return cls(
            q=allocate((chunk, hq, config.head_dim), dt, device, "q scratch") if split else None,
            k=allocate((chunk, hkv, config.head_dim), dt, device, "k scratch") if split else None,
            v=allocate((chunk, hkv, config.v_head_dim), dt, device, "v scratch") if split else None,
            o=allocate((chunk, hq, config.v_head_dim), dt, device, "o scratch"),
            lse=allocate((chunk, hq), "float32", device, "lse scratch"),
            merged_lse=allocate((chunk, hq), "float32", device, "lse scratch"),
        )


class StepUploader:
    """Places a planned step on the device: one packed upload (`AuxBuffer`), or fixed slots
    (`SlotBuffer`) for repeated decode steps, whose views stay the same from step to step."""

    def __init__(self, config: KVCacheConfig, device: tvm.runtime.Device, scratch: Scratch) -> None:
        self._config, self._device, self._scratch = config, device, scratch
        self._aux = AuxBuffer(device, 4 * (config.max_num_seqs + 1) * (md.MAX_BLOCK_DEPTH + 2)
                              + md.MAX_BLOCK_DEPTH * config.num_total_pages + 2 * config.prefill_chunk_size)
        self._scratch_views: Dict[int, Tuple[Optional[tvm.runtime.Tensor], ...]] = {}  # by row count
        # repeated decode steps' fixed slots by (batch size, depths, has_pages of each page list),
        # least recently used first: (slots, a step on their views, its batch)
        self._slot_sets: Dict[Tuple[Any, ...], Tuple[SlotBuffer, Step, Tuple[int, ...]]] = {}
        self._slots: Optional[Tuple[SlotBuffer, Step, Tuple[int, ...]]] = None  # the last step's
        self._plain_placed: Optional[Step] = None  # the last step `_place_plain` made, and what
        # (its token array, window array, slots, a function that writes the arrays to the slots again)
        self._rewrite_plain: Tuple[Any, Any, Any, Callable[[], None]] = (None, None, None, lambda: None)

    def reuse(self, meta: md.StepMetadata) -> Optional[Step]:
        """The step before, its token block written to the slots again, when ``meta`` is its
        metadata updated in place (`DecodePlanner.repeat`); else None (then `place`)."""
        last = self._plain_placed
        if last is None or last.meta is not meta:
            return None
        self._rewrite_plain[3]()
        last.appended.clear()
        return last

    def place(self, meta: md.StepMetadata, *, repeated_decode: bool, tokens: Optional[np.ndarray] = None,
              window: Optional[np.ndarray] = None) -> Step:
        """Upload ``meta``'s arrays (asynchronously on CUDA); the step that reads them.
        ``repeated_decode``: a step the decode planner keeps, placed in the fixed slots.
        ``tokens``: ``meta`` is the step before's with new token arrays and last-page lengths of
        its only depth, the concatenation ``tokens`` (`DecodePlanner.plain_tokens`), and the
        window's length_info and k_rope_pos_offset, the concatenation ``window``
        (`DecodePlanner.plain_window`), both of which may change in place."""
        self._plain_placed = None
        if tokens is not None:
            step = self._place_plain(meta, tokens, window)
            if step is not None:
                return step
        arrays = _packed_arrays(meta)
        if not repeated_decode:
            self._slots = None
            return Step(meta, self._device_views(meta, self._aux.upload(arrays)), False, self._aux, meta.total_tokens)
        # Fixed slots, a set per batch size and structure: the views stay the same while a batch
        # of that size and structure fits the slots' headroom (a captured CUDA graph replays on them).
        key = (meta.batch_size, len(meta.depths),
               tuple([_has_pages(p) for d in meta.depths for p in (d, d.window) if p is not None]))
        sets = self._slot_sets
        slots = sets.pop(key, None)  # re-inserted last: the most recently used
        if slots is None or not slots[0].upload(arrays, every=tokens is not None):
            headroom = DECODE_PAGE_HEADROOM * meta.batch_size
            page_lists = _page_lists(meta)
            shapes = [(a.size + headroom,) if page_list else a.shape for a, page_list in zip(arrays, page_lists)]
            slots = (SlotBuffer(self._device, shapes, page_lists), None, None)
            slots[0].upload(arrays)
        if slots[2] == meta.seq_ids:  # the same batch: the same views (a captured CUDA graph replays on them)
            step = md.evolve(slots[1], meta=meta, appended=set())
        else:  # new slots or another batch: new views (see PagedAttentionKVCache.capturable_step)
            buffer = slots[0]
            step = Step(meta, self._device_views(meta, buffer.views), True, buffer, meta.batch_size)
            slots = (buffer, step, meta.seq_ids)
        sets[key] = self._slots = slots
        if len(sets) > MAX_SLOT_SETS:
            del sets[next(iter(sets))]
        return step

    def _place_plain(self, meta: md.StepMetadata, tokens: np.ndarray, win: Optional[np.ndarray]) -> Optional[Step]:
        """``place`` of a plain step (`DecodePlanner.plain_tokens`) when the slots hold the step
        before, but for its token arrays, last-page lengths, window arrays and page lists (else
        None): the same views."""
        slots = self._slots
        if slots is None or (slots[2] is not meta.seq_ids and slots[2] != meta.seq_ids) or len(meta.depths) != 1:
            return None
        buffer, depth = slots[0], meta.depths[0]
        window = depth.window
        if not (buffer.holds(4, meta.append_indptr) and buffer.holds(5, depth.qo_indptr)
                and buffer.holds(8, depth.k_rope_pos_offset) and (window is None) == (win is None)
                and depth.tree is None and meta.ragged_tree is None):
            return None
        runs = [(0, tokens, (meta.k_ragged_rope_pos_offset, meta.q_rope_position, meta.append_position,
                             depth.length_info))]
        lists = [(6, depth)] + ([(9, window)] if window is not None else [])
        for i, pages in lists:  # page lists that grew (or dropped pages)
            indptr, indices = pages.page_indptr, pages.page_indices
            if not (buffer.holds(i, indptr) and buffer.holds(i + 1, indices)):
                if not buffer.fits(i + 1, indices):
                    return None
                block = indptr.base  # one array, indptr then indices (`decode_plan._append_pages`)?
                if block is not None and indices.base is block and block.size == indptr.size + indices.size:
                    runs.append((i, block, (indptr, indices)))
                else:
                    runs += [(i, indptr, (indptr,)), (i + 1, indices, (indices,))]
        if window is not None:
            runs.append((11, win, (window.length_info, window.k_rope_pos_offset)))
        buffer.rewrite(runs)
        self._plain_placed = md.evolve(slots[1], meta=meta, appended=set())
        rewrite = self._rewrite_plain
        if rewrite[0] is not tokens or rewrite[1] is not win or rewrite[2] is not buffer:
            write = buffer.rewriter(0, tokens)
            if win is not None:
                write = functools.partial(_run_both, write, buffer.rewriter(11, win))
            self._rewrite_plain = (tokens, win, buffer, write)
        return self._plain_placed

    def _device_views(self, meta: md.StepMetadata, views: Sequence[tvm.runtime.Tensor]) -> DeviceStep:
        """The `DeviceStep` of ``meta`` from its arrays' device views, in `_packed_arrays`' order."""
        views = iter(views)
        k_ragged_rope_pos_offset, q_rope_position, append_position = (next(views) for _ in range(3))
        length_infos = [next(views) for _ in meta.depths]
        append_indptr = next(views)
        depths = []
        for depth, length_info in zip(meta.depths, length_infos):
            qo_indptr, page_indptr, page_indices = (next(views) for _ in range(3))
            pages = PageViews(page_indptr, page_indices, length_info, next(views), _has_pages(depth))
            window = (PageViews(*(next(views) for _ in range(4)), _has_pages(depth.window))
                      if depth.window is not None else None)
            tree = TreeViews(next(views), next(views)) if depth.tree is not None else None
            depths.append(DepthViews(qo_indptr, depth.use_decode_kernel, pages, window, tree))
        ragged_tree = TreeViews(next(views), next(views)) if meta.ragged_tree is not None else None
        grown = (PageViews(next(views), next(views), next(views), depths[0].pages.k_rope_pos_offset, True)
                 if meta.grown is not None else None)
        q, k, v, tmp_o, tmp_lse, merged_lse = self._scratch_rows(meta.total_tokens)
        return DeviceStep(
            append_indptr=append_indptr, k_ragged_rope_pos_offset=k_ragged_rope_pos_offset,
            q_rope_position=q_rope_position, append_position=append_position, depths=tuple(depths),
            ragged_tree=ragged_tree,
            q=q, k=k, v=v, tmp_o=tmp_o, tmp_lse=tmp_lse, merged_lse=merged_lse, grown=grown,
        )

    def _scratch_rows(self, n: int) -> Tuple[Optional[tvm.runtime.Tensor], ...]:
        """Views of the first ``n`` rows of the scratch tensors (q, k, v, o, lse, merged_lse),
        made once per ``n``."""
        views = self._scratch_views.get(n)
        if views is None:
            s = self._scratch
            dt, f32 = s.o.dtype, s.lse.dtype

            def rows(tensor: Optional[tvm.runtime.Tensor], dtype: Any) -> Optional[tvm.runtime.Tensor]:
                return None if tensor is None else view(tensor, (n,) + tuple(tensor.shape[1:]), 0, dtype)

            views = (rows(s.q, dt), rows(s.k, dt), rows(s.v, dt), rows(s.o, dt), rows(s.lse, f32),
                     rows(s.merged_lse, f32))
            if len(self._scratch_views) >= 4096:
                self._scratch_views.clear()
            self._scratch_views[n] = views
        return views


def _run_both(first: Callable[[], None], second: Callable[[], None]) -> None:
    first()
    second()


def _has_pages(p: Any) -> bool:  # a DepthMetadata or WindowPages
    return p.page_indices.size > 0


def _packed_arrays(meta: md.StepMetadata) -> List[np.ndarray]:
    """A step's arrays in upload order: those a decode step changes first (token arrays, then
    each depth's last-page lengths), then the rest."""
    arrays = [meta.k_ragged_rope_pos_offset, meta.q_rope_position, meta.append_position,
              *(depth.length_info for depth in meta.depths), meta.append_indptr]
    for depth in meta.depths:
        arrays += (depth.qo_indptr, depth.page_indptr, depth.page_indices, depth.k_rope_pos_offset)
        window = depth.window
        if window is not None:
            arrays += (window.page_indptr, window.page_indices, window.length_info, window.k_rope_pos_offset)
        if depth.tree is not None:
            arrays += (depth.tree.mn_indptr, depth.tree.mask)
    if meta.ragged_tree is not None:
        arrays += (meta.ragged_tree.mn_indptr, meta.ragged_tree.mask)
    if meta.grown is not None:
        arrays += (meta.grown.page_indptr, meta.grown.page_indices, meta.grown.length_info)
    return arrays


def _page_lists(meta: md.StepMetadata) -> List[bool]:
    """Whether each of `_packed_arrays` is a page list (which may grow)."""
    page_set = [False, True, False, False]
    flags = [False] * (4 + len(meta.depths))
    for depth in meta.depths:
        flags += [False, False, True, False, *(page_set if depth.window is not None else ()),
                  *((False, False) if depth.tree is not None else ())]
    return (flags + ([False, False] if meta.ragged_tree is not None else [])
            + ([False, True, False] if meta.grown is not None else []))
