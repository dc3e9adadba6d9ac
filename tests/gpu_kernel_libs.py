"""Kernel libraries of ``test_kernels.py``'s configs for running those tests on a GPU host.

On the development machine: ``python tests/gpu_kernel_libs.py DIR [--arch sm_90a]`` compiles the
CUDA kernel set of every config in ``test_kernels.CONFIGS`` (and the RoPE variants, and
``test_prefill_tiles.TILE_CONFIGS``) into ``DIR`` (plus nvcc fatbins in
``DIR/cache``). On the GPU host (runtime-only TVM)::

    RELAX_KVCACHE_CACHE_DIR=DIR/cache RELAX_KVCACHE_TEST_LIBS=DIR RELAX_KVCACHE_TEST_DEVICE=cuda \\
        python -m pytest tests/test_kernels.py

runs the kernel tests there against the same numpy references as on CPU (and
``tests/test_mla_kernels.py``'s MLA kernels, from ``kt-mla-<dtype>.so``, and
``tests/test_mla_cache.py``'s and ``tests/test_fp8_mla.py``'s float16 kernel sets).
"""

from __future__ import annotations

import argparse
import hashlib
import pathlib
import sys

import tvm


def _file(config, directory) -> pathlib.Path:
    return pathlib.Path(directory) / f"kt-{hashlib.sha256(repr(config).encode()).hexdigest()[:16]}.so"


def _load(path: pathlib.Path, what: str, directory) -> tvm.runtime.Module:
    from relax_kvcache import deploy

    if not path.exists():
        raise FileNotFoundError(f"no prepared {what} at {path}; run "
                                f"python tests/gpu_kernel_libs.py {directory} on the development machine")
    return deploy.load(str(path))


def load(config, directory) -> tvm.runtime.Module:
    """The prepared library of ``config`` (``relax_kvcache.deploy.load``)."""
    return _load(_file(config, directory), f"kernel library for {config}", directory)


def _mla_file(dtype, directory) -> pathlib.Path:
    return pathlib.Path(directory) / f"kt-mla-{dtype}.so"


def load_mla(dtype, directory) -> tvm.runtime.Module:
    """The prepared library of ``test_mla_kernels``' page kernels for ``dtype``."""
    return _load(_mla_file(dtype, directory), "MLA kernel library", directory)


def mla_has_attention(dtype) -> bool:
    """Whether ``kt-mla-<dtype>.so`` holds the attention kernel (GPU MLA attention needs tensor
    cores: 16-bit dtypes)."""
    return dtype != "float32"


def mla_cache_config():
    """``test_mla_cache``'s configuration as it is on a GPU host (float16)."""
    from support.mla_kernel_cases import cache_config

    return cache_config("float16")


def mla_fp8_cache_configs():
    """``test_fp8_mla``'s configurations as they are on a GPU host (float16, each 8-bit format)."""
    from support.mla_kernel_cases import FP8_FORMATS, fp8_cache_config

    return [fp8_cache_config("float16", fmt) for fmt in FP8_FORMATS]


def _export(executable, path: pathlib.Path, arch: str) -> None:
    """Write ``executable`` to ``path`` and compile its CUDA source with nvcc into the cache."""
    from relax_kvcache import deploy

    executable.export_library(str(path))
    mod = executable.mod
    deploy.nvcc_compile(next(m.inspect_source() for m in [mod, *mod.imports] if m.kind == "cuda"), arch=arch)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--only-mla", action="store_true", help="build only the MLA libraries")
    parser.add_argument("--only-rope", action="store_true",
                        help="build only the LongRoPE and partial-rotary libraries")
    parser.add_argument("--only-tiles", action="store_true", help="build only test_prefill_tiles' libraries")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import os

    os.environ.setdefault("RELAX_KVCACHE_CACHE_DIR", str(pathlib.Path(args.directory) / "cache"))
    from relax_kvcache import build, launch
    from relax_kvcache.targets import make_target
    from support.kernel_cases import CONFIGS, LONGROPE_CONFIGS, ROTARY_CONFIGS, TILE_CONFIGS

    target = make_target("cuda", arch=args.arch)
    pathlib.Path(args.directory).mkdir(parents=True, exist_ok=True)
    rope_variants = {**LONGROPE_CONFIGS, **ROTARY_CONFIGS}
    configs = ({} if args.only_mla else rope_variants if args.only_rope else TILE_CONFIGS if args.only_tiles
               else {**CONFIGS, **TILE_CONFIGS, **rope_variants})
    for name, config in configs.items():
        _export(build._compile(build.KernelSetSpec.from_config(config), target, None, build.kernel_identity(config)),
                _file(config, args.directory), args.arch)
        print(f"{name}: {_file(config, args.directory)}", flush=True)
    if args.only_rope or args.only_tiles:
        return 0
    from relax_kvcache.tir_kernels import schedule_for
    from support import mla_kernel_cases as mla

    for dtype in mla.DTYPES:
        funcs = mla.kernel_funcs(dtype, schedule_for(target), attention=mla_has_attention(dtype))
        with tvm.transform.PassContext(opt_level=3, config=build._pass_config(target)):
            executable = tvm.compile(tvm.IRModule(funcs), target=target, tir_pipeline=launch.register())
        _export(executable, _mla_file(dtype, args.directory), args.arch)
        print(f"mla {dtype}: {_mla_file(dtype, args.directory)}", flush=True)
    for config in (mla_cache_config(), *mla_fp8_cache_configs()):
        _export(build._compile(build.kernel_set_spec(config), target, None, build.kernel_identity(config)),
                _file(config, args.directory), args.arch)
        print(f"mla cache ({config.kv_dtype or config.dtype} pages): {_file(config, args.directory)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
