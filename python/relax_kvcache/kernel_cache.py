"""Kernel libraries on disk: the cache folder and keys, SHA-256 checksum files (``<library>.sha256``
beside each library we write), atomic writes. Needs no TVM compiler."""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import tempfile
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import tvm

from .errors import DeployError

if TYPE_CHECKING:
    from tvm.runtime.executable import Executable

_KERNEL_SOURCE_DIR = pathlib.Path(__file__).parent / "tir_kernels"
#: Version of what a built library holds besides the kernels (3: ``kernel_spec_*`` functions;
#: 6: LongRoPE, rotary-dim and interleaved-RoPE fields among them; 7: the attention chunk).
LIBRARY_FORMAT = 7


def cache_dir() -> pathlib.Path:
    """Folder of compiled kernels: ``$RELAX_KVCACHE_CACHE_DIR`` or ``~/.cache/relax_kvcache``."""
    env = os.environ.get("RELAX_KVCACHE_CACHE_DIR")
    path = pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "relax_kvcache"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _kernel_source_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(_KERNEL_SOURCE_DIR.glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def build_key(spec: Any, target: tvm.target.Target) -> str:
    """Cache key of a kernel set spec: spec, target, TVM version, kernel sources, format."""
    text = "\n".join([repr(spec), str(target), tvm.__version__, _kernel_source_digest(),
                      str(LIBRARY_FORMAT)])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def cached_intact(path: pathlib.Path) -> bool:
    """Whether a cached library exists and agrees with its checksum file (else it is rebuilt)."""
    try:
        return path.exists() and verify_checksum(path)
    except DeployError:
        return False


def cache_path(spec: Any, target: tvm.target.Target) -> pathlib.Path:
    """Where the on-disk cache keeps the library of ``spec`` compiled for ``target``."""
    return cache_dir() / f"kernels-{target.kind.name}-{build_key(spec, target)}.so"


def checksum_path(library: Union[str, "os.PathLike[str]"]) -> pathlib.Path:
    """Where the checksum of ``library`` is kept: ``<library>.sha256`` beside it."""
    library = pathlib.Path(library)
    return library.with_name(library.name + ".sha256")


def file_sha256(path: Union[str, "os.PathLike[str]"]) -> str:
    """SHA-256 (hex) of the file at ``path``."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_checksum(library: Union[str, "os.PathLike[str]"]) -> pathlib.Path:
    """Write ``<library>.sha256`` (``sha256sum -c`` format) beside ``library``, which
    :func:`relax_kvcache.deploy.load` then checks; return its path."""
    library = pathlib.Path(library)
    line = f"{file_sha256(library)}  {library.name}\n"
    path = checksum_path(library)
    write_atomic(path, line.encode())
    return path


def verify_checksum(library: Union[str, "os.PathLike[str]"], *,
                    copy: Optional[Union[str, "os.PathLike[str]"]] = None) -> bool:
    """Check ``library`` (or ``copy``, a copy of it) against ``<library>.sha256``: True when it
    agrees, False without one; ``DeployError`` when they disagree or it cannot be read."""
    library = pathlib.Path(library)
    path = checksum_path(library)
    if not path.is_file():
        return False
    try:
        words = path.read_text(errors="replace").split()
        actual = file_sha256(library if copy is None else copy)
    except OSError as err:
        raise DeployError(f"could not read {str(library)!r} or its checksum {str(path)!r} "
                          f"({err})") from None
    expected = words[0].lower() if words else ""
    if actual != expected:
        raise DeployError(
            f"could not load {str(library)!r}: its SHA-256 is {actual[:16]}..., its checksum file "
            f"{path.name} says {expected[:16] or '(empty)'}...: the library is damaged; expected "
            "the bytes `relax-kvcache build` / export_kernels wrote (build it again, or copy the "
            "library together with its .sha256 file)")
    return True


def export_atomic(executable: Executable, path: pathlib.Path) -> None:
    """``executable.export_library(path)``, atomically, with its checksum."""
    _replace(path, executable.export_library, 0o755)
    write_checksum(path)


def copy_atomic(src: pathlib.Path, dest: pathlib.Path) -> None:
    """Copy the library ``src`` to ``dest``, atomically, with its checksum."""
    _replace(dest, lambda tmp: shutil.copyfile(src, tmp), 0o755)
    write_checksum(dest)


def write_atomic(path: pathlib.Path, data: bytes) -> None:
    """Write ``data`` to ``path`` (readable by all), creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _replace(path, lambda tmp: pathlib.Path(tmp).write_bytes(data), 0o644)


def _replace(dest: pathlib.Path, write: Callable[[str], Any], mode: int) -> None:
    """``write(tmp)`` a temporary file beside ``dest``, chmod it, rename it to ``dest``."""
    with tempfile.NamedTemporaryFile(dir=dest.parent, prefix=".tmp-", suffix=dest.suffix,
                                     delete=False) as tmp:
        tmp_path = tmp.name
    try:
        write(tmp_path)
        os.chmod(tmp_path, mode)
        os.replace(tmp_path, dest)
    finally:
        if os.path.exists(tmp_path):
            os.unlink(tmp_path)
