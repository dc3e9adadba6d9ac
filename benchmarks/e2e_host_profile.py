"""Where the host time of a whole-model decode step goes, ours against TVM's native cache.

On the model of ``e2e_bench.py`` (libraries from ``e2e_bench.py --prepare``), one sequence of
``--context`` tokens (filled by attention calls), eager decode. Each figure is the median host
time to issue a call ``--calls`` times in a row after a device sync (the GPU's queue is not full,
so the GPU work is excluded):

* a whole decode step of the same batch as the step before (``begin_forward``, the model's VM
  call, ``end_forward``);
* ``begin_forward`` + ``end_forward`` of the same batch again, and with a ``popn`` between steps
  (a new batch to ours);
* one layer's ``attention_with_fused_qkv`` through ``vm.builtin``; for ours also the method
  called directly, each compiled function it calls (the argument check, RoPE split, append,
  decode), and a call to a Python function that does nothing, with the same arguments.

Usage::

    python benchmarks/e2e_host_profile.py --libs .gpu/e2e [--model 1b]   # GPU host
    python benchmarks/e2e_host_profile.py --cpu-smoke                     # here, the tiny model
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import sys
import time
from typing import Callable, List, Optional

import numpy as np
import tvm
import tvm_ffi

import e2e_bench
from e2e_phases import fill
from e2e_runtime import GPU_PLAN, MODELS, SEED, SMOKE_MODEL, SMOKE_PLAN, Device, Runner, shape_tuple


def issue_time(device: Device, call: Callable[[], object], calls: int, reps: int = 7) -> float:
    """Median over ``reps`` of the host seconds per ``call()``, ``calls`` of them after a sync."""
    times = []
    for _ in range(reps):
        device.sync()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - start) / calls)
    device.sync()
    return statistics.median(times)


def profile_side(side: str, executable, device: Device, cfg, plan, context: int, calls: int, weights) -> dict:
    """The host times of one side (see the module docstring), in seconds."""
    runner = Runner(side, e2e_bench.make_vm(side, executable, device), weights)
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    rng = np.random.default_rng(1)
    qkv = tvm.runtime.tensor(rng.standard_normal((1, hq + 2 * hkv, d)).astype(cfg.dtype), device.dev)
    o = tvm.runtime.empty((1, hq, d), cfg.dtype, device.dev)
    scale = d ** -0.5
    cache = runner.create(1, context + 8 * calls + 64, plan.chunk)
    runner.add(cache, 0)
    fill(runner, cache, device, cfg, plan, [0], context, np.random.default_rng(3))
    ids, seq, one = device.tokens(np.array([[5]])), shape_tuple([0]), shape_tuple([1])

    def step():
        runner.begin(cache, seq, one)
        runner.decode_fn(ids, cache, *runner.weights)
        runner.end(cache)

    def begin_end():
        runner.begin(cache, seq, one)
        runner.end(cache)

    def new_batch():
        begin_end()
        runner.popn(cache, 0, 1)

    for _ in range(5):
        step()
    out = {"step": issue_time(device, step, 1, 5 * 7), "begin_end": issue_time(device, begin_end, calls)}
    runner.popn(cache, 0, 5 + 5 * 7 + 7 * calls)  # the repeated steps' tokens
    out["begin_end_new_batch"] = issue_time(device, new_batch, calls)
    runner.begin(cache, seq, one)
    out["attention_builtin"] = issue_time(device, lambda: runner.attention(cache, 0, scale, qkv, o), calls)
    if side == "ours":
        out.update(_ours_parts(device, cache, qkv, o, scale, calls))
    runner.end(cache)
    return out


def _ours_parts(device: Device, cache, qkv, o, scale: float, calls: int) -> dict:
    """Ours: the attention method called directly and the compiled functions it calls."""
    mha, st = cache._attention, cache._step
    k, dev = mha.kernels, st.device
    pages, scales = mha.pages[0], mha._scale_args[0]
    decode = mha._decode[1][0]
    parts = {"attention_method": lambda: cache.attention_with_fused_qkv(0, qkv, o, scale),
             "split_rotary": lambda: k.split_rotary(qkv, dev.q_rope_position, dev.q, dev.k, dev.v,
                                                     mha._split_rope_argument),
             "transpose_append": lambda: k.transpose_append(pages, dev.k, dev.v, dev.append_position, *scales)}
    if decode is not None:
        parts["decode"] = lambda: decode[0](dev.q, pages, *decode[1], o, dev.merged_lse, *mha._rope, scale, *scales)
    check = cache._fused_qkv_check
    if check is not None:
        parts["check"] = lambda: check(qkv, o, dev.q_rope_position)
    tvm_ffi.register_global_func("relax_kvcache_bench.noop_attention", lambda *a: None, override=True)
    noop = tvm_ffi.get_global_func("relax_kvcache_bench.noop_attention")
    parts["ffi_floor"] = lambda: noop(cache, 0, scale, qkv, o)
    return {name: issue_time(device, call, calls) for name, call in parts.items()}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--libs", type=pathlib.Path, help="folder built by e2e_bench.py --prepare (GPU host)")
    parser.add_argument("--model", choices=sorted(MODELS), default="1b")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--calls", type=int, default=200, help="calls per timing (fewer than the GPU's queue holds)")
    parser.add_argument("--cpu-smoke", action="store_true", help="the tiny model on llvm, compiled here")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        device, cfg, plan = Device(cuda=False), SMOKE_MODEL, SMOKE_PLAN
        executables = {side: e2e_bench._smoke_executable(side) for side in ("ours", "native")}
        context = min(args.context, 100)
    elif args.libs is not None:
        manifest = e2e_bench.read_manifest(args.libs)
        if args.model not in manifest["models"]:
            parser.error(f"{args.libs} holds no libraries for {args.model}: run e2e_bench.py --prepare with "
                         f"--models {args.model}")
        device, cfg, plan, context = Device(cuda=True), MODELS[args.model], GPU_PLAN, args.context
        executables = e2e_bench.load_executables(args.libs, manifest, args.model, ["ours", "native"], device)
    else:
        parser.error("--libs DIR (GPU host) or --cpu-smoke")
    plan = dataclasses.replace(plan, fill="attention")
    weights = device.weights(cfg, SEED)
    results = {side: profile_side(side, executables[side], device, cfg, plan, context, args.calls, weights)
               for side in ("ours", "native")}
    print(f"host time of a decode step, 1 x {context}, {cfg.num_layers} layers, {device.describe()} (us; GPU work "
          "excluded)")
    print(f"{'':>22} {'ours':>9} {'native':>9}")
    for name in results["ours"]:
        theirs = results["native"].get(name)
        print(f"{name:>22} {results['ours'][name] * 1e6:9.1f}" + (f" {theirs * 1e6:9.1f}" if theirs else ""))
    print(json.dumps({side: {k: round(v * 1e6, 2) for k, v in r.items()} for side, r in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
