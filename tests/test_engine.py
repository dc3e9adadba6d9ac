"""The generation engine (``relax_kvcache.generate.Engine``): what it refuses and how it recovers.

Requests: ``vocab_size`` and ``prefill_chunk_size`` are checked; a request that can never fit the
cache, an unordered or odd prompt, or a request of another engine (or a finished one) is refused;
requests are read-only handles. Steps: a ``CacheFullError`` changes nothing and ``cancel`` frees a
request; speculation stays within the token budget; more decoding requests than a step holds take
turns; a failed model step or reference check rolls the step back. Tokens are compared with the
float64 numpy model's greedy ones.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm.runtime.vm import VirtualMachine

import relax_kvcache as rk
from relax_kvcache import model_demo
from relax_kvcache.generate import Engine
from relax_kvcache.models import LlamaConfig, LlamaNumpy, random_weights
from support.snapshot import assert_same, snapshot

SMALL = rk.KVCacheConfig(num_layers=1, num_qo_heads=4, num_kv_heads=2, head_dim=32, page_size=16,
                         max_num_seqs=4, max_total_seq_len=256, prefill_chunk_size=64, dtype="float32")


class _NoVM:
    """Stands in for the compiled model: what is refused never reaches it."""


def _engine(cache=None, **kwargs):
    cache = rk.PagedAttentionKVCache(SMALL, tvm.cpu()) if cache is None else cache
    return Engine(_NoVM(), [], cache, tvm.cpu(), **{"prefill_chunk_size": 64, "vocab_size": 100, **kwargs})


# ---------------------------------------------------------------------------- engine, no model


@pytest.mark.parametrize("vocab_size", [None, 0, -3, True, 100.0, "100", 2**31 + 1])
def test_engine_requires_a_positive_int_vocab_size(vocab_size):
    with pytest.raises(ValueError, match=f"vocab_size is {vocab_size!r}; expected an int"):
        _engine(vocab_size=vocab_size)
    with pytest.raises(TypeError, match="vocab_size"):  # no default any more
        Engine(_NoVM(), [], rk.PagedAttentionKVCache(SMALL, tvm.cpu()), tvm.cpu(), prefill_chunk_size=64)


@pytest.mark.parametrize("chunk, message", [(0, "prefill_chunk_size is 0; expected an int >= 1"),
                                            (-5, "prefill_chunk_size is -5"), (1.5, "prefill_chunk_size is 1.5"),
                                            (65, "prefill_chunk_size is 65; expected at most the cache's "
                                                 "prefill_chunk_size 64")])
def test_engine_checks_prefill_chunk_size(chunk, message):
    with pytest.raises(ValueError, match=message):
        _engine(prefill_chunk_size=chunk)


def test_add_request_refuses_what_can_never_fit_the_cache():
    engine = _engine()
    free = engine.cache.get_num_available_pages()
    with pytest.raises(ValueError, match=r"is 257 tokens; expected at most .* max_total_seq_len=256"):
        engine.add_request([1] * 200, 57)
    with pytest.raises(ValueError, match="is 1000000000000000000001 tokens"):
        engine.add_request([1], 10**21)
    assert engine.requests == {} and engine.cache.empty() and engine.cache.get_num_available_pages() == free
    req = engine.add_request([1] * 200, 56)  # exactly the capacity
    assert engine.requests == {req.seq_id: req} and req.max_new_tokens == 56


@pytest.mark.parametrize("prompt, message", [
    ({1: 2, 3: 4}, "got dict"), ({1, 2}, "got set"), (frozenset([1]), "got frozenset"),
    ((t for t in [1, 2]), "got generator"), (np.array([[1, 2]]), r"shape \(1, 2\) and dtype int64"),
    (np.array([1.0, 2.0]), "dtype float64"), ("ab", "got str"),
])
def test_add_request_refuses_unordered_or_odd_prompts(prompt, message):
    engine = _engine()
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, 2)
    assert engine.requests == {} and engine.cache.empty()


def test_add_request_accepts_ordered_prompts():
    engine = _engine()
    for prompt in ([3, 1, 2], (3, 1, 2), np.array([3, 1, 2], dtype="int32"), range(3, 0, -1)):
        assert engine.add_request(prompt, 2).tokens == list(prompt)


def test_fork_and_speculate_refuse_requests_not_running_here():
    mine, other = _engine(), _engine()
    foreign = other.add_request([1, 2, 3], 4)
    own = mine.add_request([5, 6, 7], 4)  # same seq_id (0) as ``foreign``: the identity counts
    assert own.seq_id == foreign.seq_id
    for call in (lambda: mine.fork(foreign, 1), lambda: mine.speculate(foreign, [1]), lambda: mine.cancel(foreign)):
        with pytest.raises(ValueError, match="finished, cancelled or of another engine"):
            call()
    with pytest.raises(ValueError, match="not a Request"):
        mine.fork(0, 1)
    assert mine.requests == {own.seq_id: own} and mine.cache.get_sequence_length(own.seq_id) == 0


def test_cancel_removes_the_request_and_frees_its_sequence():
    engine = _engine()
    free = engine.cache.get_num_available_pages()
    req = engine.add_request([1, 2, 3], 4)
    engine.cancel(req)
    assert engine.requests == {} and engine.cache.empty() and engine.cache.get_num_available_pages() == free
    for call in (lambda: engine.cancel(req), lambda: engine.fork(req, 1), lambda: engine.speculate(req, [])):
        with pytest.raises(ValueError, match="finished, cancelled or of another engine"):
            call()


def test_engine_takes_ndarray_subclass_prompts_and_refuses_float_ids():
    engine = _engine()
    masked = np.ma.masked_array(np.array([3, 4, 5], dtype=np.int32))  # an ndarray subclass
    assert engine.add_request(masked[1:], 2).tokens == [4, 5]
    with pytest.raises(ValueError, match="not a token id"):
        engine.add_request([1, 2.0], 4)


def test_requests_are_read_only_handles():
    """``add_request`` returned the engine's live state: ``r.tokens[1] = 10**9`` fed an unchecked id
    to the model (a segfault) and ``r.cached = 0`` desynchronised the engine from the cache."""
    engine = _engine()
    req = engine.add_request([1, 2, 3], 4)
    req.tokens[1] = 10**9  # a copy
    assert req.tokens == [1, 2, 3] and engine.requests[req.seq_id].tokens == [1, 2, 3]
    for name in ("cached", "tokens", "seq_id", "max_new_tokens", "prompt_len"):
        with pytest.raises(AttributeError):
            setattr(req, name, 0)
    assert "Request(seq_id=0" in repr(req)


@pytest.mark.parametrize("budget", [np.uint64(2**64 - 1), np.int16(32762), np.int32(2**31 - 5)])
def test_numpy_token_budgets_do_not_overflow_the_capacity_check(budget):
    engine = _engine()
    with pytest.raises(ValueError, match="expected at most the cache's capacity"):
        engine.add_request([1, 2, 3], budget)
    assert not engine.requests and engine.cache.empty()


def test_huge_prompts_are_refused_by_length_first():
    """A 10**7-token prompt was converted element by element before the capacity check (10 s);
    ``range(10**12)`` raised an empty MemoryError."""
    engine = _engine()
    for prompt in (range(10**12), np.zeros(10**7, dtype=np.int64), range(0, 2**70, 1)):
        with pytest.raises(ValueError, match="plus max_new_tokens"):
            engine.add_request(prompt, 1)
    assert not engine.requests


# ---------------------------------------------------------------------------- engine with the model


@pytest.fixture(scope="module")
def model():
    """``(executable, cfg, weights, numpy model)``: the demo's float32 Llama for llvm."""
    cfg = LlamaConfig()
    weights = random_weights(cfg, 0)
    return model_demo.compile_model(cfg, tvm.target.Target("llvm")), cfg, weights, LlamaNumpy(cfg, weights)


def _model_engine(model, max_total):
    executable, cfg, weights, numpy_model = model
    vm = VirtualMachine(executable, tvm.cpu())
    shape = tvm.runtime.ShapeTuple
    cache = vm["create_kv_cache"](shape([8]), shape([max_total]), shape([64]))
    return Engine(vm, [tvm.runtime.tensor(w.astype("float32")) for w in weights.values()], cache, tvm.cpu(),
                  prefill_chunk_size=64, vocab_size=cfg.vocab_size, reference=numpy_model.logits)


def _greedy(numpy_model, prompt, n):
    """``n`` greedy tokens of the float64 numpy model (the independent expectation)."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(numpy_model.logits(tokens)[-1].argmax()))
    return tokens[len(prompt):]


def test_cache_full_step_leaves_state_and_cancel_unblocks(model):
    """A full cache wedged the engine (every step failed). Two requests that fit alone
    but not together: the step that runs out of pages raises CacheFullError and changes nothing;
    cancelling one lets the other finish with the right tokens."""
    engine = _model_engine(model, max_total=128)  # 9 pages of 16 tokens
    rng = np.random.default_rng(1)
    a = engine.add_request(rng.integers(0, 512, 90).tolist(), 6)
    b = engine.add_request(rng.integers(0, 512, 60).tolist(), 6)  # 90 + 60 + 12 tokens > 144
    with pytest.raises(rk.CacheFullError):
        for _ in range(10):
            before = ([list(r.tokens) for r in (a, b)], [r.cached for r in (a, b)], engine.free_pages())
            engine.step()
    assert ([list(r.tokens) for r in (a, b)], [r.cached for r in (a, b)], engine.free_pages()) == before
    assert [engine.cache.get_sequence_length(r.seq_id) for r in (a, b)] == [a.cached, b.cached]
    free = engine.free_pages()
    engine.cancel(b)
    assert engine.free_pages() > free and list(engine.requests) == [a.seq_id]
    done = []
    while engine.requests:
        done += engine.step()
    assert done == [a] and a.tokens[a.prompt_len:] == _greedy(model[3], a.tokens[:a.prompt_len], 6)
    assert engine.cache.empty()


def test_speculate_stays_within_max_new_tokens(model):
    engine = _model_engine(model, max_total=256)
    prompt = [5, 9, 17, 3, 100]
    req = engine.add_request(prompt, 4)
    engine.step()  # prompt in, first token generated
    expected = _greedy(model[3], prompt, 4)
    with pytest.raises(ValueError, match="3 drafts would take request 0 to 5 generated tokens; expected at most "
                                         "max_new_tokens=4"):
        engine.speculate(req, expected[1:4])
    assert req.tokens == prompt + expected[:1] and req.cached == len(prompt)
    assert engine.speculate(req, expected[1:3]) == 2  # the model's own tokens: all accepted, + 1
    assert engine.step() == [req] and req.tokens == prompt + expected  # retired, no token past the budget


def test_a_reference_check_that_raises_rolls_the_step_back(model):
    """End_forward had committed the step before the reference check ran;
    a check that raised (or Ctrl-C in the slow float64 model) left the cache a step ahead of the
    request, and the next step fed the tokens again (wrong tokens, silently)."""
    engine = _model_engine(model, max_total=256)
    numpy_model = model[3]
    calls = []

    def flaky(tokens):
        calls.append(len(tokens))
        if len(calls) == 2:  # the second request's check of the first step
            raise KeyboardInterrupt
        return numpy_model.logits(tokens)

    engine.reference = flaky
    a, b = engine.add_request([7, 8, 9, 10], 3), engine.add_request([11, 12, 13], 3)
    free = engine.free_pages()
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert (a.cached, b.cached, engine.free_pages()) == (0, 0, free)
    assert [engine.cache.get_sequence_length(r.seq_id) for r in (a, b)] == [0, 0]
    while engine.requests:
        engine.step()
    assert a.tokens[4:] == _greedy(numpy_model, [7, 8, 9, 10], 3)
    assert b.tokens[3:] == _greedy(numpy_model, [11, 12, 13], 3)


def test_prefill_rows_asks_for_the_sampled_rows_only(model):
    """``prefill_rows``: a prefill step asks the model for each request's last row (a speculative
    step for all of its rows), the count padded to a power of two; tokens and last logits are the
    float64 model's, as with every row's logits."""
    executable, cfg, weights, numpy_model = model
    vm = VirtualMachine(executable, tvm.cpu())
    shape = tvm.runtime.ShapeTuple
    cache = vm["create_kv_cache"](shape([8]), shape([256]), shape([64]))
    asked = []

    def prefill_rows(ids, rows, *rest):
        asked.append(rows.numpy().tolist())
        return vm["prefill_rows"](ids, rows, *rest)

    with pytest.raises(ValueError, match="prefill_rows leaves rows out"):
        Engine(vm, [], cache, tvm.cpu(), prefill_chunk_size=64, vocab_size=cfg.vocab_size,
               reference=numpy_model.logits, prefill_rows=True)
    engine = Engine({"prefill_rows": prefill_rows, "decode": vm["decode"]},
                    [tvm.runtime.tensor(w.astype("float32")) for w in weights.values()], cache, tvm.cpu(),
                    prefill_chunk_size=64, vocab_size=cfg.vocab_size, prefill_rows=True)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (5, 9, 3)]
    reqs = [engine.add_request(p, 4) for p in prompts]
    engine.step()
    assert asked == [[4, 13, 16, 16]]  # three last rows, padded to four
    for req, prompt in zip(reqs, prompts):
        want = numpy_model.logits(prompt)[-1]
        np.testing.assert_allclose(req.last_logits, want, rtol=0, atol=1e-4 * np.abs(want).max())
    expected = _greedy(numpy_model, prompts[0], 4)
    assert reqs[0].tokens[len(prompts[0]):] == expected[:1]
    assert engine.speculate(reqs[0], expected[1:3]) == 2  # the model's own tokens: all kept
    assert asked[-1] == [0, 1, 2, 2]  # every row of the speculative step
    while engine.requests:
        engine.step()
    assert [r.tokens[len(p):] for r, p in zip(reqs, prompts)] == [_greedy(numpy_model, p, 4) for p in prompts]


def test_failed_adds_and_forks_do_not_consume_ids(model):
    engine = _model_engine(model, max_total=128)
    other = Engine(engine.vm, engine.weights, engine.cache, tvm.cpu(), prefill_chunk_size=64,
                   vocab_size=engine.vocab_size)
    req = engine.add_request([5, 6, 7], 3)
    with pytest.raises(rk.SequenceError):  # the second engine's id 0 is taken in the shared cache
        other.add_request([1], 1)
    assert other._next_id == 0 and not other.requests
    engine.cancel(req)


def test_forks_beyond_the_step_size_take_turns(model):
    """More decoding requests than ``prefill_chunk_size`` made every step raise ForwardError (the
    engine stuck); they now take turns, and every request still gets the greedy tokens."""
    executable, cfg, weights, numpy_model = model
    vm = VirtualMachine(executable, tvm.cpu())
    shape = tvm.runtime.ShapeTuple
    cache = vm["create_kv_cache"](shape([8]), shape([256]), shape([2]))
    engine = Engine(vm, [tvm.runtime.tensor(w.astype("float32")) for w in weights.values()], cache, tvm.cpu(),
                    prefill_chunk_size=2, vocab_size=cfg.vocab_size)
    parent = engine.add_request([3, 4], 3)
    engine.step()  # prompt in, first token
    children = [engine.fork(parent, alt) for alt in (10, 11)]  # three decoding requests, steps of 2
    done = []
    while engine.requests:
        done += engine.step()
    for req in [parent] + children:
        assert req in done and req.tokens[3:] == _greedy(numpy_model, req.tokens[:3], 2)
    assert cache.empty()


# ---------------------------------------------------------------------------- a failing model


def _python_model(fail, vocab):
    """A model function that writes every layer's K/V through the cache, then may raise."""
    rng = np.random.default_rng(3)

    def model(ids, cache, *weights):
        n, cfg = ids.numpy().size, cache.config
        for layer in range(cfg.num_layers):
            qkv = rng.standard_normal((n, cfg.num_qo_heads + 2 * cfg.num_kv_heads, cfg.head_dim))
            cache.attention_with_fused_qkv(layer, tvm.runtime.tensor(qkv.astype("float32")),
                                           tvm.runtime.empty((n, cfg.num_qo_heads, cfg.head_dim), "float32"), 0.1)
        if fail["on"]:
            raise RuntimeError("the model failed")
        return tvm.runtime.tensor(rng.standard_normal((n, vocab)).astype("float32"))

    return model


def test_a_failed_model_step_returns_the_pages_in_their_order():
    """The rollback popped the step's tokens in batch order, so the
    pages went back to the free list reversed; and a VM without the step's function raised after
    begin_forward, leaving the step active (every later step failed)."""
    fail = {"on": False}
    model = _python_model(fail, 16)
    engine = _engine(vocab_size=16)
    engine.vm = {"prefill": model, "decode": model}
    a, b = engine.add_request(list(range(16)), 4), engine.add_request(list(range(16)), 4)
    engine.step()  # each prompt fills one page: the decode step takes a new page each
    # (free pages' raw contents are not compared: the model wrote its K/V there before failing)
    before = (snapshot(engine.cache), [(r.tokens, r.cached) for r in (a, b)])
    fail["on"] = True
    with pytest.raises(RuntimeError, match="the model failed"):
        engine.step()
    after = snapshot(engine.cache)
    import dataclasses
    from relax_kvcache.paging.sequences import Sequence

    last = [f.name for f in dataclasses.fields(Sequence)].index("last_append_length")
    for shot in (before[0], after):  # all but the last-step lengths: popn resets them
        shot.paging["sequences"] = tuple((k, fields[:last] + fields[last + 1:])
                                         for k, fields in shot.paging["sequences"])
    assert_same(before[0], after)
    assert [(r.tokens, r.cached) for r in (a, b)] == before[1]
    engine.vm = {"prefill": model}  # no decode function: refused before the step begins
    with pytest.raises(KeyError, match="decode"):
        engine.step()
    assert engine.cache._step is None
    engine.vm = {"prefill": model, "decode": model}
    fail["on"] = False
    engine.step()
