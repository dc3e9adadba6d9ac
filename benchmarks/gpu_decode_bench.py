"""Paged decode at long and short contexts: our kernel (and schedule variants of it) against
TVM's, kernel only, as a fraction of the GPU's copy bandwidth.

Decode reads every cached K/V byte once, so its roofline is the copy bandwidth; the figure
that matters is how close each batch x context gets to it. Float16, 32 query / 8 KV heads,
head_dim 128, pages of 16 tokens scattered at random over the pool (``ours-fp8``: the same
pages stored as float8_e4m3fn at per-head scales, checked against float64 attention over the
stored values; its bandwidth counts the 8-bit bytes; ``ours-swcvt-fp8``: the same with the
software byte conversion instead of sm_89+'s ``cvt``); each call runs the
attention kernel and, where the KV is split across blocks, the merge of the splits. Where
PyTorch is installed, SDPA's FlashAttention-2 and cuDNN backends run the same step over
contiguous K/V as anchors, and every column is GPU time from CUDA events (PyTorch's host cost
of ~50 us per SDPA call would otherwise hide its kernels). Every output is checked against float64 attention on sampled
sequences. Two ceilings of the same size run beside them (with PyTorch): ``read``, PyTorch's
sum of as many float16 bytes as the step's KV (one read-only reduction kernel: what any single
call that reads those bytes costs), and ``copy``, a device-to-device copy of those bytes
(percentages count its bytes read and written, as the copy bandwidth does).

    python benchmarks/gpu_decode_bench.py --prepare .gpu/decode [--variants NAME:knob=v,...]
    python benchmarks/gpu_decode_bench.py --libs .gpu/decode                 # GPU host
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import pathlib
import sys
import time

import ml_dtypes
import numpy as np

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "benchmarks"))

import tvm  # noqa: E402

import gpu_prefill_bench as gpb  # noqa: E402

HQ, HKV, D, PAGE, DTYPE = gpb.HQ, gpb.HKV, gpb.D, gpb.PAGE, "float16"
FP8 = "float8_e4m3fn"  # the 8-bit pages of ``ours-fp8`` (per-head scales: amax / 448)
CASES = [(1, 1024), (8, 1024), (32, 1024), (8, 4096), (32, 4096), (128, 4096), (1, 16384), (2, 16384),
         (4, 16384), (1, 65536)]


def prepare(out: pathlib.Path, arch: str, variants) -> None:
    """Our decode kernel (default schedule and ``variants``) and TVM's, with nvcc fatbins."""
    import gpu_prepare
    import tvm.relax.frontend.nn.llm.kv_cache as kc
    from tvm.s_tir import dlight as dl

    from relax_kvcache import tir_kernels as tk
    from relax_kvcache import launch
    from relax_kvcache.build import KernelSetSpec, _pass_config
    from relax_kvcache.targets import make_target

    target = make_target("cuda", arch=arch)
    out.mkdir(parents=True, exist_ok=True)
    spec, sched = KernelSetSpec.from_config(gpb.config(DTYPE)), tk.schedule_for(target)
    fp8 = KernelSetSpec.from_config(dataclasses.replace(gpb.config(DTYPE), kv_dtype=FP8))
    builds = [("ours", spec.kernel_function("attention_decode", sched)),
              ("tvm", kc._attention_decode(HKV, HQ, D, DTYPE, False, {}, target, page_size=PAGE)),
              ("ours-fp8", fp8.kernel_function("attention_decode", sched))]
    if sched.fp8_convert:  # the software conversion beside the hardware one
        builds.append(("ours-swcvt-fp8", fp8.kernel_function("attention_decode",
                                                             dataclasses.replace(sched, fp8_convert=False))))
    for name, knobs in variants.items():  # a name ending in -fp8: over 8-bit pages
        kernels = fp8 if name.endswith("-fp8") else spec
        builds.append((f"ours-{name}", kernels.kernel_function("attention_decode", dataclasses.replace(sched, **knobs))))
    for name, func in builds:
        start = time.perf_counter()
        mod = tvm.IRModule({"attention_decode": func.with_attr("global_symbol", "attention_decode")})
        if name == "tvm":
            with target:
                mod = dl.ApplyDefaultSchedule(dl.gpu.Fallback())(mod)
        with tvm.transform.PassContext(opt_level=3, config=_pass_config(target)):
            built = tvm.tirx.build(mod, target=target, pipeline="default" if name == "tvm" else launch.register())
        built.export_library(str(out / f"{name}.so"))
        gpu_prepare.precompile(gpu_prepare.cuda_source(built), arch, out)
        print(f"{name}.so: {time.perf_counter() - start:.0f} s", flush=True)


class Case:
    """``batch`` sequences of ``context`` cached tokens in scattered pages, one query each."""

    def __init__(self, batch: int, context: int, device, rng, ordered: bool = False) -> None:
        per_seq = -(-context // PAGE)
        n = batch * per_seq
        self.batch, self.context = batch, context
        self.pages_host = rng.standard_normal((n, 2, HKV, PAGE, D), dtype=np.float32).astype(DTYPE)
        # each sequence's pages: at random over the pool, or (``ordered``) consecutive
        self.order = (np.arange(n) if ordered else rng.permutation(n)).astype("int32")
        self.q_host = rng.standard_normal((batch, HQ, D), dtype=np.float32).astype(DTYPE)
        ints = lambda v: tvm.runtime.tensor(np.asarray(v, dtype="int32"), device)  # noqa: E731
        self.args = (tvm.runtime.tensor(self.q_host, device), tvm.runtime.tensor(self.pages_host, device),
                     ints(np.arange(batch + 1) * per_seq), ints(self.order),
                     ints([context - (per_seq - 1) * PAGE] * batch), ints([0] * batch), ints([context - 1] * batch))
        self.device, self.per_seq = device, per_seq

    @property
    def bytes(self) -> int:
        return self.batch * self.context * HKV * D * 2 * 2

    def call(self, kernel, fp8: bool = False):
        """A call of ``kernel`` on this case's tensors (``fp8``: over 8-bit pages, with scales)
        and its output tensor."""
        o = tvm.runtime.tensor(np.full((self.batch, HQ, D), np.nan, DTYPE), self.device)
        lse = tvm.runtime.tensor(np.full((self.batch, HQ), np.nan, "float32"), self.device)
        args = (self.args[0], self.fp8_pages()[0] if fp8 else self.args[1], *self.args[2:], o, lse, 0, 1.0, 1e4,
                D ** -0.5, *((self.fp8_pages()[1],) if fp8 else ()))
        return (lambda: kernel(*args)), o

    def fp8_pages(self):
        """The pages quantized to 8 bits at per-(K or V, head) scales ``amax / 448`` (device
        pages, scales) and their dequantized values (host float64)."""
        if not hasattr(self, "_fp8"):
            amax = np.abs(self.pages_host.astype(np.float32)).max(axis=(0, 3, 4))  # (2, HKV)
            scales = (amax / 448.0).astype(np.float32)
            stored = (self.pages_host.astype(np.float32) / scales[None, :, :, None, None]).astype(
                getattr(ml_dtypes, FP8))
            self._fp8 = (tvm.runtime.tensor(stored, self.device), tvm.runtime.tensor(scales, self.device),
                         stored.astype(np.float64) * scales[None, :, :, None, None].astype(np.float64))
        return self._fp8

    def contiguous_kv(self):
        """K and V as contiguous (batch, HKV, context, D) torch tensors, for SDPA."""
        import torch

        rows = self.pages_host[self.order].reshape(self.batch, self.per_seq, 2, HKV, PAGE, D)
        kv = rows.transpose(2, 0, 3, 1, 4, 5).reshape(2, self.batch, HKV, self.per_seq * PAGE, D)[..., :self.context, :]
        return (torch.from_numpy(np.ascontiguousarray(x)).cuda() for x in kv)

    def reference(self, b: int, fp8: bool = False) -> np.ndarray:
        """float64 attention of sequence b, (HQ, D) (``fp8``: over the 8-bit pages' values)."""
        pages = self.fp8_pages()[2] if fp8 else self.pages_host
        rows = pages[self.order[b * self.per_seq:(b + 1) * self.per_seq]].astype(np.float64)
        k = rows[:, 0].transpose(0, 2, 1, 3).reshape(-1, HKV, D)[:self.context]  # (ctx, HKV, D)
        v = rows[:, 1].transpose(0, 2, 1, 3).reshape(-1, HKV, D)[:self.context]
        q = self.q_host[b].astype(np.float64).reshape(HKV, HQ // HKV, D)
        s = np.einsum("hgd,thd->hgt", q, k) * D ** -0.5
        p = np.exp(s - s.max(axis=2, keepdims=True))
        return np.einsum("hgt,thd->hgd", p / p.sum(axis=2, keepdims=True), v).reshape(HQ, D)


def event_time_per_call(fn, min_time: float) -> float:
    """Seconds of GPU time per call: CUDA events around calls queued back to back on the legacy
    default stream (TVM's and PyTorch's default), so host cost per call does not count."""
    import torch

    stream = torch.cuda.default_stream()
    wall = gpb.time_per_call(fn, torch.cuda.synchronize, min_time / 4)  # warm-up; sizes the loop
    reps = max(10, int(min_time / max(wall, 1e-6)))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    for _ in range(reps):
        fn()
    end.record(stream)
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e-3 / reps


def sdpa_cells(case: Case, bandwidth: float, min_time: float):
    """SDPA's FlashAttention-2 and cuDNN backends on the same queries over contiguous K/V (the
    kernels a PyTorch user gets for one decode step; GQA by ``enable_gqa``)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.from_numpy(case.q_host).cuda().unsqueeze(2)  # (batch, HQ, 1, D)
    k, v = case.contiguous_kv()
    cells = []
    for kind in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        with sdpa_kernel([kind]):  # entered once: its host cost is not the kernel's
            call = lambda: F.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, enable_gqa=True)  # noqa: E731
            try:
                out = call()
            except RuntimeError:
                cells.append("n/a")
                continue
            t = event_time_per_call(call, min_time)
        got = out[:, :, 0].float().cpu().numpy()
        err = max(float(np.abs(got[b] - case.reference(b)).max()) for b in sorted({0, case.batch - 1}))
        cells.append(f"{t * 1e6:7.1f} {100 * case.bytes / t / bandwidth:5.1f}% {err:6.0e}")
    return cells


def ceiling_cells(case: Case, bandwidth: float, min_time: float):
    """A read-only reduction (PyTorch's sum, float32 accumulation) of as many bytes as the
    step's KV, and a device-to-device copy of them (percent of copy bandwidth counting read and
    written bytes): what one call moving these bytes costs on this GPU, launch and tail included."""
    import torch

    x = torch.randn(case.bytes // 2, dtype=torch.float16, device="cuda")
    y = torch.empty_like(x)
    read = event_time_per_call(lambda: torch.sum(x, dtype=torch.float32), min_time)
    copy = event_time_per_call(lambda: y.copy_(x), min_time)
    return [f"{read * 1e6:7.1f} {100 * case.bytes / read / bandwidth:5.1f}%",
            f"{copy * 1e6:7.1f} {200 * case.bytes / copy / bandwidth:5.1f}%"]


def run(libs: pathlib.Path, min_time: float, cases, ordered: bool = False) -> None:
    import gpu_bench as gb
    import gpu_prepare as gp

    device = tvm.cuda(0)
    kernels = {p.stem: gp.load_library(p, device)["attention_decode"] for p in sorted(libs.glob("*.so"))}
    names = ["ours", "tvm"] + sorted(n for n in kernels if n.startswith("ours-"))
    bandwidth = gb.measure_copy_bandwidth(device, 1 << 30, min_time)
    anchors = ["sdpa-fa2", "sdpa-cudnn", "read", "copy"] if importlib.util.find_spec("torch") else []
    timing = "GPU time by CUDA events" if anchors else "wall time per call"
    print(f"decode kernels on {gp.describe_device(device)}; {DTYPE}, {HQ}/{HKV} heads, head_dim {D}, page {PAGE}; "
          f"copy bandwidth {bandwidth / 1e9:.0f} GB/s; pages {'consecutive' if ordered else 'at random'}. "
          f"Per kernel ({timing}): us, % of copy bandwidth; max error vs float64")
    extra = ["fp16/fp8"] if "ours-fp8" in kernels else []
    print(f"{'batch x ctx':>14} " + " ".join(f"{n:>20}" for n in [*(n for n in names if n in kernels), *anchors,
                                                                  *extra]))
    rng = np.random.default_rng(0)
    for batch, context in cases:
        case = Case(batch, context, device, rng, ordered)
        cells, times = [], {}
        for name in names:
            if name not in kernels:
                continue
            fp8 = name.endswith("-fp8")
            fn, o = case.call(kernels[name], fp8)
            t = event_time_per_call(fn, min_time) if anchors else gpb.time_per_call(fn, device.sync, min_time)
            out = o.numpy().astype(np.float64)
            err = max(float(np.abs(out[b] - case.reference(b, fp8)).max()) for b in sorted({0, batch - 1}))
            times[name] = t
            read = case.bytes // 2 if fp8 else case.bytes
            cells.append(f"{t * 1e6:7.1f} {100 * read / t / bandwidth:5.1f}% {err:6.0e}")
        if anchors:
            cells += sdpa_cells(case, bandwidth, min_time) + ceiling_cells(case, bandwidth, min_time)
        if "ours-fp8" in times:
            cells.append(f"{times['ours'] / times['ours-fp8']:5.2f}x")
        print(f"{batch:>6} x {context:<6} " + " ".join(f"{c:>20}" for c in cells), flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prepare", type=pathlib.Path, help="build the libraries into this folder")
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--variants", nargs="+", help="--prepare: also build ours with GpuSchedule knobs "
                        "replaced, NAME:knob=value,...")
    parser.add_argument("--libs", type=pathlib.Path, help="folder built by --prepare (GPU host)")
    parser.add_argument("--min-time", type=float, default=0.2)
    parser.add_argument("--cases", nargs="+", help="BATCHxCONTEXT (default: all)")
    parser.add_argument("--ordered-pages", action="store_true",
                        help="each sequence's pages consecutive in the pool (default: at random)")
    args = parser.parse_args(argv)
    if args.prepare:
        prepare(args.prepare, args.arch, gpb.parse_variants(args.variants))
        return 0
    if not args.libs:
        parser.error("--prepare DIR (here) or --libs DIR (GPU host)")
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases] if args.cases else CASES
    run(args.libs, args.min_time, cases, args.ordered_pages)
    return 0


if __name__ == "__main__":
    sys.exit(main())
