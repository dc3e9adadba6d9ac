"""A small generation engine on a compiled model and the cache (what a server does), driving the
cache only through global functions (TVM's ``vm.builtin.kv_state_*``; with prefix caching, our
``relax_kvcache.*_with_tokens``) as MLC-LLM's engine does."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from operator import attrgetter
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import tvm

from .args import as_int_list, describe, exact_int, range_length
from .errors import ArgumentError

Reference = Callable[[Sequence[int]], np.ndarray]


class Request:
    """One sequence being generated: a read-only handle (the engine owns the state).
    ``tokens`` (a copy) = prompt + generated; the first ``cached`` are in the cache."""

    __slots__ = ("_seq_id", "_tokens", "_prompt_len", "_max_new_tokens", "_cached", "_last_logits")

    def __init__(self, seq_id: int, tokens: List[int], prompt_len: int, max_new_tokens: int,
                 cached: int = 0) -> None:
        self._seq_id, self._tokens, self._prompt_len = seq_id, tokens, prompt_len
        self._max_new_tokens, self._cached = max_new_tokens, cached
        self._last_logits: Optional[np.ndarray] = None

    seq_id = property(attrgetter("_seq_id"))
    prompt_len = property(attrgetter("_prompt_len"))
    max_new_tokens = property(attrgetter("_max_new_tokens"))
    cached = property(attrgetter("_cached"), doc="Tokens in the cache.")

    @property
    def tokens(self) -> List[int]:
        """Prompt and generated tokens (a copy)."""
        return list(self._tokens)

    @property
    def last_logits(self) -> Optional[np.ndarray]:
        """Logits of the last token fed, what the next token was picked from (a copy)."""
        return None if self._last_logits is None else self._last_logits.copy()

    @property
    def generated(self) -> int:
        return len(self._tokens) - self._prompt_len

    @property
    def prefilling(self) -> bool:
        return self._cached < self._prompt_len

    @property
    def finished(self) -> bool:
        return self.generated >= self._max_new_tokens and self._cached == len(self._tokens) - 1

    def __repr__(self) -> str:
        return (f"Request(seq_id={self._seq_id}, prompt_len={self._prompt_len}, "
                f"generated={self.generated}, cached={self._cached}, "
                f"max_new_tokens={self._max_new_tokens})")


@dataclasses.dataclass
class Stats:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    rolled_back: int = 0
    model_seconds: float = 0.0
    max_rel_error: float = 0.0
    checked_rows: int = 0
    graph_replays: int = 0  # decode steps replayed as a CUDA graph
    prefix_hit_tokens: int = 0  # prompt tokens found in cached pages (prefix caching): not computed


class Engine:
    """Drives ``vm["prefill"]`` / ``vm["decode"]`` (``(input_ids, cache, *weights) -> logits``)
    on one cache it owns (not picklable; docs/api.md). Token ids are checked against
    ``vocab_size``; ``prefill_chunk_size`` (the most tokens a step feeds) against our cache's.

    ``cuda_graphs`` (default: whenever ``cache`` is our cache on a CUDA device): decode steps run
    through :class:`relax_kvcache.cuda_graph.DecodeGraphs` with ``any_batch``: the whole model
    call is captured once per batch size and page-list structure (the second time one is
    seen) and replayed as one CUDA graph for every later batch of them, whichever its
    sequences; prefill steps, and the first step of a new batch size, run eagerly.

    ``prefill_rows``: prefill steps call ``vm["prefill_rows"](input_ids, rows, cache, *weights)``
    (logits of the rows ``rows`` only, ``(1, k, vocab)``) instead of ``vm["prefill"]``, asking
    for the rows the step samples from (each request's last, every row of a speculative step),
    their count padded to a power of two: the model's output takes a few sizes, not one per
    prompt length (a device allocator that caches by size then stops growing). Not with
    ``reference``, which checks every row.

    ``prefix_caching``: ``add_request`` passes the prompt's token ids to the cache, which starts
    the sequence on the cached pages of its longest cached prefix (``Request.cached`` starts
    there, those tokens are not computed: ``stats.prefix_hit_tokens``), and every step passes its
    token ids, so the pages it fills are cached for later requests (docs/prefix-caching.md).
    Needs our cache created with prefix caching (``CacheLayout(prefix_caching=True)``)."""

    def __init__(self, vm, weights: Sequence[tvm.runtime.Tensor], cache,
                 device: tvm.runtime.Device, *, prefill_chunk_size: int, vocab_size: int,
                 reference: Optional[Reference] = None, cuda_graphs: Optional[bool] = None,
                 prefill_rows: bool = False, prefix_caching: bool = False) -> None:
        vocab, chunk = exact_int(vocab_size), exact_int(prefill_chunk_size)
        if vocab is None or not 1 <= vocab <= 2**31:
            raise ValueError(f"Engine: vocab_size is {describe(vocab_size)}; expected an int in "
                             "[1, 2**31] (the model's vocabulary size; token ids are checked "
                             "against it)")
        if chunk is None or chunk < 1:
            raise ValueError(f"Engine: prefill_chunk_size is {describe(prefill_chunk_size)}; "
                             "expected an int >= 1")
        from .cache import PagedAttentionKVCache

        config = cache.config if isinstance(cache, PagedAttentionKVCache) else None  # unchecked
        if config is not None and chunk > config.prefill_chunk_size:
            raise ValueError(f"Engine: prefill_chunk_size is {chunk}; expected at most the cache's "
                             f"prefill_chunk_size {config.prefill_chunk_size} (a step feeds that "
                             "many tokens)")
        if prefill_rows and reference is not None:
            raise ValueError("Engine: prefill_rows leaves rows out; the reference check needs every row "
                             "(pass one of the two)")
        if not isinstance(prefix_caching, bool):
            raise ValueError(f"Engine: prefix_caching is {describe(prefix_caching)}; expected a bool")
        g = tvm.get_global_func
        if prefix_caching and not (config is not None and config.prefix_caching):
            raise ValueError(f"Engine: prefix_caching=True needs our cache created with prefix caching; got "
                             f"{type(cache).__name__}{'' if config is None else ' without it'} (compile the "
                             "model with CacheLayout(prefix_caching=True): the 9th cache_config entry 1)")
        self.prefix_caching = prefix_caching
        self.vm, self.weights, self.cache, self.device = vm, list(weights), cache, device
        self.prefill_rows = bool(prefill_rows)
        self.vocab_size, self.chunk, self.reference = vocab, chunk, reference
        #: the most tokens one sequence can hold (None: unknown, not checked)
        self.max_seq_tokens = None if config is None else int(config.max_total_seq_len)
        self.requests: Dict[int, Request] = {}
        self.stats = Stats()
        self._next_id = 0
        self._add, self._remove, self._fork, self._popn, self._begin, self._end = (
            g(f"vm.builtin.kv_state_{name}") for name in ("add_sequence", "remove_sequence",
                                                          "fork_sequence", "popn",
                                                          "begin_forward", "end_forward"))
        self._free_pages = g("vm.builtin.attention_kv_cache_get_num_available_pages")
        self._add_tokens, self._begin_tokens, self._prefix_stats = (
            g(f"relax_kvcache.{name}") for name in ("add_sequence_with_tokens", "begin_forward_with_tokens",
                                                    "prefix_cache_stats"))
        on_cuda = config is not None and device.dlpack_device_type() == tvm.cuda().dlpack_device_type()
        if cuda_graphs and not on_cuda:
            raise ValueError(f"Engine: cuda_graphs needs our cache on a CUDA device; got "
                             f"{type(cache).__name__} on {device}")
        self._graphs = None
        if on_cuda if cuda_graphs is None else cuda_graphs:
            from .cuda_graph import DecodeGraphs

            self._graphs = DecodeGraphs(cache, any_batch=True)
        self._decode_ids: Dict[int, tvm.runtime.Tensor] = {}  # per batch size: a graph reads them

    def add_request(self, prompt: Sequence[int], max_new_tokens: int) -> Request:
        """A new request; ValueError (nothing changed) on a bad prompt or budget, or one longer
        than the cache can hold."""
        length = self._token_count("add_request: prompt", prompt)
        if length == 0:
            raise ValueError("add_request: the prompt is empty; expected at least one token")
        budget = exact_int(max_new_tokens)  # a Python int: numpy integers overflow in the sum below
        if budget is None or budget < 1:
            raise ValueError(f"add_request: max_new_tokens is {describe(max_new_tokens)}; "
                             "expected an int >= 1")
        if self.max_seq_tokens is not None and length + budget > self.max_seq_tokens:
            raise ValueError(f"add_request: the prompt ({length} tokens) plus max_new_tokens "
                             f"({budget}) is {length + budget} tokens; expected at most the "
                             f"cache's capacity, max_total_seq_len={self.max_seq_tokens}")
        prompt = self._tokens("add_request: prompt", prompt)
        req = Request(seq_id=self._next_id, tokens=prompt, prompt_len=length, max_new_tokens=budget)
        if self.prefix_caching:
            req._cached = int(self._add_tokens(self.cache, req.seq_id, tvm.runtime.ShapeTuple(prompt)))
            self.stats.prefix_hit_tokens += req.cached
        else:
            self._add(self.cache, req.seq_id)
        self._next_id += 1  # only once the cache took the sequence
        self.requests[req.seq_id] = req
        return req

    def cancel(self, request: Request) -> None:
        """Remove a live request and its sequence (its pages return to the pool), e.g. after
        :meth:`step` raised :class:`relax_kvcache.CacheFullError`."""
        self._live("cancel", request)
        self._remove(self.cache, request.seq_id)
        del self.requests[request.seq_id]

    def fork(self, parent: Request, alternative: int) -> Request:
        """A second continuation of ``parent`` (right after its first token) sharing its cached
        prefix, continuing from ``alternative`` instead of that token."""
        self._live("fork", parent)
        alternative = self._tokens("fork: alternative", [alternative])[0]
        if parent.prefilling or parent.generated != 1:
            raise ValueError(f"fork a request right after its first token; request "
                             f"{parent.seq_id} has {parent.cached}/{parent.prompt_len} prompt "
                             f"tokens cached, {parent.generated} generated")
        child = Request(seq_id=self._next_id, tokens=parent._tokens[:-1] + [alternative],
                        prompt_len=parent.prompt_len, max_new_tokens=parent.max_new_tokens,
                        cached=parent.cached)
        self._fork(self.cache, parent.seq_id, child.seq_id, parent.cached)
        self._next_id += 1  # only once the cache took the sequence
        self.requests[child.seq_id] = child
        return child

    def free_pages(self) -> int:
        """Pages new tokens can take (with prefix caching: cached pages no request holds too)."""
        return int(self._free_pages(self.cache))

    def prefix_cache_stats(self) -> dict:
        """The cache's prefix caching counters (``relax_kvcache.prefix_cache_stats``)."""
        if not self.prefix_caching:
            raise ValueError("prefix_cache_stats: the engine runs without prefix_caching")
        return dict(self._prefix_stats(self.cache))

    def step(self) -> List[Request]:
        """One step: a token of every decoding request plus prompt chunks within
        ``prefill_chunk_size`` tokens; returns the requests that finished (and were removed). A
        step that raises (e.g. :class:`relax_kvcache.CacheFullError`) changes nothing (undone
        with ``popn``)."""
        if not self.requests:
            raise ValueError("step: there are no requests; add one with add_request")
        # (a request finished by a speculative step is only retired: it gets no more tokens)
        decoding = [r for r in self.requests.values() if not r.prefilling and not r.finished]
        if len(decoding) > self.chunk:  # more than a step holds (forks): take turns
            start = self.stats.steps % len(decoding)
            decoding = (decoding[start:] + decoding[:start])[:self.chunk]
        batch = [(r, 1) for r in decoding]
        budget = self.chunk - len(batch)
        for req in (r for r in self.requests.values() if r.prefilling):
            if budget <= 0:
                break
            n = min(req.prompt_len - req.cached, budget)
            batch.append((req, n))
            budget -= n
        if batch:
            self._run(batch)
        done = [r for r in self.requests.values() if r.finished]
        for req in done:
            self._remove(self.cache, req.seq_id)
            del self.requests[req.seq_id]
        return done

    def speculate(self, req: Request, drafts: Sequence[int]) -> int:
        """Feed ``req``'s pending token and ``drafts`` in one call, keep the drafts greedy
        decoding agrees with, roll the rest back with ``popn``; return how many were kept.
        ValueError (nothing changed) unless ``req`` is a live decoding request with room for
        them within its ``max_new_tokens``."""
        self._live("speculate", req)
        if req.prefilling or req.cached != len(req._tokens) - 1:
            raise ValueError(f"speculate on a decoding request; request {req.seq_id} is still "
                             "prefilling")
        drafts = self._tokens("speculate: drafts", drafts)
        if req.generated + len(drafts) + 1 > req.max_new_tokens:
            raise ValueError(f"speculate: {len(drafts)} drafts would take request {req.seq_id} to "
                             f"{req.generated + len(drafts) + 1} generated tokens; expected at most "
                             f"max_new_tokens={req.max_new_tokens} (it has {req.generated}; at most "
                             f"{max(req.max_new_tokens - req.generated - 1, 0)} drafts)")
        base = len(req._tokens)
        req._tokens.extend(drafts)
        try:
            logits = self._run([(req, 1 + len(drafts))], sample=False)[0]
        except Exception:
            del req._tokens[base:]  # the request as it was (_run rolled the cache back)
            raise
        accepted = 0
        while accepted < len(drafts) and int(logits[accepted].argmax()) == drafts[accepted]:
            accepted += 1
        rejected = len(drafts) - accepted
        if rejected:
            self._popn(self.cache, req.seq_id, rejected)
            self.stats.rolled_back += rejected
        del req._tokens[base + accepted:]
        req._cached = len(req._tokens)
        req._tokens.append(int(logits[accepted].argmax()))
        return accepted

    def _run(self, batch, *, sample: bool = True) -> List[np.ndarray]:
        """Feed each request's next ``n`` tokens in one model call; per request its logits (with
        ``sample``, a request whose tokens are all in gets its greedy next token)."""
        ids = np.concatenate([r._tokens[r.cached:r.cached + n] for r, n in batch]).astype("int32")
        decode = all(n == 1 for _, n in batch)
        start = time.perf_counter()
        rows_of = self._rows(batch, sample) if self.prefill_rows and not decode else None
        # the functions before the step: a missing one raises
        fn = self.vm["decode"] if decode else self.vm["prefill" if rows_of is None else "prefill_rows"]
        inputs = [self._inputs(ids, decode)]
        if rows_of is not None:
            picked = np.concatenate(rows_of)
            padded = np.full(1 << (len(picked) - 1).bit_length(), picked[-1], dtype="int32")
            padded[:len(picked)] = picked
            inputs.append(tvm.runtime.tensor(padded, self.device))
        with self._graphs.stream_context() if self._graphs else contextlib.nullcontext():
            seq_ids = tvm.runtime.ShapeTuple([r.seq_id for r, _ in batch])
            lengths = tvm.runtime.ShapeTuple([n for _, n in batch])
            if self.prefix_caching:  # the step's token ids: the pages it fills get cached
                self._begin_tokens(self.cache, seq_ids, lengths, tvm.runtime.ShapeTuple(ids.tolist()))
            else:
                self._begin(self.cache, seq_ids, lengths)
            try:
                logits = self._call(fn, inputs, decode).numpy()
                self._end(self.cache)
                logits = logits.reshape(-1, logits.shape[-1])
                counts = [n for _, n in batch] if rows_of is None else [len(r) for r in rows_of]
                per_request = np.split(logits[:sum(counts)], np.cumsum(counts)[:-1])
                for (req, n), rows in zip(batch, per_request):  # the reference check may raise
                    self._check(req._tokens[:req.cached + n], rows)
            except BaseException:  # the model or a check raised (or Ctrl-C): the step never happened
                self._end(self.cache)
                # begin_forward grew the sequences: drop the step's tokens, last sequence first, so
                # that their pages return to the free list in the order they left it
                for req, n in reversed(batch):
                    self._popn(self.cache, req.seq_id, n)
                raise
        self.stats.model_seconds += time.perf_counter() - start
        self.stats.steps += 1
        for (req, n), rows in zip(batch, per_request):
            if req.prefilling:
                self.stats.prefill_tokens += n
            else:
                self.stats.decode_tokens += n
            req._cached += n
            req._last_logits = rows[-1]
            if sample and req.cached == len(req._tokens):
                req._tokens.append(int(rows[-1].argmax()))
        return per_request

    @staticmethod
    def _rows(batch, sample: bool) -> List[np.ndarray]:
        """Per request, the rows of the step's tokens whose logits it uses: its last (and with
        ``sample`` off, a speculative step, all of its)."""
        ends = np.cumsum([n for _, n in batch])
        return [np.arange(end - n, end) if not sample else np.array([end - 1])
                for (_, n), end in zip(batch, ends)]

    def _inputs(self, ids: np.ndarray, decode: bool) -> tvm.runtime.Tensor:
        """The step's token ids on the device; with graphs, a decode batch's in the tensor its
        graph reads (one per batch size)."""
        if not (decode and self._graphs):
            return tvm.runtime.tensor(ids.reshape(-1, 1) if decode else ids.reshape(1, -1), self.device)
        held = self._decode_ids.get(len(ids))
        if held is None:
            held = self._decode_ids[len(ids)] = tvm.runtime.empty((len(ids), 1), "int32", self.device)
        held.copyfrom(ids.reshape(-1, 1))
        return held

    def _call(self, fn, inputs: List[tvm.runtime.Tensor], decode: bool) -> tvm.runtime.Tensor:
        """The model call (``inputs``: the arguments before the cache): a decode step through
        the graphs where there are any."""
        if not self._graphs:
            return fn(*inputs, self.cache, *self.weights)
        if not decode:  # eager, on the graphs' stream (non-blocking): wait before reading the output
            out = fn(*inputs, self.cache, *self.weights)
            self._graphs.synchronize()
            return out

        if self._graphs.run(lambda: fn(*inputs, self.cache, *self.weights)) == "replayed":
            self.stats.graph_replays += 1
        self._graphs.synchronize()
        return self._graphs.output  # a replay writes the output of the call it captured

    def close(self) -> None:
        """Release the CUDA graphs and their stream (if any)."""
        if self._graphs is not None:
            self._graphs.close()
            self._graphs = None

    def _token_count(self, what: str, tokens: Sequence[int]) -> int:
        """The length of a list, tuple, range or 1-D integer numpy array (elements untouched)."""
        if isinstance(tokens, np.ndarray):
            if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
                raise ValueError(f"{what} is a numpy array of shape {tokens.shape} and dtype "
                                 f"{tokens.dtype}; expected a 1-D integer array of token ids")
            return int(tokens.shape[0])
        if isinstance(tokens, range):
            return range_length(tokens)  # len() overflows beyond 2**63
        if not isinstance(tokens, (list, tuple)):
            raise ValueError(f"{what} must be a sequence of token ids (list, tuple, range or 1-D "
                             f"integer numpy array), got {type(tokens).__name__} "
                             f"({describe(tokens)})")
        return len(tokens)

    def _tokens(self, what: str, tokens: Sequence[int]) -> List[int]:
        """Token ids as Python ints, each within ``[0, vocab_size)``."""
        count = self._token_count(what, tokens)
        try:
            ids = as_int_list(what, tokens, max_len=max(count, 1), why="its length")
        except ArgumentError as err:
            raise ValueError(f"{err}: not a token id (int)") from None
        for tok in ids:
            if not 0 <= tok < self.vocab_size:
                raise ValueError(f"{what} holds token id {tok}, outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        return ids

    def _live(self, what: str, req: Request) -> None:
        """Raise ValueError unless ``req`` is a request of this engine that is still running."""
        if not isinstance(req, Request) or self.requests.get(req.seq_id) is not req:
            state = ("not a Request" if not isinstance(req, Request) else
                     "finished, cancelled or of another engine")
            raise ValueError(f"{what}: {req!r:.100} is {state}; expected a running request of this "
                             f"engine (running: {sorted(self.requests)})")

    def _check(self, tokens: Sequence[int], rows: np.ndarray) -> None:
        if self.reference is None:
            return
        want = self.reference(tokens)[-len(rows):]
        scale = max(float(np.abs(want).max()), 1e-30)
        error = float(np.abs(rows - want).max()) / scale
        self.stats.max_rel_error = max(self.stats.max_rel_error, error)
        self.stats.checked_rows += len(rows)
