"""Tensor-core schedule of the prefill tile (CUDA sm_80 and newer, float16 / bfloat16) for what
the ring tile does not take: inline RoPE, token trees, unequal or other head dims.

Warp w computes rows ``[16 w, 16 w + 16)`` with ``mma.sync.m16n8k16``: lane ``4 g + t`` holds rows
g and g + 8, columns 2 t and 2 t + 1 of every 16 x 8 accumulator tile.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from tvm.script import tirx as T

from .macros import LOG2E, NEG_INF, ONE, ZERO, query_position_range
from .schedule import GpuSchedule
from .spec import AttentionSpec

#: accumulator tile of one mma: 16 rows x 8 columns, 4 floats per lane
TILE_N = 8
TILE_K = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class MmaTileShape:
    """A tensor-core tile: ``rows`` query rows (``q_tokens`` tokens x group heads, a multiple
    of 16; one warp per 16), ``kv_chunk`` KV rows per step (a multiple of 16)."""

    rows: int
    q_tokens: int
    kv_chunk: int
    lanes: int
    v_lanes: int

    @property
    def threads(self) -> int:
        return self.rows * 2  # 32 lanes per 16 rows

    @staticmethod
    def choose(spec: AttentionSpec, sched: GpuSchedule) -> Optional["MmaTileShape"]:
        """The shape for ``spec``, or None when the tensor-core tile does not apply (no mma on
        the target, float32, head dims not multiples of 16 / 8, groups wider than 64 rows)."""
        G, D, DV = spec.group_size, spec.qk_head_dim, spec.v_head_dim
        if not sched.mma or spec.dtype not in ("float16", "bfloat16"):
            return None
        if D % TILE_K or DV % TILE_N or G > sched.q_rows:
            return None
        q_tokens, chunk = sched.q_rows // G, 2 * TILE_K

        def rows(tq: int) -> int:  # whole warps of 16 rows
            return -(-tq * G // 16) * 16

        def shared_bytes(tq: int, kc: int) -> int:
            return 2 * (rows(tq) * D + kc * (D + DV))

        while shared_bytes(q_tokens, chunk) > sched.shared_bytes:
            if chunk > TILE_K:
                chunk //= 2
            elif q_tokens > 1:
                q_tokens //= 2
            else:
                return None
        return MmaTileShape(rows=rows(q_tokens), q_tokens=q_tokens, kv_chunk=chunk,
                            lanes=spec.load_lanes(sched.lanes_for(16, D // 2)),
                            v_lanes=spec.load_lanes(sched.lanes_for(16, DV)))


def mma_m16n8k16(dtype: str):
    """``mma(a, b, c, c_tile, a_at=0, b_at=0)``: c[4 c_tile : 4 c_tile + 4] += a (16 x 16) @ b
    (16 x 8) in float32, operands of ``dtype`` (float16 / bfloat16) in per-lane fragment buffers
    starting at elements ``a_at`` / ``b_at``. Offsets other than 0 are for fragments that are
    only written through pointers (``ldmatrix``): TVM may retype a vector-accessed local buffer
    to half2 and scale offsets with it."""
    operand = "fp16" if dtype == "float16" else "bf16"

    def mma(a, b, c, c_tile, a_at=0, b_at=0):
        return T.ptx_legacy.mma("m16n8k16", "row", "col", operand, operand, "fp32", a.data, a_at, b.data, b_at,
                                c.data, c_tile * 4, False, dtype="float32")

    return mma


def ldmatrix_x4(dtype: str):
    """``ldmatrix(frag, smem, offset, trans=..., at=0)``: four 8 x 8 matrices of 16-bit elements
    from shared memory (each lane gives one row's element offset in ``smem``) into the per-lane
    fragment buffer ``frag`` from element ``at``; ``trans``: transposed."""
    def ldmatrix(frag, smem, offset, *, trans: bool, at=0):
        return T.ptx_legacy.ldmatrix(trans, 4, ".b16", frag.data, at, smem.access_ptr("r"), offset, dtype=dtype)

    return ldmatrix


def shfl_xor(x, lane_mask: int):
    """``x`` of the lane whose index differs from this one's by ``lane_mask`` (whole warp)."""
    return T.tvm_warp_shuffle_xor(T.tvm_warp_activemask(), x, lane_mask, 32, 32)


def fold_scores(ns: int):
    """Macro folding a chunk's scores into the online-softmax state of rows g and g + 8, but
    not into the accumulators: ``alpha[hr]`` receives the factor the rows' accumulators must
    be rescaled by (:func:`rescale_rows`).

    ``sacc``: ``ns`` score tiles (log2 units, -inf where masked) in accumulator layout, which
    become p = exp2(s - m); ``m2`` / ``l2``: the rows' running max and this lane's part of
    their sums; ``red``: two floats of scratch.
    """
    @T.macro
    def fold(sacc, m2, l2, alpha, red):
        for hr in T.unroll(2):
            red[0] = m2[hr]
            for nn in T.unroll(ns):
                for e in T.unroll(2):
                    red[0] = T.max(red[0], sacc[nn * 4 + hr * 2 + e])
            red[0] = T.max(red[0], shfl_xor(red[0], 1))
            red[0] = T.max(red[0], shfl_xor(red[0], 2))
            # a row with nothing visible yet has max -inf; it subtracts 0 instead, so that
            # exp2(-inf) = 0 comes out without a branch
            red[1] = T.if_then_else(red[0] == NEG_INF, ZERO, red[0])
            alpha[hr] = T.exp2(m2[hr] - red[1])
            l2[hr] = l2[hr] * alpha[hr]
            for nn in T.unroll(ns):
                for e in T.unroll(2):
                    sacc[nn * 4 + hr * 2 + e] = T.exp2(sacc[nn * 4 + hr * 2 + e] - red[1])
                    l2[hr] = l2[hr] + sacc[nn * 4 + hr * 2 + e]
            m2[hr] = red[0]

    return fold


def rescale_rows(no: int):
    """Macro multiplying ``no`` accumulator tiles' rows g and g + 8 by ``alpha[0]`` / ``alpha[1]``."""
    @T.macro
    def rescale(oacc, alpha):
        for hr in T.unroll(2):
            for nn in T.unroll(no):
                for e in T.unroll(2):
                    oacc[nn * 4 + hr * 2 + e] = oacc[nn * 4 + hr * 2 + e] * alpha[hr]

    return rescale


def online_fold(ns: int, no: int):
    """Macro folding a chunk's scores into the online-softmax state of rows g and g + 8
    (:func:`fold_scores`) and rescaling ``no`` output tiles ``oacc`` accordingly (``alpha``:
    two floats for the rows' factors, ``red`` two of scratch)."""
    fold, rescale = fold_scores(ns), rescale_rows(no)

    @T.macro
    def softmax(sacc, oacc, m2, l2, alpha, red):
        fold(sacc, m2, l2, alpha, red)
        rescale(oacc, alpha)

    return softmax


def make_mma_tile(spec: AttentionSpec, shape: MmaTileShape, io, swizzled):
    """The work item of one block on tensor cores (``io``: the swizzled
    :class:`~.attention_gpu.TileIO` of the tile, ``swizzled``: its column map)."""
    G, D, DV, dtype = spec.group_size, spec.qk_head_dim, spec.v_head_dim, spec.dtype
    R, TQ, KC = shape.rows, shape.q_tokens, shape.kv_chunk
    NS, NO = KC // TILE_N, DV // TILE_N  # score / output n-tiles of a warp
    visible, chunk_range, load_q = io.visible, io.chunk_range, io.load_q
    fetch_kv, store_kv = io.fetch_kv, io.store_kv
    KREG, VREG = io.kv_registers

    def qcol(row, d):
        return swizzled(row, d, D)

    def vcol(row, d):
        return swizzled(row, d, DV)

    mma, shfl, softmax = mma_m16n8k16(dtype), shfl_xor, online_fold(NS, NO)

    @T.macro
    def qk(sacc, qs, ks, af, bf, row0, g, t):
        """sacc = Q[row0 : row0 + 16] @ K_chunk^T (NS tiles of 16 x 8)."""
        for x in T.unroll(NS * 4):
            sacc[x] = ZERO
        for kk in T.unroll(D // TILE_K):
            for x in T.vectorized(2):
                af[x] = qs[row0 + g, qcol(row0 + g, kk * TILE_K + 2 * t) + x]
                af[2 + x] = qs[row0 + g + 8, qcol(row0 + g + 8, kk * TILE_K + 2 * t) + x]
                af[4 + x] = qs[row0 + g, qcol(row0 + g, kk * TILE_K + 8 + 2 * t) + x]
                af[6 + x] = qs[row0 + g + 8, qcol(row0 + g + 8, kk * TILE_K + 8 + 2 * t) + x]
            for nn in T.unroll(NS):
                for x in T.vectorized(2):
                    bf[x] = ks[nn * TILE_N + g, qcol(nn * TILE_N + g, kk * TILE_K + 2 * t) + x]
                    bf[2 + x] = ks[nn * TILE_N + g, qcol(nn * TILE_N + g, kk * TILE_K + 8 + 2 * t) + x]
                T.evaluate(mma(af, bf, sacc, nn))

    @T.macro
    def mask(sacc, scale, j0, nt, nq, vis_src, row0, g, t):
        """Scale the scores; -inf where (row, key) is invisible, past the chunk or past nq."""
        for nn in T.unroll(NS):
            for e in T.unroll(4):
                sacc[nn * 4 + e] = T.if_then_else(
                    T.And(T.And(nn * TILE_N + 2 * t + e % 2 < nt, (row0 + g + e // 2 * 8) // G < nq),
                          visible(vis_src[0], vis_src[1], vis_src[2], vis_src[3], vis_src[4], vis_src[5],
                                  vis_src[6], vis_src[7] + T.min((row0 + g + e // 2 * 8) // G, nq - 1),
                                  T.min(j0 + nn * TILE_N + 2 * t + e % 2, vis_src[4] - 1))),
                    sacc[nn * 4 + e] * scale, NEG_INF)

    @T.macro
    def pv(oacc, sacc, vs, pf, vf, g, t):
        """oacc += P (16 x KC, from the score registers) @ V_chunk."""
        for kk in T.unroll(KC // TILE_K):
            for e in T.unroll(4):
                pf[e] = T.Cast(dtype, sacc[2 * kk * 4 + e])
                pf[4 + e] = T.Cast(dtype, sacc[(2 * kk + 1) * 4 + e])
            for nn in T.unroll(NO):
                vf[0] = vs[kk * TILE_K + 2 * t, vcol(kk * TILE_K + 2 * t, nn * TILE_N + g)]
                vf[1] = vs[kk * TILE_K + 2 * t + 1, vcol(kk * TILE_K + 2 * t + 1, nn * TILE_N + g)]
                vf[2] = vs[kk * TILE_K + 8 + 2 * t, vcol(kk * TILE_K + 8 + 2 * t, nn * TILE_N + g)]
                vf[3] = vs[kk * TILE_K + 9 + 2 * t, vcol(kk * TILE_K + 9 + 2 * t, nn * TILE_N + g)]
                T.evaluate(mma(pf, vf, oacc, nn))

    @T.macro
    def store(out, oacc, m2, l2, h, qbeg, tile0, nq, row0, g, t):
        for hr in T.unroll(2):
            l2[hr] = l2[hr] + shfl(l2[hr], 1)
            l2[hr] = l2[hr] + shfl(l2[hr], 2)
        for hr in T.unroll(2):
            if (row0 + g + hr * 8) // G < nq:
                for nn in T.unroll(NO):
                    for e in T.unroll(2):
                        out[0][qbeg + tile0 + (row0 + g + hr * 8) // G, h * G + (row0 + g + hr * 8) % G,
                               nn * TILE_N + 2 * t + e] = T.Cast(dtype, oacc[nn * 4 + hr * 2 + e] * T.if_then_else(
                                   l2[hr] > ZERO, ONE / l2[hr], ZERO))
                if t == 0:
                    out[1][qbeg + tile0 + (row0 + g + hr * 8) // G, h * G + (row0 + g + hr * 8) % G] = T.if_then_else(
                        l2[hr] > ZERO, m2[hr] + T.log2(l2[hr]), NEG_INF)

    @T.macro
    def attend_tile(q, out, q_rope_position, kv_src, h, qbeg, q_len, tile0, kv_len, k_pos0, causal,
                    rotary_mode, rope_scale, rope_theta, sm_scale, tree_src, active, tx):
        qs = T.sblock_alloc_buffer((R, D), dtype, scope="shared")
        ks = T.sblock_alloc_buffer((KC, D), dtype, scope="shared")
        vs = T.sblock_alloc_buffer((KC, DV), dtype, scope="shared")
        kreg = T.sblock_alloc_buffer(KREG, dtype, scope="local")
        vreg = T.sblock_alloc_buffer(VREG, dtype, scope="local")
        sacc = T.sblock_alloc_buffer((NS * 4,), "float32", scope="local")
        oacc = T.sblock_alloc_buffer((NO * 4,), "float32", scope="local")
        af = T.sblock_alloc_buffer((8,), dtype, scope="local")
        bf = T.sblock_alloc_buffer((4,), dtype, scope="local")
        pf = T.sblock_alloc_buffer((8,), dtype, scope="local")
        vf = T.sblock_alloc_buffer((4,), dtype, scope="local")
        m2 = T.sblock_alloc_buffer((2,), "float32", scope="local")
        l2 = T.sblock_alloc_buffer((2,), "float32", scope="local")
        red = T.sblock_alloc_buffer((2,), "float32", scope="local")
        alpha = T.sblock_alloc_buffer((2,), "float32", scope="local")
        bounds = T.sblock_alloc_buffer((2,), "int32", scope="local")
        row0: T.let[T.int32] = tx // 32 * 16
        g: T.let[T.int32] = tx % 32 // 4
        t: T.let[T.int32] = tx % 4
        nq: T.let[T.int32] = T.if_then_else(active, T.min(TQ, q_len - tile0), 0)
        if spec.is_local:
            query_position_range(bounds, q_rope_position, qbeg + tile0, nq)
        c_lo, c_end = chunk_range(q_rope_position, qbeg, tile0, nq, q_len, kv_len, k_pos0, causal, bounds)
        c_hi: T.let[T.int32] = T.if_then_else(active, c_end, c_lo)
        load_q(qs, q, q_rope_position, h, qbeg, tile0, nq, rotary_mode, rope_scale, rope_theta, tx)
        for hr in T.unroll(2):
            m2[hr] = NEG_INF
            l2[hr] = ZERO
        for x in T.unroll(NO * 4):
            oacc[x] = ZERO
        # explicit barrier: the chunk loop (where the planner puts its own) may run zero times
        T.evaluate(T.tvm_storage_sync("shared"))
        # software pipeline: chunk c + 1 is fetched into registers while chunk c is computed
        if c_lo < c_hi:
            fetch_kv(kreg, vreg, kv_src, h, c_lo * KC, T.min(KC, kv_len - c_lo * KC), tx)
        for c in T.serial(c_lo, T.max(c_hi, c_lo)):
            nt: T.let[T.int32] = T.min(KC, kv_len - c * KC)
            store_kv(ks, vs, kreg, vreg, c * KC, k_pos0, rotary_mode, rope_scale, rope_theta, tx)
            T.evaluate(T.tvm_storage_sync("shared"))
            if c + 1 < c_hi:
                fetch_kv(kreg, vreg, kv_src, h, (c + 1) * KC, T.min(KC, kv_len - (c + 1) * KC), tx)
            qk(sacc, qs, ks, af, bf, row0, g, t)
            mask(sacc, sm_scale * LOG2E, c * KC, nt, nq,
                 (q_rope_position, tree_src, qbeg, q_len, kv_len, k_pos0, causal, tile0), row0, g, t)
            softmax(sacc, oacc, m2, l2, alpha, red)
            pv(oacc, sacc, vs, pf, vf, g, t)
        store(out, oacc, m2, l2, h, qbeg, tile0, nq, row0, g, t)

    return attend_tile
