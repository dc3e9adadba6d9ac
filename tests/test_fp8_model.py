"""A whole model over 8-bit KV pages: the demo Llama (float32 weights, llvm) compiled with a cache
of its dtype and with e4m3 pages, its logits against the float64 numpy model
(``benchmarks/fp8_accuracy.py --model``, the same code, prints the full table)."""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest
import tvm

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))

import fp8_accuracy  # noqa: E402
from relax_kvcache import model_demo  # noqa: E402
from relax_kvcache.models import LlamaConfig, LlamaNumpy, random_weights  # noqa: E402

CFG = LlamaConfig()


@pytest.fixture(scope="module")
def executables():
    target = tvm.target.Target("llvm")
    return {fmt: model_demo.compile_model(CFG, target, kv_dtype=fmt) for fmt in (None, "float8_e4m3fn")}


@pytest.fixture(scope="module")
def want():
    return fp8_accuracy.expected(CFG, random_weights(CFG, 0), prompts=(40, 75), steps=16)


def test_e4m3_logits_within_the_bound_and_model_dtype_pages_much_closer(executables, want):
    fp8 = fp8_accuracy.logit_agreement(executables["float8_e4m3fn"], want, "calibrated")
    same = fp8_accuracy.logit_agreement(executables[None], want)
    assert want.logits[0].shape == (16, CFG.vocab_size) and fp8["scale"] > 1.0  # logits of unit scale
    assert 1e-3 < fp8["max_rel"] <= model_demo.FP8_TOLERANCE["float8_e4m3fn"], fp8
    assert fp8["mean_abs"] > 1e-3 and fp8["agreement"] >= 0.9, fp8
    assert same["max_rel"] <= 1e-4 and same["agreement"] == 1.0, same
    assert same["free_running"][0] == same["free_running"][1]
    assert fp8["max_rel"] > 1000 * same["max_rel"] and fp8["mean_abs"] > 1000 * same["mean_abs"]


def test_e4m3_scales_one_and_calibrated_both_hold_the_bound(executables, want):
    one = fp8_accuracy.logit_agreement(executables["float8_e4m3fn"], want, "1.0")
    assert 1e-3 < one["max_rel"] <= model_demo.FP8_TOLERANCE["float8_e4m3fn"], one


def test_llama_like_weights_keep_the_function_and_change_the_kv_magnitudes():
    weights = random_weights(CFG, 0)
    like = fp8_accuracy.llama_like(CFG, weights)
    tokens = np.random.default_rng(1).integers(0, CFG.vocab_size, 20).tolist()
    a, b = LlamaNumpy(CFG, weights).logits(tokens), LlamaNumpy(CFG, like).logits(tokens)
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * np.abs(a).max())
    hq, hkv, d = CFG.num_heads, CFG.num_kv_heads, CFG.head_dim
    rows = lambda w, lo, hi: w["layers.0.self_attn.qkv_proj.weight"][lo * d:hi * d]  # noqa: E731
    assert np.abs(rows(like, hq + hkv, hq + 2 * hkv)).max() < 0.2 * np.abs(rows(weights, hq + hkv, hq + 2 * hkv)).max()
    assert np.abs(rows(like, hq, hq + hkv)).max() > 8 * np.abs(rows(weights, hq, hq + hkv)).max()


def test_model_demo_refuses_an_executable_of_other_pages(executables):
    with pytest.raises(ValueError, match="stores float32 pages; expected float8_e4m3fn"):
        model_demo.run_model_demo(executable=executables[None], kv_dtype="float8_e4m3fn", log=lambda _: None)
