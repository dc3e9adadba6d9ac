"""Correctness of every cache feature on a device, against the float64 reference model.

Runs random workloads on ``PagedAttentionKVCache`` with the kernels ``gpu_prepare.py`` built
and compares every output with the numpy float64 ``ReferenceCache`` of ``reference_model.py``:
chunked prefill mixed with decode over several sequences, forks at arbitrary positions (mid-page
included), popn, remove, per-sequence sliding windows with attention sinks, per-layer windows
(``MHA_SLIDING``), token trees (``begin_forward`` with parent pointers,
``commit_accepted_token_tree_nodes``, decode after), ``attention_with_shared_kv``,
``self_attention`` / ``cross_attention`` / ``merge_attn_output_inplace`` and ``debug_get_kv``
after each phase, in all three RoPE modes.

Inputs are unit-variance random values in the cache dtype (caches over 8-bit pages: K and V
on the 8-bit grid times power-of-two scales set with ``set_kv_scales``, which the pages store
exactly, so the float64 reference holds for them unchanged); every output is poisoned with NaN
before the kernel call that writes it and must come back free of NaN, with infinities only
where the reference has them (the log-sum-exp of rows that see nothing), and within
``--tolerance`` (max abs error, default 2e-2 for float16) of the reference.

One line per (configuration, workload): name, forward steps, max error, PASS/FAIL. The exit
status is nonzero when anything fails.

Usage::

    python benchmarks/gpu_check.py --libs .gpu                 # on the GPU host (runtime-only TVM)
    python benchmarks/gpu_check.py --device cpu                # here: CPU kernels built in process
    python benchmarks/gpu_check.py --device cpu --libs .gpu-cpu   # here: libraries from gpu_prepare --target llvm

The harness (:class:`Check`) is in ``gpu_check_harness.py``, the workloads in ``gpu_check_workloads.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time
import traceback
from typing import Dict, List, Optional, Tuple

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpu_prepare as gp  # noqa: E402  (also puts python/ on sys.path)

import tvm  # noqa: E402

import relax_kvcache as rk  # noqa: E402
from gpu_check_harness import DEFAULT_TOLERANCE, NP_DTYPE, Check  # noqa: E402
from gpu_check_workloads import WORKLOADS  # noqa: E402

# ----------------------------------------------------------------------------- driver

@dataclasses.dataclass
class Case:
    """One configuration to check: its config, workloads and kernels (None: failed to load)."""

    name: str
    config: rk.KVCacheConfig
    workloads: List[str]
    kernels: Optional[rk.KernelSet]
    error: str = ""


def cases_from_libs(libs: pathlib.Path, device: tvm.runtime.Device) -> List[Case]:
    """Configurations and kernels from a folder prepared by ``gpu_prepare.py``."""
    manifest = gp.read_manifest(libs)
    modules: Dict[str, rk.KernelSet] = {}
    cases = []
    for name, entry in manifest["check"].items():
        config = gp.config_from_json(entry["config"])
        file, kernels, error = entry["library"], None, ""
        if file is None:
            error = f"library not built: {entry.get('error')}"
        else:
            try:
                if file not in modules:
                    modules[file] = rk.KernelSet.from_module(gp.load_library(libs / file, device))
                kernels = modules[file]
            except Exception as err:  # noqa: BLE001
                error = f"loading {file}: {type(err).__name__}: {err}"
        cases.append(Case(name, config, list(entry["workloads"]), kernels, error))
    return cases


def case_with_tvm_kernels(libs: Optional[pathlib.Path], device: tvm.runtime.Device) -> Case:
    """Our cache with TVM's kernels of the benchmark shape (8 layers, as TVM's ``debug_get_kv``
    was built): tells harness or cache-logic problems on a device apart from kernel problems."""
    from native_baseline import create_args

    shape = gp.BENCH_SHAPE
    workloads = ["random", "prefix_chain", "token_tree", "self_cross_merge"]
    try:
        if libs is None:
            module = gp.build_tvm(shape, gp.make_target("llvm", ""))
        else:
            bench = gp.read_manifest(libs)["bench"]
            shape = gp.shape_from_json(bench["shape"])
            if not bench.get("tvm"):
                raise RuntimeError("the manifest has no TVM library")
            module = gp.load_library(libs / bench["tvm"], device)
        shape = dataclasses.replace(shape, max_num_seqs=16, max_total_seq_len=2048, prefill_chunk_size=128)
        kernels = rk.KernelSet.from_creation_args(create_args(shape, gp.tvm_kernel_dict(module)))
        return Case("tvm-kernels", shape.our_config(), workloads, kernels)
    except Exception as err:  # noqa: BLE001
        return Case("tvm-kernels", gp.BENCH_SHAPE.our_config(), workloads, None, f"{type(err).__name__}: {err}")


def cases_built_here(dtype: Optional[str]) -> List[Case]:
    """Configurations of ``gpu_prepare.CHECK_CONFIGS`` with CPU kernels built in process."""
    target = gp.make_target("llvm", "")
    cases = []
    for name, (fields, workloads) in gp.CHECK_CONFIGS.items():
        config = gp.config_from_json(dict(fields, dtype=dtype or fields["dtype"]))
        kernels = rk.KernelSet.from_module(rk.build_kernels(config, target))
        cases.append(Case(name, config, list(workloads), kernels))
    return cases


def run_case(case: Case, workload: str, device: tvm.runtime.Device, seed: int,
             tolerance: Optional[float]) -> Tuple[bool, str]:
    """Run one workload on a fresh cache; returns (passed, report line)."""
    label = f"{case.name:<20} {workload:<17}"
    if case.kernels is None:
        return False, f"{label} steps   0  max err      -    FAIL  {case.error}"
    tol = tolerance if tolerance is not None else DEFAULT_TOLERANCE[case.config.dtype]
    rng = np.random.default_rng([seed, sum(map(ord, case.name + workload))])
    start = time.perf_counter()
    check = None
    try:
        cache = rk.PagedAttentionKVCache(case.config, device, kernels=case.kernels)
        check = Check(cache, rng, tol)
        WORKLOADS[workload](check)
    except Exception as err:  # noqa: BLE001  (a crash is a failure of this workload only)
        tb = traceback.extract_tb(err.__traceback__)[-1]
        problem = f"{type(err).__name__}: {err} (at {pathlib.Path(tb.filename).name}:{tb.lineno})"
        if check is None:
            return False, f"{label} steps   0  max err      -    FAIL  {problem}"
        check.problems.insert(0, problem)
    seconds = time.perf_counter() - start
    passed = not check.problems
    line = (f"{label} steps {check.steps:>3}  max err {check.max_error:8.2e}  {'PASS' if passed else 'FAIL'}"
            f"  ({seconds:.1f} s)")
    if not passed:
        more = f" (+{len(check.problems) - 1} more)" if len(check.problems) > 1 else ""
        line += f"  {check.problems[0]}{more}"
    return passed, line


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--libs", type=pathlib.Path, help="folder prepared by gpu_prepare.py "
                        "(default .gpu for cuda; for cpu without it, CPU kernels are built here)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", choices=sorted(NP_DTYPE), help="override the dtype (CPU kernels built here only)")
    parser.add_argument("--tolerance", type=float, help="max abs error (default 2e-2 float16, 2e-3 float32)")
    parser.add_argument("--only", nargs="*", default=[], help="only these configurations / workloads (names)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tvm-kernels", action="store_true",
                        help="also run our cache with TVM's kernels of the benchmark shape (a harness baseline)")
    args = parser.parse_args(argv)

    device = tvm.cuda(0) if args.device == "cuda" else tvm.cpu(0)
    if args.device == "cuda" and args.libs is None:
        args.libs = gp.REPO / ".gpu"
    if args.libs is not None:
        cases = cases_from_libs(args.libs, device)
        source = f"libraries from {args.libs}"
    else:
        cases = cases_built_here(args.dtype)
        source = f"CPU kernels built here ({gp.make_target('llvm', '')})"
    if args.tvm_kernels:
        cases.append(case_with_tvm_kernels(args.libs, device))
    print(f"gpu_check on {device} ({source}), TVM {tvm.__version__}; {gp.describe_device(device)}", flush=True)
    failures = total = 0
    for case in cases:
        for workload in case.workloads:
            if args.only and case.name not in args.only and workload not in args.only:
                continue
            passed, line = run_case(case, workload, device, args.seed, args.tolerance)
            total += 1
            failures += not passed
            print(line, flush=True)
    print(f"gpu_check: {total - failures}/{total} passed" + (f", {failures} FAILED" if failures else ""))
    return 1 if failures or not total else 0


if __name__ == "__main__":
    sys.exit(main())
