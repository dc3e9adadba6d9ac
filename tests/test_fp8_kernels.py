"""Kernels over 8-bit float pages (``kv_dtype`` of the page and attention specs), on the CPU.

The append kernel stores ``value / scale`` saturated to the format's range, byte for byte as
numpy / ml_dtypes rounds it; the copy kernels move the bytes unchanged; attention and
``debug_get_kv`` read ``stored * scale``. Attention is checked against float64 attention over
those dequantized values: the kernels add no error beyond the model dtype's.
"""

from __future__ import annotations

import dataclasses
import math
import shutil

import ml_dtypes
import numpy as np
import pytest
import tvm

from relax_kvcache import tir_kernels as tk
from relax_kvcache import deploy
from relax_kvcache.build import _pass_config, build_kernels
from relax_kvcache.config import KVCacheConfig
from relax_kvcache.targets import make_target
from relax_kvcache.tir_kernels.spec import FP8_MAX
from support.kernel_cases import (PagedBatch, check_attention_outputs, f64, nan_like, plain_layout, randn,
                                  reference_attention, seed_of)

FORMATS = tuple(FP8_MAX)
H, HQ, D, PS, DTYPE = 2, 8, 64, 16, "float16"
CPU = tvm.cpu()


def build(func):
    """One PrimFunc compiled for the CPU."""
    target = make_target("llvm")
    with tvm.transform.PassContext(opt_level=3, config=_pass_config(target)):
        return tvm.tirx.build(tvm.IRModule({"main": func}), target=target)["main"]


def page_spec(kv_dtype):
    return tk.PageLayoutSpec(num_kv_heads=H, head_dim=D, page_size=PS, dtype=DTYPE, kv_dtype=kv_dtype)


def attention_spec(kv_dtype):
    return tk.AttentionSpec(num_qo_heads=HQ, num_kv_heads=H, qk_head_dim=D, v_head_dim=D, dtype=DTYPE,
                            page_size=PS, kv_dtype=kv_dtype)


SCHED = tk.schedule_for(make_target("llvm"))


def t(x):
    return tvm.runtime.tensor(np.ascontiguousarray(x), CPU)


def quantize(x, scale, fmt):
    """numpy's reference of the append: float32 ``x / scale`` saturated, rounded to ``fmt``."""
    fmax = np.float32(FP8_MAX[fmt])
    return np.clip(x.astype(np.float32) / scale.astype(np.float32), -fmax, fmax).astype(getattr(ml_dtypes, fmt))


def random_scales(rng):
    return rng.uniform(0.02, 2.0, (2, H)).astype(np.float32)


def random_stored(rng, shape, fmt):
    """Finite random 8-bit floats spread over the format's range (not only near 1)."""
    vals = rng.standard_normal(shape) * np.exp2(rng.integers(-6, 7, shape))
    return np.clip(vals, -FP8_MAX[fmt], FP8_MAX[fmt]).astype(getattr(ml_dtypes, fmt))


def dequantize(stored, scales, kv_axis=1, head_axis=2):
    """float64 ``stored * scale`` of a pool ``(P, 2, H, ps, D)``."""
    shape = [1] * stored.ndim
    shape[kv_axis], shape[head_axis] = 2, H
    return f64(stored.astype(np.float32)) * f64(scales.astype(np.float32)).reshape(shape)


def poison(shape, fmt):
    """A pool of NaN bytes (0x7f is NaN in both formats)."""
    return np.full(shape, 0x7F, np.uint8).view(getattr(ml_dtypes, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_append_quantizes_and_saturates(fmt):
    rng = np.random.default_rng(seed_of("fp8-append", fmt))
    func = build(tk.make_transpose_append(page_spec(fmt), SCHED))
    n, num_pages = 37, 5
    scales = random_scales(rng)
    scales[0, 0] = 0.05  # 1e4 / 0.05 lies beyond both formats' range
    k, v = randn(rng, (n, H, D), DTYPE) * 3, randn(rng, (n, H, D), DTYPE) * 3
    # outlier channels, values beyond the format's range (stored at its maximum), tiny values
    # (subnormals of the format)
    k[:, :, 5] *= 60
    k[:, :, 6] *= 1e-3
    k[0, 0, :4] = np.float16([1e4, -1e4, 6e4, -6e4])
    v[1, 1, :2] = np.float16(np.clip([FP8_MAX[fmt] * scales[1, 1] * 4, -FP8_MAX[fmt] * scales[1, 1] * 4], -6e4, 6e4))
    k[2, 1, :3] = np.float16([-1e-7, -0.0, 1e-7])  # signed zeros (ml_dtypes keeps the sign)
    pos = rng.permutation(num_pages * PS)[:n].astype(np.int32)
    pos[3] = -1  # a row that is not stored
    pages = t(poison((num_pages, 2, H, PS, D), fmt))
    func(pages, t(k), t(v), t(pos), t(scales))
    got = pages.numpy()
    exp = poison((num_pages, 2, H, PS, D), fmt)
    for i, p in enumerate(pos):
        if p >= 0:
            exp[p // PS, 0, :, p % PS] = quantize(k[i], scales[0][:, None], fmt)
            exp[p // PS, 1, :, p % PS] = quantize(v[i], scales[1][:, None], fmt)
    assert np.array_equal(got.view(np.uint8), exp.view(np.uint8))
    stored = got.astype(np.float32)
    written = np.zeros(got.shape, bool)
    written[pos[pos >= 0] // PS, :, :, pos[pos >= 0] % PS] = True
    assert np.isfinite(stored[written]).all(), "an append produced Inf / NaN"
    p0 = pos[0]
    assert stored[p0 // PS, 0, 0, p0 % PS, 0] == FP8_MAX[fmt] and stored[p0 // PS, 0, 0, p0 % PS, 1] == -FP8_MAX[fmt]


@pytest.mark.parametrize("fmt", FORMATS)
def test_copy_kernels_move_bytes(fmt):
    rng = np.random.default_rng(seed_of("fp8-copy", fmt))
    spec = page_spec(fmt)
    pool = random_stored(rng, (6, 2, H, PS, D), fmt)
    pages = t(pool)
    build(tk.make_copy_single_page(spec, SCHED))(pages, 1, 4, 11)
    exp = pool.copy()
    exp[4, :, :, :11] = pool[1, :, :, :11]
    assert np.array_equal(pages.numpy().view(np.uint8), exp.view(np.uint8))
    # compact: slots move down in order within a sequence
    src = np.array([20, 21, 40, 41], np.int32)
    dst = np.array([18, 19, 33, 34], np.int32)
    before = pages.numpy()
    build(tk.make_compact_copy(spec, SCHED))(pages, t(np.array([0, 2, 4], np.int32)), t(np.stack([src, dst])), 2)
    exp = before.copy()
    for s_, d_ in zip(src, dst):
        exp[d_ // PS, :, :, d_ % PS] = before[s_ // PS, :, :, s_ % PS]
    assert np.array_equal(pages.numpy().view(np.uint8), exp.view(np.uint8))


@pytest.mark.parametrize("fmt", FORMATS)
def test_debug_get_kv_dequantizes(fmt):
    rng = np.random.default_rng(seed_of("fp8-debug", fmt))
    pool, scales = random_stored(rng, (4, 2, H, PS, D), fmt), random_scales(rng)
    pos = rng.permutation(4 * PS)[:9].astype(np.int32)
    k, v = t(nan_like((2, 9, H, D), DTYPE)), t(nan_like((2, 9, H, D), DTYPE))
    build(tk.make_debug_get_kv(page_spec(fmt), SCHED))(t(pool), t(pos), k, v, 1, t(scales))
    deq = (pool.astype(np.float32) * scales[None, :, :, None, None]).astype(np.float16)
    assert np.array_equal(k.numpy()[1], deq[pos // PS, 0, :, pos % PS])
    assert np.array_equal(v.numpy()[1], deq[pos // PS, 1, :, pos % PS])
    assert np.isnan(k.numpy()[0]).all(), "layer 0 was written"


def fp8_batch(rng, fmt, kv_lens):
    """Pages of unit-variance K / V stored at random per-head scales."""
    cfg = KVCacheConfig(num_layers=1, num_qo_heads=HQ, num_kv_heads=H, head_dim=D, page_size=PS, dtype=DTYPE)
    batch = PagedBatch(rng, cfg, [plain_layout(n, PS) for n in kv_lens], sliding=False)
    scales = rng.uniform(0.005, 0.5, (2, H)).astype(np.float32)
    stored = quantize(batch.pages, scales[None, :, :, None, None], fmt)
    # what batch.kv(b) reads, the reference's K / V: the stored values dequantized to the model
    # dtype (as debug_get_kv returns them)
    batch.pages = f64(dequantize(stored, scales).astype(np.float32).astype(DTYPE))
    return batch, stored, scales


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rotary", [0, 1])
def test_decode_over_fp8_pages(fmt, rotary):
    rng = np.random.default_rng(seed_of("fp8-decode", fmt, rotary))
    kv_lens = [1, PS, PS + 3, 5 * PS - 1, 77]
    batch, stored, scales = fp8_batch(rng, fmt, kv_lens)
    B = len(kv_lens)
    q = randn(rng, (B, HQ, D), DTYPE)
    q_pos = rng.integers(0, 3000, B).astype(np.int32)
    k_pos0 = rng.integers(0, 3000, B).astype(np.int32)
    sm_scale = 1 / math.sqrt(D)
    o, lse = t(nan_like((B, HQ, D), DTYPE)), t(nan_like((B, HQ), np.float32))
    build(tk.make_paged_decode(attention_spec(fmt), SCHED))(
        t(q), t(stored), t(batch.page_indptr), t(batch.page_indices), t(batch.length_info), t(k_pos0), t(q_pos),
        o, lse, rotary, 1.0, 1e4, sm_scale, t(scales))
    for b in range(B):
        K, V = batch.kv(b)
        exp_o, exp_lse = reference_attention(q[b:b + 1], K, V, causal=False, rotary=rotary, q_pos=q_pos[b:b + 1],
                                             k_pos0=k_pos0[b], theta=1e4, scale=1.0, sm_scale=sm_scale)
        check_attention_outputs(o.numpy()[b:b + 1], lse.numpy()[b:b + 1], exp_o, exp_lse, DTYPE, f"seq {b}", rotary)


@pytest.mark.parametrize("fmt", FORMATS)
def test_causal_prefill_over_fp8_pages(fmt):
    rng = np.random.default_rng(seed_of("fp8-prefill", fmt))
    kv_lens, q_lens = [40, 16, 70], [9, 16, 33]
    batch, stored, scales = fp8_batch(rng, fmt, kv_lens)
    qo_indptr = np.cumsum([0] + q_lens).astype(np.int32)
    n = int(qo_indptr[-1])
    q = randn(rng, (n, HQ, D), DTYPE)
    q_pos = np.concatenate([np.arange(kv - ql, kv) for kv, ql in zip(kv_lens, q_lens)]).astype(np.int32)
    sm_scale = 1 / math.sqrt(D)
    o, lse = t(nan_like((n, HQ, D), DTYPE)), t(nan_like((n, HQ), np.float32))
    build(tk.make_paged_prefill(attention_spec(fmt), SCHED))(
        t(q), t(qo_indptr), t(stored), t(batch.page_indptr), t(batch.page_indices), t(batch.length_info),
        t(np.zeros(len(kv_lens), np.int32)), t(q_pos), o, lse, 1, 0, 1.0, 1e4, sm_scale, t(scales))
    for b, (lo, hi) in enumerate(zip(qo_indptr[:-1], qo_indptr[1:])):
        K, V = batch.kv(b)
        exp_o, exp_lse = reference_attention(q[lo:hi], K, V, causal=True, rotary=0, q_pos=q_pos[lo:hi], k_pos0=0,
                                             theta=1e4, scale=1.0, sm_scale=sm_scale)
        check_attention_outputs(o.numpy()[lo:hi], lse.numpy()[lo:hi], exp_o, exp_lse, DTYPE, f"seq {b}")


def test_model_dtype_kernels_keep_tvm_signatures():
    """Without kv_dtype the kernels take TVM's arguments (no kv_scales)."""
    assert len(tk.make_transpose_append(page_spec(None), SCHED).params) == 4
    assert len(tk.make_debug_get_kv(page_spec(None), SCHED).params) == 5
    assert len(tk.make_paged_decode(attention_spec(None), SCHED).params) == 13
    assert len(tk.make_paged_prefill(attention_spec(None), SCHED).params) == 15
    assert len(tk.make_paged_decode(attention_spec("float8_e4m3fn"), SCHED).params) == 14
    mla = tk.AttentionSpec(num_qo_heads=4, num_kv_heads=1, qk_head_dim=64, v_head_dim=32, dtype="float16")
    assert len(tk.make_paged_mla(mla, SCHED).params) == 10
    assert len(tk.make_paged_mla(dataclasses.replace(mla, kv_dtype="float8_e5m2"), SCHED).params) == 11


def test_specs_refuse_what_they_cannot_serve():
    with pytest.raises(ValueError, match="kv_dtype must be None .* got 'int8'"):
        page_spec("int8")
    with pytest.raises(ValueError, match="prefixed prefill reads pages of the model dtype only"):
        tk.make_prefixed_prefill(attention_spec("float8_e5m2"), SCHED)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("arch,fmt", [("sm_90a", "float8_e4m3fn"), ("sm_80", "float8_e5m2")])
def test_cuda_kernel_set_compiles_with_nvcc(arch, fmt):
    """The whole kernel set of a cache over 8-bit pages (windows included) for CUDA, through
    nvcc as a GPU host loads it (the decode converts bytes with ``cvt`` on sm_90a, in software on
    sm_80)."""
    config = KVCacheConfig(num_layers=1, num_qo_heads=HQ, num_kv_heads=H, head_dim=D, page_size=PS, dtype=DTYPE,
                           kv_dtype=fmt, support_sliding_window=True)
    mod = build_kernels(config, make_target("cuda", arch=arch))
    source = next(m for m in mod.imports if m.kind == "cuda").inspect_source()
    assert "attention_prefill_tree" in source and "attention_prefill_prefixed" not in source
    assert ("cvt.rn.f16x2.e" in source) == (arch == "sm_90a")  # 8-bit to float16 in hardware (sm_89+)
    assert deploy.nvcc_compile(source, arch=arch).startswith(bytes.fromhex("50ed55ba"))
