"""MLA decode on a GPU: our cache and TVM's native one, side by side on the same inputs.

Shape: DeepSeek-V3's latent (kv_lora_rank 512 + rope 64, float16, pages of 16), batch 64 x 4096
cached tokens, one layer, ``--heads`` query heads (16: DeepSeek-V3 over 8 GPUs of tensor
parallelism; 128: one GPU). Both caches get the same latent rows (``append_mla_kv``), then one
decode step: ``append_mla_kv`` and the absorbed ``cross_attention`` (TVM's
``attention_prefill_mla`` kernel in the native cache, ours in ours). Checked: ours against TVM
and against float64 numpy on sampled sequences. Timed: ``cross_attention`` (repeated inside the
step; it changes nothing). Anchors, where PyTorch is installed: SDPA's backends on the same
absorbed step over contiguous latents (q of 576 dims against K = the latent rows, V = their
first 512 dims, the one latent head broadcast to every query head), GPU time by CUDA events;
"n/a" where a backend refuses the shapes (FlashAttention-2 and cuDNN stop at head dim 256).
Roofline: latent bytes read / measured copy bandwidth, and FLOPs
(``2 Hq (W + DV)`` per cached token) / measured fp16 matmul rate.

Usage::

    python benchmarks/gpu_mla_bench.py --prepare .gpu/mla           # development machine
    python benchmarks/gpu_mla_bench.py --libs .gpu/mla [--heads 16 128]   # GPU host
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import pathlib
import sys

import numpy as np

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "benchmarks"))

import tvm  # noqa: E402
import tvm_ffi  # noqa: E402

import relax_kvcache as rk  # noqa: E402

LORA, ROPE, NOPE, VDIM, PAGE = 512, 64, 128, 128, 16
W = LORA + ROPE
BATCH, CONTEXT = 64, 4096
TVM_NAMES = ("transpose_append_mla", "attention_prefill_mla", "attention_prefill_ragged", "merge_inplace",
             "merge_general", "copy_single_page", "debug_get_kv")


def config(heads: int) -> rk.KVCacheConfig:
    return rk.KVCacheConfig(
        num_layers=1, num_qo_heads=heads, num_kv_heads=1, head_dim=W, v_head_dim=LORA,
        mla_original_qk_head_dim=NOPE + ROPE, mla_original_v_head_dim=VDIM, page_size=PAGE,
        max_num_seqs=BATCH, max_total_seq_len=BATCH * (CONTEXT + 16), prefill_chunk_size=CONTEXT,
        rope_mode=rk.RopeMode.NONE, dtype="float16", attn_kinds=[rk.AttnKind.MLA])


# ----------------------------------------------------------------------------- development machine

def prepare(out: pathlib.Path, heads, arch: str) -> None:
    """Our kernel sets and TVM's MLA kernels for each head count, with nvcc fatbins."""
    import gpu_prepare
    import tvm.relax.frontend.nn.llm.kv_cache as kc
    from tvm.s_tir import dlight as dl

    from relax_kvcache import build
    from relax_kvcache.build import _pass_config
    from relax_kvcache.targets import make_target

    target = make_target("cuda", arch=arch)
    out.mkdir(parents=True, exist_ok=True)
    for h in heads:
        path = out / f"ours-h{h}.so"
        ours = build._compile(build.kernel_set_spec(config(h)), target, None, build.kernel_identity(config(h)))
        ours.export_library(str(path))
        gpu_prepare.precompile(gpu_prepare.cuda_source(ours.mod), arch, out)
        funcs = {
            "transpose_append_mla": kc._kv_cache_transpose_append_mla(W, "float16", PAGE),
            "attention_prefill_mla": kc._attention_prefill_mla(h, LORA, ROPE, "float16", False, target, PAGE),
            "attention_prefill_ragged": kc._attention_prefill_ragged(h, h, NOPE + ROPE, VDIM, "float16", {}, target),
            "merge_inplace": kc._merge_state_inplace(h, LORA, "float16", target),
            "merge_general": kc._merge_state_inplace(h, VDIM, "float16", target),
            "copy_single_page": kc._copy_single_page_mla(PAGE, W, "float16", target),
            "debug_get_kv": kc._kv_cache_debug_get_kv_mla(1, W, "float16"),
        }
        mod = tvm.IRModule({n: f.with_attr("global_symbol", n) for n, f in funcs.items()})
        with target:
            mod = dl.ApplyDefaultSchedule(dl.gpu.Fallback())(mod)
        with tvm.transform.PassContext(opt_level=3, config=_pass_config(target)):
            built = tvm.tirx.build(mod, target=target)
        built.export_library(str(out / f"tvm-h{h}.so"))
        gpu_prepare.precompile(gpu_prepare.cuda_source(built), arch, out)
        print(f"heads {h}: {path.name}, tvm-h{h}.so", flush=True)


# ----------------------------------------------------------------------------- GPU host

def native_cache(cfg: rk.KVCacheConfig, f, device):
    """TVM's C++ cache with TVM's MLA kernels (as TVM's own MLA test creates it)."""
    create = tvm_ffi.get_global_func("vm.builtin.paged_attention_kv_cache_create")
    dumb = f["debug_get_kv"]  # unused roles need some packed function
    return create(
        tvm.runtime.ShapeTuple([BATCH, cfg.max_total_seq_len, cfg.prefill_chunk_size, PAGE, 0]),
        tvm.runtime.ShapeTuple([0, 1]), cfg.num_qo_heads, 1, W, LORA, tvm.runtime.ShapeTuple([int(rk.AttnKind.MLA)]),
        False, int(rk.RopeMode.NONE), 1.0, 10000.0, None, tvm.runtime.empty((), "float16", device),
        None, f["transpose_append_mla"], ["tirx", f["attention_prefill_ragged"]], [], [], [], [], [], [],
        ["tirx", f["attention_prefill_mla"]], [f["merge_inplace"], f["merge_general"]], dumb,
        f["copy_single_page"], f["debug_get_kv"], dumb)


@dataclasses.dataclass
class Result:
    heads: int
    ours_s: float
    tvm_s: float
    diff: float
    err: float
    bytes: int
    flops: int
    anchors: dict = dataclasses.field(default_factory=dict)  # SDPA backend -> (seconds, max err) or None


#: SDPA backends timed as anchors (name, ``torch.nn.attention.SDPBackend`` member)
SDPA_BACKENDS = (("fa2", "FLASH_ATTENTION"), ("cudnn", "CUDNN_ATTENTION"), ("efficient", "EFFICIENT_ATTENTION"),
                 ("math", "MATH"))


def sdpa_anchors(latents, new, q, scale: float, refs, min_time: float) -> dict:
    """SDPA's backends on the absorbed decode step (see the module docstring): backend ->
    (seconds per call, max error against ``refs`` ``{sequence: float64 output}``), or None
    where the backend refuses the shapes."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from gpu_decode_bench import event_time_per_call

    rows = torch.from_numpy(np.stack([np.concatenate([lat, new[s:s + 1]]) for s, lat in enumerate(latents)]))
    heads = q.shape[1]
    # the one latent head as every query head's K / V (a broadcast view: SDPA's fused kernels take
    # no GQA of dense inputs)
    k = rows.cuda().unsqueeze(1).expand(-1, heads, -1, -1)  # (batch, heads, context + 1, W)
    v = k[..., :LORA]
    qt = torch.from_numpy(q).cuda().unsqueeze(2)  # (batch, heads, 1, W)
    found = {}
    for name, member in SDPA_BACKENDS:
        with sdpa_kernel([getattr(SDPBackend, member)]):
            call = lambda: F.scaled_dot_product_attention(qt, k, v, scale=scale)  # noqa: E731
            try:
                out = call()
            except (RuntimeError, torch.OutOfMemoryError):
                found[name] = None
                continue
            t = event_time_per_call(call, min_time)
        got = out[:, :, 0].double().cpu().numpy()
        found[name] = (t, max(float(np.abs(got[s] - ref).max()) for s, ref in refs.items()))
        del out
    return found


def run(libs: pathlib.Path, heads: int, device, rng, min_time: float) -> Result:
    import gpu_prepare
    from gpu_bench import time_per_call

    from relax_kvcache.kernel_set import KernelSet

    cfg = config(heads)
    ours_mod = gpu_prepare.load_library(libs / f"ours-h{heads}.so", device)
    tvm_mod = gpu_prepare.load_library(libs / f"tvm-h{heads}.so", device)
    ours = rk.PagedAttentionKVCache(cfg, device, kernels=KernelSet.from_module(ours_mod))
    f = {n: tvm_mod.get_function(n, query_imports=True) for n in TVM_NAMES}
    native = native_cache(cfg, f, device)
    g = {n: tvm_ffi.get_global_func(f"vm.builtin.{n}") for n in (
        "kv_state_add_sequence", "kv_state_begin_forward", "kv_state_end_forward",
        "attention_kv_cache_append_mla_kv", "attention_kv_cache_cross_attention")}
    caches = (ours, native)
    shape = tvm.runtime.ShapeTuple
    latents = []
    for s in range(BATCH):
        rows = rng.standard_normal((CONTEXT, W)).astype(np.float16)
        latents.append(rows)
        rows_t = tvm.runtime.tensor(rows, device)
        for c in caches:
            g["kv_state_add_sequence"](c, s)
            g["kv_state_begin_forward"](c, shape([s]), shape([CONTEXT]), None)
            g["attention_kv_cache_append_mla_kv"](c, 0, rows_t)
            g["kv_state_end_forward"](c)
    new = rng.standard_normal((BATCH, W)).astype(np.float16)
    q = (rng.standard_normal((BATCH, heads, W)) * 0.05).astype(np.float16)
    new_t, q_t = tvm.runtime.tensor(new, device), tvm.runtime.tensor(q, device)
    scale = (NOPE + ROPE) ** -0.5
    outs, times = [], []
    for c in caches:
        g["kv_state_begin_forward"](c, shape(list(range(BATCH))), shape([1] * BATCH), None)
        g["attention_kv_cache_append_mla_kv"](c, 0, new_t)
        o = tvm.runtime.tensor(np.full((BATCH, heads, LORA), np.nan, np.float16), device)
        lse = tvm.runtime.tensor(np.full((BATCH, heads), np.nan, np.float32), device)
        attend = lambda c=c, o=o, lse=lse: g["attention_kv_cache_cross_attention"](c, 0, scale, q_t, o, lse)  # noqa: E731
        attend()
        outs.append((o.numpy().astype(np.float64), lse.numpy()))
        times.append(time_per_call(attend, device, min_time))
        g["kv_state_end_forward"](c)
    diff = float(np.abs(outs[0][0] - outs[1][0]).max())
    refs = {}
    for s in rng.choice(BATCH, 4, replace=False):
        rows = np.concatenate([latents[s], new[s:s + 1]]).astype(np.float64)
        logits = q[s].astype(np.float64) @ rows.T * scale
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        refs[int(s)] = (p / p.sum(axis=1, keepdims=True)) @ rows[:, :LORA]
    err = max(float(np.abs(outs[0][0][s] - ref).max()) for s, ref in refs.items())
    tokens = BATCH * (CONTEXT + 1)
    anchors = sdpa_anchors(latents, new, q, scale, refs, min_time) if importlib.util.find_spec("torch") else {}
    return Result(heads, times[0], times[1], diff, err, tokens * W * 2 + 2 * q.nbytes,
                  2 * heads * (W + LORA) * tokens, anchors)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prepare", type=pathlib.Path, help="build the libraries into this folder")
    parser.add_argument("--libs", type=pathlib.Path, help="run with the libraries of this folder")
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--min-time", type=float, default=0.3)
    args = parser.parse_args(argv)
    if args.prepare:
        prepare(args.prepare, args.heads, args.arch)
        return 0
    from gpu_bench import measure_copy_bandwidth, measure_matmul_rate

    device = tvm.cuda()
    rng = np.random.default_rng(0)
    results = [run(args.libs, h, device, rng, args.min_time) for h in args.heads]
    bandwidth = measure_copy_bandwidth(device, 1 << 30, args.min_time)
    matmul = measure_matmul_rate(device)
    print(f"\nMLA decode, batch {BATCH} x {CONTEXT} cached tokens, latent {LORA}+{ROPE} float16, page {PAGE}; "
          f"copy {bandwidth / 1e9:.0f} GB/s, matmul {matmul / 1e12 if matmul else float('nan'):.0f} TFLOP/s")
    print(f"{'heads':>5} {'ours us':>9} {'TVM us':>9} {'speedup':>8} {'% copy BW':>10} {'TFLOP/s':>8} "
          f"{'BW roof us':>10} {'FLOP roof us':>12} {'|ours-TVM|':>10} {'err f64':>8}")
    for r in results:
        print(f"{r.heads:>5} {r.ours_s * 1e6:>9.1f} {r.tvm_s * 1e6:>9.1f} {r.tvm_s / r.ours_s:>7.2f}x "
              f"{100 * r.bytes / r.ours_s / bandwidth:>9.1f}% {r.flops / r.ours_s / 1e12:>8.1f} "
              f"{r.bytes / bandwidth * 1e6:>10.1f} {r.flops / matmul * 1e6 if matmul else float('nan'):>12.1f} "
              f"{r.diff:>10.2e} {r.err:>8.2e}")
    if any(r.anchors for r in results):
        print("\nSDPA anchors on the same step (GPU time by CUDA events): us, ours' speedup over it, max err vs "
              "float64")
        print(f"{'heads':>5} " + " ".join(f"{'sdpa-' + name:>26}" for name, _ in SDPA_BACKENDS))
        for r in results:
            cells = [f"{a[0] * 1e6:9.1f} {a[0] / r.ours_s:6.2f}x {a[1]:8.1e}" if a else "n/a"
                     for a in (r.anchors.get(name) for name, _ in SDPA_BACKENDS)]
            print(f"{r.heads:>5} " + " ".join(f"{c:>26}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
