"""Per-target schedules: loop kinds and tile sizes that the kernel algorithms are written against.

Each kernel in this package is one algorithm (TVMScript with shared ``T.macro`` pieces); a
schedule decides how its loops map onto the target. On CPU that is ``T.parallel`` over
independent work items (sequence x KV head), ``T.vectorized`` over head_dim in ``vector_lanes``
wide pieces, and query tiles of ``q_tile`` tokens for prefill. GPU schedules come with the CUDA
work and plug in here.
"""

from __future__ import annotations

import dataclasses

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


def schedule_for(target: tvm.target.Target) -> CpuSchedule:
    """Pick the schedule for a target."""
    kind = target.kind.name
    if kind != "llvm":
        raise NotImplementedError(
            f"relax_kvcache kernels are scheduled for CPU (llvm) targets only so far; got target "
            f"kind {kind!r}. CUDA, ROCm, Metal and WebGPU schedules are planned.")
    attrs = target.attrs
    mcpu = str(attrs["mcpu"]) if "mcpu" in attrs else ""
    mattr = [str(a) for a in attrs["mattr"]] if "mattr" in attrs else []
    avx512 = any("avx512f" in a for a in mattr) or mcpu in _AVX512_CPUS
    return CpuSchedule(vector_lanes=16 if avx512 else 8)


_AVX512_CPUS = frozenset({
    "skylake-avx512", "cascadelake", "cooperlake", "icelake-server", "icelake-client",
    "sapphirerapids", "emeraldrapids", "graniterapids", "tigerlake", "znver4", "znver5",
})
