"""Compile the kernel set of a cache configuration for a target (one IRModule, functions named
by role), with an on-disk cache (:mod:`relax_kvcache.kernel_cache`; docs/deployment.md). The
kernel factories (TVMScript) are imported only to compile: a runtime-only TVM can import this."""

from __future__ import annotations

import os
import pathlib
from typing import TYPE_CHECKING, Callable, Dict, Optional, Union

import tvm

from . import launch
from .config import KVCacheConfig
from .kernel_cache import (LIBRARY_FORMAT, build_key, cache_dir, cache_path, cached_intact,
                           copy_atomic, export_atomic)
from .kernel_roles import (IDENTITY_FIELDS, IDENTITY_PREFIX, KERNEL_ROLES, MLA_KERNEL_ROLES,
                           kernel_identity)
from .kernel_specs import AnyKernelSetSpec, KernelSetSpec, MLAKernelSetSpec, kernel_set_spec
from .targets import check_can_compile, describe_target

if TYPE_CHECKING:  # TVMScript, which a runtime-only TVM lacks
    from tvm import tirx
    from tvm.runtime.executable import Executable

__all__ = [
    "IDENTITY_FIELDS", "IDENTITY_PREFIX", "KERNEL_ROLES", "LIBRARY_FORMAT", "MLA_KERNEL_ROLES",
    "AnyKernelSetSpec", "KernelSetSpec", "MLAKernelSetSpec", "Progress", "build_kernels",
    "build_key", "cache_dir", "cache_path", "can_load_here", "export_kernels", "kernel_identity",
    "kernel_set_spec",
]

Progress = Optional[Callable[[str], None]]


def build_kernels(config: KVCacheConfig, target: tvm.target.Target, *, use_cache: bool = True,
                  progress: Progress = None) -> tvm.runtime.Module:
    """Compile (or load from the on-disk cache) the kernel set for ``config`` and ``target``.

    Parameters
    ----------
    config : KVCacheConfig
        The cache configuration; only the fields in :class:`KernelSetSpec` matter.
    target : tvm.target.Target
        Compilation target (see :func:`relax_kvcache.make_target`).
    use_cache : bool
        Read and write the on-disk cache (default True).
    progress : callable, optional
        Called with a one-line message before compiling or loading.

    Returns
    -------
    tvm.runtime.Module
        Functions named by :data:`KERNEL_ROLES` (for a GPU whose device this process lacks:
        exportable, not callable here).

    Raises
    ------
    relax_kvcache.targets.TargetUnavailableError
        TVM or the toolchain cannot compile for ``target`` (e.g. Vulkan without SPIR-V codegen).
    """
    spec = _checked_spec(config, target)
    loadable = can_load_here(target)
    if not use_cache:
        executable = _compile(spec, target, progress, kernel_identity(config))
        return executable.jit() if loadable else executable.mod
    path = cache_path(spec, target)
    cached = cached_intact(path)  # hashed once
    if loadable and cached:
        _report(progress, f"loading cached kernels {path.name}")
        return tvm.runtime.load_module(str(path))
    executable = _compile(spec, target, progress, kernel_identity(config))
    if not cached:
        export_atomic(executable, path)
    return tvm.runtime.load_module(str(path)) if loadable else executable.mod


def export_kernels(config: KVCacheConfig, target: tvm.target.Target,
                   path: Union[str, "os.PathLike[str]"], *, use_cache: bool = True,
                   progress: Progress = None) -> pathlib.Path:
    """Write the kernel set for ``config`` and ``target`` to one shared library at ``path``
    (copied from the on-disk cache, else compiled and cached; no device needed).

    Parameters
    ----------
    config, target, use_cache, progress
        As in :func:`build_kernels`.
    path : path-like
        Library file to write, ending in ``.so``, in an existing folder; replaced atomically,
        with its SHA-256 beside it (``<path>.sha256``, checked by ``deploy.load``).

    Returns
    -------
    pathlib.Path
        ``path``, absolute.
    """
    dest = _checked_output(path)
    spec = _checked_spec(config, target)
    if not use_cache:
        export_atomic(_compile(spec, target, progress, kernel_identity(config)), dest)
        return dest
    cached = cache_path(spec, target)
    if cached_intact(cached):
        _report(progress, f"copying cached kernels {cached.name}")
    else:
        export_atomic(_compile(spec, target, progress, kernel_identity(config)), cached)
    copy_atomic(cached, dest)
    return dest


def can_load_here(target: tvm.target.Target) -> bool:
    """Whether a library compiled for ``target`` can be loaded (and run) in this process (CPU
    libraries always, GPU ones where the device exists)."""
    kind = target.kind.name
    if kind == "llvm":
        return True
    try:
        return bool(tvm.device(kind, 0).exist)
    except (ValueError, RuntimeError):  # a device type this TVM does not know
        return False


def _checked_spec(config: KVCacheConfig, target: tvm.target.Target) -> AnyKernelSetSpec:
    if not isinstance(config, KVCacheConfig):
        raise TypeError(f"config must be a KVCacheConfig, got {type(config).__name__}")
    if not isinstance(target, tvm.target.Target):
        raise TypeError(f"target must be a tvm.target.Target, got {type(target).__name__}")
    return kernel_set_spec(config)


def _checked_output(path: Union[str, "os.PathLike[str]"]) -> pathlib.Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or path-like, got {type(path).__name__}")
    dest = pathlib.Path(path).expanduser().absolute()
    if dest.suffix != ".so":
        raise ValueError(f"kernel library path must end in '.so', got {str(path)!r}")
    if not dest.parent.is_dir():
        raise FileNotFoundError(f"folder of kernel library path {str(path)!r} does not exist: "
                                f"{dest.parent}")
    if dest.is_dir():
        raise IsADirectoryError(f"kernel library path {str(path)!r} is a folder")
    return dest


def _report(progress: Progress, message: str) -> None:
    if progress:
        progress(message)


def _identity_functions(identity: Dict[str, float]) -> Dict[str, tirx.PrimFunc]:
    """``kernel_spec_<field>() -> int64 / float64`` for each field of :func:`kernel_identity`."""
    from tvm.script import tirx as T

    def constant(value):
        if isinstance(value, float):
            @T.prim_func(private=True, s_tir=True)
            def field() -> T.float64:
                return T.float64(value)
        else:
            @T.prim_func(private=True, s_tir=True)
            def field() -> T.int64:
                return T.int64(value)
        return field

    return {IDENTITY_PREFIX + name: constant(value) for name, value in identity.items()}


def _compile(spec: AnyKernelSetSpec, target: tvm.target.Target, progress: Progress,
             identity: Dict[str, float]) -> Executable:
    from . import tir_kernels as tk

    check_can_compile(target)
    _report(progress, f"compiling kernels for {describe_target(target)} ({spec.attention.dtype}, "
                      f"{spec.attention.num_qo_heads}/{spec.attention.num_kv_heads} heads, "
                      f"head_dim {spec.attention.qk_head_dim})")
    funcs = spec.kernel_functions(tk.schedule_for(target))
    funcs.update(_identity_functions(identity))
    mod = tvm.IRModule({role: f.with_attr("global_symbol", role) for role, f in funcs.items()})
    with tvm.transform.PassContext(opt_level=3, config=_pass_config(target)):
        return tvm.compile(mod, target=target, tir_pipeline=launch.register())


def _pass_config(target: tvm.target.Target) -> Dict[str, object]:
    """No TIR CSE for GPU kernels: it hides thread-local reads from TVM's barrier planner, which
    then wants barriers inside conditions (docs/kernels.md)."""
    from .tir_kernels.schedule import GPU_TARGET_KINDS

    return {"tirx.disable_cse_tir": True} if target.kind.name in GPU_TARGET_KINDS else {}
