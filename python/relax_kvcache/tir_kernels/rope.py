"""``split_rotary(qkv, position_map, q, k, v, apply_rope)``: split fused QKV, optionally RoPE.

``qkv (n, Hq + 2 Hkv, D)`` is split into ``q (n, Hq, D)``, ``k (n, Hkv, D)`` and
``v (n, Hkv, D)``. When ``apply_rope != 0`` q and k of token i are rotated to position
``position_map[i]`` (rotate-half RoPE, theta and scale compiled in, as TVM's convention).
With LongRoPE (``spec.longrope``) the last argument is ``ext_factors (R,) float32`` instead
(TVM's convention for RoPE extension factors) and q and k are always rotated: feature ``d`` of
the first half turns by ``pos * scale / (ext_factors[base + d] * theta^(2d/R))``, ``base`` 0
(long factors) at positions ``>= original_max_position_embeddings``, ``R/2`` (short) before,
and cos / sin are multiplied by the attention factor. ``R`` is ``spec.rotary_dim`` (default
``D``): a partial rotary dim rotates the pairs ``(d, d + R/2)`` for ``d < R/2`` and copies the
features ``[R, D)`` (GPT-NeoX / Phi-2 style). ``spec.interleaved`` (GPT-J style) pairs
neighbours ``(2i, 2i + 1)`` instead of ``(i, i + R/2)``, at the same frequencies.
"""

from __future__ import annotations

import math

import tvm
from tvm import tirx
from tvm.script import tirx as T

from .schedule import GpuSchedule, Schedule
from .spec import RopeSplitSpec


def _span_macros(spec: RopeSplitSpec, *, vector_math: bool = True):
    """Per-element work of split_rotary: ``(rope_angles, rotate_span, copy_span)``.

    ``vector_math=False`` unrolls rotations instead of vectorising them (TVM's CUDA codegen
    mis-emits float32 vectors of more than 4 lanes)."""
    R, dtype = spec.rotary, spec.dtype
    span_loop = T.vectorized if vector_math else T.unroll
    half = R // 2  # features d and d + half form a rotated pair (d < half)
    # inv_freq[d] = scale * theta^(-2d/R) = scale * exp2(d * log2_step), compiled-in constants.
    scale = tirx.const(spec.rope_scale, "float32")
    log2_step = tirx.const(-2.0 * math.log2(spec.rope_theta) / R, "float32")

    if spec.longrope is None:
        @T.macro
        def rope_angles(cos_v, sin_v, pos, d0, lanes: T.int32, ext_factors):
            """``cos_v/sin_v[d]`` = cos/sin of the angle of feature ``d0 + d`` at position pos
            (``ext_factors``: unused)."""
            for d in T.serial(lanes):
                angle: T.let[T.float32] = T.Cast("float32", pos) * (
                    scale * T.exp2(T.Cast("float32", d0 + d) * log2_step))
                cos_v[d] = T.cos(angle)
                sin_v[d] = T.sin(angle)
    else:
        original = spec.longrope.original_max_position_embeddings
        attention = tirx.const(spec.longrope.attention_factor, "float32")

        @T.macro
        def rope_angles(cos_v, sin_v, pos, d0, lanes: T.int32, ext_factors):
            """LongRoPE: the angle divided by the factor of ``d0 + d`` (long factors from
            position ``original`` on, short ones before), cos / sin times the attention factor."""
            base: T.let[T.int32] = T.if_then_else(pos >= original, 0, half)
            for d in T.serial(lanes):
                angle: T.let[T.float32] = T.Cast("float32", pos) * (
                    scale * T.exp2(T.Cast("float32", d0 + d) * log2_step)) / ext_factors[base + d0 + d]
                cos_v[d] = T.cos(angle) * attention
                sin_v[d] = T.sin(angle) * attention

    if spec.interleaved:  # GPT-J: pair i is the neighbours (2i, 2i + 1), no vector access across them
        span_loop, first, second = T.serial, (lambda i: 2 * i), (lambda i: 2 * i + 1)
    else:
        first, second = (lambda i: i), (lambda i: i + half)

    @T.macro
    def rotate_span(dst, row, head, src, src_head, d0, lanes: T.int32, cos_v, sin_v):
        """Rotate the pairs ``(first(d0 + d), second(d0 + d))`` for d < lanes by ``cos_v/sin_v[d]``:
        ``(i, i + half)``, or GPT-J's ``(2i, 2i + 1)``."""
        # Casts stay inline: a let-bound cast of a bfloat16 load is mis-legalised by TVM 0.27.
        for d in span_loop(lanes):
            dst[row, head, first(d0 + d)] = T.Cast(
                dtype, T.Cast("float32", src[row, src_head, first(d0 + d)]) * cos_v[d]
                - T.Cast("float32", src[row, src_head, second(d0 + d)]) * sin_v[d])
            dst[row, head, second(d0 + d)] = T.Cast(
                dtype, T.Cast("float32", src[row, src_head, second(d0 + d)]) * cos_v[d]
                + T.Cast("float32", src[row, src_head, first(d0 + d)]) * sin_v[d])

    @T.macro
    def copy_span(dst, row, head, src, src_head, d0, lanes: T.int32):
        """``dst[row, head, d0 : d0 + lanes] = src[row, src_head, d0 : d0 + lanes]``."""
        for d in T.vectorized(lanes):
            dst[row, head, d0 + d] = src[row, src_head, d0 + d]

    return rope_angles, rotate_span, copy_span


def _cpu_nest(spec: RopeSplitSpec):
    """One parallel work item per token; angles computed once per token."""
    Hq, Hkv, D, R = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.rotary
    half = R // 2
    rope_angles, rotate_span, copy_span = _span_macros(spec)

    @T.macro
    def rotate_head(dst, i, h, qkv, src_head, cos_v, sin_v):
        rotate_span(dst, i, h, qkv, src_head, 0, half, cos_v, sin_v)
        if R < D:  # partial rotary: the other features are copied
            copy_span(dst, i, h, qkv, src_head, R, D - R)

    @T.macro
    def nest(qkv, position_map, q, k, v, rotates, ext_factors, n):
        for i in T.parallel(n):
            with T.sblock("split"):
                T.reads()
                T.writes()
                cos_v = T.sblock_alloc_buffer((half,), "float32")
                sin_v = T.sblock_alloc_buffer((half,), "float32")
                if rotates:
                    rope_angles(cos_v, sin_v, position_map[i], 0, half, ext_factors)
                    for h in T.serial(Hq):
                        rotate_head(q, i, h, qkv, h, cos_v, sin_v)
                    for h in T.serial(Hkv):
                        rotate_head(k, i, h, qkv, Hq + h, cos_v, sin_v)
                else:
                    for h in T.serial(Hq):
                        copy_span(q, i, h, qkv, h, 0, D)
                    for h in T.serial(Hkv):
                        copy_span(k, i, h, qkv, Hq + h, 0, D)
                for h in T.serial(Hkv):
                    copy_span(v, i, h, qkv, Hq + Hkv + h, 0, D)

    return nest


def _gpu_nest(spec: RopeSplitSpec, sched: GpuSchedule):
    """One thread per (token, qkv head, span of the first half); it also writes the matching
    span of the second half. Partial rotary: a q / k span at ``d0 >= R / 2`` copies the spans at
    ``R + (d0 - R / 2)`` of both halves of ``[R, D)``."""
    Hq, Hkv, D, R = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.rotary
    half, rhalf = D // 2, R // 2
    heads = Hq + 2 * Hkv
    lanes = sched.lanes_for(tvm.DataType(spec.dtype).bits, math.gcd(half, rhalf))
    tail = (D - R) // 2  # each half of the unrotated features
    nv, nt = half // lanes, sched.copy_threads
    rope_angles, rotate_span, copy_span = _span_macros(spec, vector_math=lanes <= 4)

    @T.macro
    def copy_pair(dst, row, head, src, src_head, d0):
        copy_span(dst, row, head, src, src_head, d0, lanes)
        copy_span(dst, row, head, src, src_head, d0 + half, lanes)

    if R == D:
        @T.macro
        def span_angles(cos_v, sin_v, pos, d0, ext_factors):
            rope_angles(cos_v, sin_v, pos, d0, lanes, ext_factors)
    else:
        @T.macro
        def span_angles(cos_v, sin_v, pos, d0, ext_factors):
            """Only rotated spans need angles (and the factors hold R / 2 per half)."""
            if d0 < rhalf:
                rope_angles(cos_v, sin_v, pos, d0, lanes, ext_factors)

    @T.macro
    def rotate_or_copy(dst, i, head, qkv, src_head, d0, cos_v, sin_v):
        """A q / k head's span: rotated, or (partial rotary, ``d0 >= R / 2``) copied."""
        if R == D:
            rotate_span(dst, i, head, qkv, src_head, d0, lanes, cos_v, sin_v)
        elif d0 < rhalf:
            rotate_span(dst, i, head, qkv, src_head, d0, lanes, cos_v, sin_v)
        else:
            copy_span(dst, i, head, qkv, src_head, R + d0 - rhalf, lanes)
            copy_span(dst, i, head, qkv, src_head, R + tail + d0 - rhalf, lanes)

    @T.macro
    def nest(qkv, position_map, q, k, v, rotates, ext_factors, n):
        # At least one block: a launch of an empty grid fails.
        for bx in T.thread_binding(T.max(1, T.ceildiv(n * (heads * nv), nt)), thread="blockIdx.x"):
            for tx in T.thread_binding(nt, thread="threadIdx.x"):
                with T.sblock("split"):
                    T.reads()
                    T.writes()
                    cos_v = T.sblock_alloc_buffer((lanes,), "float32", scope="local")
                    sin_v = T.sblock_alloc_buffer((lanes,), "float32", scope="local")
                    if bx * nt + tx < n * (heads * nv):
                        i: T.let[T.int32] = (bx * nt + tx) // (heads * nv)
                        h: T.let[T.int32] = (bx * nt + tx) // nv % heads
                        d0: T.let[T.int32] = (bx * nt + tx) % nv * lanes
                        if rotates and h < Hq + Hkv:
                            span_angles(cos_v, sin_v, position_map[i], d0, ext_factors)
                            if h < Hq:
                                rotate_or_copy(q, i, h, qkv, h, d0, cos_v, sin_v)
                            else:
                                rotate_or_copy(k, i, h - Hq, qkv, h, d0, cos_v, sin_v)
                        elif h < Hq:
                            copy_pair(q, i, h, qkv, h, d0)
                        elif h < Hq + Hkv:
                            copy_pair(k, i, h - Hq, qkv, h, d0)
                        else:
                            copy_pair(v, i, h - Hq - Hkv, qkv, h, d0)

    return nest


def make_split_rotary(spec: RopeSplitSpec, sched: Schedule) -> tirx.PrimFunc:
    """``split_rotary(qkv, position_map, q, k, v, apply_rope: int64)``, or with
    ``spec.longrope`` ``split_rotary(qkv, position_map, q, k, v, ext_factors (R,) float32)``."""
    Hq, Hkv, D, dtype = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.dtype
    nest = _gpu_nest(spec, sched) if isinstance(sched, GpuSchedule) else _cpu_nest(spec)

    @T.macro
    def split(var_qkv, var_position_map, var_q, var_k, var_v, rotates, ext_factors):
        """The buffers of both signatures (they differ in the last argument only) and the nest."""
        T.func_attr({"tirx.noalias": True})
        n = T.int32()
        off_pos = T.int32()
        qkv = T.match_buffer(var_qkv, (n, Hq + 2 * Hkv, D), dtype)
        position_map = T.match_buffer(var_position_map, (n,), "int32", elem_offset=off_pos)
        q = T.match_buffer(var_q, (n, Hq, D), dtype)
        k = T.match_buffer(var_k, (n, Hkv, D), dtype)
        v = T.match_buffer(var_v, (n, Hkv, D), dtype)
        nest(qkv, position_map, q, k, v, rotates, ext_factors, n)

    if spec.longrope is not None:
        @T.prim_func(s_tir=True)
        def split_rotary_longrope(var_qkv: T.handle, var_position_map: T.handle, var_q: T.handle,
                                  var_k: T.handle, var_v: T.handle, var_ext_factors: T.handle):
            ext_factors = T.match_buffer(var_ext_factors, (spec.rotary,), "float32")
            split(var_qkv, var_position_map, var_q, var_k, var_v, T.bool(True), ext_factors)

        return split_rotary_longrope

    @T.prim_func(s_tir=True)
    def split_rotary(var_qkv: T.handle, var_position_map: T.handle, var_q: T.handle,
                     var_k: T.handle, var_v: T.handle, apply_rope: T.int64):
        split(var_qkv, var_position_map, var_q, var_k, var_v, apply_rope != 0, 0)

    return split_rotary


def make_fused_qkv_check(spec: RopeSplitSpec, sched: Schedule) -> tirx.PrimFunc:
    """``check_fused_qkv(qkv, o, position_map)``: does nothing; its argument binding checks (dtype,
    device, shape, contiguity, no byte offset) that ``qkv (n, Hq + 2 Hkv, D)`` and ``o (n, Hq, D)``
    fit a step of ``n = len(position_map)`` tokens, in one host call (``attention_with_fused_qkv``;
    the same on every target: ``sched`` is not used)."""
    Hq, Hkv, D, dtype = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.dtype

    @T.prim_func(s_tir=True)
    def check_fused_qkv(var_qkv: T.handle, var_o: T.handle, var_position_map: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int32()
        off_pos = T.int32()
        T.match_buffer(var_qkv, (n, Hq + 2 * Hkv, D), dtype)
        T.match_buffer(var_o, (n, Hq, D), dtype)
        T.match_buffer(var_position_map, (n,), "int32", elem_offset=off_pos)
        T.evaluate(0)

    return check_fused_qkv
