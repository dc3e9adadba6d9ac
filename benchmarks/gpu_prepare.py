"""Build, on the development machine, every kernel library the GPU check and benchmark load.

The CUDA host runs a runtime-only TVM (no compiler), so nothing may be compiled there. This
script compiles, for one target:

* our kernel set (``relax_kvcache.build.export_kernels``) for each check configuration and for
  the benchmark shape; configurations whose kernels are identical share one library;
* TVM's own kernels (``tvm.relax.frontend.nn.llm.kv_cache``, GPU-scheduled for CUDA) for the
  benchmark shape, the baseline that TVM's native C++ cache runs with;

and writes them with a ``manifest.json`` (configurations, workloads, file names) into one folder
(default ``.gpu/`` in the repository root). For CUDA it also compiles each library's CUDA source
with nvcc here (``--no-nvcc`` skips this) into ``<out>/cache/cuda-fatbin``, the fatbin cache
``relax_kvcache.deploy`` reads on the host: nvcc errors show up here, and the host loads the
libraries without compiling. With ``--bundle`` it also packs TVM's runtime-only bundle
(``tools/make_bundle.sh``) into ``<out>/bundle``, so that the folder is all the GPU
host needs beside the repository. Everything sent must stay under 64 MiB.

The module also holds what the check and the benchmark share: the configurations, the manifest
format and :func:`load_library`. Build-time imports (TVM's compiler, our kernel factories) happen
inside the build functions only, so the module imports on a runtime-only TVM.

Usage::

    python benchmarks/gpu_prepare.py [--out .gpu] [--arch sm_90a] [--bundle]
    python benchmarks/gpu_prepare.py --target llvm --out .gpu-cpu   # CPU libraries, to test here
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "benchmarks"))  # native_baseline, also when imported from elsewhere

import tvm  # noqa: E402

import relax_kvcache as rk  # noqa: E402
from native_baseline import KERNEL_NAMES, Shape  # noqa: E402

MANIFEST = "manifest.json"
SIZE_LIMIT = 64 << 20  # bytes the device tool carries, bundle included
BUNDLE_SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "tools" / "make_bundle.sh"


# ----------------------------------------------------------------------------- configurations

def _check_config(**overrides) -> Dict[str, Any]:
    base = dict(num_layers=2, num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, max_num_seqs=16,
                max_total_seq_len=2048, prefill_chunk_size=128, rope_mode=int(rk.RopeMode.NORMAL),
                rope_theta=1e4, rope_scale=1.0, dtype="float16")
    base.update(overrides)
    return base


_LAYER_WINDOWS = dict(attn_kinds=[int(rk.AttnKind.MHA_SLIDING), int(rk.AttnKind.MHA)], layer_sliding_window_size=40)
_CHUNKED = dict(attn_kinds=[int(rk.AttnKind.MHA_CHUNKED_LOCAL), int(rk.AttnKind.MHA)], attention_chunk_size=40)

#: Check configurations: name -> (KVCacheConfig fields, workloads run on it; see tests/test_workloads.py).
#: RoPE mode is no kernel parameter, so configurations differing only in it share a library.
CHECK_CONFIGS: Dict[str, Tuple[Dict[str, Any], List[str]]] = {
    "d128-normal": (_check_config(head_dim=128, rope_theta=5e5, rope_scale=0.5),
                    ["random", "prefix_chain", "token_tree", "self_cross_merge", "checkpoint", "graph_decode",
                     "graph_batches"]),
    "d64-none": (_check_config(rope_mode=int(rk.RopeMode.NONE)),
                 ["random", "token_tree", "self_cross_merge"]),
    "d128-inline": (_check_config(head_dim=128, rope_mode=int(rk.RopeMode.INLINE), rope_theta=5e5, rope_scale=0.5),
                    ["random", "prefix_chain", "self_cross_merge"]),
    "d64-seqwin": (_check_config(support_sliding_window=True, max_num_seqs=8),  # RoPE becomes INLINE
                   ["seq_windows", "random"]),
    "d64-seqwin-none": (_check_config(support_sliding_window=True, max_num_seqs=8, rope_mode=int(rk.RopeMode.NONE)),
                        ["seq_windows"]),
    "d64-layerwin-normal": (_check_config(**_LAYER_WINDOWS), ["layer_windows", "shared_kv", "checkpoint",
                                                              "graph_decode", "graph_batches"]),
    "d64-layerwin-inline": (_check_config(**_LAYER_WINDOWS, rope_mode=int(rk.RopeMode.INLINE)),
                            ["layer_windows", "shared_kv"]),
    "d64-chunked-normal": (_check_config(**_CHUNKED), ["layer_windows", "shared_kv", "checkpoint", "graph_decode"]),
    "d64-chunked-inline": (_check_config(**_CHUNKED, rope_mode=int(rk.RopeMode.INLINE)),
                           ["layer_windows", "graph_decode"]),
    # 8-bit pages (K / V on the 8-bit grid: stored exactly; RoPE NONE or INLINE keeps them there)
    "d128-fp8-e4m3": (_check_config(head_dim=128, rope_mode=int(rk.RopeMode.NONE), kv_dtype="float8_e4m3fn"),
                      ["random", "prefix_chain", "token_tree", "self_cross_merge", "graph_decode", "checkpoint",
                       "graph_batches"]),
    "d64-fp8-e5m2-seqwin": (_check_config(support_sliding_window=True, max_num_seqs=8, kv_dtype="float8_e5m2"),
                            ["seq_windows", "random"]),
    "d64-fp8-layerwin": (_check_config(**_LAYER_WINDOWS, rope_mode=int(rk.RopeMode.INLINE), kv_dtype="float8_e4m3fn"),
                         ["layer_windows", "shared_kv", "graph_decode"]),
    "d64-fp8-chunked": (_check_config(**_CHUNKED, rope_mode=int(rk.RopeMode.NONE), kv_dtype="float8_e5m2"),
                        ["layer_windows", "shared_kv", "checkpoint"]),
    # prefix caching with a host tier (the pinned copies on CUDA), 16- and 8-bit pages
    "d128-prefix": (_check_config(head_dim=128, prefix_caching=True, host_cache_pages=64, max_total_seq_len=1024),
                    ["prefix_cache", "random", "prefix_chain", "token_tree"]),
    "d64-fp8-prefix": (_check_config(rope_mode=int(rk.RopeMode.NONE), kv_dtype="float8_e4m3fn", prefix_caching=True,
                                     host_cache_pages=64, max_total_seq_len=1024), ["prefix_cache", "random"]),
    # the benchmark's head shape with long contexts (many KV chunks per block, large batches)
    "d128-long": (_check_config(num_qo_heads=32, num_kv_heads=8, head_dim=128, rope_theta=5e5, max_num_seqs=16,
                                max_total_seq_len=20480, prefill_chunk_size=8192), ["long_context"]),
    "d128-long-chunked": (_check_config(num_qo_heads=32, num_kv_heads=8, head_dim=128, rope_theta=5e5,
                                        max_num_seqs=16, max_total_seq_len=20480, prefill_chunk_size=8192,
                                        attn_kinds=[int(rk.AttnKind.MHA_CHUNKED_LOCAL), int(rk.AttnKind.MHA)],
                                        attention_chunk_size=384), ["long_context"]),
}

#: Benchmark shape (Llama-3-8B attention): kernels do not depend on layers or capacities.
BENCH_SHAPE = Shape(num_layers=8, num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                    max_num_seqs=128, max_total_seq_len=8192, prefill_chunk_size=4096,
                    rope_mode=int(rk.RopeMode.NORMAL), rope_theta=5e5, dtype="float16")


#: Robustness shapes: the benchmark shape with head_dim 64 or 256, or an 8:1 GQA group.
ROBUST_SHAPES: Dict[str, Shape] = {
    "d64": dataclasses.replace(BENCH_SHAPE, head_dim=64),
    "d256": dataclasses.replace(BENCH_SHAPE, head_dim=256),
    "gqa8": dataclasses.replace(BENCH_SHAPE, num_kv_heads=4),
}


#: The cost of pages: our kernels with one 4096-token page per sequence, the contiguous
#: layout a 4096-token context would have (``gpu_kernel_bench.py --page-cost``).
PAGE_COST_SHAPE = dataclasses.replace(BENCH_SHAPE, page_size=4096)


def config_to_json(config: rk.KVCacheConfig) -> Dict[str, Any]:
    """The fields of a :class:`KVCacheConfig` as JSON values (enums as ints)."""
    fields = dataclasses.asdict(config)
    fields["rope_mode"] = int(config.rope_mode)
    fields["attn_kinds"] = [int(kind) for kind in config.attn_kinds]
    return fields


def config_from_json(fields: Dict[str, Any]) -> rk.KVCacheConfig:
    """Inverse of :func:`config_to_json`."""
    return rk.KVCacheConfig(**fields)


def shape_to_json(shape: Shape) -> Dict[str, Any]:
    return dataclasses.asdict(shape)


def shape_from_json(fields: Dict[str, Any]) -> Shape:
    fields = dict(fields)
    if fields.get("attn_kinds") is not None:
        fields["attn_kinds"] = tuple(fields["attn_kinds"])
    return Shape(**fields)


# ----------------------------------------------------------------------------- targets

def make_target(kind: str, arch: str) -> tvm.target.Target:
    """``cuda`` for ``arch`` (e.g. ``sm_90a``), or ``llvm``: this machine's CPU."""
    from relax_kvcache.targets import make_target as rk_make_target

    return rk_make_target("llvm") if kind == "llvm" else rk_make_target(kind, arch=arch)


def kernel_spec_key(config: rk.KVCacheConfig) -> str:
    """What our kernel set depends on: configurations with equal keys share one library."""
    try:
        from relax_kvcache.build import KernelSetSpec
    except ImportError:
        return repr(config)
    return repr(KernelSetSpec.from_config(config))


# ----------------------------------------------------------------------------- building

def export_ours(config: rk.KVCacheConfig, target: tvm.target.Target, path: pathlib.Path) -> None:
    """Compile our kernel set for ``config`` and write it as one library file."""
    from relax_kvcache.build import export_kernels

    export_kernels(config, target, path)


def tvm_kernel_funcs(shape: Shape, target: tvm.target.Target) -> Dict[str, Any]:
    """TVM's kernels for ``shape`` as PrimFuncs, by :data:`native_baseline.KERNEL_NAMES` name.

    GPU targets get the kernels TVM's ``TIRPagedKVCache`` uses for them (already scheduled,
    except the elementwise ones, which get dlight's fallback schedule in :func:`build_tvm`);
    ``llvm`` gets TVM's CPU kernels (the set ``native_baseline.py`` uses).
    """
    from tvm.relax.frontend.nn.llm import kv_cache as kc

    hkv, hq, d, dt, ps, rs = (shape.num_kv_heads, shape.num_qo_heads, shape.head_dim, shape.dtype,
                              shape.page_size, {})
    common = dict(
        transpose_append=kc._kv_cache_transpose_append(hkv, d, dt, page_size=ps),
        debug_get_kv=kc._kv_cache_debug_get_kv(shape.num_layers, hkv, d, dt),
        split_rotary=kc.llama_rope_with_position_map(shape.rope_theta, shape.rope_scale, d, hq, hkv, dt, rs),
    )
    if target.kind.name == "llvm":
        return dict(
            common,
            attention_prefill=kc._attention_prefill_cpu(hkv, hq, d, dt, False, rs, page_size=ps),
            attention_decode=kc._attention_decode_cpu(hkv, hq, d, dt, False, rs, page_size=ps),
            attention_prefill_sliding_window=kc._attention_prefill_cpu(
                hkv, hq, d, dt, True, rs, page_size=ps, sliding_window_size=shape.layer_window_size),
            attention_decode_sliding_window=kc._attention_decode_cpu(hkv, hq, d, dt, True, rs, page_size=ps),
            attention_prefill_ragged=kc._attention_prefill_ragged_cpu(hkv, hq, d, d, dt, rs),
            tree_attn=kc.tree_attn_cpu(hkv, hq, d, dt, rs),
            tree_attn_paged=kc.tree_attn_with_paged_kv_cache_cpu(hkv, hq, d, dt, rs),
            merge_inplace=kc._merge_state_inplace_cpu(dt),
            copy_single_page=kc._copy_single_page_cpu(hkv, ps, d, dt),
            compact_copy=kc._compact_kv_copy_cpu(hkv, d, dt, page_size=ps),
        )
    return dict(
        common,
        attention_prefill=kc._attention_prefill(hkv, hq, d, dt, False, rs, target, page_size=ps),
        attention_decode=kc._attention_decode(hkv, hq, d, dt, False, rs, target, page_size=ps),
        attention_prefill_sliding_window=kc._attention_prefill(
            hkv, hq, d, dt, True, rs, target, page_size=ps, sliding_window_size=shape.layer_window_size),
        attention_decode_sliding_window=kc._attention_decode(hkv, hq, d, dt, True, rs, target, page_size=ps),
        attention_prefill_ragged=kc._attention_prefill_ragged(hkv, hq, d, d, dt, rs, target),
        tree_attn=kc.tree_attn(hkv, hq, d, dt, rs, target),
        tree_attn_paged=kc.tree_attn_with_paged_kv_cache(hkv, hq, d, dt, rs, target),
        merge_inplace=kc._merge_state_inplace(hq, d, dt, target),
        copy_single_page=kc._copy_single_page(hkv, ps, d, dt, target),
        compact_copy=kc._compact_kv_copy(hkv, d, dt, target, page_size=ps),
    )


def cuda_source(mod: tvm.runtime.Module) -> str:
    """The CUDA C++ source inside a compiled, not yet loaded, module."""
    for m in [mod, *mod.imports]:
        if m.kind == "cuda":
            return m.inspect_source()
    raise ValueError("the module holds no CUDA code")


def precompile(source: str, arch: str, out: pathlib.Path) -> int:
    """Compile CUDA source with nvcc here, into the fatbin cache ``relax_kvcache.deploy`` reads
    on the GPU host (``out/cache`` as ``RELAX_KVCACHE_CACHE_DIR``; ``gpu_host.sh`` sets it), so
    the host need not run nvcc, and compile errors show up before any device time is spent.
    Returns the fatbin's size."""
    from relax_kvcache import deploy

    fatbin = deploy.nvcc_compile(source, arch=arch, use_cache=False)
    path = out / "cache" / "cuda-fatbin" / deploy.fatbin_cache_path(source, arch=arch).name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(fatbin)
    return len(fatbin)


def _short_error(err: Exception) -> str:
    """One line about a build or nvcc failure (nvcc's first error where there is one)."""
    lines = [line.strip() for line in str(err).strip().splitlines()] or [""]
    first = next((line for line in lines if line.startswith("first error:")), None)
    return f"{type(err).__name__}: {first or lines[-1]}"


def build_tvm(shape: Shape, target: tvm.target.Target):
    """Compile TVM's kernels for ``shape`` into one module whose functions are named by
    :data:`native_baseline.KERNEL_NAMES` (as TVM's own test suite builds them, one module)."""
    from tvm.s_tir import dlight as dl

    funcs = tvm_kernel_funcs(shape, target)
    assert set(funcs) == set(KERNEL_NAMES), sorted(set(KERNEL_NAMES) ^ set(funcs))
    mod = tvm.IRModule({name: funcs[name].with_attr("global_symbol", name) for name in KERNEL_NAMES})
    if target.kind.name != "llvm":
        with target:
            mod = dl.ApplyDefaultSchedule(dl.gpu.Fallback())(mod)
    return tvm.tirx.build(mod, target=target)


# ----------------------------------------------------------------------------- loading (both machines)

def is_cpu(device: tvm.runtime.Device) -> bool:
    return device.dlpack_device_type() == tvm.cpu().dlpack_device_type()


def describe_device(device: tvm.runtime.Device) -> str:
    """A short description of a device (CUDA: compute capability and SM count)."""
    if is_cpu(device):
        return "CPU"
    try:
        return f"compute capability {device.compute_version}, {device.multi_processor_count} SMs"
    except Exception:  # noqa: BLE001  (TVM's CUDA runtime is loaded with the first library)
        return "CUDA runtime not loaded"


def read_manifest(libs: pathlib.Path) -> Dict[str, Any]:
    """The manifest of a prepared folder (see :func:`main`)."""
    path = pathlib.Path(libs) / MANIFEST
    if not path.exists():
        raise SystemExit(f"{path} not found: run benchmarks/gpu_prepare.py first")
    return json.loads(path.read_text())


def load_library(path: pathlib.Path, device: tvm.runtime.Device) -> tvm.runtime.Module:
    """Load a prepared library for ``device`` with ``relax_kvcache.deploy.load`` (on a CUDA
    host with runtime-only TVM it loads TVM's CUDA runtime and compiles the source with nvcc)."""
    from relax_kvcache import deploy

    return deploy.load(str(path), device=device)


def tvm_kernel_dict(mod: tvm.runtime.Module) -> Dict[str, Any]:
    """TVM's kernels by :data:`native_baseline.KERNEL_NAMES` name from a :func:`build_tvm` library."""
    return {name: mod.get_function(name, query_imports=True) for name in KERNEL_NAMES}


# ----------------------------------------------------------------------------- main

def _size(path: pathlib.Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _build_ours(configs: Dict[str, rk.KVCacheConfig], target, out: pathlib.Path, nvcc_arch: Optional[str],
                done: Dict[str, str], failed: Dict[str, Tuple[str, str]]) -> Dict[str, Optional[str]]:
    """Export one library per distinct kernel set (and, with ``nvcc_arch``, its fatbin); returns
    config name -> file (None: failed). ``done``: kernel-set key -> file written; ``failed``:
    key -> (file, error); both are updated."""
    files: Dict[str, Optional[str]] = {}
    for name, config in configs.items():
        key = kernel_spec_key(config)
        if key in done:
            print(f"  ours  {name:<22} -> {done[key]} (same kernels)", flush=True)
        elif key in failed:
            print(f"  ours  {name:<22} -> {failed[key][0]} (same kernels) FAILED", flush=True)
        else:
            file = f"ours-{name}.so"
            start = time.perf_counter()
            print(f"  ours  {name:<22} -> {file} ...", end=" ", flush=True)
            try:
                export_ours(config, target, out / file)
                note = ""
                if nvcc_arch:  # the same (deterministic) compile again, for its CUDA source
                    note = f", fatbin {precompile(cuda_source(rk.build_kernels(config, target)), nvcc_arch, out) / 1e6:.2f} MB"
                done[key] = file
                print(f"{time.perf_counter() - start:.0f} s, {_size(out / file) / 1e6:.2f} MB{note}", flush=True)
            except Exception as err:  # noqa: BLE001  (report and go on with the rest)
                (out / file).unlink(missing_ok=True)
                failed[key] = (file, _short_error(err))
                print(f"FAILED ({failed[key][1]})", flush=True)
        files[name] = done.get(key)
    return files


def _build_tvm(name: str, shape: Shape, target, out: pathlib.Path, nvcc_arch: Optional[str],
               failed: Dict[str, Tuple[str, str]]) -> Optional[str]:
    """Export TVM's kernels for ``shape`` as ``tvm-<name>.so`` (and its fatbin); returns the file
    (None: failed, recorded in ``failed``)."""
    file = f"tvm-{name}.so"
    start = time.perf_counter()
    print(f"  tvm   {name:<22} -> {file} ...", end=" ", flush=True)
    try:
        module = build_tvm(shape, target)
        module.export_library(str(out / file))
        note = f", fatbin {precompile(cuda_source(module), nvcc_arch, out) / 1e6:.2f} MB" if nvcc_arch else ""
        print(f"{time.perf_counter() - start:.0f} s, {_size(out / file) / 1e6:.2f} MB{note}", flush=True)
        return file
    except Exception as err:  # noqa: BLE001
        (out / file).unlink(missing_ok=True)
        failed[f"tvm-{name}"] = (file, _short_error(err))
        print(f"FAILED ({failed[f'tvm-{name}'][1]})", flush=True)
        return None


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO / ".gpu"), help="output folder (default: .gpu/ in the repo)")
    parser.add_argument("--target", default="cuda", choices=["cuda", "llvm"], help="target kind (default cuda)")
    parser.add_argument("--arch", default="sm_90a", help="CUDA architecture (default sm_90a)")
    parser.add_argument("--bundle", action="store_true",
                        help=f"also pack the runtime-only TVM bundle into OUT/bundle ({BUNDLE_SCRIPT})")
    parser.add_argument("--only", choices=["ours", "tvm", "robust"],
                        help="build only our libraries, only TVM's, or only both for the robustness shapes")
    parser.add_argument("--configs", nargs="+", choices=sorted(CHECK_CONFIGS), metavar="NAME",
                        help="with --only ours: only these check configurations (and no benchmark library)")
    parser.add_argument("--no-nvcc", action="store_true",
                        help="do not compile the CUDA code with nvcc here (the GPU host then does)")
    args = parser.parse_args(argv)

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = make_target(args.target, args.arch)
    nvcc_arch = args.arch if target.kind.name == "cuda" and not args.no_nvcc else None
    print(f"preparing {out} for target {target} (TVM {tvm.__version__})", flush=True)
    manifest: Dict[str, Any] = {"target": str(target), "target_kind": target.kind.name, "arch": args.arch,
                                "tvm_version": tvm.__version__, "fatbins_for": nvcc_arch,
                                "check": {}, "bench": {"ours": None, "tvm": None}, "robust": {}, "errors": {}}
    if args.only == "robust":  # keep everything else
        if (out / MANIFEST).exists() and read_manifest(out).get("target") == manifest["target"]:
            manifest.update({k: v for k, v in read_manifest(out).items()
                             if k not in ("robust", "page_cost", "errors")})
        stale = [f for f in out.glob("*.so") if "-robust-" in f.name]
    elif args.only:  # rebuild one side: keep the other side's libraries and manifest entries
        kept = "tvm" if args.only == "ours" else "ours"
        if (out / MANIFEST).exists():
            old_manifest = read_manifest(out)
            if old_manifest.get("target") == manifest["target"]:
                manifest["bench"][kept] = old_manifest["bench"].get(kept)
                manifest["robust"] = old_manifest.get("robust", {})
                manifest["page_cost"] = old_manifest.get("page_cost")
                if kept == "ours":
                    manifest["check"] = old_manifest["check"]
        stale = [f for f in out.glob("*.so") if f.name.startswith(f"{args.only}-") and "-robust-" not in f.name]
    else:
        stale = [*out.glob("*.so"), *out.glob("cache/cuda-fatbin/*.fatbin")]
    for old in stale:
        old.unlink()
    done: Dict[str, str] = {}
    failed: Dict[str, Tuple[str, str]] = {}
    if args.configs and args.only != "ours":
        parser.error("--configs needs --only ours")
    chosen = {name: entry for name, entry in CHECK_CONFIGS.items() if not args.configs or name in args.configs}
    if args.only in (None, "ours"):
        configs = {name: config_from_json(fields) for name, (fields, _) in chosen.items()}
        files = _build_ours(configs, target, out, nvcc_arch, done, failed)
        for name, (fields, workloads) in chosen.items():
            error = failed.get(kernel_spec_key(configs[name]), (None, None))[1]
            manifest["check"][name] = {"config": config_to_json(configs[name]), "workloads": workloads,
                                       "library": files[name], "error": error}
    manifest["bench"]["shape"] = shape_to_json(BENCH_SHAPE)
    if args.only in (None, "ours") and not args.configs:
        manifest["bench"]["ours"] = _build_ours({"bench": BENCH_SHAPE.our_config()}, target, out, nvcc_arch, done, failed)["bench"]
    if args.only in (None, "tvm"):
        manifest["bench"]["tvm"] = _build_tvm("bench", BENCH_SHAPE, target, out, nvcc_arch, failed)
    if args.only in (None, "robust"):
        for name, shape in ROBUST_SHAPES.items():
            ours = _build_ours({f"robust-{name}": shape.our_config()}, target, out, nvcc_arch, done, failed)
            manifest["robust"][name] = {"shape": shape_to_json(shape), "ours": ours[f"robust-{name}"],
                                        "tvm": _build_tvm(f"robust-{name}", shape, target, out, nvcc_arch, failed)}
        ours = _build_ours({"robust-page4096": PAGE_COST_SHAPE.our_config()}, target, out, nvcc_arch, done, failed)
        manifest["page_cost"] = {"shape": shape_to_json(PAGE_COST_SHAPE), "ours": ours["robust-page4096"]}
    errors = dict(failed.values())
    manifest["errors"] = errors  # library file -> why it was not built
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")

    if args.bundle:
        subprocess.run(["bash", str(BUNDLE_SCRIPT), str(out / "bundle")], check=True,
                       stdout=subprocess.DEVNULL)
    total = _size(out)
    bundle = out / "bundle"
    print(f"{out}: {total / 2**20:.1f} MiB in all"
          + (f" (bundle {_size(bundle) / 2**20:.1f} MiB)" if bundle.exists() else
             " (+ ~7 MiB runtime bundle, not packed: --bundle)"))
    if total + (0 if bundle.exists() else 7 << 20) >= SIZE_LIMIT:
        print(f"WARNING: over the {SIZE_LIMIT >> 20} MiB the device tool carries", file=sys.stderr)
        return 1
    if errors:
        print(f"{len(errors)} librar{'y' if len(errors) == 1 else 'ies'} failed to build (see manifest 'errors')",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
