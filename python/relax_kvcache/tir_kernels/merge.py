"""``merge_inplace(o, lse, o_other, lse_other)``: merge attention states by base-2 LSE.

``o (n, H, D)`` and ``lse (n, H)`` (float32) are overwritten with the attention over the union
of both key sets: ``lse' = log2(2^lse + 2^lse_other)`` and ``o' = (2^lse o + 2^lse_other
o_other) / 2^lse'``. A state with ``lse = -inf`` (no keys) contributes nothing; two empty
states stay empty.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .macros import NEG_INF, ONE, ZERO
from .schedule import CpuSchedule
from .spec import MergeSpec


def make_merge_inplace(spec: MergeSpec, sched: CpuSchedule) -> tirx.PrimFunc:
    H, D, dtype = spec.num_heads, spec.head_dim, spec.dtype

    @T.prim_func(s_tir=True)
    def merge_inplace(var_o: T.handle, var_lse: T.handle, var_o_other: T.handle, var_lse_other: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int32()
        o = T.match_buffer(var_o, (n, H, D), dtype)
        lse = T.match_buffer(var_lse, (n, H), "float32")
        o_other = T.match_buffer(var_o_other, (n, H, D), dtype)
        lse_other = T.match_buffer(var_lse_other, (n, H), "float32")
        for i in T.parallel(n):
            with T.sblock("merge"):
                T.reads()
                T.writes()
                for h in T.serial(H):
                    mx: T.let[T.float32] = T.max(lse[i, h], lse_other[i, h])
                    w0: T.let[T.float32] = T.if_then_else(mx == NEG_INF, ZERO, T.exp2(lse[i, h] - mx))
                    w1: T.let[T.float32] = T.if_then_else(mx == NEG_INF, ZERO, T.exp2(lse_other[i, h] - mx))
                    inv: T.let[T.float32] = T.if_then_else(w0 + w1 > ZERO, ONE / (w0 + w1), ZERO)
                    for d in T.vectorized(D):
                        o[i, h, d] = T.Cast(dtype, (T.Cast("float32", o[i, h, d]) * w0
                                                    + T.Cast("float32", o_other[i, h, d]) * w1) * inv)
                    lse[i, h] = T.if_then_else(w0 + w1 > ZERO, mx + T.log2(w0 + w1), NEG_INF)

    return merge_inplace
