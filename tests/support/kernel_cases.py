"""Kernel test cases shared by the kernel tests (``test_kernels``, ``test_prefill_tiles``) and
``gpu_kernel_libs.py`` (which builds their libraries for a GPU host): the configurations, the
device, tolerances, input and comparison helpers, and the float64 attention of one sequence.
"""

from __future__ import annotations

import os
import zlib

import ml_dtypes
import numpy as np
import tvm

from relax_kvcache import reference as ref
from relax_kvcache.config import KVCacheConfig

#: ``RELAX_KVCACHE_TEST_DEVICE=cuda`` runs these tests on a GPU (with ``RELAX_KVCACHE_TEST_LIBS``)
DEV = tvm.cuda() if os.environ.get("RELAX_KVCACHE_TEST_DEVICE") == "cuda" else tvm.cpu()

CONFIGS = {
    # float32 GQA, with the sliding-window kernels.
    "f32_gqa": KVCacheConfig(num_layers=3, num_qo_heads=8, num_kv_heads=2, head_dim=64,
                             page_size=16, dtype="float32", rope_theta=5e5, rope_scale=0.5,
                             support_sliding_window=True),
    # float16 MHA, wide heads.
    "f16_mha": KVCacheConfig(num_layers=2, num_qo_heads=4, num_kv_heads=4, head_dim=128,
                             page_size=16, dtype="float16", rope_theta=1e6, rope_scale=0.25),
    # bfloat16 MQA, small pages, with the sliding-window kernels.
    "bf16_mqa": KVCacheConfig(num_layers=4, num_qo_heads=4, num_kv_heads=1, head_dim=32,
                              page_size=8, dtype="bfloat16", rope_theta=2e4, rope_scale=2.0,
                              support_sliding_window=True),
}
#: LongRoPE split_rotary (Phi-3 factors); only ``test_split_rotary_variants`` uses them.
LONGROPE_CONFIGS = {
    name: KVCacheConfig(num_layers=1, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=16, dtype=dtype,
                        rope_theta=1e4, rope_scale=scale,
                        rope_ext_factors=tuple(float(x) for x in np.r_[np.linspace(1.0, 40.0, d // 2),
                                                                        np.linspace(1.0, 1.5, d // 2)]),
                        rope_original_max_position_embeddings=2048, rope_attention_factor=1.19)
    for name, hq, hkv, d, dtype, scale in (("f16_longrope", 8, 2, 128, "float16", 1.0),
                                           ("bf16_longrope", 4, 4, 96, "bfloat16", 0.5))
}
#: Partial rotary dims (Phi-2: head_dim 80, rotary 32), one with LongRoPE factors of its rotary
#: dim; only ``test_split_rotary_variants`` uses them.
ROTARY_CONFIGS = {
    "f32_phi2": KVCacheConfig(num_layers=1, num_qo_heads=4, num_kv_heads=4, head_dim=80, page_size=16,
                              dtype="float32", rope_theta=1e4, rope_rotary_dim=32),
    "f16_rotary32": KVCacheConfig(num_layers=1, num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=16,
                                  dtype="float16", rope_theta=5e5, rope_scale=0.5, rope_rotary_dim=32),
    "bf16_rotary64_longrope": KVCacheConfig(
        num_layers=1, num_qo_heads=4, num_kv_heads=2, head_dim=96, page_size=16, dtype="bfloat16",
        rope_theta=1e4, rope_rotary_dim=64, rope_original_max_position_embeddings=2048, rope_attention_factor=1.1,
        rope_ext_factors=tuple(float(x) for x in np.r_[np.linspace(1.0, 30.0, 32), np.linspace(1.0, 1.4, 32)])),
    # GPT-J style pairs (neighbours), whole head and partial
    "f16_gptj": KVCacheConfig(num_layers=1, num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=16,
                              dtype="float16", rope_theta=1e4, rope_interleaved=True),
    "f32_gptj_rotary64": KVCacheConfig(num_layers=1, num_qo_heads=4, num_kv_heads=4, head_dim=256, page_size=16,
                                       dtype="float32", rope_theta=1e4, rope_rotary_dim=64, rope_interleaved=True),
}
#: Prefill tiles at realistic head sizes (``test_prefill_tiles``).
TILE_CONFIGS = {
    "bf16_gqa128": KVCacheConfig(num_layers=1, num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=16,
                                 dtype="bfloat16"),
    "f16_gqa64_sw": KVCacheConfig(num_layers=1, num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                                  dtype="float16", support_sliding_window=True),
}
NP_DTYPE = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
#: Tolerance of outputs stored in the kernel dtype (unit-variance inputs).
O_TOL = {"float32": 2e-3, "float16": 2e-2, "bfloat16": 5e-2}
#: Tolerance of float32 lse outputs: absolute + relative to |lse|. Without RoPE the kernels
#: agree with float64 to ~1e-5; inline RoPE at positions in the thousands computes angles in
#: float32 (absolute angle error ~1e-4 rad), which costs up to ~1e-3 in lse.
LSE_ATOL, LSE_ATOL_ROPE, LSE_RTOL = 1e-4, 2e-3, 1e-5
#: On GPUs the inline-RoPE kernels stage rotated q and k in shared memory in the kernel dtype (as
#: TVM's GPU kernels do), which rounds each rotated value once more: lse error grows to ~1e-2
#: (float16) / ~5e-2 (bfloat16). Outputs keep the O_TOL tolerance.
GPU_LSE_ATOL_ROPE = {"float32": 2e-3, "float16": 1.5e-2, "bfloat16": 6e-2}
#: Byte-offset views are made with this many int32 elements of padding in front.
VIEW_PAD = 3


# ----------------------------------------------------------------------------- helpers


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def tensor(x: np.ndarray) -> tvm.runtime.Tensor:
    return tvm.runtime.tensor(np.ascontiguousarray(x), DEV)


def randn(rng, shape, dtype: str) -> np.ndarray:
    """Unit-normal values, rounded to ``dtype`` (never exact zeros in practice)."""
    return rng.standard_normal(shape).astype(NP_DTYPE[dtype])


def nan_like(shape, dtype) -> np.ndarray:
    return np.full(shape, np.nan, dtype=NP_DTYPE.get(dtype, dtype))


def f64(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def assert_bitwise_equal(got: np.ndarray, expected: np.ndarray, what: str) -> None:
    """Exact equality of the stored bits (NaN-safe, distinguishes -0.0 from 0.0)."""
    assert got.shape == expected.shape, (what, got.shape, expected.shape)
    g = np.ascontiguousarray(got).view(np.uint8).reshape(got.shape + (-1,))
    e = np.ascontiguousarray(expected).view(np.uint8).reshape(got.shape + (-1,))
    bad = (g != e).any(axis=-1)
    if bad.any():
        raise AssertionError(f"{what}: {int(bad.sum())} elements differ, first at "
                             f"{np.argwhere(bad)[0].tolist()}: got {got[bad][:4]}, expected {expected[bad][:4]}")


def assert_close(got, expected, tol: float, what: str) -> None:
    got, expected = f64(got), f64(expected)
    assert got.shape == expected.shape, (what, got.shape, expected.shape)
    assert not np.isnan(got).any(), f"{what}: NaN in output (not written?) at {np.argwhere(np.isnan(got))[:5].tolist()}"
    if got.size == 0:
        return
    err = np.abs(got - expected)
    worst = np.unravel_index(np.argmax(err), err.shape)
    assert err.max() <= tol, (f"{what}: max abs err {err.max():.3e} > {tol:.1e} at {list(worst)}: "
                              f"got {got[worst]!r}, expected {expected[worst]!r}")


def assert_lse_close(got, expected, what: str, atol: float = LSE_ATOL) -> None:
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    assert not np.isnan(got).any(), f"{what}: NaN in lse (not written?) at {np.argwhere(np.isnan(got))[:5].tolist()}"
    assert not np.isposinf(got).any(), f"{what}: +inf in lse"
    mism = np.isneginf(got) != np.isneginf(expected)
    assert not mism.any(), (f"{what}: -inf pattern differs at {np.argwhere(mism)[:5].tolist()}: "
                            f"got {got[mism][:5]}, expected {expected[mism][:5]}")
    fin = np.isfinite(expected)
    if fin.any():
        err = np.abs(got[fin] - expected[fin])
        tol = atol + LSE_RTOL * np.abs(expected[fin])
        assert (err <= tol).all(), f"{what}: lse max err {err.max():.3e}"


class Indices:
    """Makes int32 index tensors, as byte-offset views when ``pad > 0``.

    The padding in front of a view holds ``pad_value`` (a valid but wrong index), so a kernel
    that ignores the view's offset reads wrong entries. Parents are kept alive here.
    """

    def __init__(self, pad: int, pad_value: int = 0):
        self.pad, self.pad_value, self.keep = pad, pad_value, []

    def __call__(self, a) -> tvm.runtime.Tensor:
        a = np.ascontiguousarray(np.asarray(a, dtype=np.int32))
        if self.pad == 0:
            return tensor(a)
        flat = np.concatenate([np.full(self.pad, self.pad_value, np.int32), a.ravel(),
                               np.full(2, self.pad_value, np.int32)])
        parent = tensor(flat)
        self.keep.append(parent)
        view = parent._create_view(a.shape, "int32", self.pad * 4)
        assert np.array_equal(view.numpy(), a)
        return view


def pool_pages(rng, config: KVCacheConfig, num_pages: int) -> np.ndarray:
    shape = (num_pages, 2, config.num_kv_heads, config.page_size, config.head_dim)
    return randn(rng, shape, config.dtype)


def reference_attention(q, K, V, *, causal, rotary, q_pos, k_pos0, theta, scale, sm_scale):
    """Reference of one sequence (float64): RoPE (if rotary) then attention."""
    q, K, V = f64(q), f64(K), f64(V)
    if rotary:
        q = ref.rope(q, q_pos, theta, scale)
        K = ref.rope(K, k_pos0 + np.arange(len(K)), theta, scale)
    return ref.attention(q, K, V, sm_scale, causal=bool(causal))


def check_attention_outputs(got_o, got_lse, exp_o, exp_lse, dtype, what, rotary=0):
    assert_close(got_o, exp_o, O_TOL[dtype], f"{what}: o")
    rope_atol = GPU_LSE_ATOL_ROPE[dtype] if DEV.dlpack_device_type() != tvm.cpu().dlpack_device_type() else LSE_ATOL_ROPE
    assert_lse_close(got_lse, exp_lse, f"{what}: lse", rope_atol if rotary else LSE_ATOL)
    empty = np.isneginf(exp_lse)
    if empty.any():
        assert (f64(got_o)[empty] == 0).all(), f"{what}: o of rows with no visible key is not 0"


class PagedBatch:
    """Random paged KV of a batch: non-contiguous random page ids, partial last pages.

    ``layout`` per sequence is ``(num_pages, last_page_len, window_offset, sink)``; KV row j of
    a sequence lives at offset ``j if j < sink else j - sink + window_offset`` in its page list.
    Without a sliding window, window_offset = sink = 0.
    """

    def __init__(self, rng, cfg: KVCacheConfig, layouts, sliding: bool, spare_pages: int = 6):
        ps = cfg.page_size
        total_pages = sum(l[0] for l in layouts)
        self.num_pages = total_pages + spare_pages
        self.pages = pool_pages(rng, cfg, self.num_pages)
        perm = rng.permutation(self.num_pages)
        self.page_lists, pos = [], 0
        for npg, *_ in layouts:
            self.page_lists.append(perm[pos:pos + npg].astype(np.int32))
            pos += npg
        self.page_indptr = np.cumsum([0] + [l[0] for l in layouts]).astype(np.int32)
        self.page_indices = (np.concatenate(self.page_lists) if total_pages else np.zeros(0)).astype(np.int32)
        last = np.array([l[1] for l in layouts], np.int32)
        if sliding:
            self.length_info = np.stack([last, [l[2] for l in layouts], [l[3] for l in layouts]]).astype(np.int32)
        else:
            assert all(l[2] == 0 and l[3] == 0 for l in layouts)
            self.length_info = last
        self.kv_lens = []
        self.offsets = []
        for npg, lastlen, off, sink in layouts:
            if npg == 0:
                rows = 0
            else:
                assert 1 <= lastlen <= ps and 0 <= sink <= off <= (npg - 1) * ps + lastlen
                rows = (npg - 1) * ps + lastlen - off + sink
            j = np.arange(rows)
            self.offsets.append(np.where(j < sink, j, j - sink + off))
            self.kv_lens.append(rows)
        self.ps = ps

    def kv(self, b):
        pl, off = self.page_lists[b], self.offsets[b]
        pid, slot = pl[off // self.ps], off % self.ps
        return self.pages[pid, 0, :, slot, :], self.pages[pid, 1, :, slot, :]


def plain_layout(kv_len: int, ps: int):
    npg = -(-kv_len // ps)
    return (npg, kv_len - (npg - 1) * ps if npg else 0, 0, 0)


def rope_args(rng):
    return float(rng.choice([1e4, 5e5])) * float(rng.uniform(0.8, 1.2)), float(rng.uniform(0.4, 2.0))
