"""Kernels that move KV data in and out of pages (TVM's calling conventions, ``docs/kernels.md``).

A pool position is ``page_id * page_size + slot``. Each kernel's per-element work is a macro
moving one span ``[d0, d0 + lanes)`` of one head; CPU nests run ``T.parallel`` with head_dim as one
span, GPU nests flatten the spans onto ``blockIdx.x x threadIdx.x``, one ``vector_bytes`` span a
thread.
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.script import tirx as T

from .schedule import GpuSchedule, Schedule
from .macros import dequantized, early_start, quantized, without_param
from .spec import LatentPageSpec, PageLayoutSpec


def store_span(spec: PageLayoutSpec):
    """Macro storing one span of row ``row`` of ``src`` at pool position ``pos``; 8-bit pages:
    quantized by the head's scale in ``scales``, element by element (TVM's software conversion
    to 8-bit floats does not vectorize)."""
    if spec.quantized:
        @T.macro
        def store_quantized(pages, pos, kv: T.int32, h, src, row, d0, lanes: T.int32, ps: T.int32, scales):
            for d in T.serial(lanes):
                pages[pos // ps, kv, h, pos % ps, d0 + d] = quantized(spec, src[row, h, d0 + d], scales[kv, h])

        return store_quantized

    @T.macro
    def store(pages, pos, kv: T.int32, h, src, row, d0, lanes: T.int32, ps: T.int32, scales):
        for d in T.vectorized(lanes):
            pages[pos // ps, kv, h, pos % ps, d0 + d] = src[row, h, d0 + d]

    return store


def load_span(spec: PageLayoutSpec):
    """Macro loading one span of pool position ``pos`` into ``dst[layer, row]`` (8-bit pages:
    dequantized)."""

    @T.macro
    def load(dst, layer, row, pages, pos, kv: T.int32, h, d0, lanes: T.int32, ps: T.int32, scales):
        for d in T.vectorized(lanes):
            dst[layer, row, h, d0 + d] = dequantized(spec, pages[pos // ps, kv, h, pos % ps, d0 + d],
                                                     (None,) * 5 + (scales,), kv, h)

    return load


@T.macro
def move_span(pages, src, dst, kv, h, d0, lanes: T.int32, ps: T.int32):
    for d in T.vectorized(lanes):
        pages[dst // ps, kv, h, dst % ps, d0 + d] = pages[src // ps, kv, h, src % ps, d0 + d]


@T.macro
def copy_page_span(pages, src_page, dst_page, kv, h, slot, d0, lanes: T.int32):
    for d in T.vectorized(lanes):
        pages[dst_page, kv, h, slot, d0 + d] = pages[src_page, kv, h, slot, d0 + d]


def gpu_lanes(sched: GpuSchedule, dtype: str, extent: int) -> int:
    """Elements of one ``vector_bytes``-wide access of ``dtype`` that divide ``extent``."""
    return sched.lanes_for(tvm.DataType(dtype).bits, extent)


def gpu_blocks(work, threads: int):
    """Blocks covering ``work`` items at ``threads`` a block; at least one (zero-size grids fail)."""
    return T.max(1, T.ceildiv(work, threads))


def make_transpose_append(spec: PageLayoutSpec, sched: Schedule) -> tirx.PrimFunc:
    """Append rows of k / v ``(n, H, D)`` at ``position_map``; 8-bit pages take a last argument
    ``kv_scales (2, H) float32`` and store ``value / scale`` saturated (PageLayoutSpec)."""
    H, D, ps, dtype = spec.num_kv_heads, spec.head_dim, spec.page_size, spec.dtype
    store = store_span(spec)
    if not isinstance(sched, GpuSchedule):
        @T.macro
        def nest(pages, k, v, position_map, n, scales):
            for i in T.parallel(n):
                with T.sblock("append"):
                    T.reads()
                    T.writes()
                    pos: T.let[T.int32] = position_map[i]
                    if pos != -1:
                        for h in T.serial(H):
                            store(pages, pos, 0, h, k, i, 0, D, ps, scales)
                            store(pages, pos, 1, h, v, i, 0, D, ps, scales)
    else:
        lanes, nt = gpu_lanes(sched, spec.dtype, D), sched.copy_threads
        nv = D // lanes  # spans of one head
        trigger = early_start(spec, sched)

        @T.macro
        def nest(pages, k, v, position_map, n, scales):
            for bx in T.thread_binding(gpu_blocks(n * H * nv, nt), thread="blockIdx.x"):
                for tx in T.thread_binding(nt, thread="threadIdx.x"):
                    with T.sblock("append"):
                        T.reads()
                        T.writes()
                        if trigger:  # a dependent decode may start its page lookups at once
                            T.evaluate(T.ptx.griddepcontrol.launch_dependents())
                        if bx * nt + tx < n * H * nv:
                            pos: T.let[T.int32] = position_map[(bx * nt + tx) // (H * nv)]
                            if pos != -1:
                                store(pages, pos, 0, (bx * nt + tx) // nv % H, k, (bx * nt + tx) // (H * nv),
                                      (bx * nt + tx) % nv * lanes, lanes, ps, scales)
                                store(pages, pos, 1, (bx * nt + tx) // nv % H, v, (bx * nt + tx) // (H * nv),
                                      (bx * nt + tx) % nv * lanes, lanes, ps, scales)

    @T.prim_func(s_tir=True)
    def transpose_append(var_pages: T.handle, var_k: T.handle, var_v: T.handle, var_position_map: T.handle,
                         var_kv_scales: T.handle):
        T.func_attr({"tirx.noalias": True})
        P = T.int64()
        n = T.int32()
        off_pos = T.int32()
        pages = T.match_buffer(var_pages, (P, 2, H, ps, D), spec.page_dtype)
        k = T.match_buffer(var_k, (n, H, D), dtype)
        v = T.match_buffer(var_v, (n, H, D), dtype)
        position_map = T.match_buffer(var_position_map, (n,), "int32", elem_offset=off_pos)
        kv_scales = T.match_buffer(var_kv_scales, (2, H), "float32")
        nest(pages, k, v, position_map, n, kv_scales)

    return transpose_append if spec.quantized else without_param(transpose_append, 4)


def make_copy_single_page(spec: PageLayoutSpec, sched: Schedule) -> tirx.PrimFunc:
    H, D, ps = spec.num_kv_heads, spec.head_dim, spec.page_size
    if not isinstance(sched, GpuSchedule):
        @T.macro
        def nest(pages, src_page, dst_page, copy_length):
            for kv_h in T.parallel(2 * H):
                with T.sblock("copy"):
                    T.reads()
                    T.writes()
                    for slot in T.serial(copy_length):
                        copy_page_span(pages, src_page, dst_page, kv_h // H, kv_h % H, slot, 0, D)
    else:
        lanes, nt = gpu_lanes(sched, spec.page_dtype, D), sched.copy_threads
        nv = D // lanes
        work = 2 * H * ps * nv

        @T.macro
        def nest(pages, src_page, dst_page, copy_length):
            for bx in T.thread_binding(gpu_blocks(work, nt), thread="blockIdx.x"):
                for tx in T.thread_binding(nt, thread="threadIdx.x"):
                    with T.sblock("copy"):
                        T.reads()
                        T.writes()
                        if bx * nt + tx < work:
                            if T.Cast("int64", (bx * nt + tx) // nv % ps) < copy_length:
                                copy_page_span(pages, src_page, dst_page, (bx * nt + tx) // (H * ps * nv),
                                               (bx * nt + tx) // (ps * nv) % H, (bx * nt + tx) // nv % ps,
                                               (bx * nt + tx) % nv * lanes, lanes)

    @T.prim_func(s_tir=True)
    def copy_single_page(var_pages: T.handle, src_page_id: T.int64, tgt_page_id: T.int64,
                         copy_length: T.int64):
        T.func_attr({"tirx.noalias": True})
        P = T.int64()
        pages = T.match_buffer(var_pages, (P, 2, H, ps, D), spec.page_dtype)
        nest(pages, src_page_id, tgt_page_id, copy_length)

    return copy_single_page


def make_compact_copy(spec: PageLayoutSpec, sched: Schedule) -> tirx.PrimFunc:
    H, D, ps = spec.num_kv_heads, spec.head_dim, spec.page_size
    if not isinstance(sched, GpuSchedule):
        @T.macro
        def nest(pages, indptr, src_dst_pos, batch_size):
            for b in T.parallel(batch_size):
                with T.sblock("compact"):
                    T.reads()
                    T.writes()
                    for i in T.serial(indptr[b + 1] - indptr[b]):
                        for kv in T.serial(2):
                            for h in T.serial(H):
                                move_span(pages, src_dst_pos[0, indptr[b] + i], src_dst_pos[1, indptr[b] + i],
                                          kv, h, 0, D, ps)
    else:
        lanes, nt = gpu_lanes(sched, spec.page_dtype, D), sched.copy_threads
        nv = D // lanes
        # a block per sequence, moves in order; a thread owns fixed columns: no barriers needed
        cols = 2 * H * nv  # (kv, head, span) columns of one slot
        rounds = (cols + nt - 1) // nt  # columns a thread owns

        @T.macro
        def nest(pages, indptr, src_dst_pos, batch_size):
            for b in T.thread_binding(T.max(1, batch_size), thread="blockIdx.x"):
                for tx in T.thread_binding(nt, thread="threadIdx.x"):
                    with T.sblock("compact"):
                        T.reads()
                        T.writes()
                        if b < batch_size:
                            for i in T.serial(indptr[b + 1] - indptr[b]):
                                for r in T.serial(rounds):
                                    if r * nt + tx < cols:
                                        move_span(pages, src_dst_pos[0, indptr[b] + i], src_dst_pos[1, indptr[b] + i],
                                                  (r * nt + tx) // (H * nv), (r * nt + tx) // nv % H,
                                                  (r * nt + tx) % nv * lanes, lanes, ps)

    @T.prim_func(s_tir=True)
    def compact_copy(var_pages: T.handle, var_copy_length_indptr: T.handle,
                     var_src_dst_pos: T.handle, batch_size: T.int32):
        T.func_attr({"tirx.noalias": True})
        P = T.int64()
        total = T.int32()
        off_indptr = T.int32()
        off_pos = T.int32()
        pages = T.match_buffer(var_pages, (P, 2, H, ps, D), spec.page_dtype)
        copy_length_indptr = T.match_buffer(var_copy_length_indptr, (batch_size + 1,), "int32",
                                            elem_offset=off_indptr)
        src_dst_pos = T.match_buffer(var_src_dst_pos, (2, total), "int32", elem_offset=off_pos)
        nest(pages, copy_length_indptr, src_dst_pos, batch_size)

    return compact_copy


def make_debug_get_kv(spec: PageLayoutSpec, sched: Schedule) -> tirx.PrimFunc:
    """Gather the K / V of ``position_map``'s positions into ``k`` / ``v[layer_id]`` in the model
    dtype; 8-bit pages take a last argument ``kv_scales (2, H) float32`` and are dequantized."""
    H, D, ps, dtype = spec.num_kv_heads, spec.head_dim, spec.page_size, spec.dtype
    load = load_span(spec)
    if not isinstance(sched, GpuSchedule):
        @T.macro
        def nest(pages, position_map, k, v, layer_id, n, scales):
            for i in T.parallel(n):
                with T.sblock("gather"):
                    T.reads()
                    T.writes()
                    pos: T.let[T.int32] = position_map[i]
                    for h in T.serial(H):
                        load(k, layer_id, i, pages, pos, 0, h, 0, D, ps, scales)
                        load(v, layer_id, i, pages, pos, 1, h, 0, D, ps, scales)
    else:
        lanes, nt = spec.load_lanes(gpu_lanes(sched, spec.dtype, D)), sched.copy_threads
        nv = D // lanes

        @T.macro
        def nest(pages, position_map, k, v, layer_id, n, scales):
            for bx in T.thread_binding(gpu_blocks(n * (H * nv), nt), thread="blockIdx.x"):
                for tx in T.thread_binding(nt, thread="threadIdx.x"):
                    with T.sblock("gather"):
                        T.reads()
                        T.writes()
                        if T.Cast("int64", bx * nt + tx) < n * (H * nv):
                            pos: T.let[T.int32] = position_map[(bx * nt + tx) // (H * nv)]
                            load(k, layer_id, (bx * nt + tx) // (H * nv), pages, pos, 0,
                                 (bx * nt + tx) // nv % H, (bx * nt + tx) % nv * lanes, lanes, ps, scales)
                            load(v, layer_id, (bx * nt + tx) // (H * nv), pages, pos, 1,
                                 (bx * nt + tx) // nv % H, (bx * nt + tx) % nv * lanes, lanes, ps, scales)

    @T.prim_func(s_tir=True)
    def debug_get_kv(var_pages: T.handle, var_position_map: T.handle, var_k: T.handle,
                     var_v: T.handle, layer_id: T.int64, var_kv_scales: T.handle):
        T.func_attr({"tirx.noalias": True})
        P = T.int64()
        L = T.int64()
        n = T.int64()
        off_pos = T.int64()
        pages = T.match_buffer(var_pages, (P, 2, H, ps, D), spec.page_dtype)
        position_map = T.match_buffer(var_position_map, (n,), "int32", elem_offset=off_pos)
        k = T.match_buffer(var_k, (L, n, H, D), dtype)
        v = T.match_buffer(var_v, (L, n, H, D), dtype)
        kv_scales = T.match_buffer(var_kv_scales, (2, H), "float32")
        nest(pages, position_map, k, v, layer_id, n, kv_scales)

    return debug_get_kv if spec.quantized else without_param(debug_get_kv, 5)


def latent_span(convert=lambda value, scales: value, loop=T.vectorized):
    """Macro moving one span ``[d0, d0 + lanes)`` of ``src[src_index]`` to ``dst[dst_index]``,
    each element as ``convert(element, kv_scales)`` (default: as it is)."""

    @T.macro
    def move(dst, dst_index, src, src_index, d0, lanes: T.int32, scales):
        for d in loop(lanes):
            dst[dst_index + (d0 + d,)] = convert(src[src_index + (d0 + d,)], scales)

    return move


def _latent_rows_nest(spec: LatentPageSpec, sched: Schedule, name: str, row_move, lanes_of=None):
    """Loop nest over ``n`` latent rows; ``row_move(bufs, i, d0, lanes)`` moves one span of row i
    (GPU: spans of ``lanes_of(model dtype lanes)`` elements, default as they are)."""
    W = spec.width
    if not isinstance(sched, GpuSchedule):
        @T.macro
        def cpu_nest(bufs, n):
            for i in T.parallel(n):
                with T.sblock(name):
                    T.reads()
                    T.writes()
                    row_move(bufs, i, 0, W)
        return cpu_nest

    lanes, nt = gpu_lanes(sched, spec.dtype, W), sched.copy_threads
    if lanes_of is not None:
        lanes = lanes_of(lanes)
    nv = W // lanes

    @T.macro
    def gpu_nest(bufs, n):
        for bx in T.thread_binding(gpu_blocks(T.Cast("int32", n) * nv, nt), thread="blockIdx.x"):
            for tx in T.thread_binding(nt, thread="threadIdx.x"):
                with T.sblock(name):
                    T.reads()
                    T.writes()
                    if T.Cast("int64", bx * nt + tx) < T.Cast("int64", n) * nv:
                        row_move(bufs, (bx * nt + tx) // nv, (bx * nt + tx) % nv * lanes, lanes)
    return gpu_nest


def make_transpose_append_mla(spec: LatentPageSpec, sched: Schedule) -> tirx.PrimFunc:
    """``transpose_append_mla(pages, kv, position_map)``: token i's latent row ``kv[i]`` goes to
    position ``position_map[i]`` (skipped when it is -1). 8-bit pages take a last argument
    ``kv_scales (2, 1) float32`` and store ``kv / kv_scales[0, 0]`` saturated, element by element
    (as :func:`store_span`)."""
    W, ps, dtype = spec.width, spec.page_size, spec.dtype
    store = latent_span(lambda value, scales: quantized(spec, value, scales[0, 0]), T.serial) if spec.quantized \
        else latent_span()

    @T.macro
    def append_row(bufs, i, d0, lanes: T.int32):
        """bufs = (pages, kv, position_map, kv_scales)."""
        if bufs[2][i] != -1:
            store(bufs[0], (bufs[2][i] // ps, bufs[2][i] % ps), bufs[1], (i,), d0, lanes, bufs[3])

    nest = _latent_rows_nest(spec, sched, "append_mla", append_row)

    @T.prim_func(s_tir=True)
    def transpose_append_mla(var_pages: T.handle, var_kv: T.handle, var_position_map: T.handle,
                             var_kv_scales: T.handle):
        T.func_attr({"tirx.noalias": True})
        P = T.int64()
        n = T.int32()
        off_pos = T.int32()
        pages = T.match_buffer(var_pages, (P, ps, W), spec.page_dtype)
        kv = T.match_buffer(var_kv, (n, W), dtype)
        position_map = T.match_buffer(var_position_map, (n,), "int32", elem_offset=off_pos)
        kv_scales = T.match_buffer(var_kv_scales, (2, 1), "float32")
        nest((pages, kv, position_map, kv_scales), n)

    return transpose_append_mla if spec.quantized else without_param(transpose_append_mla, 3)


def make_copy_single_page_mla(spec: LatentPageSpec, sched: Schedule) -> tirx.PrimFunc:
    """``copy_single_page_mla(pages, src_page_id, tgt_page_id, copy_length)``: the first
    ``copy_length`` rows of a page."""
    W, ps = spec.width, spec.page_size
    move = latent_span()

    @T.macro
    def copy_row(bufs, slot, d0, lanes: T.int32):
        """bufs = (pages, src_page, dst_page)."""
        move(bufs[0], (bufs[2], slot), bufs[0], (bufs[1], slot), d0, lanes, None)

    # bytes move as they are: spans of the pages' element type
    nest = _latent_rows_nest(spec, sched, "copy_mla", copy_row,
                             lambda lanes: gpu_lanes(sched, spec.page_dtype, W) if spec.quantized else lanes)

    @T.prim_func(s_tir=True)
    def copy_single_page_mla(var_pages: T.handle, src_page_id: T.int64, tgt_page_id: T.int64,
                             copy_length: T.int64):
        T.func_attr({"tirx.noalias": True})
        P = T.int64()
        pages = T.match_buffer(var_pages, (P, ps, W), spec.page_dtype)
        nest((pages, src_page_id, tgt_page_id), T.min(copy_length, T.int64(ps)))

    return copy_single_page_mla


def make_debug_get_kv_mla(spec: LatentPageSpec, sched: Schedule) -> tirx.PrimFunc:
    """``debug_get_kv_mla(pages, position_map, kv_out, layer_id)``: ``kv_out[layer_id, i]`` =
    the latent row at position ``position_map[i]``; ``kv_out`` is ``(num_layers, n, width)``.
    8-bit pages take a last argument ``kv_scales (2, 1) float32`` and are dequantized (``stored *
    kv_scales[0, 0]`` in the model dtype)."""
    W, ps, dtype = spec.width, spec.page_size, spec.dtype
    load = latent_span(lambda stored, scales: dequantized(spec, stored, (None,) * 5 + (scales,), 0, 0))

    @T.macro
    def gather_row(bufs, i, d0, lanes: T.int32):
        """bufs = (pages, position_map, kv, layer_id, kv_scales)."""
        load(bufs[2], (bufs[3], i), bufs[0], (bufs[1][i] // ps, bufs[1][i] % ps), d0, lanes, bufs[4])

    nest = _latent_rows_nest(spec, sched, "gather_mla", gather_row, spec.load_lanes)

    @T.prim_func(s_tir=True)
    def debug_get_kv_mla(var_pages: T.handle, var_position_map: T.handle, var_kv: T.handle,
                         layer_id: T.int64, var_kv_scales: T.handle):
        T.func_attr({"tirx.noalias": True})
        P = T.int64()
        L = T.int64()
        n = T.int64()
        off_pos = T.int64()
        pages = T.match_buffer(var_pages, (P, ps, W), spec.page_dtype)
        position_map = T.match_buffer(var_position_map, (n,), "int32", elem_offset=off_pos)
        kv = T.match_buffer(var_kv, (L, n, W), dtype)
        kv_scales = T.match_buffer(var_kv_scales, (2, 1), "float32")
        nest((pages, position_map, kv, layer_id, kv_scales), n)

    return debug_get_kv_mla if spec.quantized else without_param(debug_get_kv_mla, 4)
