"""Per-target schedules: loop kinds and tile sizes that the kernel algorithms are written against."""

from __future__ import annotations

import dataclasses
from typing import Union

import tvm


@dataclasses.dataclass(frozen=True, kw_only=True)
class CpuSchedule:
    """CPU schedule of the kernels.

    Parameters
    ----------
    vector_lanes : int
        float32 lanes of one vector register (8 for AVX2, 16 for AVX-512); head_dim loops are
        split into pieces of this width so LLVM emits vector FMAs.
    q_tile : int
        Query tokens per tile in prefill kernels; a tile of ``q_tile * group_size`` rows shares
        each loaded KV chunk.
    kv_chunk : int
        KV tokens per chunk in ragged kernels (paged kernels use one page per chunk).
    """

    vector_lanes: int = 8
    q_tile: int = 8
    kv_chunk: int = 16

    def lanes_for(self, head_dim: int) -> int:
        """Widest power-of-two lane count <= vector_lanes that divides head_dim."""
        lanes = self.vector_lanes
        while lanes > 1 and head_dim % lanes != 0:
            lanes //= 2
        return lanes


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuSchedule:
    """GPU schedule of the kernels (one thread block per work item; ``docs/kernels.md``).

    Parameters
    ----------
    threads, copy_threads : int
        Threads per block of the attention kernels (a multiple of ``warp_size``) / of the
        elementwise kernels (append, page copies, RoPE, merge).
    vector_bytes : int
        Width of one global-memory load or store of KV data (16 = 128-bit loads).
    q_rows, kv_chunk : int
        Rows (query tokens x group heads) of a prefill tile; KV tokens staged per step.
    decode_splits, mla_decode_splits : int
        Most blocks one sequence's KV (one KV / latent head) is split across in decode, merged
        by LSE.
    decode_wave_blocks, decode_mma_wave_blocks, mla_wave_blocks : int
        Blocks resident at once on an H100 / H200 (132 SMs) for the CUDA-core decode (4 per SM),
        the tensor-core decode (3 per SM) and MLA (1 per SM); work is split while the blocks
        fill one such wave (a partial second wave idles most SMs).
    decode_unroll : int
        KV rows a decode row group loads per step (0: as many as fill two 16-byte vectors per
        lane).
    warp_size, max_lanes : int
        Threads of one warp / wavefront / SIMD group; most elements of one vector type (Metal
        and WebGPU have no 8-lane vectors).
    shared_bytes, dynamic_shared_bytes : int
        Shared memory one attention block may use (with room to spare) / when it opts in to a
        larger dynamic allocation (0 where no kernel opts in).
    bfloat16_shared_bytes : int
        Bytes of a bfloat16 element of a shared tile: 2, or 4 on ROCm (TVM 0.27 keeps bfloat16
        shared buffers in float32).
    warp_shuffle, mma, wgmma, fp8_convert : bool
        Whether kernels exchange registers within a warp (CUDA only in TVM 0.27), prefill tiles
        use ``mma.sync`` (CUDA sm_80+, 16-bit dtypes), warpgroup MMA (CUDA ``sm_90a``), and the
        hardware conversion of two 8-bit floats to two float16 (``cvt.rn.f16x2.e4m3x2``, CUDA
        sm_89+).
    dependent_launch : bool
        Whether the decode kernels (splits and merge) are launched programmatically dependent on
        the grid before them (CUDA sm_90+): each waits (``griddepcontrol.wait``) before it reads
        what that grid writes, and the build's pipeline (:mod:`relax_kvcache.launch`) marks such
        kernels, so that a launch overlaps the end of the grid before it. Over 16-bit pages the
        grids before a split kernel (the append, a merge of 8 or more splits) let it start at
        once (``griddepcontrol.launch_dependents``), so that its blocks' first page lookups
        overlap that grid.
    wgmma_warpgroups, wgmma_stages, wgmma_kv_chunk : int
        Warpgroups (128 threads, 64 query rows each) of a warpgroup-MMA prefill block, K/V
        chunks in its shared-memory ring (fewer where they do not fit, at least 2), KV rows per
        step (0: 128, or 64 for head_dim 256).
    wgmma_producer, wgmma_pingpong, wgmma_producer_regs : bool, bool, int
        Whether a warpgroup-MMA block (two consumer warpgroups) gets a producer warpgroup that
        fills its ring through shared-memory barriers, whether the consumers take turns issuing
        their matrix products, and the registers a producer thread keeps (``setmaxnreg``; the
        consumers take the rest).
    prefill_heads_fastest_bytes : int
        Tensor-core prefill grids (``mma`` / ``wgmma``) start the heaviest tiles of every KV head
        first, a tile's heads side by side, where the sequences' K/V averages at most this many
        bytes over all KV heads (mean query tokens x KV heads x K and V row bytes), so that it
        stays in L2; longer ones run head by head, each head's K/V shared through L2 by its
        tiles. 0: head by head always.
    """

    threads: int = 128
    copy_threads: int = 256
    vector_bytes: int = 16
    q_rows: int = 64
    kv_chunk: int = 32
    decode_splits: int = 32
    mla_decode_splits: int = 16
    decode_wave_blocks: int = 528
    decode_mma_wave_blocks: int = 396
    decode_unroll: int = 0
    mla_wave_blocks: int = 132
    warp_size: int = 32
    max_lanes: int = 8
    shared_bytes: int = 46 * 1024
    bfloat16_shared_bytes: int = 2
    dynamic_shared_bytes: int = 0
    warp_shuffle: bool = True
    mma: bool = False
    wgmma: bool = False
    fp8_convert: bool = False
    dependent_launch: bool = False
    wgmma_warpgroups: int = 2
    wgmma_stages: int = 3
    wgmma_kv_chunk: int = 0
    wgmma_producer: bool = True
    wgmma_pingpong: bool = True
    wgmma_producer_regs: int = 80
    prefill_heads_fastest_bytes: int = 0

    def lanes_for(self, dtype_bits: int, extent: int) -> int:
        """Elements per vector access: widest power of two <= vector_bytes that divides ``extent``."""
        lanes = max(1, min(self.max_lanes, self.vector_bytes * 8 // dtype_bits))
        while lanes > 1 and extent % lanes != 0:
            lanes //= 2
        return lanes


Schedule = Union[CpuSchedule, GpuSchedule]

#: Target kinds the kernels are scheduled for as GPUs.
GPU_TARGET_KINDS = ("cuda", "rocm", "metal", "webgpu", "opencl", "vulkan")


def schedule_for(target: tvm.target.Target) -> Schedule:
    """Pick the schedule for a target."""
    kind = target.kind.name
    if kind in GPU_TARGET_KINDS:
        warp = 64 if kind == "rocm" else 32
        # CUDA / ROCm give a block 48 KiB of static shared memory; Metal, WebGPU and OpenCL
        # devices guarantee 32 KiB
        small = kind in ("metal", "webgpu", "opencl", "vulkan")
        return GpuSchedule(warp_size=warp, max_lanes=4 if kind in ("metal", "webgpu") else 8,
                           shared_bytes=(30 if small else 46) * 1024, warp_shuffle=kind == "cuda",
                           bfloat16_shared_bytes=4 if kind == "rocm" else 2,
                           mma=kind == "cuda" and _sm_version(target) >= 80,
                           wgmma=kind == "cuda" and _arch(target) == "sm_90a",
                           fp8_convert=kind == "cuda" and _sm_version(target) >= 89,
                           dependent_launch=kind == "cuda" and _sm_version(target) >= 90,
                           prefill_heads_fastest_bytes=8 << 20 if kind == "cuda" else 0,
                           dynamic_shared_bytes=_dynamic_shared_bytes(target))
    if kind != "llvm":
        raise NotImplementedError(
            f"relax_kvcache kernels are scheduled for llvm (CPU) and GPU targets {GPU_TARGET_KINDS}; "
            f"got target kind {kind!r}")
    attrs = target.attrs
    mcpu = str(attrs["mcpu"]) if "mcpu" in attrs else ""
    mattr = [str(a) for a in attrs["mattr"]] if "mattr" in attrs else []
    avx512 = any("avx512f" in a for a in mattr) or mcpu in _AVX512_CPUS
    return CpuSchedule(vector_lanes=16 if avx512 else 8)


def _dynamic_shared_bytes(target: tvm.target.Target) -> int:
    """Opt-in shared memory per block of a CUDA target (CUDA programming guide, table of
    technical specifications per compute capability); 0 for other targets and pre-sm_80."""
    if target.kind.name != "cuda":
        return 0
    sm = _sm_version(target)
    if sm in (80, 87):
        return 163 * 1024
    if sm in (90, 100, 101, 103, 110):
        return 227 * 1024
    return 99 * 1024 if sm >= 80 else 0


def _arch(target: tvm.target.Target) -> str:
    """The ``arch`` of a CUDA target (e.g. ``sm_90a``; empty without one)."""
    return str(target.attrs["arch"]) if "arch" in target.attrs else ""


def _sm_version(target: tvm.target.Target) -> int:
    """Compute capability of a CUDA target as an int (``sm_90a`` -> 90; 0 without an arch)."""
    arch = _arch(target)
    digits = "".join(ch for ch in arch.removeprefix("sm_") if ch.isdigit())
    return int(digits) if digits else 0


_AVX512_CPUS = frozenset({
    "skylake-avx512", "cascadelake", "cooperlake", "icelake-server", "icelake-client",
    "sapphirerapids", "emeraldrapids", "graniterapids", "tigerlake", "znver4", "znver5",
})
