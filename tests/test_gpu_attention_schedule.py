"""GPU schedules of the attention kernels: layouts they pick and the code they generate.

No GPU is needed. The layouts (:class:`DecodeShape`, :class:`MmaTileShape`) are checked for the
invariants the kernels rely on; the generated CUDA source is checked for the instructions the
schedule is about (tensor-core ``mma.sync`` in prefill on sm_80+, warp shuffles in decode) and
for their absence where the target cannot run them. Numerics of these kernels are checked on a
real GPU by ``test_kernels.py`` (``RELAX_KVCACHE_TEST_DEVICE=cuda``) and
``test_workloads.py``.
"""

from __future__ import annotations

import functools

import pytest
import tvm

from relax_kvcache.build import _pass_config
from relax_kvcache.targets import make_target
from relax_kvcache.tir_kernels import AttentionSpec, make_paged_decode, make_ragged_prefill, make_transpose_append
from relax_kvcache.tir_kernels.attention_gpu_decode import DecodeShape
from relax_kvcache.tir_kernels.attention_gpu_mma import MmaTileShape
from relax_kvcache.tir_kernels.schedule import GpuSchedule, schedule_for
from relax_kvcache.tir_kernels.spec import PageLayoutSpec

MMA = "mma.sync.aligned.m16n8k16.row.col.f32"


def spec(dtype="float16", *, heads=(32, 8), dim=128, v_dim=None, **kw) -> AttentionSpec:
    return AttentionSpec(num_qo_heads=heads[0], num_kv_heads=heads[1], qk_head_dim=dim,
                         v_head_dim=v_dim or dim, dtype=dtype, **kw)


# ----------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("dim,v_dim", [(64, 64), (128, 128), (256, 256), (96, 96), (192, 128), (576, 512)])
@pytest.mark.parametrize("group", [1, 4, 5, 8, 16, 64])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("kind", ["cuda", "metal"])
def test_decode_shape_covers_head_dims_and_group(dim, v_dim, group, dtype, kind):
    sched = schedule_for(make_target(kind))
    shape = DecodeShape.choose(spec(dtype, heads=(8 * group, 8), dim=dim, v_dim=v_dim), sched)
    assert shape.bdx & (shape.bdx - 1) == 0 and shape.bdx <= sched.warp_size  # shuffle-xor lanes
    assert shape.bdx * shape.ek == dim and shape.bdx * shape.ev == v_dim
    assert shape.ek % shape.k_lanes == 0 and shape.ev % shape.v_lanes == 0
    assert shape.k_lanes * (4 if dtype == "float32" else 2) <= sched.vector_bytes
    assert shape.bdz * shape.rows == group
    assert shape.bdy >= 1 and shape.threads <= max(sched.threads, 1024)
    assert shape.rows * max(shape.ek, shape.ev) <= 64 or shape.rows == 1  # registers per thread


def test_decode_shape_of_llama_reads_16_bytes_per_lane():
    shape = DecodeShape.choose(spec(), schedule_for(make_target("cuda", arch="sm_90a")))
    assert (shape.bdx, shape.bdy, shape.bdz, shape.ek, shape.k_lanes, shape.rows) == (16, 8, 1, 8, 8, 4)


@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 3, 4, 8, 48, 64])
def test_mma_tile_shape(dim, group):
    sched = schedule_for(make_target("cuda", arch="sm_80"))
    shape = MmaTileShape.choose(spec(heads=(2 * group, 2), dim=dim), sched)
    if shape is None:  # a 16-row-aligned tile of one token does not fit in shared memory
        assert 2 * (-(-group // 16) * 16 * dim + 16 * 2 * dim) > sched.shared_bytes
        return
    assert shape.rows % 16 == 0 and shape.kv_chunk % 16 == 0
    assert shape.q_tokens >= 1 and shape.q_tokens * group <= shape.rows < shape.q_tokens * group + 16
    shared = 2 * (shape.rows * dim + shape.kv_chunk * 2 * dim)
    assert shared <= sched.shared_bytes


@pytest.mark.parametrize("case", [
    ("float32", {"kind": "cuda", "arch": "sm_90a"}, {}),
    ("float16", {"kind": "cuda", "arch": "sm_75"}, {}),
    ("float16", {"kind": "metal"}, {}),
    ("float16", {"kind": "cuda", "arch": "sm_90a"}, {"dim": 72}),  # head_dim not a multiple of 16
    ("float16", {"kind": "cuda", "arch": "sm_90a"}, {"heads": (128, 1)}),  # group wider than a tile
])
def test_mma_tile_not_used(case):
    dtype, target, kw = case
    assert MmaTileShape.choose(spec(dtype, **kw), schedule_for(tvm.target.Target(target))) is None


def test_schedule_flags():
    assert schedule_for(make_target("cuda", arch="sm_90a")).mma
    assert schedule_for(make_target("cuda", arch="sm_80")).mma
    assert not schedule_for(tvm.target.Target({"kind": "cuda", "arch": "sm_75"})).mma
    for kind in ("metal", "webgpu", "opencl", "rocm"):
        sched = schedule_for(tvm.target.Target({"kind": kind}))
        assert isinstance(sched, GpuSchedule) and not sched.mma and not sched.warp_shuffle


# ----------------------------------------------------------------------------- generated code


@functools.lru_cache(maxsize=None)
def device_source(factory, dtype: str, target_json: tuple, **kw) -> str:
    target = tvm.target.Target(dict(target_json))
    func = factory(spec(dtype, heads=(8, 2)), schedule_for(target)).with_attr("global_symbol", "k")
    with tvm.transform.PassContext(opt_level=3, config=_pass_config(target)):
        ex = tvm.compile(tvm.IRModule({"k": func}), target=target)
    return ex.mod.imports[0].inspect_source()


SM90 = (("kind", "cuda"), ("arch", "sm_90a"))
SM80 = (("kind", "cuda"), ("arch", "sm_80"))


@pytest.mark.parametrize("dtype,target", [("float16", SM90), ("bfloat16", SM80)])
def test_cuda_prefill_uses_tensor_cores(dtype, target):
    source = device_source(make_ragged_prefill, dtype, target)
    operand = {"float16": "f16", "bfloat16": "bf16"}[dtype]
    assert f"{MMA}.{operand}.{operand}.f32" in source
    assert " ^ " in source  # swizzled shared tiles (conflict-free fragment reads)


def test_cuda_float32_prefill_uses_cuda_cores():
    assert "mma.sync" not in device_source(make_ragged_prefill, "float32", SM90)


def test_cuda_decode_reduces_with_warp_shuffles_and_16_byte_loads():
    """Before sm_80 (no mma.sync) a GQA decode runs on CUDA cores: K/V rows into registers in
    16-byte vectors, scores summed across lanes with warp shuffles."""
    source = device_source(make_paged_decode, "float16", (("kind", "cuda"), ("arch", "sm_75")))
    assert "__shfl_xor_sync" in source and "mma.sync" not in source
    assert "*(uint4*)(kn" in source and "*(uint4*)(vn" in source


def test_cuda_gqa_decode_loads_tensor_core_fragments_from_pages():
    """From sm_80 on, a 4:1 GQA decode loads its mma fragments from the pages in 16-byte pieces."""
    source = device_source(make_paged_decode, "float16", SM80)
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in source
    assert "*(uint4*)(kr" in source and "*(uint4*)(vr" in source


def _lowered_kernels(func, target) -> dict:
    """The device kernels of ``func`` after the build's TIR pipeline, by name."""
    from relax_kvcache import launch

    func = func.with_attr("global_symbol", "k").with_attr("target", tvm.target.Target(target, host="llvm"))
    with tvm.transform.PassContext(opt_level=3, config=_pass_config(target)):
        mod = tvm.tirx.get_tir_pipeline(launch.register())[0](tvm.IRModule({"k": func}))
    return {gv.name_hint: f for gv, f in mod.functions_items() if "tirx.kernel_launch_params" in f.attrs}


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("kernel", ["decode", "mla"])
def test_decode_kernels_take_part_in_dependent_launch_from_sm90(arch, kernel):
    """On sm_90+ each decode kernel (splits and merge; MHA and MLA) opens with
    ``griddepcontrol.wait``, and the build's pipeline marks exactly those kernels for
    programmatic dependent launch; before sm_90 there is neither."""
    from relax_kvcache.tir_kernels import make_paged_mla

    target = make_target("cuda", arch=arch)
    func = (make_paged_decode(spec(heads=(8, 2)), schedule_for(target)) if kernel == "decode"
            else make_paged_mla(spec(heads=(16, 1), dim=576, v_dim=512), schedule_for(target)))
    kernels = _lowered_kernels(func, target)
    # decode: (inline RoPE, plain) x (splits, merge); MLA: (splits, merge), on sm_90a under 64
    # heads for both schedules (mma.sync for decode batches, wgmma for prefill)
    assert len(kernels) == (4 if kernel == "decode" or arch == "sm_90a" else 2)
    for name, f in kernels.items():
        tags = [str(t) for t in f.attrs["tirx.kernel_launch_params"]]
        opens = f.script().count('griddepcontrol("wait"') == 1
        assert opens == (arch == "sm_90a"), name
        assert ("tirx.use_programtic_dependent_launch" in tags) == opens, (name, tags)
        assert "tirx.use_dyn_shared_memory" not in tags[:-1]  # the runtime wants it last


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3fn"])
def test_decode_starts_early_over_16_bit_pages_from_sm90(arch, kv_dtype):
    """On sm_90+ over 16-bit pages the append and the decode merges trigger their dependents,
    and the tensor-core split kernel looks up its first pages before it waits; over 8-bit pages
    and before sm_90 no kernel triggers and no page is looked up before the wait."""
    target = make_target("cuda", arch=arch)
    sched = schedule_for(target)
    early = arch == "sm_90a" and kv_dtype is None
    decode = _lowered_kernels(make_paged_decode(spec(heads=(8, 2), kv_dtype=kv_dtype), sched), target)
    append = _lowered_kernels(make_transpose_append(
        PageLayoutSpec(num_kv_heads=2, head_dim=128, page_size=16, dtype="float16", kv_dtype=kv_dtype), sched), target)
    scripts = {name: f.script() for name, f in decode.items()}
    triggering = [name for name, s in scripts.items() if "launch_dependents" in s]
    assert len(triggering) == (2 if early else 0), triggering  # the merges of both kernel pairs
    assert all(("launch_dependents" in f.script()) == early for f in append.values())
    # page lookups (reads of the page indices, ``src_0_1``) before the wait: the plain split kernel
    looked_up = [name for name, s in scripts.items() if 'griddepcontrol("wait"' in s
                 and "src_0_1[" in s[:s.index('griddepcontrol("wait"')]]
    assert len(looked_up) == (1 if early else 0), looked_up


@pytest.mark.parametrize("kind", ["metal", "webgpu", "opencl"])
def test_decode_without_warp_shuffles(kind):
    source = device_source(make_paged_decode, "float32" if kind == "webgpu" else "float16", (("kind", kind),))
    assert "shfl" not in source and "simd_shuffle" not in source


@pytest.mark.parametrize("width", [32, 64, 96, 128, 256, 512])
def test_swizzle_is_a_permutation_of_16_byte_pieces(width):
    """Each row's columns are permuted (no two elements collide), 8-element pieces stay whole,
    and 8 consecutive rows put a given column in different pieces where the width allows."""
    from relax_kvcache.tir_kernels.attention_gpu import swizzled

    def col(row, d):
        return int(swizzled(row, d, width))  # constant-folded for Python ints

    for row in range(16):
        cols = [col(row, d) for d in range(width)]
        assert sorted(cols) == list(range(width))
        assert all(cols[d] - cols[d - d % 8] == d % 8 for d in range(width))
    pieces = {col(row, 0) // 8 for row in range(8)}
    assert len(pieces) == min(8, 1 << ((width // 8) & -(width // 8)).bit_length() - 1)


# ----------------------------------------------------------------------------- MLA tile


def _dynamic_shared_allocation(func, target) -> int:
    """Bytes of dynamic shared memory TVM allocates for ``func``'s kernel (after it merges the
    shared buffers; read off the IR before the host / device split)."""
    import re

    seen = []

    @tvm.ir.instrument.pass_instrument
    class Grab:
        def run_before_pass(self, mod, info):
            if info.name == "tirx.SplitHostDevice":
                seen.extend(int(n) * tvm.DataType(dtype).bits // 8 for n, dtype in re.findall(
                    r'alloc_buffer\(\((\d+),\), "(\w+)", scope="shared.dyn"\)', str(mod)))

    with tvm.transform.PassContext(opt_level=3, config=_pass_config(target), instruments=[Grab()]):
        tvm.tirx.build(func, target=target)
    assert len(seen) == 1, seen
    return seen[0]


@pytest.mark.parametrize("arch,chunk", [("sm_90", 64), ("sm_80", 64), ("sm_89", 32)])
def test_mla_tile_fits_the_shared_memory_it_claims(arch, chunk):
    """The absorbed MLA kernel picks its KV chunk from ``MlaTile.shared_bytes``; that estimate
    must bound what TVM really allocates (else the launch fails on the GPU) and fit the target."""
    from relax_kvcache.tir_kernels import make_paged_mla
    from relax_kvcache.tir_kernels.attention_gpu_mla import MlaTile

    target = make_target("cuda", arch=arch)
    sched = schedule_for(target)
    mla = spec("float16", heads=(16, 1), dim=576, v_dim=512)
    tile = MlaTile.choose(mla, sched)
    assert tile.kv_chunk == chunk
    assert _dynamic_shared_allocation(make_paged_mla(mla, sched), target) <= tile.shared_bytes() \
        <= sched.dynamic_shared_bytes


@pytest.mark.parametrize("heads", [8, 16, 32, 64, 128])
def test_mla_wgmma_tile_fits_the_shared_memory_it_claims(heads):
    """sm_90a's absorbed MLA kernel (warpgroup MMA): its tile buffer and the exchanged partial
    scores bound what TVM allocates and fit the GPU (below 64 heads the kernel also holds the
    mma.sync schedule for decode batches: two allocations, one per kernel)."""
    from relax_kvcache.tir_kernels import make_paged_mla
    from relax_kvcache.tir_kernels.attention_gpu_mla_wgmma import MlaWgmmaTile

    target = make_target("cuda", arch="sm_90a")
    sched = schedule_for(target)
    mla = spec("float16", heads=(heads, 1), dim=576, v_dim=512)
    tile = MlaWgmmaTile.choose(mla, sched)
    assert (tile.kv_chunk, tile.stages) == (32, 3)
    assert tile.kv_chunk * tile.width * 2 % 1024 == 0  # stages stay 1024-byte aligned
    assert tile.shared_bytes <= sched.dynamic_shared_bytes
    if heads >= 64:
        assert _dynamic_shared_allocation(make_paged_mla(mla, sched), target) <= 2 * tile.shared_elems


@pytest.mark.parametrize("case", [
    ({"arch": "sm_90"}, {}),  # no wgmma
    ({"arch": "sm_90a"}, {"kv_dtype": "float8_e4m3fn"}),  # 8-bit pages: the mma.sync kernel
    ({"arch": "sm_90a"}, {"heads": (48, 1)}),  # neither divides nor is a multiple of 64 rows
    ({"arch": "sm_90a"}, {"dim": 544}),  # not whole 64-wide column blocks
    ({"arch": "sm_90a"}, {"v_dim": 640, "dim": 704}),  # a warpgroup's half of O over 256 columns
])
def test_mla_wgmma_tile_not_used(case):
    from relax_kvcache.tir_kernels.attention_gpu_mla_wgmma import MlaWgmmaTile

    target, kw = case
    mla = spec("float16", **{"heads": (16, 1), "dim": 576, "v_dim": 512, **kw})
    assert MlaWgmmaTile.choose(mla, schedule_for(make_target("cuda", **target))) is None


@pytest.mark.skipif(__import__("shutil").which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sm90a_mla_runs_on_warpgroup_mma(tmp_path, dtype):
    """sm_90a's absorbed MLA kernel: Q K^T as 64 x 32 score tiles and P V over 256-column halves
    of O, on wgmma; chunk c's P V overlaps chunk c + 1's Q K^T, and ptxas keeps the groups
    asynchronous (no C7514 serialization)."""
    import subprocess

    from relax_kvcache.tir_kernels import make_paged_mla

    target = make_target("cuda", arch="sm_90a")
    func = make_paged_mla(spec(dtype, heads=(128, 1), dim=576, v_dim=512), schedule_for(target))
    with tvm.transform.PassContext(opt_level=3, config=_pass_config(target)):
        ex = tvm.compile(tvm.IRModule({"k": func.with_attr("global_symbol", "k")}), target=target)
    code = ex.mod.imports[0].inspect_source()
    operand = {"float16": "f16", "bfloat16": "bf16"}[dtype]
    assert f"{WGMMA}.m64n32k16.f32.{operand}.{operand}" in code
    assert f"{WGMMA}.m64n256k16.f32.{operand}.{operand}" in code
    assert "wgmma.wait_group.sync.aligned 1" in code and MMA not in code
    # fewer heads: decode batches take the mma.sync schedule, chosen at run time
    func16 = make_paged_mla(spec(dtype, heads=(16, 1), dim=576, v_dim=512), schedule_for(target))
    with tvm.transform.PassContext(opt_level=3, config=_pass_config(target)):
        ex16 = tvm.compile(tvm.IRModule({"k": func16.with_attr("global_symbol", "k")}), target=target)
    code16 = ex16.mod.imports[0].inspect_source()
    assert f"{WGMMA}.m64n32k16" in code16 and MMA in code16
    source = tmp_path / "mla.cu"
    source.write_text(code)
    proc = subprocess.run(["nvcc", "--cubin", "-O3", "-w", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
                           "-o", str(tmp_path / "mla.cubin"), str(source)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "C7514" not in proc.stderr and "serialized" not in proc.stderr, proc.stderr[-2000:]


# ----------------------------------------------------------------------------- Hopper (wgmma) tile

WGMMA = "wgmma.mma_async.sync.aligned"


@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 5, 8, 128])
def test_wgmma_tile_shape(dim, group):
    from relax_kvcache.tir_kernels.attention_gpu_wgmma import WgmmaTileShape

    sched = schedule_for(make_target("cuda", arch="sm_90a"))
    shape = WgmmaTileShape.choose(spec(heads=(2 * group, 2), dim=dim), sched)
    assert shape.rows == 64 * shape.warpgroups and shape.q_tokens == shape.rows // group >= 1
    assert shape.kv_chunk % 16 == 0 and shape.kv_chunk * dim * 2 % 1024 == 0  # stages stay 1024-byte aligned
    assert 2 <= shape.stages <= sched.wgmma_stages and shape.shared_bytes <= sched.dynamic_shared_bytes
    assert shape.producer and shape.threads == 128 * (shape.warpgroups + 1) and shape.loaders == 128


@pytest.mark.parametrize("case", [
    ("float32", {"kind": "cuda", "arch": "sm_90a"}, {}),
    ("float16", {"kind": "cuda", "arch": "sm_75"}, {}),  # no mma.sync m16n8k16 / cp.async
    ("float16", {"kind": "cuda", "arch": "sm_90a"}, {"dim": 96}),
    ("float16", {"kind": "cuda", "arch": "sm_90a"}, {"dim": 192, "v_dim": 128}),
    ("float16", {"kind": "cuda", "arch": "sm_90a"}, {"heads": (256, 1)}),  # group wider than the tile
])
def test_wgmma_tile_not_used(case):
    from relax_kvcache.tir_kernels.attention_gpu_wgmma import WgmmaTileShape

    dtype, target, kw = case
    assert WgmmaTileShape.choose(spec(dtype, **kw), schedule_for(tvm.target.Target(target))) is None


@pytest.mark.parametrize("factory", ["make_ragged_prefill", "make_paged_prefill", "make_prefixed_prefill"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sm90a_prefill_uses_warpgroup_mma(factory, dtype):
    """sm_90a prefill kernels hold the warpgroup-MMA tile (and the mma.sync one for inline RoPE)."""
    from relax_kvcache import tir_kernels

    source = device_source(getattr(tir_kernels, factory), dtype, SM90)
    operand = {"float16": "f16", "bfloat16": "bf16"}[dtype]
    assert f"{WGMMA}.m64n128k16.f32.{operand}.{operand}" in source  # Q K^T (64 keys x ...) and P V
    assert "cp.async.cg.shared.global" in source and "fence.proxy.async" in source
    assert "wgmma.wait_group.sync.aligned 1" in source  # P V of a chunk overlaps the next Q K^T
    assert MMA in source


@pytest.mark.parametrize("factory", ["make_ragged_prefill", "make_paged_prefill"])
def test_sm90a_prefill_is_warp_specialized(factory):
    """A producer warpgroup (few registers) fills the ring through shared-memory barriers; the two
    consumer warpgroups (the registers it gave back) take turns issuing their products."""
    from relax_kvcache import tir_kernels

    source = device_source(getattr(tir_kernels, factory), "float16", SM90)
    assert "__launch_bounds__(384)" in source
    assert "setmaxnreg.dec.sync.aligned.u32 80;" in source and "setmaxnreg.inc.sync.aligned.u32 208;" in source
    assert "mbarrier.init.shared::cta.b64" in source and "mbarrier.try_wait.parity.shared::cta.b64" in source
    assert "bar.sync %0, %1;" in source and "bar.arrive %0, %1;" in source  # ping-pong


def test_prefixed_prefill_and_8_bit_pages_copy_with_every_thread():
    """The prefixed kernel's two K/V sources and 8-bit pages (converted by the copying threads)
    keep the tile without a producer: every thread copies, one block barrier per chunk."""
    from relax_kvcache import tir_kernels
    from relax_kvcache.tir_kernels.attention_gpu_wgmma import WgmmaTileShape

    sched = schedule_for(make_target("cuda", arch="sm_90a"))
    assert WgmmaTileShape.choose(spec(), sched).producer
    assert not WgmmaTileShape.choose(spec(), sched, one_source=False).producer
    fp8 = WgmmaTileShape.choose(spec(kv_dtype="float8_e4m3fn"), sched)
    assert fp8 is not None and not fp8.producer and fp8.threads == 256
    source = device_source(tir_kernels.make_prefixed_prefill, "float16", SM90)
    assert "setmaxnreg" not in source and "mbarrier" not in source and WGMMA in source


@pytest.mark.parametrize("producer_regs", range(24, 169, 8))
def test_consumers_take_no_more_registers_than_the_producer_gives_back(producer_regs):
    """setmaxnreg.inc waits until the block's released registers cover it: budgets that ask for
    more than the producer releases would hang every block."""
    from relax_kvcache.tir_kernels.hopper import register_budgets

    start = 168  # 64 Ki registers over 384 threads, in steps of 8
    (consumer_name, _), (producer_name, _) = register_budgets(producer_regs)
    consumer = int(consumer_name.rsplit("_", 1)[1])
    assert producer_name.endswith(f"_{producer_regs}") and consumer % 8 == 0 and consumer >= start
    assert 2 * 128 * (consumer - start) <= 128 * (start - producer_regs)
    assert 2 * 128 * (consumer + 8 - start) > 128 * (start - producer_regs)  # and takes all it can


@pytest.mark.parametrize("arch,shared,chunk", [("sm_80", 163, 128), ("sm_86", 99, 64), ("sm_90", 227, 128)])
def test_ring_tile_runs_mma_sync_without_wgmma(arch, shared, chunk):
    """Without sm_90a's wgmma (sm_80 - sm_89, sm_90) the ring tile runs on mma.sync, sized for the
    target's opt-in shared memory."""
    from relax_kvcache.tir_kernels.attention_gpu_wgmma import WgmmaTileShape

    sched = schedule_for(make_target("cuda", arch=arch))
    shape = WgmmaTileShape.choose(spec("float16", heads=(32, 8), dim=128), sched)
    assert shape.sync and shape.kv_chunk == chunk and shape.stages >= 2
    assert 2 * shape.shared_elems <= shared * 1024


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sm80_prefill_reads_fragments_with_ldmatrix(dtype):
    """The sm_80 ring tile: cp.async ring, ldmatrix (K) and ldmatrix.trans (V) fragments, mma.sync."""
    source = device_source(make_ragged_prefill, dtype, SM80)
    assert "wgmma" not in source and "fence.proxy.async" not in source
    assert "cp.async.cg.shared.global" in source and MMA in source
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in source
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in source


@pytest.mark.skipif(__import__("shutil").which("nvcc") is None, reason="nvcc is not installed")
def test_sm80_prefill_assembles_without_spills(tmp_path):
    """The sm_80 ring tile keeps Q fragments, scores and accumulators in registers: 128 KV rows
    per chunk for head_dim 128 without spilling."""
    import subprocess

    source = tmp_path / "prefill.cu"
    source.write_text(device_source(make_ragged_prefill, "float16", SM80))
    proc = subprocess.run(["nvcc", "--cubin", "-O3", "-w", "-gencode=arch=compute_80,code=sm_80", "-Xptxas", "-v",
                           "-o", str(tmp_path / "prefill.cubin"), str(source)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.count(" 0 bytes spill stores") == proc.stderr.count("spill stores"), proc.stderr[-2000:]


def test_wgmma_tile_fits_the_shared_memory_it_claims():
    from relax_kvcache.tir_kernels.attention_gpu_wgmma import WgmmaTileShape

    target = make_target("cuda", arch="sm_90a")
    sched = schedule_for(target)
    llama = spec("float16", heads=(32, 8), dim=128)
    shape = WgmmaTileShape.choose(llama, sched)
    assert (shape.rows, shape.kv_chunk, shape.stages) == (128, 128, 3)
    assert _dynamic_shared_allocation(make_ragged_prefill(llama, sched), target) <= 2 * shape.shared_elems \
        <= sched.dynamic_shared_bytes


@pytest.mark.skipif(__import__("shutil").which("nvcc") is None, reason="nvcc is not installed")
def test_sm90a_prefill_assembles_without_serialized_wgmma(tmp_path):
    """ptxas accepts the sm_90a prefill kernel and keeps its wgmma groups asynchronous: it warns
    (C7514) when code touches a wgmma's registers while it may still run, and serializes."""
    import subprocess

    source = tmp_path / "prefill.cu"
    source.write_text(device_source(make_ragged_prefill, "float16", SM90))
    proc = subprocess.run(["nvcc", "--cubin", "-O3", "-w", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
                           "-o", str(tmp_path / "prefill.cubin"), str(source)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "C7514" not in proc.stderr and "serialized" not in proc.stderr, proc.stderr[-2000:]
    assert "spill" in proc.stderr and " 0 bytes spill stores" in proc.stderr  # the accumulators stay in registers


@pytest.mark.skipif(__import__("shutil").which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_decode_kernel_fits_the_wave_it_is_split_for(tmp_path, dtype):
    """A 4:1 GQA decode runs on tensor cores, and decode splits a batch's KV until
    ``decode_mma_wave_blocks`` blocks run (three per H100 SM): that many are resident only if
    both decode kernels (rope-free and inline-RoPE, one of which runs) need at most
    65536 / (3 x 128) registers per thread (ptxas reports each kernel)."""
    import re
    import subprocess

    from relax_kvcache import tir_kernels

    sched = schedule_for(make_target("cuda", arch="sm_90a"))
    code = device_source(tir_kernels.make_paged_decode, dtype, SM90)
    assert code.count("mma.sync.aligned.m16n8k16") >= 2  # Q K^T and V^T P^T
    source = tmp_path / "decode.cu"
    source.write_text(code)
    proc = subprocess.run(["nvcc", "--cubin", "-O3", "-w", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
                           "-o", str(tmp_path / "decode.cubin"), str(source)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    registers = sorted(int(n) for n in re.findall(r"Used (\d+) registers", proc.stderr))
    # two merges (few registers) and the two decode kernels
    assert len(registers) == 4, proc.stderr[-2000:]
    assert registers[3] * sched.threads * (sched.decode_mma_wave_blocks // 132) <= 65536, registers
