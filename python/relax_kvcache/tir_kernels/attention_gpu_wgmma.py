"""The ring prefill tile (CUDA float16 / bfloat16): warpgroup MMA on sm_90a, ``mma.sync``
without it (design: ``docs/kernels.md``).

A block is ``warpgroups`` consumer groups of 4 warps; warp i of group w owns query rows ``64 w +
16 i .. + 16`` (GQA packed). The query tile and a ring of ``stages`` K/V chunks live in dynamic
shared memory in the 128-byte swizzled layout (:func:`sw128`). Accumulators have the
``mma.sync`` layout either way (:func:`~.attention_gpu_mma.fold_scores`).

On sm_90a the block is warp-specialized (FlashAttention-3's design): one more warpgroup, the
producer, copies Q and the K/V chunks into the ring with few registers; the consumers wait for
each chunk on a shared-memory barrier, free its stage on another, and take turns issuing their
matrix products (ping-pong), so that one group's softmax runs while the other's products do.
Elsewhere every thread copies and computes, with one block barrier per chunk.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from tvm.script import tirx as T

from .attention_gpu_decode_mma import FP8X2_TO_HALF2
from .attention_gpu_mma import fold_scores, ldmatrix_x4, mma_m16n8k16, rescale_rows, shfl_xor
from .hopper import (ALIGN_ELEMS, FENCES, MBAR_ARRIVE, MBAR_INIT, MBAR_WAIT, SWIZZLE_128B, WG_ROWS, WG_THREADS, call,
                     aligned_base, fence_registers, ping_pong, ptx, register_budgets, sw128)
from .macros import LOG2E, NEG_INF, ONE, ZERO, ceildiv, query_position_range
from .schedule import GpuSchedule
from .spec import AttentionSpec



@dataclasses.dataclass(frozen=True, kw_only=True)
class WgmmaTileShape:
    """A warpgroup-MMA tile: ``rows = 64 * warpgroups`` query rows (``q_tokens`` tokens x group
    heads, padded), ``kv_chunk`` KV rows per step, a ring of ``stages`` K/V chunks. ``sync``:
    on ``mma.sync``; ``producer``: warp-specialized, the producer warpgroup keeping
    ``producer_regs`` registers a thread; ``pingpong``: the consumers take turns issuing."""

    rows: int
    q_tokens: int
    kv_chunk: int
    warpgroups: int
    stages: int
    head_dim: int
    sync: bool = False
    producer: bool = False
    pingpong: bool = False
    producer_regs: int = 80

    @property
    def threads(self) -> int:
        """Threads of a block: the consumer warpgroups, and the producer's where there is one."""
        return (self.warpgroups + self.producer) * WG_THREADS

    @property
    def loaders(self) -> int:
        """Threads that copy Q and K/V into shared memory: the producer's, or every thread."""
        return WG_THREADS if self.producer else self.threads

    @property
    def shared_elems(self) -> int:
        """16-bit elements of the shared buffer: Q tile, K/V ring, alignment slack."""
        return self.rows * self.head_dim + 2 * self.stages * self.kv_chunk * self.head_dim + ALIGN_ELEMS

    @property
    def shared_bytes(self) -> int:
        """Shared memory of a block: the buffer and the producer's barriers (two per stage)."""
        return 2 * self.shared_elems + (16 * self.stages if self.producer else 0)

    @staticmethod
    def choose(spec: AttentionSpec, sched: GpuSchedule, one_source: bool = True) -> Optional["WgmmaTileShape"]:
        """The shape for ``spec``, or None where the ring tile does not apply (no tensor cores,
        float32, 8-bit pages without the hardware conversion or of a bfloat16 model, head dims
        other than 64 / 128 / 256 or unequal, groups wider than the tile).
        Without ``wgmma`` (sm_80 - sm_89, sm_90 without ``a``) the tile runs ``mma.sync``. The
        producer warpgroup serves 16-bit K/V from one source (ragged rows or pages): 8-bit pages
        (converted by the copying threads) and the prefixed kernel's two sources measured
        faster with every thread copying."""
        G, D = spec.group_size, spec.qk_head_dim
        if not (sched.wgmma or sched.mma) or spec.dtype not in ("float16", "bfloat16"):
            return None
        if spec.quantized and not (sched.fp8_convert and spec.dtype == "float16"):
            return None
        if D != spec.v_head_dim or D not in (64, 128, 256):
            return None
        warpgroups = sched.wgmma_warpgroups
        rows = warpgroups * WG_ROWS
        if G > rows:
            return None
        widest = 128 if D <= 128 else 64
        chunks = [sched.wgmma_kv_chunk] if sched.wgmma_kv_chunk else [widest, widest // 2]
        for chunk in chunks:  # the widest chunk, then the deepest ring, that fits
            for stages in range(sched.wgmma_stages, 1, -1):
                shape = WgmmaTileShape(rows=rows, q_tokens=rows // G, kv_chunk=chunk, warpgroups=warpgroups,
                                       stages=stages, head_dim=D, sync=not sched.wgmma,
                                       producer=bool(sched.wgmma_producer and sched.wgmma and warpgroups == 2
                                                     and one_source and not spec.quantized),
                                       pingpong=bool(sched.wgmma_pingpong),
                                       producer_regs=sched.wgmma_producer_regs)
                if shape.shared_bytes <= sched.dynamic_shared_bytes:
                    return shape
        return None


def make_wgmma_tile(spec: AttentionSpec, shape: WgmmaTileShape, io, kv_rows):
    """The work item of one ring-tile block (same arguments as the other tiles; ``io``: its
    :class:`~.attention_gpu.TileIO`, ``kv_rows``: :func:`~.macros.paged_kv_rows`'s triple)."""
    locate, elem_at, elem_new = kv_rows
    one_source = elem_new is None
    G, D, dtype = spec.group_size, spec.qk_head_dim, spec.dtype
    R, TQ, KC, S = shape.rows, shape.q_tokens, shape.kv_chunk, shape.stages
    NS, NO = KC // 8, D // 8  # accumulator n-tiles of S and O
    PIECES = D // 8  # 16-byte pieces of a row
    LT = shape.loaders
    Q_IT, KV_IT = ceildiv(R * PIECES, LT), ceildiv(KC * PIECES, LT)
    KV_OFF = R * D  # the ring after the Q tile; stage s: K at KV_OFF + 2 s KC D, V after it
    ab = "f16" if dtype == "float16" else "bf16"
    mma_qk = ptx(f"wgmma.mma_async.sync.aligned.m64n{KC}k16.f32.{ab}.{ab}")
    mma_pv = ptx(f"wgmma.mma_async.sync.aligned.m64n{D}k16.f32.{ab}.{ab}")
    cvt_pair = ptx(f"cvt.rn.{ab}x2.f32")
    visible, chunk_range = io.visible, io.chunk_range
    fold, rescale, shfl = fold_scores(NS), rescale_rows(NO), shfl_xor
    local = spec.is_local  # window / chunk masks: every chunk is masked by the general predicate
    SYNC = shape.sync
    PRODUCER, WGS = shape.producer, shape.warpgroups
    PINGPONG = shape.pingpong
    REGS_CONSUMER, REGS_PRODUCER = register_budgets(shape.producer_regs)
    first_turn, my_turn, your_turn = ping_pong(PINGPONG)
    Q_REGS = D <= 128  # mma.sync: the query fragments stay in registers (64 per lane at most)
    mma, ldmatrix = mma_m16n8k16(dtype), ldmatrix_x4(dtype)

    def k_at(stage):
        return KV_OFF + 2 * stage * KC * D

    def qk(sacc, dq, dk, kk):
        # k-step kk: 32 bytes into a swizzled row, a whole column block every 4 steps
        return mma_qk(*[sacc[i] for i in range(NS * 4)],
                      dq[0] + T.uint64((kk // 4) * (R * 128 >> 4) + (kk % 4) * 2),
                      dk[0] + T.uint64((kk // 4) * (KC * 128 >> 4) + (kk % 4) * 2),
                      kk > 0, 1, 1, 0, 0)

    def pv(oacc, pa, dv, kk):
        # k-step kk: 16 V rows of 128 bytes further
        return mma_pv(*[oacc[i] for i in range(NO * 4)], pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2],
                      pa[4 * kk + 3], dv[0] + T.uint64(kk * (16 * 128 >> 4)), True, 1, 1, 1)

    @T.macro
    def copy16(smem, dst, src_elem, full):
        """Start a 16-byte copy from the element ``src_elem`` to ``smem[dst]`` (zeros unless
        ``full``)."""
        T.evaluate(T.ptx["cp.async.cg.shared.global"](
            T.address_of(smem[dst]), T.address_of(src_elem), 16, T.Cast("uint32", T.if_then_else(full, 16, 0))))

    @T.macro
    def load_q(smem, base, q, h, qbeg, tile0, nq, tx):
        """Copy the query tile: row r = token tile0 + r // G, head h G + r % G (zeros past nq
        tokens)."""
        for it in T.unroll(Q_IT):
            if it * LT + tx < R * PIECES:
                r: T.let[T.int32] = (it * LT + tx) // PIECES
                c: T.let[T.int32] = (it * LT + tx) % PIECES * 8
                copy16(smem, base + sw128(r, c, R),
                       q[qbeg + tile0 + T.min(r // G, T.max(nq - 1, 0)), h * G + r % G, c], r // G < nq)

    ps, fmt = spec.page_size, spec.kv_dtype

    @T.macro
    def convert8(smem, dst, kv_src, h, slot, kv: int, c, full, cw):
        """8-bit pages: the 8 bytes of (slot, kv, dims c .. c + 8) as float16 at ``smem[dst ..]``
        (zeros unless ``full``), synchronously: two 32-bit loads, the hardware conversion (the
        scales apply to the scores and the output)."""
        for w in T.unroll(2):
            cw[2] = T.if_then_else(full, T.reinterpret("uint32", kv_src[0][slot // ps, kv, h, slot % ps,
                                                                          T.ramp(c + 4 * w, 1, 4)]), T.uint32(0))
            T.evaluate(FP8X2_TO_HALF2[fmt](cw[0], T.Cast("uint16", cw[2])))
            T.evaluate(FP8X2_TO_HALF2[fmt](cw[1], T.Cast("uint16", T.shift_right(cw[2], T.uint32(16)))))
            smem[T.ramp(dst + 4 * w, 1, 2)] = T.reinterpret("float16x2", cw[0])
            smem[T.ramp(dst + 4 * w + 2, 1, 2)] = T.reinterpret("float16x2", cw[1])

    def k_scaled(sm_scale, kv_src, h):
        """The score scale: times the K scale over 8-bit pages (their rows are staged unscaled)."""
        return sm_scale * kv_src[5][0, h] if spec.quantized else sm_scale

    def v_scaled(inv, kv_src, h):
        """The output's normalizer: times the V scale over 8-bit pages."""
        return inv * kv_src[5][1, h] if spec.quantized else inv

    @T.macro
    def copy_row(smem, dst, elem, kv_src, h, slot, c, full):
        """Copy 16 bytes of K and of V of a slot (read with ``elem``) to ``smem[dst]`` and
        ``smem[dst + KC D]``."""
        copy16(smem, dst, elem(kv_src, h, slot, 0, c), full)
        copy16(smem, dst + KC * D, elem(kv_src, h, slot, 1, c), full)

    @T.macro
    def stage_row(smem, dst, elem, kv_src, h, slot, c, full, cw):
        """:func:`copy_row`, or for 8-bit pages :func:`convert8` of K and V."""
        if spec.quantized:
            convert8(smem, dst, kv_src, h, slot, 0, c, full, cw)
            convert8(smem, dst + KC * D, kv_src, h, slot, 1, c, full, cw)
        else:
            copy_row(smem, dst, elem, kv_src, h, slot, c, full)

    @T.macro
    def load_kv(smem, base, stage, kv_src, h, j0, seq, tx, cw):
        """Start copying KV rows j0 .. j0 + KC into ring stage ``stage`` (zeros past kv_len =
        ``seq[2]``; 8-bit pages are converted here and now), then close the copy group."""
        for it in T.unroll(KV_IT):
            if it * LT + tx < KC * PIECES:
                r: T.let[T.int32] = (it * LT + tx) // PIECES
                c: T.let[T.int32] = (it * LT + tx) % PIECES * 8
                slot: T.let[T.int32] = locate(kv_src, T.max(T.min(j0 + r, seq[2] - 1), 0), seq)
                if one_source:
                    stage_row(smem, base + k_at(stage) + sw128(r, c, KC), elem_at, kv_src, h, slot, c,
                              j0 + r < seq[2], cw)
                else:
                    if slot >= 0:
                        stage_row(smem, base + k_at(stage) + sw128(r, c, KC), elem_at, kv_src, h, slot, c,
                                  j0 + r < seq[2], cw)
                    else:
                        copy_row(smem, base + k_at(stage) + sw128(r, c, KC), elem_new, kv_src, h, slot, c,
                                 j0 + r < seq[2])
        T.evaluate(T.ptx["cp.async.commit_group"]())

    @T.macro
    def mask_by_limit(sacc, scale, j0, lim, t):
        """Scale the scores; -inf at and past each row's first invisible key (``lim``: rows g,
        g + 8): the causal diagonal and the end of the sequence."""
        for nn in T.unroll(NS):
            for e in T.unroll(4):
                sacc[nn * 4 + e] = T.if_then_else(j0 + nn * 8 + 2 * t + e % 2 < lim[e // 2],
                                                  sacc[nn * 4 + e] * scale, NEG_INF)

    @T.macro
    def mask(sacc, scale, j0, nt, nq, vis_src, row0, g, t):
        """Scale the scores; -inf where (row, key) is invisible or past the chunk's nt rows."""
        for nn in T.unroll(NS):
            for e in T.unroll(4):
                sacc[nn * 4 + e] = T.if_then_else(
                    T.And(nn * 8 + 2 * t + e % 2 < nt,
                          visible(vis_src[0], vis_src[1], vis_src[2], vis_src[3], vis_src[4], vis_src[5],
                                  vis_src[6], vis_src[7] + T.min((row0 + g + e // 2 * 8) // G, T.max(nq - 1, 0)),
                                  T.min(j0 + nn * 8 + 2 * t + e % 2, vis_src[4] - 1))),
                    sacc[nn * 4 + e] * scale, NEG_INF)

    @T.macro
    def store(out, oacc, m2, l2, inv, h, qbeg, tile0, nq, row0, g, t, kv_src):
        for hr in T.unroll(2):
            l2[hr] = l2[hr] + shfl(l2[hr], 1)
            l2[hr] = l2[hr] + shfl(l2[hr], 2)
            inv[hr] = T.if_then_else(l2[hr] > ZERO, v_scaled(ONE / l2[hr], kv_src, h), ZERO)
        for hr in T.unroll(2):
            if T.And((row0 + g + hr * 8) // G < nq, row0 + g + hr * 8 < TQ * G):
                for nn in T.unroll(NO):
                    for e in T.vectorized(2):
                        out[0][qbeg + tile0 + (row0 + g + hr * 8) // G, h * G + (row0 + g + hr * 8) % G,
                               nn * 8 + 2 * t + e] = T.Cast(dtype, oacc[nn * 4 + hr * 2 + e] * inv[hr])
                if t == 0:
                    out[1][qbeg + tile0 + (row0 + g + hr * 8) // G, h * G + (row0 + g + hr * 8) % G] = T.if_then_else(
                        l2[hr] > ZERO, m2[hr] + T.log2(l2[hr]), NEG_INF)

    @T.macro
    def scores(smem, base, sacc, dq, dk, c, c_lo, wg):
        """Issue ``sacc = Q K_c^T`` (asynchronous; one commit group)."""
        T.cuda.wgmma.encode_matrix_descriptor(T.address_of(dq[0]), T.address_of(smem[base + wg * WG_ROWS * 64]),
                                              1, 1024 >> 4, SWIZZLE_128B)
        T.cuda.wgmma.encode_matrix_descriptor(T.address_of(dk[0]), T.address_of(smem[base + k_at((c - c_lo) % S)]),
                                              1, 1024 >> 4, SWIZZLE_128B)
        T.ptx.wgmma.fence.sync.aligned()
        for kk in T.unroll(D // 16):
            T.evaluate(qk(sacc, dq, dk, kk))
        T.ptx.wgmma.commit_group.sync.aligned()

    @T.macro
    def values(smem, base, oacc, pa, dv, c, c_lo):
        """Issue ``oacc += P V_c`` with P in ``pa`` (asynchronous; one commit group)."""
        # V is MN-major: the leading offset steps to the next 64-column block
        T.cuda.wgmma.encode_matrix_descriptor(T.address_of(dv[0]),
                                              T.address_of(smem[base + k_at((c - c_lo) % S) + KC * D]),
                                              (KC * 128) >> 4, 1024 >> 4, SWIZZLE_128B)
        T.ptx.wgmma.fence.sync.aligned()
        for kk in T.unroll(KC // 16):
            T.evaluate(pv(oacc, pa, dv, kk))
        T.ptx.wgmma.commit_group.sync.aligned()

    @T.macro
    def to_probs(sacc, m2, l2, alpha, red, lim, c, kv_len, q_len, tile0, nq, causal, vis_src, sm_scale, row0, g,
                 t):
        """Chunk c's scores (complete in ``sacc``) -> masked probabilities, folded into (m2,
        l2); the rows' rescale factors in ``alpha``."""
        if local:  # windows and attention chunks: the general predicate, on every chunk
            mask(sacc, sm_scale * LOG2E, c * KC, T.min(KC, kv_len - c * KC), nq, vis_src, row0, g, t)
        elif T.Or(c * KC + KC > kv_len, T.And(causal > 0, c * KC + KC - 1 > kv_len - q_len + tile0)):
            mask_by_limit(sacc, sm_scale * LOG2E, c * KC, lim, t)
        else:
            for x in T.unroll(NS * 4):
                sacc[x] = sacc[x] * (sm_scale * LOG2E)
        fold(sacc, m2, l2, alpha, red)

    @T.macro
    def pack(sacc, pa):
        """P in the dtype: the A fragments of ``P V`` (only once the previous ``P V``, which
        reads ``pa`` asynchronously, has completed)."""
        for x in T.unroll(NS * 2):
            T.evaluate(cvt_pair(pa[x], sacc[2 * x + 1], sacc[2 * x]))

    @T.macro
    def q_fragments(smem, base, qf, kk, row0, lane):
        """qf[8 kk : 8 kk + 8] (or qf[0 : 8]) = this warp's A fragments of Q over k-step kk:
        matrices rows 0-7 / 8-15 x columns 0-7, then the same x columns 8-15."""
        T.evaluate(ldmatrix(qf, smem, base + sw128(row0 + lane % 16, kk * 16 + lane // 16 * 8, R), trans=False,
                            at=kk * 8 if Q_REGS else 0))

    @T.macro
    def scores_sync(smem, base, sacc, qf, bf, c, c_lo, row0, lane):
        """sacc = Q K_c^T with ``mma.sync``: per k-step, one ``ldmatrix`` of K per two n-tiles
        (matrices: key rows 0-7 x columns 0-7 / 8-15, then rows 8-15 x the same)."""
        for x in T.unroll(NS * 4):
            sacc[x] = ZERO
        for kk in T.unroll(D // 16):
            if not Q_REGS:
                q_fragments(smem, base, qf, kk, row0, lane)
            for p in T.unroll(NS // 2):
                T.evaluate(ldmatrix(bf, smem, base + k_at((c - c_lo) % S)
                                    + sw128(p * 16 + lane // 16 * 8 + lane % 8, kk * 16 + lane % 16 // 8 * 8, KC),
                                    trans=False))
                T.evaluate(mma(qf, bf, sacc, 2 * p, a_at=kk * 8 if Q_REGS else 0, b_at=0))
                T.evaluate(mma(qf, bf, sacc, 2 * p + 1, a_at=kk * 8 if Q_REGS else 0, b_at=4))

    @T.macro
    def values_sync(smem, base, oacc, pa, vf, c, c_lo, lane):
        """oacc += P V_c with ``mma.sync``: V's B fragments by ``ldmatrix.trans`` (matrices: key
        rows 0-7 / 8-15 x columns 0-7, then the same x columns 8-15)."""
        for kk in T.unroll(KC // 16):
            for p in T.unroll(NO // 2):
                T.evaluate(ldmatrix(vf, smem, base + k_at((c - c_lo) % S) + KC * D
                                    + sw128(kk * 16 + lane % 16, p * 16 + lane // 16 * 8, KC), trans=True))
                T.evaluate(mma(pa, vf, oacc, 2 * p, a_at=4 * kk, b_at=0))
                T.evaluate(mma(pa, vf, oacc, 2 * p + 1, a_at=4 * kk, b_at=4))

    @T.macro
    def chunk_ready(tx):
        """Every thread's copies of the next chunk have landed (one newer group may be in
        flight); the fence makes them visible to the tensor cores' (async) proxy."""
        T.evaluate(T.ptx["cp.async.wait_group"](S - 2))
        T.ptx.fence.proxy.async_()
        T.evaluate(T.tvm_storage_sync("shared"))

    @T.macro
    def ring_sync(smem, base, sacc, oacc, pa, qf, bf, vf, m2, l2, alpha, red, lim, c_lo, c_hi, kv_src, h, qbeg, q_len,
                  tile0, kv_len, nq, causal, vis_src, sm_scale, row0, g, t, tx, cw):
        """The chunks on ``mma.sync``. Each trip waits for chunk c (over-waiting by one group on
        the first trip), and after the barrier, at which every warp is done with chunk c - 1,
        refills that stage with chunk c - 1 + S: one barrier per chunk, S - 1 chunks in flight."""
        if Q_REGS:
            T.evaluate(T.ptx["cp.async.wait_group"](S - 1))
            T.evaluate(T.tvm_storage_sync("shared"))
            for kk in T.unroll(D // 16):
                q_fragments(smem, base, qf, kk, row0, tx % 32)
        for c in T.serial(c_lo, c_hi):
            T.evaluate(T.ptx["cp.async.wait_group"](S - 2))
            T.evaluate(T.tvm_storage_sync("shared"))
            if c > c_lo:
                if c - 1 + S < c_hi:
                    load_kv(smem, base, (c - 1 - c_lo) % S, kv_src, h, (c - 1 + S) * KC, (qbeg, q_len, kv_len), tx, cw)
                else:
                    T.evaluate(T.ptx["cp.async.commit_group"]())
            scores_sync(smem, base, sacc, qf, bf, c, c_lo, row0, tx % 32)
            to_probs(sacc, m2, l2, alpha, red, lim, c, kv_len, q_len, tile0, nq, causal, vis_src, sm_scale, row0, g,
                     t)
            rescale(oacc, alpha)
            pack(sacc, pa)
            values_sync(smem, base, oacc, pa, vf, c, c_lo, tx % 32)

    @T.macro
    def init_state(m2, l2, oacc):
        """No keys yet: running maxima -inf, sums and outputs 0."""
        for hr in T.unroll(2):
            m2[hr] = NEG_INF
            l2[hr] = ZERO
        for x in T.unroll(NO * 4):
            oacc[x] = ZERO

    @T.macro
    def fold_first(sacc, pa, m2, l2, alpha, red, lim, c, kv_len, q_len, tile0, nq, causal, vis_src, sm_scale, row0,
                   g, t):
        """Once chunk c's issued ``Q K^T`` is done: its probabilities, packed for its ``P V``."""
        T.ptx.wgmma.wait_group.sync.aligned(0)
        fence_registers(sacc, NS * 4, *FENCES["float32"])
        to_probs(sacc, m2, l2, alpha, red, lim, c, kv_len, q_len, tile0, nq, causal, vis_src, sm_scale, row0, g, t)
        pack(sacc, pa)

    @T.macro
    def fold_next(sacc, oacc, pa, m2, l2, alpha, red, lim, c, kv_len, q_len, tile0, nq, causal, vis_src, sm_scale,
                  row0, g, t):
        """With chunk c's ``Q K^T`` and chunk c - 1's ``P V`` issued: chunk c's probabilities once
        its scores are done (the ``P V`` still running), then wait for the ``P V``."""
        T.ptx.wgmma.wait_group.sync.aligned(1)
        fence_registers(sacc, NS * 4, *FENCES["float32"])
        to_probs(sacc, m2, l2, alpha, red, lim, c, kv_len, q_len, tile0, nq, causal, vis_src, sm_scale, row0, g, t)
        T.ptx.wgmma.wait_group.sync.aligned(0)
        fence_registers(oacc, NO * 4, *FENCES["float32"])
        fence_registers(pa, NS * 2, *FENCES["uint32"])

    @T.macro
    def shared_ring(smem, base, q, out, sacc, oacc, pa, qf, bf, vf, dq, dk, dv, m2, l2, alpha, red, lim, cw, c_lo,
                    c_hi, kv_src, h, qbeg, q_len, tile0, kv_len, nq, causal, vis_src, sm_scale, row0, g, t, tx, wg):
        """Every thread copies and computes; one block barrier per chunk."""
        load_q(smem, base, q, h, qbeg, tile0, nq, tx)
        for s in T.unroll(S):
            if c_lo + s < c_hi:
                load_kv(smem, base, s, kv_src, h, (c_lo + s) * KC, (qbeg, q_len, kv_len), tx, cw)
            else:
                T.evaluate(T.ptx["cp.async.commit_group"]())
        init_state(m2, l2, oacc)
        if SYNC:
            ring_sync(smem, base, sacc, oacc, pa, qf, bf, vf, m2, l2, alpha, red, lim, c_lo, c_hi, kv_src, h, qbeg,
                      q_len, tile0, kv_len, nq, causal, vis_src, sm_scale, row0, g, t, tx, cw)
        else:
            if c_lo < c_hi:  # chunk c_lo's probabilities, before the loop
                T.evaluate(T.ptx["cp.async.wait_group"](S - 1))
                T.ptx.fence.proxy.async_()
            T.evaluate(T.tvm_storage_sync("shared"))
            if c_lo < c_hi:
                scores(smem, base, sacc, dq, dk, c_lo, c_lo, wg)
                fold_first(sacc, pa, m2, l2, alpha, red, lim, c_lo, kv_len, q_len, tile0, nq, causal, vis_src,
                           sm_scale, row0, g, t)
            # chunk c: P_c V_c runs on the tensor cores while chunk c + 1's scores are folded. The
            # loop body issues the same wgmma groups on every trip (the last chunk is peeled off):
            # otherwise ptxas cannot tell which group wait_group(1) leaves in flight and serializes.
            for c in T.serial(c_lo, T.max(c_hi - 1, c_lo)):
                chunk_ready(tx)
                scores(smem, base, sacc, dq, dk, c + 1, c_lo, wg)
                values(smem, base, oacc, pa, dv, c, c_lo)
                fold_next(sacc, oacc, pa, m2, l2, alpha, red, lim, c + 1, kv_len, q_len, tile0, nq, causal, vis_src,
                          sm_scale, row0, g, t)
                rescale(oacc, alpha)
                pack(sacc, pa)
                # every warpgroup is done with chunk c's stage: refill it with chunk c + S
                T.evaluate(T.tvm_storage_sync("shared"))
                if c + S < c_hi:
                    load_kv(smem, base, (c - c_lo) % S, kv_src, h, (c + S) * KC, (qbeg, q_len, kv_len), tx, cw)
                else:
                    T.evaluate(T.ptx["cp.async.commit_group"]())
            if c_lo < c_hi:  # the last chunk's P V (its data landed before its scores were taken)
                values(smem, base, oacc, pa, dv, c_hi - 1, c_lo)
                T.ptx.wgmma.wait_group.sync.aligned(0)
                fence_registers(oacc, NO * 4, *FENCES["float32"])
        T.evaluate(T.ptx["cp.async.wait_group"](0))  # no copy outlives the block
        store(out, oacc, m2, l2, alpha, h, qbeg, tile0, nq, row0, g, t, kv_src)

    @T.macro
    def arrive_full(bars, k, pending):
        """The producer's copies of chunk k have landed (all but ``pending`` newer groups) and are
        visible to the tensor cores: complete its stage's barrier."""
        T.evaluate(T.ptx["cp.async.wait_group"](pending))
        T.ptx.fence.proxy.async_()
        T.evaluate(call(MBAR_ARRIVE, T.address_of(bars[k % S])))

    @T.macro
    def produce(smem, base, bars, q, cw, c_lo, c_hi, kv_src, h, qbeg, q_len, tile0, kv_len, nq, tx):
        """The producer warpgroup: the query tile with chunk c_lo, then chunk after chunk into the
        ring, each once the consumers have freed its stage (``bars[S + stage]``); a chunk's
        ``bars[stage]`` completes once its copies have landed (and are visible to the tensor
        cores). Before it blocks on a stage, the chunk before is complete, so that the consumers
        can always go on."""
        T.evaluate(call(REGS_PRODUCER))
        for k in T.serial(c_hi - c_lo):
            if k >= S:
                arrive_full(bars, k - 1, 0)
                T.evaluate(call(MBAR_WAIT, T.address_of(bars[S + k % S]), T.Cast("uint32", (k // S - 1) % 2)))
            if k == 0:
                load_q(smem, base, q, h, qbeg, tile0, nq, tx)
            load_kv(smem, base, k % S, kv_src, h, (c_lo + k) * KC, (qbeg, q_len, kv_len), tx, cw)
            if T.And(k >= 1, k < S):
                arrive_full(bars, k - 1, 1)
        T.evaluate(T.ptx["cp.async.wait_group"](0))
        T.ptx.fence.proxy.async_()
        if c_lo < c_hi:
            T.evaluate(call(MBAR_ARRIVE, T.address_of(bars[(c_hi - c_lo - 1) % S])))

    @T.macro
    def chunk_landed(bars, c, c_lo):
        T.evaluate(call(MBAR_WAIT, T.address_of(bars[(c - c_lo) % S]), T.Cast("uint32", (c - c_lo) // S % 2)))
        T.ptx.fence.proxy.async_()

    @T.macro
    def consume(smem, base, bars, out, sacc, oacc, pa, dq, dk, dv, m2, l2, alpha, red, lim, c_lo, c_hi, kv_src, h,
                qbeg, q_len, tile0, kv_len, nq, causal, vis_src, sm_scale, row0, g, t, wg):
        """A consumer warpgroup: the loop of :func:`shared_ring` on wgmma, waiting for each chunk's
        barrier instead of the block's, and freeing each chunk's stage once its ``P V`` is done."""
        T.evaluate(call(REGS_CONSUMER))
        init_state(m2, l2, oacc)
        first_turn(wg, c_lo < c_hi)
        if c_lo < c_hi:
            chunk_landed(bars, c_lo, c_lo)
            my_turn(wg)
            scores(smem, base, sacc, dq, dk, c_lo, c_lo, wg)
            your_turn(wg, False)
            fold_first(sacc, pa, m2, l2, alpha, red, lim, c_lo, kv_len, q_len, tile0, nq, causal, vis_src, sm_scale,
                       row0, g, t)
        for c in T.serial(c_lo, T.max(c_hi - 1, c_lo)):
            chunk_landed(bars, c + 1, c_lo)
            my_turn(wg)
            scores(smem, base, sacc, dq, dk, c + 1, c_lo, wg)
            values(smem, base, oacc, pa, dv, c, c_lo)
            your_turn(wg, False)
            fold_next(sacc, oacc, pa, m2, l2, alpha, red, lim, c + 1, kv_len, q_len, tile0, nq, causal, vis_src,
                      sm_scale, row0, g, t)
            T.evaluate(call(MBAR_ARRIVE, T.address_of(bars[S + (c - c_lo) % S])))  # chunk c's stage is free
            rescale(oacc, alpha)
            pack(sacc, pa)
        if c_lo < c_hi:
            my_turn(wg)
            values(smem, base, oacc, pa, dv, c_hi - 1, c_lo)
            your_turn(wg, True)
            T.ptx.wgmma.wait_group.sync.aligned(0)
            fence_registers(oacc, NO * 4, *FENCES["float32"])
        store(out, oacc, m2, l2, alpha, h, qbeg, tile0, nq, row0, g, t, kv_src)

    @T.macro
    def specialized(smem, base, bars, q, out, sacc, oacc, pa, dq, dk, dv, m2, l2, alpha, red, lim, cw, c_lo, c_hi,
                    kv_src, h, qbeg, q_len, tile0, kv_len, nq, causal, vis_src, sm_scale, row0, g, t, tx, wg):
        """Warp-specialized ring: the last warpgroup produces (:func:`produce`), the others consume
        (:func:`consume`); stage s is filled once ``bars[s]`` completes and free once ``bars[S + s]``
        does (each completes once per use of the stage)."""
        if tx == 0:
            for s in T.unroll(S):
                T.evaluate(call(MBAR_INIT, T.address_of(bars[s]), T.uint32(WG_THREADS)))
                T.evaluate(call(MBAR_INIT, T.address_of(bars[S + s]), T.uint32(WGS * WG_THREADS)))
        T.evaluate(T.tvm_storage_sync("shared"))
        if wg == WGS:
            produce(smem, base, bars, q, cw, c_lo, c_hi, kv_src, h, qbeg, q_len, tile0, kv_len, nq,
                    tx - WGS * WG_THREADS)
        else:
            consume(smem, base, bars, out, sacc, oacc, pa, dq, dk, dv, m2, l2, alpha, red, lim, c_lo, c_hi, kv_src,
                    h, qbeg, q_len, tile0, kv_len, nq, causal, vis_src, sm_scale, row0, g, t, wg)

    @T.macro
    def tile(q, out, q_rope_position, kv_src, h, qbeg, q_len, tile0, kv_len, k_pos0, causal, sm_scale, tree_src,
             active, tx):
        smem = T.sblock_alloc_buffer((shape.shared_elems,), dtype, scope="shared.dyn")
        sacc = T.sblock_alloc_buffer((NS * 4,), "float32", scope="local")
        oacc = T.sblock_alloc_buffer((NO * 4,), "float32", scope="local")
        pa = T.sblock_alloc_buffer((NS * 2,), "uint32", scope="local")
        cw = T.sblock_alloc_buffer((3,), "uint32", scope="local")  # 8-bit pages: conversion registers
        dq = T.sblock_alloc_buffer((1,), "uint64", scope="local")
        dk = T.sblock_alloc_buffer((1,), "uint64", scope="local")
        dv = T.sblock_alloc_buffer((1,), "uint64", scope="local")
        m2 = T.sblock_alloc_buffer((2,), "float32", scope="local")
        l2 = T.sblock_alloc_buffer((2,), "float32", scope="local")
        alpha = T.sblock_alloc_buffer((2,), "float32", scope="local")
        red = T.sblock_alloc_buffer((2,), "float32", scope="local")
        bounds = T.sblock_alloc_buffer((2,), "int32", scope="local")
        lim = T.sblock_alloc_buffer((2,), "int32", scope="local")
        qf = T.sblock_alloc_buffer(((D // 16 if Q_REGS else 1) * 8,), dtype, scope="local")
        bf = T.sblock_alloc_buffer((8,), dtype, scope="local")
        vf = T.sblock_alloc_buffer((8,), dtype, scope="local")
        base: T.let[T.int32] = aligned_base(smem)
        wg: T.let[T.int32] = tx // WG_THREADS
        row0: T.let[T.int32] = wg * WG_ROWS + tx % WG_THREADS // 32 * 16
        g: T.let[T.int32] = tx % 32 // 4
        t: T.let[T.int32] = tx % 4
        nq: T.let[T.int32] = T.if_then_else(active, T.min(TQ, q_len - tile0), 0)
        if spec.is_local:
            query_position_range(bounds, q_rope_position, qbeg + tile0, nq)
        c_lo, c_end = chunk_range(q_rope_position, qbeg, tile0, nq, q_len, kv_len, k_pos0, causal, bounds)
        c_hi: T.let[T.int32] = T.if_then_else(active, c_end, c_lo)
        vis_src = (q_rope_position, tree_src, qbeg, q_len, kv_len, k_pos0, causal, tile0)
        for hr in T.unroll(2):  # first key row g / g + 8 does not see (causal: past its own position)
            lim[hr] = T.if_then_else(causal > 0, T.min(kv_len, kv_len - q_len + tile0 + (row0 + g + hr * 8) // G + 1),
                                     kv_len)
        # ring: chunk c in stage (c - c_lo) % S; S chunks in flight from the start (a group each)
        if PRODUCER:
            bars = T.sblock_alloc_buffer((2 * S,), "uint64", scope="shared")
            specialized(smem, base, bars, q, out, sacc, oacc, pa, dq, dk, dv, m2, l2, alpha, red, lim, cw, c_lo, c_hi,
                        kv_src, h, qbeg, q_len, tile0, kv_len, nq, causal, vis_src, sm_scale, row0, g, t, tx, wg)
        else:
            shared_ring(smem, base, q, out, sacc, oacc, pa, qf, bf, vf, dq, dk, dv, m2, l2, alpha, red, lim, cw,
                        c_lo, c_hi, kv_src, h, qbeg, q_len, tile0, kv_len, nq, causal, vis_src, sm_scale, row0, g,
                        t, tx, wg)

    @T.macro
    def attend_tile(q, out, q_rope_position, kv_src, h, qbeg, q_len, tile0, kv_len, k_pos0, causal,
                    rotary_mode, rope_scale, rope_theta, sm_scale, tree_src, active, tx):
        # the sequence's scalars in registers: the asm statements below (copies, fences,
        # barriers) clobber memory, so expressions that load them would be reloaded every use
        qbeg_: T.let[T.int32] = qbeg
        q_len_: T.let[T.int32] = q_len
        tile0_: T.let[T.int32] = tile0
        kv_len_: T.let[T.int32] = kv_len
        k_pos0_: T.let[T.int32] = k_pos0
        kv_base: T.let[T.int32] = kv_src[2]
        tile(q, out, q_rope_position, (kv_src[0], kv_src[1], kv_base) + tuple(kv_src[3:]), h, qbeg_, q_len_,
             tile0_, kv_len_, k_pos0_, causal, k_scaled(sm_scale, kv_src, h), tree_src, active, tx)

    return attend_tile
