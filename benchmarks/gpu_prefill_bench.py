"""Causal prefill on a GPU: our kernels, TVM's, and PyTorch SDPA's FlashAttention-2 and cuDNN.

Shape: Llama-3-8B attention (32 query / 8 KV heads, head_dim 128), float16 and bfloat16, pages
of 16. Two cases per (batch x length):

* **ragged**: fresh prompts, causal attention of each prompt over its own tokens (the step's
  K/V, ``attention_prefill_ragged``);
* **paged**: the second half of each sequence attending to its first half, cached in pages
  scattered at random, and to itself causally: what a chunked prefill step does. Each side
  runs the kernels its cache runs for such a step: ours ``attention_prefill``, one causal pass
  over the pages (the cache appends the step's K/V first), TVM's the ragged kernel over the new
  tokens, the paged kernel over the cached half and the merge of the two states (ours'
  three-kernel path and ``attention_prefill_prefixed`` are timed too, kernel by kernel).

PyTorch SDPA gets the same inputs with the KV heads repeated to 32 (outside the timing), causal
with the diagonal aligned at the bottom right (``causal_lower_right``) for the paged case.
Reported per shape and dtype: TFLOP/s of ours, FlashAttention-2, cuDNN and TVM's kernels
(FLOPs = 4 x heads x head_dim x visible query-key pairs), ours / FA2 and ours / cuDNN as
speed ratios (above 1: ours faster), the fp16 matmul rate as the roofline, the max abs
difference between ours and FA2, and ours' max abs error against float64 attention on sampled
query rows. ``ours-fp8`` (float16 only) runs the paged case's pass over the same K/V stored as
``float8_e4m3fn`` pages, checked against float64 attention over the stored values. Timing: calls
queued back to back between two synchronisations, median of three rounds.

Usage::

    python benchmarks/gpu_prefill_bench.py --prepare .gpu/prefill      # development machine
    python benchmarks/gpu_prefill_bench.py --libs .gpu/prefill         # GPU host (PyTorch)
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import numpy as np

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python"))

import tvm  # noqa: E402

import relax_kvcache as rk  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16
SHAPES = [(1, 2048), (8, 512), (1, 8192), (4, 4096)]
DTYPES = ("float16", "bfloat16")
ROLES = ("attention_prefill_ragged", "attention_prefill", "merge_inplace", "attention_prefill_prefixed")
REF_ROWS = 6  # sampled query tokens per shape checked against float64
FP8 = "float8_e4m3fn"  # ours-fp8: the paged case's pages in 8 bits (per-head scales amax / 448)


def config(dtype: str) -> rk.KVCacheConfig:
    return rk.KVCacheConfig(num_layers=1, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PAGE,
                            max_num_seqs=8, max_total_seq_len=16384, prefill_chunk_size=8192,
                            rope_mode=rk.RopeMode.NONE, dtype=dtype)


# ----------------------------------------------------------------------------- development machine

def parse_variants(texts) -> Dict[str, Dict[str, int]]:
    """``NAME:knob=value,knob=value`` -> {NAME: {knob: value}} (``GpuSchedule`` knobs)."""
    variants = {}
    for text in texts or ():
        name, _, knobs = text.partition(":")
        variants[name] = {k: int(v) for k, v in (kv.split("=") for kv in knobs.split(",") if kv)}
    return variants


def prepare(out: pathlib.Path, arch: str, dtypes, variants: Dict[str, Dict[str, int]]) -> None:
    """Our three prefill kernels and TVM's, per dtype, with nvcc fatbins (``out/cache``); with
    ``variants``, also ours with those schedule knobs replaced (``ours-NAME-dtype.so``)."""
    import dataclasses

    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_prepare
    import tvm.relax.frontend.nn.llm.kv_cache as kc
    from tvm.s_tir import dlight as dl

    from relax_kvcache import tir_kernels as tk
    from relax_kvcache import launch
    from relax_kvcache.build import KernelSetSpec, _pass_config
    from relax_kvcache.targets import make_target

    target = make_target("cuda", arch=arch)
    out.mkdir(parents=True, exist_ok=True)
    for dtype in dtypes:
        spec, sched = KernelSetSpec.from_config(config(dtype)), tk.schedule_for(target)
        ours = {role: spec.kernel_function(role, sched) for role in ROLES}  # ours has every role
        theirs = {
            "attention_prefill_ragged": kc._attention_prefill_ragged(HKV, HQ, D, D, dtype, {}, target),
            "attention_prefill": kc._attention_prefill(HKV, HQ, D, dtype, False, {}, target, page_size=PAGE),
            "merge_inplace": kc._merge_state_inplace(HQ, D, dtype, target),
        }
        builds = [("ours", ours), ("tvm", theirs)]
        if dtype == "float16":  # the cache's pass over 8-bit pages (ours-fp8: attention_prefill only)
            fp8 = KernelSetSpec.from_config(dataclasses.replace(config(dtype), kv_dtype=FP8))
            builds.append(("ours-fp8", {"attention_prefill": fp8.kernel_function("attention_prefill", sched)}))
        for variant, knobs in variants.items():
            vsched = dataclasses.replace(sched, **knobs)
            builds.append((f"ours-{variant}", {role: spec.kernel_function(role, vsched) for role in ROLES}))
        for name, funcs in builds:
            start = time.perf_counter()
            mod = tvm.IRModule({n: f.with_attr("global_symbol", n) for n, f in funcs.items()})
            if name == "tvm":
                with target:
                    mod = dl.ApplyDefaultSchedule(dl.gpu.Fallback())(mod)
            with tvm.transform.PassContext(opt_level=3, config=_pass_config(target)):
                built = tvm.tirx.build(mod, target=target, pipeline="default" if name == "tvm" else launch.register())
            path = out / f"{name}-{dtype}.so"
            built.export_library(str(path))
            gpu_prepare.precompile(gpu_prepare.cuda_source(built), arch, out)
            print(f"{path.name}: {time.perf_counter() - start:.0f} s", flush=True)


# ----------------------------------------------------------------------------- GPU host

def time_per_call(fn: Callable[[], object], sync: Callable[[], None], min_time: float) -> float:
    """Seconds per call: calls queued back to back between two syncs, repeated until a round
    lasts ``min_time``; the median of three rounds."""
    fn()
    sync()
    reps = 1
    while True:
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        elapsed = time.perf_counter() - start
        if elapsed >= min_time or reps >= 10000:
            break
        reps = min(10000, max(2 * reps, int(reps * 1.2 * min_time / max(elapsed, 1e-9))))
    rounds = [elapsed / reps]
    for _ in range(2):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        rounds.append((time.perf_counter() - start) / reps)
    return statistics.median(rounds)


class Case:
    """One shape's inputs on the host and the device: ``batch`` sequences of ``length`` tokens;
    ``cached`` of them (per sequence) are in pages, the rest are the step's new tokens."""

    def __init__(self, batch: int, length: int, cached: int, dtype: str, device, rng) -> None:
        import ml_dtypes  # noqa: F401  (numpy bfloat16)

        self.batch, self.length, self.cached, self.dtype, self.device = batch, length, cached, dtype, device
        self.new = length - cached
        n, nd = batch * self.new, np.dtype(dtype if dtype != "bfloat16" else ml_dtypes.bfloat16)
        self.host = {name: rng.standard_normal((batch, length, h, D)).astype(nd)
                     for name, h in (("q", HQ), ("k", HKV), ("v", HKV))}
        q_new = self.host["q"][:, cached:].reshape(n, HQ, D)
        k_new = self.host["k"][:, cached:].reshape(n, HKV, D)
        v_new = self.host["v"][:, cached:].reshape(n, HKV, D)
        self.q, self.k, self.v = (tvm.runtime.tensor(np.ascontiguousarray(x), device) for x in (q_new, k_new, v_new))
        self.qo_indptr = self._int(np.arange(batch + 1) * self.new)
        self.q_pos = self._int(np.tile(np.arange(cached, length), batch))
        self.zeros = self._int(np.zeros(batch))
        if cached:
            self.pages, self.page_indptr, self.page_indices, self.last_page_len = self._paged(cached, rng)
            # every row in pages (the step's own appended before attention): one paged causal pass
            self.all_paged = self._paged(length, rng)

    def _paged(self, rows: int, rng, kv=None) -> tuple:
        """The first ``rows`` K/V rows of every sequence (``kv``: other (k, v) host arrays) in
        scattered pages: (pages, page_indptr, page_indices, last_page_len) on the device."""
        k, v = kv or (self.host["k"], self.host["v"])
        per_seq = -(-rows // PAGE)
        order = rng.permutation(self.batch * per_seq)
        pages = np.zeros((self.batch * per_seq, 2, HKV, PAGE, D), k.dtype)
        for b in range(self.batch):
            for p in range(per_seq):
                span = slice(p * PAGE, min(rows, (p + 1) * PAGE))
                n = span.stop - span.start
                pages[order[b * per_seq + p], 0, :, :n] = k[b, span].transpose(1, 0, 2)
                pages[order[b * per_seq + p], 1, :, :n] = v[b, span].transpose(1, 0, 2)
        return (tvm.runtime.tensor(pages, self.device), self._int(np.arange(self.batch + 1) * per_seq),
                self._int(order), self._int(np.full(self.batch, rows - (per_seq - 1) * PAGE)))

    def _int(self, values) -> tvm.runtime.Tensor:
        return tvm.runtime.tensor(np.asarray(values, dtype="int32"), self.device)

    @property
    def flops(self) -> int:
        pairs = self.batch * (self.new * self.cached + self.new * (self.new + 1) // 2)
        return 4 * HQ * D * pairs

    def outputs(self):
        n = self.batch * self.new
        o = tvm.runtime.tensor(np.full((n, HQ, D), np.nan, np.float32).astype(self.host["q"].dtype), self.device)
        lse = tvm.runtime.tensor(np.full((n, HQ), np.nan, np.float32), self.device)
        return o, lse

    def cache_call(self, kernels) -> Callable[[], None]:
        """The kernel calls a cache makes for this step (ours or TVM's kernels), as one callable
        writing ``self.out``."""
        o, lse = self.outputs()
        scale = D ** -0.5
        ragged = (self.q, self.qo_indptr, self.k, self.v, self.qo_indptr, self.q_pos, self.zeros, o, lse, 1, 0,
                  1.0, 1e4, scale)
        if not self.cached:
            self.out = o
            return lambda: kernels["attention_prefill_ragged"](*ragged)
        o2, lse2 = self.outputs()
        paged = (self.q, self.qo_indptr, self.pages, self.page_indptr, self.page_indices, self.last_page_len,
                 self.zeros, self.q_pos, o2, lse2, 0, 0, 1.0, 1e4, scale)
        self.out = o
        self.parts = {"ragged": lambda: kernels["attention_prefill_ragged"](*ragged),
                      "paged": lambda: kernels["attention_prefill"](*paged),
                      "merge": lambda: kernels["merge_inplace"](o, lse, o2, lse2)}
        if "attention_prefill_prefixed" in kernels:  # ours
            # what the cache runs: the step's K/V appended first, one causal pass over the pages
            all_paged = (self.q, self.qo_indptr, *self.all_paged, self.zeros, self.q_pos, o, lse, 1, 0, 1.0, 1e4,
                         scale)
            self.parts["all-paged"] = lambda: kernels["attention_prefill"](*all_paged)
            # one kernel over the cached prefix and the new rows (attention_with_shared_kv's)
            o3, lse3 = self.outputs()
            prefixed = (self.q, self.qo_indptr, self.pages, self.page_indptr, self.page_indices, self.last_page_len,
                        self.zeros, self.q_pos, self.k, self.v, o3, lse3, 1, 0, 1.0, 1e4, scale)
            self.parts["prefixed"] = lambda: kernels["attention_prefill_prefixed"](*prefixed)
            return self.parts["all-paged"]

        def step():
            for part in ("ragged", "paged", "merge"):
                self.parts[part]()

        return step

    def fp8_call(self, kernels, rng) -> Callable[[], None]:
        """Ours' all-paged pass over the same K/V stored as 8-bit floats at per-(K or V, head)
        scales ``amax / 448``; ``self.kv_fp8``: the stored values dequantized (float64), the
        reference's K/V."""
        import ml_dtypes

        kv = [self.host[x].astype(np.float32) for x in ("k", "v")]
        scales = np.stack([np.abs(x).max(axis=(0, 1, 3)) / 448.0 for x in kv]).astype(np.float32)  # (2, HKV)
        stored = [(x / s[None, None, :, None]).astype(getattr(ml_dtypes, FP8)) for x, s in zip(kv, scales)]
        self.kv_fp8 = [x.astype(np.float64) * s[None, None, :, None] for x, s in zip(stored, scales)]
        o, lse = self.outputs()
        args = (self.q, self.qo_indptr, *self._paged(self.length, rng, stored), self.zeros, self.q_pos, o, lse, 1, 0,
                1.0, 1e4, D ** -0.5, tvm.runtime.tensor(scales, self.device))
        self.out = o
        return lambda: kernels["attention_prefill"](*args)

    def torch_inputs(self):
        import torch

        tdt = getattr(torch, self.dtype)
        q, k, v = (torch.from_numpy(self.host[x].astype(np.float32)).to("cuda", tdt) for x in ("q", "k", "v"))
        q = q[:, self.cached:].transpose(1, 2).contiguous()
        k, v = (x.repeat_interleave(HQ // HKV, dim=2).transpose(1, 2).contiguous() for x in (k, v))
        return q, k, v

    def reference_rows(self, rng, kv=None) -> tuple:
        """(rows, float64 outputs) for REF_ROWS sampled new tokens, all heads (``kv``: other
        (k, v) host arrays)."""
        keys, values = kv or (self.host["k"], self.host["v"])
        rows = rng.choice(self.batch * self.new, size=min(REF_ROWS, self.batch * self.new), replace=False)
        refs = []
        for r in rows:
            b, i = divmod(int(r), self.new)
            t = self.cached + i
            q = self.host["q"][b, t].astype(np.float64)  # (HQ, D)
            k = keys[b, :t + 1].astype(np.float64).repeat(HQ // HKV, axis=1)  # (t+1, HQ, D)
            v = values[b, :t + 1].astype(np.float64).repeat(HQ // HKV, axis=1)
            s = np.einsum("hd,thd->ht", q, k) * D ** -0.5
            p = np.exp(s - s.max(axis=1, keepdims=True))
            refs.append(np.einsum("ht,thd->hd", p / p.sum(axis=1, keepdims=True), v))
        return rows, np.stack(refs)


def sdpa(q, k, v, backend: str, cached: bool):
    """A callable running SDPA on ``backend`` (None if it refuses these inputs) and its output."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kind = {"fa2": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    if cached:
        from torch.nn.attention.bias import causal_lower_right

        mask = dict(attn_mask=causal_lower_right(q.shape[2], k.shape[2]))
    else:
        mask = dict(is_causal=True)
    result = {}

    def call():
        with sdpa_kernel([kind]):
            result["out"] = F.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, **mask)

    try:
        call()
        torch.cuda.synchronize()
    except Exception as err:  # noqa: BLE001  (a backend that does not support the case)
        print(f"    {backend}: not available ({str(err).splitlines()[0][:120]})", flush=True)
        return None, None
    return call, result


def run_case(libs: Dict[str, Dict[str, object]], batch: int, length: int, cached: int, dtype: str, device, rng,
             min_time: float) -> dict:
    import torch

    case = Case(batch, length, cached, dtype, device, rng)
    row = {"times": {}, "flops": case.flops}
    outs = {}
    for name, kernels in libs.items():
        if name == "ours-fp8":
            if cached:
                fn = case.fp8_call(kernels, rng)
                row["times"][name] = time_per_call(fn, device.sync, min_time)
                rows, ref = case.reference_rows(rng, case.kv_fp8)
                row["fp8_err"] = float(np.abs(case.out.numpy().astype(np.float32)[rows] - ref).max())
            continue
        fn = case.cache_call(kernels)
        row["times"][name] = time_per_call(fn, device.sync, min_time)
        outs[name] = case.out.numpy().astype(np.float32)
        if cached and name == "ours":  # where the step's time goes
            row["parts"] = {part: time_per_call(f, device.sync, min_time) for part, f in case.parts.items()}
    q, k, v = case.torch_inputs()
    for backend in ("fa2", "cudnn"):
        call, result = sdpa(q, k, v, backend, bool(cached))
        if call is not None:
            row["times"][backend] = time_per_call(call, torch.cuda.synchronize, min_time)
            outs[backend] = result["out"].transpose(1, 2).reshape(-1, HQ, D).float().cpu().numpy()
    del q, k, v
    torch.cuda.empty_cache()
    if "ours" in outs and "fa2" in outs:
        row["diff_fa2"] = float(np.abs(outs["ours"] - outs["fa2"]).max())
    rows, ref = case.reference_rows(rng)
    row["err"] = {name: float(np.abs(out[rows] - ref).max()) for name, out in outs.items()}
    return row


def _tf(row, name) -> str:
    t = row["times"].get(name)
    return f"{row['flops'] / t / 1e12:8.1f}" if t else f"{'-':>8}"


def _ratio(row, a, b) -> str:
    ta, tb = row["times"].get(a), row["times"].get(b)
    return f"{tb / ta:8.2f}" if ta and tb else f"{'-':>8}"


def report(results: List[tuple], matmul: Optional[float]) -> None:
    print()
    print("Causal prefill, 32/8 heads, head_dim 128 (TFLOP/s; ratios: speed of ours over the other, above 1 = ours "
          "faster)" + (f"; fp16 matmul {matmul / 1e12:.0f} TFLOP/s" if matmul else ""))
    print(f"{'dtype':>8} {'case':>6} {'shape':>10} {'ours':>8} {'FA2':>8} {'cuDNN':>8} {'native':>8} "
          f"{'o/FA2':>8} {'o/cuDNN':>8} {'o/native':>8} {'|o-FA2|':>9} {'ours err':>9} {'FA2 err':>9}")
    for dtype, case, batch, length, row in results:
        err = row["err"]
        print(f"{dtype:>8} {case:>6} {batch:>4} x {length:<5} {_tf(row, 'ours')} {_tf(row, 'fa2')} "
              f"{_tf(row, 'cudnn')} {_tf(row, 'tvm')} {_ratio(row, 'ours', 'fa2')} {_ratio(row, 'ours', 'cudnn')} "
              f"{_ratio(row, 'ours', 'tvm')} {row.get('diff_fa2', float('nan')):9.2e} "
              f"{err.get('ours', float('nan')):9.2e} {err.get('fa2', float('nan')):9.2e}")
    print("(paged: the second half of each sequence over its cached first half and itself, with the kernels the "
          "caches run for such a step: ours attention_prefill over the pages, the step's K/V appended first; native "
          "ragged + paged + merge; err: max abs error against float64 on sampled rows)")
    fp8 = [(dtype, batch, length, row) for dtype, case, batch, length, row in results if "fp8_err" in row]
    if fp8:
        print()
        print(f"Paged case over 8-bit pages ({FP8}, per-head scales; error against float64 over the stored values): "
              "TFLOP/s of ours over 16-bit and over 8-bit pages, and their ratio")
        for dtype, batch, length, row in fp8:
            print(f"{dtype:>8} {batch:>4} x {length:<5} {_tf(row, 'ours')} {_tf(row, 'ours-fp8')} "
                  f"{_ratio(row, 'ours-fp8', 'ours')}   max err {row['fp8_err']:.2e}")
    variants = sorted({n for *_, row in results for n in row["times"] if n.startswith("ours-") and n != "ours-fp8"})
    if variants:
        print()
        print("Schedule variants (TFLOP/s): " + ", ".join(variants))
        for dtype, case, batch, length, row in results:
            worst = max(row["err"].get(v, float("nan")) for v in variants)
            print(f"{dtype:>8} {case:>6} {batch:>4} x {length:<5} {_tf(row, 'ours')} "
                  + " ".join(_tf(row, v) for v in variants) + f"   max err {worst:.2e}")
    parts = [(dtype, batch, length, row["parts"]) for dtype, case, batch, length, row in results if "parts" in row]
    if parts:
        print()
        print("Ours, paged case, per kernel (us): ragged causal over the new half, paged over the cached half and "
              "merge (the three-kernel path); all-paged (what the cache runs); prefixed (one kernel over the cached "
              "prefix and the new rows, for attention_with_shared_kv)")
        for dtype, batch, length, p in parts:
            print(f"{dtype:>8} {batch:>4} x {length:<5} " + " ".join(f"{k} {v * 1e6:8.1f}" for k, v in p.items()))


def matmul_rate() -> Optional[float]:
    import torch

    n = 8192
    a = torch.randn(n, n, dtype=torch.float16, device="cuda")
    b = torch.randn(n, n, dtype=torch.float16, device="cuda")
    t = time_per_call(lambda: a @ b, torch.cuda.synchronize, 0.2)
    return 2 * n ** 3 / t


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prepare", type=pathlib.Path, help="build the libraries into this folder")
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--libs", type=pathlib.Path, help="folder built by --prepare (GPU host)")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--shapes", nargs="+", default=[f"{b}x{n}" for b, n in SHAPES],
                        help="batch x length, e.g. 1x2048")
    parser.add_argument("--cases", nargs="+", default=["ragged", "paged"], choices=["ragged", "paged"])
    parser.add_argument("--no-native", action="store_true", help="skip TVM's kernels (slow: about 3 TFLOP/s)")
    parser.add_argument("--min-time", type=float, default=0.1)
    parser.add_argument("--variants", nargs="+", help="--prepare: also build ours with schedule knobs replaced, "
                        "NAME:knob=value,... (e.g. wg1:wgmma_warpgroups=1); the host times every ours-NAME library")
    args = parser.parse_args(argv)
    if args.prepare:
        prepare(args.prepare, args.arch, args.dtypes, parse_variants(args.variants))
        return 0
    if args.libs is None:
        parser.error("--prepare DIR (here) or --libs DIR (GPU host)")
    from relax_kvcache import deploy

    device = tvm.cuda(0)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    rng = np.random.default_rng(0)
    matmul = matmul_rate()
    results = []
    for dtype in args.dtypes:
        libs = {}
        names = ["ours"] + ([] if args.no_native else ["tvm"])
        names += sorted(p.name[:-len(f"-{dtype}.so")] for p in args.libs.glob(f"ours-*-{dtype}.so"))
        for name in names:
            mod = deploy.load(str(args.libs / f"{name}-{dtype}.so"), device=device)
            libs[name] = {role: mod.get_function(role, query_imports=True) for role in ROLES
                          if mod.implements_function(role, query_imports=True)}
        for case in args.cases:
            for batch, length in shapes:
                print(f"{dtype} {case} {batch} x {length} ...", flush=True)
                cached = length // 2 if case == "paged" else 0
                results.append((dtype, case, batch, length,
                                run_case(libs, batch, length, cached, dtype, device, rng, args.min_time)))
    report(results, matmul)
    return 0


if __name__ == "__main__":
    sys.exit(main())
