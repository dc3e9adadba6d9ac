"""``relax-kvcache demo --cache-only``: a serving workload through the cache on the local CPU
(chunked prefill, a fork mid-page, a ``popn`` rollback), every attention output checked against
float64 numpy attention over copies of the K/V, which ``debug_get_kv`` reads back.

With ``kv_dtype`` (8-bit pages) the copies hold what the cache stored: each step's new K/V,
read back with ``debug_get_kv``, must lie within one step of the format's grid of numpy's
quantization of the float64 K/V (``max_grid_steps``; RoPE in float32 may move a value across a
rounding boundary), and the outputs are checked against float64 attention over the stored
values (a prefill step's own rows as computed, as the cache attends them)."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Dict, List, Optional, Tuple

import ml_dtypes
import numpy as np
import tvm

from .cache import PagedAttentionKVCache
from .config import KV_DTYPE_MAX, KVCacheConfig, RopeMode
from .reference import attention, rope
from .tensors import numpy_dtype

_TOLERANCE = {"float32": 2e-3, "float16": 2e-2, "bfloat16": 6e-2}


@dataclasses.dataclass
class _Request:
    prompt_len: int
    max_new_tokens: int
    prefilled: int = 0
    generated: int = 0
    in_prefill = property(lambda self: self.prefilled < self.prompt_len)
    done = property(lambda self: not self.in_prefill and self.generated >= self.max_new_tokens)


@dataclasses.dataclass
class DemoResult:
    steps: int
    tokens: int
    cache_seconds: float
    max_error: float
    tolerance: float
    kv_dtype: Optional[str] = None
    max_grid_steps: float = 0.0  # 8-bit pages: stored K/V against numpy's quantization, in grid steps


    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.cache_seconds if self.cache_seconds > 0 else float("inf")

    @property
    def ok(self) -> bool:
        return self.max_error <= self.tolerance and self.max_grid_steps <= 1.0


class _Driver:
    """Serves requests on the cache and on float64 copies of its K/V (stored K: K rotated at its
    token index), tracking the worst error."""

    def __init__(self, cache: PagedAttentionKVCache, seed: int, log: Callable[[str], None]) -> None:
        self.cache, self.cfg, self.log = cache, cache.config, log
        self.requests: Dict[int, _Request] = {}
        self.kv: Dict[int, List[np.ndarray]] = {}  # seq -> [K, V], each (layers, length, Hkv, D)
        self.rng = np.random.default_rng(seed)
        self.sm_scale = self.cfg.head_dim ** -0.5
        self.max_error, self.tokens, self.steps, self.cache_seconds = 0.0, 0, 0, 0.0
        self.max_grid_steps = 0.0

    def admit(self, seq_id: int, prompt: int, new_tokens: int) -> None:
        cfg = self.cfg
        self.cache.add_sequence(seq_id)
        self.kv[seq_id] = [np.zeros((cfg.num_layers, 0, cfg.num_kv_heads, cfg.head_dim))] * 2
        self.requests[seq_id] = _Request(prompt, new_tokens)

    def fork(self, parent: int, child: int, pos: int, new_tokens: int) -> None:
        self.cache.fork_sequence(parent, child, pos)
        self.kv[child] = [x[:, :pos] for x in self.kv[parent]]
        self.requests[child] = _Request(pos, new_tokens, prefilled=pos)

    def popn(self, seq_id: int, n: int) -> None:
        self.cache.popn(seq_id, n)
        self.kv[seq_id] = [x[:, :x.shape[1] - n] for x in self.kv[seq_id]]

    def run_steps(self, count: int) -> None:
        """Up to ``count`` steps: a token of every decoding request, then prefill chunks within
        the prefill chunk size; finished requests are removed."""
        for _ in range(count):
            batch = [(s, 1) for s, r in self.requests.items() if not r.in_prefill and not r.done]
            parts = [f"decode x{len(batch)}"] if batch else []
            budget = self.cfg.prefill_chunk_size - len(batch)
            for seq_id, req in self.requests.items():
                if req.in_prefill and budget > 0:
                    take = min(budget, req.prompt_len - req.prefilled)
                    batch.append((seq_id, take))
                    parts.append(f"prefill {seq_id}[{req.prefilled}:{req.prefilled + take}]")
                    budget -= take
            if not batch:
                return
            self.step(batch, ", ".join(parts))
            for seq_id, length in batch:
                req = self.requests[seq_id]
                if req.in_prefill:
                    req.prefilled += length
                else:
                    req.generated += 1
            for seq_id in [s for s, r in self.requests.items() if r.done]:
                self.cache.remove_sequence(seq_id)
                del self.kv[seq_id], self.requests[seq_id]
                self.log(f"      request {seq_id} finished; "
                         f"{self.cache.get_num_available_pages()} pages free")

    def step(self, batch: List[Tuple[int, int]], label: str) -> None:
        cfg, device = self.cfg, self.cache.device
        n, hq, hkv = sum(length for _, length in batch), cfg.num_qo_heads, cfg.num_kv_heads

        def tensor(values: np.ndarray) -> tvm.runtime.Tensor:
            return tvm.runtime.tensor(values.astype(numpy_dtype(cfg.dtype)), device)

        qkv_dev = [tensor(self.rng.standard_normal((n, hq + 2 * hkv, cfg.head_dim)))
                   for _ in range(cfg.num_layers)]
        outs = [tensor(np.full((n, hq, cfg.head_dim), np.nan)) for _ in range(cfg.num_layers)]
        start = time.perf_counter()
        self.cache.begin_forward([s for s, _ in batch], [length for _, length in batch])
        for layer in range(cfg.num_layers):
            self.cache.attention_with_fused_qkv(layer, qkv_dev[layer], outs[layer], self.sm_scale)
        self.cache.end_forward()
        self.cache_seconds += time.perf_counter() - start
        qkv = np.stack([x.numpy().astype(np.float64) for x in qkv_dev])  # (layers, n, heads, D)
        got = np.stack([o.numpy().astype(np.float64) for o in outs])
        error, offset = 0.0, 0
        for seq_id, length in batch:
            rows = slice(offset, offset + length)
            cached = self.kv[seq_id][0].shape[1]
            positions = np.arange(cached, cached + length)
            new_k = np.stack([rope(x[rows, hq:hq + hkv], positions, cfg.rope_theta, cfg.rope_scale) for x in qkv])
            new = (new_k, qkv[:, rows, hq + hkv:])
            k, v = (np.concatenate(pair, axis=1) for pair in zip(self.kv[seq_id], new))
            if cfg.kv_dtype is not None:  # the copies hold the stored values
                stored = self.stored(seq_id, cached, cached + length, new)
                self.kv[seq_id] = [np.concatenate(pair, axis=1) for pair in zip(self.kv[seq_id], stored)]
                if all(n == 1 for _, n in batch):  # a decode step reads its token as stored
                    k, v = self.kv[seq_id]
            else:
                self.kv[seq_id] = [k, v]
            for layer in range(cfg.num_layers):
                q = rope(qkv[layer, rows, :hq], positions, cfg.rope_theta, cfg.rope_scale)
                want, _ = attention(q, k[layer], v[layer], self.sm_scale, causal=True)
                error = max(error, float(np.abs(got[layer, rows] - want).max()))
            offset += length
        self.max_error = max(self.max_error, error)
        self.tokens += n
        self.steps += 1
        self.log(f"  step {self.steps:3d} {label:<44s} {n:4d} tokens  max|err| {error:.1e}")

    def read(self, seq_id: int, start: int, end: int) -> Tuple[np.ndarray, np.ndarray]:
        """``debug_get_kv`` of positions ``[start, end)``, float64 ``(layers, n, Hkv, D)`` each."""
        cfg = self.cfg
        shape = (cfg.num_layers, end - start, cfg.num_kv_heads, cfg.head_dim)
        k, v = (tvm.runtime.empty(shape, cfg.dtype, self.cache.device) for _ in range(2))
        self.cache.debug_get_kv(seq_id, start, end, k, v)
        return k.numpy().astype(np.float64), v.numpy().astype(np.float64)

    def stored(self, seq_id: int, start: int, end: int, new: Tuple[np.ndarray, np.ndarray]
               ) -> Tuple[np.ndarray, np.ndarray]:
        """The stored K/V of the step's positions ``[start, end)``, checked against numpy's
        quantization of the float64 K/V ``new`` (within one grid step)."""
        fmt, got = self.cfg.kv_dtype, self.read(seq_id, start, end)
        fmax, (bits, emin) = KV_DTYPE_MAX[fmt], (3, -6) if "e4m3" in fmt else (2, -14)
        for kv, (values, stored) in enumerate(zip(new, got)):
            scale = np.stack([self.cache.get_kv_scales(layer)[kv] for layer in range(self.cfg.num_layers)])
            scale = scale.astype(np.float64)[:, None, :, None]
            want, got_q = (np.clip(x / scale, -fmax, fmax).astype(np.float32).astype(getattr(ml_dtypes, fmt))
                           .astype(np.float64) for x in (values, stored))  # stored: exact up to the model dtype
            exponent = np.floor(np.log2(np.maximum(np.maximum(np.abs(want), np.abs(got_q)), 2.0 ** emin)))
            steps = np.abs(got_q - want) / np.exp2(exponent - bits)
            self.max_grid_steps = max(self.max_grid_steps, float(steps.max()))
        return got

    def verify_contents(self) -> None:
        for seq_id, want in self.kv.items():
            length = want[0].shape[1]
            if length == 0:
                continue
            for got, expected in zip(self.read(seq_id, 0, length), want):
                self.max_error = max(self.max_error, float(np.abs(got - expected).max()))
        self.log(f"      read back K/V of {len(self.kv)} sequences with debug_get_kv")


def run_demo(*, dtype: str = "float32", seed: int = 0, kv_dtype: Optional[str] = None,
             log: Callable[[str], None] = print) -> DemoResult:
    """Run the demo workload and return its summary (``kv_dtype``: 8-bit pages, with scales
    calibrated from the first prefill step)."""
    config = KVCacheConfig(num_layers=4, num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                           max_num_seqs=8, max_total_seq_len=2048, prefill_chunk_size=64,
                           rope_mode=RopeMode.NORMAL, rope_theta=1e4, dtype=dtype, kv_dtype=kv_dtype)
    pages = f", {kv_dtype} pages" if kv_dtype else ""
    log(f"[1/4] kernels for the local CPU ({dtype}{pages}, GQA {config.num_qo_heads}/"
        f"{config.num_kv_heads} heads, head_dim {config.head_dim}, {config.num_layers} layers)")
    start = time.perf_counter()
    cache = PagedAttentionKVCache(config, tvm.cpu(), progress=lambda msg: log("      " + msg))
    log(f"      ready in {time.perf_counter() - start:.1f} s: {cache}")
    driver = _Driver(cache, seed, log)
    if kv_dtype is not None:
        cache.calibrate_kv_scales()
        log("      K / V scales: calibrated from the first prefill step's maximum")
    log("[2/4] chunked prefill of 3 requests mixed with decode")
    for seq_id, prompt, new_tokens in ((0, 70, 24), (1, 25, 12), (2, 40, 30)):
        driver.admit(seq_id, prompt, new_tokens)
    driver.run_steps(6)
    log("[3/4] fork mid-page, speculative extension rolled back with popn, late arrival")
    parent = driver.requests[1]
    fork_pos = parent.prompt_len + parent.generated - 3  # inside a page
    driver.fork(1, 10, fork_pos, new_tokens=10)
    log(f"      forked request 1 at position {fork_pos} (page offset "
        f"{fork_pos % config.page_size}) into request 10")
    driver.step([(2, 5)], "speculative extension of request 2 by 5")
    driver.popn(2, 4)
    log("      rolled back 4 rejected tokens of request 2 with popn")
    driver.verify_contents()
    driver.admit(3, prompt=100, new_tokens=8)
    driver.run_steps(8)
    driver.verify_contents()
    log("[4/4] run every request to completion")
    driver.run_steps(1000)
    if not cache.empty():
        raise RuntimeError("the cache is not empty after every request finished")
    log(f"      all requests finished; cache empty, {cache.get_num_available_pages()} pages free")
    return DemoResult(steps=driver.steps, tokens=driver.tokens, cache_seconds=driver.cache_seconds,
                      max_error=driver.max_error, tolerance=_TOLERANCE[dtype], kv_dtype=kv_dtype,
                      max_grid_steps=driver.max_grid_steps)
