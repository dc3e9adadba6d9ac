"""Tensor-core schedule of a model's matmuls for :func:`relax_kvcache.frontend.compile` (CUDA
sm_80 and newer, float16 / bfloat16): ``C = A @ W.T`` as TVM's ``FuseTransposeMatmul`` leaves it,
with the elementwise epilogue ``FuseOps`` fused into it (a residual add, a bias, a cast).

One block computes a 128 x 128 tile of C with four warps of 64 x 64 on ``mma.sync.m16n8k16``
(float32 accumulators), reading A and W through a three-stage ``cp.async`` ring of 64-wide k
slices in shared memory (16-byte pieces XOR-swizzled by row, read by ``ldmatrix``). Rows past the
matmul's row count read zeros and are not stored.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional

import tvm
from tvm.script import tirx as T

from .tir_kernels.attention_gpu import swizzled
from .tir_kernels.attention_gpu_mma import ldmatrix_x4, mma_m16n8k16

BK = 64  # k slice
COLS = 128  # a block tile's columns
STAGES = 3
_LOAD = tvm.ir.expr.TensorLoad  # the type of buffer loads


@dataclasses.dataclass(frozen=True)
class NTMatmul:
    """A PrimFunc's matmul ``out[..., r, n] = epilogue(sum_k a[..., r, k] * w[n, k])``: its
    buffers, the one extent that varies (the row count, in axis ``row_axis`` of ``a`` and
    ``out``), and the epilogue as a function of the matmul's value (in the model dtype) and the
    output's indices."""

    a: tvm.tirx.Buffer
    w: tvm.tirx.Buffer
    out: tvm.tirx.Buffer
    row_axis: int
    epilogue: Callable[[tvm.tirx.PrimExpr, List[tvm.tirx.PrimExpr]], tvm.tirx.PrimExpr]

    @property
    def rows(self) -> tvm.tirx.PrimExpr:
        return self.a.shape[self.row_axis]

    def index(self, row, col) -> list:
        """Indices of element (row, col) of ``out`` (``row`` on the row axis, 0 on the others)."""
        idx = [row if axis == self.row_axis else 0 for axis in range(len(self.out.shape) - 1)]
        return idx + [col]


def match(func: tvm.tirx.PrimFunc) -> Optional[NTMatmul]:
    """The matmul of ``func``, where the tensor-core kernel can compute it.

    Parameters
    ----------
    func : tvm.tirx.PrimFunc
        A legalized, fused, unscheduled function.

    Returns
    -------
    NTMatmul or None
        Its matmul when ``func`` is one ``NT`` matmul block over float16 / bfloat16 (k static, a
        multiple of 64; columns static, a multiple of 128; one extent varying, the rows), then at
        most one elementwise block over its output reading parameters at the same indices or
        broadcast along some (a residual, a bias) and casting; else None.
    """
    blocks = _blocks(func)
    if not blocks or len(blocks) > 2:
        return None
    mm = _match_matmul(blocks[0])
    if mm is None:
        return None
    a, w, c, spatial = mm
    n, k = w.shape
    if not (isinstance(k, tvm.tirx.IntImm) and isinstance(n, tvm.tirx.IntImm)):
        return None
    if int(k) % BK or int(n) % COLS or a.dtype not in ("float16", "bfloat16") or w.dtype != a.dtype or c.dtype != a.dtype:
        return None
    dynamic = [axis for axis, extent in enumerate(a.shape[:-1]) if not _is_one(extent)]
    if len(dynamic) != 1 or any(not _is_one(e) for i, e in enumerate(c.shape[:-1]) if i != dynamic[0]):
        return None
    params = [p for p in func.params if isinstance(p.ty, tvm.tirx.BufferType)]
    if not (_among(a, params) and _among(w, params)):
        return None
    if len(blocks) == 1:
        if not _among(c, params):
            return None
        return NTMatmul(a, w, c, dynamic[0], lambda value, idx: value)
    epilogue = _match_epilogue(blocks[1], c, params)
    if epilogue is None:
        return None
    out, fn = epilogue
    return NTMatmul(a, w, out, dynamic[0], fn)


def _among(buffer, buffers) -> bool:
    return any(buffer.same_as(b) for b in buffers)


def _is_one(extent) -> bool:
    return isinstance(extent, tvm.tirx.IntImm) and int(extent) == 1


def _blocks(func: tvm.tirx.PrimFunc) -> List[tvm.s_tir.SBlock]:
    """The blocks under the root block, in order (empty when there are nested blocks)."""
    try:
        sch = tvm.s_tir.Schedule(func)
        children = sch.get_child_blocks(sch.get_sblock("root"))
    except tvm.TVMError:
        return []
    blocks = [sch.get(b) for b in children]
    return [] if any(sch.get_child_blocks(b) for b in children) else blocks


def _match_matmul(block: tvm.s_tir.SBlock):
    """``(a, w, c, spatial vars)`` of a block ``c[s..., n] = c[s..., n] + a[s..., k] * w[n, k]``."""
    iters = block.iter_vars
    if not _zero_init(block) or len(iters) < 2 or iters[-1].iter_type != tvm.tirx.IterVar.CommReduce:
        return None
    if any(it.iter_type != tvm.tirx.IterVar.DataPar for it in iters[:-1]):
        return None
    spatial, k = [it.var for it in iters[:-1]], iters[-1].var
    store = block.body
    if not isinstance(store, tvm.tirx.BufferStore) or not _indices_are(store.indices, spatial):
        return None
    value = store.value
    if not (isinstance(value, tvm.tirx.Add) and isinstance(value.a, _LOAD)
            and value.a.source.same_as(store.buffer) and isinstance(value.b, tvm.tirx.Mul)):
        return None
    lhs, rhs = value.b.a, value.b.b
    if not (isinstance(lhs, _LOAD) and isinstance(rhs, _LOAD)):
        return None
    if not (_indices_are(lhs.indices, spatial[:-1] + [k]) and _indices_are(rhs.indices, [spatial[-1], k])):
        return None
    return lhs.source, rhs.source, store.buffer, spatial


def _zero_init(block: tvm.s_tir.SBlock) -> bool:
    """Whether ``block`` starts its reduction at zero."""
    init = block.init
    return (isinstance(init, tvm.tirx.BufferStore) and isinstance(init.value, (tvm.tirx.IntImm, tvm.tirx.FloatImm))
            and float(init.value.value) == 0.0)


def _indices_are(indices, variables) -> bool:
    return len(indices) == len(variables) and all(i.same_as(v) for i, v in zip(indices, variables))


def _match_epilogue(block: tvm.s_tir.SBlock, c: tvm.tirx.Buffer, params):
    """``(out, fn)`` of an elementwise block ``out[s] = f(c[s], x[s], bias[s_j], ...)`` over ``c``'s
    shape, where fn(value, indices) is f with ``value`` for c[s] at output indices ``indices``."""
    iters = [it.var for it in block.iter_vars]
    store = block.body
    if (block.init is not None or any(it.iter_type != tvm.tirx.IterVar.DataPar for it in block.iter_vars)
            or not isinstance(store, tvm.tirx.BufferStore) or not _among(store.buffer, params)
            or not _indices_are(store.indices, iters) or len(iters) != len(c.shape)
            or not all(_same_extent(it.dom.extent, e) for it, e in zip(block.iter_vars, c.shape))):
        return None
    if _rebuild(store.value, lambda ld: _elementwise_load(ld, iters, c, params)) is None:
        return None

    def fn(value, indices):
        def load(ld):
            if ld.source.same_as(c):
                return value
            return tvm.tirx.BufferLoad(ld.source, [_at(i, iters, indices) for i in ld.indices])
        return _rebuild(store.value, load)

    return store.buffer, fn


def _same_extent(x, y) -> bool:
    """Whether extents ``x`` and ``y`` are the same constant or the same variable."""
    if isinstance(x, tvm.tirx.IntImm) and isinstance(y, tvm.tirx.IntImm):
        return int(x) == int(y)
    return x.same_as(y)


def _elementwise_load(ld, iters, c: tvm.tirx.Buffer, params):
    """``ld`` where it reads the matmul's value at the block's indices, or a parameter at indices
    each one of the block's variables or a constant (a broadcast, e.g. a bias); else None."""
    if ld.source.same_as(c):
        return ld if _indices_are(ld.indices, iters) else None
    simple = all(isinstance(i, tvm.tirx.IntImm) or any(i.same_as(v) for v in iters) for i in ld.indices)
    return ld if simple and _among(ld.source, params) else None


def _at(index, iters, indices):
    """``index`` (a block variable or a constant) at the output element ``indices``."""
    for var, value in zip(iters, indices):
        if index.same_as(var):
            return value
    return index


_BINARY = (tvm.tirx.Add, tvm.tirx.Sub, tvm.tirx.Mul, tvm.tirx.Div, tvm.tirx.Max, tvm.tirx.Min)


def _rebuild(expr, load: Callable[[tvm.tirx.BufferLoad], Optional[tvm.tirx.PrimExpr]]):
    """``expr`` with each buffer load replaced by ``load(it)``; None where it holds anything
    but loads, constants, casts and arithmetic (or a load gives None)."""
    if isinstance(expr, _LOAD):
        return load(expr)
    if isinstance(expr, (tvm.tirx.IntImm, tvm.tirx.FloatImm)):
        return expr
    if isinstance(expr, tvm.tirx.Cast):
        value = _rebuild(expr.value, load)
        return None if value is None else tvm.tirx.Cast(str(expr.ty), value)
    if isinstance(expr, _BINARY):
        a, b = _rebuild(expr.a, load), _rebuild(expr.b, load)
        return None if a is None or b is None else type(expr)(a, b)
    return None


@dataclasses.dataclass(frozen=True)
class MatmulTile:
    """A block's tile: ``rows`` x ``cols`` of C over ``warps_m`` x ``warps_n`` warps, and the
    number of parts k is split into (``splits`` > 1: for at most ``max_rows`` rows, where the
    column tiles alone leave most SMs idle; each part's float32 sums go to a workspace of
    :data:`WORKSPACE_FLOATS`, which a second kernel adds up before the epilogue)."""

    rows: int
    cols: int = COLS
    warps_m: int = 2
    warps_n: int = 2
    splits: int = 1
    max_rows: int = 0

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n

    @property
    def m_tiles(self) -> int:  # a warp's 16-row mma tiles
        return self.rows // self.warps_m // 16

    @property
    def n_tiles(self) -> int:  # a warp's 8-column mma tiles
        return self.cols // self.warps_n // 8


#: The tile past the largest of :data:`SMALL_ROWS`.
LARGE_TILE = MatmulTile(rows=128)
#: Row counts up to which a matmul runs on :func:`small_tile`'s tile (frontend.compile dispatches
#: on the row count at run time).
SMALL_ROWS = (32, 128)
#: Blocks a split tile aims at: about one wave of a large GPU (132 SMs on an H100 / H200).
WAVE_BLOCKS = 132
#: Floats of every split tile's workspace, whatever its shape: enough for any split
#: :func:`small_tile` makes (splits x columns <= WAVE_BLOCKS x 128 / m tiles). One size for all, so
#: that TVM's workspace pool, which frees and reallocates a page that is too small, keeps giving
#: the same page: CUDA graphs captured on it stay valid.
WORKSPACE_FLOATS = WAVE_BLOCKS * COLS * 64


def small_tile(rows: int, mm: NTMatmul) -> MatmulTile:
    """The tile for at most ``rows`` rows (32 rows x 128 columns up to 32, else 64 x 128): k split
    into as many parts as bring the blocks to about :data:`WAVE_BLOCKS`, each part at least four
    k slices (:data:`LARGE_TILE` past 32 rows when k need not be split)."""
    tile = MatmulTile(rows=32, warps_m=1, warps_n=4) if rows <= 32 else MatmulTile(rows=64)
    blocks = -(-rows // tile.rows) * (int(mm.w.shape[0]) // tile.cols)
    splits = max(1, min(WAVE_BLOCKS // blocks, int(mm.w.shape[1]) // BK // 4))
    if splits == 1 and tile.rows > 32:  # enough column tiles: the large tile is faster
        return LARGE_TILE
    return dataclasses.replace(tile, splits=splits, max_rows=rows)


def kernel_body(mm: NTMatmul, tile: MatmulTile = LARGE_TILE) -> tvm.tirx.Stmt:
    """The tensor-core kernel computing ``mm`` with ``tile`` (a body over ``mm``'s buffers, to
    replace its PrimFunc's or one branch of it)."""
    a, w, out, dtype = mm.a, mm.w, mm.out, mm.a.dtype
    K, N = int(w.shape[1]), int(w.shape[0])
    BM, BN, NT, S = tile.rows, tile.cols, tile.threads, tile.splits
    if S > 1 and S * tile.max_rows * N > WORKSPACE_FLOATS:
        raise ValueError(f"{tile} needs {S * tile.max_rows * N} workspace floats, over {WORKSPACE_FLOATS}")
    WM, WN, WR, WC = tile.m_tiles, tile.n_tiles, BM // tile.warps_m, BN // tile.warps_n
    KT, NVEC = K // BK, BK // 8  # k slices; 16-byte pieces of a slice row
    mma, ldmatrix = mma_m16n8k16(dtype), ldmatrix_x4(dtype)
    rows = T.Cast("int32", mm.rows)

    def col(r, d):
        return swizzled(r, d, BK)

    @T.macro
    def load(sa, sw, stage, kt, m0, n0, tx):
        for it in T.unroll(BM * NVEC // NT):
            r: T.let[T.int32] = (it * NT + tx) // NVEC
            p: T.let[T.int32] = (it * NT + tx) % NVEC
            T.evaluate(T.ptx["cp.async.cg.shared.global"](
                sa.ptr_to([stage * BM + r, col(r, p * 8)]),
                a.ptr_to(mm.index(T.min(m0 + r, rows - 1), kt * BK + p * 8)), 16,
                T.Cast("uint32", T.if_then_else(m0 + r < rows, 16, 0))))
        for it in T.unroll(BN * NVEC // NT):
            r: T.let[T.int32] = (it * NT + tx) // NVEC
            p: T.let[T.int32] = (it * NT + tx) % NVEC
            T.evaluate(T.ptx["cp.async.cg.shared.global"](
                sw.ptr_to([stage * BN + r, col(r, p * 8)]), w.ptr_to([n0 + r, kt * BK + p * 8]), 16,
                T.Cast("uint32", 16)))

    @T.macro
    def compute(sa, sw, af, bf, acc, stage, wm, wn, lane):
        for kk in T.unroll(BK // 16):
            for mi in T.unroll(WM):
                T.evaluate(ldmatrix(af, sa, (stage * BM + wm * WR + mi * 16 + lane % 16) * BK
                                    + col(wm * WR + mi * 16 + lane % 16, kk * 16 + lane // 16 * 8),
                                    trans=False, at=mi * 8))
            for nj in T.unroll(WN // 2):
                T.evaluate(ldmatrix(bf, sw, (stage * BN + wn * WC + nj * 16 + lane // 16 * 8 + lane % 8) * BK
                                    + col(wn * WC + nj * 16 + lane // 16 * 8 + lane % 8,
                                          kk * 16 + lane % 16 // 8 * 8),
                                    trans=False, at=nj * 8))
            for mi in T.unroll(WM):
                for ni in T.unroll(WN):
                    T.evaluate(mma(af, bf, acc, mi * WN + ni, a_at=mi * 8, b_at=ni * 4))

    def store(value, r, c):
        idx = mm.index(r, c)
        return T.buffer_store(out, mm.epilogue(T.Cast(dtype, value), idx), idx)

    @T.macro
    def tile_sums(acc, part, m0, n0, tx):
        """acc = this thread's share of A[m0 : m0 + BM] W[n0 : n0 + BN]^T over k part ``part``."""
        sa = T.sblock_alloc_buffer((STAGES * BM, BK), dtype, scope="shared.dyn")
        sw = T.sblock_alloc_buffer((STAGES * BN, BK), dtype, scope="shared.dyn")
        af = T.sblock_alloc_buffer((WM * 8,), dtype, scope="local")
        bf = T.sblock_alloc_buffer((WN * 4,), dtype, scope="local")
        wm: T.let[T.int32] = tx // 32 // tile.warps_n
        wn: T.let[T.int32] = tx // 32 % tile.warps_n
        k0: T.let[T.int32] = part * KT // S
        nk: T.let[T.int32] = (part + 1) * KT // S - k0
        for x in T.unroll(WM * WN * 4):
            acc[x] = T.float32(0)
        for s in T.unroll(STAGES - 1):
            if s < nk:
                load(sa, sw, s, k0 + s, m0, n0, tx)
            T.evaluate(T.ptx["cp.async.commit_group"]())
        for kt in T.serial(nk):
            T.evaluate(T.ptx["cp.async.wait_group"](STAGES - 2))
            T.evaluate(T.tvm_storage_sync("shared"))
            if kt + STAGES - 1 < nk:
                load(sa, sw, (kt + STAGES - 1) % STAGES, k0 + kt + STAGES - 1, m0, n0, tx)
            T.evaluate(T.ptx["cp.async.commit_group"]())
            compute(sa, sw, af, bf, acc, kt % STAGES, wm, wn, tx % 32)

    def row_of(m0, tx, mi, e):
        return m0 + tx // 32 // tile.warps_n * WR + mi * 16 + tx % 32 // 4 + e // 2 * 8

    def col_of(n0, tx, ni, e):
        return n0 + tx // 32 % tile.warps_n * WC + ni * 8 + tx % 4 * 2 + e % 2

    @T.macro
    def block_tile(part, by, bx, tx, ws):
        """This block's tile over k part ``part``: through the epilogue into ``out`` (one part), or
        as float32 sums into the workspace ``ws`` (several; None with one)."""
        acc = T.sblock_alloc_buffer((WM * WN * 4,), "float32", scope="local")
        m0: T.let[T.int32] = by * BM
        n0: T.let[T.int32] = bx * BN
        tile_sums(acc, part, m0, n0, tx)
        for mi in T.unroll(WM):
            for ni in T.unroll(WN):
                for e in T.unroll(4):
                    r: T.let[T.int32] = row_of(m0, tx, mi, e)
                    if r < rows:
                        if ws is None:
                            store(acc[(mi * WN + ni) * 4 + e], r, col_of(n0, tx, ni, e))
                        else:
                            ws[(part * rows + r) * N + col_of(n0, tx, ni, e)] = acc[(mi * WN + ni) * 4 + e]

    if S == 1:  # only the kernel used is parsed
        @T.prim_func(private=True, s_tir=True, check_well_formed=False)
        def kernel():
            for by in T.thread_binding((rows + BM - 1) // BM, thread="blockIdx.y"):
                for bx in T.thread_binding(N // BN, thread="blockIdx.x"):
                    for tx in T.thread_binding(NT, thread="threadIdx.x"):
                        with T.sblock("tensor_core_matmul"):
                            T.reads()
                            T.writes()
                            block_tile(0, T.Cast("int32", by), T.Cast("int32", bx), T.Cast("int32", tx), None)
    else:
        @T.prim_func(private=True, s_tir=True, check_well_formed=False)
        def kernel():
            ws = T.sblock_alloc_buffer((WORKSPACE_FLOATS,), "float32")
            for by in T.thread_binding((rows + BM - 1) // BM, thread="blockIdx.y"):
                for bx in T.thread_binding(N // BN, thread="blockIdx.x"):
                    for bz in T.thread_binding(S, thread="blockIdx.z"):
                        for tx in T.thread_binding(NT, thread="threadIdx.x"):
                            with T.sblock("tensor_core_matmul_part"):
                                T.reads()
                                T.writes()
                                block_tile(T.Cast("int32", bz), T.Cast("int32", by), T.Cast("int32", bx),
                                           T.Cast("int32", tx), ws)
            for bx in T.thread_binding((rows * N + 255) // 256, thread="blockIdx.x"):
                for tx in T.thread_binding(256, thread="threadIdx.x"):
                    with T.sblock("tensor_core_matmul_sum"):
                        T.reads()
                        T.writes()
                        total = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        i: T.let[T.int32] = T.Cast("int32", bx) * 256 + T.Cast("int32", tx)
                        if i < rows * N:
                            total[0] = ws[i]
                            for part in T.unroll(1, S):
                                total[0] = total[0] + ws[part * rows * N + i]
                            store(total[0], i // N, i % N)

    return kernel.body


def schedule(func: tvm.tirx.PrimFunc, rows: Optional[int] = None) -> Optional[tvm.tirx.PrimFunc]:
    """``func`` computed by the tensor-core kernel.

    Parameters
    ----------
    func : tvm.tirx.PrimFunc
        A legalized, fused, unscheduled function (see :func:`match`).
    rows : int, optional
        Schedule for at most that many rows, one of :data:`SMALL_ROWS` (:func:`small_tile`);
        default: any number, on :data:`LARGE_TILE`.

    Returns
    -------
    tvm.tirx.PrimFunc or None
        ``func`` with the kernel as its body, marked scheduled; None where :func:`match` gives
        None.
    """
    mm = match(func)
    if mm is None:
        return None
    tile = LARGE_TILE if rows is None else small_tile(rows, mm)
    return func.with_body(kernel_body(mm, tile)).with_attr("tirx.is_scheduled", True)
