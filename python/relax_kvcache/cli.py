"""Command line: ``relax-kvcache demo`` and ``relax-kvcache build``."""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time
from typing import Callable, List, Optional

import tvm

from .config import KV_DTYPES, SUPPORTED_DTYPES, AttnKind, KVCacheConfig, RopeMode
from .targets import TARGET_KINDS

_ROPE_MODES = {mode.name.lower(): mode for mode in RopeMode}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="relax-kvcache", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    _add_demo_parser(commands)
    _add_build_parser(commands)
    args = parser.parse_args(argv)
    if args.command == "build":
        return _run_build(args)
    return _run_demo(args)


def _add_demo_parser(commands: argparse._SubParsersAction) -> None:
    demo = commands.add_parser(
        "demo", help="serve a small Llama-style model compiled with the cache, checked against numpy",
        description="Compile a 2-layer Llama-style model with the cache's kernels and serve a few "
                    "requests, every logit checked against a float64 numpy model. For a GPU host "
                    "with a runtime-only TVM: `--target cuda --export model.so` here, "
                    "`--load model.so` there.")
    demo.add_argument("--target", default="llvm", choices=["llvm", "cuda"], help="where to run (default: llvm)")
    demo.add_argument("--arch", help="CUDA architecture (default: the local GPU's, else sm_80)")
    demo.add_argument("--dtype", choices=SUPPORTED_DTYPES,
                      help="model and cache dtype (default: float32 on llvm, float16 on cuda)")
    demo.add_argument("--seed", type=_seed, default=0, help="random seed, a non-negative int (default 0)")
    demo.add_argument("--export", metavar="PATH", help="compile the model for --target and write the library; do not run")
    demo.add_argument("--load", metavar="PATH", help="run a library written by --export (runtime-only TVM is enough)")
    demo.add_argument("--cache-only", action="store_true",
                      help="the cache without a model: random attention inputs through every cache operation")
    demo.add_argument("--kv-dtype", choices=KV_DTYPES,
                      help="8-bit float pages, scales calibrated from the first step (default: pages of "
                           "--dtype); the model's logits are then held to the format's bound")
    demo.add_argument("--prefix-caching", action="store_true",
                      help="a cache with prefix caching; every request gets a second turn that starts on the "
                           "cached pages of its first (docs/prefix-caching.md)")
    demo.add_argument("--quiet", action="store_true", help="print only the summary line")


def _seed(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative; expected a non-negative int")
    return value


class _UsageError(Exception):
    """A command line that cannot work (one line, exit code 2)."""


def _one_line(err: BaseException) -> str:
    return "; ".join(line.strip() for line in str(err).splitlines() if line.strip()) or type(err).__name__


def _logger(args: argparse.Namespace) -> Callable[[str], None]:
    return lambda message: None if args.quiet else print(message, flush=True)


def _run_demo(args: argparse.Namespace) -> int:
    from .deploy import DeployError

    log = _logger(args)
    try:
        target = _check_demo_args(args)
        if not args.cache_only:
            return _run_model_demo(args, target, log)
        from .demo import run_demo

        result = run_demo(dtype=args.dtype or "float32", seed=args.seed, kv_dtype=args.kv_dtype, log=log)
    except (FileNotFoundError, DeployError, _UsageError) as err:
        print(f"relax-kvcache demo: error: {_one_line(err)}", file=sys.stderr, flush=True)
        return 2
    pages = (f", {result.kv_dtype} pages within {result.max_grid_steps:.2g} grid steps of numpy's quantization "
             "(at most 1)" if result.kv_dtype else "")
    print(f"demo {'OK' if result.ok else 'FAILED'}: {result.steps} steps, {result.tokens} tokens, "
          f"{result.tokens_per_second:,.0f} tokens/s through the cache, max |error| vs float64 "
          f"reference {result.max_error:.1e} (tolerance {result.tolerance:.0e}){pages}", flush=True)
    return 0 if result.ok else 1


def _check_demo_args(args: argparse.Namespace) -> Optional[tvm.target.Target]:
    """Refuse option combinations and --export destinations that cannot work, before compiling;
    return the target to compile for (None: nothing to compile)."""
    for option, value in (("--load", args.load), ("--export", args.export)):
        if value is not None and not value.strip():
            raise _UsageError(f"{option} {value!r} is empty; expected a file path")
    if args.cache_only and (args.load is not None or args.export is not None):
        option = "--load" if args.load is not None else "--export"
        raise _UsageError(f"--cache-only runs the cache without a model; it cannot be combined with {option} "
                          f"{(args.load or args.export)!r} (expected one of them)")
    if args.cache_only and args.prefix_caching:
        raise _UsageError("--prefix-caching serves a model's requests by their token ids; --cache-only has no "
                          "model (expected one of them)")
    if args.load is not None and args.export is not None:
        raise _UsageError(f"--load {args.load!r} runs a library and --export {args.export!r} writes one; expected "
                          "one of them")
    if args.export is not None:
        _check_output_path(args.export, "--export")
        if not args.export.endswith(".so"):
            raise _UsageError(f"--export {args.export!r} does not end in .so; expected a shared library path such "
                              "as model.so")
    return _check_demo_target(args)


def _check_demo_target(args: argparse.Namespace) -> Optional[tvm.target.Target]:
    """Refuse an --arch the demo would not use or that names no device model, and --target cuda
    without a GPU when it would run here."""
    from .build import can_load_here
    from .targets import TargetUnavailableError, make_target

    if args.cache_only and args.target != "llvm":
        raise _UsageError(f"--cache-only runs the cache with kernels for this machine's CPU; --target "
                          f"{args.target} would be ignored (expected --target llvm or no --target)")
    compiles = args.export is not None or (args.target == "cuda" and args.load is None)
    if args.arch is not None and not compiles:
        raise _UsageError(f"--arch {args.arch!r} is used where the demo compiles its model (--target cuda, or "
                          f"--export); with --target {args.target}"
                          f"{' and --load' if args.load is not None else ''} it would be ignored")
    if not compiles:
        return None
    try:
        target = make_target(args.target, arch=args.arch)
    except (ValueError, TargetUnavailableError) as err:
        raise _UsageError(_one_line(err)) from None
    if args.export is None and not can_load_here(target):  # it would run here: --target cuda
        raise _UsageError("--target cuda runs the demo on this machine's GPU and there is none (or no CUDA "
                          "runtime); compile here with --export model.so and run it on the GPU host with --load")
    return target


def _check_output_path(path: str, option: str) -> None:
    """Raise _UsageError unless ``path`` names a file that can be written."""
    if not path.strip():
        raise _UsageError(f"{option} {path!r} is empty; expected a file path such as model.so")
    if path.endswith(os.sep) or (os.altsep and path.endswith(os.altsep)):
        raise _UsageError(f"{option} {path!r} ends with a path separator; expected a file path such as "
                          f"{path.rstrip(os.sep + (os.altsep or '')) or 'model'}.so")
    try:
        dest = pathlib.Path(os.path.realpath(pathlib.Path(path).expanduser()))  # a link's target
        if len(dest.name.encode()) > 255:
            raise _UsageError(f"{option} {path!r}: the file name is longer than 255 bytes")
        if dest.is_dir():
            raise _UsageError(f"{option} {path!r} is a folder; expected a file path such as "
                              f"{str(dest / 'model.so')!r}")
        if not dest.parent.is_dir():
            raise _UsageError(f"{option} {path!r}: folder {str(dest.parent)!r} does not exist; "
                              "expected an existing folder")
        if not os.access(dest.parent, os.W_OK | os.X_OK):
            raise _UsageError(f"{option} {path!r}: folder {str(dest.parent)!r} is not writable")
    except (RuntimeError, OSError, ValueError) as err:  # ~unknown_user, a name too long, a NUL byte
        raise _UsageError(f"{option} {path!r} cannot be written: {_one_line(err)}") from None


def _run_model_demo(args: argparse.Namespace, target: Optional[tvm.target.Target], log) -> int:
    from .deploy import write_checksum
    from .model_demo import compile_model, default_dtype, run_model_demo
    from .models import LlamaConfig

    dtype = args.dtype or default_dtype(args.target)
    executable = None
    if target is not None:
        log(f"compiling the demo model for {target} ...")
        executable = compile_model(LlamaConfig(dtype=dtype), target, prefix_caching=args.prefix_caching,
                                   kv_dtype=args.kv_dtype)
        if args.export:
            try:
                executable.export_library(args.export)
                write_checksum(args.export)
            except Exception as err:  # noqa: BLE001 - the linker or the file system; one line, exit 2
                raise _UsageError(f"could not write --export {args.export!r}: {_one_line(err)[-300:]}") from None
            kv = f" --kv-dtype {args.kv_dtype}" if args.kv_dtype else ""
            print(f"wrote {args.export}: the demo model ({dtype}{kv and ', ' + args.kv_dtype + ' pages'}) and the "
                  f"cache's kernels for {target}; run it with `relax-kvcache demo --target {args.target} --load "
                  f"{args.export}{kv}`", flush=True)
            return 0
    if args.load is not None:
        from .deploy import DeployError, load

        # with --target cuda, prepare (and check) the CUDA runtime and GPU before loading
        executable = load(args.load, device=tvm.cuda(0) if args.target == "cuda" else None)
        if not executable.implements_function("vm_load_executable", query_imports=True):
            raise DeployError(f"{args.load!r} holds no Relax model (no vm_load_executable: a kernel library?); "
                              "expected a library written by `relax-kvcache demo --export`")
    try:
        result = run_model_demo(target=args.target, dtype=dtype, seed=args.seed, executable=executable, log=log,
                                prefix_caching=args.prefix_caching, kv_dtype=args.kv_dtype)
    except Exception as err:  # noqa: BLE001 - a loaded model of another shape or dtype than the demo's
        if args.load is None:
            raise
        raise _UsageError(f"{args.load!r} does not run as the demo model ({dtype}): {type(err).__name__}: "
                          f"{_one_line(err)[:300]}; expected a library written by `relax-kvcache demo --export` "
                          "with the same --dtype and --kv-dtype") from None
    status = "OK" if result.ok else "FAILED"
    pages = f" over {result.kv_dtype} pages" if result.kv_dtype else ""
    print(f"demo {status}: Llama (2 layers) on {result.target} {result.dtype}{pages}: {result.requests} requests "
          f"(1 forked), {result.steps} steps, {result.prefill_tokens} prefill + {result.decode_tokens} decode "
          f"tokens, {result.tokens_per_second:,.0f} tokens/s; {result.shared_prefix_pages} prefix pages shared "
          f"by the fork, {result.rolled_back} speculative tokens rolled back; max logit error vs float64 numpy "
          f"model {result.max_rel_error:.1e} relative over {result.checked_rows} rows (tolerance "
          f"{result.tolerance:.0e}); pages all returned: {result.pages_returned}", flush=True)
    if result.prefix_hit_rate is not None:
        print(f"prefix caching: hit rate {result.prefix_hit_rate:.1%} of the prompt tokens looked up, "
              f"{result.prefix_hit_tokens} prefill tokens saved ({result.prefill_tokens} computed)", flush=True)
    return 0 if result.ok else 1


def _add_build_parser(commands: argparse._SubParsersAction) -> None:
    build = commands.add_parser(
        "build", help="compile the kernel set of a cache shape for a target into one shared library",
        description="Compile the kernels of a KV cache shape for a target into one library, e.g. "
                    "`relax-kvcache build --target cuda --arch sm_90a --num-qo-heads 32 "
                    "--num-kv-heads 8 --head-dim 128 --output kernels.so`. Load it with "
                    "relax_kvcache.deploy.load (also on a GPU host with a runtime-only TVM).")
    build.add_argument("--target", default="llvm", choices=TARGET_KINDS, help="target kind (default: llvm)")
    build.add_argument("--arch", help="device model: cuda sm_80 (default), sm_90a, ...; rocm gfx90a (default), "
                                      "gfx942, ...; llvm a CPU model (default: this machine's CPU)")
    build.add_argument("--output", "-o", required=True, help="library file to write (.so)")
    build.add_argument("--num-qo-heads", type=int, required=True, help="query/output heads")
    build.add_argument("--num-kv-heads", type=int, required=True, help="key/value heads")
    build.add_argument("--head-dim", type=int, required=True, help="features per head")
    build.add_argument("--page-size", type=int, default=16, help="tokens per page (default: 16)")
    build.add_argument("--dtype", default="float16", choices=SUPPORTED_DTYPES, help="KV dtype (default: float16)")
    build.add_argument("--kv-dtype", choices=KV_DTYPES, help="8-bit float pages (default: pages of --dtype)")
    build.add_argument("--rope-mode", default="normal", choices=list(_ROPE_MODES),
                       help="where RoPE is applied (default: normal)")
    build.add_argument("--rope-theta", type=float, default=10000.0, help="RoPE base (default: 10000)")
    build.add_argument("--rope-scale", type=float, default=1.0, help="RoPE position scale (default: 1)")
    build.add_argument("--sliding-window", action="store_true", help="per-sequence sliding windows")
    build.add_argument("--layer-window", type=int, metavar="N", help="window of MHA_SLIDING layers")
    build.add_argument("--attention-chunk", type=int, metavar="N",
                       help="chunk of MHA_CHUNKED_LOCAL layers")
    build.add_argument("--no-cache", action="store_true", help="neither read nor write the on-disk kernel cache")
    build.add_argument("--quiet", action="store_true", help="print only the summary line")


def build_config(args: argparse.Namespace) -> KVCacheConfig:
    """The cache configuration of ``relax-kvcache build`` arguments (placeholder layer and page
    counts; ``--layer-window`` / ``--attention-chunk``: one local layer, one ``MHA``)."""
    local, window = [], {}
    if args.layer_window is not None:
        local.append(AttnKind.MHA_SLIDING)
        window["layer_sliding_window_size"] = args.layer_window
    if args.attention_chunk is not None:
        local.append(AttnKind.MHA_CHUNKED_LOCAL)
        window["attention_chunk_size"] = args.attention_chunk
    kinds = (*local, AttnKind.MHA) if local else None
    return KVCacheConfig(
        num_layers=1 if kinds is None else len(kinds), num_qo_heads=args.num_qo_heads,
        num_kv_heads=args.num_kv_heads, head_dim=args.head_dim, page_size=args.page_size,
        dtype=args.dtype, kv_dtype=args.kv_dtype, rope_mode=_ROPE_MODES[args.rope_mode], rope_theta=args.rope_theta,
        rope_scale=args.rope_scale, support_sliding_window=args.sliding_window, attn_kinds=kinds,
        **window)


def _run_build(args: argparse.Namespace) -> int:
    from .build import export_kernels, kernel_set_spec
    from .targets import TargetUnavailableError, describe_target, make_target

    log = _logger(args)
    start = time.perf_counter()
    try:
        _check_output_path(args.output, "--output")
        config = build_config(args)
        target = make_target(args.target, arch=args.arch)
        path = export_kernels(config, target, args.output, use_cache=not args.no_cache, progress=log)
    except (ValueError, TypeError, NotImplementedError, OSError, TargetUnavailableError, _UsageError) as err:
        print(f"relax-kvcache build: error: {_one_line(err)}", file=sys.stderr, flush=True)
        return 2
    roles = kernel_set_spec(config).roles()
    pages = f" over {config.kv_dtype} pages" if config.kv_dtype else ""
    print(f"built {path} ({path.stat().st_size / 2**20:.2f} MiB) in {time.perf_counter() - start:.1f} s: "
          f"{len(roles)} kernels for {describe_target(target)}, {config.dtype}{pages}, "
          f"{config.num_qo_heads}/{config.num_kv_heads} heads, head_dim {config.head_dim}, "
          f"page {config.page_size}", flush=True)
    log("kernels: " + ", ".join(roles))
    return 0


if __name__ == "__main__":
    sys.exit(main())
