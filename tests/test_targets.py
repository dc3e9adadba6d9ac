"""Targets: ``make_target`` / ``default_target`` and compiling the whole kernel set per target kind.

No GPU is needed: GPU targets are compiled here (CUDA keeps its source in the module) and the
module is checked for every kernel role and exported. Each target is compiled once per session
(module-scoped fixture) and only for the cases listed in ``FULL_SET_CASES``. ROCm (toolchain,
code objects) is tested in ``test_rocm_build.py``.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
from typing import Optional

import pytest
import tvm

import relax_kvcache as rk
from relax_kvcache import deploy
from relax_kvcache.build import KernelSetSpec, build_kernels, export_kernels
from relax_kvcache.kernel_roles import HOST_ROLES
from relax_kvcache.runtime import default_target, host_target
from relax_kvcache.targets import TargetUnavailableError, cuda_arch, make_target

def full_config(dtype: str) -> rk.KVCacheConfig:
    """A GQA config whose kernel set has every role (sequence and per-layer sliding windows)."""
    return rk.KVCacheConfig(
        num_layers=2, num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=16, dtype=dtype,
        support_sliding_window=True, attn_kinds=(rk.AttnKind.MHA_SLIDING, rk.AttnKind.MHA),
        layer_sliding_window_size=64)


# ----------------------------------------------------------------------------------------------
# make_target
# ----------------------------------------------------------------------------------------------


def test_llvm_default_is_the_host_target():
    assert str(make_target("llvm")) == str(host_target()) == str(default_target(tvm.cpu()))


def test_llvm_arch_is_the_cpu_model():
    target = make_target("llvm", arch="znver3")
    assert target.kind.name == "llvm" and str(target.attrs["mcpu"]) == "znver3"


@pytest.mark.parametrize("arch, expected", [(None, "sm_80"), ("sm_80", "sm_80"), ("sm_90a", "sm_90a"),
                                            ("sm_89", "sm_89"), ("sm_100a", "sm_100a")])
def test_cuda_target_arch(arch, expected):
    target = make_target("cuda", arch=arch)
    assert target.kind.name == "cuda" and str(target.attrs["arch"]) == expected


def test_cuda_target_passes_options():
    target = make_target("cuda", arch="sm_90a", max_shared_memory_per_block=232448)
    assert int(target.attrs["max_shared_memory_per_block"]) == 232448


@pytest.mark.parametrize("kind", ["metal", "webgpu", "opencl"])
def test_gpu_targets_without_arch(kind):
    target = make_target(kind)
    assert target.kind.name == kind and "gpu" in [str(k) for k in target.keys]


def test_vulkan_reports_missing_spirv_codegen():
    with pytest.raises(TargetUnavailableError, match=r"SPIR-V code generation \(USE_VULKAN\)"):
        make_target("vulkan")


def test_build_checks_targets_made_without_make_target():
    config = full_config("float16")
    with pytest.raises(TargetUnavailableError, match="USE_VULKAN"):
        build_kernels(config, tvm.target.Target({"kind": "vulkan"}), use_cache=False)


@pytest.mark.parametrize("kind, pattern", [
    ("cdua", r"unknown target kind 'cdua' \(did you mean 'cuda'\?\); expected one of llvm, cuda"),
    ("CUDA", r"unknown target kind 'CUDA'"),
    ("c", r"unknown target kind 'c'"),
])
def test_bad_kind(kind, pattern):
    with pytest.raises(ValueError, match=pattern):
        make_target(kind)


def test_kind_must_be_a_string():
    with pytest.raises(TypeError, match="target kind must be a str, got int"):
        make_target(3)


@pytest.mark.parametrize("arch", ["sm80", "90a", "compute_90", "sm_9", "sm_90x", ""])
def test_bad_cuda_arch(arch):
    with pytest.raises(ValueError, match=rf"CUDA arch must look like 'sm_80'.*got '{arch}'"):
        make_target("cuda", arch=arch)


def test_bad_rocm_arch():
    with pytest.raises(ValueError, match=r"'gfx9999' is not a CPU LLVM knows for amdgcn-amd-amdhsa; "
                                         r"expected an AMD GPU such as 'gfx90a'"):
        make_target("rocm", arch="gfx9999")


def test_bad_llvm_cpu():
    with pytest.raises(ValueError, match=r"'pentium9' is not a CPU LLVM knows for .*; expected a CPU model"):
        make_target("llvm", arch="pentium9")


@pytest.mark.parametrize("kind", ["metal", "webgpu", "opencl", "vulkan"])
def test_arch_for_a_kind_without_one(kind):
    with pytest.raises(ValueError, match=rf"target kind '{kind}' takes no arch \(got 'sm_80'\)"):
        make_target(kind, arch="sm_80")


def test_unknown_option_named():
    with pytest.raises(ValueError, match=r"TVM rejected target .*Unknown config option 'warp_speed'"):
        make_target("cuda", warp_speed=9)


def test_model_as_option_rejected():
    with pytest.raises(ValueError, match=r"pass the device model as arch=\.\.\., not as option\(s\) \['mcpu'\]"):
        make_target("rocm", mcpu="gfx90a")


# ----------------------------------------------------------------------------------------------
# CUDA arch of a device, default_target
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version, arch", [("9.0", "sm_90a"), ("8.0", "sm_80"), ("8.6", "sm_86"),
                                           ("8.9", "sm_89"), ("10.0", "sm_100"), ("12.0", "sm_120")])
def test_cuda_arch_of_compute_version(version, arch):
    assert cuda_arch(version) == arch


@pytest.mark.parametrize("version", ["9", "sm_90", "9.0.1", ""])
def test_bad_compute_version(version):
    with pytest.raises(ValueError, match=rf"CUDA compute version must look like '8.0'.*got '{version}'"):
        cuda_arch(version)


class FakeCudaDevice:
    """What default_target reads of a CUDA device, for a GPU this machine does not have."""

    def __init__(self, compute_version: str) -> None:
        self.exist = True
        self.compute_version = compute_version

    def dlpack_device_type(self) -> int:
        return tvm.cuda().dlpack_device_type()


@pytest.mark.parametrize("version, arch", [("9.0", "sm_90a"), ("8.0", "sm_80")])
def test_default_target_of_a_cuda_device(version, arch):
    target = default_target(FakeCudaDevice(version))
    assert target.kind.name == "cuda" and str(target.attrs["arch"]) == arch


@pytest.mark.skipif(tvm.cuda().exist, reason="this machine has a CUDA GPU")
def test_default_target_of_an_absent_cuda_device():
    with pytest.raises(TargetUnavailableError, match=r"cuda:0 is not available .* pass target=make_target"):
        default_target(tvm.cuda())


@pytest.mark.parametrize("device", [tvm.rocm(), tvm.metal(), tvm.vulkan()])
def test_default_target_of_other_devices(device):
    with pytest.raises(NotImplementedError, match=r"default targets for CPU and CUDA devices only.*make_target"):
        default_target(device)


# ----------------------------------------------------------------------------------------------
# The whole kernel set compiles for every target kind
# ----------------------------------------------------------------------------------------------

#: (id, kind, arch, dtype) of the full-set compiles; each costs one compile of all kernels, so
#: CI covers each CUDA arch and each 16-bit dtype once; ``RELAX_KVCACHE_ALL_TARGET_CASES=1`` adds
#: the other two CUDA combinations.
FULL_SET_CASES = [
    ("cuda-sm_90a-float16", "cuda", "sm_90a", "float16"),
    ("cuda-sm_80-bfloat16", "cuda", "sm_80", "bfloat16"),
    ("metal-float16", "metal", None, "float16"),
    ("webgpu-float32", "webgpu", None, "float32"),
    ("opencl-float16", "opencl", None, "float16"),
]
if os.environ.get("RELAX_KVCACHE_ALL_TARGET_CASES") == "1":
    FULL_SET_CASES += [
        ("cuda-sm_80-float16", "cuda", "sm_80", "float16"),
        ("cuda-sm_90a-bfloat16", "cuda", "sm_90a", "bfloat16"),
    ]


#: Full-set cases whose CUDA source is also compiled with nvcc (what loading on a GPU host does).
NVCC_CASES = ("cuda-sm_90a-float16",)


@dataclasses.dataclass(frozen=True)
class FullSet:
    """The whole kernel set of ``full_config(dtype)`` compiled for one case, and its library."""

    case: str
    kind: str
    arch: Optional[str]
    dtype: str
    mod: tvm.runtime.Module
    path: pathlib.Path


@pytest.fixture(scope="module", params=FULL_SET_CASES, ids=[case[0] for case in FULL_SET_CASES])
def full_set(request, tmp_path_factory) -> FullSet:
    """The whole kernel set compiled once per case (module scope) and exported."""
    case, kind, arch, dtype = request.param
    target = make_target(kind, arch=arch)
    try:
        mod = build_kernels(full_config(dtype), target, use_cache=False)
    except Exception as err:  # report TVM's error line, not a 200-frame C++ traceback
        pytest.fail(f"compiling the kernel set for {case} failed: {type(err).__name__}: "
                    f"{_last_line(err)}", pytrace=False)
    path = tmp_path_factory.mktemp(case) / "kernels.so"
    mod.export_library(str(path))
    return FullSet(case=case, kind=kind, arch=arch, dtype=dtype, mod=mod, path=path)


def _last_line(err: Exception) -> str:
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    return lines[-1] if lines else repr(err)


def test_full_set_has_every_role(full_set):
    assert KernelSetSpec.from_config(full_config(full_set.dtype)).roles() == rk.KERNEL_ROLES
    # The host module holds every entry function (querying a GPU import here would raise).
    missing = [role for role in rk.KERNEL_ROLES if not full_set.mod.implements_function(role)]
    assert not missing, f"{full_set.case}: kernel roles missing from the module: {missing}"


def test_full_set_device_module(full_set):
    device_kinds = {imported.kind for imported in full_set.mod.imports}
    assert full_set.kind in device_kinds, f"{full_set.case}: device modules {device_kinds}"
    assert full_set.path.stat().st_size > 0
    assert deploy.library_holds_cuda(full_set.path) == (full_set.kind == "cuda")


def _cuda_source(full_set: FullSet) -> str:
    if full_set.kind != "cuda":
        pytest.skip("CUDA only")
    return next(imported for imported in full_set.mod.imports if imported.kind == "cuda").inspect_source()


def test_full_set_cuda_source_has_every_kernel(full_set):
    source = _cuda_source(full_set)
    missing = [role for role in rk.KERNEL_ROLES if role not in source and role not in HOST_ROLES]
    assert not missing, f"kernels missing from the CUDA source: {missing}"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_full_set_cuda_source_compiles_with_nvcc(full_set):
    """TVM's CUDA source is valid CUDA: what ``deploy.load`` compiles on the GPU host (fatbin cached)."""
    source = _cuda_source(full_set)
    if full_set.case not in NVCC_CASES:
        pytest.skip(f"nvcc is run for {', '.join(NVCC_CASES)} only (time)")
    assert deploy.nvcc_compile(source, arch=full_set.arch).startswith(bytes.fromhex("50ed55ba"))


def test_webgpu_float16_elementwise_kernels():
    """WebGPU float16 (vectors of at most 4 lanes, the schedule's ``max_lanes``) is checked on the
    elementwise kernels only (a full set would double the cost)."""
    target = make_target("webgpu")
    spec = KernelSetSpec.from_config(full_config("float16"))
    from relax_kvcache import tir_kernels as tk

    sched = tk.schedule_for(target)
    roles = ("transpose_append", "split_rotary", "merge_inplace")
    mod = tvm.IRModule({role: spec.kernel_function(role, sched).with_attr("global_symbol", role)
                        for role in roles})
    tvm.compile(mod, target=target)


def test_export_kernels_for_cuda_without_a_gpu(tmp_path, monkeypatch):
    """A CUDA library is exported (and cached) here; the second export copies it from the cache."""
    monkeypatch.setenv("RELAX_KVCACHE_CACHE_DIR", str(tmp_path / "cache"))
    tiny = _tiny_cuda_executable()
    compiles = []

    def fake_compile(spec, target, progress, identity):
        compiles.append(str(target))
        return tiny

    monkeypatch.setattr("relax_kvcache.build._compile", fake_compile)
    config, target = full_config("float16"), make_target("cuda", arch="sm_90a")
    messages = []
    first = export_kernels(config, target, tmp_path / "a.so", progress=messages.append)
    second = export_kernels(config, target, tmp_path / "b.so", progress=messages.append)
    assert len(compiles) == 1 and messages == [f"copying cached kernels {_cached(tmp_path).name}"]
    assert first.read_bytes() == second.read_bytes() == _cached(tmp_path).read_bytes()
    assert deploy.library_holds_cuda(second)
    if not tvm.cuda().exist:  # not loadable here: build_kernels compiles and returns that module
        assert build_kernels(config, target) is tiny.mod and len(compiles) == 2


def _cached(tmp_path):
    (path,) = (tmp_path / "cache").glob("kernels-cuda-*.so")
    return path


def _tiny_cuda_executable():
    from tvm.script import tirx as T

    @T.prim_func
    def add_one(a: T.Buffer((256,), "float32")):
        for i in T.thread_binding(2, thread="blockIdx.x"):
            for j in T.thread_binding(128, thread="threadIdx.x"):
                a[i * 128 + j] = a[i * 128 + j] + T.float32(1)

    return tvm.compile(tvm.IRModule({"add_one": add_one}), target=make_target("cuda", arch="sm_90a"))


LOCAL_ROLES = ("attention_prefill_sliding_window", "attention_decode_sliding_window",
               "attention_prefill_ragged_sliding_window")


@pytest.mark.parametrize("kind", ["cuda", "metal", "webgpu", "opencl"])
def test_chunked_local_kernels_compile(kind):
    """The windowed kernels compiled with an attention chunk (``MHA_CHUNKED_LOCAL``, a floor
    modulo of positions in the masks) build for every GPU target (compile only)."""
    from relax_kvcache.build import _pass_config
    from relax_kvcache.tir_kernels import schedule_for

    config = rk.KVCacheConfig(num_layers=2, num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                              dtype="float32", attn_kinds=(rk.AttnKind.MHA_CHUNKED_LOCAL, rk.AttnKind.MHA),
                              attention_chunk_size=8192)
    target = make_target(kind)
    spec, sched = KernelSetSpec.from_config(config), schedule_for(target)
    mod = tvm.IRModule({role: spec.kernel_function(role, sched).with_attr("global_symbol", role)
                        for role in LOCAL_ROLES})
    with tvm.transform.PassContext(opt_level=3, config=_pass_config(target)):
        executable = tvm.compile(mod, target=target)
    assert all(executable.mod.implements_function(role) for role in LOCAL_ROLES)
