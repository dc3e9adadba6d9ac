"""The model matmuls of ``frontend.compile`` on CUDA: what it builds now (the row-count dispatch:
dlight's ``LowBatchGEMV`` for one row, then the tensor-core kernels of
``relax_kvcache.tensor_core_matmul``) against what it built before (``LowBatchGEMV`` up to 8 rows,
then dlight's ``Matmul`` without tensor cores) and PyTorch's ``torch.matmul`` (cuBLAS), in one process.

Each case is a matmul of the Llama-3.2-1B / Llama-3-8B shapes as ``FuseTransposeMatmul`` and
``FuseOps`` leave it: ``x @ W.T`` with a dynamic row count, alone, with the residual add fused
after it, a bias, or the cast to float32 of the logits. Rows: decode batches (1-128) and prefill
chunks (512-8192). Each result is checked against float64 (relative to the reference's scale)
before it is timed; TFLOP/s count 2 M N K. Ours must agree within ``TOLERANCE``; the error of the
build before, whose ``Matmul`` accumulates in the model dtype as the legalized matmul says, is
printed beside it. The ``large`` column times the 128 x 128 tile alone at every row count (what
the small-row tiles, with k split, are measured against).

Usage::

    python benchmarks/matmul_bench.py --prepare .gpu/mm --arch sm_90a   # here: compile
    python benchmarks/matmul_bench.py --libs .gpu/mm                    # GPU host (PyTorch)
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from typing import Dict, List, Tuple

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "benchmarks"))

import numpy as np  # noqa: E402
import tvm  # noqa: E402

#: (name, N, K, epilogue): the matmuls of a layer and the logits, per model (``qkv_bias``: with
#: a bias, as in Qwen-style models)
SHAPES = {
    "1b": [("qkv", 3072, 2048, "none"), ("qkv_bias", 3072, 2048, "bias"), ("o_proj", 2048, 2048, "add"), ("gate_up", 16384, 2048, "none"),
           ("down", 2048, 8192, "add"), ("lm_head", 128256, 2048, "cast")],
    "8b": [("qkv", 6144, 4096, "none"), ("o_proj", 4096, 4096, "add"), ("gate_up", 28672, 4096, "none"),
           ("down", 4096, 14336, "add"), ("lm_head", 128256, 4096, "cast")],
}
ROWS = (1, 4, 8, 16, 32, 64, 128, 512, 2048, 8192)
DTYPES = ("float16", "bfloat16")
TOLERANCE = 2e-2  # of the reference's largest magnitude (fp16 / bf16 output rounding, k up to 14336)


def case_name(model: str, name: str, dtype: str) -> str:
    return f"{model}_{name}_{dtype}"


def matmul_func(n_out: int, k: int, epilogue: str, dtype: str) -> tvm.tirx.PrimFunc:
    """``FuseTransposeMatmul`` + ``LegalizeOps`` + ``FuseTIR``'s form of ``x @ W.T`` (+ epilogue)
    for x ``(1, n, k)``: made by legalizing the Relax ops, as ``frontend.compile`` sees them."""
    from tvm import relax as rx

    bb = rx.BlockBuilder()
    n = tvm.tirx.Var("n", "int64")
    x = rx.Var("x", rx.TensorType((1, n, k), dtype))
    w = rx.Var("w", rx.TensorType((n_out, k), dtype))
    res = rx.Var("res", rx.TensorType((1, n, n_out), dtype))
    bias = rx.Var("bias", rx.TensorType((n_out,), dtype))
    params = [x, w] + {"add": [res], "bias": [bias]}.get(epilogue, [])
    with bb.function("main", params):
        with bb.dataflow():
            y = bb.emit(rx.op.matmul(x, rx.op.permute_dims(w)))
            if epilogue == "add":
                y = bb.emit(rx.op.add(res, y))
            elif epilogue == "bias":
                y = bb.emit(rx.op.add(y, bias))
            elif epilogue == "cast":
                y = bb.emit(rx.op.astype(y, "float32"))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    mod = tvm.transform.Sequential([rx.transform.FuseTransposeMatmul(), rx.transform.LegalizeOps(),
                                    rx.transform.AnnotateTIROpPattern(), rx.transform.FuseOps(),
                                    rx.transform.FuseTIR()])(bb.get())
    funcs = [f for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert len(funcs) == 1, [gv.name_hint for gv, _ in mod.functions_items()]
    return funcs[0]


#: the functions of a case in the library: ours (frontend.compile's dispatch), the large tile
#: alone, and before: the GEMV buckets and dlight's Matmul without tensor cores
KINDS = ("ours", "large", "gemv1", "gemv4", "gemv8", "simt")


def prepare(out: pathlib.Path, arch: str, dtypes: Tuple[str, ...] = DTYPES) -> int:
    """Compile every case's :data:`KINDS` (in ``dtypes``) into ``out/matmul.so`` with its fatbins
    and ``manifest.json``."""
    import gpu_prepare
    from tvm.s_tir import dlight as dl

    from relax_kvcache import deploy, frontend, launch, tensor_core_matmul
    from relax_kvcache.build import _pass_config
    from relax_kvcache.targets import make_target

    target = make_target("cuda", arch=arch)
    funcs: Dict[str, tvm.tirx.PrimFunc] = {}
    manifest = {"arch": arch, "cases": []}
    with target:
        for model, shapes in SHAPES.items():
            for name, n_out, k, epilogue in shapes:
                for dtype in dtypes:
                    func = matmul_func(n_out, k, epilogue, dtype)
                    case = case_name(model, name, dtype)
                    kinds = {"ours": frontend._row_dispatch(func), "large": tensor_core_matmul.schedule(func),
                             **{f"gemv{r}": frontend._scheduled(func, dl.gpu.LowBatchGEMV(r)) for r in (1, 4, 8)},
                             "simt": frontend._scheduled(func, frontend._MatmulWithoutTensorCores())}
                    missing = [kind for kind, f in kinds.items() if f is None]
                    if missing:
                        raise SystemExit(f"{case}: no {missing} schedule")
                    for kind, f in kinds.items():
                        funcs[f"{kind}_{case}"] = f.with_attr("global_symbol", f"{kind}_{case}")
                    manifest["cases"].append(dict(case=case, model=model, name=name, n=n_out, k=k,
                                                  epilogue=epilogue, dtype=dtype))
    start = time.perf_counter()
    with tvm.transform.PassContext(opt_level=3, config=_pass_config(target)):
        lib = tvm.compile(tvm.IRModule(funcs), target=target, tir_pipeline=launch.register())
    out.mkdir(parents=True, exist_ok=True)
    path = out / "matmul.so"
    lib.export_library(str(path))
    deploy.write_checksum(path)
    sources = [m.inspect_source() for m in lib.mod.imports if m.kind == "cuda"]
    fatbin = sum(gpu_prepare.precompile(source, arch, out) for source in sources)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"{path}: {len(funcs)} functions, {time.perf_counter() - start:.0f} s, fatbin {fatbin / 2**20:.1f} MiB")
    return 0


def before_kind(rows: int) -> str:
    """The function frontend.compile's build before ran for ``rows`` rows."""
    return next((f"gemv{r}" for r in (1, 4, 8) if rows <= r), "simt")


def run(libs: pathlib.Path, rows: Tuple[int, ...], repeat: int) -> int:
    """Check and time every case of ``libs`` on the GPU; exit status 1 on a wrong result."""
    import torch
    from relax_kvcache import deploy

    manifest = json.loads((libs / "manifest.json").read_text())
    dev = tvm.cuda(0)
    lib = deploy.load(str(libs / "matmul.so"), device=dev)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, TVM {tvm.__version__}; TFLOP/s (2 M N K "
          f"/ median of {repeat}); error: max |ours - float64| / max |float64|")
    print(f"{'case':<22} {'rows':>5} {'ours':>7} {'large':>7} {'before':>7} {'cuBLAS':>7} {'ours/before':>12} "
          f"{'ours/cuBLAS':>12} {'ours error':>11} {'before error':>13}")
    failed = 0
    gen = torch.Generator(device="cuda").manual_seed(0)
    for case in manifest["cases"]:
        tdtype = getattr(torch, case["dtype"])
        for m in rows:
            x = torch.randn(1, m, case["k"], device="cuda", generator=gen).to(tdtype)
            w = (torch.randn(case["n"], case["k"], device="cuda", generator=gen) / case["k"] ** 0.5).to(tdtype)
            extra = {"add": [torch.randn(1, m, case["n"], device="cuda", generator=gen).to(tdtype)],
                     "bias": [torch.randn(case["n"], device="cuda", generator=gen).to(tdtype)]}.get(case["epilogue"], [])
            ref = (x.double() @ w.double().T)
            if extra:
                ref = ref + extra[0].double()
            out_dtype = torch.float32 if case["epilogue"] == "cast" else tdtype
            args = [tvm.runtime.from_dlpack(t) for t in (x, w, *extra)]
            times, errors = {}, {}
            for column, kind in (("ours", "ours"), ("large", "large"), ("before", before_kind(m))):
                out = torch.full((1, m, case["n"]), float("nan"), device="cuda", dtype=out_dtype)
                func = lib[f"{kind}_{case['case']}"]
                call_args = args + [tvm.runtime.from_dlpack(out)]
                func(*call_args)
                torch.cuda.synchronize()
                errors[column] = float((out.double() - ref).abs().max() / ref.abs().max())
                if column != "before" and not errors[column] <= TOLERANCE:
                    print(f"FAILED {column} {case['case']} rows {m}: error {errors[column]:.3g}")
                    failed += 1
                times[column] = _time(lambda: func(*call_args), repeat)
            if case["epilogue"] in ("add", "bias"):
                times["cublas"] = _time(lambda: torch.add(torch.matmul(x, w.T), extra[0]), repeat)
            elif case["epilogue"] == "cast":
                times["cublas"] = _time(lambda: torch.matmul(x, w.T).float(), repeat)
            else:
                times["cublas"] = _time(lambda: torch.matmul(x, w.T), repeat)
            flop = 2 * m * case["n"] * case["k"]
            tf = {kind: flop / t / 1e12 for kind, t in times.items()}
            print(f"{case['case']:<22} {m:>5} {tf['ours']:7.1f} {tf['large']:7.1f} {tf['before']:7.1f} "
                  f"{tf['cublas']:7.1f} {tf['ours'] / tf['before']:11.2f}x {tf['ours'] / tf['cublas']:11.2f}x "
                  f"{errors['ours']:11.1e} {errors['before']:13.1e}", flush=True)
    print(f"ours: all results within {TOLERANCE} of float64" if not failed
          else f"ours: {failed} result(s) outside the tolerance")
    return 1 if failed else 0


def _time(fn, repeat: int) -> float:
    """Median seconds of ``fn`` over ``repeat`` runs, timed by CUDA events after two warm-up runs."""
    import torch

    fn()
    fn()
    times: List[float] = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return float(np.median(times))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prepare", type=pathlib.Path, help="compile the cases into this folder (here)")
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES), help="with --prepare")
    parser.add_argument("--libs", type=pathlib.Path, help="run the cases of this folder (GPU host)")
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args(argv)
    if args.prepare:
        return prepare(args.prepare, args.arch, tuple(args.dtypes))
    if args.libs:
        return run(args.libs, tuple(args.rows), args.repeat)
    parser.error("give --prepare or --libs")
    return 2


if __name__ == "__main__":
    sys.exit(main())
