"""Tensor-core schedule of absorbed MLA attention (CUDA sm_80 and newer, float16 / bfloat16).

A block is 8 warps over 16 query rows and one split of a sequence's KV range (merged by LSE);
latent chunks stream through a two-stage ``cp.async`` ring as K and V. ``Q K^T``: warp w computes
16 score columns over a slice of the features; ``P V``: warp w owns ``DV / 8`` output columns.
Fragments: PTX's ``mma.m16n8k16`` (lane ``4 g + t``: rows g, g + 8, columns 2 t, 2 t + 1).

8-bit pages: the ring holds the chunks' bytes (``cp.async``, 16 bytes a copy, in the space of
the second 16-bit stage); each step converts its chunk into one 16-bit stage by moving bits
(:func:`.attention_gpu_decode_mma.fp8_pairs`), and the layer's scale (with the conversion's
factor) multiplies the scores and the outputs.
"""

from __future__ import annotations

import dataclasses

from tvm.script import tirx as T

from .attention_gpu import find_tile, swizzled
from .attention_gpu_decode import merge_splits
from .attention_gpu_decode_mma import FP8_HALF_FACTOR, fp8_pairs, half_of
from .attention_gpu_mla_wgmma import MlaWgmmaTile, mla_wgmma_grid
from .hopper import WG_ROWS
from .attention_gpu_mma import ldmatrix_x4, mma_m16n8k16, shfl_xor
from .macros import LOG2E, NEG_INF, ONE, ZERO, ceildiv, grid_dependency, paged_kv_len
from .schedule import GpuSchedule
from .spec import AttentionSpec

ROWS = 16  # query rows of a block: one mma tile
WARPS = 8
NT = 32 * WARPS
STAGES = 2  # shared-memory ring of KV chunks


@dataclasses.dataclass(frozen=True, kw_only=True)
class MlaTile:
    """KV rows per pipeline stage and how the warps split ``Q K^T``: ``col_groups`` groups of
    16 score columns times ``k_slices`` feature slices (``col_groups * k_slices`` = 8 warps)."""

    kv_chunk: int
    width: int

    @property
    def col_groups(self) -> int:
        return self.kv_chunk // 16

    @property
    def k_slices(self) -> int:
        return WARPS // self.col_groups

    @property
    def p_rows(self) -> int:
        """Latent-wide rows after the ring that hold the P tile (ROWS x kv_chunk)."""
        return -(-ROWS * self.kv_chunk // self.width)

    def shared_bytes(self, elem_bytes: int = 2) -> int:
        """KV ring and P tile, partial scores (float32), the chunk's pool rows (int32), per-row
        rescale factors and final (max, sum)."""
        return ((STAGES * self.kv_chunk + self.p_rows) * self.width * elem_bytes
                + (self.k_slices * ROWS + 1) * self.kv_chunk * 4 + 3 * ROWS * 4)

    @staticmethod
    def choose(spec: AttentionSpec, sched: GpuSchedule) -> "MlaTile":
        """The largest chunk (64, then 32 rows) whose tile fits the target's shared memory."""
        check_mla_gpu(spec, sched)
        for chunk in (64, 32):
            tile = MlaTile(kv_chunk=chunk, width=spec.qk_head_dim)
            if tile.shared_bytes() <= sched.dynamic_shared_bytes:
                return tile
        raise NotImplementedError(f"GPU MLA attention: a {spec.qk_head_dim}-wide latent tile of 32 rows "
                                  f"needs {MlaTile(kv_chunk=32, width=spec.qk_head_dim).shared_bytes()} bytes "
                                  f"of shared memory; the target allows {sched.dynamic_shared_bytes}")


def check_mla_gpu(spec: AttentionSpec, sched: GpuSchedule) -> None:
    """Raise NotImplementedError where this schedule does not apply."""
    Hq, W, DV = spec.num_qo_heads, spec.qk_head_dim, spec.v_head_dim
    if not sched.mma or spec.dtype not in ("float16", "bfloat16"):
        raise NotImplementedError(f"GPU MLA attention runs on tensor cores: float16 / bfloat16 on CUDA sm_80+, "
                                  f"got {spec.dtype} (mma={sched.mma})")
    if (Hq % ROWS and ROWS % Hq) or W % 64 or DV % (16 * WARPS):
        raise NotImplementedError(f"GPU MLA attention needs num_qo_heads dividing or divisible by {ROWS}, "
                                  f"qk_head_dim a multiple of 64 and v_head_dim of {16 * WARPS}; "
                                  f"got {Hq}, {W}, {DV}")


def mla_grid(spec: AttentionSpec, sched: GpuSchedule):
    """Macro running absorbed MLA attention over a batch on CUDA tensor cores: the body of
    :func:`.attention_mla.make_paged_mla` (its buffers, then ``causal, sm_scale, B, total_q``).

    Warpgroup MMA (:mod:`.attention_gpu_mla_wgmma`) where it applies, else this module's
    ``mma.sync`` schedule. With fewer than 64 heads a decode batch (one query per sequence)
    would fill half or less of the warpgroup tile's 64 rows: such batches take the
    ``mma.sync`` schedule (16-row tiles), chosen at run time."""
    wgmma_tile = MlaWgmmaTile.choose(spec, sched)
    if wgmma_tile is None:
        return _mma_sync_grid(spec, sched)
    fast = mla_wgmma_grid(spec, sched, wgmma_tile)
    if spec.num_qo_heads >= WG_ROWS:
        return fast
    plain = _mma_sync_grid(spec, sched)

    @T.macro
    def run(q, qo_indptr, pages, page_indptr, page_indices, length_info, o, lse, causal, sm_scale, B, total_q,
            kv_scales):
        # loops of 0 / 1 trips, not an `if`: TVM's barrier planner refuses kernels inside conditions
        for _prefill in T.serial(T.if_then_else(total_q > B, 1, 0)):
            fast(q, qo_indptr, pages, page_indptr, page_indices, length_info, o, lse, causal, sm_scale, B, total_q,
                 kv_scales)
        for _decode in T.serial(T.if_then_else(total_q > B, 0, 1)):
            plain(q, qo_indptr, pages, page_indptr, page_indices, length_info, o, lse, causal, sm_scale, B, total_q,
                  kv_scales)

    return run


def _mma_sync_grid(spec: AttentionSpec, sched: GpuSchedule):
    """Macro of :func:`mla_grid` on ``mma.sync`` (16-row tiles)."""
    tile = MlaTile.choose(spec, sched)
    Hq, W, DV, ps, dtype = spec.num_qo_heads, spec.qk_head_dim, spec.v_head_dim, spec.page_size, spec.dtype
    KC, CG, KS = tile.kv_chunk, tile.col_groups, tile.k_slices
    HG = min(Hq, ROWS)  # heads of a row tile
    TQ, NHG = ROWS // HG, Hq // HG  # tokens of a tile, head groups
    KSW = W // 16 // KS  # k-steps of Q K^T per warp
    RPW = ROWS // WARPS  # rows whose softmax a warp keeps (2)
    LPR = 32 // RPW  # lanes of a row in the softmax (16: shuffles over lane bits 0-3)
    P0, PROWS = STAGES * KC, tile.p_rows  # the P tile: ROWS x KC, row-major, after the ring
    CPL = KC // LPR  # columns per lane in the softmax
    CW = DV // WARPS  # output columns per warp
    NO = CW // 8  # output n-tiles per warp
    NVEC = W // 8  # 16-byte pieces of a latent row
    K_IT = ceildiv(KC * NVEC, NT)
    SMS = sched.mla_wave_blocks
    merge, opening = merge_splits(spec, sched, sched.mla_decode_splits), grid_dependency(sched)
    mma, ldmatrix, shfl = mma_m16n8k16(dtype), ldmatrix_x4(dtype), shfl_xor
    quantized, fmt = spec.quantized, spec.kv_dtype

    def stored_scale(kv_scales):
        """What the shared-memory rows are multiplied by to give the latent rows: 8-bit pages'
        scale times the conversion's factor (1 over pages of the model dtype: no factor)."""
        return kv_scales[0, 0] * FP8_HALF_FACTOR[fmt]

    def score_scale(sm_scale, kv_scales):
        return sm_scale * LOG2E * stored_scale(kv_scales) if quantized else sm_scale * LOG2E

    def out_scale(x, kv_scales):
        return x * stored_scale(kv_scales) if quantized else x

    def to_model(half):
        return half if dtype == "float16" else T.Cast(dtype, T.Cast("float32", half))

    def col(row, d):
        return swizzled(row, d, W)

    def scol(row, j):  # the score and P tiles (KC columns)
        return swizzled(row, j, KC)

    def splits(tiles):
        """Splits per tile: as many as fill one wave of blocks (a second, partial wave would
        idle most SMs), at least one."""
        return T.min(sched.mla_decode_splits, T.max(1, SMS // (tiles * NHG)))

    @T.macro
    def load_q(qf, q, qo_indptr, b, tile0, nq, hg, ks, g, t):
        """qf = this warp's A fragments of the tile's 16 query rows over feature slice ``ks``,
        read straight from global memory (once per block; zeros past nq tokens): in k-step kk,
        elements (0, 1) / (2, 3) / (4, 5) / (6, 7) are rows g / g + 8 / g / g + 8 at columns
        2 t (+ 1) / 2 t (+ 1) / 2 t + 8 (+ 1) / 2 t + 8 (+ 1) of the step."""
        for kk in T.unroll(KSW):
            for e in T.unroll(8):
                if (g + e // 2 % 2 * 8) // HG < nq:
                    qf[kk * 8 + e] = q[qo_indptr[b] + tile0 + (g + e // 2 % 2 * 8) // HG,
                                       hg * HG + (g + e // 2 % 2 * 8) % HG,
                                       (ks * KSW + kk) * 16 + e // 4 * 8 + 2 * t + e % 2]
                else:
                    qf[kk * 8 + e] = T.Cast(dtype, ZERO)

    @T.macro
    def plan_rows(rows, page_indices, page0, j0, row_hi, tx):
        """rows[r] = pool row (page * page_size + slot) of latent row j0 + r (of row_hi - 1 past
        the end; nothing for a chunk past the end): the page lookups of a chunk, once per row
        instead of once per 16-byte piece."""
        if T.And(tx < KC, j0 < row_hi):
            j: T.let[T.int32] = T.min(j0 + tx, row_hi - 1)
            rows[tx] = page_indices[page0 + j // ps] * ps + j % ps

    @T.macro
    def issue(kv, pages, rows, stage, j0, row_hi, tx):
        """Start copying latent rows j0 .. j0 + KC (pool rows ``rows``) into ring stage ``stage``
        (zeros at and past row_hi) and close the copy group."""
        for it in T.unroll(K_IT):
            if it * NT + tx < KC * NVEC:
                r: T.let[T.int32] = (it * NT + tx) // NVEC
                p: T.let[T.int32] = (it * NT + tx) % NVEC
                T.evaluate(T.ptx["cp.async.cg.shared.global"](
                    kv.ptr_to([stage * KC + r, col(r, p * 8)]), pages.ptr_to([rows[r] // ps, rows[r] % ps, p * 8]), 16,
                    T.Cast("uint32", T.if_then_else(j0 + r < row_hi, 16, 0))))
        T.evaluate(T.ptx["cp.async.commit_group"]())

    # 8-bit pages: the ring holds the chunks' bytes (stage s: rows KC + s KC / 2 .. of the
    # model-dtype tile, half a row per latent row), converted into rows 0 .. KC at each step
    NVB, WPR = W // 16, W // 4  # 16-byte pieces and 32-bit words of a latent row of bytes
    KB_IT, CW_IT = ceildiv(KC * NVB, NT), KC * WPR // NT

    @T.macro
    def issue_bytes(kv, pages, rows, stage, j0, row_hi, tx):
        """:func:`issue` over 8-bit pages: the chunk's bytes into byte stage ``stage``."""
        for it in T.unroll(KB_IT):
            if it * NT + tx < KC * NVB:
                r: T.let[T.int32] = (it * NT + tx) // NVB
                p: T.let[T.int32] = (it * NT + tx) % NVB
                T.evaluate(T.ptx["cp.async.cg.shared.global"](
                    kv.ptr_to([KC + stage * (KC // 2) + r // 2, r % 2 * (W // 2) + p * 8]),
                    pages.ptr_to([rows[r] // ps, rows[r] % ps, p * 16]), 16,
                    T.Cast("uint32", T.if_then_else(j0 + r < row_hi, 16, 0))))
        T.evaluate(T.ptx["cp.async.commit_group"]())

    @T.macro
    def convert(kv, stage, tx):
        """Rows 0 .. KC of the tile = byte stage ``stage`` in the model dtype, by moving bits
        (:func:`fp8_pairs`; ``stored_scale`` restores the values): all words read first, then
        written (no barrier between a thread's reads and writes)."""
        words = T.sblock_alloc_buffer((CW_IT,), "uint32", scope="local")
        for it in T.unroll(CW_IT):
            words[it] = T.reinterpret("uint32", kv[KC + stage * (KC // 2) + (it * NT + tx) // WPR // 2,
                                                   T.ramp((it * NT + tx) // WPR % 2 * (W // 2)
                                                          + (it * NT + tx) % WPR * 2, 1, 2)])
        for it in T.unroll(CW_IT):
            r: T.let[T.int32] = (it * NT + tx) // WPR
            c4: T.let[T.int32] = (it * NT + tx) % WPR * 4
            kv[r, col(r, c4)] = to_model(half_of(fp8_pairs(fmt, words[it])[0], False))
            kv[r, col(r, c4 + 1)] = to_model(half_of(fp8_pairs(fmt, words[it])[1], False))
            kv[r, col(r, c4 + 2)] = to_model(half_of(fp8_pairs(fmt, words[it])[0], True))
            kv[r, col(r, c4 + 3)] = to_model(half_of(fp8_pairs(fmt, words[it])[1], True))

    fill = issue_bytes if quantized else issue

    def tile_stage(c):
        """The tile rows scores and P V read in step c: ring stage c % STAGES, or over 8-bit
        pages the converted rows (stage 0)."""
        return 0 if quantized else c % STAGES

    @T.macro
    def scores(sp, qf, kv, stage, bf, sacc, ks, cg, tx):
        """sp[ks] = Q K^T of score columns [16 cg, 16 cg + 16) over feature slice ks (float32)."""
        for x in T.unroll(8):
            sacc[x] = ZERO
        for kk in T.unroll(KSW):
            # matrices: rows 0-7 of the group x features lo / hi, rows 8-15 x lo / hi
            T.evaluate(ldmatrix(bf, kv, (stage * KC + cg * 16 + tx % 32 // 16 * 8 + tx % 8) * W
                                + col(cg * 16 + tx % 32 // 16 * 8 + tx % 8,
                                      (ks * KSW + kk) * 16 + tx % 16 // 8 * 8), trans=False))
            T.evaluate(mma(qf, bf, sacc, 0, a_at=kk * 8, b_at=0))
            T.evaluate(mma(qf, bf, sacc, 1, a_at=kk * 8, b_at=4))
        for nn in T.unroll(2):
            for e in T.unroll(4):
                sp[ks, tx % 32 // 4 + e // 2 * 8,
                   scol(tx % 32 // 4 + e // 2 * 8, cg * 16 + nn * 8 + tx % 4 * 2 + e % 2)] = sacc[nn * 4 + e]

    @T.macro
    def softmax(sp, kv, al, mrow, lrow, sv, red, scale, j0, row_hi, kv_len, q_len, tile0, causal, w, tx):
        """Fold the chunk into the online-softmax state of row ``r = 2 w + lane // 16`` (16
        lanes per row, CPL columns per lane; ``mrow`` / ``lrow``: the row's running max and sum,
        the same in its 16 lanes): sum the partial scores, scale, mask (only in chunks that
        reach past row_hi or the causal diagonal of the tile's first token), write p = exp2(s -
        m) to the P tile and the row's rescale factor to ``al``. Rows past the tile's tokens are
        not masked: their queries are zeros, their outputs never stored."""
        r: T.let[T.int32] = w * RPW + tx % 32 // LPR
        u: T.let[T.int32] = tx % LPR
        for i in T.unroll(CPL):
            sv[i] = sp[0, r, scol(r, u * CPL + i)]
            for k in T.unroll(1, KS):
                sv[i] = sv[i] + sp[k, r, scol(r, u * CPL + i)]
        if T.Or(j0 + KC > row_hi, T.And(causal != 0, j0 + KC - 1 > kv_len - q_len + tile0)):
            for i in T.unroll(CPL):
                sv[i] = T.if_then_else(
                    T.And(j0 + u * CPL + i < row_hi,
                          T.Or(causal == 0, j0 + u * CPL + i <= kv_len - q_len + tile0 + r // HG)),
                    sv[i] * scale, NEG_INF)
        else:
            for i in T.unroll(CPL):
                sv[i] = sv[i] * scale
        red[0] = mrow[0]
        for i in T.unroll(CPL):
            red[0] = T.max(red[0], sv[i])
        red[0] = T.max(red[0], shfl(red[0], 1))
        red[0] = T.max(red[0], shfl(red[0], 2))
        red[0] = T.max(red[0], shfl(red[0], 4))
        red[0] = T.max(red[0], shfl(red[0], 8))
        # a row with nothing visible yet has max -inf; it subtracts 0 instead, so that
        # exp2(-inf) = 0 comes out without a branch
        red[1] = T.if_then_else(red[0] == NEG_INF, ZERO, red[0])
        red[2] = ZERO
        for i in T.unroll(CPL):
            sv[i] = T.exp2(sv[i] - red[1])
            red[2] = red[2] + sv[i]
            kv[P0 + (r * KC + scol(r, u * CPL + i)) // W, (r * KC + scol(r, u * CPL + i)) % W] = T.Cast(dtype, sv[i])
        red[2] = red[2] + shfl(red[2], 1)
        red[2] = red[2] + shfl(red[2], 2)
        red[2] = red[2] + shfl(red[2], 4)
        red[2] = red[2] + shfl(red[2], 8)
        red[1] = T.exp2(mrow[0] - red[1])
        lrow[0] = lrow[0] * red[1] + red[2]
        mrow[0] = red[0]
        if u == 0:
            al[r] = red[1]

    @T.macro
    def pv(oacc, al, kv, stage, pf, vf, w, g, tx):
        """Rescale oacc by the rows' factors, then oacc += P (16 x KC) @ V_chunk[:, this warp's
        columns]."""
        for nn in T.unroll(NO):
            for e in T.unroll(4):
                oacc[nn * 4 + e] = oacc[nn * 4 + e] * al[g + e // 2 * 8]
        for kk in T.unroll(KC // 16):
            # matrices: rows 0-7 / 8-15 x columns lo / hi of the k-step (as the query fragments)
            T.evaluate(ldmatrix(pf, kv, P0 * W + tx % 16 * KC + scol(tx % 16, kk * 16 + tx % 32 // 16 * 8), trans=False))
            for pair in T.unroll(NO // 2):
                # matrices: rows lo / hi of the k-step x columns of n-tile 2 pair, then 2 pair + 1
                T.evaluate(ldmatrix(vf, kv, (stage * KC + kk * 16 + tx % 16 // 8 * 8 + tx % 8) * W
                                    + col(kk * 16 + tx % 16 // 8 * 8 + tx % 8,
                                          w * CW + pair * 16 + tx % 32 // 16 * 8), trans=True))
                T.evaluate(mma(pf, vf, oacc, 2 * pair, b_at=0))
                T.evaluate(mma(pf, vf, oacc, 2 * pair + 1, b_at=4))

    @T.macro
    def store(ws_o, ws_lse, oacc, stat, mrow, lrow, qrow0, sp_id, nq, hg, w, g, t, tx, kv_scales):
        """The rows' owners publish (max, sum); every warp scales and stores its columns."""
        if tx % LPR == 0:
            stat[w * RPW + tx % 32 // LPR, 0] = mrow[0]
            stat[w * RPW + tx % 32 // LPR, 1] = lrow[0]
        T.evaluate(T.tvm_storage_sync("shared"))
        for hr in T.unroll(2):
            if (g + hr * 8) // HG < nq:
                for nn in T.unroll(NO):
                    for e in T.unroll(2):
                        ws_o[(qrow0 + (g + hr * 8) // HG) * Hq + hg * HG + (g + hr * 8) % HG, sp_id,
                             w * CW + nn * 8 + 2 * t + e] = out_scale(oacc[nn * 4 + hr * 2 + e] * T.if_then_else(
                                 stat[g + hr * 8, 1] > ZERO, ONE / stat[g + hr * 8, 1], ZERO), kv_scales)
                if T.And(w == 0, t == 0):
                    ws_lse[(qrow0 + (g + hr * 8) // HG) * Hq + hg * HG + (g + hr * 8) % HG, sp_id] = T.if_then_else(
                        stat[g + hr * 8, 1] > ZERO, stat[g + hr * 8, 0] + T.log2(stat[g + hr * 8, 1]), NEG_INF)

    @T.macro
    def run(q, qo_indptr, pages, page_indptr, page_indices, length_info, o, lse, causal, sm_scale, B, total_q,
            kv_scales):
        ws_o = T.sblock_alloc_buffer((total_q * Hq, splits(ceildiv(total_q, TQ)), DV), "float32")
        ws_lse = T.sblock_alloc_buffer((total_q * Hq, splits(ceildiv(total_q, TQ))), "float32")
        nsplit: T.let[T.int32] = splits(ceildiv(total_q, TQ))
        # blockIdx.x = tile x NHG + head group: the head groups of a token run side by side,
        # so that the latent rows they all read come from L2 rather than memory
        for bx in T.thread_binding((ceildiv(total_q, TQ) + B) * NHG, thread="blockIdx.x"):
            for by in T.thread_binding(nsplit, thread="blockIdx.y"):
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    with T.sblock("work"):
                        T.reads()
                        T.writes()
                        opening()
                        # the KV ring, then the P tile (a buffer of its own trips TVM 0.27's
                        # lowering of access pointers into merged shared memory)
                        kv = T.sblock_alloc_buffer((P0 + PROWS, W), dtype, scope="shared.dyn")
                        sp = T.sblock_alloc_buffer((KS, ROWS, KC), "float32", scope="shared.dyn")
                        rows = T.sblock_alloc_buffer((KC,), "int32", scope="shared.dyn")
                        al = T.sblock_alloc_buffer((ROWS,), "float32", scope="shared.dyn")
                        stat = T.sblock_alloc_buffer((ROWS, 2), "float32", scope="shared.dyn")
                        qf = T.sblock_alloc_buffer((KSW * 8,), dtype, scope="local")
                        bf = T.sblock_alloc_buffer((8,), dtype, scope="local")
                        vf = T.sblock_alloc_buffer((8,), dtype, scope="local")
                        pf = T.sblock_alloc_buffer((8,), dtype, scope="local")
                        sacc = T.sblock_alloc_buffer((8,), "float32", scope="local")
                        sv = T.sblock_alloc_buffer((CPL,), "float32", scope="local")
                        oacc = T.sblock_alloc_buffer((NO * 4,), "float32", scope="local")
                        mrow = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        lrow = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        red = T.sblock_alloc_buffer((3,), "float32", scope="local")
                        found = T.sblock_alloc_buffer((3,), "int32", scope="local")
                        find_tile(qo_indptr, B, bx // NHG, TQ, found)
                        # blocks past the last tile have nothing to do; a loop of 0 / 1 trips rather
                        # than an `if`: TVM plans no barriers inside conditions, and its shared-memory
                        # merge wants the tile's bindings in a scope of their own
                        for _tile in T.serial(T.if_then_else(found[0] >= 0, 1, 0)):
                            b: T.let[T.int32] = found[0]
                            w: T.let[T.int32] = tx // 32
                            g: T.let[T.int32] = tx % 32 // 4
                            t: T.let[T.int32] = tx % 4
                            q_len: T.let[T.int32] = qo_indptr[b + 1] - qo_indptr[b]
                            nq: T.let[T.int32] = T.min(TQ, q_len - found[1])
                            kv_len: T.let[T.int32] = paged_kv_len(page_indptr[b + 1] - page_indptr[b], ps,
                                                                  length_info, b, False)
                            per: T.let[T.int32] = ceildiv(ceildiv(kv_len, KC), nsplit)
                            c_lo: T.let[T.int32] = T.min(by * per, ceildiv(kv_len, KC))
                            c_hi: T.let[T.int32] = T.if_then_else(
                                nq > 0, T.min(c_lo + per, ceildiv(kv_len, KC)), c_lo)
                            row_hi: T.let[T.int32] = T.min(kv_len, c_hi * KC)
                            for s in T.unroll(STAGES):
                                plan_rows(rows, page_indices, page_indptr[b], (c_lo + s) * KC, row_hi, tx)
                                T.evaluate(T.tvm_storage_sync("shared"))
                                if c_lo + s < c_hi:
                                    fill(kv, pages, rows, s, (c_lo + s) * KC, row_hi, tx)
                                else:
                                    T.evaluate(T.ptx["cp.async.commit_group"]())
                                T.evaluate(T.tvm_storage_sync("shared"))
                            load_q(qf, q, qo_indptr, b, found[1], nq, bx % NHG, w // CG, g, t)
                            mrow[0] = NEG_INF
                            lrow[0] = ZERO
                            for x in T.unroll(NO * 4):
                                oacc[x] = ZERO
                            for c in T.serial(c_lo, T.max(c_hi, c_lo)):
                                T.evaluate(T.ptx["cp.async.wait_group"](STAGES - 1))
                                T.evaluate(T.tvm_storage_sync("shared"))
                                if quantized:
                                    convert(kv, (c - c_lo) % STAGES, tx)
                                    T.evaluate(T.tvm_storage_sync("shared"))
                                scores(sp, qf, kv, tile_stage(c - c_lo), bf, sacc, w // CG, w % CG, tx)
                                plan_rows(rows, page_indices, page_indptr[b], (c + STAGES) * KC, row_hi, tx)
                                T.evaluate(T.tvm_storage_sync("shared"))
                                softmax(sp, kv, al, mrow, lrow, sv, red, score_scale(sm_scale, kv_scales), c * KC,
                                        row_hi, kv_len, q_len, found[1], causal, w, tx)
                                T.evaluate(T.tvm_storage_sync("shared"))
                                pv(oacc, al, kv, tile_stage(c - c_lo), pf, vf, w, g, tx)
                                T.evaluate(T.tvm_storage_sync("shared"))
                                if c + STAGES < c_hi:
                                    fill(kv, pages, rows, (c - c_lo) % STAGES, (c + STAGES) * KC, row_hi, tx)
                                else:
                                    T.evaluate(T.ptx["cp.async.commit_group"]())
                            store(ws_o, ws_lse, oacc, stat, mrow, lrow, qo_indptr[b] + found[1], by, nq, bx % NHG, w,
                                  g, t, tx, kv_scales)
        merge(ws_o, ws_lse, o, lse, total_q * Hq, nsplit)

    return run
