"""ROCm: the toolchain checks, and the kernel set compiled and linked for AMD GPUs (no GPU needed).

TVM compiles the kernels to an AMDGPU object with its LLVM, links the ROCm device libraries
(ocml, ockl) into it and turns it into a code object with ``ld.lld``; the exported library embeds
that code object, whose ELF symbol table is read here. This needs ``ld.lld`` >= 16 and the ROCm
device libraries (Debian: ``lld-22`` and ``rocm-device-libs``, found through ``ROCM_PATH``, set
to :data:`relax_kvcache.targets.DEBIAN_ROCM_PATH` when unset). Without them these tests skip,
or fail with ``RELAX_KVCACHE_REQUIRE_ROCM=1`` (``.ci/run`` installs both and sets it).

The full kernel set (float16, GQA, sequence and per-layer windows, token trees) is compiled once
per AMD GPU of :data:`ARCHS` (about 35 s each on one core), and in bfloat16 for one of them (TVM
keeps bfloat16 shared tiles in float32 on ROCm: the tiles must be sized for that, or LLVM refuses
the kernel and ends the process). MLA's attention runs on CUDA tensor cores only.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import struct
from typing import Dict, List

import pytest
import tvm

import relax_kvcache as rk
from relax_kvcache import deploy, targets
from relax_kvcache.build import KernelSetSpec, build_kernels
from relax_kvcache.kernel_roles import HOST_ROLES
from relax_kvcache.targets import TargetUnavailableError, make_target

#: AMD GPUs the full kernel set is compiled for: MI200 (CDNA2) and MI300 (CDNA3).
ARCHS = ("gfx90a", "gfx942")

#: ``e_flags & EF_AMDGPU_MACH`` of a code object for each GPU (LLVM's ``ELF.h``).
AMDGPU_MACH = {"gfx90a": 0x3F, "gfx942": 0x4C}

EM_AMDGPU, ET_DYN, SHT_SYMTAB, STT_OBJECT, STT_FUNC, STB_GLOBAL = 224, 3, 2, 1, 2, 1


#: (GPU, dtype) of the full kernel sets compiled
SETS = [(arch, "float16") for arch in ARCHS] + [("gfx942", "bfloat16")]


def full_config(dtype: str = "float16") -> rk.KVCacheConfig:
    """A GQA config whose kernel set has every role (windows of both kinds, trees)."""
    return rk.KVCacheConfig(
        num_layers=2, num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=16, dtype=dtype,
        support_sliding_window=True, attn_kinds=(rk.AttnKind.MHA_SLIDING, rk.AttnKind.MHA),
        layer_sliding_window_size=64)


# ----------------------------------------------------------------------------------------------
# Toolchain
# ----------------------------------------------------------------------------------------------


def require_rocm_toolchain(patch: pytest.MonkeyPatch) -> None:
    """Skip (fail with ``RELAX_KVCACHE_REQUIRE_ROCM=1``) unless the ROCm toolchain checks pass.

    Debian's ``rocm-device-libs`` is used through ``ROCM_PATH`` when ROCM_PATH is unset.
    """
    if "ROCM_PATH" not in os.environ and os.path.isdir(os.path.join(targets.DEBIAN_ROCM_PATH, "amdgcn")):
        patch.setenv("ROCM_PATH", targets.DEBIAN_ROCM_PATH)
    try:
        targets.check_rocm_toolchain()
    except TargetUnavailableError as err:
        message = f"ROCm toolchain incomplete (Debian: apt-get install lld-22 rocm-device-libs): {err}"
        if os.environ.get("RELAX_KVCACHE_REQUIRE_ROCM") == "1":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)


@pytest.fixture
def rocm_env(monkeypatch):
    require_rocm_toolchain(monkeypatch)


def test_rocm_without_lld_names_it(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    if any(os.path.isabs(name) and shutil.which(name) for name in targets._lld_candidates()):
        pytest.skip("ROCm's own ld.lld (/opt/rocm/llvm/bin) is installed")
    with pytest.raises(TargetUnavailableError, match=r"needs the LLVM linker ld\.lld, which is not installed"
                                                     r".*install Debian's 'lld' package"):
        make_target("rocm")


def test_rocm_without_device_libraries_names_them(rocm_env, monkeypatch, tmp_path):
    monkeypatch.setenv("ROCM_PATH", str(tmp_path))
    with pytest.raises(TargetUnavailableError, match=r"needs the ROCm device libraries \(ocml\.bc"):
        make_target("rocm")


def test_rocm_target(rocm_env):
    target = make_target("rocm", arch="gfx942")
    assert target.kind.name == "rocm" and str(target.attrs["mcpu"]) == "gfx942"


# ----------------------------------------------------------------------------------------------
# The code objects in an exported library
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Symbol:
    kind: int  # STT_*
    bind: int  # STB_*
    section: int  # 0: undefined
    size: int


@dataclasses.dataclass(frozen=True)
class CodeObject:
    """What the tests read of an AMDGPU ELF image: its type, GPU and symbol table."""

    elf_type: int
    mach: int
    symbols: Dict[str, Symbol]


def code_objects(library: bytes) -> List[CodeObject]:
    """The AMDGPU ELF images (64-bit, little-endian) embedded in an exported library."""
    found, start = [], 0
    while (at := library.find(b"\x7fELF\x02\x01", start)) >= 0:
        start = at + 1
        if struct.unpack_from("<H", library, at + 18)[0] == EM_AMDGPU:
            found.append(_read_code_object(library, at))
    return found


def _read_code_object(data: bytes, base: int) -> CodeObject:
    (elf_type,) = struct.unpack_from("<H", data, base + 16)
    (section_offset,) = struct.unpack_from("<Q", data, base + 0x28)
    (flags,) = struct.unpack_from("<I", data, base + 0x30)
    entry_size, count = struct.unpack_from("<HH", data, base + 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, base + section_offset + i * entry_size)
                for i in range(count)]
    symbols = {}
    for _, kind, _, _, offset, size, link, _, _, _ in sections:
        if kind != SHT_SYMTAB:
            continue
        strings = base + sections[link][4]
        for i in range(size // 24):
            name, info, _, section, _, sym_size = struct.unpack_from("<IBBHQQ", data, base + offset + i * 24)
            text = data[strings + name:data.index(b"\0", strings + name)].decode()
            symbols[text] = Symbol(kind=info & 0xF, bind=info >> 4, section=section, size=sym_size)
    return CodeObject(elf_type=elf_type, mach=flags & 0xFF, symbols=symbols)


@dataclasses.dataclass(frozen=True)
class RocmSet:
    arch: str
    mod: tvm.runtime.Module
    code_objects: List[CodeObject]


@pytest.fixture(scope="module", params=SETS, ids=[f"{a}-{d}" for a, d in SETS])
def rocm_set(request, tmp_path_factory) -> RocmSet:
    """The whole kernel set compiled for one AMD GPU and dtype (once per module) and exported."""
    arch, dtype = request.param
    with pytest.MonkeyPatch.context() as patch:
        require_rocm_toolchain(patch)
        try:
            mod = build_kernels(full_config(dtype), make_target("rocm", arch=arch), use_cache=False)
        except Exception as err:  # TVM's error line, not a 200-frame C++ traceback
            lines = [line for line in str(err).splitlines() if line.strip()]
            pytest.fail(f"compiling the kernel set for {arch} failed: {type(err).__name__}: "
                        f"{lines[-1] if lines else ''}", pytrace=False)
    path = tmp_path_factory.mktemp(f"rocm-{arch}-{dtype}") / "kernels.so"
    mod.export_library(str(path))
    assert not deploy.library_holds_cuda(path)
    return RocmSet(arch=arch, mod=mod, code_objects=code_objects(path.read_bytes()))


def test_rocm_set_has_every_role(rocm_set):
    assert KernelSetSpec.from_config(full_config()).roles() == rk.KERNEL_ROLES
    missing = [role for role in rk.KERNEL_ROLES if not rocm_set.mod.implements_function(role)]
    assert not missing, f"{rocm_set.arch}: kernel roles missing from the host module: {missing}"
    assert "hip" in {imported.kind for imported in rocm_set.mod.imports}


def test_rocm_library_holds_one_linked_code_object_for_the_gpu(rocm_set):
    (code,) = rocm_set.code_objects
    assert code.elf_type == ET_DYN, f"not linked by ld.lld (ELF type {code.elf_type})"
    assert code.mach == AMDGPU_MACH[rocm_set.arch], f"code object for mach {code.mach:#x}, not {rocm_set.arch}"
    undefined = [name for name, sym in code.symbols.items()
                 if name and sym.section == 0 and sym.bind == STB_GLOBAL]
    assert not undefined, f"undefined symbols in the code object: {undefined}"


def test_rocm_code_object_has_every_kernel(rocm_set):
    """Each role's device kernel is a defined global function with its kernel descriptor (.kd),
    and every kernel of the code object belongs to a role."""
    symbols = rocm_set.code_objects[0].symbols
    for role in (role for role in rk.KERNEL_ROLES if role not in HOST_ROLES):
        kernel, descriptor = symbols.get(f"{role}_kernel"), symbols.get(f"{role}_kernel.kd")
        assert kernel is not None and descriptor is not None, f"{rocm_set.arch}: no kernel for {role}"
        assert (kernel.kind, kernel.bind) == (STT_FUNC, STB_GLOBAL) and kernel.section and kernel.size > 0
        assert descriptor.kind == STT_OBJECT and descriptor.size == 64
    kernels = [name[:-len(".kd")] for name in symbols if name.endswith(".kd")]
    strays = [name for name in kernels if not any(name.startswith(f"{role}_kernel") for role in rk.KERNEL_ROLES)]
    assert not strays, f"kernels of no role: {strays}"


# ----------------------------------------------------------------------------------------------
# Other kernel sets
# ----------------------------------------------------------------------------------------------

LOCAL_ROLES = ("attention_prefill_sliding_window", "attention_decode_sliding_window",
               "attention_prefill_ragged_sliding_window")


def test_rocm_chunked_local_kernels_compile(rocm_env, tmp_path):
    """The windowed kernels with an attention chunk (``MHA_CHUNKED_LOCAL``) compile and link."""
    from relax_kvcache.build import _pass_config
    from relax_kvcache.tir_kernels import schedule_for

    config = rk.KVCacheConfig(num_layers=2, num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                              dtype="float32", attn_kinds=(rk.AttnKind.MHA_CHUNKED_LOCAL, rk.AttnKind.MHA),
                              attention_chunk_size=8192)
    target = make_target("rocm", arch="gfx942")
    spec, sched = KernelSetSpec.from_config(config), schedule_for(target)
    mod = tvm.IRModule({role: spec.kernel_function(role, sched).with_attr("global_symbol", role)
                        for role in LOCAL_ROLES})
    with tvm.transform.PassContext(opt_level=3, config=_pass_config(target)):
        executable = tvm.compile(mod, target=target)
    assert all(executable.mod.implements_function(role) for role in LOCAL_ROLES)
    executable.export_library(str(tmp_path / "local.so"))
    (code,) = code_objects((tmp_path / "local.so").read_bytes())
    missing = [role for role in LOCAL_ROLES if f"{role}_kernel.kd" not in code.symbols]
    assert code.mach == AMDGPU_MACH["gfx942"] and not missing, f"kernels missing from the code object: {missing}"


def test_rocm_mla_is_refused_by_name(rocm_env):
    config = rk.KVCacheConfig(num_layers=2, num_qo_heads=16, num_kv_heads=1, head_dim=576, v_head_dim=512,
                              mla_original_qk_head_dim=192, mla_original_v_head_dim=128, page_size=16,
                              rope_mode=rk.RopeMode.NONE, dtype="float16", attn_kinds=[rk.AttnKind.MLA] * 2)
    with pytest.raises(NotImplementedError, match=r"GPU MLA attention runs on tensor cores.*CUDA sm_80\+"):
        build_kernels(config, make_target("rocm"), use_cache=False)
