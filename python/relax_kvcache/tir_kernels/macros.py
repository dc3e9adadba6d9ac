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

from .spec import FP8_MAX

LOG2E = math.log2(math.e)
NEG_INF = tirx.const(float("-inf"), "float32")
ZERO = tirx.const(0.0, "float32")
ONE = tirx.const(1.0, "float32")


def ceildiv(a, b):
    """``ceil(a / b)`` for non-negative integers or PrimExprs."""
    return (a + b - 1) // b


def grid_dependency(sched):
    """Macro opening a kernel launched programmatically dependent on the grid before it
    (``sched.dependent_launch``; nothing otherwise): it waits, unconditionally and first in the
    block, until that grid has finished and its writes are visible. Such a kernel's blocks are
    resident before then, so the launch overlaps the predecessor's last blocks; one that skipped
    the wait could read its predecessor's output early. Split kernels do not trigger their
    dependents explicitly: at block start measured slower (the waiting merge blocks hold SM
    slots), at block end no faster than the implicit trigger at exit (see :func:`early_start`
    for the grids that do)."""
    enabled = bool(sched.dependent_launch)

    @T.macro
    def opening():
        if enabled:
            T.evaluate(T.ptx.griddepcontrol.wait())

    return opening


def split_rows(span, pos, k_pos0, kv_len, split, nsplit):
    """``(first, end)`` KV rows of decode split ``split`` of ``nsplit``: the rows a query at
    ``pos`` sees (:func:`first_visible_row` on), cut into equal runs."""
    lo = first_visible_row(span, pos, k_pos0)
    per_split = ceildiv(T.max(kv_len - lo, 0), nsplit)
    return lo + split * per_split, T.min(kv_len, lo + split * per_split + per_split)


def early_start(spec, sched) -> bool:
    """Whether decode over ``spec``'s pages starts early under dependent launch: the grid before
    a split kernel (the append, a merge of many splits) lets it start at once, and its blocks
    look up their first pages (host data) before they wait. 16-bit pages only: 8-bit pages
    measured slower so (their split kernel is shorter and its registers fuller)."""
    return bool(sched.dependent_launch and not spec.quantized)


def paged_kv_len(npages, page_size: int, length_info, b, sliding_window: bool):
    """Number of KV rows of sequence b in its page list (TVM's ``length_info`` layouts)."""
    if not sliding_window:
        rows = (npages - 1) * page_size + length_info[b]
    else:
        # last_page_len - window offset + sink size
        rows = (npages - 1) * page_size + length_info[0, b] - length_info[1, b] + length_info[2, b]
    return T.if_then_else(npages > 0, rows, 0)


def first_visible_row(span, pos, k_pos0):
    """First KV row a single query at ``pos`` sees: 0, or for a local layer (``span``, the
    spec's :class:`LayerSpan` or None) the row of ``span.first_visible(pos)`` (rows start at
    position ``k_pos0``)."""
    return T.max(span.first_visible(pos) - k_pos0, 0) if span else T.int32(0)


def paged_row_offset(j, length_info, b, sliding_window: bool):
    """Offset of logical KV row j inside the sequence's page list (sinks, then the window)."""
    if not sliding_window:
        return j
    return T.if_then_else(j < length_info[2, b], j, j - length_info[2, b] + length_info[1, b])


# KV row sources. ``kv_src`` tuples: paged ``(pages, page_indices, first page of the sequence,
# length_info, sequence[, kv_scales])`` (``kv_scales`` for 8-bit pages), ragged ``(k, v, first KV
# row of the sequence)``. The accessors read element d of the sequence's KV row j (kv 0 = K,
# 1 = V) in the model dtype; CPU and GPU kernels share them.


def dequantized(spec, stored, kv_src, kv: int, h):
    """A page element ``stored`` in the model dtype: as it is, or for 8-bit pages times the
    scale of (kv, h) (``kv_src[5]``, ``kv_scales (2, Hkv) float32``)."""
    if not spec.quantized:
        return stored
    return T.Cast(spec.dtype, T.Cast("float32", fp8_to_half(spec.kv_dtype, stored)) * kv_src[5][kv, h])


def fp8_to_half(kv_dtype: str, stored):
    """An 8-bit float as float16, exactly, by moving its bits (both formats' values are float16
    values; TVM's software conversion flushes their subnormals): e5m2 is float16's upper byte;
    e4m3's exponent and mantissa shift into float16's, whose bias (15 against 7) a factor 2^8
    corrects."""
    bits = T.Cast("uint16", T.reinterpret("uint8", stored))
    if kv_dtype == "float8_e5m2":
        return T.reinterpret("float16", T.shift_left(bits, T.uint16(8)))
    moved = T.bitwise_or(T.shift_left(T.bitwise_and(bits, T.uint16(0x80)), T.uint16(8)),
                         T.shift_left(T.bitwise_and(bits, T.uint16(0x7F)), T.uint16(7)))
    return T.reinterpret("float16", moved) * T.float16(256)


#: mantissa bits, smallest normal exponent and exponent bias of the 8-bit formats
FP8_GRID = {"float8_e4m3fn": (3, -6, 7), "float8_e5m2": (2, -14, 15)}


def _let(name: str, value, body):
    """``body(var)`` with ``var`` bound to ``value`` (a float32 let expression)."""
    var = tirx.Var(name, "float32")
    return tirx.Let(var, value, body(var))


def _exponent(mag, emin: int):
    """``max(floor(log2(mag)), emin)`` exactly (log2 corrected where it rounds across a power of
    two; ``mag = 0`` gives ``emin``)."""
    one, zero = T.float32(1), T.float32(0)
    return _let("fl", T.floor(T.log2(mag)), lambda fl: T.max(
        fl - T.Select(T.exp2(fl) > mag, one, zero) + T.Select(T.exp2(fl + one) <= mag, one, zero), T.float32(emin)))


def quantized(spec, value, scale):
    """``value / scale`` in the page dtype: saturated to the format's finite range (never Inf /
    NaN from a finite value) and rounded to nearest even on its grid, subnormals included. The
    byte is assembled here (float32 arithmetic, exact on the grid): TVM's software conversion
    flushes subnormals."""
    mant, emin, bias = FP8_GRID[spec.kv_dtype]
    fmax, one, zero = T.float32(FP8_MAX[spec.kv_dtype]), T.float32(1), T.float32(0)

    def encode(x, q):  # q: x on the grid; the sign bit is x's (-0 and values rounding to -0 keep it)
        sign = T.Cast("float32", T.shift_right(T.reinterpret("uint32", x), T.uint32(31))) * T.float32(128)
        return _let("a", T.abs(q), lambda a: _let("e", _exponent(a, emin), lambda e: _let(
            "normal", T.Select(a >= T.float32(2.0 ** emin), one, zero), lambda normal:
            sign + normal * (e + T.float32(bias - 1)) * T.float32(2 ** mant) + a * T.exp2(T.float32(mant) - e))))

    def round_to_grid(x):
        return _let("step", T.exp2(_exponent(T.abs(x), emin) - T.float32(mant)),
                    lambda step: encode(x, T.nearbyint(x / step) * step))

    byte = _let("x", T.max(T.min(T.Cast("float32", value) / scale, fmax), -fmax), round_to_grid)
    return T.reinterpret(spec.kv_dtype, T.Cast("uint8", byte))


def refuse_quantized(spec, kernel: str) -> None:
    """Raise for an 8-bit ``kv_dtype`` in a kernel that reads the model dtype only."""
    if spec.quantized:
        raise ValueError(f"{kernel} reads pages of the model dtype only, got kv_dtype={spec.kv_dtype!r}")


def with_kv_scales(spec, kv_src, kv_scales):
    """``kv_src`` with ``kv_scales`` after it where pages are 8-bit (:func:`dequantized`)."""
    return (*kv_src, kv_scales) if spec.quantized else kv_src


def without_param(func: tirx.PrimFunc, index: int) -> tirx.PrimFunc:
    """``func`` without its parameter ``index``, one the body does not use (the ``kv_scales`` of
    a kernel over pages of the model dtype)."""
    params = [p for i, p in enumerate(func.params) if i != index]
    return tirx.PrimFunc(params, func.body, func.ret_type, func.attrs)


def paged_kv_access(spec):
    """``elem(kv_src, h, j, kv, d)`` of a sequence's page list (``length_info`` layouts)."""
    ps, sliding = spec.page_size, spec.sliding_window

    def elem(kv_src, h, j, kv: int, d):
        off = paged_row_offset(j, kv_src[3], kv_src[4], sliding)
        return dequantized(spec, kv_src[0][kv_src[1][kv_src[2] + off // ps], kv, h, off % ps, d], kv_src, kv, h)

    return elem


def ragged_kv_access(spec):
    """``elem(kv_src, h, j, kv, d)`` of a sequence's contiguous k / v."""

    def elem(kv_src, h, j, kv: int, d):
        return kv_src[kv][kv_src[2] + j, h, d]

    return elem


def paged_kv_rows(spec):
    """``(locate, elem_at, elem_new)`` of a sequence's page list, for tiles that copy whole rows:
    ``locate(kv_src, j, seq)`` is the pool slot (page * page_size + row in page) of KV row j,
    ``elem_at(kv_src, h, slot, kv, d)`` element d of that slot (the composition is
    :func:`paged_kv_access`, with the page lookup made once per row). ``seq = (first query
    token, q_len, kv_len)`` of the sequence, for sources that need it; ``elem_new`` is None
    (one source)."""
    ps, sliding = spec.page_size, spec.sliding_window

    def locate(kv_src, j, seq):
        off = paged_row_offset(j, kv_src[3], kv_src[4], sliding)
        return kv_src[1][kv_src[2] + off // ps] * ps + off % ps

    def elem_at(kv_src, h, slot, kv: int, d):
        return dequantized(spec, kv_src[0][slot // ps, kv, h, slot % ps, d], kv_src, kv, h)

    return locate, elem_at, None


def ragged_kv_rows(spec):
    """``(locate, elem_at, elem_new)`` of a sequence's contiguous k / v (as
    :func:`paged_kv_rows`)."""

    def locate(kv_src, j, seq):
        return kv_src[2] + j

    def elem_at(kv_src, h, row, kv: int, d):
        return kv_src[kv][row, h, d]

    return locate, elem_at, None


def prefixed_kv_access(spec):
    """``elem(kv_src, h, j, kv, d)`` of a sequence's cached prefix followed by the step's own
    K/V: ``kv_src = (pages, page_indices, first page, length_info, sequence, k, v, first new
    row, prefix rows)``; rows below the prefix come from the page list (no sliding window),
    the rest from ``k`` / ``v``."""
    paged = paged_kv_access(spec)

    def elem(kv_src, h, j, kv: int, d):
        return T.if_then_else(j < kv_src[8], paged(kv_src, h, T.min(j, T.max(kv_src[8] - 1, 0)), kv, d),
                              kv_src[5 + kv][kv_src[7] + T.max(j - kv_src[8], 0), h, d])

    return elem


def prefixed_kv_rows(spec):
    """``(locate, elem_at, elem_new)`` of :func:`prefixed_kv_access`'s rows: a slot >= 0 is a
    pool slot of the prefix, a slot < 0 the row ``-slot - 1`` of ``k`` / ``v`` (read with
    ``elem_new``); the prefix is ``kv_len - q_len`` rows (``seq``)."""
    locate_paged, elem_at, _ = paged_kv_rows(spec)

    def locate(kv_src, j, seq):
        prefix = seq[2] - seq[1]
        return T.if_then_else(j < prefix, locate_paged(kv_src, T.min(j, T.max(prefix - 1, 0)), seq),
                              -(kv_src[7] + j - prefix) - 1)

    def elem_new(kv_src, h, slot, kv: int, d):
        return kv_src[5 + kv][-slot - 1, h, d]

    return locate, elem_at, elem_new


def latent_kv_access(spec):
    """``elem(kv_src, h, j, kv, d)`` of a sequence's MLA page list (``kv_src`` as paged, pages
    ``(num_pages, page_size, width)``): K and V are the same latent row (V is its first
    ``v_head_dim`` features), so ``kv`` and ``h`` (one latent head) are not used; 8-bit pages
    are dequantized by the one scale of the layer (``kv_src[5]``, ``kv_scales (2, 1)``)."""
    ps = spec.page_size
    if spec.quantized:  # 8-bit pages: times the layer's one scale, kv_src[5][0, 0]
        def elem_dequantized(kv_src, h, j, kv: int, d):
            stored = kv_src[0][kv_src[1][kv_src[2] + j // ps], j % ps, d]
            return T.Cast(spec.dtype, T.Cast("float32", fp8_to_half(spec.kv_dtype, stored)) * kv_src[5][0, 0])

        return elem_dequantized

    def elem(kv_src, h, j, kv: int, d):
        return kv_src[0][kv_src[1][kv_src[2] + j // ps], j % ps, d]

    return elem


def prefetch(elem_expr, locality: int = 3):
    """Hint the CPU to fetch the cache line holding the element ``elem_expr`` (a buffer load, or
    a dequantized one: :func:`dequantized`)."""
    while not hasattr(elem_expr, "indices"):  # down to the load: casts' values, calls' and products' first operands
        elem_expr = (elem_expr.value if hasattr(elem_expr, "value") else
                     elem_expr.args[0] if hasattr(elem_expr, "args") else elem_expr.a)
    return T.evaluate(T.call_intrin("void", "tirx.prefetch", T.address_of(elem_expr), 0, locality, 1))


#: Coefficients of a degree-6 polynomial for 2^f on [0, 1) (weighted least squares on Chebyshev
#: nodes; relative error 1.9e-9, about 1e-7 when evaluated in float32).
_EXP2_POLY = (1.0, 0.693146987, 0.240229796, 0.0554835247, 0.00967847255, 0.00124430815, 0.000216906092)


def exp2_poly(x):
    """``2^x`` for a float32 PrimExpr, in operations LLVM vectorises (no libm call): ``2^floor(x)``
    from the exponent bits times a polynomial of the fraction; 0 below -126 (no denormals)."""
    xc = T.max(x, T.float32(-126.0))
    n = T.floor(xc)
    f = xc - n
    p = T.float32(_EXP2_POLY[-1])
    for c in reversed(_EXP2_POLY[:-1]):
        p = p * f + T.float32(c)
    scale = T.reinterpret("float32", T.shift_left(T.Cast("int32", n) + 127, 23))
    return T.if_then_else(x < T.float32(-126.0), ZERO, p * scale)


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
def rope_steps(rot, inv_freq, half: T.int32):
    """rot[2, d], rot[3, d] = cos, sin of ``inv_freq[d]``: the one-position rotation
    :func:`rope_rows_inplace` advances by (fill once per ``inv_freq``)."""
    for d in T.serial(half):
        rot[2, d] = T.cos(inv_freq[d])
        rot[3, d] = T.sin(inv_freq[d])


@T.macro
def rope_rows_inplace(buf, nt, pos0, inv_freq, rot, half: T.int32):
    """Rotate rows ``[0, nt)`` of ``buf`` (float32) in place to RoPE positions ``pos0 + t``:
    cos / sin at ``pos0`` advanced row by row by angle addition (``rot``: (4, half), rows 2-3
    from :func:`rope_steps`, rows 0-1 scratch; drift ~1e-7 a row)."""
    for d in T.serial(half):
        angle: T.let[T.float32] = T.Cast("float32", pos0) * inv_freq[d]
        rot[0, d] = T.cos(angle)
        rot[1, d] = T.sin(angle)
    for t in T.serial(nt):
        for d in T.vectorized(half):
            x0: T.let[T.float32] = buf[t, d]
            x1: T.let[T.float32] = buf[t, d + half]
            buf[t, d] = x0 * rot[0, d] - x1 * rot[1, d]
            buf[t, d + half] = x1 * rot[0, d] + x0 * rot[1, d]
            c: T.let[T.float32] = rot[0, d] * rot[2, d] - rot[1, d] * rot[3, d]
            rot[1, d] = rot[1, d] * rot[2, d] + rot[0, d] * rot[3, d]
            rot[0, d] = c


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


def row_block(group: int) -> int:
    """CPU register block: query rows (4, 2 or 1, dividing the GQA group) that share every K or
    V vector loaded; a tile's ``rows = tokens * group`` is always a multiple of it."""
    return next(rb for rb in (4, 2, 1) if group % rb == 0)


@T.macro
def lane_sum(part, i, j, lanes: T.int32):
    """part[i, j, 0] = sum of part[i, j, :lanes] (a power of two <= 16), by halving vector adds."""
    if lanes >= 16:
        for x in T.vectorized(8):
            part[i, j, x] = part[i, j, x] + part[i, j, x + 8]
    if lanes >= 8:
        for x in T.vectorized(4):
            part[i, j, x] = part[i, j, x] + part[i, j, x + 4]
    if lanes >= 4:
        for x in T.vectorized(2):
            part[i, j, x] = part[i, j, x] + part[i, j, x + 2]
    if lanes >= 2:
        part[i, j, 0] = part[i, j, 0] + part[i, j, 1]


@T.macro
def score_chunk(s, qs, k_src, k_at, h, c0, rows, nt, dqk: T.int32, lanes: T.int32, rb: T.int32, part, on_row,
                on_row_args):
    """s[r, t] = qs[r, :] . (K row ``c0 + t``), K element d read by ``k_at(k_src, h, c0, t, d)``.

    Rows go in blocks of ``rb`` and KV rows in pairs: each K vector loaded feeds ``rb`` partial
    sums and each query vector two, in ``2 * rb`` independent accumulators ``part[i, j, :]``
    (``lanes`` wide, kept in registers; enough chains to hide the FMA latency). An odd last KV
    row is scored twice. ``on_row(on_row_args, t)`` (a macro) runs once per KV row before the
    row is scored.
    """
    for blk in T.serial(rows // rb):
        for tp in T.serial(ceildiv(nt, 2)):
            t0: T.let[T.int32] = tp * 2
            t1: T.let[T.int32] = T.min(tp * 2 + 1, nt - 1)
            if blk == 0:
                on_row(on_row_args, t0)
                on_row(on_row_args, t1)
            for i in T.unroll(rb):
                for j in T.unroll(2):
                    for x in T.vectorized(lanes):
                        part[i, j, x] = ZERO
            for dd in T.serial(dqk // lanes):
                for i in T.unroll(rb):
                    for x in T.vectorized(lanes):
                        part[i, 0, x] = part[i, 0, x] + qs[blk * rb + i, dd * lanes + x] * T.Cast(
                            "float32", k_at(k_src, h, c0, t0, dd * lanes + x))
                        part[i, 1, x] = part[i, 1, x] + qs[blk * rb + i, dd * lanes + x] * T.Cast(
                            "float32", k_at(k_src, h, c0, t1, dd * lanes + x))
            for i in T.unroll(rb):
                for j in T.unroll(2):
                    lane_sum(part, i, j, lanes)
                s[blk * rb + i, t0] = part[i, 0, 0]
                s[blk * rb + i, t1] = part[i, 1, 0]


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
def window_mask_chunk(s, rows, nt, group: T.int32, q_rope_position, tok0, k_pos_first, span, causal):
    """Mask s[r, t] (-inf) unless key position ``k_pos_first + t`` lies in
    ``[span.first_visible(q_pos), q_pos]`` of row r's query (upper bound only when ``causal``;
    ``span`` a :class:`LayerSpan`: a sliding window or an attention chunk)."""
    for r in T.serial(rows):
        for t in T.serial(nt):
            if k_pos_first + t < span.first_visible(q_rope_position[tok0 + r // group]):
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
def softmax_update(s, m, l, alpha, rows, nt, chunk: T.int32, red):
    """Online-softmax step for the chunk scores ``s`` (``nt`` of its ``chunk`` columns valid): new
    running max ``m`` and sum ``l``, the rescale factor ``alpha[r]`` of each row's accumulator,
    and ``s`` turned into probabilities (columns past ``nt`` hold garbage)."""
    for r in T.serial(rows):
        red[0] = m[r]
        for t in T.serial(nt):
            red[0] = T.max(red[0], s[r, t])
        alpha[r] = T.if_then_else(m[r] == red[0], ONE, T.exp2(m[r] - red[0]))
        m[r] = red[0]
        for t in T.vectorized(chunk):
            s[r, t] = T.if_then_else(red[0] == NEG_INF, ZERO, exp2_poly(s[r, t] - red[0]))
        red[0] = ZERO
        for t in T.serial(nt):
            red[0] = red[0] + s[r, t]
        l[r] = l[r] * alpha[r] + red[0]


@T.macro
def accumulate_pv(acc, s, alpha, v_src, v_at, h, c0, rows, nt, dv: T.int32, lanes: T.int32, rb: T.int32, part):
    """acc[r, :] = acc[r, :] * alpha[r] + sum_t s[r, t] * (V row ``c0 + t``), V element d read by
    ``v_at(v_src, h, c0, t, d)``; rows in blocks of ``rb`` sharing each V vector loaded, each
    row's ``lanes`` columns at a time in ``part[i, :]`` (registers; the caller picks ``lanes``
    of two vector registers where it can, so that ``2 * rb`` FMA chains run at once)."""
    for blk in T.serial(rows // rb):
        for dd in T.serial(dv // lanes):
            for i in T.unroll(rb):
                for x in T.vectorized(lanes):
                    part[i, x] = acc[blk * rb + i, dd * lanes + x] * alpha[blk * rb + i]
            for t in T.serial(nt):
                for i in T.unroll(rb):
                    for x in T.vectorized(lanes):
                        part[i, x] = part[i, x] + s[blk * rb + i, t] * T.Cast(
                            "float32", v_at(v_src, h, c0, t, dd * lanes + x))
            for i in T.unroll(rb):
                for x in T.vectorized(lanes):
                    acc[blk * rb + i, dd * lanes + x] = part[i, x]


@T.macro
def store_row(o, lse, o_index, lse_index, acc, m, l, r, dv: T.int32, dtype: T.str):
    """Normalise row r of the state and write it out (``o = 0, lse = -inf`` when empty)."""
    inv: T.let[T.float32] = T.if_then_else(l[r] > ZERO, ONE / l[r], ZERO)
    for d in T.vectorized(dv):
        o[o_index + (d,)] = T.Cast(dtype, acc[r, d] * inv)
    lse[lse_index] = T.if_then_else(l[r] > ZERO, m[r] + T.log2(l[r]), NEG_INF)
