"""``attention_prefill_prefixed``: :mod:`.attention`'s algorithm over :func:`~.macros.prefixed_kv_access`."""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from . import attention_gpu as gpu
from .attention import make_attend_sequence
from .macros import paged_kv_len, prefixed_kv_access, prefixed_kv_rows, refuse_quantized
from .schedule import GpuSchedule, Schedule
from .spec import AttentionSpec


def _prefixed_seq_src(spec: AttentionSpec):
    """GPU grids: tile arguments of sequence b from ``(pages, page_indices, page_indptr,
    length_info, k_rope_pos_offset, k, v, qo_indptr)``: the cached prefix, then the step's rows."""
    ps = spec.page_size

    def seq_src(bufs, b):
        prefix = paged_kv_len(bufs[2][b + 1] - bufs[2][b], ps, bufs[3], b, False)
        kv_src = (bufs[0], bufs[1], bufs[2][b], bufs[3], b, bufs[5], bufs[6], bufs[7][b], prefix)
        return kv_src, prefix + bufs[7][b + 1] - bufs[7][b], bufs[4][b], ()

    return seq_src


def make_prefixed_prefill(spec: AttentionSpec, sched: Schedule) -> tirx.PrimFunc:
    """Prefill over a cached prefix and the step's own K/V in one pass: the keys of sequence b
    are its paged rows (as :func:`make_paged_prefill`, no sliding window), then its new rows
    ``k / v[qo_indptr[b]:qo_indptr[b + 1]]`` (as q), at RoPE positions ``k_rope_pos_offset[b]``
    onwards; with ``causal`` the queries are the last keys. Replaces ragged prefill + paged
    prefill + merge for steps whose sequences each have one page list."""
    refuse_quantized(spec, "prefixed prefill")
    Hq, Hkv = spec.num_qo_heads, spec.num_kv_heads
    D, ps, dtype = spec.qk_head_dim, spec.page_size, spec.dtype
    if spec.sliding_window or spec.v_head_dim != D:
        raise ValueError("prefixed prefill reads plain page lists with v_head_dim == qk_head_dim")
    kv_elem = prefixed_kv_access(spec)
    on_gpu = isinstance(sched, GpuSchedule)
    if on_gpu:
        run_gpu = gpu.prefill_grid(spec, sched, kv_elem, _prefixed_seq_src(spec), kv_rows=prefixed_kv_rows(spec))
    else:
        attend_sequence = make_attend_sequence(spec, sched, q_tile=sched.q_tile, chunk=sched.kv_chunk,
                                                kv_elem=kv_elem)

    @T.prim_func(s_tir=True)
    def prefixed_prefill(var_q: T.handle, var_qo_indptr: T.handle, var_pages: T.handle,
                         var_page_indptr: T.handle, var_page_indices: T.handle, var_length_info: T.handle,
                         var_k_rope_pos_offset: T.handle, var_q_rope_position: T.handle, var_k: T.handle,
                         var_v: T.handle, var_o: T.handle, var_lse: T.handle, causal: T.int32,
                         rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32):
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
        pages = T.match_buffer(var_pages, (P, 2, Hkv, ps, D), dtype)
        page_indptr = T.match_buffer(var_page_indptr, (B + 1,), "int32", elem_offset=off_indptr)
        page_indices = T.match_buffer(var_page_indices, (nnz,), "int32", elem_offset=off_indices)
        length_info = T.match_buffer(var_length_info, (B,), "int32", elem_offset=off_len)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (B,), "int32", elem_offset=off_krope)
        q_rope_position = T.match_buffer(var_q_rope_position, (total_q,), "int32", elem_offset=off_qrope)
        k = T.match_buffer(var_k, (total_q, Hkv, D), dtype)
        v = T.match_buffer(var_v, (total_q, Hkv, D), dtype)
        o = T.match_buffer(var_o, (total_q, Hq, D), dtype)
        lse = T.match_buffer(var_lse, (total_q, Hq), "float32")
        if on_gpu:
            run_gpu(q, o, lse, q_rope_position, qo_indptr, B, total_q,
                    (pages, page_indices, page_indptr, length_info, k_rope_pos_offset, k, v, qo_indptr),
                    causal, rotary_mode, rope_scale, rope_theta, sm_scale)
        else:
            for bh in T.parallel(B * Hkv):
                with T.sblock("work"):
                    T.reads()
                    T.writes()
                    b: T.let[T.int32] = bh // Hkv
                    prefix: T.let[T.int32] = paged_kv_len(page_indptr[b + 1] - page_indptr[b], ps, length_info, b,
                                                          False)
                    attend_sequence(q, o, lse, q_rope_position,
                                    (pages, page_indices, page_indptr[b], length_info, b, k, v, qo_indptr[b], prefix),
                                    bh % Hkv, qo_indptr[b], qo_indptr[b + 1] - qo_indptr[b],
                                    prefix + qo_indptr[b + 1] - qo_indptr[b], k_rope_pos_offset[b], causal,
                                    rotary_mode, rope_scale, rope_theta, sm_scale, ())

    return prefixed_prefill
