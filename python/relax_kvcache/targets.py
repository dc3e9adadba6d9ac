"""Compilation targets of the kernels: construction, validation and toolchain checks (a missing
capability is named before a build starts; docs/deployment.md, "Targets")."""

from __future__ import annotations

import difflib
import os
import re
import shutil
import subprocess
from typing import Any, Dict, List, Optional

import tvm
import tvm_ffi

from .host import physical_core_count

#: Target kinds relax_kvcache compiles its kernels for.
TARGET_KINDS = ("llvm", "cuda", "rocm", "metal", "webgpu", "opencl", "vulkan")
#: CUDA architecture used when ``make_target("cuda")`` is given none (Ampere, runs on newer GPUs).
DEFAULT_CUDA_ARCH = "sm_80"
#: AMD GPU used when ``make_target("rocm")`` is given none (MI200 series).
DEFAULT_ROCM_MCPU = "gfx90a"
#: Oldest ld.lld that links the AMDGPU code objects of TVM's LLVM (14 fails, 19 and 22 work).
MIN_LLD_MAJOR = 16

_CUDA_ARCH = re.compile(r"^sm_(\d{2,3})([af]?)$")
_COMPUTE_VERSION = re.compile(r"^(\d+)\.(\d+)$")
_AMDGPU_TRIPLE = "amdgcn-amd-amdhsa"

#: ``ROCM_PATH`` for Debian's ``rocm-device-libs`` (it installs ``amdgcn/bitcode`` here).
DEBIAN_ROCM_PATH = "/usr/lib/x86_64-linux-gnu"


class TargetUnavailableError(RuntimeError):
    """The installed TVM or the system toolchain cannot compile for (or run on) a target."""


def make_target(kind: str, *, arch: Optional[str] = None, **options: Any) -> tvm.target.Target:
    """A compilation target for the kernels, checked for what compiling for it needs.

    Parameters
    ----------
    kind : str
        One of :data:`TARGET_KINDS`.
    arch : str, optional
        The device model: a CUDA architecture (default :data:`DEFAULT_CUDA_ARCH`), an AMD GPU
        (default :data:`DEFAULT_ROCM_MCPU`) or, for ``llvm``, a CPU model (default: the host's).
    **options
        Further target attributes passed to TVM (e.g. ``max_shared_memory_per_block``).

    Returns
    -------
    tvm.target.Target

    Raises
    ------
    ValueError
        Unknown kind, malformed ``arch``, ``arch`` for a kind that takes none, or an option
        TVM does not know for the kind.
    TargetUnavailableError
        The installed TVM or toolchain cannot compile for it (:func:`check_can_compile`).
    """
    if not isinstance(kind, str):
        raise TypeError(f"target kind must be a str, got {type(kind).__name__}")
    if kind not in TARGET_KINDS:
        close = difflib.get_close_matches(kind, TARGET_KINDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown target kind {kind!r}{hint}; expected one of "
                         f"{', '.join(TARGET_KINDS)}")
    if arch is not None and not isinstance(arch, str):
        raise TypeError(f"arch must be a str or None, got {type(arch).__name__}")
    if kind == "llvm" and arch is None and not options:
        return host_target()
    config = _target_config(kind, arch, options)
    try:
        target = tvm.target.Target(config)
    except ValueError as err:
        raise ValueError(f"TVM rejected target {config}: {str(err).splitlines()[0]}") from None
    check_can_compile(target)
    return target


def host_target() -> tvm.target.Target:
    """The ``llvm`` target of this machine's CPU: its model (``mcpu``) and physical core count."""
    config = {"kind": "llvm", "num-cores": physical_core_count()}
    cpu = tvm.target.codegen.llvm_get_system_cpu()
    if cpu and cpu != "generic":
        config["mcpu"] = cpu
    return tvm.target.Target(config)


def _target_config(kind: str, arch: Optional[str], options: Dict[str, Any]) -> Dict[str, Any]:
    reserved = {"kind", "arch", "mcpu"} & set(options)
    if reserved:
        raise ValueError(f"pass the device model as arch=..., not as option(s) {sorted(reserved)}")
    config: Dict[str, Any] = {"kind": kind, **options}
    if kind == "cuda":
        config["arch"] = check_cuda_arch(DEFAULT_CUDA_ARCH if arch is None else arch)
    elif kind == "rocm":
        config["mcpu"] = _checked_cpu(DEFAULT_ROCM_MCPU if arch is None else arch, _AMDGPU_TRIPLE,
                                      "an AMD GPU such as 'gfx90a', 'gfx942' or 'gfx1100'")
    elif kind == "llvm" and arch is not None:
        config["mcpu"] = _checked_cpu(arch, tvm.target.codegen.llvm_get_system_triple(), "a CPU "
                                      "model such as 'znver3' or 'skylake-avx512' (llc -mcpu=help)")
    elif arch is not None:
        raise ValueError(f"target kind {kind!r} takes no arch (got {arch!r}); arch applies to "
                         "cuda (sm_XX), rocm (gfxNNN) and llvm (CPU model)")
    return config


def check_cuda_arch(arch: str) -> str:
    """``arch`` if it names a CUDA architecture (``sm_<digits>`` with optional ``a``/``f``).

    Raises
    ------
    ValueError
        ``arch`` is malformed, e.g. ``"sm80"``, ``"90a"`` or ``"compute_90"``.
    """
    if not isinstance(arch, str) or not _CUDA_ARCH.match(arch):
        raise ValueError(f"CUDA arch must look like 'sm_80', 'sm_89' or 'sm_90a', got {arch!r}")
    return arch


def cuda_arch(compute_version: str) -> str:
    """The nvcc / TVM architecture of a compute capability (``tvm.cuda(i).compute_version``):
    ``"9.0"`` -> ``"sm_90a"`` (Hopper's own features), ``"8.6"`` -> ``"sm_86"``."""
    match = _COMPUTE_VERSION.match(compute_version) if isinstance(compute_version, str) else None
    if match is None:
        raise ValueError("CUDA compute version must look like '8.0' or '9.0', got "
                         f"{compute_version!r}")
    major, minor = match.groups()
    return "sm_90a" if (major, minor) == ("9", "0") else f"sm_{major}{minor}"


def describe_target(target: tvm.target.Target) -> str:
    """A short name of a target: its kind and device model, e.g. ``"cuda sm_90a"``."""
    attrs = target.attrs
    model = next((str(attrs[key]) for key in ("arch", "mcpu") if key in attrs), "")
    return f"{target.kind.name} {model}".strip()


def _checked_cpu(mcpu: str, triple: str, expected: str) -> str:
    if not mcpu or not tvm.target.codegen.llvm_is_valid_cpu(mcpu, triple):
        raise ValueError(f"{mcpu!r} is not a CPU LLVM knows for {triple}; expected {expected}")
    return mcpu


def check_can_compile(target: tvm.target.Target) -> None:
    """Raise :class:`TargetUnavailableError` unless this process can compile for ``target``: TVM
    has its code generator (the 0.27 wheel has none for Vulkan) and, for ROCm,
    :func:`check_rocm_toolchain` passes."""
    kind = target.kind.name
    if kind not in TARGET_KINDS:
        raise ValueError(f"relax_kvcache compiles for target kinds {', '.join(TARGET_KINDS)}; "
                         f"got {kind!r}")
    if tvm_ffi.get_global_func(f"target.build.{kind}", allow_missing=True) is None:
        raise TargetUnavailableError(
            "TVM built without SPIR-V code generation (USE_VULKAN): the installed TVM "
            f"{tvm.__version__} has no 'target.build.vulkan'. Build TVM from source with "
            "USE_VULKAN=ON (needs the Vulkan SDK / SPIRV-Tools) to compile for Vulkan, or use "
            "another target kind." if kind == "vulkan" else
            f"the installed TVM {tvm.__version__} has no code generator for target kind {kind!r} "
            f"(global function 'target.build.{kind}' is missing; runtime-only TVM compiles "
            "nothing)")
    if kind == "rocm":
        check_rocm_toolchain()


def check_rocm_toolchain() -> Dict[str, str]:
    """What building for ROCm needs besides TVM: ``{"ld.lld": path, "bitcode": folder}`` (the
    device libraries; on Debian ``ROCM_PATH`` = :data:`DEBIAN_ROCM_PATH`).

    Raises
    ------
    TargetUnavailableError
        No AMDGPU backend in TVM's LLVM, no (or too old an) ``ld.lld``, or no device libraries.
    """
    if "amdgcn" not in tvm.target.codegen.llvm_get_targets():
        raise TargetUnavailableError(
            "TVM's LLVM was built without the AMDGPU backend (no 'amdgcn' in "
            "tvm.target.codegen.llvm_get_targets()); cannot compile for ROCm")
    return {"ld.lld": _find_lld(), "bitcode": _find_rocm_bitcode()}


def _lld_candidates() -> List[str]:
    """The linkers TVM's ``tvm_callback_rocm_link`` tries, in its order."""
    major = tvm.target.codegen.llvm_version_major(allow_none=True)
    names = ([f"ld.lld-{major}.0", f"ld.lld-{major}"] if major is not None else []) + ["ld.lld"]
    return names + [f"/opt/rocm/llvm/bin/{name}" for name in names]


def _find_lld() -> str:
    candidates = _lld_candidates()
    major = tvm.target.codegen.llvm_version_major(allow_none=True)
    package = f"lld-{major}" if major is not None else "lld"  # the version of TVM's LLVM
    found = [path for path in map(shutil.which, candidates) if path]
    if not found:
        raise TargetUnavailableError(
            f"building for ROCm needs the LLVM linker ld.lld, which is not installed (tried "
            f"{', '.join(candidates)} on PATH={os.environ.get('PATH', '')}); install Debian's "
            f"'lld' package, best the version of TVM's LLVM ('apt-get install {package}')")
    major = _lld_major(found[0])
    if major is not None and major < MIN_LLD_MAJOR:
        raise TargetUnavailableError(
            f"{found[0]} is LLD {major}, too old for the AMDGPU code objects of TVM's LLVM "
            f"(needs LLD >= {MIN_LLD_MAJOR}); install '{package}'")
    return found[0]


def _lld_major(path: str) -> Optional[int]:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"LLD (\d+)\.", out)
    return int(match.group(1)) if match else None


def _find_rocm_bitcode() -> str:
    """The folder of the ROCm device libraries, found as TVM finds it (its ``find_rocm_path`` and
    ``tvm_callback_rocm_bitcode_path``)."""
    hipcc = shutil.which("hipcc")
    root = (os.environ["ROCM_PATH"] if "ROCM_PATH" in os.environ else
            os.path.realpath(os.path.join(hipcc, "..", "..")) if hipcc else
            "/opt/rocm" if os.path.exists("/opt/rocm/bin/hipcc") else None)
    folder = None
    if root is not None:
        folder = os.path.join(root, "amdgcn", "bitcode")
        folder = folder if os.path.exists(folder) else "/opt/rocm/lib"
        if os.path.isfile(os.path.join(folder, "ocml.bc")):
            return folder
    where = f"ROCM_PATH={root}" if root is not None else "no ROCm found (ROCM_PATH unset, no hipcc)"
    hint = ""
    if os.path.isfile(os.path.join(DEBIAN_ROCM_PATH, "amdgcn", "bitcode", "ocml.bc")):
        hint = f" Debian's rocm-device-libs is installed here: set ROCM_PATH={DEBIAN_ROCM_PATH}."
    raise TargetUnavailableError(
        "building for ROCm needs the ROCm device libraries (ocml.bc, ockl.bc, ...); "
        f"{where}{'' if folder is None else f', looked in {folder}'}. Install ROCm, or Debian's "
        f"'rocm-device-libs' and set ROCM_PATH to the folder that holds amdgcn/bitcode.{hint}")
