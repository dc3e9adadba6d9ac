"""``merge_inplace(o, lse, o_other, lse_other)``: merge attention states by base-2 LSE.

``o (n, H, D)`` and ``lse (n, H)`` (float32) are overwritten with the attention over the union
of both key sets: ``lse' = log2(2^lse + 2^lse_other)`` and ``o' = (2^lse o + 2^lse_other
o_other) / 2^lse'``. A state with ``lse = -inf`` (no keys) contributes nothing; two empty
states stay empty.
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.script import tirx as T

from .macros import NEG_INF, ONE, ZERO
from .schedule import GpuSchedule, Schedule
from .spec import MergeSpec


def _merge_head(spec: MergeSpec):
    """Macro merging head h of token i (CPU: head_dim is one vectorised span)."""
    D, dtype = spec.head_dim, spec.dtype

    @T.macro
    def merge_head(o, lse, o_other, lse_other, i, h):
        mx: T.let[T.float32] = T.max(lse[i, h], lse_other[i, h])
        w0: T.let[T.float32] = T.if_then_else(mx == NEG_INF, ZERO, T.exp2(lse[i, h] - mx))
        w1: T.let[T.float32] = T.if_then_else(mx == NEG_INF, ZERO, T.exp2(lse_other[i, h] - mx))
        inv: T.let[T.float32] = T.if_then_else(w0 + w1 > ZERO, ONE / (w0 + w1), ZERO)
        for d in T.vectorized(D):
            o[i, h, d] = T.Cast(dtype, (T.Cast("float32", o[i, h, d]) * w0
                                        + T.Cast("float32", o_other[i, h, d]) * w1) * inv)
        lse[i, h] = T.if_then_else(w0 + w1 > ZERO, mx + T.log2(w0 + w1), NEG_INF)

    return merge_head


def _cpu_nest(spec: MergeSpec):
    """One parallel work item per token; head_dim is one vectorised span."""
    H = spec.num_heads
    merge_head = _merge_head(spec)

    @T.macro
    def nest(o, lse, o_other, lse_other, n):
        for i in T.parallel(n):
            with T.sblock("merge"):
                T.reads()
                T.writes()
                for h in T.serial(H):
                    merge_head(o, lse, o_other, lse_other, i, h)

    return nest


def _gpu_nest(spec: MergeSpec, sched: GpuSchedule):
    """A (token, head) per group of ``tph`` neighbouring threads; thread s takes the spans ``s, s +
    tph, ...`` of head_dim; after a warp barrier the first one writes the merged lse."""
    H, D, dtype, nt = spec.num_heads, spec.head_dim, spec.dtype, sched.copy_threads
    lanes = sched.lanes_for(tvm.DataType(dtype).bits, D)
    spans = D // lanes
    tph = 1
    while tph < min(spans, sched.warp_size) and spans % (2 * tph) == 0:
        tph *= 2
    heads_per_block = nt // tph

    @T.macro
    def nest(o, lse, o_other, lse_other, n):
        # At least one block: a launch of an empty grid fails.
        for bx in T.thread_binding(T.max(1, T.ceildiv(n * H, heads_per_block)), thread="blockIdx.x"):
            for tx in T.thread_binding(nt, thread="threadIdx.x"):
                with T.sblock("merge"):
                    T.reads()
                    T.writes()
                    a = T.sblock_alloc_buffer((lanes,), dtype, scope="local")
                    b = T.sblock_alloc_buffer((lanes,), dtype, scope="local")
                    row: T.let[T.int32] = T.min(bx * heads_per_block + tx // tph, n * H - 1)
                    i: T.let[T.int32] = row // H
                    h: T.let[T.int32] = row % H
                    mx: T.let[T.float32] = T.max(lse[i, h], lse_other[i, h])
                    w0: T.let[T.float32] = T.if_then_else(mx == NEG_INF, ZERO, T.exp2(lse[i, h] - mx))
                    w1: T.let[T.float32] = T.if_then_else(mx == NEG_INF, ZERO, T.exp2(lse_other[i, h] - mx))
                    inv: T.let[T.float32] = T.if_then_else(w0 + w1 > ZERO, ONE / (w0 + w1), ZERO)
                    if bx * heads_per_block + tx // tph < n * H:
                        for it in T.serial(spans // tph):
                            for d in T.vectorized(lanes):
                                a[d] = o[i, h, (it * tph + tx % tph) * lanes + d]
                            for d in T.vectorized(lanes):
                                b[d] = o_other[i, h, (it * tph + tx % tph) * lanes + d]
                            for d in T.unroll(lanes):
                                a[d] = T.Cast(dtype, (T.Cast("float32", a[d]) * w0 + T.Cast("float32", b[d]) * w1) * inv)
                            for d in T.vectorized(lanes):
                                o[i, h, (it * tph + tx % tph) * lanes + d] = a[d]
                    # every thread of the group has read lse[i, h] before the first one writes it
                    T.evaluate(T.tvm_storage_sync("warp"))
                    if T.And(bx * heads_per_block + tx // tph < n * H, tx % tph == 0):
                        lse[i, h] = T.if_then_else(w0 + w1 > ZERO, mx + T.log2(w0 + w1), NEG_INF)

    return nest


def make_merge_inplace(spec: MergeSpec, sched: Schedule) -> tirx.PrimFunc:
    H, D, dtype = spec.num_heads, spec.head_dim, spec.dtype
    nest = _gpu_nest(spec, sched) if isinstance(sched, GpuSchedule) else _cpu_nest(spec)

    @T.prim_func(s_tir=True)
    def merge_inplace(var_o: T.handle, var_lse: T.handle, var_o_other: T.handle, var_lse_other: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int32()
        o = T.match_buffer(var_o, (n, H, D), dtype)
        lse = T.match_buffer(var_lse, (n, H), "float32")
        o_other = T.match_buffer(var_o_other, (n, H, D), dtype)
        lse_other = T.match_buffer(var_lse_other, (n, H), "float32")
        nest(o, lse, o_other, lse_other, n)

    return merge_inplace
