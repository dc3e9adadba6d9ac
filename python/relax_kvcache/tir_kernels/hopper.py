"""Hopper pieces of the warpgroup-MMA tiles (MHA and MLA): the 128-byte swizzled shared layout,
register fences, shared-memory and named barriers, and register budgets of warp-specialized
blocks, as inline CUDA for ``T.cuda.func_call``."""

from __future__ import annotations

import functools

from tvm import tirx
from tvm.script import tirx as T

WG_THREADS = 128
WG_ROWS = 64  # query rows of one warpgroup: wgmma's M
SWIZZLE_128B = 3  # T.cuda.wgmma.encode_matrix_descriptor's code for the 128-byte swizzle
ALIGN_ELEMS = 512  # slack of the shared buffer (1024 bytes of 16-bit elements) for aligning it


def sw128(r, c, rows: int):
    """Element offset of (row r, column c) in a ``rows``-row tile in the 128-byte swizzled
    layout (``rows x 64`` column blocks, 16-byte pieces XOR-permuted by ``r % 8``)."""
    return (c // 64) * (rows * 64) + r * 64 + tirx.bitwise_xor((c % 64) // 8, r % 8) * 8 + c % 8


def aligned_base(smem):
    """Element offset of the first 1024-byte aligned 16-bit element of the shared buffer
    ``smem``: the swizzle pattern follows absolute shared addresses, so tiles start there
    (``ALIGN_ELEMS`` of slack cover it)."""
    return T.Cast("int32", ((T.uint32(1024) - (T.cuda.cvta_generic_to_shared(
        T.address_of(smem[0])) & T.uint32(1023))) & T.uint32(1023)) >> T.uint32(1))


#: (function name, CUDA source) of the register fences, by register dtype
FENCES = {
    "float32": ("relax_kvcache_fence_f32", "__forceinline__ __device__ void relax_kvcache_fence_f32(float& r) "
                '{ asm volatile("" : "+f"(r) :: "memory"); }'),
    "uint32": ("relax_kvcache_fence_u32", "__forceinline__ __device__ void relax_kvcache_fence_u32(unsigned int& r) "
               '{ asm volatile("" : "+r"(r) :: "memory"); }'),
}


@T.macro
def fence_registers(buf, count, name, source):
    """Tie ``count`` registers of ``buf`` to this point (an empty ``asm volatile``; ``name`` /
    ``source``: one of :data:`FENCES`), so that no access to them moves above a wgmma wait."""
    for i in T.unroll(count):
        T.evaluate(T.cuda.func_call(name, buf[i], source_code=source))


def device_function(name: str, signature: str, body: str):
    """(name, CUDA source) of an inline device function for ``T.cuda.func_call``."""
    return name, f"__forceinline__ __device__ void {name}({signature}) {{ {body} }}"


def call(fn, *args):
    """``T.cuda.func_call`` of a :func:`device_function`."""
    return T.cuda.func_call(fn[0], *args, source_code=fn[1])


def _smem(ptr: str) -> str:
    return f"static_cast<unsigned>(__cvta_generic_to_shared({ptr}))"


#: Shared-memory barriers (``mbarrier``: init with an arrival count, arrive, wait for the phase
#: of a parity) and named block barriers (``bar.sync`` / ``bar.arrive`` with a thread count).
MBAR_INIT = device_function("relax_kvcache_mbar_init", "void* bar, unsigned count",
                             'asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"('
                             + _smem("bar") + '), "r"(count) : "memory");')
MBAR_ARRIVE = device_function("relax_kvcache_mbar_arrive", "void* bar",
                               'asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"('
                               + _smem("bar") + ') : "memory");')
MBAR_WAIT = device_function(
    "relax_kvcache_mbar_wait", "void* bar, unsigned parity",
    'asm volatile("{\\n.reg .pred p;\\nWAIT_%=:\\n'
    'mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\\n@!p bra WAIT_%=;\\n}" :: "r"('
    + _smem("bar") + '), "r"(parity) : "memory");')
BAR_SYNC = device_function("relax_kvcache_bar_sync", "unsigned id, unsigned count",
                            'asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(count) : "memory");')
BAR_ARRIVE = device_function("relax_kvcache_bar_arrive", "unsigned id, unsigned count",
                              'asm volatile("bar.arrive %0, %1;" :: "r"(id), "r"(count) : "memory");')


def ping_pong(enabled: bool):
    """Macros by which two consumer warpgroups take turns issuing their matrix products (named
    barriers 1 and 2; nothing where not ``enabled``): ``first_turn(wg, any)`` lets group 0 go
    first, ``my_turn(wg)`` waits before a group issues, ``your_turn(wg, last)`` hands over after.
    Every wait meets exactly one arrival of the other group (group 1's last hand-over is left
    out: group 0 has no turn after it)."""

    @T.macro
    def first_turn(wg, any_turn):
        if enabled:
            if T.And(wg == 1, any_turn):
                T.evaluate(call(BAR_ARRIVE, T.uint32(1), T.uint32(2 * WG_THREADS)))

    @T.macro
    def my_turn(wg):
        if enabled:
            T.evaluate(call(BAR_SYNC, T.Cast("uint32", 1 + wg), T.uint32(2 * WG_THREADS)))

    @T.macro
    def your_turn(wg, last):
        if enabled:
            if T.Or(wg == 0, T.Not(last)):
                T.evaluate(call(BAR_ARRIVE, T.Cast("uint32", 2 - wg), T.uint32(2 * WG_THREADS)))

    return first_turn, my_turn, your_turn


def register_budgets(producer_regs: int):
    """``setmaxnreg`` of the consumer and the producer warpgroups. A block of three warpgroups
    starts with 168 registers a thread (64 Ki over 384 threads, in steps of 8); the producer
    gives back all but ``producer_regs``, and the consumers take what it gave back (a
    ``setmaxnreg.inc`` waits until the block's released registers cover it: never more)."""
    start = 64 * 1024 // (3 * WG_THREADS) // 8 * 8
    consumer = (3 * start - producer_regs) // 2 // 8 * 8
    return (device_function(f"relax_kvcache_regs_consumer_{consumer}", "",
                             f'asm volatile("setmaxnreg.inc.sync.aligned.u32 {consumer};");'),
            device_function(f"relax_kvcache_regs_producer_{producer_regs}", "",
                             f'asm volatile("setmaxnreg.dec.sync.aligned.u32 {producer_regs};");'))


def ptx(name: str):
    """``T.ptx.<name>`` for a dotted PTX instruction name."""
    return functools.reduce(getattr, name.split("."), T.ptx)
