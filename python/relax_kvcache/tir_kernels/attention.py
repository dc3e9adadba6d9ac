"""Attention kernels: paged decode, paged prefill and ragged prefill (TVM's calling conventions).

A work item owns one sequence and one KV head: it takes the queries of that head group in tiles,
walks the KV in chunks (a page, or ``kv_chunk`` ragged rows) and folds each chunk into an
online-softmax state (the macros of :mod:`.macros`). Conventions and masks: ``docs/kernels.md``.
"""

from __future__ import annotations

import dataclasses

import tvm
from tvm import tirx
from tvm.script import tirx as T

from .macros import (
    LOG2E,
    accumulate_pv,
    causal_mask_chunk,
    ceildiv,
    paged_kv_access,
    paged_kv_len,
    paged_kv_rows,
    prefetch,
    tree_mask_chunk,
    with_kv_scales,
    without_param,
    init_state,
    load_q_tile,
    query_position_range,
    ragged_kv_access,
    ragged_kv_rows,
    rope_inv_freq,
    rope_rows_inplace,
    rope_steps,
    row_block,
    score_chunk,
    softmax_update,
    store_row,
    window_mask_chunk,
)
from . import attention_gpu as gpu
from .attention_gpu_decode import decode_grid
from .schedule import CpuSchedule, GpuSchedule, Schedule
from .spec import AttentionSpec


def _length_info_buffer(var, batch, elem_offset, sliding_window: bool):
    shape = (3, batch) if sliding_window else (batch,)
    return T.match_buffer(var, shape, "int32", elem_offset=elem_offset)


def _causal_chunks(causal, first_row_limit, nq, kv_len, chunk: int):
    """Chunks a tile must visit: all of them, or (causal) those up to its last visible column."""
    all_chunks = ceildiv(kv_len, chunk)
    visible = T.max(first_row_limit + nq, 0)
    return T.if_then_else(causal > 0, T.min(all_chunks, ceildiv(visible, chunk)), all_chunks)


def _paged_seq_src(spec: AttentionSpec):
    """GPU grids: tile arguments of sequence b from ``(pages, page_indices, page_indptr,
    length_info, k_rope_pos_offset[, tree_mask, mn_indptr][, kv_scales])`` (``kv_scales``: 8-bit
    pages)."""
    ps, sliding = spec.page_size, spec.sliding_window
    scaled = int(spec.quantized)

    def seq_src(bufs, b):
        kv_len = paged_kv_len(bufs[2][b + 1] - bufs[2][b], ps, bufs[3], b, sliding)
        tree_src = () if len(bufs) == 5 + scaled else (bufs[5], bufs[6][b], bufs[6][b + 1] - bufs[6][b])
        scales = (bufs[-1],) if scaled else ()
        return (bufs[0], bufs[1], bufs[2][b], bufs[3], b, *scales), kv_len, bufs[4][b], tree_src

    return seq_src


def _ragged_seq_src(bufs, b):
    """GPU grids: tile arguments of sequence b from ``(k, v, kv_indptr, k_rope_pos_offset)`` or
    ``(k, v, kv_indptr, tree_mask, mn_indptr)`` (trees: no RoPE offset)."""
    kv_len = bufs[2][b + 1] - bufs[2][b]
    if len(bufs) == 4:
        return (bufs[0], bufs[1], bufs[2][b]), kv_len, bufs[3][b], ()
    return (bufs[0], bufs[1], bufs[2][b]), kv_len, 0, (bufs[3], bufs[4][b], bufs[4][b + 1] - bufs[4][b])


def make_paged_prefill(spec: AttentionSpec, sched: Schedule) -> tirx.PrimFunc:
    """Paged prefill: tiles of queries of each sequence against its paged KV."""
    return _make_paged(spec, sched, decode=False)


def make_paged_decode(spec: AttentionSpec, sched: Schedule) -> tirx.PrimFunc:
    """Paged decode: one query token per sequence against its paged KV."""
    return _make_paged(spec, sched, decode=True)


def make_attend_sequence(spec: AttentionSpec, sched: CpuSchedule, *, q_tile: int, chunk: int, kv_elem,
                          tree: bool = False):
    """The CPU work item (one sequence, one KV head): query tiles of ``q_tile`` tokens against KV
    chunks of ``chunk`` rows read through ``kv_elem(kv_src, h, j, kv, d)``. With ``tree``,
    ``tree_src = (tree_mask, first mask row, tree size)``; the last ``tree size`` KV rows are the
    tree's nodes."""
    G, D, DV, dtype = spec.group_size, spec.qk_head_dim, spec.v_head_dim, spec.dtype
    lanes = sched.lanes_for(D)
    v_lanes = sched.lanes_for(DV)
    pv_lanes = 2 * v_lanes if DV % (2 * v_lanes) == 0 else v_lanes  # two registers per row in P @ V
    rows, half, span, local, rb = q_tile * G, D // 2, spec.span, spec.is_local, row_block(G)
    # prefill tiles stage each KV chunk in float32 (short V stride for accumulate_pv)
    stage = q_tile > 1

    def k_in_place(kv_src, h, c0, t, d):
        return kv_elem(kv_src, h, c0 + t, 0, d)

    def v_in_place(kv_src, h, c0, t, d):
        return kv_elem(kv_src, h, c0 + t, 1, d)

    def staged(buf, h, c0, t, d):
        return buf[t, d]

    @T.macro
    def no_hook(args, t):
        T.evaluate(0)

    line = 64 * 8 // tvm.runtime.DataType(dtype).bits  # elements per 64-byte cache line

    @T.macro
    def prefetch_v_row(v_src, t):
        """Prefetch V row t of the chunk ``v_src = (kv_src, h, c0)``."""
        for x in T.unroll(ceildiv(DV, line)):
            prefetch(kv_elem(v_src[0], v_src[1], v_src[2] + t, 1, x * line))

    @T.macro
    def stage_chunk(kc, vc, kv_src, h, c0, nt, rotary_mode, k_pos0, rope, with_v: T.bool):
        """KV rows [c0, c0 + nt) to float32 ``kc`` (RoPE'd) and, with ``with_v``, ``vc``."""
        for t in T.serial(nt):
            for d in T.vectorized(D):
                kc[t, d] = T.Cast("float32", kv_elem(kv_src, h, c0 + t, 0, d))
            if with_v:
                for d in T.vectorized(DV):
                    vc[t, d] = T.Cast("float32", kv_elem(kv_src, h, c0 + t, 1, d))
        if rotary_mode == 1:
            rope_rows_inplace(kc, nt, k_pos0 + c0, rope[0], rope[1], half)

    @T.macro
    def score(s, qs, kc, vc, kv_src, h, c0, nt, nrows, rotary_mode, k_pos0, rope, part):
        """Scores of KV rows [c0, c0 + nt)."""
        if stage:
            stage_chunk(kc, vc, kv_src, h, c0, nt, rotary_mode, k_pos0, rope, True)
            score_chunk(s, qs, kc, staged, h, c0, nrows, nt, D, lanes, rb, part, no_hook, ())
        elif rotary_mode == 1:
            stage_chunk(kc, vc, kv_src, h, c0, nt, rotary_mode, k_pos0, rope, False)
            score_chunk(s, qs, kc, staged, h, c0, nrows, nt, D, lanes, rb, part, prefetch_v_row,
                        (kv_src, h, c0))
        else:
            score_chunk(s, qs, kv_src, k_in_place, h, c0, nrows, nt, D, lanes, rb, part, prefetch_v_row,
                        (kv_src, h, c0))

    @T.macro
    def fold(s, m, l, alpha, acc, vc, kv_src, h, c0, nt, nrows, red, part):
        softmax_update(s, m, l, alpha, nrows, nt, chunk, red)
        if stage:
            accumulate_pv(acc, s, alpha, vc, staged, h, c0, nrows, nt, DV, pv_lanes, rb, part)
        else:
            accumulate_pv(acc, s, alpha, kv_src, v_in_place, h, c0, nrows, nt, DV, pv_lanes, rb, part)

    @T.macro
    def attend_sequence(q, o, lse, q_rope_position, kv_src, h, qbeg, q_len, kv_len, k_pos0, causal,
                        rotary_mode, rope_scale, rope_theta, sm_scale, tree_src):
        qs = T.sblock_alloc_buffer((rows, D), "float32")
        acc = T.sblock_alloc_buffer((rows, DV), "float32")
        kc = T.sblock_alloc_buffer((chunk, D), "float32")
        vc = T.sblock_alloc_buffer((chunk, DV), "float32")
        s = T.sblock_alloc_buffer((rows, chunk), "float32")
        m = T.sblock_alloc_buffer((rows,), "float32")
        l = T.sblock_alloc_buffer((rows,), "float32")
        alpha = T.sblock_alloc_buffer((rows,), "float32")
        part = T.sblock_alloc_buffer((rb, 2, lanes), "float32")
        part_pv = T.sblock_alloc_buffer((rb, pv_lanes), "float32")
        red = T.sblock_alloc_buffer((1,), "float32")
        inv_freq = T.sblock_alloc_buffer((half,), "float32")
        rot = T.sblock_alloc_buffer((4, half), "float32")
        if rotary_mode == 1:
            rope_inv_freq(inv_freq, half, rope_scale, rope_theta)
            rope_steps(rot, inv_freq, half)
        bounds = T.sblock_alloc_buffer((2,), "int32")
        for tile in T.serial(ceildiv(q_len, q_tile)):
            nq: T.let[T.int32] = T.min(q_tile, q_len - tile * q_tile)
            tok0: T.let[T.int32] = qbeg + tile * q_tile
            first_row_limit: T.let[T.int32] = kv_len - q_len + tile * q_tile
            init_state(m, l, acc, nq * G, DV)
            load_q_tile(qs, q, tok0, nq, h, G, D, rotary_mode, q_rope_position, inv_freq, sm_scale * LOG2E)
            if tree:
                for c in T.serial(ceildiv(kv_len, chunk)):
                    nt: T.let[T.int32] = T.min(chunk, kv_len - c * chunk)
                    score(s, qs, kc, vc, kv_src, h, c * chunk, nt, nq * G, rotary_mode, k_pos0, (inv_freq, rot), part)
                    tree_mask_chunk(s, nq * G, nt, G, tree_src, tok0 - qbeg + tree_src[2] - q_len, c * chunk,
                                    kv_len - tree_src[2])
                    fold(s, m, l, alpha, acc, vc, kv_src, h, c * chunk, nt, nq * G, red, part_pv)
            elif not local:
                for c in T.serial(_causal_chunks(causal, first_row_limit, nq, kv_len, chunk)):
                    nt: T.let[T.int32] = T.min(chunk, kv_len - c * chunk)
                    score(s, qs, kc, vc, kv_src, h, c * chunk, nt, nq * G, rotary_mode, k_pos0, (inv_freq, rot), part)
                    if causal > 0:
                        causal_mask_chunk(s, nq * G, nt, G, c * chunk, first_row_limit)
                    fold(s, m, l, alpha, acc, vc, kv_src, h, c * chunk, nt, nq * G, red, part_pv)
            else:
                query_position_range(bounds, q_rope_position, tok0, nq)
                row_lo: T.let[T.int32] = T.max(span.first_visible(bounds[0]) - k_pos0, 0)
                row_hi: T.let[T.int32] = T.if_then_else(
                    causal > 0, T.max(T.min(kv_len, bounds[1] - k_pos0 + 1), 0), kv_len)
                for c in T.serial(row_lo // chunk, ceildiv(row_hi, chunk)):
                    nt: T.let[T.int32] = T.min(chunk, kv_len - c * chunk)
                    score(s, qs, kc, vc, kv_src, h, c * chunk, nt, nq * G, rotary_mode, k_pos0, (inv_freq, rot), part)
                    window_mask_chunk(s, nq * G, nt, G, q_rope_position, tok0, k_pos0 + c * chunk, span, causal)
                    fold(s, m, l, alpha, acc, vc, kv_src, h, c * chunk, nt, nq * G, red, part_pv)
            for r in T.serial(nq * G):
                store_row(o, lse, (tok0 + r // G, h * G + r % G), (tok0 + r // G, h * G + r % G),
                          acc, m, l, r, DV, dtype)

    return attend_sequence


def _make_paged(spec: AttentionSpec, sched: Schedule, *, decode: bool) -> tirx.PrimFunc:
    Hq, Hkv = spec.num_qo_heads, spec.num_kv_heads
    D, ps, dtype, sliding = spec.qk_head_dim, spec.page_size, spec.dtype, spec.sliding_window
    if spec.v_head_dim != D:
        raise ValueError(f"paged MHA kernels need v_head_dim == qk_head_dim, got {spec.v_head_dim} != {D}")
    on_gpu = isinstance(sched, GpuSchedule)
    if on_gpu:
        kv_elem, seq_src = paged_kv_access(spec), _paged_seq_src(spec)
        run_gpu = (decode_grid(spec, sched, paged_kv_rows(spec), seq_src) if decode
                   else gpu.prefill_grid(spec, sched, kv_elem, seq_src, kv_rows=paged_kv_rows(spec)))
        attend_sequence = None
    else:
        attend_sequence = make_attend_sequence(spec, sched, q_tile=1 if decode else sched.q_tile,
                                                chunk=ps, kv_elem=paged_kv_access(spec))

    scaled = spec.quantized  # 8-bit pages: kv_scales, the kernels' last argument

    @T.macro
    def attend_paged(q, o, lse, pages, page_indptr, page_indices, length_info, k_rope_pos_offset,
                     q_rope_position, b, h, qbeg, q_len, causal, rotary_mode, rope_scale, rope_theta,
                     sm_scale, kv_scales):
        kv_len: T.let[T.int32] = paged_kv_len(page_indptr[b + 1] - page_indptr[b], ps, length_info, b, sliding)
        attend_sequence(q, o, lse, q_rope_position,
                        with_kv_scales(spec, (pages, page_indices, page_indptr[b], length_info, b), kv_scales),
                        h, qbeg, q_len, kv_len, k_rope_pos_offset[b], causal, rotary_mode, rope_scale,
                        rope_theta, sm_scale, ())

    if decode:

        @T.prim_func(s_tir=True)
        def paged_decode(var_q: T.handle, var_pages: T.handle, var_page_indptr: T.handle,
                         var_page_indices: T.handle, var_length_info: T.handle,
                         var_k_rope_pos_offset: T.handle, var_q_rope_position: T.handle,
                         var_o: T.handle, var_lse: T.handle, rotary_mode: T.int32,
                         rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32,
                         var_kv_scales: T.handle):
            T.func_attr({"tirx.noalias": True})
            B = T.int32()
            P = T.int64()
            nnz = T.int32()
            off_indptr = T.int32()
            off_indices = T.int32()
            off_len = T.int32()
            off_krope = T.int32()
            off_qrope = T.int32()
            q = T.match_buffer(var_q, (B, Hq, D), dtype)
            pages = T.match_buffer(var_pages, (P, 2, Hkv, ps, D), spec.page_dtype)
            page_indptr = T.match_buffer(var_page_indptr, (B + 1,), "int32", elem_offset=off_indptr)
            page_indices = T.match_buffer(var_page_indices, (nnz,), "int32", elem_offset=off_indices)
            length_info = _length_info_buffer(var_length_info, B, off_len, sliding)
            k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (B,), "int32", elem_offset=off_krope)
            q_rope_position = T.match_buffer(var_q_rope_position, (B,), "int32", elem_offset=off_qrope)
            o = T.match_buffer(var_o, (B, Hq, D), dtype)
            lse = T.match_buffer(var_lse, (B, Hq), "float32")
            kv_scales = T.match_buffer(var_kv_scales, (2, Hkv), "float32")
            if on_gpu:
                run_gpu(q, o, lse, q_rope_position, B, nnz,
                        with_kv_scales(spec, (pages, page_indices, page_indptr, length_info, k_rope_pos_offset),
                                       kv_scales),
                        rotary_mode, rope_scale, rope_theta, sm_scale)
            else:
                for bh in T.parallel(B * Hkv):
                    with T.sblock("work"):
                        T.reads()
                        T.writes()
                        attend_paged(q, o, lse, pages, page_indptr, page_indices, length_info,
                                     k_rope_pos_offset, q_rope_position, bh // Hkv, bh % Hkv, bh // Hkv, 1,
                                     0, rotary_mode, rope_scale, rope_theta, sm_scale, kv_scales)

        return paged_decode if scaled else without_param(paged_decode, 13)

    @T.prim_func(s_tir=True)
    def paged_prefill(var_q: T.handle, var_qo_indptr: T.handle, var_pages: T.handle,
                      var_page_indptr: T.handle, var_page_indices: T.handle,
                      var_length_info: T.handle, var_k_rope_pos_offset: T.handle,
                      var_q_rope_position: T.handle, var_o: T.handle, var_lse: T.handle,
                      causal: T.int32, rotary_mode: T.int32, rope_scale: T.float32,
                      rope_theta: T.float32, sm_scale: T.float32, var_kv_scales: T.handle):
        T.func_attr({"tirx.noalias": True})
        B = T.int32()
        total_q = T.int32()
        P = T.int64()
        nnz = T.int32()
        off_qo = T.int32()
        off_indptr = T.int32()
        off_indices = T.int32()
        off_len = T.int32()
        off_krope = T.int32()
        off_qrope = T.int32()
        q = T.match_buffer(var_q, (total_q, Hq, D), dtype)
        qo_indptr = T.match_buffer(var_qo_indptr, (B + 1,), "int32", elem_offset=off_qo)
        pages = T.match_buffer(var_pages, (P, 2, Hkv, ps, D), spec.page_dtype)
        page_indptr = T.match_buffer(var_page_indptr, (B + 1,), "int32", elem_offset=off_indptr)
        page_indices = T.match_buffer(var_page_indices, (nnz,), "int32", elem_offset=off_indices)
        length_info = _length_info_buffer(var_length_info, B, off_len, sliding)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (B,), "int32", elem_offset=off_krope)
        q_rope_position = T.match_buffer(var_q_rope_position, (total_q,), "int32", elem_offset=off_qrope)
        o = T.match_buffer(var_o, (total_q, Hq, D), dtype)
        lse = T.match_buffer(var_lse, (total_q, Hq), "float32")
        kv_scales = T.match_buffer(var_kv_scales, (2, Hkv), "float32")
        if on_gpu:
            run_gpu(q, o, lse, q_rope_position, qo_indptr, B, total_q,
                    with_kv_scales(spec, (pages, page_indices, page_indptr, length_info, k_rope_pos_offset), kv_scales),
                    causal, rotary_mode, rope_scale, rope_theta, sm_scale)
        else:
            for bh in T.parallel(B * Hkv):
                with T.sblock("work"):
                    T.reads()
                    T.writes()
                    attend_paged(q, o, lse, pages, page_indptr, page_indices, length_info, k_rope_pos_offset,
                                 q_rope_position, bh // Hkv, bh % Hkv, qo_indptr[bh // Hkv],
                                 qo_indptr[bh // Hkv + 1] - qo_indptr[bh // Hkv], causal, rotary_mode,
                                 rope_scale, rope_theta, sm_scale, kv_scales)

    return paged_prefill if scaled else without_param(paged_prefill, 15)


def make_ragged_prefill(spec: AttentionSpec, sched: Schedule) -> tirx.PrimFunc:
    """Ragged prefill: queries of each sequence against that sequence's new (contiguous) K/V."""
    Hq, Hkv = spec.num_qo_heads, spec.num_kv_heads
    D, DV, dtype = spec.qk_head_dim, spec.v_head_dim, spec.dtype

    on_gpu = isinstance(sched, GpuSchedule)
    if on_gpu:  # the step's own K/V are in the model dtype, whatever the pages store
        plain = dataclasses.replace(spec, kv_dtype=None) if spec.quantized else spec
        run_gpu = gpu.prefill_grid(plain, sched, ragged_kv_access(plain), _ragged_seq_src,
                                   kv_rows=ragged_kv_rows(plain))
    else:
        attend_sequence = make_attend_sequence(spec, sched, q_tile=sched.q_tile, chunk=sched.kv_chunk,
                                                kv_elem=ragged_kv_access(spec))

    @T.prim_func(s_tir=True)
    def ragged_prefill(var_q: T.handle, var_qo_indptr: T.handle, var_k: T.handle, var_v: T.handle,
                       var_kv_indptr: T.handle, var_q_rope_position: T.handle,
                       var_k_rope_pos_offset: T.handle, var_o: T.handle, var_lse: T.handle,
                       causal: T.int32, rotary_mode: T.int32, rope_scale: T.float32,
                       rope_theta: T.float32, sm_scale: T.float32):
        T.func_attr({"tirx.noalias": True})
        B = T.int32()
        total_q = T.int32()
        total_kv = T.int32()
        off_qo = T.int32()
        off_kv = T.int32()
        off_qrope = T.int32()
        off_krope = T.int32()
        q = T.match_buffer(var_q, (total_q, Hq, D), dtype)
        qo_indptr = T.match_buffer(var_qo_indptr, (B + 1,), "int32", elem_offset=off_qo)
        k = T.match_buffer(var_k, (total_kv, Hkv, D), dtype)
        v = T.match_buffer(var_v, (total_kv, Hkv, DV), dtype)
        kv_indptr = T.match_buffer(var_kv_indptr, (B + 1,), "int32", elem_offset=off_kv)
        q_rope_position = T.match_buffer(var_q_rope_position, (total_q,), "int32", elem_offset=off_qrope)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (B,), "int32", elem_offset=off_krope)
        o = T.match_buffer(var_o, (total_q, Hq, DV), dtype)
        lse = T.match_buffer(var_lse, (total_q, Hq), "float32")
        if on_gpu:
            run_gpu(q, o, lse, q_rope_position, qo_indptr, B, total_q, (k, v, kv_indptr, k_rope_pos_offset),
                    causal, rotary_mode, rope_scale, rope_theta, sm_scale)
        else:
            for bh in T.parallel(B * Hkv):
                with T.sblock("work"):
                    T.reads()
                    T.writes()
                    attend_sequence(q, o, lse, q_rope_position, (k, v, kv_indptr[bh // Hkv]), bh % Hkv,
                                    qo_indptr[bh // Hkv], qo_indptr[bh // Hkv + 1] - qo_indptr[bh // Hkv],
                                    kv_indptr[bh // Hkv + 1] - kv_indptr[bh // Hkv],
                                    k_rope_pos_offset[bh // Hkv], causal, rotary_mode, rope_scale,
                                    rope_theta, sm_scale, ())

    return ragged_prefill


def make_paged_tree_prefill(spec: AttentionSpec, sched: Schedule) -> tirx.PrimFunc:
    """Paged prefill with a token-tree mask (TVM's ``tree_attn_with_paged_kv_cache`` convention):
    the last ``tree_mn_indptr[b+1] - tree_mn_indptr[b]`` KV rows of sequence b are its tree's
    nodes (``tree_mask``: their DFS intervals), its queries the last nodes; ``rotary_mode`` 0."""
    Hq, Hkv = spec.num_qo_heads, spec.num_kv_heads
    D, ps, dtype, sliding = spec.qk_head_dim, spec.page_size, spec.dtype, spec.sliding_window
    on_gpu = isinstance(sched, GpuSchedule)
    if on_gpu:
        run_gpu = gpu.prefill_grid(spec, sched, paged_kv_access(spec), _paged_seq_src(spec), tree=True)
    else:
        attend_sequence = make_attend_sequence(spec, sched, q_tile=sched.q_tile, chunk=ps,
                                                kv_elem=paged_kv_access(spec), tree=True)

    @T.prim_func(s_tir=True)
    def paged_tree_prefill(var_q: T.handle, var_qo_indptr: T.handle, var_pages: T.handle,
                           var_page_indptr: T.handle, var_page_indices: T.handle, var_length_info: T.handle,
                           var_k_rope_pos_offset: T.handle, var_q_rope_position: T.handle, var_o: T.handle,
                           var_lse: T.handle, rotary_mode: T.int32, rope_scale: T.float32,
                           rope_theta: T.float32, sm_scale: T.float32, var_mn_indptr: T.handle,
                           var_tree_mask: T.handle, var_kv_scales: T.handle):
        T.func_attr({"tirx.noalias": True})
        B = T.int32()
        total_q = T.int32()
        P = T.int64()
        nnz = T.int32()
        nodes = T.int32()
        off_qo = T.int32()
        off_indptr = T.int32()
        off_indices = T.int32()
        off_len = T.int32()
        off_krope = T.int32()
        off_qrope = T.int32()
        off_mn = T.int32()
        off_mask = T.int32()
        q = T.match_buffer(var_q, (total_q, Hq, D), dtype)
        qo_indptr = T.match_buffer(var_qo_indptr, (B + 1,), "int32", elem_offset=off_qo)
        pages = T.match_buffer(var_pages, (P, 2, Hkv, ps, D), spec.page_dtype)
        page_indptr = T.match_buffer(var_page_indptr, (B + 1,), "int32", elem_offset=off_indptr)
        page_indices = T.match_buffer(var_page_indices, (nnz,), "int32", elem_offset=off_indices)
        length_info = _length_info_buffer(var_length_info, B, off_len, sliding)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (B,), "int32", elem_offset=off_krope)
        q_rope_position = T.match_buffer(var_q_rope_position, (total_q,), "int32", elem_offset=off_qrope)
        o = T.match_buffer(var_o, (total_q, Hq, D), dtype)
        lse = T.match_buffer(var_lse, (total_q, Hq), "float32")
        mn_indptr = T.match_buffer(var_mn_indptr, (B + 1,), "int32", elem_offset=off_mn)
        tree_mask = T.match_buffer(var_tree_mask, (nodes, 2), "int32", elem_offset=off_mask)
        kv_scales = T.match_buffer(var_kv_scales, (2, Hkv), "float32")
        T.Assert(rotary_mode == 0, "tree attention does not support inline RoPE (rotary_mode must be 0)")
        if on_gpu:
            run_gpu(q, o, lse, q_rope_position, qo_indptr, B, total_q,
                    with_kv_scales(spec, (pages, page_indices, page_indptr, length_info, k_rope_pos_offset, tree_mask,
                                          mn_indptr), kv_scales),
                    0, 0, rope_scale, rope_theta, sm_scale)
        else:
            for bh in T.parallel(B * Hkv):
                with T.sblock("work"):
                    T.reads()
                    T.writes()
                    attend_sequence(
                        q, o, lse, q_rope_position,
                        with_kv_scales(spec, (pages, page_indices, page_indptr[bh // Hkv], length_info, bh // Hkv),
                                       kv_scales), bh % Hkv,
                        qo_indptr[bh // Hkv], qo_indptr[bh // Hkv + 1] - qo_indptr[bh // Hkv],
                        paged_kv_len(page_indptr[bh // Hkv + 1] - page_indptr[bh // Hkv], ps, length_info,
                                      bh // Hkv, sliding),
                        k_rope_pos_offset[bh // Hkv], 0, 0, rope_scale, rope_theta, sm_scale,
                        (tree_mask, mn_indptr[bh // Hkv], mn_indptr[bh // Hkv + 1] - mn_indptr[bh // Hkv]))

    return paged_tree_prefill if spec.quantized else without_param(paged_tree_prefill, 16)


def make_ragged_tree_prefill(spec: AttentionSpec, sched: Schedule) -> tirx.PrimFunc:
    """Ragged prefill with a token-tree mask (TVM's ``tree_attn`` convention): a query sees the
    keys of its ancestors and itself; ``rotary_mode`` 0."""
    Hq, Hkv = spec.num_qo_heads, spec.num_kv_heads
    D, DV, dtype = spec.qk_head_dim, spec.v_head_dim, spec.dtype
    on_gpu = isinstance(sched, GpuSchedule)
    if on_gpu:
        run_gpu = gpu.prefill_grid(spec, sched, ragged_kv_access(spec), _ragged_seq_src, tree=True)
    else:
        attend_sequence = make_attend_sequence(spec, sched, q_tile=sched.q_tile, chunk=sched.kv_chunk,
                                                kv_elem=ragged_kv_access(spec), tree=True)

    @T.prim_func(s_tir=True)
    def ragged_tree_prefill(var_q: T.handle, var_qo_indptr: T.handle, var_k: T.handle, var_v: T.handle,
                            var_kv_indptr: T.handle, var_q_rope_position: T.handle, var_mn_indptr: T.handle,
                            var_tree_mask: T.handle, var_o: T.handle, var_lse: T.handle, rotary_mode: T.int32,
                            rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32):
        T.func_attr({"tirx.noalias": True})
        Bp1 = T.int32()  # batch size + 1 (only indptr arrays carry the batch size here)
        total_q = T.int32()
        total_kv = T.int32()
        nodes = T.int32()
        off_qo = T.int32()
        off_kv = T.int32()
        off_qrope = T.int32()
        off_mn = T.int32()
        off_mask = T.int32()
        q = T.match_buffer(var_q, (total_q, Hq, D), dtype)
        qo_indptr = T.match_buffer(var_qo_indptr, (Bp1,), "int32", elem_offset=off_qo)
        k = T.match_buffer(var_k, (total_kv, Hkv, D), dtype)
        v = T.match_buffer(var_v, (total_kv, Hkv, DV), dtype)
        kv_indptr = T.match_buffer(var_kv_indptr, (Bp1,), "int32", elem_offset=off_kv)
        q_rope_position = T.match_buffer(var_q_rope_position, (total_q,), "int32", elem_offset=off_qrope)
        mn_indptr = T.match_buffer(var_mn_indptr, (Bp1,), "int32", elem_offset=off_mn)
        tree_mask = T.match_buffer(var_tree_mask, (nodes, 2), "int32", elem_offset=off_mask)
        o = T.match_buffer(var_o, (total_q, Hq, DV), dtype)
        lse = T.match_buffer(var_lse, (total_q, Hq), "float32")
        T.Assert(rotary_mode == 0, "tree attention does not support inline RoPE (rotary_mode must be 0)")
        if on_gpu:
            run_gpu(q, o, lse, q_rope_position, qo_indptr, Bp1 - 1, total_q, (k, v, kv_indptr, tree_mask, mn_indptr),
                    0, 0, rope_scale, rope_theta, sm_scale)
        else:
            for bh in T.parallel((Bp1 - 1) * Hkv):
                with T.sblock("work"):
                    T.reads()
                    T.writes()
                    attend_sequence(
                        q, o, lse, q_rope_position, (k, v, kv_indptr[bh // Hkv]), bh % Hkv,
                        qo_indptr[bh // Hkv], qo_indptr[bh // Hkv + 1] - qo_indptr[bh // Hkv],
                        kv_indptr[bh // Hkv + 1] - kv_indptr[bh // Hkv], 0, 0, 0, rope_scale, rope_theta,
                        sm_scale,
                        (tree_mask, mn_indptr[bh // Hkv], mn_indptr[bh // Hkv + 1] - mn_indptr[bh // Hkv]))

    return ragged_tree_prefill
