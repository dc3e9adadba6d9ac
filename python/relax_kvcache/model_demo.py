"""``relax-kvcache demo``: a Llama-style model compiled with the cache serves a few requests
through :class:`~relax_kvcache.generate.Engine` (chunked prefill, a fork, a speculative step
rolled back with ``popn``), every logit row checked against the float64 numpy model. With prefix
caching, a second turn of every request resends its conversation: it starts on the cached pages."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

import numpy as np
import tvm
from tvm.runtime.vm import VirtualMachine

from .generate import Engine, Stats
from .models import LlamaConfig, LlamaNumpy, random_weights

#: unit roundoff (half the spacing of numbers near 1) of the 16-bit dtypes: 2^-11, 2^-8
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
#: relative max logit error allowed: 40 x the unit roundoff (measured: float16 ~1e-2, bfloat16
#: ~8e-2); float32 1e-3 (it measures ~1e-6)
TOLERANCE = {"float32": 1e-3, **{dtype: 40 * u for dtype, u in UNIT_ROUNDOFF.items()}}
#: relative max logit error allowed over 8-bit pages (scales calibrated): 0.1 for e4m3, 0.15 for
#: e5m2, about 2.5x the worst measured on the float32 model (0.038 and 0.053 on the demo workload;
#: 0.027 and 0.045 in ``benchmarks/fp8_accuracy.py --model``); pages of the model dtype: ~1e-6
FP8_TOLERANCE = {"float8_e4m3fn": 0.1, "float8_e5m2": 0.15}
PAGE_SIZE = 16
PROMPTS = (37, 90, 12, 61)
NEW_TOKENS = (8, 12, 16, 6)
PREFILL_CHUNK = 64


@dataclasses.dataclass(kw_only=True)
class ModelDemoResult(Stats):
    """The engine's :class:`~relax_kvcache.generate.Stats` and what the demo adds."""

    target: str
    dtype: str
    kv_dtype: Optional[str]
    requests: int
    shared_prefix_pages: int
    pages_returned: bool
    tolerance: float
    prefix_hit_rate: Optional[float] = None  # prefix caching: prompt tokens found cached / looked up

    @property
    def tokens_per_second(self) -> float:
        return (self.prefill_tokens + self.decode_tokens) / max(self.model_seconds, 1e-9)

    @property
    def ok(self) -> bool:
        return self.max_rel_error <= self.tolerance and self.pages_returned and self.checked_rows > 0


def default_dtype(kind: str) -> str:
    """The demo's dtype on a target kind: float32 on the CPU, float16 on GPUs."""
    return "float32" if kind == "llvm" else "float16"


def compile_model(cfg: LlamaConfig, target: tvm.target.Target, *, prefix_caching: bool = False,
                  kv_dtype: Optional[str] = None):
    """The model compiled with the cache's kernels for ``target`` (needs TVM's compiler);
    ``prefix_caching``: its ``create_kv_cache`` makes a cache with prefix caching; ``kv_dtype``:
    one over 8-bit float pages (``float8_e4m3fn`` or ``float8_e5m2``)."""
    from . import frontend
    from .models.llama import build_module

    if not prefix_caching:
        return frontend.compile(build_module(cfg, target, PAGE_SIZE, kv_dtype), target)
    model = prefix_caching_llama(cfg, target, PAGE_SIZE, kv_dtype=kv_dtype)
    return frontend.compile(model.export_tvm(spec=model.export_spec(), debug=False)[0], target)


def prefix_caching_llama(cfg: LlamaConfig, target: tvm.target.Target, page_size: int, base=None,
                         kv_dtype: Optional[str] = None):
    """The demo's Llama (or ``base``, a subclass of it) whose cache has prefix caching; its
    ``create_kv_cache_with_host`` takes a 4th capacity, ``host_cache_pages``."""
    from .frontend import PagedKVCache
    from .models.llama import Llama, cache_layout

    class PrefixCachingLlama(base or Llama):
        def create_kv_cache(self, max_batch_size, max_total_seq_len, prefill_chunk_size):
            return self.create_kv_cache_with_host(max_batch_size, max_total_seq_len, prefill_chunk_size, 0)

        def create_kv_cache_with_host(self, max_batch_size, max_total_seq_len, prefill_chunk_size, host_cache_pages):
            layout = dataclasses.replace(cache_layout(self.cfg, self.page_size, self.kv_dtype), prefix_caching=True)
            return PagedKVCache.create(layout, self.target, max_batch_size=max_batch_size,
                                       max_total_seq_len=max_total_seq_len, prefill_chunk_size=prefill_chunk_size,
                                       host_cache_pages=host_cache_pages)

        def export_spec(self) -> dict:
            spec = super().export_spec()
            params = {k: v for k, v in spec["create_kv_cache"].items() if k != "$"}
            spec["create_kv_cache_with_host"] = {**params, "host_cache_pages": int, "$": spec["create_kv_cache"]["$"]}
            return spec

    return PrefixCachingLlama(cfg, target, page_size, kv_dtype)


def run_model_demo(*, target: str = "llvm", dtype: Optional[str] = None, seed: int = 0,
                   executable=None, log: Callable[[str], None] = print,
                   prefix_caching: bool = False, kv_dtype: Optional[str] = None) -> ModelDemoResult:
    """Serve the demo workload; ``executable``: the model compiled for ``target`` already (e.g.
    loaded with :func:`relax_kvcache.deploy.load`), else it is compiled here (with
    ``prefix_caching``, its cache has prefix caching and each request gets a second turn).
    ``kv_dtype``: the cache stores 8-bit pages (the executable's must), scales calibrated from the
    first step; logits are then held to :data:`FP8_TOLERANCE`."""
    kind = str(target) if isinstance(target, str) else target.kind.name
    dtype = dtype or default_dtype(kind)
    cfg = LlamaConfig(dtype=dtype)
    device = tvm.cpu() if kind == "llvm" else tvm.device(kind, 0)
    if executable is None:
        log(f"compiling a {cfg.num_layers}-layer Llama ({cfg.num_heads}/{cfg.num_kv_heads} heads, "
            f"head_dim {cfg.head_dim}, {dtype}) with the cache's kernels for {kind} ...")
        start = time.perf_counter()
        executable = compile_model(cfg, tvm.target.Target(kind), prefix_caching=prefix_caching, kv_dtype=kv_dtype)
        log(f"  compiled in {time.perf_counter() - start:.1f} s")
    vm = VirtualMachine(executable, device)
    weights = random_weights(cfg, seed)
    reference = LlamaNumpy(cfg, weights)
    shape = tvm.runtime.ShapeTuple
    max_total = sum(PROMPTS) + sum(NEW_TOKENS) * 2 + 8 * PAGE_SIZE
    cache = vm["create_kv_cache"](shape([8]), shape([max_total]), shape([PREFILL_CHUNK]))
    pages = getattr(getattr(cache, "config", None), "kv_dtype", None)
    if pages != kv_dtype:
        raise ValueError(f"the model's cache stores {pages or dtype} pages; expected {kv_dtype or dtype} (compile "
                         "it with the same kv_dtype)")
    if kv_dtype is not None:
        cache.calibrate_kv_scales()
        log(f"  cache over {kv_dtype} pages, K / V scales calibrated from the first step")
    engine = Engine(vm, [tvm.runtime.tensor(w.astype(dtype), device) for w in weights.values()],
                    cache, device, prefill_chunk_size=PREFILL_CHUNK, reference=reference.logits,
                    vocab_size=cfg.vocab_size, prefix_caching=prefix_caching)
    pages_at_start = engine.free_pages()
    rng = np.random.default_rng(seed)
    requests = [engine.add_request(rng.integers(0, cfg.vocab_size, n).tolist(), new)
                for n, new in zip(PROMPTS, NEW_TOKENS)]
    log(f"serving {len(requests)} requests (prompts {list(PROMPTS)} tokens, prefill chunks of "
        f"{PREFILL_CHUNK})")
    forked = speculated = False
    shared_pages = 0
    while engine.requests:
        finished = engine.step()
        first = requests[0]
        if not forked and first.seq_id in engine.requests and first.generated == 1:
            runner_up = int(np.argsort(first.last_logits)[-2])
            child = engine.fork(first, runner_up)
            shared_pages = first.cached // PAGE_SIZE
            forked = True
            log(f"  step {engine.stats.steps}: forked request {first.seq_id} -> {child.seq_id} "
                f"({first.cached}-token prefix, {shared_pages} full pages shared)")
        second = requests[1]
        if not speculated and second.seq_id in engine.requests and second.generated >= 3:
            draft = int(reference.logits(second.tokens)[-1].argmax())  # right; then two wrong guesses
            wrong = [(draft + 1 + i) % cfg.vocab_size for i in range(2)]
            accepted = engine.speculate(second, [draft] + wrong)
            speculated = True
            log(f"  step {engine.stats.steps}: speculative step on request {second.seq_id}: "
                f"{accepted}/3 drafts accepted, {3 - accepted} rolled back with popn")
        for req in finished:
            log(f"  step {engine.stats.steps}: request {req.seq_id} finished ({req.generated} "
                f"tokens), pages freed; {len(engine.requests)} still running, "
                f"{engine.free_pages()} pages free")
    hit_rate = _second_turns(engine, requests, rng, log) if prefix_caching else None
    log(f"  all requests done; {engine.free_pages()}/{pages_at_start} pages free")
    return ModelDemoResult(**dataclasses.asdict(engine.stats), target=kind, dtype=dtype, kv_dtype=kv_dtype,
                           requests=len(requests) * (1 + prefix_caching) + int(forked),
                           shared_prefix_pages=shared_pages,
                           pages_returned=engine.free_pages() == pages_at_start,
                           tolerance=FP8_TOLERANCE[kv_dtype] if kv_dtype else TOLERANCE[dtype],
                           prefix_hit_rate=hit_rate)


def _second_turns(engine: Engine, requests, rng: np.random.Generator, log: Callable[[str], None]) -> float:
    """Each request's conversation resent with a new message (prefix caching: it starts on the
    cached pages of what the first turn fed); the hit rate over every request's prompt."""
    computed = engine.stats.prefill_tokens
    turns = [engine.add_request(r.tokens + rng.integers(0, engine.vocab_size, 8).tolist(), 4) for r in requests]
    log(f"second turns of {len(turns)} requests: {sum(t.cached for t in turns)} of their "
        f"{sum(t.prompt_len for t in turns)} prompt tokens found in cached pages")
    while engine.requests:
        engine.step()
    stats = engine.prefix_cache_stats()
    log(f"  computed {engine.stats.prefill_tokens - computed} prefill tokens; prefix cache: "
        f"{stats['hit_tokens']}/{stats['lookup_tokens']} tokens hit, {stats['cached_pages']} pages cached")
    return float(stats["hit_rate"])
