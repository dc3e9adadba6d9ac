"""``split_rotary(qkv, position_map, q, k, v, apply_rope)``: split fused QKV, optionally RoPE.

``qkv (n, Hq + 2 Hkv, D)`` is split into ``q (n, Hq, D)``, ``k (n, Hkv, D)`` and
``v (n, Hkv, D)``. When ``apply_rope != 0`` q and k of token i are rotated to position
``position_map[i]`` (rotate-half RoPE, theta and scale compiled in, as TVM's convention).
The cosines and sines of a token are computed once and reused by all its heads.
"""

from __future__ import annotations

import math

from tvm import tirx
from tvm.script import tirx as T

from .schedule import CpuSchedule
from .spec import RopeSplitSpec


def make_split_rotary(spec: RopeSplitSpec, sched: CpuSchedule) -> tirx.PrimFunc:
    Hq, Hkv, D, dtype = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.dtype
    half = D // 2
    # inv_freq[d] = scale * theta^(-2d/D) = scale * exp2(d * log2_step), compiled-in constants.
    scale = tirx.const(spec.rope_scale, "float32")
    log2_step = tirx.const(-2.0 * math.log2(spec.rope_theta) / D, "float32")

    @T.macro
    def rotate_head(dst, row, head, src, src_head, cos_v, sin_v):
        # Casts stay inline: a let-bound cast of a bfloat16 load is mis-legalised by TVM 0.27.
        for d in T.vectorized(half):
            dst[row, head, d] = T.Cast(dtype, T.Cast("float32", src[row, src_head, d]) * cos_v[d]
                                       - T.Cast("float32", src[row, src_head, d + half]) * sin_v[d])
            dst[row, head, d + half] = T.Cast(dtype, T.Cast("float32", src[row, src_head, d + half]) * cos_v[d]
                                              + T.Cast("float32", src[row, src_head, d]) * sin_v[d])

    @T.prim_func(s_tir=True)
    def split_rotary(var_qkv: T.handle, var_position_map: T.handle, var_q: T.handle,
                     var_k: T.handle, var_v: T.handle, apply_rope: T.int64):
        T.func_attr({"tirx.noalias": True})
        n = T.int32()
        off_pos = T.int32()
        qkv = T.match_buffer(var_qkv, (n, Hq + 2 * Hkv, D), dtype)
        position_map = T.match_buffer(var_position_map, (n,), "int32", elem_offset=off_pos)
        q = T.match_buffer(var_q, (n, Hq, D), dtype)
        k = T.match_buffer(var_k, (n, Hkv, D), dtype)
        v = T.match_buffer(var_v, (n, Hkv, D), dtype)
        for i in T.parallel(n):
            with T.sblock("split"):
                T.reads()
                T.writes()
                cos_v = T.sblock_alloc_buffer((half,), "float32")
                sin_v = T.sblock_alloc_buffer((half,), "float32")
                if apply_rope != 0:
                    for d in T.serial(half):
                        angle: T.let[T.float32] = T.Cast("float32", position_map[i]) * (
                            scale * T.exp2(T.Cast("float32", d) * log2_step))
                        cos_v[d] = T.cos(angle)
                        sin_v[d] = T.sin(angle)
                    for h in T.serial(Hq):
                        rotate_head(q, i, h, qkv, h, cos_v, sin_v)
                    for h in T.serial(Hkv):
                        rotate_head(k, i, h, qkv, Hq + h, cos_v, sin_v)
                else:
                    for h in T.serial(Hq):
                        for d in T.vectorized(D):
                            q[i, h, d] = qkv[i, h, d]
                    for h in T.serial(Hkv):
                        for d in T.vectorized(D):
                            k[i, h, d] = qkv[i, Hq + h, d]
                for h in T.serial(Hkv):
                    for d in T.vectorized(D):
                        v[i, h, d] = qkv[i, Hq + Hkv + h, d]

    return split_rotary

