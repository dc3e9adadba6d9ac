"""Load exported kernel libraries, also on a GPU host where only TVM's runtime is installed
(docs/deployment.md, "What deploy.load does"). Imports no compiler part of TVM."""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import importlib.util
import mmap
import os
import pathlib
import shutil
import subprocess
import tempfile
from typing import Any, List, Optional, Union

import tvm
import tvm_ffi

from .errors import DeployError
from .kernel_cache import (cache_dir, checksum_path, file_sha256, verify_checksum, write_atomic,
                           write_checksum)
from .targets import check_cuda_arch, cuda_arch

__all__ = ["CUDA_COMPILE_CALLBACK", "CUDA_RUNTIME_LIB", "DeployError", "checksum_path",
           "cuda_runtime_registered", "fatbin_cache_path", "file_sha256", "find_nvcc",
           "install_cuda_compile_callback", "library_holds_cuda", "load", "load_cuda_runtime",
           "nvcc_compile", "prepare_cuda", "verify_checksum", "write_checksum"]

#: File name of TVM's CUDA runtime library (device API, CUDA module loader).
CUDA_RUNTIME_LIB = "libtvm_runtime_cuda.so"

#: Name of the global function TVM calls to compile CUDA source when loading a module.
CUDA_COMPILE_CALLBACK = "tvm_callback_cuda_compile"

# Serialized kind of a CUDA module inside an exported library: a uint64 length, then "cuda".
_CUDA_MODULE_MARK = (4).to_bytes(8, "little") + b"cuda"
_NVCC_FALLBACK_DIRS = ("/usr/local/cuda/bin",)  # searched after PATH, CUDA_HOME and CUDA_PATH


@dataclasses.dataclass
class _CallbackState:  # our compile callback: registered?, its arch, its last error (re-raised)
    installed: bool = False
    arch: Optional[str] = None
    error: Optional[DeployError] = None


_CALLBACK = _CallbackState()
_LOADED_LIBRARIES: List[ctypes.CDLL] = []  # keep ctypes handles (and so the libraries) alive


def load(path: Union[str, "os.PathLike[str]"], *,
         device: Optional[tvm.runtime.Device] = None) -> tvm.runtime.Module:
    """Load a library written by ``relax-kvcache build`` or :func:`~relax_kvcache.export_kernels`
    (through a private copy: a library rebuilt under the same path is loaded anew).

    Parameters
    ----------
    path : path-like
        The library (``.so``).
    device : tvm.runtime.Device, optional
        The device to run on; a CUDA one (or None and a library holding CUDA code) is prepared
        first (:func:`prepare_cuda`).

    Returns
    -------
    tvm.runtime.Module
        The kernels, by role (:data:`relax_kvcache.build.KERNEL_ROLES`); pass it to
        :meth:`relax_kvcache.KernelSet.from_module`.

    Raises
    ------
    FileNotFoundError
        ``path`` is not a file.
    DeployError
        The library differs from its checksum file (``<path>.sha256``, :func:`write_checksum`;
        none: loaded unchecked), the dynamic loader refuses it, or the CUDA runtime, the GPU or
        nvcc is missing, or nvcc failed.
    """
    library = _checked_library(path)
    if device is not None and not isinstance(device, tvm.runtime.Device):
        raise TypeError(f"device must be a tvm.runtime.Device or None, got {type(device).__name__}")
    with tempfile.TemporaryDirectory(prefix="relax_kvcache_load_") as tmp:
        copy = pathlib.Path(tmp) / library.name
        try:
            shutil.copyfile(library, copy)
        except OSError as err:
            raise DeployError(f"could not read {str(library)!r} ({err}); expected a readable .so "
                              "file") from None
        verify_checksum(library, copy=copy)  # before this process maps it
        if device is None and library_holds_cuda(copy):
            device = tvm.cuda(0)
        if device is not None and device.dlpack_device_type() == tvm.cuda().dlpack_device_type():
            prepare_cuda(device)
        _CALLBACK.error = None
        try:
            return tvm.runtime.load_module(str(copy))
        except Exception as err:  # our callback's error: re-raised (TVM makes it a RuntimeError)
            error, _CALLBACK.error = _CALLBACK.error, None
            if error is not None:
                raise error from None
            reason = (str(err).strip().splitlines() or [type(err).__name__])[-1]
            raise DeployError(f"could not load {str(library)!r}: {reason}; expected a shared "
                              "library written by `relax-kvcache build` / export_kernels (or a "
                              "model's export_library)") from err


def _checked_library(path: Union[str, "os.PathLike[str]"]) -> pathlib.Path:
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"path must be a str or path-like, got {type(path).__name__}")
    if not os.fsdecode(path).strip():
        raise FileNotFoundError(f"kernel library path {str(path)!r} is empty; expected a .so file")
    try:
        library = pathlib.Path(os.fsdecode(path)).expanduser()
        if library.is_file():
            return library
        what = ("is a folder" if library.is_dir() else
                "is not a regular file (a device, a pipe or a socket)" if library.exists() else
                "is a broken symbolic link (or a loop)" if library.is_symlink() else
                "does not exist")
    except (RuntimeError, OSError, ValueError) as err:  # ~unknown_user, a name too long, a NUL byte
        raise FileNotFoundError(f"kernel library {str(path)!r} cannot be opened ({err}); expected "
                                "a .so file") from None
    raise FileNotFoundError(f"kernel library {str(path)!r} {what}; expected a .so file written by "
                            "`relax-kvcache build --output FILE.so` or relax_kvcache.build.export_kernels")


def library_holds_cuda(path: Union[str, "os.PathLike[str]"]) -> bool:
    """Whether an exported library embeds a CUDA module (a look for its serialized kind)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return False
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return data.find(_CUDA_MODULE_MARK) >= 0


def prepare_cuda(device: Optional[tvm.runtime.Device] = None) -> str:
    """Make CUDA modules loadable here (:func:`load_cuda_runtime`, a check that ``device``,
    default ``tvm.cuda(0)``, exists, :func:`install_cuda_compile_callback` for its arch); return
    the arch."""
    device = tvm.cuda(0) if device is None else device
    load_cuda_runtime()
    if not device.exist:
        raise DeployError(
            f"{device} is not available: TVM's CUDA runtime is loaded but finds no such GPU "
            "(is the NVIDIA driver, libcuda.so.1, installed and the device visible? "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})")
    arch = cuda_arch(device.compute_version)
    install_cuda_compile_callback(arch=arch)
    return arch


def cuda_runtime_registered() -> bool:
    """Whether TVM's CUDA device API is registered in this process."""
    return tvm_ffi.get_global_func("device_api.cuda", allow_missing=True) is not None


def load_cuda_runtime() -> Optional[pathlib.Path]:
    """Load TVM's CUDA runtime library unless its device API is already registered (a
    runtime-only ``import tvm`` does not load it).

    Returns
    -------
    pathlib.Path or None
        The library loaded, or None when the CUDA runtime was already there.
    """
    if cuda_runtime_registered():
        return None
    folders = _cuda_runtime_folders()
    path = next((f / CUDA_RUNTIME_LIB for f in folders if (f / CUDA_RUNTIME_LIB).is_file()), None)
    if path is None:
        raise DeployError(
            f"TVM's CUDA runtime {CUDA_RUNTIME_LIB} not found; looked in "
            f"{', '.join(map(str, folders))}. Install a TVM package built with CUDA, or set "
            "TVM_LIBRARY_PATH to the folder that holds it.")
    try:
        _LOADED_LIBRARIES.append(ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL))
    except OSError as err:
        raise DeployError(
            f"could not load {path}: {err}. It needs the CUDA runtime (libcudart.so.13) and the "
            f"NVIDIA driver (libcuda.so.1) on the library path; LD_LIBRARY_PATH="
            f"{os.environ.get('LD_LIBRARY_PATH', '<unset>')}") from err
    if not cuda_runtime_registered():
        raise DeployError(f"loaded {path}, but it registered no CUDA device API "
                          "('device_api.cuda')")
    return path


def _cuda_runtime_folders() -> List[pathlib.Path]:
    """TVM_LIBRARY_PATH, the folder of libtvm_runtime, TVM's package."""
    folders = [pathlib.Path(p) for p in os.environ.get("TVM_LIBRARY_PATH", "").split(os.pathsep)
               if p]
    runtime = getattr(tvm.base, "_LOADED_LIBS", {}).get("tvm_runtime")
    if runtime is not None and getattr(runtime, "_name", None):
        folders.append(pathlib.Path(runtime._name).resolve().parent)
    package = pathlib.Path(tvm.__file__).resolve().parent
    folders += [package / "lib", package]
    return list(dict.fromkeys(folders))


def install_cuda_compile_callback(*, arch: Optional[str] = None, force: bool = False) -> bool:
    """Register our nvcc-based ``tvm_callback_cuda_compile`` (:func:`nvcc_compile`) unless TVM's
    own one can work (it needs TVM's compiler and, in NVRTC mode, ``cuda-python``).

    Parameters
    ----------
    arch : str, optional
        CUDA architecture to compile for (``"sm_90a"``); default: that of ``tvm.cuda(0)``,
        looked up when the callback runs.
    force : bool
        Register ours even where TVM's callback would work.

    Returns
    -------
    bool
        Whether ours is the registered callback now.
    """
    if arch is not None:
        check_cuda_arch(arch)
    if not (force or _CALLBACK.installed or not _tvm_callback_usable()):
        return False
    tvm_ffi.register_global_func(CUDA_COMPILE_CALLBACK, _compile_callback, override=True)
    _CALLBACK.installed, _CALLBACK.arch = True, arch
    return True


def _tvm_callback_usable() -> bool:
    if tvm_ffi.get_global_func(CUDA_COMPILE_CALLBACK, allow_missing=True) is None or getattr(
            tvm.base, "_RUNTIME_ONLY", False):
        return False
    mode = os.environ.get("TVM_CUDA_COMPILE_MODE", "nvrtc").lower()
    return (mode == "nvcc" and shutil.which("nvcc") is not None
            or mode == "nvrtc" and _module_exists("cuda.bindings.nvrtc"))


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a parent package is missing
        return False


def _compile_callback(code: str, *_ignored: Any) -> bytes:
    """``tvm_callback_cuda_compile``: CUDA source -> fatbin for our arch (or the GPU's)."""
    try:
        arch = _CALLBACK.arch or cuda_arch(tvm.cuda(0).compute_version)
        return nvcc_compile(str(code), arch=arch)
    except DeployError as err:
        _CALLBACK.error = err
        raise


def nvcc_compile(code: str, *, arch: str, use_cache: bool = True) -> bytes:
    """Compile CUDA source to a fatbin with ``nvcc --fatbin -O3``, cached on disk
    (:func:`fatbin_cache_path`; clear it after changing the CUDA toolkit).

    Parameters
    ----------
    code : str
        CUDA C++ source, as TVM's CUDA code generator writes it.
    arch : str
        Architecture, e.g. ``"sm_90a"`` (see :func:`relax_kvcache.targets.cuda_arch`).
    use_cache : bool
        Read and write the fatbin cache (default True).

    Raises
    ------
    DeployError
        ``nvcc`` is not found, or it failed (the message ends with its stderr).
    """
    if not isinstance(code, str):
        raise TypeError(f"code must be a str of CUDA source, got {type(code).__name__}")
    check_cuda_arch(arch)
    cached = fatbin_cache_path(code, arch=arch)
    if use_cache and cached.is_file():
        return cached.read_bytes()
    nvcc = find_nvcc()
    with tempfile.TemporaryDirectory(prefix="relax_kvcache_nvcc_") as tmp:
        source, output = os.path.join(tmp, "kernels.cu"), os.path.join(tmp, "kernels.fatbin")
        pathlib.Path(source).write_text(code)
        # -gencode, not -arch: with -arch=sm_90a nvcc 13.0 also assembles compute_90 PTX, which
        # rejects sm_90a-only instructions (wgmma)
        cc = arch.removeprefix("sm_")
        cmd = [nvcc, "--fatbin", "-O3", "-w", f"-gencode=arch=compute_{cc},code=sm_{cc}",
               "-o", output, source]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            log = proc.stderr or proc.stdout or ""
            first = next((line.strip() for line in log.splitlines() if "error" in line), "")
            raise DeployError(f"nvcc failed (exit {proc.returncode}) compiling CUDA source for "
                              f"{arch}: {' '.join(cmd)}\nfirst error: {first}\n"
                              f"--- stderr (tail) ---\n{log[-4000:]}")
        fatbin = pathlib.Path(output).read_bytes()
    if use_cache:
        write_atomic(cached, fatbin)
    return fatbin


def fatbin_cache_path(code: str, *, arch: str) -> pathlib.Path:
    """Where :func:`nvcc_compile` caches the fatbin of ``code`` for ``arch`` (in
    :func:`relax_kvcache.kernel_cache.cache_dir`)."""
    key = hashlib.sha256(f"{arch}\n{code}".encode()).hexdigest()
    return cache_dir() / "cuda-fatbin" / f"{key}.fatbin"


def find_nvcc() -> str:
    """Path of ``nvcc``: on PATH, else in ``$CUDA_HOME/bin``, ``$CUDA_PATH/bin``,
    ``/usr/local/cuda/bin``."""
    found = shutil.which("nvcc")
    if found:
        return found
    folders = [os.path.join(os.environ[var], "bin") for var in ("CUDA_HOME", "CUDA_PATH")
               if os.environ.get(var)] + list(_NVCC_FALLBACK_DIRS)
    for folder in folders:
        candidate = os.path.join(folder, "nvcc")
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise DeployError(
        f"nvcc not found: searched PATH={os.environ.get('PATH', '')} and {', '.join(folders)}. "
        "Loading a CUDA kernel library built elsewhere compiles its CUDA source here: install the "
        "CUDA toolkit or put nvcc on PATH.")

