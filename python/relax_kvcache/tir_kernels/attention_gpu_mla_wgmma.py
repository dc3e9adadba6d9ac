"""Warpgroup-MMA schedule of absorbed MLA attention (CUDA sm_90a, pages of the model dtype;
design: ``docs/kernels.md``).

A block is two warpgroups over 64 query rows (one token's heads, or several tokens' heads where
num_qo_heads < 64) and one split of the sequence's latent rows; the splits are merged by LSE as
in :mod:`.attention_gpu_mla`. The query tile and a ring of latent chunks live in dynamic shared
memory in the 128-byte swizzled layout (:func:`~.hopper.sw128`). Per chunk:

* ``S = Q K^T`` is split over the features: warpgroup w multiplies features ``[64 b + 32 w,
  64 b + 32 w + 32)`` of every 64-wide column block b. The two partial scores meet in shared
  memory (thread i of one warpgroup holds the same elements as thread i of the other), so both
  warpgroups hold the whole S and fold the same online softmax.
* ``O += P V``: warpgroup w owns output columns ``[DV / 2 w, DV / 2 (w + 1))``, with P from
  registers and V (the chunk's first DV features) from shared memory.

Chunk c + 1's scores are taken while chunk c's ``P V`` runs on the tensor cores.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from tvm.script import tirx as T

from .attention_gpu import find_tile
from .attention_gpu_decode import merge_splits
from .attention_gpu_mma import fold_scores, rescale_rows, shfl_xor
from .hopper import (ALIGN_ELEMS, FENCES, SWIZZLE_128B, WG_ROWS, WG_THREADS, aligned_base, fence_registers, ptx,
                     sw128)
from .macros import LOG2E, NEG_INF, ONE, ZERO, ceildiv, grid_dependency, paged_kv_len
from .schedule import GpuSchedule
from .spec import AttentionSpec

ROWS = WG_ROWS  # query rows of a block
NT = 2 * WG_THREADS


@dataclasses.dataclass(frozen=True, kw_only=True)
class MlaWgmmaTile:
    """The tile of ``width``-wide latent rows: ``kv_chunk`` rows per step, a ring of
    ``stages`` chunks after the 64-row query tile."""

    width: int
    kv_chunk: int
    stages: int

    @property
    def shared_elems(self) -> int:
        """16-bit elements of the tile buffer: query tile, ring, alignment slack."""
        return (ROWS + self.stages * self.kv_chunk) * self.width + ALIGN_ELEMS

    @property
    def shared_bytes(self) -> int:
        """The tile buffer and the partial scores the warpgroups exchange (float32)."""
        return 2 * self.shared_elems + 4 * 2 * ROWS * self.kv_chunk

    @staticmethod
    def choose(spec: AttentionSpec, sched: GpuSchedule) -> Optional["MlaWgmmaTile"]:
        """The tile for ``spec``, or None where this schedule does not apply: no ``wgmma``
        (sm_90a), 8-bit pages, features not in whole 64-wide column blocks or not split evenly
        into k-steps, output halves other than 64 - 256 columns in whole blocks, or head counts
        that neither divide nor are multiples of 64."""
        Hq, W, DV = spec.num_qo_heads, spec.qk_head_dim, spec.v_head_dim
        if not sched.wgmma or spec.quantized or spec.dtype not in ("float16", "bfloat16"):
            return None
        if W % 64 or DV % 128 or DV // 2 > 256 or (ROWS % Hq and Hq % ROWS):
            return None
        for stages in (3, 2):
            tile = MlaWgmmaTile(width=W, kv_chunk=32, stages=stages)
            if tile.shared_bytes <= sched.dynamic_shared_bytes:
                return tile
        return None


def mla_wgmma_grid(spec: AttentionSpec, sched: GpuSchedule, tile: MlaWgmmaTile):
    """Macro running absorbed MLA attention over a batch with warpgroup MMA (the arguments of
    :func:`.attention_gpu_mla.mla_grid`'s macro)."""
    Hq, W, DV, ps, dtype = spec.num_qo_heads, spec.qk_head_dim, spec.v_head_dim, spec.page_size, spec.dtype
    KC, S = tile.kv_chunk, tile.stages
    HG = min(Hq, ROWS)  # heads of a row tile
    TQ, NHG = ROWS // HG, Hq // HG  # tokens of a tile, head groups
    DVH = DV // 2  # output columns of a warpgroup
    NS, NO = KC // 8, DVH // 8  # accumulator n-tiles of S and of a warpgroup's O
    PIECES = W // 8  # 16-byte pieces of a latent row
    Q_IT = ceildiv(ROWS * PIECES, NT)
    assert KC * 8 == NT, "load_kv: eight threads a latent row"
    KV_OFF = ROWS * W  # the ring after the query tile
    ab = "f16" if dtype == "float16" else "bf16"
    mma_qk = ptx(f"wgmma.mma_async.sync.aligned.m64n{KC}k16.f32.{ab}.{ab}")
    mma_pv = ptx(f"wgmma.mma_async.sync.aligned.m64n{DVH}k16.f32.{ab}.{ab}")
    cvt_pair = ptx(f"cvt.rn.{ab}x2.f32")
    fold, rescale, shfl = fold_scores(NS), rescale_rows(NO), shfl_xor
    merge, opening = merge_splits(spec, sched, sched.mla_decode_splits), grid_dependency(sched)
    SMS = sched.mla_wave_blocks

    def k_at(stage):
        return KV_OFF + stage * KC * W

    def splits(tiles):
        """Splits per tile: as many as fill one wave of blocks, at least one."""
        return T.min(sched.mla_decode_splits, T.max(1, SMS // (tiles * NHG)))

    @T.macro
    def copy16(smem, dst, src_elem, full):
        """Start a 16-byte copy from ``src_elem`` to ``smem[dst]`` (zeros unless ``full``)."""
        T.evaluate(T.ptx["cp.async.cg.shared.global"](
            T.address_of(smem[dst]), T.address_of(src_elem), 16, T.Cast("uint32", T.if_then_else(full, 16, 0))))

    @T.macro
    def load_q(smem, base, q, qrow0, hg, nq, tx):
        """Copy the query tile: row r = token qrow0 + r // HG, head hg HG + r % HG (zeros past
        nq tokens)."""
        for it in T.unroll(Q_IT):
            if it * NT + tx < ROWS * PIECES:
                r: T.let[T.int32] = (it * NT + tx) // PIECES
                c: T.let[T.int32] = (it * NT + tx) % PIECES * 8
                copy16(smem, base + sw128(r, c, ROWS),
                       q[qrow0 + T.min(r // HG, T.max(nq - 1, 0)), hg * HG + r % HG, c], r // HG < nq)

    @T.macro
    def lookup(nxt, page_indices, page0, j0, kv_len, tx):
        """Start loading the page of latent row ``j0 + tx // 8`` (clamped below kv_len; nothing
        for a chunk past it) into ``nxt``: a chunk's page lookups, issued a chunk before its
        copies."""
        if j0 < kv_len:
            nxt[0] = page_indices[page0 + T.min(j0 + tx // 8, kv_len - 1) // ps]

    @T.macro
    def load_kv(smem, base, nxt, stage, pages, j0, kv_len, tx):
        """Start copying latent rows j0 .. j0 + KC (the page of this thread's row in ``nxt``)
        into ring stage ``stage`` (zeros past kv_len), then close the copy group. Eight
        threads a row: thread tx copies pieces ``tx % 8 + 8 k`` of row ``tx // 8``, one per
        64-column block k, at the same swizzled slot of each block."""
        r: T.let[T.int32] = tx // 8
        u: T.let[T.int32] = tx % 8
        for k in T.unroll(PIECES // 8):
            copy16(smem, base + k_at(stage) + k * (KC * 64) + r * 64 + T.bitwise_xor(u, r % 8) * 8,
                   pages[nxt[0], T.max(T.min(j0 + r, kv_len - 1), 0) % ps, (u + 8 * k) * 8], j0 + r < kv_len)
        T.evaluate(T.ptx["cp.async.commit_group"]())

    @T.macro
    def scores(smem, base, sacc, dq, dk, stage, wg):
        """Issue ``sacc = Q K^T`` over this warpgroup's features (asynchronous; one group)."""
        T.cuda.wgmma.encode_matrix_descriptor(T.address_of(dq[0]), T.address_of(smem[base + wg * 32]), 1,
                                              1024 >> 4, SWIZZLE_128B)
        T.cuda.wgmma.encode_matrix_descriptor(T.address_of(dk[0]), T.address_of(smem[base + k_at(stage) + wg * 32]),
                                              1, 1024 >> 4, SWIZZLE_128B)
        T.ptx.wgmma.fence.sync.aligned()
        # warpgroup w takes k-steps 2 w and 2 w + 1 of each 64-feature column block: 32 bytes a
        # step into a swizzled row, a whole column block every 4 steps (16-byte units)
        for blk in T.unroll(W // 64):
            for kk in T.unroll(2):
                T.evaluate(mma_qk(*[sacc[i] for i in range(NS * 4)], dq[0] + T.uint64(blk * ROWS * 8 + kk * 2),
                                  dk[0] + T.uint64(blk * KC * 8 + kk * 2), blk + kk > 0, 1, 1, 0, 0))
        T.ptx.wgmma.commit_group.sync.aligned()

    @T.macro
    def values(smem, base, oacc, pa, dv, stage, wg):
        """Issue ``oacc += P V`` over this warpgroup's output columns (asynchronous; one
        group). V is MN-major: the leading offset steps to the next 64-column block."""
        T.cuda.wgmma.encode_matrix_descriptor(T.address_of(dv[0]),
                                              T.address_of(smem[base + k_at(stage) + wg * (DVH // 64) * KC * 64]),
                                              (KC * 128) >> 4, 1024 >> 4, SWIZZLE_128B)
        T.ptx.wgmma.fence.sync.aligned()
        for kk in T.unroll(KC // 16):
            T.evaluate(mma_pv(*[oacc[i] for i in range(NO * 4)], pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2],
                              pa[4 * kk + 3], dv[0] + T.uint64(kk * (16 * 128 >> 4)), True, 1, 1, 1))
        T.ptx.wgmma.commit_group.sync.aligned()

    @T.macro
    def exchange(xs, sacc, wg, tx):
        """Add the other warpgroup's partial scores (the same elements, its thread tx +- 128)."""
        for x in T.unroll(NS * 4):
            xs[wg, x, tx % WG_THREADS] = sacc[x]
        T.evaluate(T.tvm_storage_sync("shared"))
        for x in T.unroll(NS * 4):
            sacc[x] = sacc[x] + xs[1 - wg, x, tx % WG_THREADS]

    @T.macro
    def to_probs(sacc, m2, l2, alpha, red, lim, c, kv_len, q_len, tile0, causal, scale, t):
        """Chunk c's scores -> masked probabilities folded into (m2, l2); the rows' rescale
        factors in ``alpha``. Masks only in chunks past kv_len or the first token's diagonal."""
        if T.Or(c * KC + KC > kv_len, T.And(causal > 0, c * KC + KC - 1 > kv_len - q_len + tile0)):
            for nn in T.unroll(NS):
                for e in T.unroll(4):
                    sacc[nn * 4 + e] = T.if_then_else(c * KC + nn * 8 + 2 * t + e % 2 < lim[e // 2],
                                                      sacc[nn * 4 + e] * scale, NEG_INF)
        else:
            for x in T.unroll(NS * 4):
                sacc[x] = sacc[x] * scale
        fold(sacc, m2, l2, alpha, red)

    @T.macro
    def pack(sacc, pa):
        """P in the dtype: the A fragments of ``P V``."""
        for x in T.unroll(NS * 2):
            T.evaluate(cvt_pair(pa[x], sacc[2 * x + 1], sacc[2 * x]))

    @T.macro
    def store(ws_o, ws_lse, oacc, m2, l2, inv, qrow0, hg, split, nq, row0, wg, g, t):
        """This warpgroup's output columns and (warpgroup 0) the rows' LSE into the workspace."""
        for hr in T.unroll(2):
            l2[hr] = l2[hr] + shfl(l2[hr], 1)
            l2[hr] = l2[hr] + shfl(l2[hr], 2)
            inv[hr] = T.if_then_else(l2[hr] > ZERO, ONE / l2[hr], ZERO)
        for hr in T.unroll(2):
            if (row0 + g + hr * 8) // HG < nq:
                for nn in T.unroll(NO):
                    for e in T.unroll(2):
                        ws_o[(qrow0 + (row0 + g + hr * 8) // HG) * Hq + hg * HG + (row0 + g + hr * 8) % HG, split,
                             wg * DVH + nn * 8 + 2 * t + e] = oacc[nn * 4 + hr * 2 + e] * inv[hr]
                if T.And(wg == 0, t == 0):
                    ws_lse[(qrow0 + (row0 + g + hr * 8) // HG) * Hq + hg * HG + (row0 + g + hr * 8) % HG,
                           split] = T.if_then_else(l2[hr] > ZERO, m2[hr] + T.log2(l2[hr]), NEG_INF)

    @T.macro
    def ring(smem, base, xs, nxt, sacc, oacc, pa, dq, dk, dv, m2, l2, alpha, red, lim, pages, page_indices,
             page0, c_lo, c_hi, kv_len, q_len, tile0, causal, scale, wg, t, tx):
        """The chunks c_lo .. c_hi in the ring: chunk c in stage (c - c_lo) % S. Trip c looks
        up the pages of chunk c + S while the tensor cores work, and copies it at its end."""
        if c_lo < c_hi:  # chunk c_lo's probabilities, before the loop
            T.evaluate(T.ptx["cp.async.wait_group"](S - 1))
            T.ptx.fence.proxy.async_()
        T.evaluate(T.tvm_storage_sync("shared"))
        if c_lo < c_hi:
            scores(smem, base, sacc, dq, dk, 0, wg)
            T.ptx.wgmma.wait_group.sync.aligned(0)
            fence_registers(sacc, NS * 4, *FENCES["float32"])
            exchange(xs, sacc, wg, tx)
            to_probs(sacc, m2, l2, alpha, red, lim, c_lo, kv_len, q_len, tile0, causal, scale, t)
            pack(sacc, pa)
        # the loop body issues the same wgmma groups on every trip (the last chunk is peeled off)
        for c in T.serial(c_lo, T.max(c_hi - 1, c_lo)):
            T.evaluate(T.ptx["cp.async.wait_group"](S - 2))  # chunk c + 1 has landed
            T.ptx.fence.proxy.async_()
            T.evaluate(T.tvm_storage_sync("shared"))
            scores(smem, base, sacc, dq, dk, (c + 1 - c_lo) % S, wg)
            values(smem, base, oacc, pa, dv, (c - c_lo) % S, wg)
            lookup(nxt, page_indices, page0, (c + S) * KC, kv_len, tx)
            T.ptx.wgmma.wait_group.sync.aligned(1)
            fence_registers(sacc, NS * 4, *FENCES["float32"])
            exchange(xs, sacc, wg, tx)
            to_probs(sacc, m2, l2, alpha, red, lim, c + 1, kv_len, q_len, tile0, causal, scale, t)
            T.ptx.wgmma.wait_group.sync.aligned(0)
            fence_registers(oacc, NO * 4, *FENCES["float32"])
            fence_registers(pa, NS * 2, *FENCES["uint32"])
            rescale(oacc, alpha)
            pack(sacc, pa)
            # both warpgroups are done with chunk c's stage and the exchanged scores: refill
            T.evaluate(T.tvm_storage_sync("shared"))
            if c + S < c_hi:
                load_kv(smem, base, nxt, (c - c_lo) % S, pages, (c + S) * KC, kv_len, tx)
            else:
                T.evaluate(T.ptx["cp.async.commit_group"]())
        if c_lo < c_hi:  # the last chunk's P V
            values(smem, base, oacc, pa, dv, (c_hi - 1 - c_lo) % S, wg)
            T.ptx.wgmma.wait_group.sync.aligned(0)
            fence_registers(oacc, NO * 4, *FENCES["float32"])
        T.evaluate(T.ptx["cp.async.wait_group"](0))  # no copy outlives the block

    @T.macro
    def block(q, pages, page_indices, ws_o, ws_lse, tile0, hg, split, nsplit, qbeg, q_len, page0, kv_len, causal,
              sm_scale, tx):
        smem = T.sblock_alloc_buffer((tile.shared_elems,), dtype, scope="shared.dyn")
        xs = T.sblock_alloc_buffer((2, NS * 4, WG_THREADS), "float32", scope="shared")
        nxt = T.sblock_alloc_buffer((1,), "int32", scope="local")  # page of this thread's row of the next copy
        sacc = T.sblock_alloc_buffer((NS * 4,), "float32", scope="local")
        oacc = T.sblock_alloc_buffer((NO * 4,), "float32", scope="local")
        pa = T.sblock_alloc_buffer((NS * 2,), "uint32", scope="local")
        dq = T.sblock_alloc_buffer((1,), "uint64", scope="local")
        dk = T.sblock_alloc_buffer((1,), "uint64", scope="local")
        dv = T.sblock_alloc_buffer((1,), "uint64", scope="local")
        m2 = T.sblock_alloc_buffer((2,), "float32", scope="local")
        l2 = T.sblock_alloc_buffer((2,), "float32", scope="local")
        alpha = T.sblock_alloc_buffer((2,), "float32", scope="local")
        red = T.sblock_alloc_buffer((2,), "float32", scope="local")
        lim = T.sblock_alloc_buffer((2,), "int32", scope="local")
        base: T.let[T.int32] = aligned_base(smem)
        wg: T.let[T.int32] = tx // WG_THREADS
        row0: T.let[T.int32] = tx % WG_THREADS // 32 * 16
        g: T.let[T.int32] = tx % 32 // 4
        t: T.let[T.int32] = tx % 4
        nq: T.let[T.int32] = T.min(TQ, q_len - tile0)
        # the tile's chunks (causal: up to its last token's diagonal), split evenly
        c_end: T.let[T.int32] = T.if_then_else(causal > 0, ceildiv(T.max(kv_len - q_len + tile0 + nq, 0), KC),
                                               ceildiv(kv_len, KC))
        per: T.let[T.int32] = ceildiv(c_end, nsplit)
        c_lo: T.let[T.int32] = T.min(split * per, c_end)
        c_hi: T.let[T.int32] = T.if_then_else(nq > 0, T.min(c_lo + per, c_end), c_lo)
        for hr in T.unroll(2):  # first key row g / g + 8 does not see (causal: past its own position)
            lim[hr] = T.if_then_else(causal > 0,
                                     T.min(kv_len, kv_len - q_len + tile0 + (row0 + g + hr * 8) // HG + 1), kv_len)
        load_q(smem, base, q, qbeg + tile0, hg, nq, tx)
        for s in T.unroll(S):
            lookup(nxt, page_indices, page0, (c_lo + s) * KC, kv_len, tx)
            if c_lo + s < c_hi:
                load_kv(smem, base, nxt, s, pages, (c_lo + s) * KC, kv_len, tx)
            else:
                T.evaluate(T.ptx["cp.async.commit_group"]())
        for hr in T.unroll(2):
            m2[hr] = NEG_INF
            l2[hr] = ZERO
        for x in T.unroll(NO * 4):
            oacc[x] = ZERO
        ring(smem, base, xs, nxt, sacc, oacc, pa, dq, dk, dv, m2, l2, alpha, red, lim, pages, page_indices,
             page0, c_lo, c_hi, kv_len, q_len, tile0, causal, sm_scale * LOG2E, wg, t, tx)
        store(ws_o, ws_lse, oacc, m2, l2, alpha, qbeg + tile0, hg, split, nq, row0, wg, g, t)

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
                        found = T.sblock_alloc_buffer((3,), "int32", scope="local")
                        find_tile(qo_indptr, B, bx // NHG, TQ, found)
                        # blocks past the last tile have nothing to do (a loop of 0 / 1 trips: TVM
                        # plans no barriers inside conditions)
                        for _tile in T.serial(T.if_then_else(found[0] >= 0, 1, 0)):
                            # the sequence's scalars in registers: the asm statements (copies,
                            # fences, barriers) clobber memory, so loads of them would repeat
                            b: T.let[T.int32] = found[0]
                            tile0: T.let[T.int32] = found[1]
                            qbeg: T.let[T.int32] = qo_indptr[b]
                            q_len: T.let[T.int32] = qo_indptr[b + 1] - qbeg
                            page0: T.let[T.int32] = page_indptr[b]
                            kv_len: T.let[T.int32] = paged_kv_len(page_indptr[b + 1] - page0, ps, length_info, b,
                                                                  False)
                            block(q, pages, page_indices, ws_o, ws_lse, tile0, bx % NHG, by, nsplit, qbeg, q_len,
                                  page0, kv_len, causal, sm_scale, tx)
        merge(ws_o, ws_lse, o, lse, total_q * Hq, nsplit)

    return run
