"""``e2e_bench.py``'s phases on one side: the logits check against native, TTFT, context fill
and decode timing (step time and host time per step), and which decode batches fit the device."""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import tvm

from relax_kvcache.models import LlamaConfig
from relax_kvcache.tensors import view
from e2e_report import SIDES
from e2e_runtime import PAGE, RESERVE, SEED, TOLERANCE, Device, Plan, Runner, round_up, shape_tuple


def _graphs(cache):
    from relax_kvcache.cuda_graph import DecodeGraphs

    return DecodeGraphs(cache)


def logits_run(runner: Runner, device: Device, plan: Plan, prompt: np.ndarray, tokens: np.ndarray,
               graphs: bool = False) -> dict:
    """Logits of one prefill and ``tokens`` decode steps of one sequence (ours with ``graphs``:
    the decode steps through ``DecodeGraphs``, replayed from the fourth on)."""
    cache = runner.create(1, round_up(len(prompt) + len(tokens) + PAGE), plan.chunk)
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
                runner.begin(cache, shape_tuple([0]), shape_tuple([1]))
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
    cache = runner.create(1, round_up(max(plan.ttft) + PAGE), plan.chunk)
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
    """Fill each of ``seqs`` with ``length`` tokens, ``plan.chunk`` tokens per step (``plan.fill``:
    by the model's prefill of random tokens, or by each layer's attention call on random q/k/v,
    the same for both sides); seconds."""
    pending = [[s, length] for s in seqs]
    qkv = out = None
    if plan.fill == "attention":
        heads = cfg.num_heads + 2 * cfg.num_kv_heads
        qkv = tvm.runtime.tensor(rng.standard_normal((plan.chunk, heads, cfg.head_dim)).astype(cfg.dtype), device.dev)
        out = tvm.runtime.empty((plan.chunk, cfg.num_heads, cfg.head_dim), cfg.dtype, device.dev)
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
        seq_ids, lengths = [s for s, _ in step], [n for _, n in step]
        if qkv is None:
            ids = device.tokens(rng.integers(0, cfg.vocab_size, (1, sum(lengths))))
            runner.forward(cache, runner.prefill_fn, ids, seq_ids, lengths)
            continue
        n = sum(lengths)  # views of the step's rows, as a model passes them
        rows_qkv, rows_out = (view(t, (n,) + tuple(t.shape[1:]), 0, t.dtype) for t in (qkv, out))
        runner.begin(cache, shape_tuple(seq_ids), shape_tuple(lengths))
        for layer in range(cfg.num_layers):
            runner.attention(cache, layer, cfg.head_dim ** -0.5, rows_qkv, rows_out)
        runner.end(cache)
    device.sync()
    return time.perf_counter() - start


def measure(step: Callable[[list], None], device: Device, plan: Plan) -> dict:
    """``step(marks)`` appends four perf_counter marks (before begin_forward, after it, after the
    VM call, after end_forward). Step time: ``plan.steps`` steps back to back, one sync at the
    end (``plan.sync_steps``: a sync before each). Host time: steps issued one at a time after a
    sync (the GPU queue empty), not waited for."""
    for _ in range(plan.warmup):
        if plan.sync_steps:
            device.sync()
        step([])
    device.sync()
    start = time.perf_counter()
    for _ in range(plan.steps):
        if plan.sync_steps:
            device.sync()
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
    seq_ids, ones = shape_tuple(range(batch)), shape_tuple([1] * batch)
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
        cache = runner.create(batch, batch * round_up(context + plan.extra + PAGE), plan.chunk)
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
        need = kv_bytes(cfg, batch * round_up(context + plan.extra + PAGE))
        if need <= room:
            out.append(batch)
        else:
            skipped.append(f"{batch} x {context}: KV needs {need / 2**30:.1f} GiB, {room / 2**30:.1f} GiB free "
                           f"beside the weights, prefill activations and a {RESERVE >> 30} GiB reserve")
    return out
