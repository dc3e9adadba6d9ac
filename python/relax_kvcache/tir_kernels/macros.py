"""Shared TVMScript pieces (``T.macro``) of the kernels.

Conventions
-----------
* Scores are kept in log2 units: queries are pre-multiplied by ``sm_scale * log2(e)``, so the
  softmax uses ``exp2`` and the log-sum-exp written out is base 2 (TVM's convention):
  ``lse = log2(sum_j exp(sm_scale * q . k_j))``.
* An attention state with nothing to attend to is ``o = 0, lse = -inf``.
* RoPE (rotate-half form) at position ``p`` rotates features ``(d, d + D/2)`` by the angle
  ``p * scale / theta^(2d/D)``.
"""

from __future__ import annotations

import math

from tvm import tirx
from tvm.script import tirx as T

LOG2E = math.log2(math.e)
NEG_INF = tirx.const(float("-inf"), "float32")
ZERO = tirx.const(0.0, "float32")
ONE = tirx.const(1.0, "float32")


def ceildiv(a, b):
    """``ceil(a / b)`` for non-negative integers or PrimExprs."""
    return (a + b - 1) // b


def paged_kv_len(npages, page_size: int, length_info, b, sliding_window: bool):
    """Number of KV rows of sequence b in its page list (TVM's ``length_info`` layouts)."""
    if not sliding_window:
        rows = (npages - 1) * page_size + length_info[b]
    else:
        # last_page_len - window offset + sink size
        rows = (npages - 1) * page_size + length_info[0, b] - length_info[1, b] + length_info[2, b]
    return T.if_then_else(npages > 0, rows, 0)


def paged_row_offset(j, length_info, b, sliding_window: bool):
    """Offset of logical KV row j inside the sequence's page list (sinks, then the window)."""
    if not sliding_window:
        return j
    return T.if_then_else(j < length_info[2, b], j, j - length_info[2, b] + length_info[1, b])


def rope_inv_freq_expr(d, dim: int, rope_scale, rope_theta):
    """RoPE frequency of feature pair d of a ``dim``-wide head: ``scale / theta^(2d / dim)``."""
    return rope_scale / T.pow(rope_theta, T.Cast("float32", 2 * d) / T.Cast("float32", dim))


@T.macro
def rope_inv_freq(inv_freq, half: T.int32, rope_scale, rope_theta):
    """inv_freq[d] = scale / theta^(2d / (2 * half)) for d < half."""
    for d in T.serial(half):
        inv_freq[d] = rope_inv_freq_expr(d, 2 * half, rope_scale, rope_theta)


@T.macro
def rope_row_inplace(buf, row, pos, inv_freq, half: T.int32):
    """Rotate ``buf[row, :2*half]`` (float32) in place to RoPE position ``pos``."""
    for d in T.serial(half):
        angle: T.let[T.float32] = T.Cast("float32", pos) * inv_freq[d]
        c: T.let[T.float32] = T.cos(angle)
        s: T.let[T.float32] = T.sin(angle)
        x0: T.let[T.float32] = buf[row, d]
        x1: T.let[T.float32] = buf[row, d + half]
        buf[row, d] = x0 * c - x1 * s
        buf[row, d + half] = x1 * c + x0 * s


@T.macro
def load_q_tile(qs, q, tok0, nq, h, group: T.int32, dim: T.int32, rotary_mode, q_rope_position,
                inv_freq, qk_scale):
    """Rows ``i * group + g`` of ``qs`` = query token ``tok0 + i``, head ``h * group + g``
    (float32, RoPE'd when ``rotary_mode == 1``, times ``qk_scale``)."""
    for i in T.serial(nq):
        for g in T.serial(group):
            for d in T.vectorized(dim):
                qs[i * group + g, d] = T.Cast("float32", q[tok0 + i, h * group + g, d])
            if rotary_mode == 1:
                rope_row_inplace(qs, i * group + g, q_rope_position[tok0 + i], inv_freq, dim // 2)
            for d in T.vectorized(dim):
                qs[i * group + g, d] = qs[i * group + g, d] * qk_scale


@T.macro
def init_state(m, l, acc, rows, dv: T.int32):
    for r in T.serial(rows):
        m[r] = NEG_INF
        l[r] = ZERO
        for d in T.vectorized(dv):
            acc[r, d] = ZERO


@T.macro
def score_chunk(s, qs, kc, rows, nt, dqk: T.int32, lanes: T.int32, part):
    """s[r, t] = qs[r, :] . kc[t, :] with ``lanes``-wide partial sums over head_dim."""
    for r in T.serial(rows):
        for t in T.serial(nt):
            for x in T.vectorized(lanes):
                part[x] = ZERO
            for dd in T.serial(dqk // lanes):
                for x in T.vectorized(lanes):
                    part[x] = part[x] + qs[r, dd * lanes + x] * kc[t, dd * lanes + x]
            s[r, t] = ZERO
            for x in T.serial(lanes):
                s[r, t] = s[r, t] + part[x]


@T.macro
def causal_mask_chunk(s, rows, nt, group: T.int32, col0, first_row_limit):
    """Mask s[r, t] (-inf) where column ``col0 + t`` lies after row r's last visible column.

    Row r belongs to query token ``r // group`` of the tile; token i sees columns up to
    ``first_row_limit + i`` (inclusive).
    """
    for r in T.serial(rows):
        for t in T.serial(nt):
            if col0 + t > first_row_limit + r // group:
                s[r, t] = NEG_INF


@T.macro
def window_mask_chunk(s, rows, nt, group: T.int32, q_rope_position, tok0, k_pos_first, window: T.int32,
                      causal):
    """Mask s[r, t] (-inf) unless key position ``k_pos_first + t`` lies in
    ``(q_pos - window, q_pos]`` of row r's query (upper bound only when ``causal``)."""
    for r in T.serial(rows):
        for t in T.serial(nt):
            if k_pos_first + t <= q_rope_position[tok0 + r // group] - window:
                s[r, t] = NEG_INF
            elif causal > 0 and k_pos_first + t > q_rope_position[tok0 + r // group]:
                s[r, t] = NEG_INF


@T.macro
def tree_mask_chunk(s, rows, nt, group: T.int32, tree_src, node0, col0, tree_start):
    """Token-tree mask: row r (tree node ``node0 + r // group``) sees key ``col0 + t`` if the key
    precedes the tree or is an ancestor-or-self of the row's node. ``tree_src = (tree_mask,
    first mask row)``; ``tree_mask[n] = [first, last)`` is node n's DFS interval."""
    for r in T.serial(rows):
        for t in T.serial(nt):
            if col0 + t >= tree_start:
                if tree_src[0][tree_src[1] + node0 + r // group, 0] < tree_src[0][tree_src[1] + col0 + t - tree_start, 0]:
                    s[r, t] = NEG_INF
                elif tree_src[0][tree_src[1] + node0 + r // group, 0] >= tree_src[0][tree_src[1] + col0 + t - tree_start, 1]:
                    s[r, t] = NEG_INF


@T.macro
def query_position_range(bounds, q_rope_position, tok0, nq):
    """bounds = (min, max) of the positions of query tokens ``[tok0, tok0 + nq)``."""
    bounds[0] = q_rope_position[tok0]
    bounds[1] = q_rope_position[tok0]
    for i in T.serial(nq):
        bounds[0] = T.min(bounds[0], q_rope_position[tok0 + i])
        bounds[1] = T.max(bounds[1], q_rope_position[tok0 + i])


@T.macro
def softmax_update(s, m, l, acc, vc, rows, nt, dv: T.int32, lanes: T.int32, part, red):
    """Online-softmax step: fold the chunk scores ``s`` and values ``vc`` into (m, l, acc)."""
    for r in T.serial(rows):
        red[0] = m[r]
        for t in T.serial(nt):
            red[0] = T.max(red[0], s[r, t])
        alpha: T.let[T.float32] = T.if_then_else(m[r] == red[0], ONE, T.exp2(m[r] - red[0]))
        m[r] = red[0]
        for t in T.serial(nt):
            s[r, t] = T.if_then_else(red[0] == NEG_INF, ZERO, T.exp2(s[r, t] - red[0]))
        red[0] = ZERO
        for t in T.serial(nt):
            red[0] = red[0] + s[r, t]
        l[r] = l[r] * alpha + red[0]
        for dd in T.serial(dv // lanes):
            for x in T.vectorized(lanes):
                part[x] = acc[r, dd * lanes + x] * alpha
            for t in T.serial(nt):
                for x in T.vectorized(lanes):
                    part[x] = part[x] + s[r, t] * vc[t, dd * lanes + x]
            for x in T.vectorized(lanes):
                acc[r, dd * lanes + x] = part[x]


@T.macro
def store_row(o, lse, o_index, lse_index, acc, m, l, r, dv: T.int32, dtype: T.str):
    """Normalise row r of the state and write it out (``o = 0, lse = -inf`` when empty)."""
    inv: T.let[T.float32] = T.if_then_else(l[r] > ZERO, ONE / l[r], ZERO)
    for d in T.vectorized(dv):
        o[o_index + (d,)] = T.Cast(dtype, acc[r, d] * inv)
    lse[lse_index] = T.if_then_else(l[r] > ZERO, m[r] + T.log2(l[r]), NEG_INF)
