"""GPU schedule of the attention algorithm of :mod:`.attention`: prefill tiles and the grids.

A prefill work item is a thread block over (query tile, KV head); :class:`TileIO` holds what the
tiles share (this module's CUDA-core :func:`make_tile`, :mod:`.attention_gpu_mma`,
:mod:`.attention_gpu_wgmma`). Design: ``docs/kernels.md``.
"""

from __future__ import annotations

import dataclasses

from tvm import tirx
from tvm.script import tirx as T

from .macros import LOG2E, NEG_INF, ONE, ZERO, ceildiv, query_position_range, rope_inv_freq_expr
from .attention_gpu_mma import MmaTileShape, make_mma_tile
from .attention_gpu_wgmma import WgmmaTileShape, make_wgmma_tile
from .schedule import GpuSchedule
from .spec import AttentionSpec


def _bits(dtype: str) -> int:
    return 32 if dtype == "float32" else 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class TileShape:
    """How one block's threads cover a tile.

    ``rows = max(q_tokens * group, 2)`` query rows, ``kv_chunk`` KV rows per step, ``threads``
    threads.
    Scores: thread ``tx`` owns rows ``tx // s_col_groups + i * s_row_groups`` (i < s_rows) and
    columns ``tx % s_col_groups + j * s_col_groups`` (j < s_cols). Output: thread ``tx`` owns rows
    ``tx // o_col_groups + i * o_row_groups`` (i < o_rows) and head_dim columns
    ``(tx % o_col_groups) * o_cols + x`` (x < o_cols). ``lanes`` / ``v_lanes``: elements per
vector load of K (half rows, for RoPE pairs) / V rows.
    """

    rows: int
    q_tokens: int
    kv_chunk: int
    threads: int
    s_row_groups: int
    s_col_groups: int
    s_rows: int
    s_cols: int
    o_row_groups: int
    o_col_groups: int
    o_rows: int
    o_cols: int
    lanes: int
    v_lanes: int

    @staticmethod
    def choose(spec: AttentionSpec, sched: GpuSchedule) -> "TileShape":
        G, D, DV = spec.group_size, spec.qk_head_dim, spec.v_head_dim
        elem = sched.bfloat16_shared_bytes if spec.dtype == "bfloat16" else _bits(spec.dtype) // 8
        q_tokens = max(1, sched.q_rows // G)
        chunk = sched.kv_chunk

        def shared_bytes(tq: int, kc: int) -> int:
            rows = max(tq * G, 2)
            return (rows * D + kc * (D + DV)) * elem + rows * kc * 4 + 3 * rows * 4

        while shared_bytes(q_tokens, chunk) > sched.shared_bytes:
            if chunk > 16:
                chunk //= 2
            elif q_tokens > 1:
                q_tokens //= 2
            else:
                raise ValueError(f"attention tile does not fit in shared memory: head_dim {D}/{DV}, "
                                 f"group {G}, dtype {spec.dtype}")
        # at least 2 rows: with one, TVM's simplifier folds the row index to a constant and its
        # barrier planner can no longer prove a row's thread rereads only its own values
        rows, threads = max(q_tokens * G, 2), sched.threads
        s_rg = min(rows, threads // min(chunk, 8))
        s_cg = threads // s_rg
        lanes = spec.load_lanes(sched.lanes_for(_bits(spec.dtype), D // 2))
        o_cols = sched.lanes_for(_bits(spec.dtype), DV)
        while o_cols > 1 and ceildiv(DV, o_cols) * rows < threads:
            o_cols //= 2
        o_cg = ceildiv(DV, o_cols)
        o_rg = max(1, threads // o_cg)
        return TileShape(rows=rows, q_tokens=q_tokens, kv_chunk=chunk, threads=threads,
                         s_row_groups=s_rg, s_col_groups=s_cg, s_rows=ceildiv(rows, s_rg),
                         s_cols=ceildiv(chunk, s_cg), o_row_groups=o_rg, o_col_groups=o_cg,
                         o_rows=ceildiv(rows, o_rg), o_cols=o_cols, lanes=lanes,
                         v_lanes=spec.load_lanes(sched.lanes_for(_bits(spec.dtype), DV)))


def swizzled(row, d, width: int):
    """Column of element (row, d) in a ``width``-wide shared tile whose 8-element (16-byte)
    pieces are XOR-permuted by row: ``d ^ (row % S) * 8`` with S the largest power of two <= 8
    dividing ``width / 8`` (elements within a piece keep their order; needs ``width % 8 == 0``)."""
    pieces = width // 8
    span = 1
    while span < 8 and pieces % (2 * span) == 0:
        span *= 2
    return T.bitwise_xor(d, row % span * 8) if span > 1 else d


@dataclasses.dataclass(frozen=True)
class TileIO:
    """What every prefill tile schedule shares: which (query, key) pairs are visible, which KV
    chunks a tile visits, and the staging of the query tile and of KV chunks in shared memory.

    ``visible(q_rope_position, tree_src, qbeg, q_len, kv_len, k_pos0, causal, qi, j)``: does
    query token qi of the sequence see KV row j. ``chunk_range(...)``: (first, end) chunk.
    ``load_q`` / ``load_kv``: macros filling ``qs[r, :D]`` / ``ks[t, :D]``, ``vs[t, :DV]``;
    ``load_kv`` is ``fetch_kv`` (global -> per-thread registers of shapes ``kv_registers``)
    then ``store_kv`` (registers -> shared), which a pipelined tile calls apart.
    """

    visible: object
    chunk_range: object
    load_q: object
    load_kv: object
    fetch_kv: object
    store_kv: object
    kv_registers: tuple


def tile_io(spec: AttentionSpec, *, rows: int, kv_chunk: int, threads: int, lanes: int, v_lanes: int,
            kv_elem, tree: bool, swizzle: bool = False) -> TileIO:
    """The shared pieces of a tile of ``rows`` query rows staging ``kv_chunk`` KV rows with
    ``threads`` threads (``lanes`` / ``v_lanes``: elements per vector load of K half rows / V rows).

    ``kv_elem(kv_src, h, j, kv, d)`` reads element d of KV row j (kv 0 = K, 1 = V). With
    ``swizzle`` element (row, d) of ``qs`` / ``ks`` / ``vs`` is stored at column
    :func:`swizzled` ``(row, d, width)`` (16-byte pieces XOR-permuted per row, so that reads of
    one column by 8 consecutive rows hit different banks).
    """
    G, D, DV, dtype = spec.group_size, spec.qk_head_dim, spec.v_head_dim, spec.dtype
    R, KC, NT = rows, kv_chunk, threads
    half, span = D // 2, spec.span
    n_qvec = half // lanes
    n_vvec = DV // v_lanes

    def qk_col(row, d):
        return swizzled(row, d, D) if swizzle else d

    def v_col(row, d):
        return swizzled(row, d, DV) if swizzle else d

    def visible(q_rope_position, tree_src, qbeg, q_len, kv_len, k_pos0, causal, qi, j):
        """Does query token qi (of the sequence) see KV row j?"""
        if tree:
            tree_start = kv_len - tree_src[2]
            node_q = tree_src[1] + tree_src[2] - q_len + qi
            node_k = tree_src[1] + j - tree_start
            return T.if_then_else(
                j < tree_start, tirx.const(True, "bool"),
                T.And(tree_src[0][node_k, 0] <= tree_src[0][node_q, 0],
                      tree_src[0][node_q, 0] < tree_src[0][node_k, 1]))
        if span:
            q_pos = q_rope_position[qbeg + qi]
            lower = k_pos0 + j >= span.first_visible(q_pos)
            return T.if_then_else(causal > 0, T.And(lower, k_pos0 + j <= q_pos), lower)
        return T.Or(causal == 0, j <= kv_len - q_len + qi)

    def rope_angle(pos, d, rope_scale, rope_theta):
        return T.Cast("float32", pos) * rope_inv_freq_expr(d, D, rope_scale, rope_theta)

    @T.macro
    def load_q(qs, q, q_rope_position, h, qbeg, tile0, nq, rotary_mode, rope_scale, rope_theta, tx):
        """qs[r] = query (token tile0 + r // G, head h * G + r % G), RoPE'd; zeros past ``nq``
        tokens. (Not pre-scaled: the scores are scaled in float32, so q loses no precision.)"""
        for it in T.unroll(ceildiv(R * n_qvec, NT)):
            if it * NT + tx < R * n_qvec:
                r: T.let[T.int32] = (it * NT + tx) // n_qvec
                d0: T.let[T.int32] = (it * NT + tx) % n_qvec * lanes
                tok: T.let[T.int32] = qbeg + tile0 + r // G
                if r // G < nq:
                    if rotary_mode == 1:
                        for x in T.serial(lanes):
                            angle: T.let[T.float32] = rope_angle(q_rope_position[tok], d0 + x, rope_scale, rope_theta)
                            qs[r, qk_col(r, d0) + x] = T.Cast(dtype, (
                                T.Cast("float32", q[tok, h * G + r % G, d0 + x]) * T.cos(angle)
                                - T.Cast("float32", q[tok, h * G + r % G, d0 + x + half]) * T.sin(angle)))
                            qs[r, qk_col(r, d0 + half) + x] = T.Cast(dtype, (
                                T.Cast("float32", q[tok, h * G + r % G, d0 + x + half]) * T.cos(angle)
                                + T.Cast("float32", q[tok, h * G + r % G, d0 + x]) * T.sin(angle)))
                    else:
                        for x in T.vectorized(lanes):
                            qs[r, qk_col(r, d0) + x] = q[tok, h * G + r % G, d0 + x]
                        for x in T.vectorized(lanes):
                            qs[r, qk_col(r, d0 + half) + x] = q[tok, h * G + r % G, d0 + x + half]
                else:
                    for x in T.vectorized(lanes):
                        qs[r, qk_col(r, d0) + x] = T.Cast(dtype, ZERO)
                    for x in T.vectorized(lanes):
                        qs[r, qk_col(r, d0 + half) + x] = T.Cast(dtype, ZERO)

    K_IT, V_IT = ceildiv(KC * n_qvec, NT), ceildiv(KC * n_vvec, NT)

    @T.macro
    def fetch_kv(kreg, vreg, kv_src, h, j0, nt, tx):
        """Registers of this thread's pieces of K/V rows ``j0 + t`` (zeros past ``nt`` rows):
        ``kreg (K_IT, 2, lanes)`` (both halves of a RoPE pair), ``vreg (V_IT, v_lanes)``. Only
        loads, so that the global reads stay in flight until :func:`store_kv` uses them."""
        for it in T.unroll(K_IT):
            if T.And(it * NT + tx < KC * n_qvec, (it * NT + tx) // n_qvec < nt):
                for x in T.vectorized(lanes):
                    kreg[it, 0, x] = kv_elem(kv_src, h, j0 + (it * NT + tx) // n_qvec, 0,
                                             (it * NT + tx) % n_qvec * lanes + x)
                for x in T.vectorized(lanes):
                    kreg[it, 1, x] = kv_elem(kv_src, h, j0 + (it * NT + tx) // n_qvec, 0,
                                             (it * NT + tx) % n_qvec * lanes + half + x)
            else:
                for x in T.vectorized(lanes):
                    kreg[it, 0, x] = T.Cast(dtype, ZERO)
                for x in T.vectorized(lanes):
                    kreg[it, 1, x] = T.Cast(dtype, ZERO)
        for it in T.unroll(V_IT):
            if T.And(it * NT + tx < KC * n_vvec, (it * NT + tx) // n_vvec < nt):
                for x in T.vectorized(v_lanes):
                    vreg[it, x] = kv_elem(kv_src, h, j0 + (it * NT + tx) // n_vvec, 1, (it * NT + tx) % n_vvec * v_lanes + x)
            else:
                for x in T.vectorized(v_lanes):
                    vreg[it, x] = T.Cast(dtype, ZERO)

    @T.macro
    def store_kv(ks, vs, kreg, vreg, j0, k_pos0, rotary_mode, rope_scale, rope_theta, tx):
        """ks/vs[t] = what :func:`fetch_kv` put in this thread's registers, K RoPE'd at
        ``k_pos0 + j0 + t`` with inline RoPE."""
        for it in T.unroll(K_IT):
            t: T.let[T.int32] = (it * NT + tx) // n_qvec
            d0: T.let[T.int32] = (it * NT + tx) % n_qvec * lanes
            if it * NT + tx < KC * n_qvec:
                if rotary_mode == 1:
                    for x in T.unroll(lanes):  # unrolled: kreg stays in registers
                        angle: T.let[T.float32] = rope_angle(k_pos0 + j0 + t, d0 + x, rope_scale, rope_theta)
                        ks[t, qk_col(t, d0) + x] = T.Cast(dtype, T.Cast("float32", kreg[it, 0, x]) * T.cos(angle)
                                                          - T.Cast("float32", kreg[it, 1, x]) * T.sin(angle))
                        ks[t, qk_col(t, d0 + half) + x] = T.Cast(
                            dtype, T.Cast("float32", kreg[it, 1, x]) * T.cos(angle)
                            + T.Cast("float32", kreg[it, 0, x]) * T.sin(angle))
                else:
                    for x in T.vectorized(lanes):
                        ks[t, qk_col(t, d0) + x] = kreg[it, 0, x]
                    for x in T.vectorized(lanes):
                        ks[t, qk_col(t, d0 + half) + x] = kreg[it, 1, x]
        for it in T.unroll(V_IT):
            if it * NT + tx < KC * n_vvec:
                for x in T.vectorized(v_lanes):
                    vs[(it * NT + tx) // n_vvec, v_col((it * NT + tx) // n_vvec, (it * NT + tx) % n_vvec * v_lanes) + x] = \
                        vreg[it, x]

    @T.macro
    def load_kv(ks, vs, kreg, vreg, kv_src, h, j0, nt, k_pos0, rotary_mode, rope_scale, rope_theta, tx):
        """ks/vs[t] = K/V row j0 + t (K RoPE'd at k_pos0 + j0 + t); zeros past ``nt`` rows."""
        fetch_kv(kreg, vreg, kv_src, h, j0, nt, tx)
        store_kv(ks, vs, kreg, vreg, j0, k_pos0, rotary_mode, rope_scale, rope_theta, tx)

    def chunk_range(q_rope_position, qbeg, tile0, nq, q_len, kv_len, k_pos0, causal, bounds):
        """(first, end) chunk indices a tile must visit (bounds: query position (min, max))."""
        if tree:
            return 0, ceildiv(kv_len, KC)
        if span:
            row_lo = T.max(span.first_visible(bounds[0]) - k_pos0, 0)
            row_hi = T.if_then_else(causal > 0, T.max(T.min(kv_len, bounds[1] - k_pos0 + 1), 0), kv_len)
            return row_lo // KC, T.max(ceildiv(row_hi, KC), row_lo // KC)
        visible_rows = T.max(kv_len - q_len + tile0 + nq, 0)
        return 0, T.if_then_else(causal > 0, T.min(ceildiv(kv_len, KC), ceildiv(visible_rows, KC)),
                                 ceildiv(kv_len, KC))

    return TileIO(visible=visible, chunk_range=chunk_range, load_q=load_q, load_kv=load_kv, fetch_kv=fetch_kv,
                  store_kv=store_kv, kv_registers=((K_IT, 2, lanes), (V_IT, v_lanes)))


def make_tile(spec: AttentionSpec, shape: TileShape, kv_elem, *, tree: bool = False):
    """The work item of one block on CUDA cores: a query tile against its KV chunks.

    ``kv_elem(kv_src, h, j, kv, d)`` reads element d of KV row j (kv 0 = K, 1 = V); the
    normalised rows go to ``out = (o, lse)`` at ``[token, head]``.
    """
    G, D, DV, dtype = spec.group_size, spec.qk_head_dim, spec.v_head_dim, spec.dtype
    R, TQ, KC, NT = shape.rows, shape.q_tokens, shape.kv_chunk, shape.threads
    SRG, SCG, SRM, SCM = shape.s_row_groups, shape.s_col_groups, shape.s_rows, shape.s_cols
    ORG, OCG, ORM, OCM = shape.o_row_groups, shape.o_col_groups, shape.o_rows, shape.o_cols
    rot = 4 // (_bits(dtype) // 8)  # head_dim elements per 32-bit bank word, lane-rotated reads
    io = tile_io(spec, rows=R, kv_chunk=KC, threads=NT, lanes=shape.lanes, v_lanes=shape.v_lanes,
                 kv_elem=kv_elem, tree=tree)
    visible, chunk_range, load_q, load_kv = io.visible, io.chunk_range, io.load_q, io.load_kv
    KREG, VREG = io.kv_registers

    @T.macro
    def scores(s, qs, ks, sc, j0, nt, nq, vis_src, scale, tx):
        """s[r, t] = scale * qs[r] . ks[t] for visible (row, key) pairs, -inf elsewhere."""
        for i in T.unroll(SRM):
            for jj in T.unroll(SCM):
                sc[i, jj] = ZERO
        for d in T.serial(D):
            for i in T.unroll(SRM):
                for jj in T.unroll(SCM):
                    sc[i, jj] = sc[i, jj] + T.Cast(
                        "float32", qs[T.min(tx // SCG + i * SRG, R - 1), (d + tx % 32 * rot) % D]) * T.Cast(
                        "float32", ks[T.min(tx % SCG + jj * SCG, KC - 1), (d + tx % 32 * rot) % D])
        for i in T.unroll(SRM):
            for jj in T.unroll(SCM):
                if tx // SCG + i * SRG < R and tx % SCG + jj * SCG < KC:
                    s[tx // SCG + i * SRG, tx % SCG + jj * SCG] = T.if_then_else(
                        T.And(T.And(tx % SCG + jj * SCG < nt, (tx // SCG + i * SRG) // G < nq),
                              visible(vis_src[0], vis_src[1], vis_src[2], vis_src[3], vis_src[4], vis_src[5],
                                      vis_src[6], vis_src[7] + T.min((tx // SCG + i * SRG) // G, nq - 1),
                                      T.min(j0 + tx % SCG + jj * SCG, vis_src[4] - 1))),
                        sc[i, jj] * scale, NEG_INF)

    @T.macro
    def softmax_rows(s, m, l, alpha, red, tx):
        """Fold the chunk's scores into each row's (m, l); s becomes exp2(s - m_new).

        Row guards sit inside the loops so that barriers never land inside a condition."""
        for it in T.serial(ceildiv(R, NT)):
            row: T.let[T.int32] = T.min(it * NT + tx, R - 1)
            red[0] = m[row]
            for t in T.serial(KC):
                red[0] = T.max(red[0], s[row, t])
            red[1] = ZERO
            # inside the guards index by it * NT + tx (not the clamped row): the barrier planner
            # must see that each thread rereads only what it wrote itself
            for t in T.serial(KC):
                if it * NT + tx < R:
                    p: T.let[T.float32] = T.if_then_else(red[0] == NEG_INF, ZERO,
                                                         T.exp2(s[it * NT + tx, t] - red[0]))
                    s[it * NT + tx, t] = p
                    red[1] = red[1] + p
            if it * NT + tx < R:
                alpha[it * NT + tx] = T.if_then_else(m[it * NT + tx] == red[0], ONE, T.exp2(m[it * NT + tx] - red[0]))
                l[it * NT + tx] = l[it * NT + tx] * alpha[it * NT + tx] + red[1]
                m[it * NT + tx] = red[0]

    @T.macro
    def accumulate(acc, s, vs, alpha, nt, tx):
        """acc = acc * alpha + p @ V over the chunk's ``nt`` rows."""
        for i in T.unroll(ORM):
            if tx // OCG + i * ORG < R:
                for x in T.unroll(OCM):
                    acc[i, x] = acc[i, x] * alpha[tx // OCG + i * ORG]
                for t in T.serial(nt):
                    for x in T.unroll(OCM):
                        acc[i, x] = acc[i, x] + s[tx // OCG + i * ORG, t] * T.Cast(
                            "float32", vs[t, T.min(tx % OCG * OCM + x, DV - 1)])

    @T.macro
    def store(out, acc, m, l, h, qbeg, tile0, nq, tx):
        for i in T.unroll(ORM):
            if tx // OCG + i * ORG < R:
                if (tx // OCG + i * ORG) // G < nq:
                    for x in T.unroll(OCM):
                        if tx % OCG * OCM + x < DV:
                            out[0][qbeg + tile0 + (tx // OCG + i * ORG) // G, h * G + (tx // OCG + i * ORG) % G,
                                   tx % OCG * OCM + x] = T.Cast(dtype, acc[i, x] * T.if_then_else(
                                       l[tx // OCG + i * ORG] > ZERO, ONE / l[tx // OCG + i * ORG], ZERO))
                    if tx % OCG == 0:
                        out[1][qbeg + tile0 + (tx // OCG + i * ORG) // G, h * G + (tx // OCG + i * ORG) % G] = \
                            T.if_then_else(l[tx // OCG + i * ORG] > ZERO,
                                           m[tx // OCG + i * ORG] + T.log2(l[tx // OCG + i * ORG]), NEG_INF)

    @T.macro
    def attend_tile(q, out, q_rope_position, kv_src, h, qbeg, q_len, tile0, kv_len, k_pos0, causal,
                    rotary_mode, rope_scale, rope_theta, sm_scale, tree_src, active, tx):
        qs = T.sblock_alloc_buffer((R, D), dtype, scope="shared")
        ks = T.sblock_alloc_buffer((KC, D), dtype, scope="shared")
        vs = T.sblock_alloc_buffer((KC, DV), dtype, scope="shared")
        s = T.sblock_alloc_buffer((R, KC), "float32", scope="shared")
        m = T.sblock_alloc_buffer((R,), "float32", scope="shared")
        l = T.sblock_alloc_buffer((R,), "float32", scope="shared")
        alpha = T.sblock_alloc_buffer((R,), "float32", scope="shared")
        kreg = T.sblock_alloc_buffer(KREG, dtype, scope="local")
        vreg = T.sblock_alloc_buffer(VREG, dtype, scope="local")
        acc = T.sblock_alloc_buffer((ORM, OCM), "float32", scope="local")
        sc = T.sblock_alloc_buffer((SRM, SCM), "float32", scope="local")
        red = T.sblock_alloc_buffer((2,), "float32", scope="local")
        bounds = T.sblock_alloc_buffer((2,), "int32", scope="local")
        nq: T.let[T.int32] = T.if_then_else(active, T.min(TQ, q_len - tile0), 0)
        if spec.is_local:
            query_position_range(bounds, q_rope_position, qbeg + tile0, nq)
        c_lo, c_end = chunk_range(q_rope_position, qbeg, tile0, nq, q_len, kv_len, k_pos0, causal, bounds)
        c_hi: T.let[T.int32] = T.if_then_else(active, c_end, c_lo)
        load_q(qs, q, q_rope_position, h, qbeg, tile0, nq, rotary_mode, rope_scale, rope_theta, tx)
        for it in T.serial(ceildiv(R, NT)):
            if it * NT + tx < R:
                m[it * NT + tx] = NEG_INF
                l[it * NT + tx] = ZERO
        for i in T.unroll(ORM):
            for x in T.unroll(OCM):
                acc[i, x] = ZERO
        # explicit barrier: the planner puts its own inside the chunk loop, which may run zero
        # times (an empty split, a row with no keys), and the store reads other threads' m, l
        T.evaluate(T.tvm_storage_sync("shared"))
        for c in T.serial(c_lo, T.max(c_hi, c_lo)):
            nt: T.let[T.int32] = T.min(KC, kv_len - c * KC)
            load_kv(ks, vs, kreg, vreg, kv_src, h, c * KC, nt, k_pos0, rotary_mode, rope_scale, rope_theta, tx)
            scores(s, qs, ks, sc, c * KC, nt, nq,
                   (q_rope_position, tree_src, qbeg, q_len, kv_len, k_pos0, causal, tile0), sm_scale * LOG2E, tx)
            softmax_rows(s, m, l, alpha, red, tx)
            accumulate(acc, s, vs, alpha, nt, tx)
        store(out, acc, m, l, h, qbeg, tile0, nq, tx)

    return attend_tile


def heads_fastest_tokens(spec: AttentionSpec, sched: GpuSchedule) -> int:
    """Mean query tokens per sequence up to which a prefill grid runs a tile's KV heads side by
    side: ``sched.prefill_heads_fastest_bytes`` over the K/V bytes of one token's KV heads."""
    row_bytes = spec.num_kv_heads * (spec.qk_head_dim + spec.v_head_dim) * (8 if spec.quantized else 16) // 8
    return sched.prefill_heads_fastest_bytes // row_bytes


@T.macro
def find_tile(qo_indptr, batch, tile_id, q_tokens: T.int32, found):
    """found = (sequence, first token of the tile in it) of the ``tile_id``-th tile of
    ``q_tokens`` tokens, counting each sequence's tiles in order; sequence -1 past the end."""
    found[0] = -1
    found[1] = 0
    found[2] = 0
    for b in T.serial(batch):
        if found[0] == -1:
            if tile_id < found[2] + ceildiv(qo_indptr[b + 1] - qo_indptr[b], q_tokens):
                found[0] = b
                found[1] = (tile_id - found[2]) * q_tokens
            found[2] = found[2] + ceildiv(qo_indptr[b + 1] - qo_indptr[b], q_tokens)


def prefill_grid(spec: AttentionSpec, sched: GpuSchedule, kv_elem, seq_src, *, tree: bool = False, kv_rows=None):
    """Macro running the tile over every (query tile, KV head) of a prefill batch.

    ``seq_src(bufs, b)`` returns the tile arguments of sequence b, ``(kv_src, kv_len, k_pos0,
    tree_src)``, from the kernel's buffers ``bufs`` (a tuple the macro is given). Where the
    warpgroup-MMA tile applies (sm_90a, no token tree; ``kv_rows``: the KV rows' ``(locate,
    elem_at, elem_new)``, :func:`~.macros.paged_kv_rows`) the kernel holds it and the
    ``mma.sync`` tile, and runs the first unless RoPE is inline (``rotary_mode == 1``).
    """
    mma_shape = MmaTileShape.choose(spec, sched)
    if mma_shape is not None:
        shape = mma_shape
        io = tile_io(spec, rows=shape.rows, kv_chunk=shape.kv_chunk, threads=shape.threads, lanes=shape.lanes,
                     v_lanes=shape.v_lanes, kv_elem=kv_elem, tree=tree, swizzle=True)
        tile = make_mma_tile(spec, shape, io, swizzled)
    else:
        shape = TileShape.choose(spec, sched)
        tile = make_tile(spec, shape, kv_elem, tree=tree)
    tokens = heads_fastest_tokens(spec, sched)  # the tensor-core grids' block order
    across = tokens if mma_shape is not None else 0
    grid = _tile_grid(spec, seq_src, tile, shape.q_tokens, shape.threads, heavy_first=across > 0,
                      heads_fastest_tokens=across)
    wg_shape = None if tree or kv_rows is None else WgmmaTileShape.choose(spec, sched, one_source=kv_rows[2] is None)
    if wg_shape is None:
        return grid
    io = tile_io(spec, rows=wg_shape.rows, kv_chunk=wg_shape.kv_chunk, threads=wg_shape.threads, lanes=8,
                 v_lanes=8, kv_elem=kv_elem, tree=False)
    wg_grid = _tile_grid(spec, seq_src, make_wgmma_tile(spec, wg_shape, io, kv_rows), wg_shape.q_tokens,
                         wg_shape.threads, heavy_first=True, heads_fastest_tokens=tokens)

    @T.macro
    def run(q, o, lse, q_rope_position, qo_indptr, batch, total_q, bufs, causal, rotary_mode,
            rope_scale, rope_theta, sm_scale):
        # loops of 0 / 1 trips, not an `if`: TVM's barrier planner refuses kernels inside conditions
        for _inline in T.serial(T.if_then_else(rotary_mode == 1, 1, 0)):
            grid(q, o, lse, q_rope_position, qo_indptr, batch, total_q, bufs, causal, rotary_mode, rope_scale,
                 rope_theta, sm_scale)
        for _plain in T.serial(T.if_then_else(rotary_mode == 1, 0, 1)):
            wg_grid(q, o, lse, q_rope_position, qo_indptr, batch, total_q, bufs, causal, rotary_mode, rope_scale,
                    rope_theta, sm_scale)

    return run


def _tile_grid(spec: AttentionSpec, seq_src, tile, TQ: int, NT: int, *, heavy_first: bool,
               heads_fastest_tokens: int = 0):
    """Macro launching ``tile`` on blocks of ``NT`` threads over (tile of ``TQ`` query tokens,
    KV head). ``heavy_first``: blocks take the tiles in reverse order, so that the last tiles
    of causal sequences, which see the most keys, start first. ``heads_fastest_tokens`` (0:
    never): where the sequences average at most this many query tokens, consecutive blocks take
    one tile's KV heads, so that (with ``heavy_first``) the heaviest tiles of every head start
    before any lighter one; else they go head by head, each head's K/V reused from L2 by its
    tiles."""
    Hkv = spec.num_kv_heads

    @T.macro
    def body(q, o, lse, q_rope_position, qo_indptr, batch, total_q, bufs, causal, rotary_mode,
             rope_scale, rope_theta, sm_scale, bx, by, tx):
        with T.sblock("work"):
            T.reads()
            T.writes()
            found = T.sblock_alloc_buffer((3,), "int32", scope="local")
            if heavy_first:
                find_tile(qo_indptr, batch, ceildiv(total_q, TQ) + batch - 1 - bx, TQ, found)
            else:
                find_tile(qo_indptr, batch, bx, TQ, found)
            # no branch around the tile (its barriers must not sit in a condition):
            # a block past the last tile runs an empty one
            b: T.let[T.int32] = T.max(found[0], 0)
            src = seq_src(bufs, b)
            tile(q, (o, lse), q_rope_position, src[0], by, qo_indptr[b],
                 qo_indptr[b + 1] - qo_indptr[b], found[1], src[1], src[2], causal,
                 rotary_mode, rope_scale, rope_theta, sm_scale, src[3], found[0] >= 0, tx)

    @T.macro
    def run(q, o, lse, q_rope_position, qo_indptr, batch, total_q, bufs, causal, rotary_mode,
            rope_scale, rope_theta, sm_scale):
        if heads_fastest_tokens > 0:
            tiles: T.let[T.int32] = ceildiv(total_q, TQ) + batch
            for bxy in T.thread_binding(tiles * Hkv, thread="blockIdx.x"):
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    with T.sblock("order"):
                        T.reads()
                        T.writes()
                        item = T.sblock_alloc_buffer((2,), "int32", scope="local")  # (tile, KV head)
                        if total_q <= heads_fastest_tokens * batch:
                            item[0] = bxy // Hkv
                            item[1] = bxy % Hkv
                        else:
                            item[0] = T.truncmod(bxy, tiles)
                            item[1] = T.truncdiv(bxy, tiles)
                        body(q, o, lse, q_rope_position, qo_indptr, batch, total_q, bufs, causal, rotary_mode,
                             rope_scale, rope_theta, sm_scale, item[0], item[1], tx)
        else:
            for bx in T.thread_binding(ceildiv(total_q, TQ) + batch, thread="blockIdx.x"):
                for by in T.thread_binding(Hkv, thread="blockIdx.y"):
                    for tx in T.thread_binding(NT, thread="threadIdx.x"):
                        body(q, o, lse, q_rope_position, qo_indptr, batch, total_q, bufs, causal, rotary_mode,
                             rope_scale, rope_theta, sm_scale, bx, by, tx)

    return run
