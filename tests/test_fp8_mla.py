"""MLA caches over 8-bit float pages (``KVCacheConfig.kv_dtype`` with MLA layers).

Latent rows are drawn on the 8-bit grid times the layer's power-of-two scale, so the cache
stores them exactly: every step is checked both ways against the float64 MLA model over those
rows (``test_mla_cache``'s ``Harness``: absorbed attention over the dequantized pages, and the
chunked context over dequantized gathered rows) and ``debug_get_kv_mla`` reads them back
exactly; the kernels add no error of their own. Rows beyond the format's range saturate to it;
attention over them matches float64 attention over the stored rows. One scale per layer serves
the latent row (``set_kv_scales`` refuses a different ``v_scale``); ``calibrate_kv_scales``
takes it from the first step's rows. Outputs are poisoned with NaN. On CPU in float32;
``RELAX_KVCACHE_TEST_DEVICE=cuda`` runs it in float16 on a GPU with the libraries
``tests/gpu_kernel_libs.py`` prepared.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import ml_dtypes
import numpy as np
import pytest
import tvm
import tvm_ffi

from relax_kvcache import PagedAttentionKVCache
from relax_kvcache import reference as ref
from relax_kvcache.config import KV_DTYPE_MAX
from relax_kvcache.errors import ArgumentError, ConfigError
from relax_kvcache.kernel_set import KernelSet
from support.mla_kernel_cases import FP8_FORMATS, fp8_cache_config
from support.snapshot import assert_same, snapshot
from test_mla_cache import (DEV, DTYPE, HEADS, LAYERS, LORA, NP_DTYPE, ROPE, SM_SCALE, Harness, _creation_args,
                            _poisoned, _t)

WIDTH = LORA + ROPE
#: absorbed attention against float64 over the stored rows: the model dtype's accuracy
ACCURACY = {"float32": 2e-5, "float16": 1e-2}[DTYPE]
#: each layer's scale: powers of two, so that grid values times them are exact in the model dtype
SCALES = (2.0 ** -5, 2.0 ** -4)


@pytest.fixture(scope="module", params=FP8_FORMATS)
def fp8_kernels(request, kernel_build):
    config = fp8_cache_config(DTYPE, request.param)
    return config, KernelSet.from_module(kernel_build(config))


def fp8_cache(fp8_kernels, scales=SCALES, **changes):
    config, kernels = fp8_kernels
    cache = PagedAttentionKVCache(dataclasses.replace(config, **changes), DEV, kernels=kernels)
    for layer, scale in enumerate(scales):
        cache.set_kv_scales(layer, scale, scale)
    return cache


def on_grid(fmt):
    """``latent_values`` of the Harness: random values on the 8-bit grid times the layer's scale."""
    grid = ml_dtypes.finfo(getattr(ml_dtypes, fmt))

    def values(rng, layer, shape):
        x = rng.standard_normal(shape) * np.exp2(rng.integers(-2, 1, shape)) / SCALES[layer]
        return np.clip(x, -float(grid.max), float(grid.max)).astype(grid.dtype).astype(np.float64) * SCALES[layer]

    return values


def stored_rows(cache, seq_id):
    n = cache.get_sequence_length(seq_id)
    out = _poisoned((LAYERS, n, WIDTH))
    cache.debug_get_kv_mla(seq_id, 0, n, out)
    return out.numpy().astype(np.float64)


def check_absorbed_decode(cache, seq_id, rng):
    """A decode step of ``seq_id`` (its latent row as the last stored one) against float64
    attention over the stored rows."""
    cache.begin_forward([seq_id], [1])
    outs = []
    for layer in range(LAYERS):
        cache.append_mla_kv(layer, _t(on_grid(cache.config.kv_dtype)(rng, layer, (1, WIDTH))))
        q = rng.standard_normal((1, HEADS, WIDTH)).astype(NP_DTYPE).astype(np.float64)
        o, lse = _poisoned((1, HEADS, LORA)), _poisoned((1, HEADS), "float32")
        cache.cross_attention(layer, _t(q), o, lse, SM_SCALE)
        outs.append((q, o.numpy().astype(np.float64), lse.numpy()))
    cache.end_forward()
    rows = stored_rows(cache, seq_id)
    for layer, (q, o, lse) in enumerate(outs):
        o_ref, lse_ref = ref.attention(q, rows[layer][:, None], rows[layer][:, None, :LORA], SM_SCALE, causal=True)
        np.testing.assert_allclose(o, o_ref, rtol=ACCURACY, atol=ACCURACY, err_msg=f"layer {layer}: o")
        np.testing.assert_allclose(lse, lse_ref, rtol=ACCURACY, atol=ACCURACY, err_msg=f"layer {layer}: lse")
    return rows


def test_steps_forks_popn(fp8_kernels):
    """Prefill, decode, forks inside and at the end of pages, popn and remove over 8-bit pages."""
    config, _ = fp8_kernels
    cache = fp8_cache(fp8_kernels)
    h = Harness(cache, seed=11, latent_values=on_grid(config.kv_dtype))
    for seq in (0, 1):
        h.add(seq)
    h.step([(0, 57), (1, 20)])
    h.step([(0, 1), (1, 1)])
    h.fork(0, 2, 21)
    h.fork(0, 3, -1)
    h.step([(2, 9), (0, 1), (3, 1)])
    h.popn(0, 5)
    h.step([(0, 2), (2, 1), (3, 1)])
    h.remove(1)
    h.step([(0, 1), (3, 1)])
    h.check_rows([0, 2, 3])
    check_absorbed_decode(cache, 2, h.rng)
    assert cache._pages[0].dtype == config.kv_dtype  # one byte per latent element


def test_rows_beyond_the_format_saturate(fp8_kernels):
    """Values far beyond ``format max * scale`` are stored as that limit (never Inf / NaN), the
    rest as numpy rounds ``value / scale`` to the format; attention reads the stored rows."""
    fmt = fp8_kernels[0].kv_dtype
    scale = np.float32(1e-3)
    cache = fp8_cache(fp8_kernels, scales=(scale, scale))
    rng = np.random.default_rng(5)
    latent = (rng.standard_normal((LAYERS, 8, WIDTH)) * 100).astype(NP_DTYPE)
    cache.add_sequence(0)
    cache.begin_forward([0], [8])
    for layer in range(LAYERS):
        cache.append_mla_kv(layer, _t(latent[layer]))
    cache.end_forward()
    fmax = np.float32(KV_DTYPE_MAX[fmt])
    quantized = np.clip(latent.astype(np.float32) / scale, -fmax, fmax).astype(getattr(ml_dtypes, fmt))
    expected = (quantized.astype(np.float32) * scale).astype(NP_DTYPE).astype(np.float64)
    rows = check_absorbed_decode(cache, 0, rng)[:, :8]
    np.testing.assert_array_equal(rows, expected)
    limit = float(NP_DTYPE(fmax * scale))
    assert np.abs(rows).max() == limit and (np.abs(rows) == limit).mean() > 0.5


def test_one_scale_per_layer(fp8_kernels):
    """K's scale serves the latent row: a different v_scale is refused, naming both, and changes
    nothing; get_kv_scales gives it twice."""
    cache = fp8_cache(fp8_kernels)
    before, scales = snapshot(cache, pages=True), cache._kv_scales.host.copy()
    with pytest.raises(ArgumentError, match=r"one latent vector serves K and V.*v_scale must equal k_scale; got "
                                            r"k_scale 0.5, v_scale 0.25 for layer 1"):
        cache.set_kv_scales(1, 0.5, 0.25)
    assert_same(before, snapshot(cache, pages=True))
    np.testing.assert_array_equal(cache._kv_scales.host, scales)
    cache.set_kv_scales(1, [0.5], 0.5)
    assert [s.tolist() for s in cache.get_kv_scales(1)] == [[0.5], [0.5]]
    assert [s.tolist() for s in cache.get_kv_scales(0)] == [[SCALES[0]], [SCALES[0]]]


def test_calibrated_scale_from_the_first_step(fp8_kernels):
    """calibrate_kv_scales: the first step's latent rows set each layer's one scale to
    ``margin * max|row| / format max``; nothing saturates, the stored rows are the rows rounded
    to the grid; later steps keep the scale and attend over the stored rows."""
    fmt = fp8_kernels[0].kv_dtype
    cache = fp8_cache(fp8_kernels, scales=())
    cache.calibrate_kv_scales(margin=1.5)
    rng = np.random.default_rng(8)
    latent = (rng.standard_normal((LAYERS, 20, WIDTH)) * np.array([1.0, 30.0])[:, None, None]).astype(NP_DTYPE)
    cache.add_sequence(0)
    cache.begin_forward([0], [20])
    for layer in range(LAYERS):
        cache.append_mla_kv(layer, _t(latent[layer]))
    cache.end_forward()
    amax = np.abs(latent.astype(np.float64)).max(axis=(1, 2))
    for layer in range(LAYERS):
        k, v = cache.get_kv_scales(layer)
        np.testing.assert_allclose(k, [1.5 * amax[layer] / KV_DTYPE_MAX[fmt]], rtol=1e-6)
        assert k.tolist() == v.tolist()
    calibrated = cache._kv_scales.host.copy()
    rows = check_absorbed_decode(cache, 0, rng)[:, :20]
    np.testing.assert_array_equal(cache._kv_scales.host, calibrated)
    mant = 3 if "e4m3" in fmt else 2
    step = np.abs(latent.astype(np.float64)) * 2.0 ** -mant + calibrated[:, 0, 0][:, None, None] * 2.0 ** -6
    assert (np.abs(rows - latent.astype(np.float64)) <= step).all()
    assert (np.abs(rows).max(axis=(1, 2)) <= amax * (1 + 2.0 ** -mant)).all()


def test_prefix_caching_reuses_8_bit_pages(fp8_kernels):
    """A prompt's cached latent pages serve a second sequence: the same stored rows, and its
    decode attends over them."""
    cache = fp8_cache(fp8_kernels, prefix_caching=True)
    fmt, ps = cache.config.kv_dtype, cache.config.page_size
    rng = np.random.default_rng(9)
    ids = [int(t) for t in rng.integers(1, 1000, 2 * ps + 3)]
    cache.add_sequence(0, ids)
    cache.begin_forward([0], [len(ids)], token_ids=ids)
    for layer in range(LAYERS):
        cache.append_mla_kv(layer, _t(on_grid(fmt)(rng, layer, (len(ids), WIDTH))))
    cache.end_forward()
    assert cache.add_sequence(1, ids[:2 * ps] + [7]) == 2 * ps
    cache.begin_forward([1], [1], token_ids=[7])
    for layer in range(LAYERS):
        cache.append_mla_kv(layer, _t(on_grid(fmt)(rng, layer, (1, WIDTH))))
    cache.end_forward()
    np.testing.assert_array_equal(stored_rows(cache, 1)[:, :2 * ps], stored_rows(cache, 0)[:, :2 * ps])
    check_absorbed_decode(cache, 1, rng)


def test_creation_function_takes_8_bit_mla_kernels(fp8_kernels, kernel_build):
    """``paged_attention_kv_cache_create`` with kv_dtype in ``cache_config[7]`` and the 8-bit MLA
    kernels (which take ``kv_scales``) serves as the Python API does, bit for bit; kernels over
    pages of the model dtype are refused there."""
    config, kernels = fp8_kernels
    create = tvm_ffi.get_global_func("relax_kvcache.paged_attention_kv_cache_create")
    args = _creation_args(kernel_build(config).get_function)
    args[0] = tvm.runtime.ShapeTuple([16, 2048, 256, 16, 0, 1024, 0, 1 + FP8_FORMATS.index(config.kv_dtype)])
    created = create(*args)
    assert created.config.kv_dtype == config.kv_dtype
    fmt, rows = config.kv_dtype, []
    for cache in (created, fp8_cache(fp8_kernels)):
        cache.set_kv_scales(0, SCALES[0], SCALES[0])
        cache.set_kv_scales(1, SCALES[1], SCALES[1])
        rng = np.random.default_rng(6)
        cache.add_sequence(0)
        cache.begin_forward([0], [30])
        for layer in range(LAYERS):
            cache.append_mla_kv(layer, _t(on_grid(fmt)(rng, layer, (30, WIDTH))))
        cache.end_forward()
        rows.append(check_absorbed_decode(cache, 0, rng))
    np.testing.assert_array_equal(rows[0], rows[1])
    args = _creation_args(kernel_build(dataclasses.replace(config, kv_dtype=None)).get_function)
    args[0] = tvm.runtime.ShapeTuple([16, 2048, 256, 16, 0, 1024, 0, 1 + FP8_FORMATS.index(fmt)])
    with pytest.raises(ConfigError, match="expected the transpose_append_mla kernel, of 4 parameters"):
        create(*args)


def test_checkpoints_stay_refused(fp8_kernels):
    cache = fp8_cache(fp8_kernels)
    cache.add_sequence(0)
    with pytest.raises(NotImplementedError, match="checkpoints of caches with MLA layers"):
        cache.get_checkpoint_metadata(0)


@pytest.mark.skipif(shutil.which("nvcc") is None or bool(os.environ.get("RELAX_KVCACHE_TEST_LIBS")),
                    reason="needs nvcc and TVM's compiler (the development machine)")
@pytest.mark.parametrize("arch,fmt,dtype", [("sm_90a", "float8_e4m3fn", "float16"),
                                            ("sm_80", "float8_e5m2", "bfloat16")])
def test_cuda_kernel_set_compiles_with_nvcc(arch, fmt, dtype):
    """The CUDA kernel set of an 8-bit MLA cache, through nvcc as a GPU host loads it; the
    latent chunks still arrive by 16-byte cp.async copies."""
    from relax_kvcache import deploy
    from relax_kvcache.build import build_kernels
    from relax_kvcache.targets import make_target

    mod = build_kernels(fp8_cache_config(dtype, fmt), make_target("cuda", arch=arch))
    source = next(m for m in mod.imports if m.kind == "cuda").inspect_source()
    assert "attention_prefill_mla" in source and "cp.async.cg.shared.global [%0], [%1], 16" in source
    assert deploy.nvcc_compile(source, arch=arch).startswith(bytes.fromhex("50ed55ba"))
