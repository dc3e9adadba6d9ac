"""Load exported kernel libraries, also on a GPU host where only TVM's runtime is installed.

A CUDA library built without a GPU holds CUDA C++ source. Loading it needs TVM's CUDA runtime
(``libtvm_runtime_cuda.so``, not loaded by a runtime-only ``import tvm``) and a
``tvm_callback_cuda_compile`` (TVM's needs its compiler library): :func:`load` loads the former
where it is missing and, where TVM's callback cannot work, registers one that runs ``nvcc`` and
caches the fatbin on disk. Imports no compiler part of TVM.
"""

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
from .kernel_cache import cache_dir, checksum_path, file_sha256, verify_checksum, write_atomic, write_checksum
from .targets import check_cuda_arch, cuda_arch

__all__ = ["CUDA_COMPILE_CALLBACK", "CUDA_RUNTIME_LIB", "DeployError", "checksum_path", "cuda_runtime_registered",
           "fatbin_cache_path", "file_sha256", "find_nvcc", "install_cuda_compile_callback", "library_holds_cuda",
           "load", "load_cuda_runtime", "nvcc_compile", "prepare_cuda", "verify_checksum", "write_checksum"]

#: File name of TVM's CUDA runtime library (device API, CUDA module loader).
CUDA_RUNTIME_LIB = "libtvm_runtime_cuda.so"

#: Name of the global function TVM calls to compile CUDA source when loading a module.
CUDA_COMPILE_CALLBACK = "tvm_callback_cuda_compile"

# Serialized kind of a CUDA module inside an exported library: a uint64 length, then "cuda".
_CUDA_MODULE_MARK = (4).to_bytes(8, "little") + b"cuda"
#: Folders searched for nvcc after PATH, $CUDA_HOME/bin and $CUDA_PATH/bin.
_NVCC_FALLBACK_DIRS = ("/usr/local/cuda/bin",)


@dataclasses.dataclass
class _CallbackState:
    """Our CUDA compile callback: registered?, its arch, and its last error (:func:`load` re-raises it)."""

    installed: bool = False
    arch: Optional[str] = None
    error: Optional[DeployError] = None


_CALLBACK = _CallbackState()
_LOADED_LIBRARIES: List[ctypes.CDLL] = []  # keep ctypes handles (and so the libraries) alive


def load(path: Union[str, "os.PathLike[str]"], *, device: Optional[tvm.runtime.Device] = None) -> tvm.runtime.Module:
    """Load a kernel library written by ``relax-kvcache build`` or :func:`~relax_kvcache.build.export_kernels`.

    Parameters
    ----------
    path : path-like
        The library (``.so``).
    device : tvm.runtime.Device, optional
        The device the kernels will run on. With a CUDA device (or, when None, a library that
        holds CUDA code) the CUDA runtime and compile callback are prepared first
        (:func:`prepare_cuda`), for that device's architecture.

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
        The library's bytes differ from the SHA-256 in its checksum file beside it
        (``<path>.sha256``, :func:`write_checksum`; a library without one is loaded unchecked),
        the dynamic loader refuses it, or the CUDA runtime library, the GPU, or nvcc is missing,
        or nvcc failed.

    The file is copied to a private temporary folder first, and the copy is what is checked and
    loaded: a library rebuilt under the same path is loaded anew (the dynamic loader keeps the
    first library it loaded under a path).
    """
    library = _checked_library(path)
    if device is not None and not isinstance(device, tvm.runtime.Device):
        raise TypeError(f"device must be a tvm.runtime.Device or None, got {type(device).__name__}")
    with tempfile.TemporaryDirectory(prefix="relax_kvcache_load_") as tmp:
        copy = pathlib.Path(tmp) / library.name
        try:
            shutil.copyfile(library, copy)
        except OSError as err:
            raise DeployError(f"could not read {str(library)!r} ({err}); expected a readable .so file") from None
        verify_checksum(library, copy=copy)  # before this process maps it
        if device is None and library_holds_cuda(copy):
            device = tvm.cuda(0)
        if device is not None and device.dlpack_device_type() == tvm.cuda().dlpack_device_type():
            prepare_cuda(device)
        return _load_module(copy, shown=library)


def _load_module(library: pathlib.Path, shown: pathlib.Path) -> tvm.runtime.Module:
    """``tvm.runtime.load_module``, re-raising our callback's error (TVM makes it a RuntimeError)."""
    _CALLBACK.error = None
    try:
        return tvm.runtime.load_module(str(library))
    except Exception as err:
        error, _CALLBACK.error = _CALLBACK.error, None
        if error is not None:
            raise error from None
        reason = (str(err).strip().splitlines() or [type(err).__name__])[-1]
        raise DeployError(f"could not load {str(shown)!r}: {reason}; expected a shared library written by "
                          "`relax-kvcache build` / export_kernels (or a model's export_library)") from err


def _checked_library(path: Union[str, "os.PathLike[str]"]) -> pathlib.Path:
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"path must be a str or path-like, got {type(path).__name__}")
    if not os.fsdecode(path).strip():
        raise FileNotFoundError(f"kernel library path {str(path)!r} is empty; expected a .so file")
    try:
        library = pathlib.Path(os.fsdecode(path)).expanduser()
        is_file = library.is_file()
        what = "is a folder" if library.is_dir() else _not_a_file(library)
    except (RuntimeError, OSError, ValueError) as err:  # ~unknown_user, a name too long, a NUL byte
        raise FileNotFoundError(f"kernel library {str(path)!r} cannot be opened ({err}); expected a .so file") from None
    if not is_file:
        raise FileNotFoundError(
            f"kernel library {str(path)!r} {what}; expected a .so file written by "
            "`relax-kvcache build --output FILE.so` or relax_kvcache.build.export_kernels")
    return library


def _not_a_file(path: pathlib.Path) -> str:
    """Why a path that is neither a regular file nor a folder cannot be loaded."""
    if path.is_symlink() and not path.exists():
        return "is a broken symbolic link (or a loop)"
    if path.exists():
        return "is not a regular file (a device, a pipe or a socket)"
    return "does not exist"


def library_holds_cuda(path: Union[str, "os.PathLike[str]"]) -> bool:
    """Whether an exported library embeds a CUDA module (a look for its serialized kind)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return False
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return data.find(_CUDA_MODULE_MARK) >= 0


def prepare_cuda(device: Optional[tvm.runtime.Device] = None) -> str:
    """Make CUDA modules loadable in this process; return the arch compiled for.

    Loads TVM's CUDA runtime if needed (:func:`load_cuda_runtime`), checks that ``device``
    (default ``tvm.cuda(0)``) exists, and installs our compile callback for its architecture
    where TVM's cannot work (:func:`install_cuda_compile_callback`).
    """
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
    """Load TVM's CUDA runtime library unless its device API is already registered.

    ``import tvm`` loads it in full mode, not with ``TVM_USE_RUNTIME_LIB=1``. It needs
    ``libcudart.so.13`` and the driver's ``libcuda.so.1`` on the library path.

    Returns
    -------
    pathlib.Path or None
        The library loaded, or None when the CUDA runtime was already there.
    """
    if cuda_runtime_registered():
        return None
    folders = _cuda_runtime_folders()
    path = next((folder / CUDA_RUNTIME_LIB for folder in folders if (folder / CUDA_RUNTIME_LIB).is_file()), None)
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
        raise DeployError(f"loaded {path}, but it registered no CUDA device API ('device_api.cuda')")
    return path


def _cuda_runtime_folders() -> List[pathlib.Path]:
    """Where TVM's runtime libraries may be: TVM_LIBRARY_PATH, beside libtvm_runtime, the package."""
    folders = [pathlib.Path(p) for p in os.environ.get("TVM_LIBRARY_PATH", "").split(os.pathsep) if p]
    runtime = getattr(tvm.base, "_LOADED_LIBS", {}).get("tvm_runtime")
    if runtime is not None and getattr(runtime, "_name", None):
        folders.append(pathlib.Path(runtime._name).resolve().parent)
    package = pathlib.Path(tvm.__file__).resolve().parent
    folders += [package / "lib", package]
    return list(dict.fromkeys(folders))


def install_cuda_compile_callback(*, arch: Optional[str] = None, force: bool = False) -> bool:
    """Register our nvcc-based ``tvm_callback_cuda_compile`` unless TVM's own one can work.

    TVM's callback (``tvm.support.nvcc``) needs TVM's compiler library and, in its default
    NVRTC mode, the ``cuda-python`` bindings; ours needs only ``nvcc`` (:func:`nvcc_compile`).
    Ours is registered when no callback exists, when ours is already the registered one (to
    update ``arch``), when TVM runs runtime-only, when TVM's mode lacks what it needs, or when
    ``force`` is set.

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
    """``tvm_callback_cuda_compile``: CUDA source -> fatbin for the arch installed (or the GPU's)."""
    try:
        arch = _CALLBACK.arch if _CALLBACK.arch is not None else cuda_arch(tvm.cuda(0).compute_version)
        return nvcc_compile(str(code), arch=arch)
    except DeployError as err:
        _CALLBACK.error = err
        raise


def nvcc_compile(code: str, *, arch: str, use_cache: bool = True) -> bytes:
    """Compile CUDA source to a fatbin with ``nvcc --fatbin -O3 -arch=ARCH``, cached on disk.

    The cache is ``<relax_kvcache cache dir>/cuda-fatbin/<sha256(arch, source)>.fatbin`` (see
    :func:`relax_kvcache.kernel_cache.cache_dir`); clear it after changing the CUDA toolkit.

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
    fatbin = _run_nvcc(code, arch)
    if use_cache:
        write_atomic(cached, fatbin)
    return fatbin


def fatbin_cache_path(code: str, *, arch: str) -> pathlib.Path:
    """Where :func:`nvcc_compile` caches the fatbin of ``code`` for ``arch``."""
    key = hashlib.sha256(f"{arch}\n{code}".encode()).hexdigest()
    return cache_dir() / "cuda-fatbin" / f"{key}.fatbin"


def find_nvcc() -> str:
    """Path of ``nvcc``: on PATH, else in ``$CUDA_HOME/bin``, ``$CUDA_PATH/bin``, ``/usr/local/cuda/bin``."""
    found = shutil.which("nvcc")
    if found:
        return found
    folders = [os.path.join(os.environ[var], "bin") for var in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(var)]
    folders += _NVCC_FALLBACK_DIRS
    for folder in folders:
        candidate = os.path.join(folder, "nvcc")
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise DeployError(
        f"nvcc not found: searched PATH={os.environ.get('PATH', '')} and {', '.join(folders)}. "
        "Loading a CUDA kernel library built elsewhere compiles its CUDA source here: install the "
        "CUDA toolkit or put nvcc on PATH.")


def _run_nvcc(code: str, arch: str) -> bytes:
    nvcc = find_nvcc()
    with tempfile.TemporaryDirectory(prefix="relax_kvcache_nvcc_") as tmp:
        source, output = os.path.join(tmp, "kernels.cu"), os.path.join(tmp, "kernels.fatbin")
        pathlib.Path(source).write_text(code)
        # -gencode, not -arch: with -arch=sm_90a nvcc 13.0 also assembles compute_90 PTX, which
        # rejects sm_90a-only instructions (wgmma)
        cc = arch.removeprefix("sm_")
        cmd = [nvcc, "--fatbin", "-O3", "-w", f"-gencode=arch=compute_{cc},code=sm_{cc}", "-o", output, source]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            log = proc.stderr or proc.stdout or ""
            first = next((line.strip() for line in log.splitlines() if "error" in line), "")
            raise DeployError(f"nvcc failed (exit {proc.returncode}) compiling CUDA source for {arch}: "
                              f"{' '.join(cmd)}\nfirst error: {first}\n--- stderr (tail) ---\n{log[-4000:]}")
        return pathlib.Path(output).read_bytes()
