"""Accuracy of attention over 8-bit KV pages against float64 attention over the unquantized K/V.

A cache of each 8-bit format (float16 model, 8 / 2 heads, head_dim 64, no RoPE) stores 400
tokens and decodes the last 16, so that every key is read as stored. Inputs: unit-variance q / k
/ v, and the same with four key channels offset by 50-200 (outliers, as real keys have); scales
1.0, ``amax / format max`` per (K or V, head) over all tokens, and calibrated by the cache from
the prefill step (``calibrate_kv_scales``: the prefill's amax; later tokens may saturate). Per
row: the max / mean abs error of our
outputs, of float64 attention over the rounded K/V (the format's own error) and between the two
(what the kernels add). Runs on the CPU.

``--model``: the demo Llama (float32, 2 layers, 8 / 2 heads, head_dim 32, vocab 512; compiled
for llvm) over pages of its dtype and of each 8-bit format (scales 1.0 and calibrated), against
the float64 numpy model: prompts of 40 / 75 / 100 / 23 tokens prefilled 32 tokens per sequence a
step (later chunks read the stored K/V), then 32 greedy tokens decoded as one batch. Teacher
forced (fed the float64 model's greedy tokens): max / mean |logit error| and the fraction of
steps whose argmax is the float64 model's token; free running (fed its own tokens): tokens
identical to the float64 model's before the first difference. Weights: the demo's random ones
(unit-variance K/V), and the same function reparametrized to Llama-like K/V magnitudes
(:func:`llama_like`).

    python benchmarks/fp8_accuracy.py [--model]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import sys
from typing import Dict, List, Optional, Sequence

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


def attention_table() -> None:
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


# ----------------------------------------------------------------------------- the demo model (--model)

MODEL_PROMPTS = (40, 75, 100, 23)
MODEL_NEW_TOKENS = 32
MODEL_CHUNK = 32  # prompt tokens per sequence and prefill step
PAGE_FORMATS = (None, "float8_e4m3fn", "float8_e5m2")


def llama_like(cfg, weights: Dict[str, np.ndarray], v_scale: float = 0.1, k_outlier: float = 16.0,
               pairs: int = 2, seed: int = 1) -> Dict[str, np.ndarray]:
    """The same model (in exact arithmetic) with K/V of Llama-like magnitudes: V rows of
    ``qkv_proj`` times ``v_scale`` and ``o_proj`` divided by it (V std ~0.1, values below e4m3's
    smallest normal 2^-6 common); per KV head ``pairs`` rotary pairs of K channels times
    ``k_outlier`` (|k| up to ~50, as real keys' outlier channels) and the same channels of its
    query heads divided by it (scores unchanged: RoPE rotates a pair as one)."""
    w = {name: value.copy() for name, value in weights.items()}
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    group, rng = hq // hkv, np.random.default_rng(seed)
    for layer in range(cfg.num_layers):
        qkv, o = w[f"layers.{layer}.self_attn.qkv_proj.weight"], w[f"layers.{layer}.self_attn.o_proj.weight"]
        qkv[(hq + hkv) * d:] *= v_scale
        o /= v_scale
        for j in range(hkv):
            for c in rng.choice(d // 2, pairs, replace=False):
                for ch in (c, c + d // 2):
                    qkv[(hq + j) * d + ch] *= k_outlier
                    for head in range(j * group, (j + 1) * group):
                        qkv[head * d + ch] /= k_outlier
    return w


def greedy(reference, prompt: Sequence[int], n: int) -> List[int]:
    """``n`` greedy tokens of the float64 model after ``prompt``."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(reference.logits(tokens)[-1].argmax()))
    return tokens[len(prompt):]


def model_rows(vm, weights: List[tvm.runtime.Tensor], prompts: Sequence[Sequence[int]], steps: int,
               feed: Optional[Sequence[Sequence[int]]], scales: str):
    """Prefill ``prompts`` (``MODEL_CHUNK`` tokens of each per step), then ``steps - 1`` decode
    steps of all as one batch, fed ``feed`` (teacher forcing) or their own argmax (None). Per
    prompt: its logit rows predicting the ``steps`` new tokens ``(steps, vocab)`` (float64), and
    the tokens picked from them. ``scales``: "1.0" or "calibrated" (from the first step)."""
    shape, g = tvm.runtime.ShapeTuple, tvm.get_global_func
    begin, end = g("vm.builtin.kv_state_begin_forward"), g("vm.builtin.kv_state_end_forward")
    total = sum(map(len, prompts)) + len(prompts) * (steps + 16)
    cache = vm["create_kv_cache"](shape([len(prompts)]), shape([total]), shape([MODEL_CHUNK * len(prompts)]))
    if scales == "calibrated":
        cache.calibrate_kv_scales()
    for seq in range(len(prompts)):
        g("vm.builtin.kv_state_add_sequence")(cache, seq)
    rows: List[list] = [[] for _ in prompts]

    def forward(decode: bool, seqs, chunks):
        begin(cache, shape(seqs), shape([len(c) for c in chunks]))
        ids = np.concatenate(chunks).astype("int32")
        fn = vm["decode" if decode else "prefill"]
        out = fn(tvm.runtime.tensor(ids.reshape((-1, 1) if decode else (1, -1))), cache, *weights)
        end(cache)
        return out.numpy().reshape(len(ids), -1).astype(np.float64)

    for start in range(0, max(map(len, prompts)), MODEL_CHUNK):
        seqs = [s for s, p in enumerate(prompts) if start < len(p)]
        chunks = [np.asarray(prompts[s][start:start + MODEL_CHUNK]) for s in seqs]
        logits = forward(False, seqs, chunks)
        for s, last in zip(seqs, np.cumsum([len(c) for c in chunks]) - 1):
            if start + MODEL_CHUNK >= len(prompts[s]):
                rows[s].append(logits[last])
    for step in range(steps - 1):
        ids = [[feed[s][step] if feed else int(rows[s][-1].argmax())] for s in range(len(prompts))]
        for s, row in enumerate(forward(True, list(range(len(prompts))), ids)):
            rows[s].append(row)
    rows = [np.stack(r) for r in rows]
    return rows, [r.argmax(axis=1).tolist() for r in rows]


@dataclasses.dataclass(frozen=True)
class Expected:
    """The float64 model's side of :func:`logit_agreement`: prompts, greedy tokens, their logits."""

    cfg: object
    weights: Dict[str, np.ndarray]
    prompts: List[List[int]]
    tokens: List[List[int]]  # per prompt, its greedy continuation
    logits: List[np.ndarray]  # per prompt, the rows predicting those tokens (steps, vocab)


def expected(cfg, weights: Dict[str, np.ndarray], seed: int = 0, prompts: Sequence[int] = MODEL_PROMPTS,
             steps: int = MODEL_NEW_TOKENS) -> Expected:
    """Random prompts of the given lengths and the float64 model's greedy continuations."""
    from relax_kvcache.models import LlamaNumpy

    reference = LlamaNumpy(cfg, weights)
    rng = np.random.default_rng(seed)
    ids = [rng.integers(0, cfg.vocab_size, n).tolist() for n in prompts]
    tokens = [greedy(reference, p, steps) for p in ids]
    logits = [reference.logits(p + t[:-1])[len(p) - 1:] for p, t in zip(ids, tokens)]
    return Expected(cfg, weights, ids, tokens, logits)


def logit_agreement(executable, want: Expected, scales: str = "1.0") -> dict:
    """The compiled model (on the CPU) against the float64 model: teacher forced, max / mean abs
    logit error, max relative error (per row, over max |float64 row|, as ``generate.Engine``
    checks) and greedy agreement; free running, tokens identical before the first difference."""
    from tvm.runtime.vm import VirtualMachine

    vm = VirtualMachine(executable, tvm.cpu())
    weights = [tvm.runtime.tensor(w.astype(want.cfg.dtype)) for w in want.weights.values()]
    steps = len(want.tokens[0])
    forced, picked = model_rows(vm, weights, want.prompts, steps, want.tokens, scales)
    _, free = model_rows(vm, weights, want.prompts, steps, None, scales)
    err = np.abs(np.concatenate(forced) - np.concatenate(want.logits))
    rel = max(float((np.abs(f - w).max(axis=1) / np.abs(w).max(axis=1)).max()) for f, w in zip(forced, want.logits))
    same = [next((i for i, (a, b) in enumerate(zip(f, t)) if a != b), len(t)) for f, t in zip(free, want.tokens)]
    return {"max_abs": float(err.max()), "mean_abs": float(err.mean()), "max_rel": rel,
            "scale": float(max(np.abs(w).max() for w in want.logits)),
            "agreement": float(np.mean([a == b for p, t in zip(picked, want.tokens) for a, b in zip(p, t)])),
            "free_running": (sum(same), steps * len(want.prompts))}


def model_table() -> None:
    from relax_kvcache import model_demo
    from relax_kvcache.models import LlamaConfig, random_weights

    cfg = LlamaConfig()
    weights = random_weights(cfg, 0)
    print(f"the demo Llama ({cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads}/{cfg.num_kv_heads} "
          f"heads, head_dim {cfg.head_dim}, vocab {cfg.vocab_size}, float32) against the float64 numpy model; "
          f"prompts {list(MODEL_PROMPTS)}, {MODEL_NEW_TOKENS} greedy tokens each")
    print("| weights | pages | scales | max / mean abs logit error | max rel | greedy agreement (teacher forced) "
          "| free running: identical tokens |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    wants = {"random": expected(cfg, weights), "Llama-like K/V": expected(cfg, llama_like(cfg, weights))}
    for fmt in PAGE_FORMATS:
        executable = model_demo.compile_model(cfg, tvm.target.Target("llvm"), kv_dtype=fmt)
        for name, want in wants.items():
            for scales in ("1.0", "calibrated") if fmt else ("-",):
                r = logit_agreement(executable, want, scales)
                print(f"| {name} | {fmt or cfg.dtype} | {scales} | {r['max_abs']:.2g} / {r['mean_abs']:.2g} | "
                      f"{r['max_rel']:.2g} | {r['agreement']:.1%} | {r['free_running'][0]} / "
                      f"{r['free_running'][1]} |", flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="store_true", help="the demo model's logits instead of attention")
    args = parser.parse_args(argv)
    model_table() if args.model else attention_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
