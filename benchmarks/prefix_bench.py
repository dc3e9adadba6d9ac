"""Prefix caching through ``generate.Engine``: two serving workloads with and without caching.

* **shared system prompt**: requests sharing one system prompt, each with its own user part
  (sizes drawn around ``user``) and a few generated tokens (GPU: 64 requests, a 1,000-token
  system prompt, ~50-token user parts, 4 tokens);
* **multi-turn chat**: conversations whose every turn resends the conversation so far plus a new
  user message (GPU: 8 conversations of 8 turns, 100 user tokens and 32 generated per turn);
* **chat beyond device memory**: the chat with three times as many conversations as a cache
  sized for ``max_live`` of them holds, so that the others evict a conversation's pages between
  its turns: prefix caching without, then with a host tier (``host_cache_pages``) holding every
  conversation's pages, and a device cache holding them all (the reference: the host tier's
  outputs must equal its own, bit for bit).

Requests are admitted one per engine step, at most ``max_live`` running (a server's admission
control); a chat's next turn is queued when its previous one finishes. "Without caching" is the
same model and cache size driven by ``Engine(prefix_caching=False)`` (no token ids: nothing is
registered or looked up). Reported per workload and mode: prefill tokens computed, tokens found
cached, TTFT (from admission to the first token; mean and p50), output tokens/s and requests/s
over the wall time, the fraction of the shared prefix's tokens (chat: of the resent conversation)
computed after the first request, and whether every request generated the same tokens (greedy)
in both modes. The model: the demo's float32 Llama on the CPU, Llama-3.2-1B's shape (random
float16 weights, e2e_bench's ``1b``) on a GPU.

Usage::

    python benchmarks/prefix_bench.py                     # CPU: the demo's Llama on llvm (~1 min)
    python benchmarks/prefix_bench.py --smoke             # tiny sizes (the test)
    python benchmarks/prefix_bench.py --prepare .gpu/prefix --arch sm_90a [--bundle]   # here
    python benchmarks/prefix_bench.py --libs .gpu/prefix [--json FILE]                 # GPU host

On the GPU host (runtime-only TVM, as ``gpu_host.sh`` sets it up), from the repository root:
``. .gpu/prefix/bundle/setup_gpu_host.sh && python3 benchmarks/prefix_bench.py --libs .gpu/prefix``.
Exit status 1 unless the shared system prompt meets the target fraction with identical outputs,
the host tier finds more cached tokens than the device alone and exactly what a device cache
holding everything finds, with identical outputs (and, on the CPU's float32 model, the chats'
outputs are identical to the uncached run's too).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "benchmarks"))

import tvm  # noqa: E402
from tvm.runtime.vm import VirtualMachine  # noqa: E402

import relax_kvcache  # noqa: E402,F401  (before any VirtualMachine: routes vm.builtin.* to our cache)
from relax_kvcache.generate import Engine  # noqa: E402
from relax_kvcache.models import LlamaConfig  # noqa: E402

PAGE = 16
SEED = 0
MANIFEST = "prefix_manifest.json"
GPU_MODEL = "1b"
#: the fraction of the shared prefix computed after the first request that caching should reach
TARGET_FRACTION = 0.10


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Workload sizes (tokens unless named otherwise)."""

    requests: int  # shared system prompt: requests
    system: int  # the shared system prompt
    user: int  # each request's own part: drawn from [user / 2, 3 * user / 2]
    new_tokens: int  # generated per request
    conversations: int  # chat
    turns: int
    turn_user: int  # user tokens per turn
    turn_new: int  # generated per turn
    max_live: int  # requests running at once
    chunk: int  # prefill chunk (tokens a step feeds)


GPU_SIZES = Sizes(requests=64, system=1000, user=50, new_tokens=4, conversations=8, turns=8, turn_user=100,
                  turn_new=32, max_live=16, chunk=2048)
CPU_SIZES = Sizes(requests=32, system=500, user=30, new_tokens=4, conversations=4, turns=5, turn_user=40,
                  turn_new=8, max_live=8, chunk=512)
SMOKE_SIZES = Sizes(requests=5, system=50, user=6, new_tokens=2, conversations=2, turns=3, turn_user=6,
                    turn_new=3, max_live=3, chunk=64)


# ----------------------------------------------------------------------------- workloads

@dataclasses.dataclass
class Item:
    """A request to serve: its key, prompt, budget, and (chat) what it resends."""

    key: Tuple[int, int]
    prompt: List[int]
    new_tokens: int
    shared: int  # tokens of the prompt a cache could hold from before (system prompt / conversation)


def shared_prompt_items(sizes: Sizes, vocab: int, rng: np.random.Generator) -> List[Item]:
    system = rng.integers(0, vocab, sizes.system).tolist()
    lo, hi = max(sizes.user // 2, 1), max(3 * sizes.user // 2, 1)
    return [Item((i, 0), system + rng.integers(0, vocab, int(rng.integers(lo, hi + 1))).tolist(),
                 sizes.new_tokens, sizes.system) for i in range(sizes.requests)]


class Chat:
    """Conversations: the first turns, then each finished turn's follow-up."""

    def __init__(self, sizes: Sizes, vocab: int, rng: np.random.Generator) -> None:
        self.sizes, self.vocab, self.rng = sizes, vocab, rng
        self.messages = [[rng.integers(0, vocab, sizes.turn_user).tolist() for _ in range(sizes.turns)]
                         for _ in range(sizes.conversations)]

    def first(self) -> List[Item]:
        return [Item((c, 0), list(m[0]), self.sizes.turn_new, 0) for c, m in enumerate(self.messages)]

    def follow_up(self, item: Item, tokens: List[int]) -> Optional[Item]:
        conv, turn = item.key
        if turn + 1 == self.sizes.turns:
            return None
        return Item((conv, turn + 1), tokens + self.messages[conv][turn + 1], self.sizes.turn_new, len(tokens))


@dataclasses.dataclass
class Served:
    """What serving one workload in one mode measured."""

    outputs: Dict[Tuple[int, int], List[int]]
    ttft: List[float]
    seconds: float
    prefill_computed: int
    hit_tokens: int
    shared_computed: int  # shared tokens computed by the requests after the first
    shared_total: int

    def summary(self) -> dict:
        generated = sum(map(len, self.outputs.values()))
        return {"requests": len(self.outputs), "prefill_tokens_computed": self.prefill_computed,
                "hit_tokens": self.hit_tokens, "ttft_mean_ms": 1e3 * statistics.mean(self.ttft),
                "ttft_p50_ms": 1e3 * statistics.median(self.ttft), "seconds": self.seconds,
                "output_tokens_per_s": generated / self.seconds, "requests_per_s": len(self.outputs) / self.seconds,
                "shared_fraction_computed": self.shared_computed / max(self.shared_total, 1)}


def serve(engine: Engine, items: List[Item], follow_up: Callable[[Item, List[int]], Optional[Item]],
          max_live: int, sync: Callable[[], None]) -> Served:
    """Serve ``items`` (and their follow-ups): one admitted per step, at most ``max_live`` running."""
    pending = collections.deque(items)
    live: Dict[int, Tuple[Item, object, float]] = {}
    outputs, ttft, first_seen = {}, [], set()
    shared_computed = shared_total = 0
    prefill_before, hits_before = engine.stats.prefill_tokens, engine.stats.prefix_hit_tokens
    sync()
    start = time.perf_counter()
    while pending or live:
        if pending and len(live) < max_live:
            item = pending.popleft()
            req = engine.add_request(item.prompt, item.new_tokens)
            live[req.seq_id] = (item, req, time.perf_counter())
            if item.key != (0, 0) and item.shared:  # every request but the very first
                shared_computed += item.shared - min(req.cached, item.shared)
                shared_total += item.shared
        finished = engine.step()
        now = time.perf_counter()
        for seq_id, (item, req, admitted) in live.items():
            if seq_id not in first_seen and req.generated >= 1:
                first_seen.add(seq_id)
                ttft.append(now - admitted)
        for req in finished:
            item, _, _ = live.pop(req.seq_id)
            outputs[item.key] = req.tokens[req.prompt_len:]
            nxt = follow_up(item, req.tokens)
            if nxt is not None:
                pending.append(nxt)
    sync()
    return Served(outputs, ttft, time.perf_counter() - start, engine.stats.prefill_tokens - prefill_before,
                  engine.stats.prefix_hit_tokens - hits_before, shared_computed, shared_total)


# ----------------------------------------------------------------------------- running

@dataclasses.dataclass
class Model:
    executable: object
    cfg: LlamaConfig
    device: object  # e2e_bench.Device


def capacity(sizes: Sizes) -> Tuple[int, int]:
    """(max_num_seqs, max_total_seq_len) of the caches: room for every request running at once
    without sharing (the uncached run), rounded to pages, plus a page per request."""
    one = sizes.system + 3 * sizes.user // 2 + sizes.new_tokens
    conv = sizes.turns * (sizes.turn_user + sizes.turn_new)
    per = max(one, conv)
    return sizes.max_live, -(-(sizes.max_live * per) // PAGE) * PAGE + sizes.max_live * PAGE


def make_engine(model: Model, weights, sizes: Sizes, prefix_caching: bool, host_pages: int = 0,
                total: Optional[int] = None) -> Engine:
    vm = VirtualMachine(model.executable, model.device.dev)
    seqs, room = capacity(sizes)
    total = room if total is None else total
    shape = tvm.runtime.ShapeTuple
    cache = vm["create_kv_cache_with_host"](shape([seqs]), shape([total]), shape([sizes.chunk]), shape([host_pages]))
    functions = {"prefill_rows": vm["prefill_rows"], "decode": vm["decode"]}  # the sampled rows' logits
    return Engine(functions, weights, cache, model.device.dev, prefill_chunk_size=sizes.chunk,
                  vocab_size=model.cfg.vocab_size, prefill_rows=True, prefix_caching=prefix_caching)


def run(model: Model, sizes: Sizes, log: Callable[[str], None] = print) -> dict:
    """Both workloads, without then with caching, on fresh caches; the result dictionary."""
    weights = model.device.weights(model.cfg, SEED)
    vocab = model.cfg.vocab_size
    warm = make_engine(model, weights, sizes, True)  # first calls: allocations, CUDA graph captures
    serve(warm, shared_prompt_items(dataclasses.replace(sizes, requests=2), vocab, np.random.default_rng(1)),
          lambda *_: None, sizes.max_live, model.device.sync)
    warm.close()
    result = {"device": model.device.describe(), "sizes": dataclasses.asdict(sizes), "workloads": {}}
    workloads = {
        "shared_system_prompt": lambda rng: (shared_prompt_items(sizes, vocab, rng), lambda *_: None),
        "multi_turn_chat": lambda rng: (lambda chat: (chat.first(), chat.follow_up))(Chat(sizes, vocab, rng)),
    }
    for name, make in workloads.items():
        modes = {}
        for caching in (False, True):
            items, follow = make(np.random.default_rng(SEED))
            engine = make_engine(model, weights, sizes, caching)
            try:
                modes[caching] = serve(engine, items, follow, sizes.max_live, model.device.sync)
            finally:
                engine.close()
        off, on = modes[False], modes[True]
        entry = {"without": off.summary(), "with": on.summary(), "identical": off.outputs == on.outputs,
                 **agreement(off.outputs, on.outputs)}
        result["workloads"][name] = entry
        log(report_rows(name, entry))
    result["host_tier"] = host_tier(model, weights, sizes)
    log(report_rows("chat_beyond_device_memory", result["host_tier"], ("device", "host tier", "all on device")))
    return result


def host_tier(model: Model, weights, sizes: Sizes) -> dict:
    """The chat with ``3 * max_live`` conversations on a cache that holds ``max_live`` of them:
    between two turns of a conversation the others evict its pages. Prefix caching without,
    then with a host tier that holds every conversation's pages; and, as the reference, a device
    cache that holds them all. With the host tier every turn should find what it finds in that
    cache, and so run the same steps: its outputs must be identical, bit for bit, in any dtype."""
    many = dataclasses.replace(sizes, conversations=3 * sizes.max_live)
    conversation = -(-many.turns * (many.turn_user + many.turn_new) // PAGE)  # pages
    pages, total = many.conversations * conversation, sizes.max_live * (conversation + 1) * PAGE
    runs = {}
    for mode, host_pages, tokens in (("device", 0, total), ("host tier", pages, total),
                                      ("all on device", 0, total + pages * PAGE)):
        chat = Chat(many, model.cfg.vocab_size, np.random.default_rng(SEED))
        engine = make_engine(model, weights, sizes, True, host_pages, tokens)
        try:
            runs[mode] = serve(engine, chat.first(), chat.follow_up, sizes.max_live, model.device.sync)
            if host_pages:
                stats = dict(engine.prefix_cache_stats())
        finally:
            engine.close()
    off, on, roomy = runs["device"], runs["host tier"], runs["all on device"]
    return {"without": off.summary(), "with": on.summary(), "all_on_device": roomy.summary(),
            "identical": on.outputs == roomy.outputs and on.hit_tokens == roomy.hit_tokens,
            "host_pages": pages, "device_tokens": total, "conversations": many.conversations, "host_stats": stats,
            **agreement(roomy.outputs, on.outputs)}


def agreement(off: Dict[Tuple[int, int], List[int]], on: Dict[Tuple[int, int], List[int]]) -> dict:
    """How far two runs' greedy outputs agree: requests whose tokens are all the same, and
    generated tokens equal at their position."""
    same = sum(off[key] == on.get(key) for key in off)
    tokens = sum(len(v) for v in off.values())
    equal = sum(a == b for key in off for a, b in zip(off[key], on.get(key, [])))
    return {"same_requests": same, "same_token_fraction": equal / tokens if tokens else 1.0}


def report_rows(name: str, entry: dict, labels: Tuple[str, ...] = ("without", "with")) -> str:
    """The rows of a workload; its outputs are compared between the last two modes."""
    lines = [f"{name}: outputs identical {labels[-2]} / {labels[-1]}: {entry['identical']} ({entry['same_requests']} "
             f"of {entry['without']['requests']} requests, {entry['same_token_fraction']:.1%} of generated tokens)",
             f"  {'':13s} {'prefill computed':>16s} {'hit':>7s} {'TTFT mean':>10s} {'TTFT p50':>9s} "
             f"{'out tok/s':>10s} {'req/s':>7s} {'shared computed':>16s}"]
    for mode, label in zip(("without", "with", "all_on_device"), labels):
        s = entry[mode]
        lines.append(f"  {label:13s} {s['prefill_tokens_computed']:16d} {s['hit_tokens']:7d} "
                     f"{s['ttft_mean_ms']:8.1f}ms {s['ttft_p50_ms']:7.1f}ms {s['output_tokens_per_s']:10.1f} "
                     f"{s['requests_per_s']:7.2f} {s['shared_fraction_computed']:15.1%}")
    return "\n".join(lines)


def ok(result: dict, exact: bool) -> bool:
    """The shared system prompt computed at most :data:`TARGET_FRACTION` after the first request
    with caching, with outputs identical to the uncached run's; the host tier finding more than
    the device alone and what a cache holding everything finds, with identical outputs; with
    ``exact`` (a float32 model) the chats' outputs identical to the uncached run's too. (In float16 a chat turn's resent conversation is attended
    over cached pages instead of within one prefill, a different summation order: greedy tokens
    of random weights can flip at near ties, and a flip changes every later turn's prompt.)"""
    workloads, host = result["workloads"], result["host_tier"]
    shared = workloads["shared_system_prompt"]
    return (shared["identical"] and shared["with"]["shared_fraction_computed"] <= TARGET_FRACTION
            and host["identical"] and host["with"]["hit_tokens"] > host["without"]["hit_tokens"]
            and (not exact or all(w["identical"] for w in workloads.values())))


# ----------------------------------------------------------------------------- models

def cpu_model() -> Model:
    from e2e_bench import Device
    from relax_kvcache import model_demo

    cfg = LlamaConfig()
    return Model(model_demo.compile_model(cfg, tvm.target.Target("llvm"), prefix_caching=True), cfg,
                 Device(cuda=False))


def gpu_config() -> LlamaConfig:
    from e2e_bench import MODELS

    return MODELS[GPU_MODEL]


def prepare(out: pathlib.Path, arch: str, bundle: bool) -> int:
    """Compile the GPU model (a prefix-caching cache; ``prefill_rows`` as the engine calls it)
    for CUDA ``arch`` into ``out``: library, checksum, nvcc fatbins in ``out/cache``, manifest."""
    import e2e_models
    import gpu_prepare
    from relax_kvcache import deploy, frontend
    from relax_kvcache.model_demo import prefix_caching_llama
    from relax_kvcache.targets import make_target

    cfg, target = gpu_config(), make_target("cuda", arch=arch)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    model = prefix_caching_llama(cfg, target, PAGE, base=e2e_models.OursLlama)
    mod = model.export_tvm(spec=model.export_spec(), debug=False)[0]
    executable = frontend.compile(mod, target, upper_bounds=e2e_models.UPPER_BOUNDS)
    lib = out / f"prefix-{GPU_MODEL}.so"
    executable.export_library(str(lib))
    deploy.write_checksum(lib)
    for source in e2e_models.cuda_sources(executable.mod):
        gpu_prepare.precompile(source, arch, out)
    (out / MANIFEST).write_text(json.dumps({"arch": arch, "tvm_version": tvm.__version__, "model": GPU_MODEL,
                                            "config": dataclasses.asdict(cfg), "lib": lib.name}, indent=1) + "\n")
    print(f"{lib}: {time.perf_counter() - start:.0f} s, {lib.stat().st_size / 2**20:.1f} MiB", flush=True)
    if bundle:
        subprocess.run(["bash", str(REPO / "tools" / "make_bundle.sh"), str(out / "bundle")], check=True,
                       stdout=subprocess.DEVNULL)
    return 0


def gpu_model(libs: pathlib.Path) -> Model:
    from e2e_bench import Device

    os.environ.setdefault("RELAX_KVCACHE_CACHE_DIR", str((libs / "cache").resolve()))  # nvcc's fatbins
    from relax_kvcache import deploy

    manifest = json.loads((libs / MANIFEST).read_text())
    cfg = gpu_config()
    if manifest["config"] != dataclasses.asdict(cfg):
        raise SystemExit(f"{libs}: the library was built for another configuration; run --prepare again")
    device = Device(cuda=True)
    return Model(deploy.load(str(libs / manifest["lib"]), device=device.dev), cfg, device)


def soak(model: Model, minutes: float, json_path: Optional[pathlib.Path], smoke: bool = False) -> int:
    """``--soak``: ``e2e_soak.soak`` on an engine with prefix caching, a cache sized to run near
    full and a host tier as large, 70% of prompts starting with (part of) one of four system
    prompts; exit status 1 unless every page is back, memory did not grow and cached prefixes
    were found."""
    import e2e_soak

    load = dataclasses.replace(e2e_soak.SMOKE_LOAD if smoke or not model.device.cuda else e2e_soak.GPU_LOAD,
                               shared=0.7)
    weights = model.device.weights(model.cfg, SEED)
    vm = VirtualMachine(model.executable, model.device.dev)
    mean = (sum(load.prompt) + sum(load.output)) / 2
    total = -(-max(int(0.9 * load.max_live * mean), load.prompt[1] + load.output[1] + 8 * PAGE) // PAGE) * PAGE
    chunk = min(2048, total)
    host_pages = total // PAGE  # a host tier as large as the device cache: evicted pages come back
    cache = vm["create_kv_cache_with_host"](*(tvm.runtime.ShapeTuple([x]) for x in (2 * load.max_live, total, chunk,
                                                                                    host_pages)))
    engine = Engine({"prefill_rows": vm["prefill_rows"], "decode": vm["decode"]}, weights, cache, model.device.dev,
                    prefill_chunk_size=chunk, vocab_size=model.cfg.vocab_size, prefill_rows=True,
                    prefix_caching=True, cuda_graphs=model.device.cuda)
    print(f"prefix-caching soak on {model.device.describe()}: {minutes} min, up to {load.max_live} requests, "
          f"prompts {load.prompt[0]}-{load.prompt[1]} ({load.shared:.0%} on shared system prompts), a cache of "
          f"{total} tokens and a host tier of {host_pages} pages", flush=True)
    try:
        result = e2e_soak.soak(engine, minutes * 60, load, model.device.used_bytes)
        stats = dict(engine.prefix_cache_stats())
    finally:
        engine.close()
    result["prefix_cache"] = stats
    result["ok"] = result["ok"] and stats["hit_tokens"] > 0
    print(f"prefix cache: {stats['lookups']} lookups, {stats['hit_tokens']} of {stats['lookup_tokens']} prompt tokens "
          f"found ({stats['hit_rate']:.1%}), {stats['evicted_pages']} pages evicted, {stats['cached_pages']} cached "
          f"at the end; host tier: {stats['spilled_pages']} pages spilled, {stats['loaded_pages']} loaded back, "
          f"{stats['host_pages']} held -> {'PASS' if result['ok'] else 'FAIL'}", flush=True)
    if json_path:
        json_path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0 if result["ok"] else 1


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (the test)")
    parser.add_argument("--prepare", type=pathlib.Path, help="compile the GPU library into this folder (here)")
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--bundle", action="store_true", help="--prepare: also pack TVM's runtime-only bundle")
    parser.add_argument("--libs", type=pathlib.Path, help="folder built by --prepare: run on its CUDA device")
    parser.add_argument("--json", type=pathlib.Path, help="write the results to this file")
    parser.add_argument("--soak", type=float, metavar="MINUTES",
                        help="instead: e2e_soak's random traffic (forks, rollbacks, cancellations, a cache near "
                             "full) with prefix caching on and most prompts sharing system prompts")
    args = parser.parse_args(argv)
    if args.prepare:
        return prepare(args.prepare, args.arch, args.bundle)
    if args.soak is not None:
        return soak(gpu_model(args.libs) if args.libs else cpu_model(), args.soak, args.json, smoke=args.smoke)
    if args.libs:
        model, sizes = gpu_model(args.libs), GPU_SIZES
    else:
        model, sizes = cpu_model(), SMOKE_SIZES if args.smoke else CPU_SIZES
    print(f"prefix caching benchmark on {model.device.describe()}, TVM {tvm.__version__}: {sizes}", flush=True)
    result = run(model, sizes)
    result["ok"] = ok(result, exact=not args.libs)
    identical = all(w["identical"] for w in result["workloads"].values())
    print(f"{'PASS' if result['ok'] else 'FAIL'}: outputs identical: {identical}; shared system prompt computed after "
          f"the first request: {result['workloads']['shared_system_prompt']['with']['shared_fraction_computed']:.1%} "
          f"(target <= {TARGET_FRACTION:.0%})", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
