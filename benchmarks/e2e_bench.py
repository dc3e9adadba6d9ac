"""Whole-model speed through the Relax VM: a Llama on our cache vs the same model on TVM's native cache.

Models: Llama-architecture, random float16 weights (nothing downloaded):

* ``1b``: Llama-3.2-1B's shape (16 layers, hidden 2048, 32/8 heads, head_dim 64, MLP 8192, vocab 128256);
* ``8b``: Llama-3-8B's shape (32 layers, hidden 4096, 32/8 heads, head_dim 128, MLP 14336, vocab 128256).

Two builds of each (``e2e_models.py``): ``ours`` (``relax_kvcache.models.llama``, our kernels in the
module) and ``native`` (the same model creating TVM's ``TIRPagedKVCache``: TVM's kernels and C++
cache); prefill returns the last token's logits. Both VMs run in one process on the same weights;
the native VM is bound to TVM's own ``vm.builtin`` functions (as in a process without relax_kvcache).
On a GPU each native decode configuration runs in a process of its own (``--same-process``: not).
For each model and side (ours eager, ours with CUDA graphs of the decode step, native):

* **logits check**: one prefill and a few decode steps on the same tokens; max |ours - native| over
  max |native| must stay within :data:`TOLERANCE` (else exit status 1);
* **TTFT**: prefill of a whole prompt (1 x 512 / 2048 / 8192) up to the first token's logits;
* **decode**: contexts of 1k and 4k tokens filled by prefill in chunks (``--fill attention``: by
  each layer's attention call on random q/k/v, the same bytes without the model's matmuls), then
  ``steps`` decode steps at batch 1 / 8 / 32 / 128 queued back to back (tokens/s); configurations
  whose KV does not fit the GPU are skipped with the reason. Beside the step time: the host time
  of a step with the GPU work excluded (steps issued one at a time after a synchronisation, not waited for):
  ``begin_forward``, issuing the VM call, ``end_forward``.

Weights: linear layers N(0, 1/fan_in), norms 1; on a GPU drawn by PyTorch on the device and handed
to TVM by DLPack.

Usage::

    python benchmarks/e2e_bench.py --prepare .gpu/e2e --arch sm_90a [--models 1b] [--bundle]  # here
    python benchmarks/e2e_bench.py --libs .gpu/e2e [--models 1b 8b] [--json FILE]   # GPU host (PyTorch)
    python benchmarks/e2e_bench.py --cpu-smoke   # here: a tiny model on llvm, the same code path
    python benchmarks/e2e_bench.py --libs .gpu/e2e --soak 5   # GPU host: generate.Engine under load

``--kv-dtype float8_e4m3fn`` (with ``--prepare``, ``--libs`` or ``--cpu-smoke``): a third build,
``ours-fp8``, ours over 8-bit pages; its logits against ours over float16 pages and its decode
tokens/s beside them (``e2e_fp8.py``).

Modules: ``e2e_runtime.py`` (models, plans, device, one side's VM driver), ``e2e_phases.py`` (the
phases above), ``e2e_report.py`` (the tables), ``e2e_soak.py`` (``--soak``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import subprocess
import sys
from typing import Callable, Dict, List, Optional

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "benchmarks"))

import tvm  # noqa: E402
import tvm_ffi  # noqa: E402
from tvm.runtime.vm import VirtualMachine  # noqa: E402

import relax_kvcache  # noqa: E402,F401  (before any VirtualMachine: routes vm.builtin.* to our cache)
from relax_kvcache.ffi_registry.builtins import BUILTINS, ORIGINAL_PREFIX  # noqa: E402
from relax_kvcache.config import KV_DTYPES  # noqa: E402
from relax_kvcache.models import LlamaConfig  # noqa: E402

from e2e_report import SIDES, report  # noqa: E402
from e2e_runtime import (GPU_PLAN, MODELS, PAGE, SEED, SMOKE_MODEL, SMOKE_PLAN, TOLERANCE,  # noqa: E402,F401
                         Device, Plan, Runner, round_up)
from e2e_phases import (check_logits, compare, decode_phase, fitting_batches, isolated_phase,  # noqa: E402,F401
                        ttft_phase)

MANIFEST = "manifest.json"
CHILD_MARK = "E2E-NATIVE-DECODE "


# ----------------------------------------------------------------------------- one model

def make_vm(side: str, executable, device: Device) -> VirtualMachine:
    """A VM for one side. A VM binds the ``vm.builtin`` functions when it is made: ours gets the
    dispatchers ``import relax_kvcache`` installed; native gets TVM's own C++ functions, as in a
    process without relax_kvcache (the dispatcher's Python would sit before every native call)."""
    if side == "ours":
        return VirtualMachine(executable, device.dev)
    swapped = {}
    for name in BUILTINS:
        theirs = tvm_ffi.get_global_func(ORIGINAL_PREFIX + name, allow_missing=True)
        if theirs is not None:
            swapped[name] = tvm_ffi.get_global_func(name)
            tvm_ffi.register_global_func(name, theirs, override=True)
    try:
        return VirtualMachine(executable, device.dev)
    finally:
        for name, dispatcher in swapped.items():
            tvm_ffi.register_global_func(name, dispatcher, override=True)


def native_process(libs: pathlib.Path, model: str, plan: Plan) -> Callable[[int, int], dict]:
    """``native_decode(context, batch)`` running one native decode configuration in a process of
    its own (``--native-decode``): TVM's native cache failed a batch-8 decode with an illegal
    address on an H100 once other native caches had been used in the same process (its copy
    stream overwrites the step metadata that queued kernels still read,
    results/e2e_native_race_h100.log)."""
    def native_decode(context: int, batch: int) -> dict:
        cmd = [sys.executable, __file__, "--libs", str(libs), "--models", model, "--steps", str(plan.steps),
               "--native-decode", str(context), str(batch), *(["--sync-steps"] if plan.sync_steps else []),
               "--fill", plan.fill]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(CHILD_MARK)]
        if proc.returncode or not lines:
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            return {"error": f"exit status {proc.returncode}: {tail[:200]}"}
        return json.loads(lines[-1][len(CHILD_MARK):])

    return native_decode


def run_model(name: str, cfg: LlamaConfig, executables: dict, device: Device, plan: Plan, graphs: bool,
              log=print, native_decode: Optional[Callable[[int, int], dict]] = None,
              kv_dtype: Optional[str] = None) -> dict:
    """Every phase of one model; with ``native_decode(context, batch)``, the native side's decode
    configurations run through it (one process each) instead of in this process; with
    ``kv_dtype``, ``executables["ours-fp8"]`` against ours (``e2e_fp8.run``)."""
    weights = device.weights(cfg, SEED)
    runners = {side: Runner(side, make_vm(side, executables[side], device), weights) for side in SIDES}
    result: dict = {"model": name, "config": dataclasses.asdict(cfg), "device": device.describe(), "skipped": [],
                    "graphs": graphs}
    log(f"{name}: logits check ...")
    result["check"] = check_logits(runners, device, cfg, plan, graphs)
    if "error" in result["check"].get("graph", {}):
        result["graphs"] = graphs = False
        result["graph_error"] = result["check"]["graph"]["error"]
    result["ttft"] = {side: {} for side in SIDES}
    if plan.ttft:
        log(f"{name}: TTFT ...")
        for side in SIDES:
            times = result["ttft"][side] = ttft_phase(runners[side], device, cfg, plan)
            log(f"    {side}: " + ", ".join(f"1 x {n} {t * 1e3:.1f} ms" for n, t in times.items()), flush=True)
    free = device.free_bytes()
    result["decode"] = {}
    for context in plan.contexts:
        batches = fitting_batches(cfg, plan, context, free, result["skipped"])
        if not batches:
            continue
        log(f"{name}: decode at context {context}, batches {batches} ...")
        result["decode"][context] = {}
        for side in SIDES:
            if side == "native" and native_decode is not None:
                result["decode"][context][side] = isolated_phase(native_decode, context, batches, log)
                continue
            result["decode"][context][side] = decode_phase(runners[side], device, cfg, plan, context, batches,
                                                           graphs and side == "ours", log)
    if kv_dtype:
        import e2e_fp8

        fp8 = Runner("ours", make_vm("ours", executables["ours-fp8"], device), weights, calibrate=True)
        result["fp8"] = e2e_fp8.run(sys.modules[__name__], result, runners["ours"], fp8, device, cfg, plan, graphs,
                                    kv_dtype, log)
        del fp8
    del runners, weights
    device.release()
    return result


# ----------------------------------------------------------------------------- main

def run(executables_for: Callable[[str], dict], models: Dict[str, LlamaConfig], device: Device, plan: Plan,
        graphs: bool, json_path: Optional[pathlib.Path], libs: Optional[pathlib.Path] = None,
        kv_dtype: Optional[str] = None) -> int:
    import e2e_fp8

    results = []
    for name, cfg in models.items():
        result = run_model(name, cfg, executables_for(name), device, plan, graphs,
                           native_decode=native_process(libs, name, plan) if libs else None, kv_dtype=kv_dtype)
        result["chunk"], result["sync_steps"], result["fill"] = plan.chunk, plan.sync_steps, plan.fill
        report(result)
        if "fp8" in result:
            e2e_fp8.report(result)
        results.append(result)
    if json_path:
        json_path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    failed = [r["model"] for r in results if not r["check"]["ok"]]
    if failed:
        print(f"FAIL: logits of ours and native differ beyond tolerance for {', '.join(failed)}", file=sys.stderr)
        return 1
    failed = [r["model"] for r in results if "fp8" in r and not r["fp8"]["check"]["ok"]]
    if failed:
        print(f"FAIL: logits over {kv_dtype} pages differ from float16 pages beyond tolerance for "
              f"{', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _plan(plan: Plan, args) -> Plan:
    """``plan`` with the counts given on the command line."""
    given = {"steps": args.steps, "contexts": args.contexts, "batches": args.batches, "ttft": args.ttft,
             "sync_steps": args.sync_steps or None, "fill": args.fill}
    plan = dataclasses.replace(plan, **{k: v for k, v in given.items() if v is not None})
    return dataclasses.replace(plan, chunk=max([plan.chunk, *plan.ttft]))


@functools.lru_cache(maxsize=None)
def _smoke_executable(side: str, kv_dtype: Optional[str] = None):
    """``--cpu-smoke``'s tiny model for one side, compiled once per process."""
    import e2e_models

    return e2e_models.compile_model(side, SMOKE_MODEL, tvm.target.Target("llvm"), kv_dtype)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prepare", type=pathlib.Path, help="compile the libraries into this folder (here)")
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--bundle", action="store_true", help="--prepare: also pack TVM's runtime-only bundle")
    parser.add_argument("--libs", type=pathlib.Path, help="folder built by --prepare (GPU host)")
    parser.add_argument("--cpu-smoke", action="store_true", help="a tiny model on llvm, compiled in-process")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    parser.add_argument("--steps", type=int, help="timed decode steps per configuration")
    parser.add_argument("--contexts", type=int, nargs="*", help="decode contexts (default 1024 4096; none: "
                        "no decode)")
    parser.add_argument("--batches", type=int, nargs="+", help="decode batches (default 1 8 32 128)")
    parser.add_argument("--ttft", type=int, nargs="*", help="TTFT prompt lengths (default 512 2048 8192; none: "
                        "no TTFT)")
    parser.add_argument("--no-graph", action="store_true", help="skip ours with CUDA graphs")
    parser.add_argument("--sync-steps", action="store_true", help="wait for the GPU before every decode step, "
                        "on both sides (TVM's native cache faults when its steps queue up)")
    parser.add_argument("--fill", choices=("model", "attention"), help="how decode contexts are filled: by the "
                        "model's prefill (default) or by each layer's attention call on random q/k/v (the same KV "
                        "bytes, without the model's matmuls)")
    parser.add_argument("--json", type=pathlib.Path, help="write every result to this file")
    parser.add_argument("--kv-dtype", choices=KV_DTYPES,
                        help="also ours over 8-bit pages of this format (--prepare: build it; else: run it "
                        "beside ours over float16 pages)")
    parser.add_argument("--soak", type=float, metavar="MINUTES", help="only serve random traffic with "
                        "generate.Engine on ours for this long (the 1b model unless one is named)")
    parser.add_argument("--same-process", action="store_true", help="native decode configurations in this "
                        "process (default: a process each)")
    parser.add_argument("--native-decode", type=int, nargs=2, metavar=("CONTEXT", "BATCH"),
                        help=argparse.SUPPRESS)  # one native decode configuration (a child process)
    args = parser.parse_args(argv)
    if args.prepare:
        import e2e_models

        return e2e_models.prepare(args.prepare, args.arch, {m: MODELS[m] for m in args.models}, MANIFEST,
                                  args.bundle, args.kv_dtype)
    if args.cpu_smoke:
        import e2e_soak

        plan = _plan(SMOKE_PLAN, args)
        if args.soak is not None:
            executable = (_smoke_executable("ours-fp8", args.kv_dtype) if args.kv_dtype
                          else _smoke_executable("ours"))
            return run_soak(executable, SMOKE_MODEL, Device(cuda=False), plan, args.soak, e2e_soak.SMOKE_LOAD,
                            args.json, calibrate=bool(args.kv_dtype))
        def smoke(_name: str) -> dict:
            sides = {side: _smoke_executable(side) for side in SIDES}
            return {**sides, "ours-fp8": _smoke_executable("ours-fp8", args.kv_dtype)} if args.kv_dtype else sides

        return run(smoke, {"tiny": SMOKE_MODEL}, Device(cuda=False), plan, False, args.json, kv_dtype=args.kv_dtype)
    if args.libs is None:
        parser.error("one of --prepare DIR (here), --libs DIR (GPU host) or --cpu-smoke")
    manifest = read_manifest(args.libs)
    missing = [m for m in args.models if m not in manifest["models"]]
    if missing:
        parser.error(f"{args.libs} holds no libraries for {missing}: run --prepare with --models {' '.join(missing)}")
    other = [m for m in args.models if args.kv_dtype and manifest["models"][m].get("kv_dtype") != args.kv_dtype]
    if other:
        parser.error(f"{args.libs} holds no {args.kv_dtype} build of {other}: run --prepare with --kv-dtype "
                     f"{args.kv_dtype} --models {' '.join(other)}")
    device = Device(cuda=True)
    plan = _plan(GPU_PLAN, args)

    def executables_for(name: str) -> dict:
        return load_executables(args.libs, manifest, name, [*SIDES, *(["ours-fp8"] if args.kv_dtype else [])], device)

    if args.soak is not None:
        import e2e_soak

        name = args.models[0] if len(args.models) == 1 else "1b"
        side = "ours-fp8" if args.kv_dtype else "ours"  # --kv-dtype: the soak over 8-bit pages
        return run_soak(executables_for(name)[side], MODELS[name], device, plan, args.soak, e2e_soak.GPU_LOAD,
                        args.json, calibrate=bool(args.kv_dtype))
    if args.native_decode:
        return native_child(args.models[0], executables_for(args.models[0])["native"], device, plan,
                            *args.native_decode)
    print(f"e2e benchmark on {device.describe()}, TVM {tvm.__version__}", flush=True)
    return run(executables_for, {m: MODELS[m] for m in args.models}, device, plan, not args.no_graph, args.json,
               libs=None if args.same_process else args.libs, kv_dtype=args.kv_dtype)


def read_manifest(libs: pathlib.Path) -> dict:
    """The manifest of a folder built by ``--prepare``; its nvcc fatbins become the kernel cache."""
    os.environ.setdefault("RELAX_KVCACHE_CACHE_DIR", str((libs / "cache").resolve()))
    return json.loads((libs / MANIFEST).read_text())


def load_executables(libs: pathlib.Path, manifest: dict, name: str, sides: List[str], device: Device) -> dict:
    """The libraries of model ``name`` for ``sides`` (of :func:`read_manifest`'s folder), loaded
    on ``device``; SystemExit where they were built for another configuration."""
    from relax_kvcache import deploy

    if manifest["models"][name]["config"] != dataclasses.asdict(MODELS[name]):
        raise SystemExit(f"{name}: the libraries were built for another configuration; run --prepare again")
    return {side: deploy.load(str(libs / manifest["models"][name][side]), device=device.dev) for side in sides}


def run_soak(executable, cfg: LlamaConfig, device: Device, plan: Plan, minutes: float, load,
             json_path: Optional[pathlib.Path], calibrate: bool = False) -> int:
    """``--soak``: ``generate.Engine`` on ours for ``minutes`` (``e2e_soak.soak``), on a cache
    sized to run near full (``calibrate``: over 8-bit pages, scales from the first step); exit
    status 1 unless it passed."""
    import e2e_soak
    from relax_kvcache.generate import Engine

    weights = device.weights(cfg, SEED)
    vm = make_vm("ours", executable, device)
    mean = (sum(load.prompt) + sum(load.output)) / 2
    total = round_up(max(int(0.9 * load.max_live * mean), load.prompt[1] + load.output[1] + 8 * PAGE))
    cache = Runner("ours", vm, weights, calibrate=calibrate).create(2 * load.max_live, total, plan.chunk)
    functions = {"prefill_rows": vm["prefill_rows"], "decode": vm["decode"]}  # the sampled rows' logits
    engine = Engine(functions, weights, cache, device.dev, prefill_chunk_size=plan.chunk,
                    vocab_size=cfg.vocab_size, cuda_graphs=device.cuda, prefill_rows=True)
    pages = f" over {cache.config.kv_dtype} pages" if cache.config.kv_dtype else ""
    print(f"soak{pages} on {device.describe()}: {minutes} min, up to {load.max_live} requests, prompts "
          f"{load.prompt[0]}-{load.prompt[1]}, outputs {load.output[0]}-{load.output[1]} tokens, a cache of "
          f"{total} tokens, CUDA graphs {'on' if device.cuda else 'off'}", flush=True)
    try:
        same = e2e_soak.graphs_agree(engine, lambda: Engine(functions, weights, cache, device.dev,
                                                             prefill_chunk_size=plan.chunk, vocab_size=cfg.vocab_size,
                                                             cuda_graphs=False, prefill_rows=True)) if device.cuda else None
        result = e2e_soak.soak(engine, minutes * 60, load, device.used_bytes)
    finally:
        engine.close()
    result["graphs_agree"] = same
    result["ok"] = result["ok"] and same is not False
    if json_path:
        json_path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0 if result["ok"] else 1


def native_child(name: str, executable, device: Device, plan: Plan, context: int, batch: int) -> int:
    """``--native-decode``: one native decode configuration; its result as a JSON line."""
    cfg = MODELS[name]
    runner = Runner("native", make_vm("native", executable, device), device.weights(cfg, SEED))
    result = decode_phase(runner, device, cfg, plan, context, [batch], False, lambda *a, **k: None)
    print(CHILD_MARK + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
