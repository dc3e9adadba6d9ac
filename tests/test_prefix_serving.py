"""Prefix caching from the serving side: the creation function's 9th and 10th ``cache_config`` entries,
``frontend.CacheLayout(prefix_caching=True)``, the ``relax_kvcache.*_with_tokens`` /
``prefix_cache_stats`` globals and ``generate.Engine(prefix_caching=True)``.

The engine runs the demo's Llama compiled with a prefix-caching cache: every logit row is
checked against the float64 numpy model, and the tokens against the same workload run without
prefix caching; the prefill tokens computed drop by exactly the tokens found cached.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm.runtime import ShapeTuple
from tvm.runtime.vm import VirtualMachine

import relax_kvcache as rk
from relax_kvcache import model_demo
from relax_kvcache.generate import Engine
from relax_kvcache.models import LlamaConfig, LlamaNumpy, random_weights
from support.small_cache import assert_refused, create_with, one_sequence_cache, tiny_cache

GLOBALS = ("add_sequence_with_tokens", "begin_forward_with_tokens", "prefix_cache_stats")


def _globals():
    return [tvm.get_global_func(f"relax_kvcache.{name}") for name in GLOBALS]


# ---------------------------------------------------------------------------- creation entry


def test_creation_takes_a_prefix_caching_entry():
    """``cache_config[8]``: 1 turns prefix caching on, 0 off; TVM's 5-7 entry forms and ours
    of 8 leave it off; another value is refused naming it. ``cache_config[9]``: the host tier's
    pages (prefix caching only); an 11th entry is refused."""
    kernels = one_sequence_cache()._kernels
    for entries, on in (([8, 200, 64, 8, 0], False), ([8, 200, 64, 8, 0, 1024], False),
                        ([8, 200, 64, 8, 0, 1024, 0], False), ([8, 200, 64, 8, 0, 1024, 0, 0], False),
                        ([8, 200, 64, 8, 0, 1024, 0, 0, 0], False), ([8, 200, 64, 8, 0, 1024, 0, 0, 1], True)):
        cache = create_with(kernels, a0=ShapeTuple(entries))
        assert cache.config.prefix_caching is on, entries
        assert (cache.config.max_num_seqs, cache.config.page_size, cache.config.kv_dtype) == (8, 8, None)
    with pytest.raises(rk.ConfigError, match=r"cache_config\[8\] \(prefix_caching\) must be 0 or 1, got 2"):
        create_with(kernels, a0=ShapeTuple([8, 200, 64, 8, 0, 1024, 0, 0, 2]))
    cache = create_with(kernels, a0=ShapeTuple([8, 200, 64, 8, 0, 1024, 0, 0, 1, 6]))  # the host tier's pages
    assert cache.config.prefix_caching and cache.config.host_cache_pages == 6
    with pytest.raises(rk.ConfigError, match=r"cache_config\[9\] \(host_cache_pages\) must be .*got 6"):
        create_with(kernels, a0=ShapeTuple([8, 200, 64, 8, 0, 1024, 0, 0, 0, 6]))
    with pytest.raises(rk.ConfigError, match=r"cache_config must hold .*host_cache_pages\]\]\]\]\]\), got \[8, .*, 1, 0, 0\]"):
        create_with(kernels, a0=ShapeTuple([8, 200, 64, 8, 0, 1024, 0, 0, 1, 0, 0]))


# ---------------------------------------------------------------------------- globals


def _prefilled(cache, seq_id, tokens, rng):
    """Add ``seq_id`` with ``tokens`` through the globals and append the tokens it does not hold
    (random q / k / v); the hit."""
    add, begin, _ = _globals()
    hit = add(cache, seq_id, ShapeTuple(tokens))
    n = len(tokens) - hit
    begin(cache, ShapeTuple([seq_id]), ShapeTuple([n]), ShapeTuple(tokens[hit:]))
    cfg = cache.config
    for layer in range(cfg.num_layers):
        qkv = rng.standard_normal((n, cfg.num_qo_heads + 2 * cfg.num_kv_heads, cfg.head_dim)).astype("float32")
        cache.attention_with_fused_qkv(layer, tvm.runtime.tensor(qkv),
                                       tvm.runtime.empty((n, cfg.num_qo_heads, cfg.head_dim), "float32"), 0.2)
    cache.end_forward()
    return hit


def _kv(cache, seq_id, length):
    cfg = cache.config
    k, v = (tvm.runtime.tensor(np.full((cfg.num_layers, length, cfg.num_kv_heads, cfg.head_dim), np.nan,
                                       "float32")) for _ in range(2))
    cache.debug_get_kv(seq_id, 0, length, k, v)
    return k.numpy(), v.numpy()


@pytest.mark.parametrize("form", ["shape", "list", "int32", "int64"])
def test_globals_register_and_reuse_pages(form):
    """A sequence appended with its token ids through ``begin_forward_with_tokens`` leaves its
    full pages cached: a later one with the same leading ids (given as ``form``) starts on them
    (``add_sequence_with_tokens`` returns the hit) and reads the first one's K/V there."""
    cache, rng = tiny_cache(prefix_caching=True), np.random.default_rng(4)
    add, _, stats = _globals()
    first = rng.integers(0, 1000, 19).tolist()
    assert _prefilled(cache, 0, first, rng) == 0
    want = _kv(cache, 0, 19)
    cache.remove_sequence(0)
    second = first[:14] + [7, 8, 9]
    given = {"shape": ShapeTuple(second), "list": second, "int32": tvm.runtime.tensor(np.array(second, "int32")),
             "int64": tvm.runtime.tensor(np.array(second, "int64"))}[form]
    assert add(cache, 1, given) == 12  # three whole 4-token pages of the 14 shared tokens
    assert cache.get_sequence_length(1) == 12
    got = _kv(cache, 1, 12)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b[:, :12])
    assert add(cache, 2, ShapeTuple(second), "another tenant") == 0  # salted: other keys
    counters = stats(cache)
    assert isinstance(counters, tvm_ffi.Map) and dict(counters) == cache.prefix_cache_stats()
    assert (counters["lookups"], counters["hit_tokens"], counters["registered_pages"]) == (3, 12, 4)


def test_globals_refuse_what_they_cannot_take():
    cache = tiny_cache(prefix_caching=True)
    add, begin, stats = _globals()
    cache.add_sequence(0)
    for bad, match in ((tvm.runtime.tensor(np.arange(3, dtype="float32")), "dtype float32"),
                       (tvm.runtime.tensor(np.zeros((1, 3), "int32")), r"shape \(1, 3\)")):
        assert_refused(cache, lambda: add(cache, 1, bad), rk.ArgumentError,
                       f"add_sequence_with_tokens: token_ids is a tensor of .*{match}.*expected a 1-D int32 or int64")
    assert_refused(cache, lambda: begin(cache, ShapeTuple([0]), ShapeTuple([3]), ShapeTuple([1, 2])),
                   rk.ArgumentError, "token_ids has 2 ids; expected 3")
    assert_refused(cache, lambda: begin(cache, ShapeTuple([0]), ShapeTuple([2]), ShapeTuple([1, -2])),
                   rk.ArgumentError, "token ids must be >= 0")
    for call in (lambda: add(None, 1, [1]), lambda: stats(tvm.runtime.ShapeTuple([1]))):
        with pytest.raises(rk.ArgumentError, match="expected a relax_kvcache.PagedAttentionKVCache"):
            call()
    with pytest.raises(rk.KVCacheError, match="needs a cache created with KVCacheConfig\\(prefix_caching=True\\)"):
        stats(tiny_cache())
    assert add(tiny_cache(), 0, [1, 2, 3, 4, 5, 6]) == 0  # without prefix caching the ids are ignored


# ---------------------------------------------------------------------------- engine

SYSTEM = 70  # shared system prompt: four whole 16-token pages and six tokens


@pytest.fixture(scope="module")
def model():
    """``(executable, cfg, weights, numpy model)``: the demo's float32 Llama for llvm, its
    ``create_kv_cache`` making a cache with prefix caching (``CacheLayout(prefix_caching=True)``)."""
    cfg = LlamaConfig()
    weights = random_weights(cfg, 0)
    executable = model_demo.compile_model(cfg, tvm.target.Target("llvm"), prefix_caching=True)
    return executable, cfg, weights, LlamaNumpy(cfg, weights)


def _engine(model, prefix_caching, max_total=512, max_seqs=8, host_pages=None):
    executable, cfg, weights, numpy_model = model
    vm = VirtualMachine(executable, tvm.cpu())
    sizes = [ShapeTuple([max_seqs]), ShapeTuple([max_total]), ShapeTuple([64])]
    if host_pages is None:
        cache = vm["create_kv_cache"](*sizes)
    else:  # the frontend's 10th cache_config entry
        cache = vm["create_kv_cache_with_host"](*sizes, ShapeTuple([host_pages]))
        assert cache.config.host_cache_pages == host_pages
    assert cache.config.prefix_caching  # the frontend's 9th cache_config entry
    return Engine(vm, [tvm.runtime.tensor(w.astype("float32")) for w in weights.values()], cache, tvm.cpu(),
                  prefill_chunk_size=64, vocab_size=cfg.vocab_size, reference=numpy_model.logits,
                  prefix_caching=prefix_caching)


def _finish(engine):
    while engine.requests:
        engine.step()


def _shared_system_prompt(engine, rng_seed=5):
    """Four requests on one system prompt, each with its own user part: the first is prefilled
    before the others arrive. Their generated tokens."""
    rng = np.random.default_rng(rng_seed)
    system = rng.integers(0, 512, SYSTEM).tolist()
    prompts = [system + rng.integers(0, 512, n).tolist() for n in (9, 17, 4, 30)]
    first = engine.add_request(prompts[0], 5)
    engine.step()  # its prompt in: the system prompt's whole pages are cached
    others = [engine.add_request(p, 5) for p in prompts[1:]]
    _finish(engine)
    return [r.tokens[r.prompt_len:] for r in [first] + others], sum(map(len, prompts))


def test_engine_with_prefix_caching_shares_a_system_prompt(model):
    """The three later requests start on the system prompt's four cached pages (64 tokens not
    computed each); every token and logit row matches the uncached run and the float64 model."""
    plain, cached = _engine(model, False), _engine(model, True)
    want, prompt_tokens = _shared_system_prompt(plain)
    got, _ = _shared_system_prompt(cached)
    assert got == want
    assert plain.stats.prefill_tokens == prompt_tokens and plain.stats.prefix_hit_tokens == 0
    assert cached.stats.prefix_hit_tokens == 3 * 64
    assert cached.stats.prefill_tokens == prompt_tokens - 3 * 64
    for engine in (plain, cached):
        assert engine.stats.checked_rows > 0 and engine.stats.max_rel_error < 1e-3
    stats = cached.prefix_cache_stats()
    assert (stats["lookups"], stats["hit_tokens"]) == (4, 3 * 64)
    assert cached.cache.get_total_sequence_length() == 0 and stats["evictable_pages"] == stats["cached_pages"] > 0


def _chat(engine, turns=4, seed=6):
    """A chat: each turn resends the conversation so far plus a new user message and runs to
    completion. Per turn: (generated tokens, the request's tokens found cached)."""
    rng = np.random.default_rng(seed)
    conversation, out = [], []
    for turn in range(turns):
        conversation += rng.integers(0, 512, 11 + 7 * turn).tolist()
        req = engine.add_request(conversation, 6)
        hit = req.cached
        _finish(engine)
        out.append((req.tokens[req.prompt_len:], hit))
        conversation = req.tokens
    return out


def test_engine_with_prefix_caching_in_a_multi_turn_chat(model):
    """Each turn starts on the whole pages of everything the previous turns fed (their prompt
    and all but their last generated token); tokens as without caching."""
    plain, engine = _engine(model, False), _engine(model, True)
    want, got = _chat(plain), _chat(engine)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    lengths = [11, 35, 66, 104]  # prompt lengths: the previous turn's tokens (+ 6) and 11 + 7 * turn new ones
    assert [hit for _, hit in got] == [0] + [(n + 5) // 16 * 16 for n in lengths[:-1]]
    assert engine.stats.prefix_hit_tokens == 16 + 32 + 64
    assert engine.stats.prefill_tokens == plain.stats.prefill_tokens - (16 + 32 + 64) == sum(lengths) - 112
    assert engine.stats.max_rel_error < 1e-3 and plain.stats.max_rel_error < 1e-3


def test_engine_with_prefix_caching_evicts_and_stays_right(model):
    """A cache of 8 pages: a second chat evicts the first one's pages; the first chat run again
    gets the uncached run's tokens."""
    plain = _engine(model, False, max_total=112)
    want = [_chat(plain, seed=seed) for seed in (6, 8, 6)]
    engine = _engine(model, True, max_total=112)
    got = [_chat(engine, seed=seed) for seed in (6, 8, 6)]
    assert [[t for t, _ in run] for run in got] == [[t for t, _ in run] for run in want]
    stats = engine.prefix_cache_stats()
    assert stats["evicted_pages"] > 0 and engine.stats.max_rel_error < 1e-3
    # the second chat's last turn (7 of the 8 pages) evicted all of the first's: its rerun finds only
    # what its own earlier turns cached (kept, a turn would find 32, 64 and 96 tokens)
    assert [hit for _, hit in got[2]] == [hit for _, hit in got[0]] == [0, 16, 32, 64]


def test_engine_with_a_host_tier_gets_an_evicted_conversation_back(model):
    """As above, then the first chat's whole conversation comes back as one request: without a
    host tier its pages were evicted (nothing found); with one they come back from the host, and
    the request's tokens are the uncached run's."""
    def run(engine):
        chats = [_chat(engine, turns=3, seed=6), _chat(engine, seed=8), _chat(engine, seed=9)]
        rng, conversation = np.random.default_rng(6), []  # chat 6's conversation, rebuilt
        for turn, (tokens, _) in enumerate(chats[0]):
            conversation += rng.integers(0, 512, 11 + 7 * turn).tolist() + tokens
        req = engine.add_request(conversation + [3, 1, 4], 6)
        hit = req.cached
        _finish(engine)
        return req.tokens[req.prompt_len:], hit, len(conversation) + 3

    want, _, _ = run(_engine(model, False, max_total=112))
    dropped = _engine(model, True, max_total=112)
    got, hit, length = run(dropped)
    assert got == want and hit == 0 and dropped.prefix_cache_stats()["evicted_pages"] > 0
    host = _engine(model, True, max_total=112, host_pages=16)
    got, hit, length = run(host)
    stats = host.prefix_cache_stats()
    assert got == want and hit == (length - 1) // 16 * 16 == 64  # every page the chat's turns fed
    assert stats["loaded_pages"] == hit // 16 and stats["spilled_pages"] >= hit // 16
    assert host.stats.max_rel_error < 1e-3


def test_engine_prefix_caching_with_fork_and_speculation(model):
    """Forks and speculative steps (drafts rolled back with popn) of requests on cached pages
    keep the float64 model's tokens."""
    engine = _engine(model, True)
    rng = np.random.default_rng(7)
    system = rng.integers(0, 512, 40).tolist()
    a = engine.add_request(system + [1, 2, 3], 6)
    _finish(engine)
    b = engine.add_request(system + [4, 5], 6)
    assert b.cached == 32
    engine.step()
    child = engine.fork(b, (b.tokens[-1] + 1) % 512)
    draft = int(model[3].logits(b.tokens)[-1].argmax())
    assert engine.speculate(b, [draft, (draft + 1) % 512]) >= 1
    _finish(engine)
    assert a.generated == b.generated == child.generated == 6
    assert engine.stats.max_rel_error < 1e-3 and engine.stats.rolled_back >= 1


def test_a_failed_step_leaves_no_cached_pages():
    """A model call that raises before writing the step's K/V: the engine ends the step and pops
    its tokens; the pages it reserved must not be cached (their K/V were never written)."""
    def failing(ids, cache, *weights):
        raise RuntimeError("the model failed")

    engine = Engine({"prefill": failing, "decode": failing}, [], tiny_cache(prefix_caching=True), tvm.cpu(),
                    prefill_chunk_size=32, vocab_size=100, prefix_caching=True)
    engine.add_request(list(range(9)), 2)
    with pytest.raises(RuntimeError, match="the model failed"):
        engine.step()
    assert engine.prefix_cache_stats()["cached_pages"] == 0
    assert engine.add_request(list(range(9)), 2).cached == 0


def test_engine_refuses_prefix_caching_on_a_cache_without_it(model):
    executable, cfg, _, _ = model
    with pytest.raises(ValueError, match="prefix_caching=True needs our cache created with prefix caching; got "
                                         "PagedAttentionKVCache without it"):
        Engine(object(), [], tiny_cache(), tvm.cpu(), prefill_chunk_size=8, vocab_size=100, prefix_caching=True)
    with pytest.raises(ValueError, match="prefix_caching is 'yes'; expected a bool"):
        Engine(object(), [], tiny_cache(), tvm.cpu(), prefill_chunk_size=8, vocab_size=100, prefix_caching="yes")
    with pytest.raises(ValueError, match="runs without prefix_caching"):
        Engine(object(), [], tiny_cache(), tvm.cpu(), prefill_chunk_size=8, vocab_size=100).prefix_cache_stats()


# ---------------------------------------------------------------------------- demo


def test_demo_second_turns_start_on_cached_pages(model, capsys):
    """``relax-kvcache demo --prefix-caching``: the second turns find their first turn's whole
    pages, every logit row matches the float64 model, and the summary gives the hit rate and the
    prefill tokens saved; with ``--cache-only`` (no token ids) it is refused in one line."""
    lines = []
    result = model_demo.run_model_demo(target="llvm", seed=3, executable=model[0], log=lines.append,
                                       prefix_caching=True)
    assert result.ok and result.requests == 2 * len(model_demo.PROMPTS) + 1
    # each second turn resends prompt + generated + 8 tokens; the first turn fed all but its last token
    fed = [p + n - 1 for p, n in zip(model_demo.PROMPTS, model_demo.NEW_TOKENS)]
    assert result.prefix_hit_tokens == sum(n // 16 * 16 for n in fed) > 0
    assert 0 < result.prefix_hit_rate < 1 and any("second turns of 4 requests" in line for line in lines)
    from relax_kvcache import cli

    assert cli.main(["demo", "--cache-only", "--prefix-caching"]) == 2
    assert "--cache-only has no model" in capsys.readouterr().err
