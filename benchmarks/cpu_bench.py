"""CPU benchmark: relax_kvcache vs TVM's native C++ cache with TVM's CPU kernels, side by side.

Both caches get the same inputs in one process. Reported per shape:

* decode: time of one layer's ``attention_with_fused_qkv`` in a decode step (split + RoPE +
  append + attention), KV bytes read per second, ratio ours/native, and the fraction of the
  machine's measured read bandwidth (roofline = KV bytes / bandwidth);
* prefill: time of one layer's attention call for fresh prompts (causal) and for a chunk on
  top of a cached context, TFLOP/s (4 * heads * head_dim per visible query-key pair) against
  the measured fp32 matrix rate;
* host: ``begin_forward`` + metadata sync (``get_query_positions``) + ``end_forward`` for
  1..256 decode sequences.

Usage: ``python benchmarks/cpu_bench.py [--quick]``. Shapes: fp32, 32 query / 8 KV heads,
head_dim 128, page 16 (Llama-3-8B attention).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable, List, Optional, Tuple

import numpy as np  # noqa: E402
import tvm  # noqa: E402
from tvm.runtime import ShapeTuple  # noqa: E402
from tvm.script import tirx as T  # noqa: E402

import relax_kvcache as rk  # noqa: E402
from relax_kvcache.ffi_registry import original  # noqa: E402
from native_baseline import Shape, create_native  # noqa: E402  (TVM's native cache + TVM's CPU kernels)

HQ, HKV, D, PAGE, DTYPE = 32, 8, 128, 16, "float32"


# ----------------------------------------------------------------------------- ceilings

def measure_read_bandwidth(num_bytes: int = 1 << 29) -> float:
    """Bytes/s of a parallel, vectorised TIR reduction over a large float32 buffer."""
    n = num_bytes // 4
    chunks = 256

    @T.prim_func(s_tir=True)
    def read_all(var_a: T.handle, var_out: T.handle):
        a = T.match_buffer(var_a, (chunks, n // chunks // 8, 8), "float32")
        out = T.match_buffer(var_out, (chunks, 8), "float32")
        for c in T.parallel(chunks):
            with T.sblock("sum"):
                T.reads()
                T.writes()
                acc = T.sblock_alloc_buffer((8,), "float32")
                for x in T.vectorized(8):
                    acc[x] = T.float32(0)
                for i in T.serial(n // chunks // 8):
                    for x in T.vectorized(8):
                        acc[x] = acc[x] + a[c, i, x]
                for x in T.vectorized(8):
                    out[c, x] = acc[x]

    lib = tvm.compile(tvm.IRModule({"read_all": read_all}), target=rk.runtime.default_target(tvm.cpu()))
    a = tvm.runtime.tensor(np.ones((chunks, n // chunks // 8, 8), np.float32))
    out = tvm.runtime.empty((chunks, 8), "float32")
    f = lib["read_all"]
    f(a, out)
    return num_bytes / min(_timeit(lambda: f(a, out), 5))


def measure_matmul_rate(size: int = 2048) -> float:
    """FLOP/s of a float32 matrix multiply (numpy's BLAS, all threads)."""
    x = np.random.default_rng(0).standard_normal((size, size)).astype(np.float32)
    x @ x
    return 2 * size ** 3 / min(_timeit(lambda: x @ x, 3))


def _timeit(fn: Callable[[], object], repeat: int) -> List[float]:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


# ----------------------------------------------------------------------------- drivers

class Driver:
    """Drives one cache through the vm.builtin conventions (TVM's own builtins for native)."""

    def __init__(self, name: str, cache, native: bool) -> None:
        self.name, self.cache = name, cache
        # TVM's own builtins for its cache (no Python dispatch in the way), the dispatchers for ours.
        get = (lambda n: original("vm.builtin." + n)) if native else (lambda n: tvm.get_global_func("vm.builtin." + n))
        self.add = get("kv_state_add_sequence")
        self.remove = get("kv_state_remove_sequence")
        self.begin = get("kv_state_begin_forward")
        self.end = get("kv_state_end_forward")
        self.popn = get("kv_state_popn")
        self.attn = get("attention_kv_cache_attention_with_fused_qkv")
        self.query_positions = get("attention_kv_cache_get_query_positions")

    def step(self, seq_ids, lengths, qkvs, outs, sm_scale) -> List[float]:
        """One forward step; returns the seconds of each layer's attention call."""
        self.begin(self.cache, ShapeTuple(seq_ids), ShapeTuple(lengths))
        times = []
        for layer, (qkv, out) in enumerate(zip(qkvs, outs)):
            start = time.perf_counter()
            self.attn(self.cache, layer, sm_scale, qkv, out)
            times.append(time.perf_counter() - start)
        self.end(self.cache)
        return times


def make_pair(num_layers: int, max_tokens: int, chunk: int, max_seqs: int, heads=(HQ, HKV, D),
              layer_window: Optional[int] = None) -> List[Driver]:
    """Our cache and TVM's native one of one shape; ``layer_window``: every layer MHA_SLIDING."""
    hq, hkv, d = heads
    windowed = {} if layer_window is None else dict(attn_kinds=(int(rk.AttnKind.MHA_SLIDING),) * num_layers,
                                                     layer_window=layer_window)
    shape = Shape(num_layers=num_layers, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=PAGE,
                  max_num_seqs=max_seqs, max_total_seq_len=max_tokens, prefill_chunk_size=chunk,
                  rope_mode=int(rk.RopeMode.NORMAL), dtype=DTYPE, **windowed)
    return [Driver("ours", rk.PagedAttentionKVCache(shape.our_config()), native=False),
            Driver("native", create_native(shape), native=True)]


def random_qkv(rng, num_layers: int, n: int, heads=(HQ, HKV, D)):
    hq, hkv, d = heads
    qkvs = [tvm.runtime.tensor(rng.standard_normal((n, hq + 2 * hkv, d)).astype(DTYPE)) for _ in range(num_layers)]
    outs = [tvm.runtime.empty((n, hq, d), DTYPE) for _ in range(num_layers)]
    return qkvs, outs


# ----------------------------------------------------------------------------- benchmarks

def bench_decode(batch: int, context: int, steps: int, rng) -> dict:
    layers = 2
    drivers = make_pair(layers, batch * (context + steps + PAGE) + 64, context, batch)
    sm_scale = D ** -0.5
    for drv in drivers:
        for s in range(batch):
            drv.add(drv.cache, s)
            qkvs, outs = random_qkv(rng, layers, context)
            drv.step([s], [context], qkvs, outs, sm_scale)
    result = {}
    bytes_per_layer = batch * context * HKV * D * 2 * 4
    for drv in drivers:
        times = []
        for _ in range(steps):
            qkvs, outs = random_qkv(rng, layers, batch)
            times += drv.step(list(range(batch)), [1] * batch, qkvs, outs, sm_scale)
        result[drv.name] = statistics.median(times)
    result["bytes"] = bytes_per_layer
    return result


def bench_prefill(batch: int, length: int, cached: int, rng) -> dict:
    layers = 1
    drivers = make_pair(layers, batch * (cached + length) + 64, max(batch * length, cached), batch)
    sm_scale = D ** -0.5
    pairs = batch * (length * cached + length * (length + 1) // 2)
    result = {"flops": 4 * HQ * D * pairs}
    for drv in drivers:
        for s in range(batch):
            drv.add(drv.cache, s)
            if cached:
                qkvs, outs = random_qkv(rng, layers, cached)
                drv.step([s], [cached], qkvs, outs, sm_scale)
        qkvs, outs = random_qkv(rng, layers, batch * length)
        result[drv.name] = drv.step(list(range(batch)), [length] * batch, qkvs, outs, sm_scale)[0]
    return result


def bench_host(batch_sizes: Tuple[int, ...], repeat: int, layer_window: Optional[int] = None,
               staggered: bool = False) -> List[Tuple[int, float, float, float, float]]:
    """Median seconds of begin_forward + metadata sync + end_forward for decode batches of
    sequences of ~100 tokens: (n, ours repeated, ours planned in full, native, FFI floor:
    :func:`ffi_floor`). With
    ``layer_window`` the layer is MHA_SLIDING (Mistral / Gemma style): ours then recomputes the
    window pages of repeated steps too. ``staggered``: sequence i starts with 100 + i % 16 tokens, so
    that last pages fill at different steps, as in serving (else together, one step in 16).

    Each cell is the median of ``repeat`` steps.

    "Repeated" is a serving loop's steady state: the same batch step after step (ours derives
    the step from the previous one, see ``relax_kvcache.decode_plan``). "Planned in full" pops
    the token after each step, so every step is a new batch to ours (native plans every step
    in full anyway).
    """
    heads = (4, 1, 16)
    max_seqs = max(batch_sizes)
    drivers = make_pair(1, max_seqs * (160 + 2 * repeat * len(batch_sizes)) + 64, 2048, max_seqs, heads,
                        layer_window=layer_window)
    for drv in drivers:
        add_sequences(drv, max_seqs, staggered)
    results = {}
    for drv in drivers:
        for n in batch_sizes:
            ids = ShapeTuple(list(range(n)))
            ones = ShapeTuple([1] * n)
            for mode in ("repeated", "full"):
                times = []
                for i in range(repeat + 2):
                    start = time.perf_counter()
                    drv.begin(drv.cache, ids, ones)
                    drv.query_positions(drv.cache)
                    drv.end(drv.cache)
                    if i >= 2:
                        times.append(time.perf_counter() - start)
                    if mode == "full":
                        for s in range(n):
                            drv.popn(drv.cache, s, 1)
                results[(drv.name, n, mode)] = statistics.median(times)
    return [(n, results[("ours", n, "repeated")], results[("ours", n, "full")],
             statistics.median([results[("native", n, m)] for m in ("repeated", "full")]),
             ffi_floor(drivers[0].cache, n, repeat)) for n in batch_sizes]


def add_sequences(drv: Driver, n: int, staggered: bool) -> None:
    """Add sequences 0..n-1 and prefill them with 100 tokens each (``staggered``: 100 + i % 16),
    16 a step."""
    for s in range(n):
        drv.add(drv.cache, s)
    for first in range(0, n, 16):
        ids = list(range(first, min(first + 16, n)))
        drv.begin(drv.cache, ShapeTuple(ids), ShapeTuple([100 + (s % PAGE if staggered else 0) for s in ids]))
        drv.end(drv.cache)


def bench_churn(batch_sizes: Tuple[int, ...], repeat: int) -> List[Tuple[int, float, float]]:
    """Median seconds of a continuous-batching decode step, (n, ours, native): one sequence of
    the batch of n leaves (``remove_sequence``, timed) and one joins at the end, added and
    prefilled with 100 tokens outside the timing, then the decode step of the new batch
    (begin_forward + metadata sync + end_forward, timed). Sequences start with 100 + i % 16
    tokens, so that last pages fill at different steps."""
    rows = []
    for n in batch_sizes:
        times = {}
        for drv in make_pair(1, (n + 1) * (200 + 2 * repeat) + 64, 2048, n + 1, (4, 1, 16)):
            batch = list(range(n))
            add_sequences(drv, n, staggered=True)
            spent = []
            for i in range(repeat + 2):
                joining = n + i
                drv.add(drv.cache, joining)
                drv.begin(drv.cache, ShapeTuple([joining]), ShapeTuple([100]))
                drv.end(drv.cache)
                start = time.perf_counter()
                drv.remove(drv.cache, batch.pop(0))
                removed = time.perf_counter() - start
                batch.append(joining)
                start = time.perf_counter()
                drv.begin(drv.cache, ShapeTuple(batch), ShapeTuple([1] * n))
                drv.query_positions(drv.cache)
                drv.end(drv.cache)
                if i >= 2:
                    spent.append(removed + time.perf_counter() - start)
            times[drv.name] = statistics.median(spent)
        rows.append((n, times["ours"], times["native"]))
    return rows


def ffi_floor(cache, n: int, repeat: int) -> float:
    """Median seconds of the three calls of a host step (begin_forward with n ids and lengths,
    get_query_positions, end_forward) made to Python functions that do nothing, registered and
    called as our builtins are: the least any Python cache pays for a step through vm.builtin."""
    for name, arity in (("begin", 3), ("positions", 1), ("end", 1)):
        tvm.register_global_func(f"relax_kvcache_bench.noop_{name}",
                                 (lambda *a: None) if arity != 3 else (lambda c, i, l: None), override=True)
    begin, positions, end = (tvm.get_global_func(f"relax_kvcache_bench.noop_{name}")
                             for name in ("begin", "positions", "end"))
    ids, ones = ShapeTuple(list(range(n))), ShapeTuple([1] * n)
    times = []
    for _ in range(repeat * 10):
        start = time.perf_counter()
        begin(cache, ids, ones)
        positions(cache)
        end(cache)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def print_host_tables(batch_sizes: Tuple[int, ...], repeat: int, rounds: int = 1) -> None:
    """The host tables: a plain layer (sequences of equal, then of staggered lengths), then an
    MHA_SLIDING layer (window 64); each cell the least of ``rounds`` runs of `bench_host` on new
    caches (this machine's noise only adds)."""
    for title, window, staggered in (("", None, False), (", staggered lengths", None, True),
                                     (" (MHA_SLIDING layer, window 64)", 64, False)):
        runs = [bench_host(batch_sizes, repeat, layer_window=window, staggered=staggered) for _ in range(rounds)]
        rows = [tuple(min(column) for column in zip(*cells)) for cells in zip(*runs)]
        print()
        print(f"Host: begin_forward + metadata sync + end_forward, decode batch (us){title}; ours repeated = the "
              "same batch as the step before, ours full = a new batch")
        print(f"{'sequences':>10} {'ours repeated':>14} {'ours full':>10} {'native':>8} {'repeated/native':>16} "
              f"{'full/native':>12} {'FFI floor':>10} {'floor/native':>13}")
        for n, repeated, full, native, floor in rows:
            print(f"{n:>10} {repeated * 1e6:14.1f} {full * 1e6:10.1f} {native * 1e6:8.1f} "
                  f"{repeated / native:15.2f}x {full / native:11.1f}x {floor * 1e6:10.1f} {floor / native:12.2f}x")
    print("(FFI floor: the same three calls made to Python functions that do nothing, registered and called as "
          "ours are)")
    runs = [bench_churn(batch_sizes, repeat) for _ in range(rounds)]
    print()
    print("Host: continuous batching, decode batch (us): each step one sequence leaves (remove_sequence) and one "
          "joins (added and prefilled outside the timing), then begin_forward + metadata sync + end_forward")
    print(f"{'sequences':>10} {'ours':>8} {'native':>8} {'ours/native':>12}")
    for cells in zip(*runs):
        n, ours, native = (min(column) for column in zip(*cells))
        print(f"{n:>10} {ours * 1e6:8.1f} {native * 1e6:8.1f} {ours / native:11.2f}x")


def bench_layer_overhead(repeat: int = 3000) -> Tuple[float, ...]:
    """Python cost of one ``attention_with_fused_qkv`` decode call with every kernel replaced by
    a no-op (what the cache adds on top of its kernel launches): (direct, via vm.builtin, via
    vm.builtin with new tensor objects every call, as a Relax VM passes them, and the FFI floor:
    a Python function that does nothing, registered and called the same way, with the same and
    with new tensors). The first two pass the same qkv / o every call (checked once per step)."""
    import types

    cfg = rk.KVCacheConfig(num_layers=1, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PAGE,
                           max_num_seqs=1, max_total_seq_len=256, prefill_chunk_size=64,
                           rope_mode=rk.RopeMode.NORMAL, dtype=DTYPE)
    cache = rk.PagedAttentionKVCache(cfg)
    cache.add_sequence(0)
    qkv = tvm.runtime.tensor(np.ones((1, HQ + 2 * HKV, D), DTYPE))
    out = tvm.runtime.empty((1, HQ, D), DTYPE)
    cache.begin_forward([0], [1])
    kernels = cache._attention.kernels  # the kernels the cache's attention component launches
    cache._attention.kernels = types.SimpleNamespace(**{k: (lambda *a: None) for k in dir(kernels)
                                                         if not k.startswith("_")})
    attn = tvm.get_global_func("vm.builtin.attention_kv_cache_attention_with_fused_qkv")
    direct = statistics.median(_timeit(lambda: cache.attention_with_fused_qkv(0, qkv, out, 0.1), repeat))
    builtin = statistics.median(_timeit(lambda: attn(cache, 0, 0.1, qkv, out), repeat))
    views = iter([(tvm.runtime.tensor(np.ones((1, HQ + 2 * HKV, D), DTYPE)), tvm.runtime.empty((1, HQ, D), DTYPE))
                  for _ in range(repeat)])
    fresh = statistics.median(_timeit(lambda: attn(cache, 0, 0.1, *next(views)), repeat))
    tvm.register_global_func("relax_kvcache_bench.noop_attention", lambda c, layer, scale, a, b: None, override=True)
    noop = tvm.get_global_func("relax_kvcache_bench.noop_attention")
    floor = statistics.median(_timeit(lambda: noop(cache, 0, 0.1, qkv, out), repeat))
    views = iter([(tvm.runtime.tensor(np.ones((1, HQ + 2 * HKV, D), DTYPE)), tvm.runtime.empty((1, HQ, D), DTYPE))
                  for _ in range(repeat)])
    floor_fresh = statistics.median(_timeit(lambda: noop(cache, 0, 0.1, *next(views)), repeat))
    cache._attention.kernels = kernels
    cache.end_forward()
    return direct, builtin, fresh, floor, floor_fresh


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer shapes (the issue's 8 x 512 decode only)")
    parser.add_argument("--host-only", action="store_true",
                        help="only the host work: begin_forward tables (plain and MHA_SLIDING layers) and the "
                             "per-layer Python cost")
    args = parser.parse_args()
    if args.host_only:
        print(f"relax_kvcache CPU host benchmark, TVM {tvm.__version__}", flush=True)
        print_host_tables((1, 8, 32, 64, 128, 256), repeat=20, rounds=5)
        print_layer_overhead(least_layer_overhead(rounds=5))
        return
    rng = np.random.default_rng(0)
    print(f"relax_kvcache CPU benchmark, TVM {tvm.__version__}, TVM_NUM_THREADS={os.environ.get('TVM_NUM_THREADS')}, "
          f"target {rk.runtime.default_target(tvm.cpu())}", flush=True)
    bandwidth = measure_read_bandwidth()
    matmul = measure_matmul_rate()
    print(f"measured ceilings: read bandwidth {bandwidth / 1e9:.1f} GB/s, fp32 matmul {matmul / 1e9:.0f} GFLOP/s",
          flush=True)

    decode_shapes = [(8, 512)] if args.quick else [(1, 1024), (8, 512), (16, 1024)]
    decode_rows = []
    for batch, context in decode_shapes:
        print(f"decode {batch} x {context} ...", flush=True)
        r = bench_decode(batch, context, steps=12, rng=rng)
        decode_rows.append((batch, context, r))
    prefill_shapes = [] if args.quick else [(1, 512, 0), (4, 128, 0), (1, 256, 512)]
    prefill_rows = []
    for batch, length, cached in prefill_shapes:
        print(f"prefill {batch} x {length} (+{cached} cached) ...", flush=True)
        prefill_rows.append((batch, length, cached, bench_prefill(batch, length, cached, rng)))
    layer_overhead = least_layer_overhead(rounds=5)
    print("host begin_forward ...", flush=True)
    host_sizes = (1, 8, 32, 64, 128, 256) if not args.quick else (1, 32, 256)

    print()
    print(f"Decode, one layer of attention_with_fused_qkv (fp32, {HQ}/{HKV} heads, head_dim {D}, page {PAGE})")
    print(f"{'batch x ctx':>12} {'ours ms':>9} {'native ms':>10} {'ours GB/s':>10} {'native GB/s':>12} "
          f"{'speedup':>8} {'ours % of BW':>13}")
    for batch, context, r in decode_rows:
        gbs_ours, gbs_native = r["bytes"] / r["ours"] / 1e9, r["bytes"] / r["native"] / 1e9
        print(f"{batch:>5} x {context:<5} {r['ours'] * 1e3:9.2f} {r['native'] * 1e3:10.2f} {gbs_ours:10.2f} "
              f"{gbs_native:12.2f} {r['native'] / r['ours']:7.1f}x {100 * gbs_ours * 1e9 / bandwidth:12.0f}%")
    if prefill_rows:
        print()
        print("Prefill, one layer of attention_with_fused_qkv (causal)")
        print(f"{'batch x len (+cached)':>22} {'ours ms':>9} {'native ms':>10} {'ours GFLOP/s':>13} "
              f"{'native GFLOP/s':>15} {'speedup':>8} {'ours % of matmul':>17}")
        for batch, length, cached, r in prefill_rows:
            f_ours, f_native = r["flops"] / r["ours"] / 1e9, r["flops"] / r["native"] / 1e9
            print(f"{batch:>5} x {length:<5} (+{cached:<4})   {r['ours'] * 1e3:9.2f} {r['native'] * 1e3:10.2f} "
                  f"{f_ours:13.1f} {f_native:15.2f} {r['native'] / r['ours']:7.1f}x "
                  f"{100 * f_ours * 1e9 / matmul:16.1f}%")
    print_host_tables(host_sizes, repeat=20)
    print_layer_overhead(layer_overhead)


def least_layer_overhead(rounds: int) -> Tuple[float, ...]:
    """Each figure of `bench_layer_overhead` as the least of ``rounds`` runs (this machine's
    noise only adds)."""
    return tuple(min(column) for column in zip(*(bench_layer_overhead() for _ in range(rounds))))


def print_layer_overhead(layer_overhead: Tuple[float, ...]) -> None:
    direct, builtin, fresh, floor, floor_fresh = (t * 1e6 for t in layer_overhead)
    print()
    print(f"Per-layer Python cost of attention_with_fused_qkv (kernels replaced by no-ops, decode of 1; each the "
          f"least of 5 runs' medians): "
          f"{direct:.1f} us called directly, {builtin:.1f} us through vm.builtin from Python, {fresh:.1f} us "
          f"through vm.builtin with new qkv / o tensors every call; FFI floor (a registered Python function that "
          f"does nothing, same arguments): {floor:.1f} us, {floor_fresh:.1f} us with new tensors")


if __name__ == "__main__":
    main()
