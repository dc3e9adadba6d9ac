"""GPU schedule of decode attention (one query token per sequence), its grid and the merge of
its splits.

Blocks over (sequence x KV head, split), merged by LSE in a second kernel (which has nothing to do
where a batch fills the GPU without splits). The CUDA-core item
(FlashInfer's layout, :class:`DecodeShape`) serves inline RoPE and what the tensor-core item of
:mod:`.attention_gpu_decode_mma` does not. Design: ``docs/kernels.md``.
"""

from __future__ import annotations

import dataclasses

from tvm.script import tirx as T

from .attention_gpu_decode_mma import CHUNK as MMA_CHUNK
from .attention_gpu_decode_mma import decode_mma_applies, make_decode_mma_item
from .macros import (LOG2E, NEG_INF, ONE, ZERO, ceildiv, early_start, grid_dependency, rope_inv_freq_expr,
                     split_rows)
from .schedule import GpuSchedule
from .spec import AttentionSpec


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeShape:
    """Thread layout of a decode block (``threads = bdx * bdy * bdz``).

    Thread ``tx`` is lane ``tx % bdx`` of row group ``tx // bdx % bdy`` of head group
    ``tx // (bdx * bdy)``. A lane holds head_dim elements ``[lane * ek, (lane + 1) * ek)`` of K
    (``k_lanes`` per vector load) and ``[lane * ev, (lane + 1) * ev)`` of V; a head group holds
    ``rows`` query heads; each step a row group loads ``unroll`` KV rows.
    """

    bdx: int
    bdy: int
    bdz: int
    ek: int
    ev: int
    k_lanes: int
    v_lanes: int
    rows: int
    unroll: int

    @property
    def threads(self) -> int:
        return self.bdx * self.bdy * self.bdz

    @staticmethod
    def choose(spec: AttentionSpec, sched: GpuSchedule) -> "DecodeShape":
        D, DV, G = spec.qk_head_dim, spec.v_head_dim, spec.group_size
        bits = 32 if spec.dtype == "float32" else 16
        widest = max(1, min(sched.max_lanes, sched.vector_bytes * 8 // bits))
        # fewest lanes (a power of two, at most a warp) whose slices are at most one vector
        bdx = 1
        while bdx < sched.warp_size and D > bdx * widest:
            bdx *= 2
        while D % bdx or DV % bdx:
            bdx //= 2
        ek, ev = D // bdx, DV // bdx
        # query rows + accumulators in registers: at most 64 + 64 floats per thread, and at most
        # 4 rows (each row's score costs log2(bdx) warp shuffles per KV row: with 8 rows the
        # shuffles, not the loads, bound an 8:1 GQA decode), so wide groups are split over bdz
        # head groups (a block has at most 1024 threads)
        divisors = [z for z in range(1, G + 1) if G % z == 0 and bdx * z <= 1024]
        bdz = next((z for z in divisors if G // z <= 4 and (G // z) * max(ek, ev) <= 64), divisors[-1])
        bdy = max(1, sched.threads // (bdx * bdz))
        unroll = sched.decode_unroll or max(1, sched.vector_bytes * 2 // (max(ek, ev) * bits // 8))
        return DecodeShape(bdx=bdx, bdy=bdy, bdz=bdz, ek=ek, ev=ev, k_lanes=spec.load_lanes(sched.lanes_for(bits, ek)),
                           v_lanes=spec.load_lanes(sched.lanes_for(bits, ev)), rows=G // bdz, unroll=unroll)


def make_decode_item(spec: AttentionSpec, sched: GpuSchedule, kv_rows, *, rope: bool):
    """Macro computing one (sequence, KV head, split) into the split workspace (``kv_rows``:
    :func:`~.macros.paged_kv_rows`; ``rope``: RoPE q and K inline)."""
    shape = DecodeShape.choose(spec, sched)
    locate, elem_at, _ = kv_rows
    G, D, DV, dtype, span = spec.group_size, spec.qk_head_dim, spec.v_head_dim, spec.dtype, spec.span
    BX, BY, NT = shape.bdx, shape.bdy, shape.threads
    EK, EV, KL, VL, GR, U = shape.ek, shape.ev, shape.k_lanes, shape.v_lanes, shape.rows, shape.unroll
    half, groups = D // 2, NT // BX
    shuffle = sched.warp_shuffle
    LOG_BX = BX.bit_length() - 1
    FULL_MASK = T.uint32(0xFFFFFFFF)  # the fold runs in uniform loops: every lane is active

    def rotate(x, partner, d, pos, rope_scale, rope_theta):
        """Element d of a RoPE'd row from its value and its pair's (both float32)."""
        angle = T.Cast("float32", pos) * rope_inv_freq_expr(d % half, D, rope_scale, rope_theta)
        sign = T.if_then_else(d < half, T.float32(-1), ONE)
        return x * T.cos(angle) + sign * partner * T.sin(angle)

    @T.macro
    def load_q(qr, q, b, hq0, pos, rope_scale, rope_theta, scale, lane):
        for i in T.unroll(GR):
            for x in T.unroll(EK):
                if rope:
                    qr[i, x] = scale * rotate(T.Cast("float32", q[b, hq0 + i, lane * EK + x]),
                                              T.Cast("float32", q[b, hq0 + i, (lane * EK + x + half) % D]),
                                              lane * EK + x, pos, rope_scale, rope_theta)
                else:
                    qr[i, x] = scale * T.Cast("float32", q[b, hq0 + i, lane * EK + x])

    @T.macro
    def locate_rows(slots, kv_src, j0, hi, ty):
        """slots[u] = pool slot of KV row ``j0 + u * bdy + ty`` (clamped below hi; 0 from
        ``j0 >= hi`` on: the steps past the split's end, whose slots are never read)."""
        for u in T.unroll(U):
            slots[u] = T.if_then_else(j0 < hi, locate(kv_src, T.min(j0 + u * BY + ty, hi - 1), ()), 0)

    @T.macro
    def load_rows(kn, vn, kv_src, h, slots, j0, hi, k_pos0, rope_scale, rope_theta, ty, lane):
        """kn/vn[u] = this lane's slices of K/V at ``slots[u]`` (row ``j0 + u * bdy + ty``,
        clamped below hi: its RoPE position)."""
        for u in T.unroll(U):
            if rope:
                for x in T.unroll(EK):
                    kn[u, x] = T.Cast(dtype, rotate(
                        T.Cast("float32", elem_at(kv_src, h, slots[u], 0, lane * EK + x)),
                        T.Cast("float32", elem_at(kv_src, h, slots[u], 0, (lane * EK + x + half) % D)),
                        lane * EK + x, k_pos0 + T.min(j0 + u * BY + ty, hi - 1), rope_scale, rope_theta))
            else:
                for v in T.unroll(EK // KL):
                    for x in T.vectorized(KL):
                        kn[u, v * KL + x] = elem_at(kv_src, h, slots[u], 0, lane * EK + v * KL + x)
            for v in T.unroll(EV // VL):
                for x in T.vectorized(VL):
                    vn[u, v * VL + x] = elem_at(kv_src, h, slots[u], 1, lane * EV + v * VL + x)

    @T.macro
    def lane_sum(part, red_sh, tx):
        """part[k] = sum of part[k] over the bdx lanes of this thread's lane group."""
        if shuffle:
            for k in T.unroll(U * GR):
                for e in T.unroll(LOG_BX):
                    part[k] = part[k] + T.tvm_warp_shuffle_xor(FULL_MASK, part[k], BX >> (e + 1),
                                                               sched.warp_size, sched.warp_size)
        else:
            for k in T.unroll(U * GR):
                red_sh[tx // BX, k, tx % BX] = part[k]
            T.evaluate(T.tvm_storage_sync("shared"))
            for k in T.unroll(U * GR):
                part[k] = ZERO
                for x in T.serial(BX):
                    part[k] = part[k] + red_sh[tx // BX, k, x]
            T.evaluate(T.tvm_storage_sync("shared"))

    @T.macro
    def fold(qr, kc, vc, m, l, acc, part, red, red_sh, j0, hi, ty, tx):
        """Fold the step's U rows into this thread's (m, l, acc) of each of its query rows."""
        for u in T.unroll(U):
            for i in T.unroll(GR):
                part[u * GR + i] = ZERO
                for x in T.unroll(EK):
                    part[u * GR + i] = part[u * GR + i] + qr[i, x] * T.Cast("float32", kc[u, x])
        lane_sum(part, red_sh, tx)
        for i in T.unroll(GR):
            red[0] = m[i]
            for u in T.unroll(U):
                red[0] = T.max(red[0], T.if_then_else(j0 + u * BY + ty < hi, part[u * GR + i], NEG_INF))
            alpha: T.let[T.float32] = T.if_then_else(m[i] == red[0], ONE, T.exp2(m[i] - red[0]))
            l[i] = l[i] * alpha
            for u in T.unroll(U):
                part[u * GR + i] = T.if_then_else(j0 + u * BY + ty < hi, T.exp2(part[u * GR + i] - red[0]), ZERO)
                l[i] = l[i] + part[u * GR + i]
            m[i] = red[0]
            for x in T.unroll(EV):
                acc[i, x] = acc[i, x] * alpha
                for u in T.unroll(U):
                    acc[i, x] = acc[i, x] + part[u * GR + i] * T.Cast("float32", vc[u, x])

    @T.macro
    def merge_groups(out, m, l, acc, sm_m, sm_l, sm_o, red, hq0, ty, tz, lane, tx):
        """Merge the bdy row groups' states of each query row by LSE and write the rows out.
        ``out = (ws_o, ws_lse, first workspace row, split)``."""
        if lane == 0:
            for i in T.unroll(GR):
                sm_m[tz * BY + ty, i] = m[i]
                sm_l[tz * BY + ty, i] = l[i]
        T.evaluate(T.tvm_storage_sync("shared"))
        for i in T.unroll(GR):
            red[0] = NEG_INF
            for y in T.serial(BY):
                red[0] = T.max(red[0], sm_m[tz * BY + y, i])
            red[1] = ZERO
            for y in T.serial(BY):
                red[1] = red[1] + T.if_then_else(sm_m[tz * BY + y, i] == NEG_INF, ZERO,
                                                 sm_l[tz * BY + y, i] * T.exp2(sm_m[tz * BY + y, i] - red[0]))
            for x in T.unroll(EV):
                sm_o[tz * BY + ty, lane * EV + x] = T.if_then_else(m[i] == NEG_INF, ZERO,
                                                                   acc[i, x] * T.exp2(m[i] - red[0]))
            T.evaluate(T.tvm_storage_sync("shared"))
            for k in T.unroll(ceildiv(DV, BX * BY)):
                if k * BX * BY + ty * BX + lane < DV:
                    red[2] = ZERO
                    for y in T.serial(BY):
                        red[2] = red[2] + sm_o[tz * BY + y, k * BX * BY + ty * BX + lane]
                    out[0][out[2] + hq0 + i, out[3], k * BX * BY + ty * BX + lane] = T.if_then_else(
                        red[1] > ZERO, red[2] / red[1], ZERO)
            if ty == 0 and lane == 0:
                out[1][out[2] + hq0 + i, out[3]] = T.if_then_else(red[1] > ZERO, red[0] + T.log2(red[1]), NEG_INF)
            T.evaluate(T.tvm_storage_sync("shared"))

    @T.macro
    def registers(qr, kc, vc, m, l, acc, part, red, red_sh, kv_src, h, s_lo, s_hi, steps, k_pos0, rope_scale,
                  rope_theta, ty, lane, tx):
        """Fold the split's rows in, each step's rows loaded into registers one step ahead."""
        kn = T.sblock_alloc_buffer((U, EK), dtype, scope="local")
        vn = T.sblock_alloc_buffer((U, EV), dtype, scope="local")
        slots = T.sblock_alloc_buffer((U,), "int32", scope="local")
        locate_rows(slots, kv_src, s_lo, s_hi, ty)
        if steps > 0:
            load_rows(kn, vn, kv_src, h, slots, s_lo, s_hi, k_pos0, rope_scale, rope_theta, ty, lane)
        locate_rows(slots, kv_src, s_lo + BY * U, s_hi, ty)
        for step in T.serial(steps):
            for u in T.unroll(U):
                for x in T.unroll(EK):
                    kc[u, x] = kn[u, x]
                for x in T.unroll(EV):
                    vc[u, x] = vn[u, x]
            # the next step's rows and the slots of the one after are in flight during the fold
            if step + 1 < steps:
                load_rows(kn, vn, kv_src, h, slots, s_lo + (step + 1) * BY * U, s_hi, k_pos0, rope_scale,
                          rope_theta, ty, lane)
            locate_rows(slots, kv_src, s_lo + (step + 2) * BY * U, s_hi, ty)
            fold(qr, kc, vc, m, l, acc, part, red, red_sh, s_lo + step * BY * U, s_hi, ty, tx)

    @T.macro
    def item(q, out, q_rope_position, kv_src, b, h, kv_len, k_pos0, rope_scale, rope_theta, sm_scale, split,
             nsplit, tx):
        qr = T.sblock_alloc_buffer((GR, EK), "float32", scope="local")
        kc = T.sblock_alloc_buffer((U, EK), dtype, scope="local")
        vc = T.sblock_alloc_buffer((U, EV), dtype, scope="local")
        m = T.sblock_alloc_buffer((GR,), "float32", scope="local")
        l = T.sblock_alloc_buffer((GR,), "float32", scope="local")
        acc = T.sblock_alloc_buffer((GR, EV), "float32", scope="local")
        part = T.sblock_alloc_buffer((U * GR,), "float32", scope="local")
        red = T.sblock_alloc_buffer((3,), "float32", scope="local")
        red_sh = T.sblock_alloc_buffer((1 if shuffle else groups, U * GR, BX), "float32", scope="shared")
        sm_m = T.sblock_alloc_buffer((groups, GR), "float32", scope="shared")
        sm_l = T.sblock_alloc_buffer((groups, GR), "float32", scope="shared")
        sm_o = T.sblock_alloc_buffer((groups, DV), "float32", scope="shared")
        lane: T.let[T.int32] = tx % BX
        ty: T.let[T.int32] = tx // BX % BY
        tz: T.let[T.int32] = tx // (BX * BY)
        hq0: T.let[T.int32] = h * G + tz * GR
        pos: T.let[T.int32] = q_rope_position[b]
        # rows a window or attention chunk leaves visible: positions in [first visible, pos]
        s_lo: T.let[T.int32] = split_rows(span, pos, k_pos0, kv_len, split, nsplit)[0]
        s_hi: T.let[T.int32] = split_rows(span, pos, k_pos0, kv_len, split, nsplit)[1]
        steps: T.let[T.int32] = ceildiv(T.max(s_hi - s_lo, 0), BY * U)
        load_q(qr, q, b, hq0, pos, rope_scale, rope_theta, sm_scale * LOG2E, lane)
        for i in T.unroll(GR):
            m[i] = NEG_INF
            l[i] = ZERO
            for x in T.unroll(EV):
                acc[i, x] = ZERO
        registers(qr, kc, vc, m, l, acc, part, red, red_sh, kv_src, h, s_lo, s_hi, steps, k_pos0, rope_scale,
                  rope_theta, ty, lane, tx)
        merge_groups(out, m, l, acc, sm_m, sm_l, sm_o, red, hq0, ty, tz, lane, tx)

    return item, shape


#: Fewest splits at which the merge lets the grid after it start at once: a merge of fewer, longer
#: splits (many sequences) measured faster without (the waiting blocks hold SM slots).
EARLY_TRIGGER_SPLITS = 8


def merge_splits(spec: AttentionSpec, sched: GpuSchedule, max_splits: int, single_done: bool = False,
                 trigger: bool = False):
    """Macro merging ``nsplit`` (at most ``max_splits``) partial states per (row, head) by LSE
    into o / lse: a block per row, a thread per output element, unrolled branch-free loads of the
    LSEs and partial outputs together (one round trip), ``single_done``: nothing to do for
    ``nsplit == 1``, see :func:`copy_single_split`. ``trigger``: a merge of many splits lets the
    grid after it start at once (:func:`.macros.early_start`)."""
    DV, dtype, NT, Hq = spec.v_head_dim, spec.dtype, sched.threads, spec.num_qo_heads
    least = 2 if single_done else 1  # fewest splits that need merging
    opening = grid_dependency(sched)
    KD = ceildiv(DV, NT)  # output elements per thread

    @T.macro
    def merge(ws_o, ws_lse, o, lse, rows, nsplit):
        for bx in T.thread_binding(rows, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                with T.sblock("merge_splits"):
                    T.reads()
                    T.writes()
                    w = T.sblock_alloc_buffer((max_splits,), "float32", scope="local")
                    part = T.sblock_alloc_buffer((KD, max_splits), "float32", scope="local")
                    red = T.sblock_alloc_buffer((3,), "float32", scope="local")
                    if trigger:
                        if nsplit >= EARLY_TRIGGER_SPLITS:
                            T.evaluate(T.ptx.griddepcontrol.launch_dependents())
                    opening()
                    if nsplit >= least:
                        # loads unconditional (clamped), the selection on the loaded values: a
                        # load inside a condition would be a branch, one load at a time
                        for sp in T.unroll(max_splits):
                            w[sp] = ws_lse[bx, T.min(sp, nsplit - 1)]
                        for k in T.unroll(KD):
                            for sp in T.unroll(max_splits):
                                part[k, sp] = ws_o[bx, T.min(sp, nsplit - 1), T.min(k * NT + tx, DV - 1)]
                        red[0] = NEG_INF
                        for sp in T.unroll(max_splits):
                            w[sp] = T.if_then_else(sp < nsplit, w[sp], NEG_INF)
                            red[0] = T.max(red[0], w[sp])
                        red[1] = ZERO
                        for sp in T.unroll(max_splits):
                            # an empty row (every LSE -inf) gets weight 0, not exp2(-inf + inf)
                            w[sp] = T.if_then_else(w[sp] == NEG_INF, ZERO, T.exp2(w[sp] - red[0]))
                            red[1] = red[1] + w[sp]
                        for k in T.unroll(KD):
                            if k * NT + tx < DV:
                                red[2] = ZERO
                                for sp in T.unroll(max_splits):
                                    red[2] = red[2] + w[sp] * part[k, sp]
                                o[bx // Hq, bx % Hq, k * NT + tx] = T.Cast(
                                    dtype, T.if_then_else(red[1] > ZERO, red[2] / red[1], ZERO))
                        if tx == 0:
                            lse[bx // Hq, bx % Hq] = T.if_then_else(red[1] > ZERO, red[0] + T.log2(red[1]), NEG_INF)

    return merge


def copy_single_split(spec: AttentionSpec, sched: GpuSchedule):
    """Macro ending a decode block whose (sequence, KV head) is not split: its state, final
    already, goes from the workspace (where the block wrote it) to o / lse, so that the merge
    kernel has nothing to do."""
    G, DV, dtype, NT, Hq, Hkv = (spec.group_size, spec.v_head_dim, spec.dtype, sched.threads, spec.num_qo_heads,
                                 spec.num_kv_heads)

    @T.macro
    def copy(ws_o, ws_lse, o, lse, bx, nsplit, tx):
        T.evaluate(T.tvm_storage_sync("shared"))
        if nsplit == 1:
            b: T.let[T.int32] = bx // Hkv
            head0: T.let[T.int32] = bx % Hkv * G  # the group's first query head
            for it in T.serial(ceildiv(G * DV, NT)):
                if it * NT + tx < G * DV:
                    hd: T.let[T.int32] = (it * NT + tx) // DV
                    d: T.let[T.int32] = (it * NT + tx) % DV
                    o[b, head0 + hd, d] = T.Cast(dtype, ws_o[b * Hq + head0 + hd, 0, d])
            if tx < G:
                lse[b, head0 + tx] = ws_lse[b * Hq + head0 + tx, 0]

    return copy


def decode_grid(spec: AttentionSpec, sched: GpuSchedule, kv_rows, seq_src):
    """Macro running decode: blocks over (sequence x KV head, split), then the LSE merge; one of
    two kernel pairs runs, with inline RoPE or without (fewer registers; tensor cores where
    :func:`.attention_gpu_decode_mma.decode_mma_applies`)."""
    rope_item, shape = make_decode_item(spec, sched, kv_rows, rope=True)
    tensor_cores = decode_mma_applies(spec, sched)
    early = bool(tensor_cores and early_start(spec, sched))  # page lookups before the wait
    plain_item = (make_decode_mma_item(spec, sched, kv_rows, grid_dependency(sched) if early else None)
                  if tensor_cores else make_decode_item(spec, sched, kv_rows, rope=False)[0])
    wave = sched.decode_mma_wave_blocks if tensor_cores else sched.decode_wave_blocks
    merge = merge_splits(spec, sched, sched.decode_splits, True, early_start(spec, sched))
    copy = copy_single_split(spec, sched)
    opening = grid_dependency(sched)

    # KV rows one step of a block covers: every warp's chunk (tensor cores) or every row group's rows
    step_rows = sched.threads // 32 * MMA_CHUNK if tensor_cores else shape.bdy * shape.unroll

    def splits(batch, num_pages):
        """Blocks per (sequence, KV head), at most ``decode_splits``: as many as one wave of
        ``wave`` blocks holds, none shorter than one step of the block over the mean context
        (``num_pages`` per sequence)."""
        by_rows = ceildiv(ceildiv(num_pages, T.max(batch, 1)) * spec.page_size, step_rows)
        return T.min(NS, T.max(1, T.min(wave // T.max(batch * Hkv, 1), by_rows)))
    Hq, Hkv, DV, NT, NS = spec.num_qo_heads, spec.num_kv_heads, spec.v_head_dim, shape.threads, sched.decode_splits

    def make_run(work, waits: bool):
        @T.macro
        def run(q, o, lse, q_rope_position, batch, num_pages, bufs, rope_scale, rope_theta, sm_scale):
            # workspace of the splits that run (large batches: one split, a small workspace)
            ws_o = T.sblock_alloc_buffer((batch * Hq, splits(batch, num_pages), DV), "float32")
            ws_lse = T.sblock_alloc_buffer((batch * Hq, splits(batch, num_pages)), "float32")
            nsplit: T.let[T.int32] = splits(batch, num_pages)
            for bx in T.thread_binding(batch * Hkv, thread="blockIdx.x"):
                for by in T.thread_binding(nsplit, thread="blockIdx.y"):
                    for tx in T.thread_binding(NT, thread="threadIdx.x"):
                        with T.sblock("work"):
                            T.reads()
                            T.writes()
                            src = seq_src(bufs, bx // Hkv)
                            if not waits:
                                opening()
                            work(q, (ws_o, ws_lse, bx // Hkv * Hq, by), q_rope_position, src[0], bx // Hkv,
                                 bx % Hkv, src[1], src[2], rope_scale, rope_theta, sm_scale, by, nsplit, tx)
                            copy(ws_o, ws_lse, o, lse, bx, nsplit, tx)
            merge(ws_o, ws_lse, o, lse, batch * Hq, nsplit)

        return run

    inline, plain = make_run(rope_item, False), make_run(plain_item, early)

    @T.macro
    def run(q, o, lse, q_rope_position, batch, num_pages, bufs, rotary_mode, rope_scale, rope_theta, sm_scale):
        # loops of 0 / 1 trips, not an `if`: TVM's barrier planner refuses kernels inside conditions
        for _inline in T.serial(T.if_then_else(rotary_mode == 1, 1, 0)):
            inline(q, o, lse, q_rope_position, batch, num_pages, bufs, rope_scale, rope_theta, sm_scale)
        for _plain in T.serial(T.if_then_else(rotary_mode == 1, 0, 1)):
            plain(q, o, lse, q_rope_position, batch, num_pages, bufs, rope_scale, rope_theta, sm_scale)

    return run
