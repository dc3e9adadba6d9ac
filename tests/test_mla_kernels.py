"""MLA kernels (``relax_kvcache.tir_kernels``): latent page operations and absorbed attention.

The latent layout stores one row of ``width = kv_lora_rank + rope_dim`` features per token
(DeepSeek-V3's 512 + 64, with fewer query heads for the CPU). Page operations are compared with
numpy indexing (bit for bit, including everything a kernel must not touch); attention with the
float64 reference: every query head attends to the one latent head, score = q . latent row,
output = softmax @ latent[:, :kv_lora_rank], base-2 LSE. Outputs are poisoned with NaN first.
"""

from __future__ import annotations

import os

import ml_dtypes

import numpy as np
import pytest
import tvm

from relax_kvcache import reference as ref
from support.mla_kernel_cases import DTYPES, HEADS, LORA, MANY_HEADS, PAGE, ROPE, WIDTH, kernel_funcs

#: ``RELAX_KVCACHE_TEST_DEVICE=cuda`` runs the tests on a GPU with the libraries
#: ``tests/gpu_kernel_libs.py`` prepared (``RELAX_KVCACHE_TEST_LIBS``); GPU attention runs on
#: tensor cores, so float32 attention is skipped there.
DEV = tvm.cuda() if os.environ.get("RELAX_KVCACHE_TEST_DEVICE") == "cuda" else tvm.cpu()
NP_DTYPE = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
#: bfloat16 keeps 8 bits: P and the output are rounded to 2^-9 relative
O_TOL = {"float32": 2e-3, "float16": 2e-2, "bfloat16": 3e-2}
LSE_ATOL = 1e-3


@pytest.fixture(scope="module", params=DTYPES)
def mla(request):
    """The MLA kernels for one dtype: compiled once for this machine's CPU, or loaded from the
    prepared GPU library."""
    dtype = request.param
    if DEV.dlpack_device_type() != tvm.cpu().dlpack_device_type():
        import gpu_kernel_libs

        mod = gpu_kernel_libs.load_mla(dtype, os.environ["RELAX_KVCACHE_TEST_LIBS"])
        names = ("append", "copy", "gather") + (("attention", "attention_kc32", "attention_h32")
                                                 if gpu_kernel_libs.mla_has_attention(dtype) else ())
        return dtype, {k: mod[k] for k in names}
    from relax_kvcache import runtime
    from relax_kvcache.tir_kernels import schedule_for

    target = runtime.default_target(tvm.cpu())
    funcs = kernel_funcs(dtype, schedule_for(target))
    mod = tvm.compile(tvm.IRModule(funcs), target=target)
    return dtype, {k: mod[k] for k in funcs}


def _attention(kernels, variant="attention"):
    if "attention" not in kernels:
        pytest.skip("GPU MLA attention runs on tensor cores: float16 / bfloat16 only")
    if variant not in kernels:
        pytest.skip("the 32-row GPU tile is built for CUDA targets only")
    return kernels[variant]


def _t(x):
    return tvm.runtime.tensor(np.ascontiguousarray(x), DEV)


def _randn(rng, shape, dtype):
    return rng.standard_normal(shape).astype(NP_DTYPE[dtype])


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.uint8)


def test_append_copy_gather(mla):
    dtype, k = mla
    rng = np.random.default_rng(7)
    pages = _randn(rng, (6, PAGE, WIDTH), dtype)
    n = 21
    kv = _randn(rng, (n, WIDTH), dtype)
    position_map = rng.choice(6 * PAGE, size=n, replace=False).astype(np.int32)
    position_map[[3, 11]] = -1  # skipped tokens
    pages_t = _t(pages)
    k["append"](pages_t, _t(kv), _t(position_map))
    expect = pages.copy()
    for i, pos in enumerate(position_map):
        if pos >= 0:
            expect[pos // PAGE, pos % PAGE] = kv[i]
    np.testing.assert_array_equal(_bits(pages_t.numpy()), _bits(expect))

    k["copy"](pages_t, 2, 5, 9)
    expect[5, :9] = expect[2, :9]
    np.testing.assert_array_equal(_bits(pages_t.numpy()), _bits(expect))

    positions = rng.choice(6 * PAGE, size=13, replace=False).astype(np.int32)
    out = np.full((3, 13, WIDTH), np.nan, NP_DTYPE[dtype])
    out_t = _t(out)
    k["gather"](pages_t, _t(positions), out_t, 1)
    expect_out = out.copy()
    expect_out[1] = expect[positions // PAGE, positions % PAGE]
    np.testing.assert_array_equal(_bits(out_t.numpy()), _bits(expect_out))


@pytest.mark.parametrize("variant", ["attention", "attention_kc32", "attention_h32"])
@pytest.mark.parametrize("case", ["decode", "prefill", "chunk_on_context"])
def test_absorbed_attention(mla, case, variant):
    dtype, k = mla
    kernel = _attention(k, variant)
    heads = MANY_HEADS if variant == "attention_h32" else HEADS
    rng = np.random.default_rng(hash(case) % 2**32)
    batch = 3
    if case == "decode":
        kv_lens, q_lens = rng.integers(1, 70, batch), np.ones(batch, int)
    elif case == "prefill":
        q_lens = rng.integers(1, 40, batch)
        kv_lens = q_lens.copy()
    else:
        q_lens = rng.integers(1, 20, batch)
        kv_lens = q_lens + rng.integers(1, 50, batch)
    npages = -(-kv_lens // PAGE)
    total_pages = int(npages.sum()) + 3
    pages = _randn(rng, (total_pages, PAGE, WIDTH), dtype)
    page_indices = rng.permutation(total_pages)[: int(npages.sum())].astype(np.int32)
    page_indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
    last_len = (kv_lens - (npages - 1) * PAGE).astype(np.int32)
    qo_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = _randn(rng, (int(q_lens.sum()), heads, WIDTH), dtype)
    o = _t(np.full((len(q), heads, LORA), np.nan, NP_DTYPE[dtype]))
    lse = _t(np.full((len(q), heads), np.nan, np.float32))
    sm_scale = (128 + ROPE) ** -0.5  # DeepSeek scales by the original qk head dim
    causal = int(case != "decode")
    kernel(_t(q), _t(qo_indptr), _t(pages), _t(page_indptr), _t(page_indices), _t(last_len), o, lse, causal, sm_scale)
    o, lse = o.numpy().astype(np.float64), lse.numpy()
    for b in range(batch):
        rows = pages[page_indices[page_indptr[b]:page_indptr[b + 1]]].reshape(-1, WIDTH)[: kv_lens[b]]
        latent = rows.astype(np.float64)[:, None, :]
        ref_o, ref_lse = ref.attention(q[qo_indptr[b]:qo_indptr[b + 1]], latent, latent[:, :, :LORA], sm_scale,
                                       causal=bool(causal))
        np.testing.assert_allclose(o[qo_indptr[b]:qo_indptr[b + 1]], ref_o, atol=O_TOL[dtype], rtol=0)
        np.testing.assert_allclose(lse[qo_indptr[b]:qo_indptr[b + 1]], ref_lse, atol=LSE_ATOL, rtol=1e-5)


def test_absorbed_kernel_equals_decompressed_attention(mla):
    """Seed 002's MLA identity through our kernel: attention over decompressed per-head K/V
    (K = [c W_UK, k_rope], V = c W_UV, float64 numpy) equals the kernel's absorbed attention over
    the latent rows [c, k_rope] with queries [q_nope W_UK^T, q_rope], followed by W_UV."""
    dtype, k = mla
    rng = np.random.default_rng(3)
    n, m, dn, dv = 5, 37, 128, 128  # DeepSeek-V3's qk_nope / v head dims
    latent = _randn(rng, (m, WIDTH), dtype)
    c, k_rope = latent[:, :LORA].astype(np.float64), latent[:, LORA:].astype(np.float64)
    w_uk = rng.standard_normal((HEADS, LORA, dn)) / np.sqrt(LORA)
    w_uv = rng.standard_normal((HEADS, LORA, dv)) / np.sqrt(LORA)
    q_nope = rng.standard_normal((n, HEADS, dn))
    q_rope = rng.standard_normal((n, HEADS, ROPE))
    scale = (dn + ROPE) ** -0.5
    k_full = np.concatenate([np.einsum("mr,hrd->mhd", c, w_uk), np.repeat(k_rope[:, None], HEADS, 1)], -1)
    v_full = np.einsum("mr,hrd->mhd", c, w_uv)
    o_full, lse_full = ref.attention(np.concatenate([q_nope, q_rope], -1), k_full, v_full, scale, causal=True)

    q_abs = np.concatenate([np.einsum("nhd,hrd->nhr", q_nope, w_uk), q_rope], -1).astype(NP_DTYPE[dtype])
    npages = -(-m // PAGE)
    pages = np.zeros((npages, PAGE, WIDTH), NP_DTYPE[dtype])
    pages.reshape(-1, WIDTH)[:m] = latent
    o = _t(np.full((n, HEADS, LORA), np.nan, NP_DTYPE[dtype]))
    lse = _t(np.full((n, HEADS), np.nan, np.float32))
    _attention(k)(_t(q_abs), _t(np.array([0, n], np.int32)), _t(pages), _t(np.array([0, npages], np.int32)),
                   _t(np.arange(npages, dtype=np.int32)), _t(np.array([m - (npages - 1) * PAGE], np.int32)),
                   o, lse, 1, scale)
    o_proj = np.einsum("nhr,hrd->nhd", o.numpy().astype(np.float64), w_uv)
    tol = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 3e-2}[dtype]
    np.testing.assert_allclose(o_proj, o_full, atol=tol, rtol=0)
    np.testing.assert_allclose(lse.numpy(), lse_full, atol=tol * 10, rtol=1e-5)


def test_bad_specs_and_tensors(mla):
    """Bad specs name the value; a kernel given a tensor of the wrong width raises and writes nothing."""
    if DEV.dlpack_device_type() != tvm.cpu().dlpack_device_type():
        pytest.skip("kernel specs are made on the development machine (TVMScript)")
    from relax_kvcache import tir_kernels as tk
    from relax_kvcache.tir_kernels import CpuSchedule

    with pytest.raises(ValueError, match="width must be positive, got 0"):
        tk.LatentPageSpec(width=0, page_size=PAGE, dtype="float32")
    with pytest.raises(ValueError, match="dtype must be one of"):
        tk.LatentPageSpec(width=WIDTH, page_size=PAGE, dtype="int8")
    two_heads = tk.AttentionSpec(num_qo_heads=HEADS, num_kv_heads=2, qk_head_dim=WIDTH, v_head_dim=LORA,
                                 dtype="float32", page_size=PAGE)
    with pytest.raises(ValueError, match="one latent head"):
        tk.make_paged_mla(two_heads, CpuSchedule())
    dtype, k = mla
    rng = np.random.default_rng(11)
    pages = _randn(rng, (2, PAGE, WIDTH), dtype)
    pages_t = _t(pages)
    with pytest.raises(Exception, match=str(WIDTH)):
        k["append"](pages_t, _t(_randn(rng, (3, WIDTH - 8), dtype)), _t(np.arange(3, dtype=np.int32)))
    np.testing.assert_array_equal(_bits(pages_t.numpy()), _bits(pages))
