"""GPU benchmark: relax_kvcache vs TVM's native C++ cache with TVM's kernels, side by side.

Both caches run in one process on the same inputs, with the kernels ``gpu_prepare.py`` built
(ours and TVM's CUDA kernels, fp16, 32 query / 8 KV heads, head_dim 128, page 16). Reported:

* decode (batch x context): time of one layer's ``attention_with_fused_qkv`` (split + RoPE +
  append + attention; ``begin_forward`` excluded), averaged over many calls within one step,
  and the K/V bytes it reads per second against the measured device-to-device copy bandwidth
  (the roofline: a copy reads and writes, and both count);
* prefill (batch x prompt, causal): the same call's time and TFLOP/s, with
  FLOPs = 4 * num_qo_heads * head_dim * (visible query-key pairs);
* one whole decode step (``begin_forward`` + every layer + ``end_forward``, synchronised) of
  1 x 1024 with 8 layers;
* for every shape, the max abs difference between our output and TVM's on the same inputs;
* with ``--prefill DIR`` (libraries of ``gpu_prefill_bench.py --prepare``), causal prefill
  1 x 2048, 8 x 512, 1 x 8192 and 4 x 4096 in float16 and bfloat16, ragged and over a cached
  first half, against PyTorch SDPA's FlashAttention-2 and cuDNN backends and TVM's kernels in
  the same process (``gpu_prefill_bench.py``'s table: TFLOP/s and ratios).

Ratios are ours / native times (below 1: ours is faster). Timing: calls are queued back to back
between two device synchronisations, so Python launch overhead counts where the GPU would
otherwise wait for it.

Usage::

    python benchmarks/gpu_bench.py --libs .gpu [--quick]    # on the GPU host
    python benchmarks/gpu_bench.py --device cpu [--quick]    # here: CPU kernels built in process, small shapes
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import pathlib
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpu_prepare as gp  # noqa: E402  (also puts python/ on sys.path)

import tvm  # noqa: E402
from tvm.runtime import ShapeTuple  # noqa: E402

import relax_kvcache as rk  # noqa: E402
from relax_kvcache import reference  # noqa: E402
from relax_kvcache.ffi_registry import original  # noqa: E402
from native_baseline import CREATE_NATIVE, Shape, create_args  # noqa: E402

DIFF_WARN = 2e-2  # ours vs native outputs (fp16) beyond this are flagged


# ----------------------------------------------------------------------------- kernels and caches

@dataclasses.dataclass
class Kernels:
    """Both kernel sets of the benchmark shape (None: not available)."""

    shape: Shape
    ours: Optional[rk.KernelSet]
    tvm: Optional[Dict[str, object]]
    source: str


def kernels_from_libs(libs: pathlib.Path, device: tvm.runtime.Device) -> Kernels:
    """The benchmark kernels from a folder prepared by ``gpu_prepare.py``."""
    bench = gp.read_manifest(libs)["bench"]
    ours = tvm_kernels = None
    if bench.get("ours"):
        ours = rk.KernelSet.from_module(gp.load_library(libs / bench["ours"], device))
    if bench.get("tvm"):
        tvm_kernels = gp.tvm_kernel_dict(gp.load_library(libs / bench["tvm"], device))
    return Kernels(gp.shape_from_json(bench["shape"]), ours, tvm_kernels, f"libraries from {libs}")


def robust_kernels(libs: pathlib.Path, device: tvm.runtime.Device) -> Dict[str, Kernels]:
    """The robustness shapes' kernels (``gpu_prepare.ROBUST_SHAPES``) from a prepared folder."""
    kernels = {}
    for name, entry in gp.read_manifest(libs).get("robust", {}).items():
        ours = rk.KernelSet.from_module(gp.load_library(libs / entry["ours"], device)) if entry["ours"] else None
        native = gp.tvm_kernel_dict(gp.load_library(libs / entry["tvm"], device)) if entry["tvm"] else None
        kernels[name] = Kernels(gp.shape_from_json(entry["shape"]), ours, native, f"libraries from {libs}")
    return kernels


def kernels_built_here(dtype: Optional[str]) -> Kernels:
    """The benchmark kernels for this machine's CPU, compiled in process."""
    shape = dataclasses.replace(gp.BENCH_SHAPE, dtype=dtype or gp.BENCH_SHAPE.dtype)
    target = gp.make_target("llvm", "")
    ours = rk.KernelSet.from_module(rk.build_kernels(shape.our_config(), target))
    tvm_kernels = gp.tvm_kernel_dict(gp.build_tvm(shape, target))
    return Kernels(shape, ours, tvm_kernels, f"CPU kernels built here ({target})")


class Driver:
    """One cache driven through the ``vm.builtin`` functions a Relax model calls (TVM's own
    builtins for the native cache, relax_kvcache's dispatchers for ours)."""

    def __init__(self, name: str, cache, native: bool) -> None:
        self.name, self.cache, self.native = name, cache, native
        get = (lambda n: original("vm.builtin." + n)) if native else (lambda n: tvm.get_global_func("vm.builtin." + n))
        self._add = get("kv_state_add_sequence")
        self._begin = get("kv_state_begin_forward")
        self._end = get("kv_state_end_forward")
        self._attn = get("attention_kv_cache_attention_with_fused_qkv")

    def add(self, seq: int) -> None:
        self._add(self.cache, seq)

    def begin(self, seq_ids: List[int], lengths: List[int]) -> None:
        self._begin(self.cache, ShapeTuple(seq_ids), ShapeTuple(lengths))

    def end(self) -> None:
        self._end(self.cache)

    def attention(self, layer: int, qkv, out, sm_scale: float) -> None:
        self._attn(self.cache, layer, sm_scale, qkv, out)

    def read_kv(self, seq: int, length: int, shape, device) -> Tuple[np.ndarray, np.ndarray]:
        """K and V of layer 0 of sequence ``seq`` (``(length, kv heads, head_dim)`` each)."""
        get = (lambda n: original("vm.builtin." + n)) if self.native else (lambda n: tvm.get_global_func("vm.builtin." + n))
        dims = (shape.num_layers, length, shape.num_kv_heads, shape.head_dim)
        k, v = tvm.runtime.empty(dims, shape.dtype, device), tvm.runtime.empty(dims, shape.dtype, device)
        get("attention_kv_cache_debug_get_kv")(self.cache, seq, 0, length, k, v)
        return k.numpy()[0], v.numpy()[0]


def make_drivers(kernels: Kernels, device: tvm.runtime.Device, **sizes) -> List[Driver]:
    """Ours and TVM's native cache (those whose kernels exist) for the benchmark shape with
    ``sizes`` (num_layers, max_num_seqs, max_total_seq_len, prefill_chunk_size)."""
    shape = dataclasses.replace(kernels.shape, **sizes)
    drivers = []
    if kernels.ours is not None:
        drivers.append(Driver("ours", rk.PagedAttentionKVCache(shape.our_config(), device, kernels=kernels.ours),
                              native=False))
    if kernels.tvm is not None:
        args = create_args(shape, kernels.tvm, merge_functions=1)
        args[12] = tvm.runtime.empty((), shape.dtype, device)  # the native cache lives on this tensor's device
        drivers.append(Driver("native", tvm.get_global_func(CREATE_NATIVE)(*args), native=True))
    return drivers


# ----------------------------------------------------------------------------- timing helpers

def time_per_call(fn: Callable[[], object], device: tvm.runtime.Device, min_time: float) -> float:
    """Seconds per call of ``fn``: calls queued back to back between two device syncs, repeated
    until a round lasts ``min_time``; the median of three such rounds."""
    fn()
    device.sync()
    reps = 1
    while True:
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        device.sync()
        elapsed = time.perf_counter() - start
        if elapsed >= min_time or reps >= 100000:
            break
        reps = min(100000, max(2 * reps, int(reps * 1.2 * min_time / max(elapsed, 1e-9))))
    rounds = [elapsed / reps]
    for _ in range(2):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        device.sync()
        rounds.append((time.perf_counter() - start) / reps)
    return statistics.median(rounds)


def measure_copy_bandwidth(device: tvm.runtime.Device, num_bytes: int, min_time: float) -> float:
    """Bytes/s of a large device-to-device tensor copy, counting the bytes read and written."""
    a = tvm.runtime.empty((num_bytes // 2,), "float16", device)
    b = tvm.runtime.empty((num_bytes // 2,), "float16", device)
    return 2 * num_bytes / time_per_call(lambda: a.copyto(b), device, min_time)


def measure_matmul_rate(device: tvm.runtime.Device) -> Optional[float]:
    """FLOP/s of an 8192^3 fp16 matrix multiply with PyTorch (cuBLAS) when it is installed; the
    prefill roofline. None without PyTorch or on CPU."""
    try:
        import torch
    except ImportError:
        return None
    if device.dlpack_device_type() != tvm.cuda().dlpack_device_type() or not torch.cuda.is_available():
        return None
    n = 8192
    a = torch.randn(n, n, dtype=torch.float16, device="cuda")
    b = torch.randn(n, n, dtype=torch.float16, device="cuda")
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    return 2 * n ** 3 * 20 / (time.perf_counter() - start)


class Inputs:
    """Random fp16 (or the shape's dtype) tensors on the device, made on the host once per shape."""

    def __init__(self, shape: Shape, device: tvm.runtime.Device, rng: np.random.Generator) -> None:
        self.shape, self.device, self.rng = shape, device, rng
        self.rows = shape.num_qo_heads + 2 * shape.num_kv_heads

    def qkv(self, n: int) -> tvm.runtime.Tensor:
        host = self.rng.standard_normal((n, self.rows, self.shape.head_dim), dtype=np.float32)
        return tvm.runtime.tensor(host.astype(self.shape.dtype), self.device)

    def out(self, n: int) -> tvm.runtime.Tensor:
        return tvm.runtime.empty((n, self.shape.num_qo_heads, self.shape.head_dim), self.shape.dtype, self.device)


def fill(drivers: List[Driver], inputs: Inputs, batch: int, context: int, chunk: int, layers: int,
         sm_scale: float) -> None:
    """Add sequences 0..batch-1 and prefill each with ``context`` tokens (same inputs for every
    cache), several whole sequences per step where they fit in ``chunk`` tokens."""
    per_step = max(d for d in range(1, batch + 1) if batch % d == 0 and d * context <= chunk)
    pool = [[inputs.qkv(per_step * context) for _ in range(layers)] for _ in range(2)]
    out = inputs.out(per_step * context)
    for drv in drivers:
        for seq in range(batch):
            drv.add(seq)
        for step, first in enumerate(range(0, batch, per_step)):
            qkvs = pool[step % 2]
            drv.begin(list(range(first, first + per_step)), [context] * per_step)
            for layer in range(layers):
                drv.attention(layer, qkvs[layer], out, sm_scale)
            drv.end()
    inputs.device.sync()


def max_diff(outputs: Dict[str, tvm.runtime.Tensor]) -> Optional[float]:
    if "ours" not in outputs or "native" not in outputs:
        return None
    ours, native = (outputs[k].numpy().astype(np.float32) for k in ("ours", "native"))
    if not (np.isfinite(ours).all() and np.isfinite(native).all()):
        return float("nan")
    return float(np.abs(ours - native).max())


#: sequences of a decode batch checked against the float64 reference (numpy time)
REF_SEQS = 8


def decode_reference_errors(drivers: List[Driver], outputs, qkv, shape, device, batch: int, context: int,
                            sm_scale: float) -> Dict[str, float]:
    """Max abs error of each cache's decode output against float64 attention over the first
    REF_SEQS sequences' KV as our cache holds it (read back with debug_get_kv; queries RoPE'd
    here at position ``context``). The native cache is not read back: its debug_get_kv kernel
    is compiled for the benchmark's 8 layers and the one-layer caches here refuse it."""
    ours = next((d for d in drivers if not d.native), None)
    if ours is None:
        return {}
    q = qkv.numpy()[:, :shape.num_qo_heads].astype(np.float64)
    if shape.rope_mode == 1:  # NORMAL: the cache rotates q at its position
        q = reference.rope(q, np.full(q.shape[0], context), shape.rope_theta, shape.rope_scale)
    refs = [reference.attention(q[seq:seq + 1], *ours.read_kv(seq, context + 1, shape, device), sm_scale,
                                causal=False)[0][0] for seq in range(min(batch, REF_SEQS))]
    ref = np.stack(refs)
    return {name: float(np.abs(out.numpy()[:len(refs)].astype(np.float64) - ref).max())
            for name, out in outputs.items()}


# ----------------------------------------------------------------------------- benchmarks

def bench_layer(kernels: Kernels, device, rng, *, batch: int, new: int, context: int, min_time: float) -> dict:
    """One layer's ``attention_with_fused_qkv`` for ``batch`` sequences of ``context`` cached
    tokens appending ``new`` tokens each (new = 1: decode; context = 0: prefill)."""
    shape = kernels.shape
    chunk = max(batch * new, min(max(context, 1) * batch, 8192), context)
    drivers = make_drivers(kernels, device, num_layers=1, max_num_seqs=batch,
                           max_total_seq_len=batch * (context + new + shape.page_size) + 64, prefill_chunk_size=chunk)
    inputs = Inputs(shape, device, rng)
    sm_scale = shape.head_dim ** -0.5
    if context:
        fill(drivers, inputs, batch, context, chunk, 1, sm_scale)
    else:
        for drv in drivers:
            for seq in range(batch):
                drv.add(seq)
    qkv = inputs.qkv(batch * new)
    result: dict = {"times": {}}
    outputs = {}
    for drv in drivers:
        out = inputs.out(batch * new)
        drv.begin(list(range(batch)), [new] * batch)
        result["times"][drv.name] = time_per_call(lambda: drv.attention(0, qkv, out, sm_scale), device, min_time)
        drv.end()
        outputs[drv.name] = out
    result["diff"] = max_diff(outputs)
    if new == 1 and context:
        result["ref_err"] = decode_reference_errors(drivers, outputs, qkv, dataclasses.replace(shape, num_layers=1),
                                                    device, batch, context, sm_scale)
    itemsize = np.dtype(shape.dtype).itemsize
    result["kv_bytes"] = batch * (context + new) * shape.num_kv_heads * shape.head_dim * 2 * itemsize
    pairs = batch * (new * context + new * (new + 1) // 2)  # causal: query i of the chunk sees context + i + 1 keys
    result["flops"] = 4 * shape.num_qo_heads * shape.head_dim * pairs
    del drivers
    gc.collect()
    return result


def bench_step(kernels: Kernels, device, rng, *, batch: int, context: int, layers: int, steps: int) -> dict:
    """Median seconds of a whole synchronised decode step: begin_forward + every layer +
    end_forward, for the native cache, ours and (CUDA) ours replaying a CUDA graph of the
    layers (`relax_kvcache.cuda_graph`). All caches get the same inputs; the last step's
    outputs are compared (``graph_diff``: graph vs eager, ours; ``diff``: ours vs native)."""
    shape = kernels.shape
    sizes = dict(num_layers=layers, max_num_seqs=batch, prefill_chunk_size=max(context, batch),
                 max_total_seq_len=batch * (context + steps + 2 * shape.page_size) + 64)
    drivers = make_drivers(kernels, device, **sizes)
    cuda = device.dlpack_device_type() == tvm.cuda().dlpack_device_type()
    if cuda and kernels.ours is not None:
        graph_cache = make_drivers(dataclasses.replace(kernels, tvm=None), device, **sizes)[0]
        graph_cache.name = "ours+graph"
        drivers.append(graph_cache)
    inputs = Inputs(shape, device, rng)
    sm_scale = shape.head_dim ** -0.5
    fill(drivers, inputs, batch, context, max(context, batch), layers, sm_scale)
    qkvs = [inputs.qkv(batch) for _ in range(layers)]
    ids, ones = list(range(batch)), [1] * batch
    result: dict = {"times": {}}
    last = {}
    for drv in drivers:
        outs = [inputs.out(batch) for _ in range(layers)]

        def forward(drv=drv, outs=outs):
            for layer in range(layers):
                drv.attention(layer, qkvs[layer], outs[layer], sm_scale)

        if drv.name == "ours+graph":
            times, result["graph_runs"] = _graph_steps(drv, forward, ids, ones, steps)
        else:
            times = _eager_steps(drv, forward, ids, ones, steps, device)
        result["times"][drv.name] = statistics.median(times)
        last[drv.name] = outs[-1]
    result["diff"] = max_diff(last)
    if "ours+graph" in last:
        result["graph_diff"] = max_diff({"ours": last["ours"], "native": last["ours+graph"]})
    del drivers
    gc.collect()
    return result


def _eager_steps(drv: Driver, forward, ids, ones, steps: int, device) -> List[float]:
    times = []
    for i in range(steps + 3):  # 3 warm-up steps
        device.sync()
        start = time.perf_counter()
        drv.begin(ids, ones)
        forward()
        drv.end()
        device.sync()
        if i >= 3:
            times.append(time.perf_counter() - start)
    return times


def _graph_steps(drv: Driver, forward, ids, ones, steps: int) -> Tuple[List[float], Dict[str, int]]:
    from relax_kvcache.cuda_graph import DecodeGraphs

    graphs = DecodeGraphs(drv.cache)
    times, runs = [], {}
    with graphs.stream_context():
        for i in range(steps + 3):  # eager, capture, then replays: 3 warm-up steps
            graphs.synchronize()
            start = time.perf_counter()
            drv.begin(ids, ones)
            how = graphs.run(forward)
            drv.end()
            graphs.synchronize()
            runs[how] = runs.get(how, 0) + 1
            if i >= 3:
                times.append(time.perf_counter() - start)
    graphs.close()
    return times, runs


# ----------------------------------------------------------------------------- report

def write_json(path: pathlib.Path, device, shape: Shape, bandwidth: float, matmul: Optional[float], decode_rows,
               prefill_rows, step_rows, step_setup: Tuple[int, int]) -> None:
    """Every result as JSON: what ``plot_bench.py`` draws."""
    import json

    def clean(r: dict) -> dict:
        return {k: v for k, v in r.items() if isinstance(v, (int, float, str, dict, type(None)))}

    data = {
        "device": gp.describe_device(device), "shape": dataclasses.asdict(shape), "copy_bandwidth": bandwidth,
        "matmul_rate": matmul,
        "decode": [dict(batch=b, context=c, **clean(r)) for b, c, r in decode_rows],
        "prefill": [dict(batch=b, length=n, **clean(r)) for b, n, r in prefill_rows],
        "step": [dict(batch=b, context=step_setup[0], layers=step_setup[1], **clean(r)) for b, r in step_rows],
    }
    path.write_text(json.dumps(data, indent=1))
    print(f"wrote {path}", flush=True)



def _us(seconds: Optional[float]) -> str:
    return f"{seconds * 1e6:10.1f}" if seconds is not None else f"{'-':>10}"


def _ms(seconds: Optional[float]) -> str:
    return f"{seconds * 1e3:10.2f}" if seconds is not None else f"{'-':>10}"


def _rate(value: Optional[float], scale: float, fmt: str = "10.1f") -> str:
    return format(value / scale, fmt) if value is not None else f"{'-':>10}"


def _ratio(times: dict) -> str:
    if "ours" in times and "native" in times:
        return f"{times['ours'] / times['native']:11.2f}"
    return f"{'-':>11}"


def _err(value: Optional[float]) -> str:
    return f"{value:9.1e}" if value is not None else f"{'-':>9}"


def _diff(value: Optional[float]) -> str:
    if value is None:
        return f"{'-':>10}"
    flag = " !" if not value <= DIFF_WARN else ""
    return f"{value:10.2e}{flag}"


def print_robust(rows, bandwidth: float, matmul: Optional[float]) -> None:
    """Table of the robustness shapes: decode 64 x 2048 and prefill 1 x 2048 per shape."""
    print()
    print("Robustness shapes: decode 64 x 2048 (one layer) and causal prefill 1 x 2048")
    print(f"{'shape':>6} {'heads':>6} {'dim':>4} {'dec ours us':>11} {'dec nat. us':>11} {'ours/nat.':>9} "
          f"{'ours %roof':>10} {'pre ours ms':>11} {'pre nat. ms':>11} {'ours/nat.':>9} {'ours TF/s':>9} "
          f"{'max|diff|':>10} {'ours err':>9}")
    for name, shape, dec, pre in rows:
        td, tp = dec["times"], pre["times"]
        roof = 100 * dec["kv_bytes"] / td["ours"] / bandwidth if "ours" in td else None
        tflops = pre["flops"] / tp["ours"] if "ours" in tp else None
        diff = max((d for d in (dec["diff"], pre["diff"]) if d is not None), default=None)
        print(f"{name:>6} {shape.num_qo_heads:>3}/{shape.num_kv_heads:<2} {shape.head_dim:>4} "
              f"{_us(td.get('ours')):>11} {_us(td.get('native')):>11} {_ratio(td):>9} {_rate(roof, 1, '10.1f')} "
              f"{_ms(tp.get('ours')):>11} {_ms(tp.get('native')):>11} {_ratio(tp):>9} "
              f"{_rate(tflops, 1e12, '9.2f')} {_diff(diff)} {_err(dec.get('ref_err', {}).get('ours'))}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--libs", type=pathlib.Path, help="folder prepared by gpu_prepare.py "
                        "(default .gpu for cuda; for cpu without it, CPU kernels are built here)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="fewer shapes, shorter timing")
    parser.add_argument("--dtype", choices=["float16", "float32"], help="dtype of CPU kernels built here")
    parser.add_argument("--sweep", action="store_true",
                        help="also decode at batch 32 over contexts and prefill over lengths (for the plots)")
    parser.add_argument("--robust", action="store_true",
                        help="also decode 64 x 2048 and prefill 1 x 2048 on the robustness shapes "
                             "(head_dim 64 / 256, 8:1 GQA; libraries from gpu_prepare.py)")
    parser.add_argument("--json", type=pathlib.Path, help="write every result to this JSON file (plot_bench.py)")
    parser.add_argument("--prefill", type=pathlib.Path, metavar="DIR",
                        help="also run the prefill comparison with FlashAttention-2 / cuDNN (libraries of "
                             "gpu_prefill_bench.py --prepare DIR)")
    args = parser.parse_args(argv)

    cuda = args.device == "cuda"
    device = tvm.cuda(0) if cuda else tvm.cpu(0)
    if cuda and args.libs is None:
        args.libs = gp.REPO / ".gpu"
    kernels = kernels_from_libs(args.libs, device) if args.libs is not None else kernels_built_here(args.dtype)
    shape = kernels.shape
    if cuda:
        decode = [(1, 1024), (32, 1024)] if args.quick else [(1, 1024), (32, 1024), (64, 2048), (128, 4096), (1, 16384)]
        prefill = [(1, 2048)] if args.quick else [(1, 2048), (8, 512)]
        copy_bytes, min_time = 1 << 30, (0.05 if args.quick else 0.2)
        step_batches, step_context, step_layers = ([1, 32] if args.quick else [1, 8, 32, 64, 128]), 1024, 8
        if args.sweep:
            decode += [(32, c) for c in (256, 512, 2048, 4096, 8192)]
            prefill += [(1, n) for n in (256, 512, 1024, 4096, 8192)]
    else:
        decode = [(1, 256)] if args.quick else [(1, 256), (4, 256)]
        prefill = [(1, 128)] if args.quick else [(1, 256), (4, 64)]
        copy_bytes, min_time = 1 << 28, 0.05
        step_batches, step_context, step_layers = [1, 4], 256, 8

    print(f"gpu_bench on {device} ({kernels.source}), TVM {tvm.__version__}; {gp.describe_device(device)}",
          flush=True)
    print(f"shape: {shape.dtype}, {shape.num_qo_heads}/{shape.num_kv_heads} heads, head_dim {shape.head_dim}, "
          f"page {shape.page_size}, RoPE mode {shape.rope_mode}", flush=True)
    missing = [name for name, k in (("ours", kernels.ours), ("native", kernels.tvm)) if k is None]
    if missing:
        print(f"NOTE: no kernels for {' and '.join(missing)}: those columns stay empty", flush=True)
    bandwidth = measure_copy_bandwidth(device, copy_bytes, min_time)
    print(f"device-to-device copy: {bandwidth / 1e9:.0f} GB/s (read + write)", flush=True)
    matmul = measure_matmul_rate(device)
    if matmul:
        print(f"fp16 matmul (PyTorch, 8192^3): {matmul / 1e12:.0f} TFLOP/s", flush=True)

    rng = np.random.default_rng(0)
    decode_rows, prefill_rows = [], []
    for batch, context in decode:
        print(f"decode {batch} x {context} ...", flush=True)
        decode_rows.append((batch, context, bench_layer(kernels, device, rng, batch=batch, new=1, context=context,
                                                         min_time=min_time)))
    for batch, length in prefill:
        print(f"prefill {batch} x {length} ...", flush=True)
        prefill_rows.append((batch, length, bench_layer(kernels, device, rng, batch=batch, new=length, context=0,
                                                         min_time=min_time)))
    step_rows = []
    for batch in step_batches:
        print(f"decode step {batch} x {step_context}, {step_layers} layers ...", flush=True)
        step_rows.append((batch, bench_step(kernels, device, rng, batch=batch, context=step_context,
                                            layers=step_layers, steps=20 if args.quick else 100)))
    robust_rows = []
    if args.robust and args.libs is not None:
        for name, robust in robust_kernels(args.libs, device).items():
            print(f"robustness shape {name} ...", flush=True)
            rows = []
            for batch, new, context in ((64, 1, 2048), (1, 2048, 0)):
                try:
                    rows.append(bench_layer(robust, device, rng, batch=batch, new=new, context=context,
                                            min_time=min_time))
                except Exception as err:  # noqa: BLE001  (e.g. TVM's kernels do not launch at head_dim 256)
                    print(f"  failed with both caches ({str(err).splitlines()[0][:200]}); ours alone", flush=True)
                    rows.append(bench_layer(dataclasses.replace(robust, tvm=None), device, rng, batch=batch,
                                            new=new, context=context, min_time=min_time))
            robust_rows.append((name, robust.shape, *rows))
    if args.json:
        write_json(args.json, device, shape, bandwidth, matmul, decode_rows, prefill_rows, step_rows,
                   (step_context, step_layers))

    print()
    print(f"Decode: one layer of attention_with_fused_qkv ({shape.dtype}, {shape.num_qo_heads}/{shape.num_kv_heads} "
          f"heads, head_dim {shape.head_dim}, page {shape.page_size}); roofline = KV bytes / copy bandwidth "
          f"({bandwidth / 1e9:.0f} GB/s)")
    print(f"{'batch x ctx':>12} {'ours us':>10} {'native us':>10} {'ours/native':>11} {'ours GB/s':>10} "
          f"{'native GB/s':>11} {'ours %roof':>10} {'nat. %roof':>10} {'max|diff|':>10} "
          f"{'ours err':>9} {'nat. err':>9}")
    for batch, context, r in decode_rows:
        ref = r.get("ref_err", {})
        t = r["times"]
        gbs = {k: r["kv_bytes"] / v for k, v in t.items()}
        roof = {k: 100 * v / bandwidth for k, v in gbs.items()}
        print(f"{batch:>5} x {context:<5} {_us(t.get('ours'))} {_us(t.get('native'))} {_ratio(t)} "
              f"{_rate(gbs.get('ours'), 1e9)} {_rate(gbs.get('native'), 1e9, '11.1f')} "
              f"{_rate(roof.get('ours'), 1, '10.1f')} {_rate(roof.get('native'), 1, '10.1f')} {_diff(r['diff'])} "
              f"{_err(ref.get('ours'))} {_err(ref.get('native'))}")
    print(f"(err: max abs error against float64 attention over the KV our cache holds, first {REF_SEQS} "
          f"sequences)")
    print()
    print("Prefill: one layer of attention_with_fused_qkv, causal, fresh prompts")
    print(f"{'batch x len':>12} {'ours ms':>10} {'native ms':>10} {'ours/native':>11} {'ours TF/s':>10} "
          f"{'native TF/s':>11} {'max|diff|':>10}" + (" ours %mm" if matmul else ""))
    for batch, length, r in prefill_rows:
        t = r["times"]
        tflops = {k: r["flops"] / v for k, v in t.items()}
        roof = f" {100 * tflops['ours'] / matmul:9.1f}%" if matmul and "ours" in tflops else ""
        print(f"{batch:>5} x {length:<5} {_ms(t.get('ours'))} {_ms(t.get('native'))} {_ratio(t)} "
              f"{_rate(tflops.get('ours'), 1e12, '10.2f')} {_rate(tflops.get('native'), 1e12, '11.2f')} "
              f"{_diff(r['diff'])}{roof}")
    print()
    print(f"Decode step x {step_context}, {step_layers} layers (begin_forward + layers + end_forward, synchronised; "
          "graph: the layers replayed as a CUDA graph)")
    print(f"{'batch':>6} {'ours us':>10} {'graph us':>10} {'native us':>10} {'ours/native':>11} {'graph/native':>12} "
          f"{'graph us/layer':>14} {'max|diff|':>10} {'graph-eager':>11}  graph runs")
    for batch, r in step_rows:
        t = r["times"]
        graph = {"ours": t.get("ours+graph"), "native": t.get("native")}
        per_layer = t["ours+graph"] / step_layers if "ours+graph" in t else None
        print(f"{batch:>6} {_us(t.get('ours'))} {_us(t.get('ours+graph'))} {_us(t.get('native'))} {_ratio(t)} "
              f"{_ratio(graph):>12} {_us(per_layer):>14} {_diff(r['diff'])} {_diff(r.get('graph_diff')):>11}  "
              f"{r.get('graph_runs', '')}")
    if robust_rows:
        print_robust(robust_rows, bandwidth, matmul)
    diffs = [r["diff"] for *_, r in decode_rows + prefill_rows + step_rows if r["diff"] is not None]
    diffs += [r["diff"] for _, _, *rs in robust_rows for r in rs if r["diff"] is not None]
    diffs += [r["graph_diff"] for _, r in step_rows if r.get("graph_diff") is not None]
    flagged = [d for d in diffs if not d <= DIFF_WARN]
    if args.prefill is not None:
        import gpu_prefill_bench

        print("\nCausal prefill against PyTorch SDPA (FlashAttention-2, cuDNN) and TVM's kernels", flush=True)
        gpu_prefill_bench.main(["--libs", str(args.prefill)])
    if flagged:
        print(f"WARNING: ours and native outputs differ by more than {DIFF_WARN} on {len(flagged)} shape(s) (!)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
