"""Kernel-only timings: our attention kernels and TVM's, called directly on the same tensors.

``gpu_bench.py`` times a whole ``attention_with_fused_qkv`` (host dispatch, RoPE, append, the
attention kernels, the split merge). This script times the attention kernels alone, so the
per-layer fixed cost and the kernels can be told apart: paged decode over random page tables
(batch x context) and causal ragged prefill (batch x length), ours and TVM's (both follow TVM's
kernel calling convention), with the roofline (KV bytes / copy bandwidth, FLOPs) and the max
difference between the two outputs. Run where ``gpu_bench.py`` runs::

    python benchmarks/gpu_kernel_bench.py [--libs .gpu]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import gpu_bench as gb  # noqa: E402
import gpu_prepare as gp  # noqa: E402

import tvm  # noqa: E402

DECODE = [(1, 1024), (32, 1024), (64, 2048), (128, 4096), (8, 4096), (1, 16384), (2, 16384), (4, 16384)]
PREFILL = [(1, 2048), (8, 512), (1, 8192)]


def _tensor(rng, shape, dtype, device):
    return tvm.runtime.tensor(rng.standard_normal(shape).astype(dtype), device)


def _int(values, device):
    return tvm.runtime.tensor(np.asarray(values, dtype="int32"), device)


def decode_case(kernels, shape, device, rng, batch: int, context: int, min_time: float) -> dict:
    hq, hkv, d, ps = shape.num_qo_heads, shape.num_kv_heads, shape.head_dim, shape.page_size
    pages_per_seq = -(-context // ps)
    num_pages = batch * pages_per_seq
    pages = _tensor(rng, (num_pages, 2, hkv, ps, d), shape.dtype, device)
    indices = _int(rng.permutation(num_pages), device)  # scattered pages
    indptr = _int(np.arange(batch + 1) * pages_per_seq, device)
    last = _int([context - (pages_per_seq - 1) * ps] * batch, device)
    zeros, positions = _int([0] * batch, device), _int([context - 1] * batch, device)
    q = _tensor(rng, (batch, hq, d), shape.dtype, device)
    result = {"times": {}, "out": {}}
    for name, fn in kernels.items():
        o = tvm.runtime.empty((batch, hq, d), shape.dtype, device)
        lse = tvm.runtime.empty((batch, hq), "float32", device)
        args = (q, pages, indptr, indices, last, zeros, positions, o, lse, 0, 1.0, 1e4, d ** -0.5)
        result["times"][name] = gb.time_per_call(lambda: fn(*args), device, min_time)
        result["out"][name] = o.numpy().astype(np.float32)
    result["bytes"] = batch * context * hkv * d * 2 * np.dtype(shape.dtype).itemsize
    return result


def prefill_case(kernels, shape, device, rng, batch: int, length: int, min_time: float) -> dict:
    hq, hkv, d = shape.num_qo_heads, shape.num_kv_heads, shape.head_dim
    n = batch * length
    q, k, v = (_tensor(rng, (n, h, d), shape.dtype, device) for h in (hq, hkv, hkv))
    indptr = _int(np.arange(batch + 1) * length, device)
    zeros = _int([0] * batch, device)
    positions = _int(np.tile(np.arange(length), batch), device)
    result = {"times": {}, "out": {}}
    for name, fn in kernels.items():
        o = tvm.runtime.empty((n, hq, d), shape.dtype, device)
        lse = tvm.runtime.empty((n, hq), "float32", device)
        args = (q, indptr, k, v, indptr, positions, zeros, o, lse, 1, 0, 1.0, 1e4, d ** -0.5)
        result["times"][name] = gb.time_per_call(lambda: fn(*args), device, min_time)
        result["out"][name] = o.numpy().astype(np.float32)
    result["flops"] = 4 * hq * d * batch * length * (length + 1) // 2
    return result


def _diff(out: dict) -> str:
    if len(out) < 2:
        return f"{'-':>10}"
    return f"{float(np.abs(out['ours'] - out['native']).max()):10.2e}"


def page_cost(libs: pathlib.Path, kernels, device, rng, min_time: float, bandwidth: float) -> None:
    """Our decode kernel over pages of 16 (scattered) against one page per sequence (the
    contiguous layout of a 4096-token context, ``gpu_prepare.PAGE_COST_SHAPE``)."""
    entry = gp.read_manifest(libs).get("page_cost")
    if not entry or not entry.get("ours"):
        print("no page-cost library (gpu_prepare.py --only robust)")
        return
    import relax_kvcache as rk

    contiguous = rk.KernelSet.from_module(gp.load_library(libs / entry["ours"], device))
    shape_c = gp.shape_from_json(entry["shape"])
    print(f"{'decode':>14} {'page 16 us':>11} {'page 4096 us':>13} {'paged/contig.':>14} {'page-16 %roof':>14}")
    for batch, context in ((32, 4096), (128, 4096)):
        paged = decode_case({"ours": kernels.ours.attention_decode}, kernels.shape, device, rng, batch, context,
                            min_time)
        contig = decode_case({"ours": contiguous.attention_decode}, shape_c, device, rng, batch, context, min_time)
        t16, tc = paged["times"]["ours"], contig["times"]["ours"]
        print(f"{batch:>6} x {context:<6} {t16 * 1e6:11.1f} {tc * 1e6:13.1f} {t16 / tc:14.3f} "
              f"{100 * paged['bytes'] / t16 / bandwidth:14.1f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--libs", type=pathlib.Path, default=gp.REPO / ".gpu")
    parser.add_argument("--min-time", type=float, default=0.2)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: kernels built here, small shapes (to test the script)")
    parser.add_argument("--page-cost", action="store_true",
                        help="only compare our decode over pages of 16 with one page per sequence")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    device = tvm.cuda(0) if cuda else tvm.cpu(0)
    kernels = gb.kernels_from_libs(args.libs, device) if cuda else gb.kernels_built_here("float32")
    cases_decode, cases_prefill = (DECODE, PREFILL) if cuda else ([(1, 256), (2, 64)], [(1, 64)])
    shape = kernels.shape
    decode = {"ours": kernels.ours.attention_decode}
    prefill = {"ours": kernels.ours.attention_prefill_ragged}
    if kernels.tvm is not None:
        decode["native"] = kernels.tvm["attention_decode"]
        prefill["native"] = kernels.tvm["attention_prefill_ragged"]
    bandwidth = gb.measure_copy_bandwidth(device, (1 << 30) if cuda else (1 << 26), args.min_time)
    rng = np.random.default_rng(0)
    if args.page_cost:
        page_cost(args.libs, kernels, device, rng, args.min_time, bandwidth)
        return 0
    print(f"kernel-only timings on {gp.describe_device(device)}; {shape.dtype}, {shape.num_qo_heads}/"
          f"{shape.num_kv_heads} heads, head_dim {shape.head_dim}, page {shape.page_size}; copy bandwidth "
          f"{bandwidth / 1e9:.0f} GB/s")
    print(f"{'decode':>14} {'ours us':>9} {'native us':>10} {'ours GB/s':>10} {'%roof':>6} {'native GB/s':>11} "
          f"{'max|diff|':>10}")
    for batch, context in cases_decode:
        r = decode_case(decode, shape, device, rng, batch, context, args.min_time)
        t = r["times"]
        nat = t.get("native")
        print(f"{batch:>6} x {context:<6} {t['ours'] * 1e6:9.1f} {nat * 1e6 if nat else float('nan'):10.1f} "
              f"{r['bytes'] / t['ours'] / 1e9:10.0f} {100 * r['bytes'] / t['ours'] / bandwidth:6.1f} "
              f"{r['bytes'] / nat / 1e9 if nat else float('nan'):11.0f} {_diff(r['out'])}")
    print(f"{'prefill':>14} {'ours ms':>9} {'native ms':>10} {'ours TF/s':>10} {'':>6} {'native TF/s':>11} "
          f"{'max|diff|':>10}")
    for batch, length in cases_prefill:
        r = prefill_case(prefill, shape, device, rng, batch, length, args.min_time)
        t = r["times"]
        nat = t.get("native")
        print(f"{batch:>6} x {length:<6} {t['ours'] * 1e3:9.3f} {nat * 1e3 if nat else float('nan'):10.3f} "
              f"{r['flops'] / t['ours'] / 1e12:10.2f} {'':>6} {r['flops'] / nat / 1e12 if nat else float('nan'):11.2f} "
              f"{_diff(r['out'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
