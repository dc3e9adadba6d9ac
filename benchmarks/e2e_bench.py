"""Whole-model speed through the Relax VM: a Llama on our cache vs the same model on TVM's native cache.

Models: Llama-architecture, random float16 weights (nothing downloaded):

* ``1b``: Llama-3.2-1B's shape (16 layers, hidden 2048, 32/8 heads, head_dim 64, MLP 8192, vocab 128256);
* ``8b``: Llama-3-8B's shape (32 layers, hidden 4096, 32/8 heads, head_dim 128, MLP 14336, vocab 128256).

Two builds of each (``e2e_models.py``): ``ours`` (``relax_kvcache.models.llama``, our kernels in the
module) and ``native`` (the same model creating TVM's ``TIRPagedKVCache``: TVM's kernels and C++
cache); prefill returns the last token's logits. Both VMs run in one process on the same weights;
the native VM is bound to TVM's own ``vm.builtin`` functions (as in a process without relax_kvcache).
On a GPU each native decode configuration runs in a process of its own (``--same-process``: not).
For each model and side (ours eager, ours with CUDA graphs of the decode step, native):

* **logits check**: one prefill and a few decode steps on the same tokens; max |ours - native| over
  max |native| must stay within :data:`TOLERANCE` (else exit status 1);
* **TTFT**: prefill of a whole prompt (1 x 512 / 2048 / 8192) up to the first token's logits;
* **decode**: contexts of 1k and 4k tokens filled by prefill in chunks, then ``steps`` decode steps
  at batch 1 / 8 / 32 / 128 queued back to back (tokens/s); configurations whose KV does not fit
  the GPU are skipped with the reason. Beside the step time: the host time of a step with the GPU
  work excluded (steps issued one at a time after a synchronisation, not waited for):
  ``begin_forward``, issuing the VM call, ``end_forward``.

Weights: linear layers N(0, 1/fan_in), norms 1; on a GPU drawn by PyTorch on the device and handed
to TVM by DLPack.

Usage::

    python benchmarks/e2e_bench.py --prepare .gpu/e2e --arch sm_90a [--models 1b] [--bundle]  # here
    python benchmarks/e2e_bench.py --libs .gpu/e2e [--models 1b 8b] [--json FILE]   # GPU host (PyTorch)
    python benchmarks/e2e_bench.py --cpu-smoke   # here: a tiny model on llvm, the same code path
    python benchmarks/e2e_bench.py --libs .gpu/e2e --soak 5   # GPU host: generate.Engine under load

``--kv-dtype float8_e4m3fn`` (with ``--prepare``, ``--libs`` or ``--cpu-smoke``): a third build,
``ours-fp8``, ours over 8-bit pages; its logits against ours over float16 pages and its decode
tokens/s beside them (``e2e_fp8.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "benchmarks"))

import tvm  # noqa: E402
import tvm_ffi  # noqa: E402
from tvm.runtime.vm import VirtualMachine  # noqa: E402

import relax_kvcache  # noqa: E402,F401  (before any VirtualMachine: routes vm.builtin.* to our cache)
from relax_kvcache.ffi_registry.builtins import BUILTINS, ORIGINAL_PREFIX  # noqa: E402
from relax_kvcache.config import KV_DTYPES  # noqa: E402
from relax_kvcache.models import LlamaConfig  # noqa: E402

from e2e_report import SIDES, report  # noqa: E402

PAGE = 16
SEED = 0
MANIFEST = "manifest.json"
CHILD_MARK = "E2E-NATIVE-DECODE "
_LLAMA3 = dict(vocab_size=128256, num_heads=32, num_kv_heads=8, rope_theta=5e5, dtype="float16")
MODELS: Dict[str, LlamaConfig] = {
    "1b": LlamaConfig(hidden_size=2048, intermediate_size=8192, num_layers=16, head_dim=64, **_LLAMA3),
    "8b": LlamaConfig(hidden_size=4096, intermediate_size=14336, num_layers=32, head_dim=128, **_LLAMA3),
}
SMOKE_MODEL = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=16, rope_theta=5e5, dtype="float16")
#: max |ours - native| / max |native| allowed over the checked logits: each side's float16 error
#: against exact logits is ~1e-2 of their scale (the demo model measures it), twice that apart at most
TOLERANCE = 4e-2
RESERVE = 3 << 30  # GPU bytes kept free beside the caches and prefill activations


@dataclasses.dataclass(frozen=True)
class Plan:
    """What is measured (token counts per phase)."""

    ttft: Sequence[int]  # prompt lengths
    batches: Sequence[int]
    contexts: Sequence[int]
    steps: int  # timed decode steps per configuration
    warmup: int
    chunk: int  # prefill chunk (tokens per fill step; at least the longest TTFT prompt)
    ttft_reps: int
    check_prompt: int
    check_steps: int

    @property
    def extra(self) -> int:
        """Tokens a sequence may gain during one decode configuration (eager and graph passes)."""
        return 2 * (self.warmup + 2 * self.steps)


GPU_PLAN = Plan(ttft=(512, 2048, 8192), batches=(1, 8, 32, 128), contexts=(1024, 4096), steps=32, warmup=3,
                chunk=8192, ttft_reps=3, check_prompt=100, check_steps=6)
SMOKE_PLAN = Plan(ttft=(24, 70), batches=(1, 3), contexts=(40, 100), steps=4, warmup=3, chunk=128, ttft_reps=2,
                  check_prompt=37, check_steps=6)


def _round_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


def _shape(values) -> tvm.runtime.ShapeTuple:
    return tvm.runtime.ShapeTuple([int(v) for v in values])


# ----------------------------------------------------------------------------- device

class Device:
    """The device the VMs run on: CUDA (needs PyTorch for weights, synchronisation, free memory) or CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.dev = tvm.cuda(0) if cuda else tvm.cpu()
        self._keep: list = []
        if cuda:
            import torch

            self.torch = torch

    def sync(self) -> None:
        """Wait for all work on the device (every stream: CUDA-graph replays run on their own)."""
        if self.cuda:
            self.torch.cuda.synchronize()

    def free_bytes(self) -> Optional[int]:
        return int(self.torch.cuda.mem_get_info()[0]) if self.cuda else None

    def used_bytes(self) -> Optional[int]:
        """Device memory in use by every process (CUDA), or None (CPU: host memory is sampled)."""
        if not self.cuda:
            return None
        free, total = self.torch.cuda.mem_get_info()
        return int(total - free)

    def describe(self) -> str:
        if not self.cuda:
            return "CPU (llvm)"
        props = self.torch.cuda.get_device_properties(0)
        return f"{props.name}, {props.total_memory / 2**30:.0f} GiB"

    def tokens(self, ids: np.ndarray) -> tvm.runtime.Tensor:
        return tvm.runtime.tensor(np.ascontiguousarray(ids, dtype="int32"), self.dev)

    def weights(self, cfg: LlamaConfig, seed: int) -> List[tvm.runtime.Tensor]:
        """Random weights in ``cfg.param_shapes()`` order: linear N(0, 1/fan_in), norms 1. On
        CUDA made by PyTorch on the GPU and handed over by DLPack (no host copy)."""
        out = []
        if self.cuda:
            torch = self.torch
            torch.manual_seed(seed)
            dtype = getattr(torch, cfg.dtype)
            for name, shape in cfg.param_shapes():
                if name.endswith("norm.weight"):
                    t = torch.ones(shape, dtype=dtype, device="cuda")
                else:
                    t = torch.randn(shape, dtype=dtype, device="cuda").mul_(shape[1] ** -0.5)
                self._keep.append(t)
                out.append(tvm.runtime.from_dlpack(t))
            torch.cuda.synchronize()
            return out
        rng = np.random.default_rng(seed)
        for name, shape in cfg.param_shapes():
            w = np.ones(shape) if name.endswith("norm.weight") else rng.standard_normal(shape) * shape[1] ** -0.5
            out.append(tvm.runtime.tensor(w.astype(cfg.dtype), self.dev))
        return out

    def release(self) -> None:
        self._keep.clear()
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- one side

def make_vm(side: str, executable, device: Device) -> VirtualMachine:
    """A VM for one side. A VM binds the ``vm.builtin`` functions when it is made: ours gets the
    dispatchers ``import relax_kvcache`` installed; native gets TVM's own C++ functions, as in a
    process without relax_kvcache (the dispatcher's Python would sit before every native call)."""
    if side == "ours":
        return VirtualMachine(executable, device.dev)
    swapped = {}
    for name in BUILTINS:
        theirs = tvm_ffi.get_global_func(ORIGINAL_PREFIX + name, allow_missing=True)
        if theirs is not None:
            swapped[name] = tvm_ffi.get_global_func(name)
            tvm_ffi.register_global_func(name, theirs, override=True)
    try:
        return VirtualMachine(executable, device.dev)
    finally:
        for name, dispatcher in swapped.items():
            tvm_ffi.register_global_func(name, dispatcher, override=True)


class Runner:
    """One side's VM functions and the ``kv_state`` builtins it is driven with (ours: the
    dispatchers, as an engine calls them; native: TVM's functions)."""

    def __init__(self, side: str, vm: VirtualMachine, weights: List[tvm.runtime.Tensor],
                 calibrate: bool = False) -> None:
        prefix = "" if side == "ours" else ORIGINAL_PREFIX
        get = lambda name: tvm_ffi.get_global_func(prefix + "vm.builtin." + name)  # noqa: E731
        self.side, self.weights, self.calibrate = side, weights, calibrate  # calibrate: 8-bit pages' scales
        self.add, self.remove = get("kv_state_add_sequence"), get("kv_state_remove_sequence")
        self.popn = get("kv_state_popn")
        self.begin, self.end = get("kv_state_begin_forward"), get("kv_state_end_forward")
        self.prefill_fn, self.decode_fn, self.create_fn = vm["prefill"], vm["decode"], vm["create_kv_cache"]

    def create(self, max_batch: int, max_total: int, chunk: int):
        cache = self.create_fn(_shape([max_batch]), _shape([max_total]), _shape([chunk]))
        if self.calibrate:  # 8-bit pages: scales from the first step's K / V
            cache.calibrate_kv_scales()
        return cache

    def forward(self, cache, fn, ids: tvm.runtime.Tensor, seq_ids, lengths) -> tvm.runtime.Tensor:
        self.begin(cache, _shape(seq_ids), _shape(lengths))
        try:
            return fn(ids, cache, *self.weights)
        finally:
            self.end(cache)


def _graphs(cache):
    from relax_kvcache.cuda_graph import DecodeGraphs

    return DecodeGraphs(cache)


# ----------------------------------------------------------------------------- phases

def logits_run(runner: Runner, device: Device, plan: Plan, prompt: np.ndarray, tokens: np.ndarray,
               graphs: bool = False) -> dict:
    """Logits of one prefill and ``tokens`` decode steps of one sequence (ours with ``graphs``:
    the decode steps through ``DecodeGraphs``, replayed from the fourth on)."""
    cache = runner.create(1, _round_up(len(prompt) + len(tokens) + PAGE), plan.chunk)
    runner.add(cache, 0)
    rows = [runner.forward(cache, runner.prefill_fn, device.tokens(prompt[None]), [0], [len(prompt)]).numpy()]
    ids, held, runs = device.tokens(np.zeros((1, 1))), [None], {}

    def forward():
        held[0] = runner.decode_fn(ids, cache, *runner.weights)

    g = _graphs(cache) if graphs else None
    try:
        with g.stream_context() if g else contextlib.nullcontext():
            for tok in tokens:
                device.sync()
                ids.copyfrom(np.array([[tok]], dtype="int32"))
                runner.begin(cache, _shape([0]), _shape([1]))
                how = g.run(forward) if g else forward() or "eager"
                runner.end(cache)
                device.sync()
                runs[how] = runs.get(how, 0) + 1
                rows.append(held[0].numpy())
    finally:
        if g:
            g.close()
    return {"rows": [r.reshape(-1).astype(np.float64) for r in rows], "runs": runs}


def check_logits(runners: Dict[str, Runner], device: Device, cfg: LlamaConfig, plan: Plan, graphs: bool) -> dict:
    """ours (and ours with CUDA graphs) against native on the same tokens (see :func:`compare`).
    A graph capture that raises is reported (``graph.error``), not failed: the table shows n/a."""
    rng = np.random.default_rng(SEED + 1)
    prompt = rng.integers(0, cfg.vocab_size, plan.check_prompt)
    tokens = rng.integers(0, cfg.vocab_size, plan.check_steps)
    runs = {side: logits_run(runners[side], device, plan, prompt, tokens) for side in SIDES}
    error = None
    if graphs:
        try:
            runs["graph"] = logits_run(runners["ours"], device, plan, prompt, tokens, graphs=True)
        except Exception as err:  # noqa: BLE001
            error = _short(err)
    result = compare(runs)
    if error:
        result["graph"] = {"error": error, "ok": True}
    return result


def compare(runs: Dict[str, dict]) -> dict:
    """Max |x - native| over the logit rows of each run x; ok when within :data:`TOLERANCE` of
    max |native|, everything finite, and (graph) at least one step replayed."""
    want = np.stack(runs["native"]["rows"])
    scale = float(np.abs(want).max()) if np.isfinite(want).all() else float("nan")
    result = {"scale": scale, "tolerance": TOLERANCE, "ok": bool(np.isfinite(scale) and scale > 0)}
    for name in (n for n in runs if n != "native"):
        got = np.stack(runs[name]["rows"])
        err = float(np.abs(got - want).max()) if got.shape == want.shape and np.isfinite(got).all() else float("inf")
        ok = err <= TOLERANCE * scale
        if name == "graph":
            result["graph_runs"] = runs[name]["runs"]
            ok = ok and runs[name]["runs"].get("replayed", 0) > 0  # a replay checked, not only eager steps
        result[name] = {"err": err, "ok": bool(ok)}
        result["ok"] = result["ok"] and ok
    return result


def _short(err: Exception) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:120] if lines else ''}"


def ttft_phase(runner: Runner, device: Device, cfg: LlamaConfig, plan: Plan) -> Dict[int, float]:
    """Seconds from a prompt's prefill step to its first token's logits on the device (median)."""
    if not plan.ttft:
        return {}
    if plan.chunk < max(plan.ttft):
        raise ValueError(f"prefill chunk {plan.chunk} below the longest TTFT prompt {max(plan.ttft)}")
    rng = np.random.default_rng(SEED + 2)
    cache = runner.create(1, _round_up(max(plan.ttft) + PAGE), plan.chunk)
    out = {}
    for n in plan.ttft:
        ids = device.tokens(rng.integers(0, cfg.vocab_size, (1, n)))
        times = []
        for _ in range(1 + plan.ttft_reps):  # the first is a warm-up
            runner.add(cache, 0)
            device.sync()
            start = time.perf_counter()
            runner.forward(cache, runner.prefill_fn, ids, [0], [n])
            device.sync()
            times.append(time.perf_counter() - start)
            runner.remove(cache, 0)
        out[n] = statistics.median(times[1:])
    return out


def fill(runner: Runner, cache, device: Device, cfg: LlamaConfig, plan: Plan, seqs: Sequence[int], length: int,
         rng) -> float:
    """Prefill ``length`` random tokens into each of ``seqs``, ``plan.chunk`` tokens per step; seconds."""
    pending = [[s, length] for s in seqs]
    device.sync()
    start = time.perf_counter()
    while pending:
        step, budget = [], plan.chunk
        while pending and budget:
            n = min(pending[0][1], budget)
            step.append((pending[0][0], n))
            budget -= n
            pending[0][1] -= n
            if not pending[0][1]:
                pending.pop(0)
        ids = device.tokens(rng.integers(0, cfg.vocab_size, (1, sum(n for _, n in step))))
        runner.forward(cache, runner.prefill_fn, ids, [s for s, _ in step], [n for _, n in step])
    device.sync()
    return time.perf_counter() - start


def measure(step: Callable[[list], None], device: Device, plan: Plan) -> dict:
    """``step(marks)`` appends four perf_counter marks (before begin_forward, after it, after the
    VM call, after end_forward). Step time: ``plan.steps`` steps back to back, one sync at the
    end. Host time: steps issued one at a time after a sync (the GPU queue empty), not waited for."""
    for _ in range(plan.warmup):
        step([])
    device.sync()
    start = time.perf_counter()
    for _ in range(plan.steps):
        step([])
    device.sync()
    step_s = (time.perf_counter() - start) / plan.steps
    parts = []
    for _ in range(plan.steps):
        device.sync()
        marks: list = []
        step(marks)
        parts.append(np.diff(marks))
    device.sync()
    parts = np.array(parts)
    med = np.median(parts, axis=0)
    return {"step": step_s, "host": float(np.median(parts.sum(axis=1))), "begin": float(med[0]),
            "call": float(med[1]), "end": float(med[2])}


def decode_config(runner: Runner, cache, device: Device, cfg: LlamaConfig, plan: Plan, batch: int,
                  graphs: bool) -> dict:
    """Decode ``batch`` sequences (ids 0..batch-1): eager, then (ours, CUDA) with CUDA graphs;
    the steps' tokens are popped afterwards (contexts as filled)."""
    seq_ids, ones = _shape(range(batch)), _shape([1] * batch)
    ids = device.tokens(np.random.default_rng(SEED + batch).integers(0, cfg.vocab_size, (batch, 1)))
    appended, t = [0], time.perf_counter
    row: dict = {}

    def run_step(marks: list, call: Callable[[], object]) -> None:
        appended[0] += 1
        m0 = t()
        runner.begin(cache, seq_ids, ones)
        m1 = t()
        call()
        m2 = t()
        runner.end(cache)
        marks.extend((m0, m1, m2, t()))

    row["eager"] = measure(lambda marks: run_step(marks, lambda: runner.decode_fn(ids, cache, *runner.weights)),
                           device, plan)
    if graphs:
        row["graph"] = _graph_decode(runner, cache, device, plan, ids, run_step)
    for s in range(batch):
        runner.popn(cache, s, appended[0])
    return row


def _graph_decode(runner: Runner, cache, device: Device, plan: Plan, ids, run_step) -> dict:
    g, held, runs = _graphs(cache), [None], {}

    def forward():
        held[0] = runner.decode_fn(ids, cache, *runner.weights)  # keeps the captured output alive

    def call():
        how = g.run(forward)
        runs[how] = runs.get(how, 0) + 1

    try:
        with g.stream_context():
            result = measure(lambda marks: run_step(marks, call), device, plan)
        result["runs"] = runs
        if runs.get("replayed", 0) < plan.steps:
            result["note"] = f"few replays: {runs}"
        return result
    except Exception as err:  # noqa: BLE001  (report it in the table, go on with the rest)
        runner.end(cache)
        return {"error": _short(err)}
    finally:
        g.close()


def decode_phase(runner: Runner, device: Device, cfg: LlamaConfig, plan: Plan, context: int,
                 batches: Sequence[int], graphs: bool, log) -> dict:
    """Each batch's decode configuration on a cache of its own, holding exactly ``batch``
    sequences of ``context`` tokens (filled by prefill). TVM's native cache, filled with 128
    sequences, failed a batch-8 decode with an illegal address on an H100, so no cache is shared
    between configurations."""
    result: dict = {"fill": 0.0, "rows": {}}
    for batch in batches:
        cache = runner.create(batch, batch * _round_up(context + plan.extra + PAGE), plan.chunk)
        for s in range(batch):
            runner.add(cache, s)
        result["fill"] += fill(runner, cache, device, cfg, plan, range(batch), context,
                               np.random.default_rng(SEED + 3))
        row = result["rows"][batch] = decode_config(runner, cache, device, cfg, plan, batch, graphs)
        log(f"    {runner.side} {batch} x {context}: " + ", ".join(
            f"{name} {batch / m['step']:.0f} tokens/s (step {m['step'] * 1e3:.2f} ms, host {m['host'] * 1e3:.2f} ms)"
            if "step" in m else f"{name} n/a" for name, m in row.items()), flush=True)
        del cache
        gc.collect()
    return result


def isolated_phase(native_decode: Callable[[int, int], dict], context: int, batches: Sequence[int], log) -> dict:
    """:func:`decode_phase`'s result, each batch from ``native_decode(context, batch)``."""
    result: dict = {"fill": 0.0, "rows": {}}
    for batch in batches:
        one = native_decode(context, batch)
        if "error" in one:
            result["rows"][batch] = {"eager": {"error": one["error"]}}
            log(f"    native {batch} x {context} (own process): {one['error']}", flush=True)
            continue
        result["fill"] += one["fill"]
        result["rows"][batch] = one["rows"][str(batch)]
        m = result["rows"][batch]["eager"]
        log(f"    native {batch} x {context} (own process): {batch / m['step']:.0f} tokens/s "
            f"(step {m['step'] * 1e3:.2f} ms, host {m['host'] * 1e3:.2f} ms)", flush=True)
    return result


def native_process(libs: pathlib.Path, model: str, plan: Plan) -> Callable[[int, int], dict]:
    """``native_decode(context, batch)`` running one native decode configuration in a process of
    its own (``--native-decode``): TVM's native cache failed a batch-8 decode with an illegal
    address on an H100 once other native caches had been used in the same process."""
    def native_decode(context: int, batch: int) -> dict:
        cmd = [sys.executable, __file__, "--libs", str(libs), "--models", model, "--steps", str(plan.steps),
               "--native-decode", str(context), str(batch)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(CHILD_MARK)]
        if proc.returncode or not lines:
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            return {"error": f"exit status {proc.returncode}: {tail[:200]}"}
        return json.loads(lines[-1][len(CHILD_MARK):])

    return native_decode


def kv_bytes(cfg: LlamaConfig, tokens: int) -> int:
    return tokens * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * np.dtype(cfg.dtype).itemsize


def fitting_batches(cfg: LlamaConfig, plan: Plan, context: int, free: Optional[int], skipped: list) -> List[int]:
    """The batches whose KV (one cache at a time) fits the free memory, less prefill activations
    and a reserve; the others go to ``skipped`` with the reason."""
    if free is None:
        return list(plan.batches)
    act = plan.chunk * (cfg.hidden_size * 4 + (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
                        + 2 * cfg.intermediate_size) * 2 * 2
    room = free - RESERVE - act
    out = []
    for batch in plan.batches:
        need = kv_bytes(cfg, batch * _round_up(context + plan.extra + PAGE))
        if need <= room:
            out.append(batch)
        else:
            skipped.append(f"{batch} x {context}: KV needs {need / 2**30:.1f} GiB, {room / 2**30:.1f} GiB free "
                           f"beside the weights, prefill activations and a {RESERVE >> 30} GiB reserve")
    return out


def run_model(name: str, cfg: LlamaConfig, executables: dict, device: Device, plan: Plan, graphs: bool,
              log=print, native_decode: Optional[Callable[[int, int], dict]] = None,
              kv_dtype: Optional[str] = None) -> dict:
    """Every phase of one model; with ``native_decode(context, batch)``, the native side's decode
    configurations run through it (one process each) instead of in this process; with
    ``kv_dtype``, ``executables["ours-fp8"]`` against ours (``e2e_fp8.run``)."""
    weights = device.weights(cfg, SEED)
    runners = {side: Runner(side, make_vm(side, executables[side], device), weights) for side in SIDES}
    result: dict = {"model": name, "config": dataclasses.asdict(cfg), "device": device.describe(), "skipped": [],
                    "graphs": graphs}
    log(f"{name}: logits check ...")
    result["check"] = check_logits(runners, device, cfg, plan, graphs)
    if "error" in result["check"].get("graph", {}):
        result["graphs"] = graphs = False
        result["graph_error"] = result["check"]["graph"]["error"]
    result["ttft"] = {side: {} for side in SIDES}
    if plan.ttft:
        log(f"{name}: TTFT ...")
        for side in SIDES:
            times = result["ttft"][side] = ttft_phase(runners[side], device, cfg, plan)
            log(f"    {side}: " + ", ".join(f"1 x {n} {t * 1e3:.1f} ms" for n, t in times.items()), flush=True)
    free = device.free_bytes()
    result["decode"] = {}
    for context in plan.contexts:
        batches = fitting_batches(cfg, plan, context, free, result["skipped"])
        if not batches:
            continue
        log(f"{name}: decode at context {context}, batches {batches} ...")
        result["decode"][context] = {}
        for side in SIDES:
            if side == "native" and native_decode is not None:
                result["decode"][context][side] = isolated_phase(native_decode, context, batches, log)
                continue
            result["decode"][context][side] = decode_phase(runners[side], device, cfg, plan, context, batches,
                                                           graphs and side == "ours", log)
    if kv_dtype:
        import e2e_fp8

        fp8 = Runner("ours", make_vm("ours", executables["ours-fp8"], device), weights, calibrate=True)
        result["fp8"] = e2e_fp8.run(sys.modules[__name__], result, runners["ours"], fp8, device, cfg, plan, graphs,
                                    kv_dtype, log)
        del fp8
    del runners, weights
    device.release()
    return result


# ----------------------------------------------------------------------------- main

def run(executables_for: Callable[[str], dict], models: Dict[str, LlamaConfig], device: Device, plan: Plan,
        graphs: bool, json_path: Optional[pathlib.Path], libs: Optional[pathlib.Path] = None,
        kv_dtype: Optional[str] = None) -> int:
    import e2e_fp8

    results = []
    for name, cfg in models.items():
        result = run_model(name, cfg, executables_for(name), device, plan, graphs,
                           native_decode=native_process(libs, name, plan) if libs else None, kv_dtype=kv_dtype)
        result["chunk"] = plan.chunk
        report(result)
        if "fp8" in result:
            e2e_fp8.report(result)
        results.append(result)
    if json_path:
        json_path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    failed = [r["model"] for r in results if not r["check"]["ok"]]
    if failed:
        print(f"FAIL: logits of ours and native differ beyond tolerance for {', '.join(failed)}", file=sys.stderr)
        return 1
    failed = [r["model"] for r in results if "fp8" in r and not r["fp8"]["check"]["ok"]]
    if failed:
        print(f"FAIL: logits over {kv_dtype} pages differ from float16 pages beyond tolerance for "
              f"{', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _plan(plan: Plan, args) -> Plan:
    """``plan`` with the counts given on the command line."""
    given = {"steps": args.steps, "contexts": args.contexts, "batches": args.batches, "ttft": args.ttft}
    plan = dataclasses.replace(plan, **{k: v for k, v in given.items() if v is not None})
    return dataclasses.replace(plan, chunk=max([plan.chunk, *plan.ttft]))


@functools.lru_cache(maxsize=None)
def _smoke_executable(side: str, kv_dtype: Optional[str] = None):
    """``--cpu-smoke``'s tiny model for one side, compiled once per process."""
    import e2e_models

    return e2e_models.compile_model(side, SMOKE_MODEL, tvm.target.Target("llvm"), kv_dtype)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prepare", type=pathlib.Path, help="compile the libraries into this folder (here)")
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--bundle", action="store_true", help="--prepare: also pack TVM's runtime-only bundle")
    parser.add_argument("--libs", type=pathlib.Path, help="folder built by --prepare (GPU host)")
    parser.add_argument("--cpu-smoke", action="store_true", help="a tiny model on llvm, compiled in-process")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    parser.add_argument("--steps", type=int, help="timed decode steps per configuration")
    parser.add_argument("--contexts", type=int, nargs="*", help="decode contexts (default 1024 4096; none: "
                        "no decode)")
    parser.add_argument("--batches", type=int, nargs="+", help="decode batches (default 1 8 32 128)")
    parser.add_argument("--ttft", type=int, nargs="*", help="TTFT prompt lengths (default 512 2048 8192; none: "
                        "no TTFT)")
    parser.add_argument("--no-graph", action="store_true", help="skip ours with CUDA graphs")
    parser.add_argument("--json", type=pathlib.Path, help="write every result to this file")
    parser.add_argument("--kv-dtype", choices=KV_DTYPES,
                        help="also ours over 8-bit pages of this format (--prepare: build it; else: run it "
                        "beside ours over float16 pages)")
    parser.add_argument("--soak", type=float, metavar="MINUTES", help="only serve random traffic with "
                        "generate.Engine on ours for this long (the 1b model unless one is named)")
    parser.add_argument("--same-process", action="store_true", help="native decode configurations in this "
                        "process (default: a process each)")
    parser.add_argument("--native-decode", type=int, nargs=2, metavar=("CONTEXT", "BATCH"),
                        help=argparse.SUPPRESS)  # one native decode configuration (a child process)
    args = parser.parse_args(argv)
    if args.prepare:
        import e2e_models

        return e2e_models.prepare(args.prepare, args.arch, {m: MODELS[m] for m in args.models}, MANIFEST,
                                  args.bundle, args.kv_dtype)
    if args.cpu_smoke:
        import e2e_soak

        plan = _plan(SMOKE_PLAN, args)
        if args.soak is not None:
            executable = (_smoke_executable("ours-fp8", args.kv_dtype) if args.kv_dtype
                          else _smoke_executable("ours"))
            return run_soak(executable, SMOKE_MODEL, Device(cuda=False), plan, args.soak, e2e_soak.SMOKE_LOAD,
                            args.json, calibrate=bool(args.kv_dtype))
        def smoke(_name: str) -> dict:
            sides = {side: _smoke_executable(side) for side in SIDES}
            return {**sides, "ours-fp8": _smoke_executable("ours-fp8", args.kv_dtype)} if args.kv_dtype else sides

        return run(smoke, {"tiny": SMOKE_MODEL}, Device(cuda=False), plan, False, args.json, kv_dtype=args.kv_dtype)
    if args.libs is None:
        parser.error("one of --prepare DIR (here), --libs DIR (GPU host) or --cpu-smoke")
    os.environ.setdefault("RELAX_KVCACHE_CACHE_DIR", str((args.libs / "cache").resolve()))  # nvcc's fatbins
    from relax_kvcache import deploy

    manifest = json.loads((args.libs / MANIFEST).read_text())
    missing = [m for m in args.models if m not in manifest["models"]]
    if missing:
        parser.error(f"{args.libs} holds no libraries for {missing}: run --prepare with --models {' '.join(missing)}")
    other = [m for m in args.models if args.kv_dtype and manifest["models"][m].get("kv_dtype") != args.kv_dtype]
    if other:
        parser.error(f"{args.libs} holds no {args.kv_dtype} build of {other}: run --prepare with --kv-dtype "
                     f"{args.kv_dtype} --models {' '.join(other)}")
    device = Device(cuda=True)
    plan = _plan(GPU_PLAN, args)

    def executables_for(name: str) -> dict:
        if manifest["models"][name]["config"] != dataclasses.asdict(MODELS[name]):
            raise SystemExit(f"{name}: the libraries were built for another configuration; run --prepare again")
        sides = [*SIDES, *(["ours-fp8"] if args.kv_dtype else [])]
        return {side: deploy.load(str(args.libs / manifest["models"][name][side]), device=device.dev)
                for side in sides}

    if args.soak is not None:
        import e2e_soak

        name = args.models[0] if len(args.models) == 1 else "1b"
        side = "ours-fp8" if args.kv_dtype else "ours"  # --kv-dtype: the soak over 8-bit pages
        return run_soak(executables_for(name)[side], MODELS[name], device, plan, args.soak, e2e_soak.GPU_LOAD,
                        args.json, calibrate=bool(args.kv_dtype))
    if args.native_decode:
        return native_child(args.models[0], executables_for(args.models[0])["native"], device, plan,
                            *args.native_decode)
    print(f"e2e benchmark on {device.describe()}, TVM {tvm.__version__}", flush=True)
    return run(executables_for, {m: MODELS[m] for m in args.models}, device, plan, not args.no_graph, args.json,
               libs=None if args.same_process else args.libs, kv_dtype=args.kv_dtype)


def run_soak(executable, cfg: LlamaConfig, device: Device, plan: Plan, minutes: float, load,
             json_path: Optional[pathlib.Path], calibrate: bool = False) -> int:
    """``--soak``: ``generate.Engine`` on ours for ``minutes`` (``e2e_soak.soak``), on a cache
    sized to run near full (``calibrate``: over 8-bit pages, scales from the first step); exit
    status 1 unless it passed."""
    import e2e_soak
    from relax_kvcache.generate import Engine

    weights = device.weights(cfg, SEED)
    vm = make_vm("ours", executable, device)
    mean = (sum(load.prompt) + sum(load.output)) / 2
    total = _round_up(max(int(0.9 * load.max_live * mean), load.prompt[1] + load.output[1] + 8 * PAGE))
    cache = Runner("ours", vm, weights, calibrate=calibrate).create(2 * load.max_live, total, plan.chunk)
    functions = {"prefill_rows": vm["prefill_rows"], "decode": vm["decode"]}  # the sampled rows' logits
    engine = Engine(functions, weights, cache, device.dev, prefill_chunk_size=plan.chunk,
                    vocab_size=cfg.vocab_size, cuda_graphs=device.cuda, prefill_rows=True)
    pages = f" over {cache.config.kv_dtype} pages" if cache.config.kv_dtype else ""
    print(f"soak{pages} on {device.describe()}: {minutes} min, up to {load.max_live} requests, prompts "
          f"{load.prompt[0]}-{load.prompt[1]}, outputs {load.output[0]}-{load.output[1]} tokens, a cache of "
          f"{total} tokens, CUDA graphs {'on' if device.cuda else 'off'}", flush=True)
    try:
        same = e2e_soak.graphs_agree(engine, lambda: Engine(functions, weights, cache, device.dev,
                                                             prefill_chunk_size=plan.chunk, vocab_size=cfg.vocab_size,
                                                             cuda_graphs=False, prefill_rows=True)) if device.cuda else None
        result = e2e_soak.soak(engine, minutes * 60, load, device.used_bytes)
    finally:
        engine.close()
    result["graphs_agree"] = same
    result["ok"] = result["ok"] and same is not False
    if json_path:
        json_path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0 if result["ok"] else 1


def native_child(name: str, executable, device: Device, plan: Plan, context: int, batch: int) -> int:
    """``--native-decode``: one native decode configuration; its result as a JSON line."""
    cfg = MODELS[name]
    runner = Runner("native", make_vm("native", executable, device), device.weights(cfg, SEED))
    result = decode_phase(runner, device, cfg, plan, context, [batch], False, lambda *a, **k: None)
    print(CHILD_MARK + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
