"""The forward step in progress, and the uploader that places a planned step on the device.

A step runs one way through three stages: the planner (:mod:`.planner`, over the paging state
and :mod:`relax_kvcache.metadata`) turns ``begin_forward``'s arguments into host arrays
(`metadata.StepMetadata`); :class:`StepUploader` copies them to the device in one transfer and
makes the views the kernels read (:class:`DeviceStep`); the cache keeps the result, one frozen
:class:`Step`, until ``end_forward`` drops it.

Shapes: B = sequences in the step, n = tokens of the step, c = chunks at a depth, Hq / Hkv =
query / KV heads, D / Dv = q-k / v head dims; every index array is int32.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Sequence, Set, Tuple

import numpy as np
import tvm

from .. import metadata as md
from ..aux_buffer import AuxBuffer, SlotBuffer
from ..config import KVCacheConfig
from ..errors import ForwardError
from ..tensors import allocate, view

#: Page ids per sequence that fixed decode slots leave free for the page lists to grow into.
DECODE_PAGE_HEADROOM = 32


@dataclasses.dataclass(frozen=True)
class PageViews:
    """Device views of a set of page lists (see `metadata.DepthMetadata` / `WindowPages`).

    Attributes
    ----------
    page_indptr : int32 (c + 1,)
    page_indices : int32 (nnz,)
    length_info : int32 (c,) or (3, c)
    k_rope_pos_offset : int32 (c,)
    has_pages : bool
        Whether any chunk reads a page (kernels are skipped otherwise).
    """

    page_indptr: tvm.runtime.Tensor
    page_indices: tvm.runtime.Tensor
    length_info: tvm.runtime.Tensor
    k_rope_pos_offset: tvm.runtime.Tensor
    has_pages: bool


@dataclasses.dataclass(frozen=True)
class TreeViews:
    """Device views of token-tree masks (see `metadata.TreeMask`): ``mn_indptr (c + 1,)``,
    ``mask (nodes, 2)``."""

    mn_indptr: tvm.runtime.Tensor
    mask: tvm.runtime.Tensor


@dataclasses.dataclass(frozen=True)
class DepthViews:
    """Device views of one block depth: ``qo_indptr (c + 1,)``, all its pages, what local
    layers read (``window``, caches with local layers) and its tree masks (tree steps)."""

    qo_indptr: tvm.runtime.Tensor
    use_decode_kernel: bool
    pages: PageViews
    window: Optional[PageViews]
    tree: Optional[TreeViews]


@dataclasses.dataclass(frozen=True)
class DeviceStep:
    """What a step's kernels read and write on the device.

    Attributes
    ----------
    append_indptr : int32 (B + 1,)
    k_ragged_rope_pos_offset : int32 (B,)
    q_rope_position : int32 (n,)
    append_position : int32 (n,)
        Page slot (``page * page_size + offset``) of each new token.
    depths : tuple of DepthViews
        Root depth first.
    ragged_tree : TreeViews, optional
        Masks of the ragged tree kernel (tree steps not appended before attention).
    q, k, v : Tensor, optional
        ``(n, Hq, D)``, ``(n, Hkv, D)``, ``(n, Hkv, Dv)`` cache dtype: ``split_rotary``'s output
        (None for MLA, whose model passes q / k / v).
    tmp_o : Tensor (n, Hq, Dv), cache dtype
        A depth's partial output before it is merged.
    tmp_lse : Tensor (n, Hq), float32
    merged_lse : Tensor (n, Hq), float32
        LSE of ``attention_with_fused_qkv``'s output.
    """

    append_indptr: tvm.runtime.Tensor
    k_ragged_rope_pos_offset: tvm.runtime.Tensor
    q_rope_position: tvm.runtime.Tensor
    append_position: tvm.runtime.Tensor
    depths: Tuple[DepthViews, ...]
    ragged_tree: Optional[TreeViews]
    q: Optional[tvm.runtime.Tensor]
    k: Optional[tvm.runtime.Tensor]
    v: Optional[tvm.runtime.Tensor]
    tmp_o: tvm.runtime.Tensor
    tmp_lse: tvm.runtime.Tensor
    merged_lse: tvm.runtime.Tensor

    def depths_with_pages(self, windowed: bool) -> Tuple[Tuple[DepthViews, PageViews], ...]:
        """(depth, the page views a layer reads) for the depths where it reads any page."""
        views = ((d, d.window if windowed else d.pages) for d in self.depths)
        return tuple((d, p) for d, p in views if p.has_pages)


@dataclasses.dataclass(frozen=True)
class Step:
    """The forward step in progress, from ``begin_forward`` to ``end_forward``.

    Attributes
    ----------
    meta : metadata.StepMetadata
        The plan as host arrays (batch, token maps, per-depth page lists).
    device : DeviceStep
        Its arrays on the device and the scratch views of its ``n`` tokens. Repeated decode
        steps of one batch share one (fixed slots: see :meth:`StepUploader.place`).
    fixed_slots : bool
        Whether ``device`` lives in fixed slots (its kernels may be captured in a CUDA graph).
    buffer : AuxBuffer or SlotBuffer
        What the arrays were uploaded through; ``buffer.wait()`` orders the compute stream
        after the copy.
    appended : set of int
        Layers whose K/V the step has appended so far: the one part that grows during the step.
    """

    meta: md.StepMetadata
    device: DeviceStep
    fixed_slots: bool
    buffer: Any
    appended: Set[int] = dataclasses.field(default_factory=set)

    @property
    def total_tokens(self) -> int:
        return self.meta.total_tokens

    def check_not_overwritten(self, what: str, layer: int, layer_id: int) -> None:
        """Refuse ``what``, a read of ``layer``'s KV, once its append overwrote pages that slid
        out of a window this step."""
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
    """Per-step scratch tensors of ``prefill_chunk_size`` rows; a step uses its first ``n``.

    ``q (chunk, Hq, D)``, ``k (chunk, Hkv, D)``, ``v (chunk, Hkv, Dv)`` (MHA only: MLA layers
    take q / k / v from the model), ``o (chunk, Hq, Dv)``, float32 ``lse`` and ``merged_lse``
    ``(chunk, Hq)``.
    """

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
    (`SlotBuffer`) for repeated decode steps, whose views stay the same from step to step.

    Parameters
    ----------
    config : KVCacheConfig
    device : tvm.runtime.Device
    scratch : Scratch
        The cache's scratch tensors (the step's views cover their first ``n`` rows).
    """

    def __init__(self, config: KVCacheConfig, device: tvm.runtime.Device, scratch: Scratch) -> None:
        self._config, self._device, self._scratch = config, device, scratch
        self._aux = AuxBuffer(device, 4 * (config.max_num_seqs + 1) * (md.MAX_BLOCK_DEPTH + 2)
                              + md.MAX_BLOCK_DEPTH * config.num_total_pages + 2 * config.prefill_chunk_size)
        # repeated decode steps' fixed slots: (depths' has_pages, slots, the step's views, batch)
        self._slots: Optional[Tuple[Tuple[Any, ...], SlotBuffer, DeviceStep, Tuple[int, ...]]] = None

    def place(self, meta: md.StepMetadata, *, repeated_decode: bool) -> Step:
        """Upload ``meta``'s arrays (asynchronously on CUDA); the step that reads them.

        ``repeated_decode``: a decode step the decode planner keeps (see
        :mod:`relax_kvcache.decode_plan`); it goes to the fixed slots.
        """
        if repeated_decode:
            device, buffer = self._place_decode(meta)
            return Step(meta, device, True, buffer)
        return Step(meta, self._device_views(meta, self._aux.upload(_packed_arrays(meta))), False, self._aux)

    def _place_decode(self, meta: md.StepMetadata) -> Tuple[DeviceStep, SlotBuffer]:
        """Fixed slots: the views (and so every kernel argument) stay the same while the batch
        keeps its structure and its page lists fit the slots' headroom; a CUDA graph captured
        on one such step replays on the next ones (see :mod:`relax_kvcache.cuda_graph`)."""
        fixed, page_lists = _decode_arrays(meta)
        arrays = fixed + page_lists
        has_pages = tuple((d.has_pages, d.window.has_pages if d.window is not None else None) for d in meta.depths)
        slots = self._slots
        if slots is None or slots[0] != has_pages or not slots[1].fits(arrays):
            headroom = DECODE_PAGE_HEADROOM * meta.batch_size
            shapes = [a.shape for a in fixed] + [(a.size + headroom,) for a in page_lists]
            buffer = SlotBuffer(self._device, shapes, [False] * len(fixed) + [True] * len(page_lists))
            slots = self._slots = (has_pages, buffer, self._slot_views(meta, buffer), meta.seq_ids)
        elif slots[3] != meta.seq_ids:
            # another batch of the same structure: the same slots, but a new object, so that a
            # graph captured with the old batch's forward is not replayed for this one
            slots = self._slots = (has_pages, slots[1], self._slot_views(meta, slots[1]), meta.seq_ids)
        slots[1].upload(arrays)
        return slots[2], slots[1]

    def _slot_views(self, meta: md.StepMetadata, buffer: SlotBuffer) -> DeviceStep:
        """The views of a decode step whose arrays live in ``buffer``'s slots (laid out by
        `_decode_arrays`), in `_packed_arrays`' order (page indices second in each view set)."""
        fixed_count = 4 + sum(4 if depth.window is None else 7 for depth in meta.depths)
        fixed, page_lists = iter(buffer.views[:fixed_count]), iter(buffer.views[fixed_count:])
        views = [next(fixed) for _ in range(4)]
        for depth in meta.depths:
            qo, indptr, info, rope = (next(fixed) for _ in range(4))
            views += [qo, indptr, next(page_lists), info, rope]
            if depth.window is not None:
                w_indptr, w_info, w_rope = (next(fixed) for _ in range(3))
                views += [w_indptr, next(page_lists), w_info, w_rope]
        return self._device_views(meta, views)

    def _device_views(self, meta: md.StepMetadata, views: Sequence[tvm.runtime.Tensor]) -> DeviceStep:
        """The `DeviceStep` of ``meta`` from its arrays' device views, in `_packed_arrays`' order."""
        views = iter(views)
        head = [next(views) for _ in range(4)]
        depths = []
        for depth in meta.depths:
            qo_indptr = next(views)
            pages = PageViews(next(views), next(views), next(views), next(views), depth.has_pages)
            window = (PageViews(next(views), next(views), next(views), next(views), depth.window.has_pages)
                      if depth.window is not None else None)
            tree = TreeViews(next(views), next(views)) if depth.tree is not None else None
            depths.append(DepthViews(qo_indptr, depth.use_decode_kernel, pages, window, tree))
        ragged_tree = TreeViews(next(views), next(views)) if meta.ragged_tree is not None else None
        n, s = meta.total_tokens, self._scratch
        dt, f32 = s.o.dtype, s.lse.dtype

        def rows(tensor: Optional[tvm.runtime.Tensor], dtype: Any) -> Optional[tvm.runtime.Tensor]:
            return None if tensor is None else view(tensor, (n,) + tuple(tensor.shape[1:]), 0, dtype)

        return DeviceStep(
            append_indptr=head[0], k_ragged_rope_pos_offset=head[1], q_rope_position=head[2],
            append_position=head[3], depths=tuple(depths), ragged_tree=ragged_tree,
            q=rows(s.q, dt), k=rows(s.k, dt), v=rows(s.v, dt), tmp_o=rows(s.o, dt), tmp_lse=rows(s.lse, f32),
            merged_lse=rows(s.merged_lse, f32),
        )


def _packed_arrays(meta: md.StepMetadata) -> List[np.ndarray]:
    """A step's arrays in upload order: the four token arrays, then per depth its qo_indptr
    and page lists (its window's, its tree masks), then the ragged tree masks."""
    arrays = [meta.append_indptr, meta.k_ragged_rope_pos_offset, meta.q_rope_position, meta.append_position]
    for depth in meta.depths:
        arrays += [depth.qo_indptr, depth.page_indptr, depth.page_indices, depth.length_info,
                   depth.k_rope_pos_offset]
        if depth.window is not None:
            w = depth.window
            arrays += [w.page_indptr, w.page_indices, w.length_info, w.k_rope_pos_offset]
        if depth.tree is not None:
            arrays += [depth.tree.mn_indptr, depth.tree.mask]
    if meta.ragged_tree is not None:
        arrays += [meta.ragged_tree.mn_indptr, meta.ragged_tree.mask]
    return arrays


def _decode_arrays(meta: md.StepMetadata) -> Tuple[List[np.ndarray], List[np.ndarray]]:
    """A decode step's arrays for `SlotBuffer` slots: (fixed-shape arrays, page lists).

    Fixed: the step's four token arrays, then per depth its qo_indptr, page_indptr,
    length_info and k_rope_pos_offset (and its window's page_indptr, length_info and
    k_rope_pos_offset). Page lists: per depth its page_indices (and its window's)."""
    fixed = [meta.append_indptr, meta.k_ragged_rope_pos_offset, meta.q_rope_position, meta.append_position]
    page_lists = []
    for depth in meta.depths:
        fixed += [depth.qo_indptr, depth.page_indptr, depth.length_info, depth.k_rope_pos_offset]
        page_lists.append(depth.page_indices)
        if depth.window is not None:
            w = depth.window
            fixed += [w.page_indptr, w.length_info, w.k_rope_pos_offset]
            page_lists.append(w.page_indices)
    return fixed, page_lists
