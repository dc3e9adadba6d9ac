"""Tensor-core schedule of GQA decode (CUDA sm_80 and newer, float16 / bfloat16, 4-8 query
heads per KV head).

The algorithm is :mod:`.attention_gpu_decode`'s; a warp takes 16 KV rows at a time and computes
``S = Q K^T`` and ``O^T += V^T P^T`` with ``mma.sync.m16n8k16`` (the S accumulators are already
the B operand of the second product). Fragments load straight from the pages in 16-byte pieces
because the head dimension is permuted (dot products and output columns do not depend on the
order of the dimensions, as long as Q and K, and V and O, share it):

* K / Q: lane ``4 g + t`` holds dims ``[t D / 4, (t + 1) D / 4)``; k-step kk uses
  ``t D / 4 + 4 kk + (0..3)``;
* V / O: lane ``4 g + t`` holds dims ``[g W, (g + 1) W)`` (``W = DV / 8``) of KV rows
  ``2 t, 2 t + 1, 2 t + 8, 2 t + 9``; row slot g / g + 8 of output m-tile mt is dim
  ``g W + 2 mt`` / ``g W + 2 mt + 1``.
"""

from __future__ import annotations

from tvm.script import tirx as T

from .attention_gpu_mma import fold_scores, mma_m16n8k16, shfl_xor
from .macros import LOG2E, NEG_INF, ONE, ZERO, ceildiv, split_rows
from .schedule import GpuSchedule
from .spec import AttentionSpec

CHUNK = 16  # KV rows per warp step


def decode_mma_applies(spec: AttentionSpec, sched: GpuSchedule) -> bool:
    """Whether the tensor-core decode item serves ``spec`` (mma on the target, float16 /
    bfloat16 pages or 8-bit pages of a float16 model, 4 to 8 query heads per KV head, head dims
    64 or 128: whole 16-byte loads of a lane's K and V slices, and fragments that fit in
    registers)."""
    D, DV, G = spec.qk_head_dim, spec.v_head_dim, spec.group_size
    dtypes = ("float16",) if spec.quantized else ("float16", "bfloat16")
    return (sched.mma and spec.dtype in dtypes and 4 <= G <= 8 and D in (64, 128)
            and DV in (64, 128) and sched.threads % 32 == 0)


def fp8_pairs(kv_dtype: str, word):
    """``word``'s four 8-bit floats as float16 bit pairs by moving bits (``(bytes 0 and 2, bytes
    1 and 3)``, each in a 32-bit word's low and high half; :func:`half_of`): each byte goes to
    the upper byte of its half, which is the float16 of an e5m2 value; e4m3's exponent and
    mantissa then move one bit down, giving its value times 2^-8 (exact;
    :data:`FP8_HALF_FACTOR` restores it)."""
    pairs = (T.bitwise_and(T.shift_left(word, T.uint32(8)), T.uint32(0xFF00FF00)),
             T.bitwise_and(word, T.uint32(0xFF00FF00)))
    if kv_dtype == "float8_e5m2":
        return pairs
    return tuple(T.bitwise_or(T.bitwise_and(x, T.uint32(0x80008000)),
                              T.shift_right(T.bitwise_and(x, T.uint32(0x7F007F00)), T.uint32(1))) for x in pairs)


def half_of(pair, high: bool):
    """The low or high float16 of a 32-bit word."""
    return T.reinterpret("float16", T.Cast("uint16", T.shift_right(pair, T.uint32(16)) if high else pair))


#: what :func:`fp8_pairs`' float16 values are multiplied by to give the stored values
FP8_HALF_FACTOR = {"float8_e4m3fn": 256.0, "float8_e5m2": 1.0}

#: the PTX conversion of two 8-bit floats (a 16-bit word) to two float16 (sm_89+; exact)
FP8X2_TO_HALF2 = {"float8_e4m3fn": T.ptx.cvt.rn.f16x2.e4m3x2, "float8_e5m2": T.ptx.cvt.rn.f16x2.e5m2x2}


def make_decode_mma_item(spec: AttentionSpec, sched: GpuSchedule, kv_rows, opening=None):
    """Macro computing one (sequence, KV head, split) into the split workspace on tensor cores
    (the arguments of :func:`.attention_gpu_decode.make_decode_item`'s rope-free item).
    ``opening``: the grid-dependency wait, which the item then runs itself after its first page
    lookups (host data) and before its first read of q."""
    locate, elem_at, _ = kv_rows
    G, D, DV, dtype, span = spec.group_size, spec.qk_head_dim, spec.v_head_dim, spec.dtype, spec.span
    quantized = spec.quantized
    NT = sched.threads
    NW, KQ, W, MT = NT // 32, D // 4, DV // 8, DV // 16  # warps, K dims per lane, V dims per lane, m-tiles
    KK = D // 16  # k-steps of Q K^T
    VEC = min(8, W)  # halves per vector load (16 bytes; DV = 64 leaves 8 dims per lane)
    mma, fold = mma_m16n8k16(dtype), fold_scores(2)

    def shfl_from(x, lane):
        return T.tvm_warp_shuffle(T.tvm_warp_activemask(), x, lane, 32, 32)

    @T.macro
    def locate_chunk(slots, kv_src, j0, hi, g, t):
        """slots = pool slots of this lane's K rows (``j0 + g``, ``j0 + 8 + g``) and V rows
        (``j0 + 2 t, + 1, + 8, + 9``) of the chunk at j0 (clamped below hi; 0 past hi)."""
        for r in T.unroll(2):
            slots[r] = T.if_then_else(j0 < hi, locate(kv_src, T.min(j0 + r * 8 + g, hi - 1), ()), 0)
        for r in T.unroll(4):
            slots[2 + r] = T.if_then_else(
                j0 < hi, locate(kv_src, T.min(j0 + r // 2 * 8 + 2 * t + r % 2, hi - 1), ()), 0)

    @T.macro
    def load_chunk(kr, vr, kv_src, h, slots, g, t):
        for r in T.unroll(2):
            for v in T.unroll(KQ // VEC):
                for x in T.vectorized(VEC):
                    kr[r, v * VEC + x] = elem_at(kv_src, h, slots[r], 0, t * KQ + v * VEC + x)
        for r in T.unroll(4):
            for v in T.unroll(W // VEC):
                for x in T.vectorized(VEC):
                    vr[r, v * VEC + x] = elem_at(kv_src, h, slots[2 + r], 1, g * W + v * VEC + x)

    ps, fmt = spec.page_size, spec.kv_dtype

    hardware = quantized and sched.fp8_convert
    half_factor = 1.0 if hardware else FP8_HALF_FACTOR.get(fmt, 1.0)

    @T.macro
    def convert_word(frag, r, i, word, cw):
        """Elements ``4 i .. 4 i + 3`` of fragment row r from one word of 8-bit floats (``cw``:
        two 32-bit registers for the hardware conversion)."""
        if hardware:
            T.evaluate(FP8X2_TO_HALF2[fmt](cw[0], T.Cast("uint16", word)))
            T.evaluate(FP8X2_TO_HALF2[fmt](cw[1], T.Cast("uint16", T.shift_right(word, T.uint32(16)))))
            frag[r, 4 * i] = half_of(cw[0], False)
            frag[r, 4 * i + 1] = half_of(cw[0], True)
            frag[r, 4 * i + 2] = half_of(cw[1], False)
            frag[r, 4 * i + 3] = half_of(cw[1], True)
        else:
            frag[r, 4 * i] = half_of(fp8_pairs(fmt, word)[0], False)
            frag[r, 4 * i + 1] = half_of(fp8_pairs(fmt, word)[1], False)
            frag[r, 4 * i + 2] = half_of(fp8_pairs(fmt, word)[0], True)
            frag[r, 4 * i + 3] = half_of(fp8_pairs(fmt, word)[1], True)

    @T.macro
    def load_chunk_fp8(kr, vr, kv_src, h, slots, g, t, kw, vw, cw):
        """8-bit pages: the lane's K / V bytes as 32-bit words (4 elements each), then as
        float16 fragments (the hardware conversion where there is one, else :func:`fp8_pairs`;
        the scales apply to scores and outputs)."""
        for r in T.unroll(2):
            for i in T.unroll(KQ // 4):
                kw[r, i] = T.reinterpret("uint32", kv_src[0][slots[r] // ps, 0, h, slots[r] % ps,
                                                             T.ramp(t * KQ + 4 * i, 1, 4)])
        for r in T.unroll(4):
            for i in T.unroll(W // 4):
                vw[r, i] = T.reinterpret("uint32", kv_src[0][slots[2 + r] // ps, 1, h, slots[2 + r] % ps,
                                                             T.ramp(g * W + 4 * i, 1, 4)])
        for r in T.unroll(2):
            for i in T.unroll(KQ // 4):
                convert_word(kr, r, i, kw[r, i], cw)
        for r in T.unroll(4):
            for i in T.unroll(W // 4):
                convert_word(vr, r, i, vw[r, i], cw)

    @T.macro
    def scores(sacc, qf, kr, af, bf, scale, j0, hi, t):
        """sacc = S of the chunk (two 16 x 8 tiles: heads g, g + 8 x KV rows), scaled to log2
        units, -inf past hi."""
        for x in T.unroll(8):
            sacc[x] = ZERO
        for kk in T.unroll(KK):
            for x in T.unroll(8):
                af[x] = qf[kk * 8 + x]
            for nt in T.unroll(2):
                for x in T.unroll(4):
                    bf[x] = kr[nt, kk * 4 + x]
                T.evaluate(mma(af, bf, sacc, nt))
        for nt in T.unroll(2):
            for e in T.unroll(4):
                sacc[nt * 4 + e] = T.if_then_else(j0 + nt * 8 + 2 * t + e % 2 < hi, sacc[nt * 4 + e] * scale, NEG_INF)

    @T.macro
    def values(oacc, sacc, vr, af, bf, alpha, t):
        """oacc (O^T: dims x heads) = oacc * alpha(head) + V^T P^T of the chunk."""
        # alpha of heads 2 t and 2 t + 1 (kept by lanes 4 head + any t)
        for e in T.unroll(2):
            alpha[2 + e] = shfl_from(alpha[0], 4 * (2 * t + e))
        for mt in T.unroll(MT):
            for e in T.unroll(4):
                oacc[mt * 4 + e] = oacc[mt * 4 + e] * alpha[2 + e % 2]
        bf[0] = T.Cast(dtype, sacc[0])
        bf[1] = T.Cast(dtype, sacc[1])
        bf[2] = T.Cast(dtype, sacc[4])
        bf[3] = T.Cast(dtype, sacc[5])
        for mt in T.unroll(MT):
            for x in T.unroll(8):
                # (dim slot g or g + 8, KV row 2 t + x % 2 (+ 8 from x = 4 on))
                af[x] = vr[x // 4 * 2 + x % 2, 2 * mt + x // 2 % 2]
            T.evaluate(mma(af, bf, oacc, mt))

    @T.macro
    def merge_warps(out, oacc, m2, l2, sm_m, sm_l, sm_o, red, h, w, g, t, tx, v_factor):
        """Merge the warps' states by LSE and write the group's rows of the split workspace
        (``out = (ws_o, ws_lse, first workspace row, split)``, rows ``h G .. h G + G``)."""
        for e in T.unroll(2):
            l2[0] = l2[0] + shfl_xor(l2[0], 1 + e)
        if t == 0:
            if g < G:
                sm_m[w, g] = m2[0]
                sm_l[w, g] = l2[0]
        for mt in T.unroll(MT):
            for e in T.unroll(4):
                if 2 * t + e % 2 < G:
                    sm_o[w, 2 * t + e % 2, g * W + 2 * mt + e // 2] = oacc[mt * 4 + e]
        T.evaluate(T.tvm_storage_sync("shared"))
        for it in T.serial(ceildiv(G * DV, NT)):
            if it * NT + tx < G * DV:
                hd: T.let[T.int32] = (it * NT + tx) // DV
                d: T.let[T.int32] = (it * NT + tx) % DV
                red[0] = NEG_INF
                for v in T.unroll(NW):
                    red[0] = T.max(red[0], sm_m[v, hd])
                red[1] = ZERO
                red[2] = ZERO
                for v in T.unroll(NW):
                    red[3] = T.if_then_else(sm_m[v, hd] == NEG_INF, ZERO, T.exp2(sm_m[v, hd] - red[0]))
                    red[1] = red[1] + sm_l[v, hd] * red[3]
                    red[2] = red[2] + sm_o[v, hd, d] * red[3]
                if quantized:  # 8-bit pages: the V scale (and the float16 fragments' factor) applies here
                    out[0][out[2] + h * G + hd, out[3], d] = T.if_then_else(red[1] > ZERO, red[2] / red[1] * v_factor,
                                                                            ZERO)
                else:
                    out[0][out[2] + h * G + hd, out[3], d] = T.if_then_else(red[1] > ZERO, red[2] / red[1], ZERO)
                if d == 0:
                    out[1][out[2] + h * G + hd, out[3]] = T.if_then_else(red[1] > ZERO, red[0] + T.log2(red[1]), NEG_INF)

    @T.macro
    def item(q, out, q_rope_position, kv_src, b, h, kv_len, k_pos0, rope_scale, rope_theta, sm_scale, split,
             nsplit, tx):
        qf = T.sblock_alloc_buffer((KK * 8,), dtype, scope="local")
        kr = T.sblock_alloc_buffer((2, KQ), dtype, scope="local")
        vr = T.sblock_alloc_buffer((4, W), dtype, scope="local")
        af = T.sblock_alloc_buffer((8,), dtype, scope="local")
        bf = T.sblock_alloc_buffer((4,), dtype, scope="local")
        sacc = T.sblock_alloc_buffer((8,), "float32", scope="local")
        oacc = T.sblock_alloc_buffer((MT * 4,), "float32", scope="local")
        m2 = T.sblock_alloc_buffer((2,), "float32", scope="local")
        l2 = T.sblock_alloc_buffer((2,), "float32", scope="local")
        alpha = T.sblock_alloc_buffer((4,), "float32", scope="local")
        red = T.sblock_alloc_buffer((4,), "float32", scope="local")
        slots = T.sblock_alloc_buffer((6,), "int32", scope="local")
        sm_m = T.sblock_alloc_buffer((NW, G), "float32", scope="shared")
        sm_l = T.sblock_alloc_buffer((NW, G), "float32", scope="shared")
        sm_o = T.sblock_alloc_buffer((NW, G, DV), "float32", scope="shared")
        w: T.let[T.int32] = tx // 32
        g: T.let[T.int32] = tx % 32 // 4
        t: T.let[T.int32] = tx % 4
        pos: T.let[T.int32] = q_rope_position[b]
        s_lo: T.let[T.int32] = split_rows(span, pos, k_pos0, kv_len, split, nsplit)[0]
        s_hi: T.let[T.int32] = split_rows(span, pos, k_pos0, kv_len, split, nsplit)[1]
        # this warp's chunks: s_lo + (w + NW i) CHUNK for i < steps
        steps: T.let[T.int32] = ceildiv(T.max(ceildiv(T.max(s_hi - s_lo, 0), CHUNK) - w, 0), NW)
        if opening is not None:
            locate_chunk(slots, kv_src, s_lo + w * CHUNK, s_hi, g, t)
            opening()
        # Q fragments (rows g, g + 8: heads of the group, zero past G), k-steps in order
        for kk in T.unroll(KK):
            for x in T.unroll(4):
                qf[kk * 8 + x // 2 * 4 + x % 2] = T.if_then_else(
                    g < G, q[b, h * G + T.min(g, G - 1), t * KQ + kk * 4 + x // 2 * 2 + x % 2], T.Cast(dtype, ZERO))
                qf[kk * 8 + x // 2 * 4 + 2 + x % 2] = T.Cast(dtype, ZERO)
        for hr in T.unroll(2):
            m2[hr] = NEG_INF
            l2[hr] = ZERO
        for x in T.unroll(MT * 4):
            oacc[x] = ZERO
        if opening is None:
            locate_chunk(slots, kv_src, s_lo + w * CHUNK, s_hi, g, t)
        if quantized:  # 8-bit pages: the K scale joins the score scale, the V scale the output's
            kw = T.sblock_alloc_buffer((2, KQ // 4), "uint32", scope="local")
            vw = T.sblock_alloc_buffer((4, W // 4), "uint32", scope="local")
            cw = T.sblock_alloc_buffer((2,), "uint32", scope="local")
            for i in T.serial(steps):
                j0: T.let[T.int32] = s_lo + (w + i * NW) * CHUNK
                load_chunk_fp8(kr, vr, kv_src, h, slots, g, t, kw, vw, cw)
                locate_chunk(slots, kv_src, j0 + NW * CHUNK, s_hi, g, t)
                scores(sacc, qf, kr, af, bf, sm_scale * LOG2E * kv_src[5][0, h] * half_factor, j0, s_hi, t)
                fold(sacc, m2, l2, alpha, red)
                values(oacc, sacc, vr, af, bf, alpha, t)
            merge_warps(out, oacc, m2, l2, sm_m, sm_l, sm_o, red, h, w, g, t, tx, kv_src[5][1, h] * half_factor)
        else:
            for i in T.serial(steps):
                j0: T.let[T.int32] = s_lo + (w + i * NW) * CHUNK
                load_chunk(kr, vr, kv_src, h, slots, g, t)
                # the next chunk's page-table reads are in flight during this chunk's math
                locate_chunk(slots, kv_src, j0 + NW * CHUNK, s_hi, g, t)
                scores(sacc, qf, kr, af, bf, sm_scale * LOG2E, j0, s_hi, t)
                fold(sacc, m2, l2, alpha, red)
                values(oacc, sacc, vr, af, bf, alpha, t)
            merge_warps(out, oacc, m2, l2, sm_m, sm_l, sm_o, red, h, w, g, t, tx, ONE)

    return item
