"""MLA prefill over a long cached context on a GPU: chunked compute-friendly attention (ours)
against the absorbed attention TVM's native cache runs, side by side on the same inputs.

Shape: DeepSeek-V3's latent (kv_lora_rank 512 + rope 64, float16, pages of 16), one layer,
``--heads`` query heads, ``--batch`` sequences of ``--context`` cached tokens each appending
``--new`` tokens in one prefill step. Timed: the attention of the step's queries over the cached
context (the part that grows with the context; the step's own tokens are the same ragged
self-attention either way, merged by LSE afterwards), two ways:

* absorbed (seed 000's ``MLACrossAttnInternal``, non-causal over the cached pages; TVM's native
  cache with TVM's kernels, and ours): queries multiplied by W_UK attend the latent pages
  directly, ``2 Hq (W + L)`` FLOPs per (query, cached token);
* compute-friendly (seed 002's chunked context; ours, ``mla_context_attention`` with chunks of
  ``--chunk`` rows): the context decompressed chunk by chunk by a PyTorch callback on the same GPU
  (``latent @ W_UK``, ``latent @ W_UV``, through DLPack) and attended by the ragged kernel,
  ``2 Hq (Dqk + Dv)`` FLOPs per pair plus the decompression GEMMs.

Checked: every output against the absorbed result of TVM's cache mapped through W_UV, and all of
them against float64 numpy (first 4 heads of every sequence). Roofline: FLOPs / measured fp16
matmul rate.

Usage::

    python benchmarks/gpu_mla_bench.py --prepare .gpu/mla          # development machine (same libs)
    python benchmarks/gpu_mla_context_bench.py --libs .gpu/mla      # GPU host, needs PyTorch
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "benchmarks"))

import tvm  # noqa: E402
import tvm_ffi  # noqa: E402

import relax_kvcache as rk  # noqa: E402
from gpu_mla_bench import LORA, NOPE, ROPE, TVM_NAMES, VDIM, W, config, native_cache  # noqa: E402


def _builtins():
    names = ("kv_state_add_sequence", "kv_state_begin_forward", "kv_state_end_forward",
             "attention_kv_cache_append_mla_kv", "attention_kv_cache_cross_attention")
    return {n: tvm_ffi.get_global_func(f"vm.builtin.{n}") for n in names}


def run(libs: pathlib.Path, heads: int, batch: int, context: int, new: int, chunk: int, min_time: float,
        matmul_rate: float) -> str:
    import dataclasses

    import torch

    import gpu_prepare
    from gpu_bench import time_per_call
    from relax_kvcache.kernel_set import KernelSet

    device, shape, rng = tvm.cuda(0), tvm.runtime.ShapeTuple, np.random.default_rng(heads)
    cfg = dataclasses.replace(config(heads), context_chunk_size=chunk)
    ours = rk.PagedAttentionKVCache(cfg, device, kernels=KernelSet.from_module(
        gpu_prepare.load_library(libs / f"ours-h{heads}.so", device)))
    tvm_mod = gpu_prepare.load_library(libs / f"tvm-h{heads}.so", device)
    native = native_cache(cfg, {n: tvm_mod.get_function(n, query_imports=True) for n in TVM_NAMES}, device)
    g = _builtins()
    w_uk = (rng.standard_normal((LORA, heads, NOPE)) / LORA ** 0.5).astype(np.float16)
    w_uv = (rng.standard_normal((LORA, heads, VDIM)) / LORA ** 0.5).astype(np.float16)
    tw_uk, tw_uv = (torch.from_numpy(w.reshape(LORA, -1)).cuda() for w in (w_uk, w_uv))

    def decompress(latent, k, v):  # latent (c, W) -> k (c, H, NOPE + ROPE), v (c, H, VDIM)
        lat, tk, tv = torch.from_dlpack(latent), torch.from_dlpack(k), torch.from_dlpack(v)
        tk[:, :, :NOPE] = (lat[:, :LORA] @ tw_uk).view(-1, heads, NOPE)
        tk[:, :, NOPE:] = lat[:, None, LORA:]
        tv.copy_((lat[:, :LORA] @ tw_uv).view(-1, heads, VDIM))

    latents = [rng.standard_normal((context + new, W)).astype(np.float16) for _ in range(batch)]
    for c in (ours, native):
        for s in range(batch):
            g["kv_state_add_sequence"](c, s)
            for start in range(0, context, cfg.prefill_chunk_size):
                rows = latents[s][start:min(context, start + cfg.prefill_chunk_size)]
                g["kv_state_begin_forward"](c, shape([s]), shape([len(rows)]), None)
                g["attention_kv_cache_append_mla_kv"](c, 0, tvm.runtime.tensor(rows, device))
                g["kv_state_end_forward"](c)
    n = batch * new
    q = (rng.standard_normal((n, heads, NOPE + ROPE)) * 0.5).astype(np.float16)
    q_abs = np.concatenate([np.einsum("nhd,lhd->nhl", q[..., :NOPE].astype(np.float32), w_uk.astype(np.float32)),
                            q[..., NOPE:]], axis=-1).astype(np.float16)
    new_rows = np.concatenate([lat[context:] for lat in latents])
    scale = (NOPE + ROPE) ** -0.5
    t = lambda a: tvm.runtime.tensor(np.ascontiguousarray(a), device)  # noqa: E731
    q_t, q_abs_t, new_t = t(q), t(q_abs), t(new_rows)

    def nan(*dims, dtype=np.float16):
        return t(np.full(dims, np.nan, dtype))

    results, times = {}, {}
    for name, c in (("tvm absorbed", native), ("ours absorbed", ours)):
        g["kv_state_begin_forward"](c, shape(list(range(batch))), shape([new] * batch), None)
        g["attention_kv_cache_append_mla_kv"](c, 0, new_t)
        o, lse = nan(n, heads, LORA), nan(n, heads, dtype=np.float32)
        attend = lambda c=c, o=o, lse=lse: g["attention_kv_cache_cross_attention"](c, 0, scale, q_abs_t, o, lse)  # noqa: E731
        attend()
        results[name] = (np.einsum("nhl,lhd->nhd", o.numpy().astype(np.float32), w_uv.astype(np.float32)),
                         lse.numpy())
        times[name] = time_per_call(attend, device, min_time)
        if c is native:
            g["kv_state_end_forward"](c)
    # ours, compute-friendly (the step of ours stays open: same appended rows)
    o, lse = nan(n, heads, VDIM), nan(n, heads, dtype=np.float32)

    def compute_friendly():
        ours.mla_context_attention(0, q_t, o, lse, scale, decompress)

    compute_friendly()
    results["ours chunked"] = (o.numpy().astype(np.float32), lse.numpy())
    times["ours chunked"] = time_per_call(compute_friendly, device, min_time)
    ours.end_forward()
    ref_o, ref_lse = results["tvm absorbed"]
    lines = []
    pairs = batch * new * context
    flops = {"tvm absorbed": 2 * heads * (W + LORA) * pairs, "ours absorbed": 2 * heads * (W + LORA) * pairs,
             "ours chunked": 2 * heads * (NOPE + ROPE + VDIM) * pairs
             + 2 * batch * context * LORA * heads * (NOPE + VDIM)}
    for name in ("tvm absorbed", "ours absorbed", "ours chunked"):
        o_, lse_ = results[name]
        err = _numpy_error(q, latents, w_uk, w_uv, o_, batch, context, new, scale)
        rate = flops[name] / times[name] / 1e12
        lines.append(f"| {heads} | {batch}x{context}+{new} | {name} | {times[name] * 1e3:.2f} ms | "
                     f"{times['tvm absorbed'] / times[name]:.2f}x | {rate:.0f} TFLOP/s = "
                     f"{100 * rate * 1e12 / matmul_rate:.0f}% | {np.abs(o_ - ref_o).max():.1e} | "
                     f"{np.abs(lse_ - ref_lse).max():.1e} | {err:.1e} |")
    return "\n".join(lines)


def _numpy_error(q, latents, w_uk, w_uv, out, batch, context, new, scale, heads=4) -> float:
    """Max |out - float64 attention| over every sequence, on the first ``heads`` heads (cheap)."""
    err = 0.0
    w_uk, w_uv = w_uk[:, :heads].astype(np.float64), w_uv[:, :heads].astype(np.float64)
    for s in range(batch):
        rows = latents[s][:context].astype(np.float64)  # the cached context (the step's own tokens: self_attention)
        k = np.concatenate([np.einsum("cl,lhd->chd", rows[:, :LORA], w_uk),
                            np.broadcast_to(rows[:, None, LORA:], (len(rows), heads, ROPE))], axis=-1)
        v = np.einsum("cl,lhd->chd", rows[:, :LORA], w_uv)
        qs = q[s * new:(s + 1) * new, :heads].astype(np.float64)
        logits = np.einsum("nhd,chd->hnc", qs, k) * scale  # every cached token precedes every query
        p = np.exp(logits - logits.max(-1, keepdims=True))
        ref = np.einsum("hnc,chd->nhd", p / p.sum(-1, keepdims=True), v)
        err = max(err, float(np.abs(out[s * new:(s + 1) * new, :heads] - ref).max()))
    return err


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--libs", type=pathlib.Path, required=True, help="gpu_mla_bench.py --prepare's folder")
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--new", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=4096, help="context_chunk_size")
    parser.add_argument("--min-time", type=float, default=0.3)
    args = parser.parse_args(argv)
    import gpu_prepare
    from gpu_bench import measure_matmul_rate

    device = tvm.cuda(0)
    gpu_prepare.load_library(args.libs / f"ours-h{args.heads[0]}.so", device)  # sets up the CUDA runtime
    rate = measure_matmul_rate(device) or float("nan")
    rows = []
    for h in args.heads:
        for ctx in args.context:
            rows.append(run(args.libs, h, args.batch, ctx, args.new, args.chunk, args.min_time, rate))
            print(rows[-1], flush=True)
    print(f"\nfp16 matmul rate {rate / 1e12:.0f} TFLOP/s; chunk {args.chunk} rows; errors vs TVM's absorbed result "
          "mapped through W_UV")
    print("| heads | batch x context + new | path | time | vs TVM | FLOP rate | max |o - tvm| | max |lse - tvm| "
          "| max |o - f64| (4 heads) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
