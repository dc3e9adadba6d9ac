"""Load on the GPU: ``generate.Engine`` serving random traffic on a compiled model for a while.

Requests arrive at random with random prompt and output lengths; forks, speculative steps (drafts
that are mostly rejected, so rolled back with ``popn``) and cancellations happen along the way, and
the cache is sized to run near full (a step that finds it full preempts the youngest request, as a
server would). Reported: requests served, tokens/s, request latency percentiles, and device / host
memory sampled over time. It fails unless every page is back at the end, memory after warm-up does
not grow and nothing raised other than the cache being full.

Used by ``e2e_bench.py --soak MINUTES`` (the 1B-shape model on the GPU; ``--cpu-smoke`` on llvm).
"""

from __future__ import annotations

import dataclasses
import resource
import time
from typing import Callable, List, Optional

import numpy as np

from relax_kvcache import CacheFullError
from relax_kvcache.generate import Engine, Request

#: memory growth allowed after warm-up: host (allocator noise) and device (pool rounding)
HOST_GROWTH = 64 << 20
DEVICE_GROWTH = 64 << 20


@dataclasses.dataclass(frozen=True)
class Load:
    """The traffic: at most ``max_live`` requests, prompts of ``prompt`` tokens and outputs of
    ``output`` tokens (inclusive ranges), and the per-step chance of each event."""

    max_live: int
    prompt: tuple
    output: tuple
    arrive: float = 0.5
    fork: float = 0.05
    speculate: float = 0.1
    cancel: float = 0.02
    shared: float = 0.0  # the share of prompts that start with one of a few system prompts


GPU_LOAD = Load(max_live=48, prompt=(16, 2048), output=(8, 512))
SMOKE_LOAD = Load(max_live=6, prompt=(2, 60), output=(2, 24))


def _rss() -> Optional[int]:
    """Resident host memory of this process, in bytes (None where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return None


def soak(engine: Engine, seconds: float, load: Load, device_used: Callable[[], Optional[int]],
         log=print, seed: int = 0) -> dict:
    """Serve random traffic on ``engine`` for ``seconds``; the result dict (see the module doc).
    ``device_used()``: device bytes in use (None where unknown)."""
    rng = np.random.default_rng(seed)
    pages = engine.free_pages()
    born: dict = {}  # seq_id -> arrival time
    stats = {"arrived": 0, "served": 0, "cancelled": 0, "preempted": 0, "forks": 0, "speculated": 0}
    latencies: List[float] = []
    samples: List[tuple] = []
    start = last_sample = time.perf_counter()
    tokens0 = 0

    def live() -> List[Request]:
        return list(engine.requests.values())

    stems = [rng.integers(0, engine.vocab_size, load.prompt[1] // 2).tolist() for _ in range(4)]

    def arrive() -> None:
        n = int(rng.integers(load.prompt[0], load.prompt[1] + 1))
        prompt = rng.integers(0, engine.vocab_size, n).tolist()
        if rng.random() < load.shared:  # a system prompt (or part of one), then the request's own
            stem = stems[int(rng.integers(len(stems)))]
            prompt = (stem[:int(rng.integers(1, len(stem) + 1))] + prompt)[:load.prompt[1]]
        req = engine.add_request(prompt, int(rng.integers(load.output[0], load.output[1] + 1)))
        born[req.seq_id] = time.perf_counter()

    def event(name: str, action: Callable[[], None]) -> None:
        try:
            action()
            stats[name] += 1
        except CacheFullError:
            preempt()

    def fork(parent: Request) -> None:
        child = engine.fork(parent, int(rng.integers(engine.vocab_size)))
        born[child.seq_id] = time.perf_counter()

    def cancel(victim: Request) -> None:
        engine.cancel(victim)
        born.pop(victim.seq_id, None)

    def preempt() -> None:
        youngest = max(live(), key=lambda r: r.seq_id, default=None)
        if youngest is not None:
            engine.cancel(youngest)
            born.pop(youngest.seq_id, None)
            stats["preempted"] += 1

    while time.perf_counter() - start < seconds:
        reqs = live()
        if len(reqs) < load.max_live and (not reqs or rng.random() < load.arrive):
            event("arrived", arrive)
        reqs = live()
        forkable = [r for r in reqs if not r.prefilling and r.generated == 1]
        if forkable and len(reqs) < load.max_live and rng.random() < load.fork:
            parent = forkable[int(rng.integers(len(forkable)))]
            event("forks", lambda: fork(parent))
        spec = [r for r in reqs if not r.prefilling and r.cached == len(r.tokens) - 1
                and r.generated + 3 < r.max_new_tokens]
        if spec and rng.random() < load.speculate:
            req = spec[int(rng.integers(len(spec)))]
            event("speculated", lambda: engine.speculate(req, rng.integers(0, engine.vocab_size, 2).tolist()))
        if reqs and rng.random() < load.cancel:
            victim = reqs[int(rng.integers(len(reqs)))]
            event("cancelled", lambda: cancel(victim))
        if not engine.requests:
            continue
        try:
            done = engine.step()
        except CacheFullError:
            preempt()
            continue
        now = time.perf_counter()
        for req in done:
            stats["served"] += 1
            latencies.append(now - born.pop(req.seq_id, now))
        if now - last_sample >= max(seconds / 40, 0.05) or not samples:
            tokens = engine.stats.decode_tokens + engine.stats.prefill_tokens
            samples.append((now - start, device_used(), _rss(), engine.free_pages(), len(engine.requests),
                            (tokens - tokens0) / (now - last_sample) if samples else 0.0))
            tokens0, last_sample = tokens, now
    for req in live():
        engine.cancel(req)
    elapsed = time.perf_counter() - start
    return _result(stats, latencies, samples, elapsed, engine, pages, log)


def graphs_agree(engine: Engine, eager: Callable[[], Engine], log=print, seed: int = 1) -> bool:
    """Greedy generation of the same requests through ``engine`` (CUDA graphs) and through an
    eager engine on the same cache (``eager()``): the same tokens (the replayed kernels are the
    captured ones), and graphs replayed on the way. Two waves of four requests with 10-16 new
    tokens each: the batch shrinks as requests finish, and the second wave's batches replay
    graphs captured on the first's (other sequences, same sizes)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, engine.vocab_size, int(n)).tolist() for n in rng.integers(8, 64, 8)]
    budgets = [10 + 2 * (i % 4) for i in range(len(prompts))]
    outputs = []
    for make in (eager, lambda: engine):
        e = make()
        tokens = {}
        for wave in (slice(0, 4), slice(4, 8)):
            reqs = [e.add_request(p, n) for p, n in zip(prompts[wave], budgets[wave])]
            while e.requests:
                for req in e.step():
                    tokens[req.seq_id] = req.tokens
            outputs.append([tokens[r.seq_id] for r in reqs])
        if e is not engine:
            e.close()
    same = outputs[:2] == outputs[2:] and engine.stats.graph_replays > 0
    log(f"soak: greedy tokens with CUDA graphs ({engine.stats.graph_replays} replays) "
        f"{'equal' if outputs[:2] == outputs[2:] else 'DIFFER from'} the eager ones ({len(prompts)} requests in two "
        "waves, 10-16 tokens each)")
    return same


def _growth(values: List[Optional[int]]) -> Optional[int]:
    """Growth of a sampled quantity's floor: its least value over the last quarter of the run
    against its least over the second (the first is warm-up). Memory that a step allocates and
    frees (a prefill's logits on the host) comes and goes; a leak raises the floor."""
    known = [v for v in values if v is not None]
    if len(known) < 4:
        return None
    q = len(known) // 4
    return min(known[3 * q:]) - min(known[q:2 * q])


def _result(stats: dict, latencies: List[float], samples: List[tuple], elapsed: float, engine: Engine,
            pages: int, log) -> dict:
    tokens = engine.stats.decode_tokens + engine.stats.prefill_tokens
    device_growth = _growth([s[1] for s in samples])
    host_growth = _growth([s[2] for s in samples])
    result = {
        **stats,
        "seconds": elapsed, "steps": engine.stats.steps, "tokens_per_s": tokens / elapsed,
        "decode_tokens": engine.stats.decode_tokens, "rolled_back": engine.stats.rolled_back,
        "latency_s": {f"p{q}": float(np.percentile(latencies, q)) for q in (50, 90, 99)} if latencies else {},
        "pages_back": engine.free_pages() == pages, "free_pages": [engine.free_pages(), pages],
        "device_growth": device_growth, "host_growth": host_growth,
        "samples": samples,
    }
    result["ok"] = (result["pages_back"] and stats["served"] > 0
                    and (device_growth is None or device_growth <= DEVICE_GROWTH)
                    and (host_growth is None or host_growth <= HOST_GROWTH))
    lat = result["latency_s"]
    log(f"soak: {elapsed:.0f} s, {stats['arrived']} requests arrived, {stats['served']} served ({stats['cancelled']} cancelled, "
        f"{stats['preempted']} preempted, {stats['forks']} forks, {stats['speculated']} speculative steps, "
        f"{engine.stats.rolled_back} tokens rolled back), {engine.stats.steps} steps "
        f"({engine.stats.graph_replays} replayed as CUDA graphs), "
        f"{result['tokens_per_s']:.0f} tokens/s")
    if lat:
        log("soak: request latency p50 / p90 / p99 " + " / ".join(f"{lat[k]:.2f}" for k in ("p50", "p90", "p99"))
            + " s")
    log(f"{'t s':>8} {'device MiB':>11} {'host MiB':>9} {'free pages':>11} {'live':>5} {'tokens/s':>9}")
    for t, dev, rss, free, n, rate in samples[::max(1, len(samples) // 10)]:
        mib = [float("nan") if v is None else v / 2**20 for v in (dev, rss)]
        log(f"{t:8.1f} {mib[0]:11.0f} {mib[1]:9.0f} {free:11d} "
            f"{n:5d} {rate:9.0f}")
    mib = lambda v: "n/a" if v is None else f"{v / 2**20:.1f} MiB"  # noqa: E731
    log(f"soak: pages back {engine.free_pages()} / {pages}; growth after warm-up: device {mib(device_growth)}, "
        f"host {mib(host_growth)} -> {'PASS' if result['ok'] else 'FAIL'}")
    return result
