"""GPU code generation of the elementwise kernels (page ops, split_rotary, merge_inplace).

No GPU is needed: each kernel is scheduled with the target's :class:`GpuSchedule` and compiled
for CUDA (sm_80, sm_90a), Metal, WebGPU and OpenCL, and the generated device source is
inspected. The kernels that move KV data must use 128-bit vector accesses on CUDA. Numerics of
the GPU schedules are checked on a real GPU elsewhere; the CPU schedules are tested in
``test_kernels.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import pytest
import tvm

from relax_kvcache.tir_kernels import (
    LatentPageSpec,
    MergeSpec,
    PageLayoutSpec,
    RopeSplitSpec,
    make_compact_copy,
    make_copy_single_page,
    make_copy_single_page_mla,
    make_debug_get_kv,
    make_debug_get_kv_mla,
    make_merge_inplace,
    make_split_rotary,
    make_transpose_append,
    make_transpose_append_mla,
)
from relax_kvcache.tir_kernels.schedule import GpuSchedule, schedule_for

TARGETS = {
    "sm_80": {"kind": "cuda", "arch": "sm_80"},
    "sm_90a": {"kind": "cuda", "arch": "sm_90a"},
    "metal": {"kind": "metal"},
    "webgpu": {"kind": "webgpu"},
    "opencl": {"kind": "opencl"},
}
DTYPES = ("float16", "bfloat16", "float32")
#: Kernels that move KV data between tensors and pages: plain copies, so 128-bit accesses.
KV_MOVING = ("transpose_append", "copy_single_page", "compact_copy", "debug_get_kv",
             "transpose_append_mla", "copy_single_page_mla", "debug_get_kv_mla")
KERNELS = KV_MOVING + ("split_rotary", "merge_inplace")
#: 128-bit vector types of the CUDA source (16-bit types are moved as uint4).
VECTOR_128 = ("uint4", "float4")
#: Widest vector (in lanes) of the shading languages that have a limit below 16 bytes of float16.
MAX_LANES = {"metal": 4, "webgpu": 4}
#: Marker of a kernel's definition in the device source, per target kind.
KERNEL_MARK = {"cuda": "__global__", "metal": "kernel void", "webgpu": "@compute", "opencl": "__kernel"}


@functools.lru_cache(maxsize=None)
def make_kernel(name: str, dtype: str, sched: GpuSchedule, head_dim: int) -> tvm.tirx.PrimFunc:
    """The PrimFunc of kernel ``name`` for a GQA layout (8 query heads, 2 KV heads; MLA page
    kernels: latent rows of ``head_dim`` features); cached, as targets with equal schedules
    share it."""
    page = PageLayoutSpec(num_kv_heads=2, head_dim=head_dim, page_size=16, dtype=dtype)
    latent = LatentPageSpec(width=head_dim, page_size=16, dtype=dtype)
    rope = RopeSplitSpec(num_qo_heads=8, num_kv_heads=2, head_dim=head_dim, dtype=dtype,
                         rope_theta=1e4, rope_scale=1.0)
    factories = {
        "transpose_append": lambda: make_transpose_append(page, sched),
        "copy_single_page": lambda: make_copy_single_page(page, sched),
        "compact_copy": lambda: make_compact_copy(page, sched),
        "debug_get_kv": lambda: make_debug_get_kv(page, sched),
        "transpose_append_mla": lambda: make_transpose_append_mla(latent, sched),
        "copy_single_page_mla": lambda: make_copy_single_page_mla(latent, sched),
        "debug_get_kv_mla": lambda: make_debug_get_kv_mla(latent, sched),
        "split_rotary": lambda: make_split_rotary(rope, sched),
        "merge_inplace": lambda: make_merge_inplace(MergeSpec(num_heads=8, head_dim=head_dim, dtype=dtype), sched),
    }
    return factories[name]()


@functools.lru_cache(maxsize=None)
def device_source(name: str, dtype: str, target_key: str, *, head_dim: int = 128,
                  vector_bytes: int | None = None) -> str:
    """Compile kernel ``name`` with the schedule of ``TARGETS[target_key]``; the device source.

    ``vector_bytes`` overrides the schedule's vector width.
    """
    target = tvm.target.Target(TARGETS[target_key])
    sched = schedule_for(target)
    assert isinstance(sched, GpuSchedule), sched
    if vector_bytes is not None:
        sched = dataclasses.replace(sched, vector_bytes=vector_bytes)
    func = make_kernel(name, dtype, sched, head_dim).with_attr("global_symbol", name)
    ex = tvm.compile(tvm.IRModule({name: func}), target=target)
    source = ex.mod.imports[0].inspect_source()
    assert KERNEL_MARK[target.kind.name] in source, source
    return source


def kernel_body(source: str, name: str) -> str:
    """The CUDA definition of kernel ``name`` (the header's helper types are cut off)."""
    return source[source.rindex(f"{name}_kernel("):]


def schedule_lanes(target_key: str, dtype: str) -> int:
    """Lanes the target's schedule gives a head_dim-128 span of ``dtype``."""
    sched = schedule_for(tvm.target.Target(TARGETS[target_key]))
    return sched.lanes_for(tvm.DataType(dtype).bits, 128)


def expect_lane_limit(request, target_key: str, dtype: str) -> None:
    """Mark the test xfail while the schedule asks for wider vectors than the target has."""
    limit = MAX_LANES.get(target_key)
    if limit is not None and schedule_lanes(target_key, dtype) > limit:
        request.applymarker(pytest.mark.xfail(
            raises=tvm.error.InternalError, strict=True,
            reason=f"schedule_for({target_key}) gives {schedule_lanes(target_key, dtype)}-lane {dtype} "
                   f"vectors; {target_key} codegen allows at most {limit} lanes (GpuSchedule needs a "
                   f"lane cap for this target)"))


# ----------------------------------------------------------------------------- CUDA


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", KERNELS)
def test_cuda_codegen(name: str, dtype: str, arch: str) -> None:
    body = kernel_body(device_source(name, dtype, arch), name)
    assert "threadIdx.x" in body
    # a latent page (16 rows of 128) is one block of work, so that kernel's grid folds to 1
    assert "blockIdx.x" in body or name == "copy_single_page_mla"
    if name in KV_MOVING:
        assert any(f"*({vec}*)" in body for vec in VECTOR_128), f"no 128-bit access in {name}:\n{body}"


@pytest.mark.parametrize("name", KV_MOVING)
def test_cuda_narrow_head_dim(name: str) -> None:
    """A head_dim that 16 bytes do not divide (36 float16) falls back to 8-byte vectors."""
    body = kernel_body(device_source(name, "float16", "sm_80", head_dim=36), name)
    assert "*(half4*)" in body, body


def test_cuda_compact_copy_keeps_sequence_order() -> None:
    """compact_copy: one block per sequence, its moves in one serial loop and no barriers."""
    body = kernel_body(device_source("compact_copy", "float16", "sm_80"), "compact_copy")
    assert "__syncthreads" not in body
    assert "for (int i = 0;" in body


@pytest.mark.parametrize("name", KERNELS)
def test_grids_are_never_empty(name: str) -> None:
    """A launch of 0 blocks fails: every grid is a constant or ``max(1, ...)``."""
    sched = schedule_for(tvm.target.Target(TARGETS["sm_80"]))
    script = make_kernel(name, "float16", sched, 128).script()
    grids = re.findall(r'T\.thread_binding\((.*), thread="blockIdx\.x"\)', script)
    assert grids, script
    for extent in grids:
        assert re.fullmatch(r"\d+|T\.max\((1|T\.int64\(1\)), .*\)", extent), extent


# ----------------------------------------------------------------------------- other GPU targets


@pytest.mark.parametrize("dtype", ("float16", "float32"))
@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("target_key", ["metal", "webgpu", "opencl"])
def test_other_gpu_codegen(request, target_key: str, name: str, dtype: str) -> None:
    expect_lane_limit(request, target_key, dtype)
    device_source(name, dtype, target_key)


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("target_key", ["metal", "webgpu"])
def test_float16_compiles_with_four_lanes(target_key: str, name: str) -> None:
    """With 8-byte vectors (4 float16 lanes) the kernels compile for Metal and WebGPU."""
    device_source(name, "float16", target_key, vector_bytes=8)
