"""Tensor-core schedule of absorbed MLA attention (CUDA sm_80 and newer, float16 / bfloat16).

The algorithm is the one of :func:`.attention.make_paged_mla`: every query head attends to the
one latent head, score = q . latent row (``W = kv_lora_rank + rope dim`` features), output =
softmax @ latent[:, :v_head_dim], folded chunk by chunk into an online-softmax state in log2
units. MLA's shapes change the schedule: the 16 query rows of a tile all read the same latent
rows (as in MQA) and v_head_dim is 512 wide, too wide for one warp's accumulators.

* A block is 4 warps over 16 query rows (16 heads of one token, or ``16 / Hq`` tokens of
  ``Hq < 16`` heads) and one split of the sequence's KV range (flash-decoding: splits keep the
  GPU busy when the batch is small, as many as fill one wave of resident blocks; a second
  kernel merges them by LSE).
* Each KV chunk of 16 latent rows is staged once in shared memory (16-byte loads, fetched into
  registers one chunk ahead, XOR-swizzled pieces so fragment reads hit distinct banks); K and V
  are the same rows, so the chunk is read from memory once.
* ``Q K^T`` is split over the 576 features: warp w multiplies its quarter of them (query
  tile staged once in shared memory) and the four partial 16 x 16 score tiles are summed
  through shared memory. ``P V`` is split over the output columns: warp w owns
  columns ``[w DV/4, (w + 1) DV/4)``. Every warp keeps the (identical) softmax state of all 16
  rows, so no further exchange is needed.

Fragment layouts are PTX's ``mma.m16n8k16`` ones: lane ``4 g + t`` holds rows ``g`` and
``g + 8``, columns ``2 t`` and ``2 t + 1`` of each 16 x 8 accumulator tile.
"""

from __future__ import annotations

from tvm.script import tirx as T

from .attention_gpu import find_tile, merge_splits, swizzled
from .attention_gpu_mma import mma_m16n8k16, online_fold, shfl_xor
from .macros import LOG2E, NEG_INF, ONE, ZERO, ceildiv, paged_kv_len
from .schedule import GpuSchedule
from .spec import AttentionSpec

ROWS = 16  # query rows of a block: one mma tile
WARPS = 4
KC = 16  # latent rows per chunk: one mma k-step of P V
BLOCKS_PER_SM = 2  # resident blocks per SM (ptxas: 211 registers per thread, 40 KB shared a block)


def check_mla_gpu(spec: AttentionSpec, sched: GpuSchedule) -> None:
    """Raise NotImplementedError where this schedule does not apply."""
    Hq, W, DV = spec.num_qo_heads, spec.qk_head_dim, spec.v_head_dim
    if not sched.mma or spec.dtype not in ("float16", "bfloat16"):
        raise NotImplementedError(f"GPU MLA attention runs on tensor cores: float16 / bfloat16 on CUDA sm_80+, "
                                  f"got {spec.dtype} (mma={sched.mma})")
    if (Hq % ROWS and ROWS % Hq) or W % (16 * WARPS) or DV % (8 * WARPS):
        raise NotImplementedError(f"GPU MLA attention needs num_qo_heads dividing or divisible by {ROWS}, "
                                  f"qk_head_dim a multiple of {16 * WARPS} and v_head_dim of {8 * WARPS}; "
                                  f"got {Hq}, {W}, {DV}")


def mla_grid(spec: AttentionSpec, sched: GpuSchedule):
    """Macro running absorbed MLA attention over a batch on CUDA tensor cores: the body of
    :func:`.attention.make_paged_mla` (its buffers, then ``causal, sm_scale, B, total_q``)."""
    check_mla_gpu(spec, sched)
    Hq, W, DV, ps, dtype = spec.num_qo_heads, spec.qk_head_dim, spec.v_head_dim, spec.page_size, spec.dtype
    HG = min(Hq, ROWS)  # heads of a row tile
    TQ, NHG = ROWS // HG, Hq // HG  # tokens of a tile, head groups
    KSW = W // 16 // WARPS  # k-steps of Q K^T per warp
    CW = DV // WARPS  # output columns per warp
    NO = CW // 8  # output n-tiles per warp
    NT = 32 * WARPS
    NVEC = W // 8  # 16-byte pieces of a latent row
    K_IT = ceildiv(KC * NVEC, NT)
    NSPLIT = sched.decode_splits
    RESIDENT = sched.min_blocks // 2 * BLOCKS_PER_SM  # min_blocks: two per SM
    merge = merge_splits(spec, sched)
    mma, shfl, fold = mma_m16n8k16(dtype), shfl_xor, online_fold(2, NO)

    def col(row, d):
        return swizzled(row, d, W)

    def splits(tiles):
        """Splits per tile: as many as fit in one wave of resident blocks (a second, partial
        wave would idle most SMs), at least one."""
        return T.min(NSPLIT, T.max(1, RESIDENT // (tiles * NHG)))

    @T.macro
    def load_q(qs, q, qo_indptr, b, tile0, nq, hg, tx):
        """qs = the tile's 16 query rows (zeros past nq tokens), 16-byte pieces, swizzled."""
        for it in T.unroll(ceildiv(ROWS * NVEC, NT)):
            if it * NT + tx < ROWS * NVEC:
                r: T.let[T.int32] = (it * NT + tx) // NVEC
                d0: T.let[T.int32] = (it * NT + tx) % NVEC * 8
                if r // HG < nq:
                    for x in T.vectorized(8):
                        qs[r, col(r, d0) + x] = q[qo_indptr[b] + tile0 + r // HG, hg * HG + r % HG, d0 + x]
                else:
                    for x in T.vectorized(8):
                        qs[r, col(r, d0) + x] = T.Cast(dtype, ZERO)

    @T.macro
    def fetch(kreg, pages, page_indices, page0, j0, row_hi, tx):
        """Registers of this thread's 16-byte pieces of latent rows j0 .. j0 + KC (zeros at and
        past row_hi)."""
        for it in T.unroll(K_IT):
            if T.And(it * NT + tx < KC * NVEC, j0 + (it * NT + tx) // NVEC < row_hi):
                for x in T.vectorized(8):
                    kreg[it, x] = pages[page_indices[page0 + (j0 + (it * NT + tx) // NVEC) // ps],
                                        (j0 + (it * NT + tx) // NVEC) % ps, (it * NT + tx) % NVEC * 8 + x]
            else:
                for x in T.vectorized(8):
                    kreg[it, x] = T.Cast(dtype, ZERO)

    @T.macro
    def stage(ks, kreg, tx):
        for it in T.unroll(K_IT):
            if it * NT + tx < KC * NVEC:
                for x in T.vectorized(8):
                    ks[(it * NT + tx) // NVEC, col((it * NT + tx) // NVEC, (it * NT + tx) % NVEC * 8) + x] = kreg[it, x]

    @T.macro
    def scores(sp, qs, ks, af, bf, sacc, w, g, t):
        """sp[w] = this warp's quarter of Q K^T for the chunk (16 x 16, float32)."""
        for x in T.unroll(8):
            sacc[x] = ZERO
        for kk in T.unroll(KSW):
            for hr in T.unroll(2):
                for half in T.unroll(2):
                    for x in T.vectorized(2):
                        af[half * 4 + hr * 2 + x] = qs[g + 8 * hr, col(g + 8 * hr, (w * KSW + kk) * 16 + half * 8 + 2 * t)
                                                       + x]
            for nn in T.unroll(2):
                for x in T.vectorized(2):
                    bf[x] = ks[nn * 8 + g, col(nn * 8 + g, (w * KSW + kk) * 16 + 2 * t) + x]
                    bf[2 + x] = ks[nn * 8 + g, col(nn * 8 + g, (w * KSW + kk) * 16 + 8 + 2 * t) + x]
                T.evaluate(mma(af, bf, sacc, nn))
        for nn in T.unroll(2):
            for e in T.unroll(4):
                sp[w, g + e // 2 * 8, nn * 8 + 2 * t + e % 2] = sacc[nn * 4 + e]

    @T.macro
    def softmax(sfull, sp, oacc, m2, l2, red, scale, j0, row_hi, nq, kv_len, q_len, tile0, causal, g, t):
        """Sum the partial scores, mask, and fold the chunk into rows g and g + 8."""
        for nn in T.unroll(2):
            for e in T.unroll(4):
                sfull[nn * 4 + e] = sp[0, g + e // 2 * 8, nn * 8 + 2 * t + e % 2] + \
                    sp[1, g + e // 2 * 8, nn * 8 + 2 * t + e % 2] + sp[2, g + e // 2 * 8, nn * 8 + 2 * t + e % 2] + \
                    sp[3, g + e // 2 * 8, nn * 8 + 2 * t + e % 2]
                sfull[nn * 4 + e] = T.if_then_else(
                    T.And(T.And(j0 + nn * 8 + 2 * t + e % 2 < row_hi, (g + e // 2 * 8) // HG < nq),
                          T.Or(causal == 0, j0 + nn * 8 + 2 * t + e % 2
                               <= kv_len - q_len + tile0 + (g + e // 2 * 8) // HG)),
                    sfull[nn * 4 + e] * scale, NEG_INF)
        fold(sfull, oacc, m2, l2, red)

    @T.macro
    def pv(oacc, sfull, ks, pf, vf, w, g, t):
        """oacc += P (16 x 16) @ V_chunk[:, this warp's columns]."""
        for e in T.unroll(4):
            pf[e] = T.Cast(dtype, sfull[e])
            pf[4 + e] = T.Cast(dtype, sfull[4 + e])
        for nn in T.unroll(NO):
            vf[0] = ks[2 * t, col(2 * t, w * CW + nn * 8 + g)]
            vf[1] = ks[2 * t + 1, col(2 * t + 1, w * CW + nn * 8 + g)]
            vf[2] = ks[8 + 2 * t, col(8 + 2 * t, w * CW + nn * 8 + g)]
            vf[3] = ks[9 + 2 * t, col(9 + 2 * t, w * CW + nn * 8 + g)]
            T.evaluate(mma(pf, vf, oacc, nn))

    @T.macro
    def store(ws_o, ws_lse, oacc, m2, l2, qrow0, sp_id, nq, hg, w, g, t):
        for hr in T.unroll(2):
            l2[hr] = l2[hr] + shfl(l2[hr], 1)
            l2[hr] = l2[hr] + shfl(l2[hr], 2)
        for hr in T.unroll(2):
            if (g + hr * 8) // HG < nq:
                for nn in T.unroll(NO):
                    for e in T.unroll(2):
                        ws_o[(qrow0 + (g + hr * 8) // HG) * Hq + hg * HG + (g + hr * 8) % HG, sp_id,
                             w * CW + nn * 8 + 2 * t + e] = oacc[nn * 4 + hr * 2 + e] * T.if_then_else(
                                 l2[hr] > ZERO, ONE / l2[hr], ZERO)
                if T.And(w == 0, t == 0):
                    ws_lse[(qrow0 + (g + hr * 8) // HG) * Hq + hg * HG + (g + hr * 8) % HG, sp_id] = T.if_then_else(
                        l2[hr] > ZERO, m2[hr] + T.log2(l2[hr]), NEG_INF)

    @T.macro
    def run(q, qo_indptr, pages, page_indptr, page_indices, length_info, o, lse, causal, sm_scale, B, total_q):
        ws_o = T.sblock_alloc_buffer((total_q * Hq, splits(ceildiv(total_q, TQ)), DV), "float32")
        ws_lse = T.sblock_alloc_buffer((total_q * Hq, splits(ceildiv(total_q, TQ))), "float32")
        nsplit: T.let[T.int32] = splits(ceildiv(total_q, TQ))
        for bx in T.thread_binding(ceildiv(total_q, TQ) + B, thread="blockIdx.x"):
            for by in T.thread_binding(nsplit, thread="blockIdx.y"):
                for bz in T.thread_binding(NHG, thread="blockIdx.z"):
                    for tx in T.thread_binding(NT, thread="threadIdx.x"):
                        with T.sblock("work"):
                            T.reads()
                            T.writes()
                            ks = T.sblock_alloc_buffer((KC, W), dtype, scope="shared")
                            sp = T.sblock_alloc_buffer((WARPS, ROWS, KC), "float32", scope="shared")
                            kreg = T.sblock_alloc_buffer((K_IT, 8), dtype, scope="local")
                            qs = T.sblock_alloc_buffer((ROWS, W), dtype, scope="shared")
                            sacc = T.sblock_alloc_buffer((8,), "float32", scope="local")
                            sfull = T.sblock_alloc_buffer((8,), "float32", scope="local")
                            oacc = T.sblock_alloc_buffer((NO * 4,), "float32", scope="local")
                            af = T.sblock_alloc_buffer((8,), dtype, scope="local")
                            bf = T.sblock_alloc_buffer((4,), dtype, scope="local")
                            pf = T.sblock_alloc_buffer((8,), dtype, scope="local")
                            vf = T.sblock_alloc_buffer((4,), dtype, scope="local")
                            m2 = T.sblock_alloc_buffer((2,), "float32", scope="local")
                            l2 = T.sblock_alloc_buffer((2,), "float32", scope="local")
                            red = T.sblock_alloc_buffer((2,), "float32", scope="local")
                            found = T.sblock_alloc_buffer((3,), "int32", scope="local")
                            find_tile(qo_indptr, B, bx, TQ, found)
                            b: T.let[T.int32] = T.max(found[0], 0)
                            w: T.let[T.int32] = tx // 32
                            g: T.let[T.int32] = tx % 32 // 4
                            t: T.let[T.int32] = tx % 4
                            q_len: T.let[T.int32] = qo_indptr[b + 1] - qo_indptr[b]
                            nq: T.let[T.int32] = T.if_then_else(found[0] >= 0, T.min(TQ, q_len - found[1]), 0)
                            kv_len: T.let[T.int32] = paged_kv_len(page_indptr[b + 1] - page_indptr[b], ps,
                                                                  length_info, b, False)
                            per: T.let[T.int32] = ceildiv(ceildiv(kv_len, KC), nsplit)
                            c_lo: T.let[T.int32] = T.min(by * per, ceildiv(kv_len, KC))
                            c_hi: T.let[T.int32] = T.if_then_else(
                                nq > 0, T.min(c_lo + per, ceildiv(kv_len, KC)), c_lo)
                            row_hi: T.let[T.int32] = T.min(kv_len, c_hi * KC)
                            load_q(qs, q, qo_indptr, b, found[1], nq, bz, tx)
                            for hr in T.unroll(2):
                                m2[hr] = NEG_INF
                                l2[hr] = ZERO
                            for x in T.unroll(NO * 4):
                                oacc[x] = ZERO
                            if c_lo < c_hi:
                                fetch(kreg, pages, page_indices, page_indptr[b], c_lo * KC, row_hi, tx)
                            for c in T.serial(c_lo, T.max(c_hi, c_lo)):
                                T.evaluate(T.tvm_storage_sync("shared"))
                                stage(ks, kreg, tx)
                                T.evaluate(T.tvm_storage_sync("shared"))
                                if c + 1 < c_hi:
                                    fetch(kreg, pages, page_indices, page_indptr[b], (c + 1) * KC, row_hi, tx)
                                scores(sp, qs, ks, af, bf, sacc, w, g, t)
                                T.evaluate(T.tvm_storage_sync("shared"))
                                softmax(sfull, sp, oacc, m2, l2, red, sm_scale * LOG2E, c * KC, row_hi, nq,
                                        kv_len, q_len, found[1], causal, g, t)
                                pv(oacc, sfull, ks, pf, vf, w, g, t)
                            store(ws_o, ws_lse, oacc, m2, l2, qo_indptr[b] + found[1], by, nq, bz, w, g, t)
        merge(ws_o, ws_lse, o, lse, total_q * Hq, nsplit)

    return run
