"""Kernels that move KV data in and out of pages.

A position in the page pool is ``page_id * page_size + slot``. Calling conventions (TVM's):

* ``transpose_append(pages, k, v, position_map)``: write token i's k/v to ``position_map[i]``
  (skipped when it is -1).
* ``copy_single_page(pages, src_page_id, tgt_page_id, copy_length)``: copy the first
  ``copy_length`` slots of a page (K and V, all heads).
* ``compact_copy(pages, copy_length_indptr, src_dst_pos, batch_size)``: for each sequence b,
  move ``src_dst_pos[0, i] -> src_dst_pos[1, i]`` for i in its range, in order.
* ``debug_get_kv(pages, position_map, k_out, v_out, layer_id)``: gather positions into
  ``k_out/v_out[layer_id]`` of shape ``(num_layers, n, num_kv_heads, head_dim)``.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .schedule import CpuSchedule
from .spec import PageLayoutSpec


@T.macro
def copy_slot(pages, src, dst, heads: T.int32, dim: T.int32, ps: T.int32):
    """Copy K and V of all heads from pool position src to pool position dst."""
    for kv in T.serial(2):
        for h in T.serial(heads):
            for d in T.vectorized(dim):
                pages[dst // ps, kv, h, dst % ps, d] = pages[src // ps, kv, h, src % ps, d]


def make_transpose_append(spec: PageLayoutSpec, sched: CpuSchedule) -> tirx.PrimFunc:
    H, D, ps, dtype = spec.num_kv_heads, spec.head_dim, spec.page_size, spec.dtype

    @T.prim_func(s_tir=True)
    def transpose_append(var_pages: T.handle, var_k: T.handle, var_v: T.handle, var_position_map: T.handle):
        T.func_attr({"tirx.noalias": True})
        P = T.int64()
        n = T.int32()
        off_pos = T.int32()
        pages = T.match_buffer(var_pages, (P, 2, H, ps, D), dtype)
        k = T.match_buffer(var_k, (n, H, D), dtype)
        v = T.match_buffer(var_v, (n, H, D), dtype)
        position_map = T.match_buffer(var_position_map, (n,), "int32", elem_offset=off_pos)
        for i in T.parallel(n):
            with T.sblock("append"):
                T.reads()
                T.writes()
                pos: T.let[T.int32] = position_map[i]
                if pos != -1:
                    for h in T.serial(H):
                        for d in T.vectorized(D):
                            pages[pos // ps, 0, h, pos % ps, d] = k[i, h, d]
                        for d in T.vectorized(D):
                            pages[pos // ps, 1, h, pos % ps, d] = v[i, h, d]

    return transpose_append


def make_copy_single_page(spec: PageLayoutSpec, sched: CpuSchedule) -> tirx.PrimFunc:
    H, D, ps, dtype = spec.num_kv_heads, spec.head_dim, spec.page_size, spec.dtype

    @T.prim_func(s_tir=True)
    def copy_single_page(var_pages: T.handle, src_page_id: T.int64, tgt_page_id: T.int64,
                         copy_length: T.int64):
        T.func_attr({"tirx.noalias": True})
        P = T.int64()
        pages = T.match_buffer(var_pages, (P, 2, H, ps, D), dtype)
        for kv_h in T.parallel(2 * H):
            with T.sblock("copy"):
                T.reads()
                T.writes()
                for slot in T.serial(copy_length):
                    for d in T.vectorized(D):
                        pages[tgt_page_id, kv_h // H, kv_h % H, slot, d] = \
                            pages[src_page_id, kv_h // H, kv_h % H, slot, d]

    return copy_single_page


def make_compact_copy(spec: PageLayoutSpec, sched: CpuSchedule) -> tirx.PrimFunc:
    H, D, ps, dtype = spec.num_kv_heads, spec.head_dim, spec.page_size, spec.dtype

    @T.prim_func(s_tir=True)
    def compact_copy(var_pages: T.handle, var_copy_length_indptr: T.handle,
                     var_src_dst_pos: T.handle, batch_size: T.int32):
        T.func_attr({"tirx.noalias": True})
        P = T.int64()
        total = T.int32()
        off_indptr = T.int32()
        off_pos = T.int32()
        pages = T.match_buffer(var_pages, (P, 2, H, ps, D), dtype)
        copy_length_indptr = T.match_buffer(var_copy_length_indptr, (batch_size + 1,), "int32",
                                            elem_offset=off_indptr)
        src_dst_pos = T.match_buffer(var_src_dst_pos, (2, total), "int32", elem_offset=off_pos)
        for b in T.parallel(batch_size):
            with T.sblock("compact"):
                T.reads()
                T.writes()
                for i in T.serial(copy_length_indptr[b + 1] - copy_length_indptr[b]):
                    copy_slot(pages, src_dst_pos[0, copy_length_indptr[b] + i],
                              src_dst_pos[1, copy_length_indptr[b] + i], H, D, ps)

    return compact_copy


def make_debug_get_kv(spec: PageLayoutSpec, sched: CpuSchedule) -> tirx.PrimFunc:
    H, D, ps, dtype = spec.num_kv_heads, spec.head_dim, spec.page_size, spec.dtype

    @T.prim_func(s_tir=True)
    def debug_get_kv(var_pages: T.handle, var_position_map: T.handle, var_k: T.handle,
                     var_v: T.handle, layer_id: T.int64):
        T.func_attr({"tirx.noalias": True})
        P = T.int64()
        L = T.int64()
        n = T.int64()
        off_pos = T.int64()
        pages = T.match_buffer(var_pages, (P, 2, H, ps, D), dtype)
        position_map = T.match_buffer(var_position_map, (n,), "int32", elem_offset=off_pos)
        k = T.match_buffer(var_k, (L, n, H, D), dtype)
        v = T.match_buffer(var_v, (L, n, H, D), dtype)
        for i in T.parallel(n):
            with T.sblock("gather"):
                T.reads()
                T.writes()
                pos: T.let[T.int32] = position_map[i]
                for h in T.serial(H):
                    for d in T.vectorized(D):
                        k[layer_id, i, h, d] = pages[pos // ps, 0, h, pos % ps, d]
                    for d in T.vectorized(D):
                        v[layer_id, i, h, d] = pages[pos // ps, 1, h, pos % ps, d]

    return debug_get_kv
