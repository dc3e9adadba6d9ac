"""Accuracy of attention over 8-bit KV pages against float64 attention over the unquantized K/V.

A cache of each 8-bit format (float16 model, 8 / 2 heads, head_dim 64, no RoPE) stores 400
tokens and decodes the last 16, so that every key is read as stored. Inputs: unit-variance q / k
/ v, and the same with four key channels offset by 50-200 (outliers, as real keys have); scales
1.0, ``amax / format max`` per (K or V, head) over all tokens, and calibrated by the cache from
the prefill step (``calibrate_kv_scales``: the prefill's amax; later tokens may saturate). Per
row: the max / mean abs error of our
outputs, of float64 attention over the rounded K/V (the format's own error) and between the two
(what the kernels add). Runs on the CPU.

    python benchmarks/fp8_accuracy.py
"""

from __future__ import annotations

import math
import pathlib
import sys

import ml_dtypes
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "python"))

import tvm  # noqa: E402

import relax_kvcache as rk  # noqa: E402
from relax_kvcache.reference import attention  # noqa: E402
from relax_kvcache.tir_kernels.spec import FP8_MAX  # noqa: E402

HQ, H, D, N, DECODE = 8, 2, 64, 400, 16
SM_SCALE = 1 / math.sqrt(D)


def decode_outputs(kv_dtype, scales, qkv: np.ndarray):
    """Prefill all but the last ``DECODE`` tokens, decode those; their outputs (float64) and the
    scales used (``scales`` "calibrated": the cache's from the prefill step)."""
    config = rk.KVCacheConfig(num_layers=1, num_qo_heads=HQ, num_kv_heads=H, head_dim=D, max_num_seqs=1,
                              max_total_seq_len=N, prefill_chunk_size=N, dtype="float16", kv_dtype=kv_dtype,
                              rope_mode=rk.RopeMode.NONE)
    cache = rk.PagedAttentionKVCache(config)
    if scales == "calibrated":
        cache.calibrate_kv_scales()
    elif kv_dtype is not None:
        cache.set_kv_scales(0, *scales)
    cache.add_sequence(0)
    outs = []
    for lo, hi in [(0, N - DECODE)] + [(i, i + 1) for i in range(N - DECODE, N)]:
        out = tvm.runtime.tensor(np.full((hi - lo, HQ, D), np.nan, np.float16))
        cache.begin_forward([0], [hi - lo])
        cache.attention_with_fused_qkv(0, tvm.runtime.tensor(qkv[lo:hi]), out, SM_SCALE)
        cache.end_forward()
        outs.append(out.numpy()[-1])
    return np.stack(outs[1:]).astype(np.float64), cache.get_kv_scales(0)


def reference(q, k, v) -> np.ndarray:
    """float64 attention of the decoded tokens."""
    return np.stack([attention(q[i:i + 1], k[:i + 1], v[:i + 1], SM_SCALE, causal=True)[0][0]
                     for i in range(N - DECODE, N)])


def rounded(x: np.ndarray, scale, fmt: str) -> np.ndarray:
    """``x`` as the pages store it, in float64: ``x / scale`` saturated and rounded, times ``scale``."""
    s = np.asarray(scale, np.float32).reshape(1, -1, 1)
    q = np.clip(x.astype(np.float32) / s, -FP8_MAX[fmt], FP8_MAX[fmt]).astype(getattr(ml_dtypes, fmt))
    return (q.astype(np.float32) * s).astype(np.float16).astype(np.float64)


def main() -> int:
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((N, heads, D)) for heads in (HQ, H, H))
    outlier = k.copy()
    outlier[:, :, rng.choice(D, 4, replace=False)] += rng.uniform(50, 200, (1, H, 4)) * rng.choice([-1, 1], (1, H, 4))
    print(f"8-bit pages vs float64 over unquantized K/V: float16 model, {HQ}/{H} heads, head_dim {D}, "
          f"{N} tokens, {DECODE} decode steps; max / mean abs error")
    print("| K / V | format | scales | ours | format's rounding alone (float64) | ours vs that |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, keys in (("unit variance", k), ("key outliers", outlier)):
        q16, k16, v16 = (x.astype(np.float16) for x in (q, keys, v))
        exact = reference(*(x.astype(np.float64) for x in (q16, k16, v16)))
        qkv = np.concatenate([q16, k16, v16], axis=1)
        for fmt in ("float8_e4m3fn", "float8_e5m2"):
            amax = [np.abs(x.astype(np.float32)).max(axis=(0, 2)) / FP8_MAX[fmt] for x in (k16, v16)]
            for label, scales in (("1.0", (1.0, 1.0)), (f"amax / {FP8_MAX[fmt]:g}", amax),
                                  ("calibrated (prefill amax)", "calibrated")):
                ours, scales = decode_outputs(fmt, scales, qkv)
                alone = reference(q16.astype(np.float64), rounded(k16, scales[0], fmt), rounded(v16, scales[1], fmt))
                err, inherent = np.abs(ours - exact), np.abs(alone - exact)
                print(f"| {name} | {fmt.split('_')[1]} | {label} | {err.max():.2g} / {err.mean():.2g} | "
                      f"{inherent.max():.2g} / {inherent.mean():.2g} | {np.abs(ours - alone).max():.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
