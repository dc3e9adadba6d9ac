"""Model, invariants and random operation mix shared by ``test_property.py`` and ``benchmarks/soak.py``.

A `Harness` drives one small `PagedAttentionKVCache` (4-token pages, a few dozen pages, so the cache
runs out of pages often) and a pure-Python `Model` of what the cache should hold. Every operation
(``add``, ``remove``, ``fork``, ``popn``, ``enable_window``, ``step``) first derives from the model
what must happen (`Expect`): succeed, raise one of some error types, or (where the model cannot
tell exactly, see below) either. Then it runs the operation and checks:

* an operation that raises raises a `KVCacheError` subclass it was allowed to, and leaves the cache
  exactly as it was: the paging state (``debug_snapshot``), every page's bytes in every layer, the
  K/V of every sequence read with ``debug_get_kv``, the free page count and whether a step is active;
* an operation that succeeds changes the model the same way; a forward step's attention outputs
  match a float64 reference (``reference_model.attend``) over the model's tokens;
* after every operation, `check_paging_invariants` and `check_against_model` hold.

The model, per sequence: its K/V tokens as stored (RoPE NONE, so K is stored as given), the start
positions of the blocks of its path in the prefix tree (``bounds``: derived from the fork/pop rules,
compared with the cache's block trace), its sliding window and the sink of its last block, and per
pair of sequences the length of the prefix they physically share (whole pages, set by forks). The
model predicts every error exactly except the page needs of sequences that have slid (their pages
depend on the window offset): a batch with a sliding sequence must succeed when the pages it could
need at most are free and may raise `CacheFullError` otherwise.

Sliding-window model (caches with ``support_sliding_window``): a windowed sequence keeps its first
``sink_limit = prefix + last-block sink`` tokens (``prefix``: start of its last block; the blocks
before it cannot slide) and its most recent ``window - sink_limit`` ones; a window smaller than
``prefix`` is refused (``SequenceError``), and a step that must slide a sequence whose window is
smaller than ``sink_limit`` raises `SequenceError`; forks must be within
``sink_limit``; a fork keeps ``sink_limit`` (the last block's sink shrinks by what the fork moves into
prefix blocks); ``popn`` that frees whole blocks recomputes the last block's sink from the sink the
window was enabled with (``max(sink - prefix, 0)``), and a ``popn`` into a shared prefix re-forks the
sequence, keeping its window and sink the same way (no sink check: the re-fork is inside prefix
blocks, which never slide).

Chunked local attention (the ``chunked`` cache: layer 0 is ``MHA_CHUNKED_LOCAL`` with chunks of
``ATTENTION_CHUNK`` tokens, not a multiple of the page size): a step's token at position p of layer 0
attends to the keys at positions ``[p - p % ATTENTION_CHUNK, p]``; paging is the plain cache's.
``enable_window`` marks a sequence there without sliding it (as TVM does on caches with local
layers): the window and sink are recorded and bound forks and checkpoints as on the sliding cache,
the sequence keeps every token, and a window smaller than its prefix is accepted.

Token trees (``tree_step`` with ``token_tree_parent_ptr``, plain cache only: caches with sliding
windows or chunked layers raise `ForwardError`) and ``commit`` (``commit_accepted_token_tree_nodes``), with
``reference_model``'s semantics: a sequence's uncommitted tree nodes follow its tokens; a node attends to
the tokens before its tree, its ancestors and itself; a commit keeps, after the tokens before the
tree, the accepted path's nodes (indices in the whole tree, over all its steps) and pops the rest
(``popn`` rules; leaf -1 drops the tree, and on a committed sequence pops its last step). While a
tree is uncommitted the sequence cannot be forked, stepped without a tree, or popped
(`SequenceError`).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import ml_dtypes
import numpy as np
import tvm

import relax_kvcache as rk
from relax_kvcache.build import build_kernels
from relax_kvcache.errors import CacheFullError, ForwardError, KVCacheError, SequenceError
from relax_kvcache.kernel_set import KernelSet
from relax_kvcache.runtime import default_target

from reference_model import attend, tree_path, tree_visible

PAGE_SIZE = 4
NUM_LAYERS = 2
NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM = 2, 1, 16
CHUNK = 32  # prefill_chunk_size: the most tokens one step may append
SM_SCALE = HEAD_DIM ** -0.5
ATTENTION_CHUNK = 6  # the chunked cache's layer 0: not a multiple of PAGE_SIZE
KINDS = ("plain", "sliding", "chunked", "fp8", "prefix")
#: the fp8 cache's K and V scales (powers of two: values on the 8-bit grid times them are stored
#: exactly, so the model's exact checks hold)
FP8_SCALES = (0.5, 2.0)


class Mismatch(AssertionError):
    """The cache did something the model says it must not."""


# ----------------------------------------------------------------------------------- the cache

def make_config(kind: str) -> rk.KVCacheConfig:
    """A tiny config: 13 pages of 4 tokens (``plain``, ``chunked``: layer 0 attends within chunks
    of ``ATTENTION_CHUNK`` tokens; ``fp8``: pages of ``float8_e4m3fn``), 21 with per-sequence
    sliding windows (``sliding``); ``prefix``: prefix caching with a host tier of 6 pages."""
    chunked = dict(attn_kinds=(rk.AttnKind.MHA_CHUNKED_LOCAL,) + (rk.AttnKind.MHA,) * (NUM_LAYERS - 1),
                   attention_chunk_size=ATTENTION_CHUNK) if kind == "chunked" else {}
    return rk.KVCacheConfig(
        num_layers=NUM_LAYERS, num_qo_heads=NUM_QO_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
        page_size=PAGE_SIZE, max_num_seqs=4, max_total_seq_len=48, prefill_chunk_size=CHUNK,
        rope_mode=rk.RopeMode.NONE, dtype="float32", support_sliding_window=kind == "sliding",
        kv_dtype="float8_e4m3fn" if kind == "fp8" else None, prefix_caching=kind == "prefix",
        host_cache_pages=6 if kind == "prefix" else 0, **chunked)


_KERNELS: Dict[str, KernelSet] = {}


def make_cache(kind: str) -> rk.PagedAttentionKVCache:
    """A fresh cache of ``kind`` (kernels built once per process, then from the on-disk cache)."""
    cfg = make_config(kind)
    if kind not in _KERNELS:
        _KERNELS[kind] = KernelSet.from_module(build_kernels(cfg, default_target(tvm.cpu())))
    cache = rk.PagedAttentionKVCache(cfg, tvm.cpu(), kernels=_KERNELS[kind])
    if cfg.kv_dtype is not None:
        for layer in range(NUM_LAYERS):
            cache.set_kv_scales(layer, *FP8_SCALES)
    return cache


#: the prefix cache's prompts start with a prefix of one of these (system prompts)
STEMS = ((1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12), (1, 2, 3, 4, 9, 9, 9, 9, 5), (7,) * 10)


def token_kv(token: int, position: int) -> np.ndarray:
    """The prefix cache's K and V rows ``(layers, 2 * Hkv, D)`` of a token: a function of its id and
    position only, as in a model, so a sequence on cached pages holds what it would compute."""
    return np.random.default_rng([token, position]).standard_normal(
        (NUM_LAYERS, 2 * NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)


def read_kv(cache: rk.PagedAttentionKVCache, seq_id: int, length: int) -> Tuple[np.ndarray, np.ndarray]:
    """K and V ``(layers, length, Hkv, D)`` of a sequence, read with ``debug_get_kv``."""
    shape = (NUM_LAYERS, length, NUM_KV_HEADS, HEAD_DIM)
    k, v = tvm.runtime.empty(shape, "float32"), tvm.runtime.empty(shape, "float32")
    cache.debug_get_kv(seq_id, 0, length, k, v)
    return k.numpy(), v.numpy()


def read_all_kv(cache: rk.PagedAttentionKVCache) -> Dict[int, Tuple[np.ndarray, np.ndarray]]:
    paging = cache._paging
    return {s: read_kv(cache, s, paging.sequence_length(s)) for s in paging.seq_ids()
            if paging.sequence_length(s)}


def snapshot(cache: rk.PagedAttentionKVCache, kv: Optional[dict] = None) -> Dict[str, Any]:
    """Everything an operation could change. ``kv``: the sequences' ``debug_get_kv`` contents when
    already read from this very state (the harness reuses the last check's read)."""
    return {
        "paging": cache._paging.debug_snapshot(),
        "paging_version": cache._paging.version,  # bumped by every change of the paging state
        "step_active": cache._step is not None,
        "free_pages": cache.get_num_available_pages(),
        "total_length": cache.get_total_sequence_length(),
        "page_bytes": [p.numpy().tobytes() for p in cache._pages],
        "kv": read_all_kv(cache) if kv is None else kv,
    }


def assert_unchanged(before: Dict[str, Any], after: Dict[str, Any], what: str) -> None:
    for key in ("paging", "paging_version", "step_active", "free_pages", "total_length"):
        if before[key] != after[key]:
            raise Mismatch(f"{what} raised but changed {key}: {before[key]!r} -> {after[key]!r}")
    if before["page_bytes"] != after["page_bytes"]:
        raise Mismatch(f"{what} raised but changed page contents")
    if before["kv"].keys() != after["kv"].keys():
        raise Mismatch(f"{what} raised but changed the sequences read by debug_get_kv")
    for seq, (k, v) in before["kv"].items():
        k2, v2 = after["kv"][seq]
        if k.tobytes() != k2.tobytes() or v.tobytes() != v2.tobytes():
            raise Mismatch(f"{what} raised but changed the K/V of sequence {seq}")


# ----------------------------------------------------------------------------------- invariants

def check_paging_invariants(cache: rk.PagedAttentionKVCache) -> None:
    """Structural invariants of the paging state (see ``test_property``'s docstring).

    Ownership rule (``paging/block_pool.py``, TVM's ``external_ref_cnt``): a live block's
    ``ref_count`` is the number of live blocks whose parent it is plus the number of sequences whose
    last block it is; only `BlockPool` changes it, and a block is freed when its count would drop to 0.
    Pages are owned by blocks: a page is free or in exactly one live block's ``page_ids``.
    """
    paging, ps = cache._paging, PAGE_SIZE
    num_pages = paging.num_pages
    free = list(paging.free_page_ids()) + list(paging._pages.cached_page_ids())  # cached: available
    live = paging._blocks.live_indices()
    blocks = {i: paging.block(i) for i in live}
    _expect(len(set(free)) == len(free), f"free list has duplicates: {free}")
    owned = [p for b in blocks.values() for p in b.page_ids]
    registered = {page for page, _ in paging.registered_pages()}
    counts = collections.Counter(owned)
    for page, n in counts.items():  # only registered (full, never written) pages are shared
        _expect(n == paging._pages.refs(page), f"page {page} is held by {n} blocks, refs {paging._pages.refs(page)}")
        _expect(n == 1 or page in registered, f"a page is owned by two blocks (or twice): {sorted(owned)}")
    _expect(set(paging._pages.cached_page_ids()) <= registered, "a cached page is not registered")
    owned = sorted(counts)
    _expect(not set(owned) & set(free), f"pages both free and used: {sorted(set(owned) & set(free))}")
    _expect(sorted(owned + free) == list(range(num_pages)),
            f"pages lost or out of range: owned {sorted(owned)}, free {sorted(free)}")
    _expect(len(owned) + len(free) == num_pages == cache.config.num_total_pages, "page count")
    _expect(cache.get_num_available_pages() == len(free), "get_num_available_pages != free list length")
    free_blocks = list(paging._blocks.free_block_indices())
    _expect(sorted(free_blocks + live) == list(range(len(paging._blocks))), "block indices lost or reused twice")
    refs = collections.Counter(b.parent for b in blocks.values() if b.parent != -1)
    seqs = [paging.sequence(s) for s in paging.seq_ids()]
    refs.update(s.last_block for s in seqs)
    for i, b in blocks.items():
        _expect(b.ref_count == refs[i], f"block {i} has ref_count {b.ref_count}, expected {refs[i]} "
                                        "(child blocks + sequences ending there)")
    reachable = set()
    for seq in seqs:
        _check_path(paging, seq, blocks, ps)
        idx = seq.last_block
        while idx != -1 and idx not in reachable:
            reachable.add(idx)
            idx = blocks[idx].parent
    _expect(reachable == set(live), f"live blocks unreachable from any sequence: {set(live) - reachable}")
    _expect(paging.total_sequence_length() == sum(s.seq_length for s in seqs), "total sequence length")
    _expect(cache.empty() == (not seqs), f"empty() is {cache.empty()} with {len(seqs)} sequence(s)")


def _check_path(paging, seq, blocks, ps: int) -> None:
    trace = paging.block_trace(seq.seq_id)
    _expect(all(i in blocks for i in trace), f"sequence {seq.seq_id} reaches a freed block")
    _expect(blocks[seq.last_block].ref_count == 1,
            f"last block of sequence {seq.seq_id} is shared (ref_count {blocks[seq.last_block].ref_count})")
    start = 0
    for depth, idx in enumerate(trace):
        b = blocks[idx]
        _expect(b.start_pos == start, f"block {idx} starts at {b.start_pos}, its ancestors hold {start}")
        used = b.seq_length - b.sink_length + b.sliding_window_offset
        _expect(b.sliding_window_offset >= b.sink_length >= 0, f"block {idx} window offset < sink")
        _expect(len(b.page_ids) == -(-used // ps), f"block {idx} holds {len(b.page_ids)} pages for {used} slots")
        if depth < len(trace) - 1:
            _expect(b.seq_length > 0 and b.seq_length % ps == 0 and not b.sink_length
                    and not b.sliding_window_offset, f"prefix block {idx} is not whole unslid pages")
        start += b.seq_length
    _expect(start == seq.seq_length, f"sequence {seq.seq_id} has length {seq.seq_length}, blocks {start}")


def _expect(cond: bool, message: str) -> None:
    if not cond:
        raise Mismatch(message)


# ----------------------------------------------------------------------------------- the model

def _empty_kv() -> np.ndarray:
    return np.zeros((NUM_LAYERS, 0, NUM_KV_HEADS, HEAD_DIM), np.float32)


@dataclasses.dataclass
class SeqModel:
    """Expected state of one sequence."""

    k: np.ndarray  # (layers, length, Hkv, D) float32, as stored
    v: np.ndarray
    bounds: set  # start positions of the blocks of the sequence's path (multiples of the page size)
    window: int = -1  # sliding window size, -1: none
    lbass: int = 0  # sink of the last block (``last_block_attn_sink_size``)
    sink: int = 0  # the sink the window was enabled with
    slid: bool = False  # has slid: its last block's page count depends on the window offset
    tree: Optional[List[int]] = None  # parents of the uncommitted token tree (accumulated), None: committed
    tree_start: int = 0  # position of the uncommitted tree's roots
    last_append: int = 0  # tokens the sequence's last step appended (what commits resolve against)
    ids: Optional[List[int]] = dataclasses.field(default_factory=list)  # token ids (None: unknown)

    @property
    def length(self) -> int:
        return self.k.shape[1]

    @property
    def prefix(self) -> int:
        """Start of the last block: the tokens in blocks that cannot slide."""
        return max(self.bounds)

    @property
    def sink_limit(self) -> int:
        """Tokens a windowed sequence keeps at its start (and can be forked within)."""
        return self.prefix + self.lbass


class Model:
    """Expected sequences and the prefixes they share (see the module docstring).

    ``slides``: windowed sequences slide (a cache with ``support_sliding_window``); otherwise
    ``enable_window`` only marks them."""

    def __init__(self, slides: bool = False) -> None:
        self.slides = slides
        self.seqs: Dict[int, SeqModel] = {}
        self._shares: Dict[Tuple[int, int], int] = {}

    def share(self, a: int, b: int) -> int:
        return self._shares.get((min(a, b), max(a, b)), 0)

    def set_share(self, a: int, b: int, length: int) -> None:
        key = (min(a, b), max(a, b))
        if length > 0:
            self._shares[key] = length
        else:
            self._shares.pop(key, None)

    def shares_of(self, a: int) -> List[Tuple[int, int]]:
        """(other sequence, shared prefix length) of sequence ``a``."""
        return [(y if x == a else x, s) for (x, y), s in self._shares.items() if a in (x, y)]

    def shared_pairs(self) -> List[Tuple[int, int, int]]:
        return [(x, y, s) for (x, y), s in self._shares.items()]

    def max_share(self, a: int) -> int:
        return max((s for _, s in self.shares_of(a)), default=0)

    # -- structure (called after the cache succeeded)
    def add(self, seq_id: int) -> None:
        self.seqs[seq_id] = SeqModel(_empty_kv(), _empty_kv(), {0})

    def remove(self, seq_id: int) -> None:
        del self.seqs[seq_id]
        for other, _ in self.shares_of(seq_id):
            self.set_share(seq_id, other, 0)

    def fork(self, parent: int, child: int, pos: int) -> None:
        p = self.seqs[parent]
        pos = p.length if pos == -1 else pos
        cut = pos - pos % PAGE_SIZE  # whole pages are shared, a partial one is copied
        limit = p.sink_limit
        self._split(parent, pos, cut)
        self.seqs[child] = SeqModel(p.k[:, :pos].copy(), p.v[:, :pos].copy(), {b for b in p.bounds if b < cut} | {cut},
                                    ids=None if p.ids is None else p.ids[:pos])
        for other, s in self.shares_of(parent):
            self.set_share(child, other, min(s, cut))
        self.set_share(child, parent, cut)
        if p.window != -1:  # the fork moved tokens of the last block into prefix blocks
            p.lbass = limit - p.prefix
            assert p.lbass >= 0

    def _split(self, seq_id: int, pos: int, cut: int) -> None:
        """A fork at ``pos`` splits the block containing it at ``cut``, in every path through it."""
        self.seqs[seq_id].bounds.add(cut)
        for other, s in self.shares_of(seq_id):
            if s > pos:
                self.seqs[other].bounds.add(cut)

    def popn(self, seq_id: int, n: int) -> None:
        s = self.seqs[seq_id]
        left = s.length - n
        if left < self.max_share(seq_id):  # into a shared prefix: re-forked from its own prefix
            cut = left - left % PAGE_SIZE
            self._split(seq_id, left, cut)
            for other, shared in self.shares_of(seq_id):
                self.set_share(seq_id, other, min(shared, cut))
            s.bounds = {b for b in s.bounds if b < cut} | {cut}
            s.lbass, s.slid = max(s.sink - s.prefix, 0), False  # a fresh record keeping the window
            s.last_append = max(0, s.last_append - n)  # the last step's count kept
        else:  # unshared blocks are trimmed; a new last block's sink is recomputed
            prefix = s.prefix
            s.bounds = {b for b in s.bounds if b <= left}
            if s.prefix != prefix:
                s.lbass = max(s.sink - s.prefix, 0)
            s.last_append = max(0, s.last_append - n)
        s.k, s.v = s.k[:, :left], s.v[:, :left]
        s.ids = None if s.ids is None else s.ids[:left]

    def enable_window(self, seq_id: int, window: int, sink: int) -> None:
        s = self.seqs[seq_id]
        s.window, s.sink, s.lbass = window, sink, max(sink - s.prefix, 0)

    def restore(self, src: int, dst: int) -> None:
        """A checkpoint of ``src`` imported into ``dst`` (new, or empty: its blocks are kept)."""
        k, v = self.seqs[src].k.copy(), self.seqs[src].v.copy()
        if dst in self.seqs:
            self.seqs[dst].k, self.seqs[dst].v, self.seqs[dst].last_append = k, v, 0
            self.seqs[dst].ids = None
        else:
            self.seqs[dst] = SeqModel(k, v, {0}, ids=None)

    def load(self, seq_id: int, ids: List[int]) -> None:
        """A new sequence that starts on cached pages holding the tokens ``ids`` (prefix caching)."""
        s = self.seqs[seq_id]
        kv = np.stack([token_kv(t, p) for p, t in enumerate(ids)], axis=1) if ids else None
        if kv is not None:
            s.k, s.v = kv[:, :, :NUM_KV_HEADS], kv[:, :, NUM_KV_HEADS:]
        s.ids = list(ids)

    def append(self, seq_id: int, k: np.ndarray, v: np.ndarray, ids: Optional[List[int]] = None) -> None:
        """Append a step's K/V ``(layers, n, Hkv, D)`` (token ids ``ids``, None: unknown); slide a
        windowed sequence."""
        s = self.seqs[seq_id]
        s.k, s.v = np.concatenate([s.k, k], axis=1), np.concatenate([s.v, v], axis=1)
        s.ids = None if s.ids is None or ids is None else s.ids + list(ids)
        s.last_append = k.shape[1]
        if self.slides and s.window != -1 and s.length > s.window:
            keep = np.r_[0:s.sink_limit, s.length - (s.window - s.sink_limit):s.length]
            s.k, s.v, s.slid = s.k[:, keep], s.v[:, keep], True


    def tree_append(self, seq_id: int, parents: List[int], k: np.ndarray, v: np.ndarray) -> None:
        """A tree step's nodes (plain cache): appended after the sequence's tokens."""
        s = self.seqs[seq_id]
        if s.tree is None:
            s.tree, s.tree_start = [], s.length
        s.tree = s.tree + list(parents)
        self.append(seq_id, k, v)

    def commit_pop(self, seq_id: int, leaf: int) -> Tuple[int, List[int]]:
        """(tokens the commit pops, accepted path) of one sequence (leaf already validated)."""
        s = self.seqs[seq_id]
        path = tree_path(s.tree, leaf) if leaf != -1 else []
        return self.commit_span(seq_id) - len(path), path

    def commit_span(self, seq_id: int) -> int:
        """The tokens a commit of the sequence works on: its uncommitted tree, else its last step."""
        s = self.seqs[seq_id]
        return len(s.tree) if s.tree is not None else s.last_append

    def commit(self, seq_id: int, leaf: int) -> None:
        """``reference_model.commit``: keep, after the tokens before the tree, the accepted path's
        nodes; the rest is popped (``popn`` rules)."""
        s = self.seqs[seq_id]
        pop, path = self.commit_pop(seq_id, leaf)
        base = s.length - self.commit_span(seq_id)
        if base < 0:  # the last step's tokens were popped since: the commit is the pop (no moves)
            keep = np.arange(s.length - pop)
        else:
            keep = np.r_[0:base, base + np.asarray(path, dtype=np.int64)].astype(np.int64)
        k, v = s.k[:, keep], s.v[:, keep]
        self.popn(seq_id, pop)
        s = self.seqs[seq_id]
        s.k, s.v = k, v
        s.tree, s.last_append, s.ids = None, 0, None


def check_against_model(cache: rk.PagedAttentionKVCache, model: Model) -> Dict[int, tuple]:
    """The cache holds what the model says; returns the contents read with ``debug_get_kv``."""
    paging = cache._paging
    _expect(sorted(paging.seq_ids()) == sorted(model.seqs),
            f"sequences {sorted(paging.seq_ids())}, model {sorted(model.seqs)}")
    _expect(cache.get_total_sequence_length() == sum(s.length for s in model.seqs.values()), "total length")
    kv = {}
    for seq_id, s in model.seqs.items():
        _expect(cache.get_sequence_length(seq_id) == s.length,
                f"sequence {seq_id} has length {cache.get_sequence_length(seq_id)}, model {s.length}")
        starts = [b.start_pos for b in paging.trace_blocks(seq_id)]
        _expect(starts == sorted(s.bounds), f"sequence {seq_id} has blocks starting at {starts}, "
                                            f"model {sorted(s.bounds)}")
        rec = paging.sequence(seq_id)
        _expect(rec.sliding_window_size == s.window, f"sequence {seq_id} window {rec.sliding_window_size}, "
                                                     f"model {s.window}")
        if s.window != -1:
            _expect(rec.last_block_attn_sink_size == s.lbass,
                    f"sequence {seq_id} last-block sink {rec.last_block_attn_sink_size}, model {s.lbass}")
        if s.length:
            kv[seq_id] = k, v = read_kv(cache, seq_id, s.length)
            _expect(k.tobytes() == s.k.tobytes() and v.tobytes() == s.v.tobytes(),
                    f"K/V of sequence {seq_id} differ from the model")
    for a, b, shared in model.shared_pairs():  # shared prefixes are the same slots, not copies
        pa, pb = paging.position_map(a, 0, shared), paging.position_map(b, 0, shared)
        _expect(np.array_equal(pa, pb), f"sequences {a} and {b} do not share their first {shared} slots")
    return kv


# ----------------------------------------------------------------------------------- expectations

@dataclasses.dataclass(frozen=True)
class Expect:
    """What an operation must do: raise one of ``raises`` (``must_raise``) or succeed; with
    ``must_raise`` False an error in ``raises`` is also accepted. ``free_delta``: the exact change of
    the free page count on success, where the model knows it."""

    raises: Tuple[type, ...] = ()
    must_raise: bool = False
    free_delta: Optional[int] = None


def _fail(*errors: type) -> Expect:
    return Expect(tuple(errors), True)


def _is_int(x: Any) -> bool:
    return type(x) is int


def _pages(tokens: int) -> int:
    return -(-tokens // PAGE_SIZE)


# ----------------------------------------------------------------------------------- the harness

class Harness:
    """One cache plus its model; each method is one operation, checked as the module docstring says.

    Methods return True when the operation succeeded, False when it raised (as allowed).
    """

    def __init__(self, kind: str, seed: int = 0, record: bool = False) -> None:
        self.kind = kind
        self.cache = make_cache(kind)
        self.model = Model(slides=self.sliding)
        self.rng = np.random.default_rng(seed)  # K/V values
        self.errors: collections.Counter = collections.Counter()
        self.ops = 0
        self.outcomes: collections.Counter = collections.Counter()  # (operation, "ok" or error type)
        self.undecided = 0  # operations the model allowed both to succeed and to fail
        self.last_batch: Optional[List[int]] = None
        self._kv: Optional[dict] = {}  # debug_get_kv contents of the current state, when known
        self.history: Optional[list] = [] if record else None  # (method, args) of every operation
        self._ids: Optional[List[int]] = None  # the current step's token ids (prefix cache)

    @property
    def sliding(self) -> bool:
        return self.cache.config.support_sliding_window

    @property
    def chunk(self) -> int:
        """Attention chunk of layer 0 (0: not a chunked cache)."""
        return ATTENTION_CHUNK if self.kind == "chunked" else 0

    def free_pages(self) -> int:
        return self.cache.get_num_available_pages()

    # -- core
    def _run(self, what: str, expect: Expect, action: Callable[[], Any],
             apply: Optional[Callable[[Any], None]] = None) -> bool:
        self.ops += 1
        op = what.split("(")[0]
        self.undecided += bool(expect.raises) and not expect.must_raise
        before = snapshot(self.cache, self._kv)
        self._kv = None
        try:
            result = action()
        except KVCacheError as err:
            if not isinstance(err, expect.raises):
                raise Mismatch(f"{what}: unexpected {type(err).__name__}: {err}") from err
            after = snapshot(self.cache)
            assert_unchanged(before, after, what)
            self._kv = after["kv"]
            self.errors[type(err).__name__] += 1
            self.outcomes[op, type(err).__name__] += 1
            return False
        self.outcomes[op, "ok"] += 1
        if expect.must_raise:
            raise Mismatch(f"{what} succeeded; expected {' or '.join(e.__name__ for e in expect.raises)}")
        if apply is not None:
            apply(result)
        if expect.free_delta is not None:
            _expect(self.free_pages() == before["free_pages"] + expect.free_delta,
                    f"{what}: {self.free_pages()} free pages, expected "
                    f"{before['free_pages']} {expect.free_delta:+d}")
        self.check()
        return True

    def _record(self, method: str, *args: Any) -> None:
        if self.history is not None:
            self.history.append((method, args))

    def check(self) -> None:
        check_paging_invariants(self.cache)
        self._kv = check_against_model(self.cache, self.model)
        for page, entry in self.cache._paging.registered_pages():  # hold exactly their tokens' K/V
            stored = np.stack([p.numpy()[page] for p in self.cache._pages])  # (layers, 2, Hkv, ps, D)
            for j, token in enumerate(entry.tokens):
                want = token_kv(token, entry.depth * PAGE_SIZE + j).reshape(NUM_LAYERS, 2, NUM_KV_HEADS, HEAD_DIM)
                _expect(stored[:, :, :, j].tobytes() == want.tobytes(), f"registered page {page} holds other K/V")
        for slot, entry in self.cache._paging.host_pages():  # so do the pages on the host tier
            stored = np.stack([self.cache._host.read(layer, slot).view(np.float32).reshape(
                2, NUM_KV_HEADS, PAGE_SIZE, HEAD_DIM) for layer in range(NUM_LAYERS)])
            for j, token in enumerate(entry.tokens):
                want = token_kv(token, entry.depth * PAGE_SIZE + j).reshape(NUM_LAYERS, 2, NUM_KV_HEADS, HEAD_DIM)
                _expect(stored[:, :, :, j].tobytes() == want.tobytes(), f"host slot {slot} holds other K/V")

    # -- operations
    def add(self, seq_id: Any, ids: Optional[List[int]] = None) -> bool:
        """``add_sequence(seq_id)``; with prefix caching and ``ids`` (a prompt), the sequence may
        start on cached pages (the model then holds the tokens the cache says it found)."""
        self._record("add", seq_id, ids)
        if not _is_int(seq_id):
            expect = _fail(KVCacheError)
        else:  # reusing cached pages changes the available count
            expect = _fail(SequenceError) if seq_id in self.model.seqs else Expect(free_delta=None if ids else 0)

        def apply(hit: int) -> None:
            _expect(hit % PAGE_SIZE == 0 and hit <= max(len(ids or ()) - 1, 0), f"add_sequence found {hit} tokens")
            self.model.add(seq_id)
            self.model.load(seq_id, (ids or [])[:hit])
        return self._run(f"add_sequence({seq_id!r}, {ids!r})", expect, lambda: self.cache.add_sequence(seq_id, ids),
                         apply)

    def remove(self, seq_id: Any) -> bool:
        self._record("remove", seq_id)
        expect = Expect() if seq_id in self.model.seqs and _is_int(seq_id) else _fail(KVCacheError)

        def apply(_):
            self.model.remove(seq_id)
        return self._run(f"remove_sequence({seq_id!r})", expect, lambda: self.cache.remove_sequence(seq_id), apply)

    def checkpoint(self, src: Any, dst: Any) -> bool:
        """Save ``src`` (metadata and a page group per layer) and import it into ``dst``."""
        self._record("checkpoint", src, dst)
        return self._run(f"checkpoint({src!r} -> {dst!r})", self._expect_checkpoint(src, dst),
                         lambda: self._save_and_restore(src, dst), lambda _: self.model.restore(src, dst))

    def _save_and_restore(self, src: Any, dst: Any) -> None:
        cache = self.cache
        meta = cache.get_checkpoint_metadata(src)
        length = cache.get_sequence_length(src)
        groups = []
        for group in range(NUM_LAYERS):
            groups.append(tvm.runtime.empty((1, _pages(length), 2, NUM_KV_HEADS, PAGE_SIZE, HEAD_DIM), "float32"))
            cache.export_page_group(src, group, groups[-1])
        cache.prepare_import(dst, meta)
        for group in reversed(range(NUM_LAYERS)):
            cache.import_page_group(dst, group, groups[group])
        cache.finish_import(dst)

    def _expect_checkpoint(self, src: Any, dst: Any) -> Expect:
        seqs = self.model.seqs
        if not (_is_int(src) and _is_int(dst)) or src not in seqs:
            return _fail(KVCacheError)
        s = seqs[src]
        if s.window != -1 or s.tree is not None:
            return _fail(SequenceError)
        if dst in seqs:
            d = seqs[dst]
            if d.length or d.window != -1 or d.tree is not None:
                return _fail(SequenceError)
            return Expect((SequenceError, CacheFullError))  # an empty sequence forked from: refused
        if _pages(s.length) > self.free_pages():
            return _fail(CacheFullError)
        return Expect(free_delta=-_pages(s.length))

    def fork(self, parent: Any, child: Any, pos: Any) -> bool:
        self._record("fork", parent, child, pos)
        return self._run(f"fork_sequence({parent!r}, {child!r}, {pos!r})", self._expect_fork(parent, child, pos),
                         lambda: self.cache.fork_sequence(parent, child, pos),
                         lambda _: self.model.fork(parent, child, pos))

    def _expect_fork(self, parent: Any, child: Any, pos: Any) -> Expect:
        seqs = self.model.seqs
        errors = []
        if not _is_int(parent) or parent not in seqs:
            errors.append(SequenceError)
        if not _is_int(child) or child in seqs:
            errors.append(SequenceError)
        if not _is_int(pos):
            errors.append(KVCacheError)
        elif parent in seqs and not -1 <= pos <= seqs[parent].length:
            errors.append(SequenceError)
        if errors:
            return _fail(*errors)
        p = seqs[parent]
        pos = p.length if pos == -1 else pos
        if p.tree is not None:  # uncommitted token-tree nodes: no fork
            return _fail(SequenceError)
        if p.window != -1 and pos > p.sink_limit:
            return _fail(SequenceError)
        copies = int(pos % PAGE_SIZE != 0)  # a partial page is copied into a fresh page
        if copies > self.free_pages():
            return _fail(CacheFullError)
        return Expect(free_delta=-copies)

    def popn(self, seq_id: Any, n: Any) -> bool:
        self._record("popn", seq_id, n)
        return self._run(f"popn({seq_id!r}, {n!r})", self._expect_popn(seq_id, n),
                         lambda: self.cache.popn(seq_id, n), lambda _: self.model.popn(seq_id, n))

    def _expect_popn(self, seq_id: Any, n: Any, *, in_commit: bool = False) -> Expect:
        seqs = self.model.seqs
        if not _is_int(seq_id) or seq_id not in seqs or not _is_int(n) or not 0 <= n <= seqs[seq_id].length:
            return _fail(KVCacheError)
        s = seqs[seq_id]
        left, shared = s.length - n, self.model.max_share(seq_id)
        if n == 0:
            return Expect(free_delta=0)
        if s.tree is not None and not in_commit:  # popn: not with uncommitted token-tree nodes
            return _fail(SequenceError)
        if left >= shared:  # prefix caching: a page shared by cached-prefix reuse is copied
            cow = self.kind == "prefix" and left % PAGE_SIZE and self.free_pages() == 0
            return Expect((CacheFullError,) if cow else ())
        if s.tree is not None:  # the re-fork is a fork: not with uncommitted token-tree nodes
            return _fail(SequenceError)
        # Re-fork from the sequence's own prefix (inside prefix blocks: no sink check)
        if left % PAGE_SIZE and self.free_pages() == 0:
            if s.slid:
                return Expect((CacheFullError,))
            if s.length == shared:  # nothing unshared to free: no page for the partial copy
                return _fail(CacheFullError)
        return Expect()

    def enable_window(self, seq_id: Any, window: Any, sink: Any) -> bool:
        self._record("enable_window", seq_id, window, sink)
        return self._run(f"enable_sliding_window_for_seq({seq_id!r}, {window!r}, {sink!r})",
                         self._expect_window(seq_id, window, sink),
                         lambda: self.cache.enable_sliding_window_for_seq(seq_id, window, sink),
                         lambda _: self.model.enable_window(seq_id, window, sink))

    def _expect_window(self, seq_id: Any, window: Any, sink: Any) -> Expect:
        seqs = self.model.seqs
        if not (self.sliding or self.chunk) or not all(map(_is_int, (seq_id, window, sink))):
            return _fail(KVCacheError)
        if seq_id not in seqs or not 0 <= sink < window or seqs[seq_id].window != -1:
            return _fail(SequenceError)
        if self.sliding and window < seqs[seq_id].prefix:  # its prefix blocks cannot slide: every append would fail
            return _fail(SequenceError)
        return Expect(free_delta=0)

    def step(self, seq_ids: List[Any], lengths: List[Any], interrupt: Optional[str] = None,
             parents: Optional[List[Any]] = None) -> bool:
        """A forward step: begin_forward, attention_with_fused_qkv on every layer, end_forward.

        ``interrupt``: after begin_forward, try an operation not allowed during a step ("remove",
        "fork", "popn", "begin"); it must raise `ForwardError` and change nothing.
        ``parents``: the step's ``token_tree_parent_ptr`` (a token-tree step; plain cache only).
        """
        self._record("step", list(seq_ids), list(lengths), interrupt, parents)
        expect = self._expect_step(seq_ids, lengths, parents)

        def apply(_):
            self._attend_and_end(seq_ids, lengths, interrupt, parents)

        what = "step" if parents is None else "tree_step"
        ids = self._step_ids(seq_ids, lengths) if self.kind == "prefix" and parents is None else None
        self._ids = ids
        ok = self._run(f"{what}({seq_ids!r}, {lengths!r}{'' if parents is None else ', ' + repr(parents)})",
                       expect, lambda: self.cache.begin_forward(seq_ids, lengths, parents, token_ids=ids), apply)
        if ok:
            self.last_batch = list(seq_ids)
        return ok

    def _step_ids(self, seq_ids: List[Any], lengths: List[Any]) -> Optional[List[int]]:
        """Token ids of a step (prefix cache): a sequence on a stem continues it, others draw."""
        if not all(map(_is_int, lengths)) or any(n < 1 for n in lengths):
            return None
        ids = []
        for seq_id, n in zip(seq_ids, lengths):
            s = self.model.seqs.get(seq_id)
            known = list(s.ids) if s is not None and s.ids is not None else []
            stem = next((st for st in STEMS if tuple(known) == st[:len(known)]), ())
            new = list(stem[len(known):len(known) + n])
            ids += new + self.rng.integers(0, 16, n - len(new)).tolist()
        return ids

    def _tree_error(self, seq_ids: List[Any], lengths: List[Any], parents: List[Any]) -> bool:
        """Whether a tree step's trees are rejected (``ForwardError``): windows, or bad parents."""
        if self.sliding or self.chunk or not all(map(_is_int, parents)) or len(parents) != sum(lengths):
            return True
        off = 0
        for seq_id, n in zip(seq_ids, lengths):
            s = self.model.seqs.get(seq_id)
            old = len(s.tree) if s is not None and s.tree is not None else 0
            if old + n > 256 or any(not -1 <= p < old + i for i, p in enumerate(parents[off:off + n])):
                return True
            off += n
        return False

    def _expect_step(self, seq_ids: List[Any], lengths: List[Any], parents: Optional[List[Any]] = None) -> Expect:
        seqs = self.model.seqs
        errors = []
        if len(seq_ids) != len(lengths) or not seq_ids:
            errors.append(ForwardError)
        if not all(map(_is_int, lengths)):
            errors.append(KVCacheError)
        elif any(n < 1 for n in lengths) or sum(lengths) > CHUNK:
            errors.append(ForwardError)
        if any(not _is_int(s) or s not in seqs for s in seq_ids) or len(set(seq_ids)) != len(seq_ids):
            errors.append(SequenceError)
        if parents is None and any(_is_int(s) and s in seqs and seqs[s].tree is not None for s in seq_ids):
            errors.append(SequenceError)  # a step without a tree needs the trees committed
        if parents is not None:
            if not all(map(_is_int, lengths)) or len(seq_ids) != len(lengths):
                errors.append(ForwardError)
            elif self._tree_error(seq_ids, lengths, parents):
                errors.append(ForwardError)
        if errors:
            return _fail(*errors)
        exact, need, most, window_error = True, 0, 0, False
        for seq_id, n in zip(seq_ids, lengths):
            s = seqs[seq_id]
            slides = self.sliding and s.window != -1 and s.length + n > s.window
            if s.slid or slides:  # pages depend on the window offset, or the slide frees some
                exact = False
                most += _pages(n)
                window_error |= slides and s.window < s.sink_limit
            else:
                add = _pages(s.length + n) - _pages(s.length)  # last blocks start on page boundaries
                need += add
                most += add
        free = self.free_pages()
        if exact:
            return _fail(CacheFullError) if need > free else Expect(free_delta=-need)
        raises = ((SequenceError,) if window_error else ()) + ((CacheFullError,) if most > free else ())
        return Expect(raises, must_raise=window_error)

    def _attend_and_end(self, seq_ids: List[int], lengths: List[int], interrupt: Optional[str],
                        parents: Optional[List[int]] = None) -> None:
        cache, model = self.cache, self.model
        if interrupt is not None:
            self._interrupt(interrupt, seq_ids[0])
        n = sum(lengths)
        qkv = self.rng.standard_normal((NUM_LAYERS, n, NUM_QO_HEADS + 2 * NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)
        if self.cache.config.kv_dtype is not None:  # K / V on the 8-bit grid times the scales: stored exactly
            hq, hkv = NUM_QO_HEADS, NUM_KV_HEADS
            for part, scale in ((slice(hq, hq + hkv), FP8_SCALES[0]), (slice(hq + hkv, None), FP8_SCALES[1])):
                grid = qkv[:, :, part] * np.exp2(self.rng.integers(-3, 3, qkv[:, :, part].shape))
                qkv[:, :, part] = grid.astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale
        ids = self._ids if parents is None else None
        if ids is not None:  # prefix cache: K / V a function of the token and its position
            rows = []
            for seq_id, m in zip(seq_ids, lengths):
                start = model.seqs[seq_id].length
                rows += [token_kv(t, start + i) for i, t in enumerate(ids[len(rows):len(rows) + m])]
            qkv[:, :, NUM_QO_HEADS:] = np.stack(rows, axis=1)
        for layer in range(NUM_LAYERS):
            o = tvm.runtime.tensor(np.full((n, NUM_QO_HEADS, HEAD_DIM), np.nan, np.float32))
            cache.attention_with_fused_qkv(layer, tvm.runtime.tensor(qkv[layer]), o, SM_SCALE)
            self._check_attention(seq_ids, lengths, qkv[layer], layer, o.numpy(), parents)
        cache.end_forward()
        hq, hkv = NUM_QO_HEADS, NUM_KV_HEADS
        off = 0
        for seq_id, m in zip(seq_ids, lengths):
            rows = qkv[:, off:off + m]
            if parents is None:
                model.append(seq_id, rows[:, :, hq:hq + hkv], rows[:, :, hq + hkv:],
                             None if ids is None else ids[off:off + m])
            else:
                model.tree_append(seq_id, parents[off:off + m], rows[:, :, hq:hq + hkv], rows[:, :, hq + hkv:])
            off += m

    def _check_attention(self, seq_ids, lengths, qkv: np.ndarray, layer: int, o: np.ndarray,
                         parents: Optional[List[int]] = None) -> None:
        """Each new token attends causally over its sequence's kept tokens and the step's; a token-tree
        node over the tokens before its tree, its ancestors and itself."""
        hq, hkv = NUM_QO_HEADS, NUM_KV_HEADS
        off = 0
        for seq_id, m in zip(seq_ids, lengths):
            s = self.model.seqs[seq_id]
            rows = qkv[off:off + m]
            k = np.concatenate([s.k[layer], rows[:, hq:hq + hkv]])
            v = np.concatenate([s.v[layer], rows[:, hq + hkv:]])
            if parents is None:
                expected = attend(rows[:, :hq], k, v, SM_SCALE, causal_offset=s.length,
                                  chunk=self.chunk if layer == 0 else 0)[0]
            else:
                old = s.tree or []
                start = s.tree_start if s.tree is not None else s.length
                vis = tree_visible(old + list(parents[off:off + m]))[len(old):]
                expected = np.stack([
                    attend(rows[i:i + 1, :hq], k[keys], v[keys], SM_SCALE, causal_offset=None)[0][0]
                    for i, keys in enumerate(np.r_[0:start, start + np.nonzero(row)[0]] for row in vis)])
            if not np.allclose(o[off:off + m], expected, rtol=1e-4, atol=1e-4):
                raise Mismatch(f"attention output of sequence {seq_id} (layer {layer}) differs from the "
                               f"reference by {np.nanmax(np.abs(o[off:off + m] - expected)):.3g}")
            off += m

    def _interrupt(self, what: str, seq_id: int) -> None:
        """An operation during the step must raise ForwardError and change nothing."""
        actions = {
            "remove": lambda: self.cache.remove_sequence(seq_id),
            "fork": lambda: self.cache.fork_sequence(seq_id, max(self.model.seqs) + 1, -1),
            "popn": lambda: self.cache.popn(seq_id, 0),
            "begin": lambda: self.cache.begin_forward([seq_id], [1]),
        }
        before = snapshot(self.cache)
        try:
            actions[what]()
        except ForwardError:
            assert_unchanged(before, snapshot(self.cache), f"{what} during a step")
            self.errors["ForwardError"] += 1
            return
        raise Mismatch(f"{what} during a step did not raise ForwardError")

    def commit(self, seq_ids: List[Any], leaves: List[Any]) -> bool:
        """``commit_accepted_token_tree_nodes(seq_ids, leaves)``."""
        self._record("commit", list(seq_ids), list(leaves))

        def apply(_):
            for seq_id, leaf in zip(seq_ids, leaves):
                self.model.commit(seq_id, leaf)
        return self._run(f"commit_accepted_token_tree_nodes({seq_ids!r}, {leaves!r})",
                         self._expect_commit(seq_ids, leaves),
                         lambda: self.cache.commit_accepted_token_tree_nodes(seq_ids, leaves), apply)

    def _expect_commit(self, seq_ids: List[Any], leaves: List[Any]) -> Expect:
        """Argument and leaf checks first (all `SequenceError`, nothing changes), then every
        sequence pops what the commit drops (``popn``'s rules, before its tree is cleared)."""
        seqs = self.model.seqs
        if not all(map(_is_int, list(seq_ids) + list(leaves))):
            return _fail(KVCacheError)
        if len(seq_ids) != len(leaves) or len(set(seq_ids)) != len(seq_ids):
            return _fail(SequenceError)
        for seq_id, leaf in zip(seq_ids, leaves):
            s = seqs.get(seq_id)
            if s is None or leaf < -1 or (leaf != -1 and (s.tree is None or leaf >= len(s.tree))):
                return _fail(SequenceError)
        expects, independent = [], True
        for seq_id, leaf in zip(seq_ids, leaves):
            s = seqs[seq_id]
            pop, path = self.model.commit_pop(seq_id, leaf)
            if pop > s.length:
                return _fail(SequenceError)  # whatever the other sequences do
            if s.length < self.model.commit_span(seq_id) and any(p != j for j, p in enumerate(path)):
                return _fail(KVCacheError)  # moves from positions popped since: out of range
            e = self._expect_popn(seq_id, pop, in_commit=True)
            independent &= pop == 0 or s.length - pop >= self.model.max_share(seq_id)
            expects.append(e)
        if len(expects) == 1:
            return dataclasses.replace(expects[0], free_delta=None)
        raises = tuple({err for e in expects for err in e.raises})
        if independent:  # trims only: each pop as on its own
            return Expect(raises, must_raise=any(e.must_raise for e in expects))
        return Expect(raises + (SequenceError,) * (not raises))  # re-forks interact: not predicted exactly

    def repeat_decode(self) -> bool:
        """The last batch again with one token each (the decode fast path of the plain cache)."""
        batch = [s for s in (self.last_batch or []) if s in self.model.seqs]
        if not batch:
            return False
        return self.step(batch, [1] * len(batch))

    def remove_all(self, order: Iterable[int]) -> None:
        """Remove every sequence; the cache must be empty with every page free."""
        for seq_id in order:
            self.remove(seq_id)
        _expect(self.cache.empty(), "empty() is False after removing every sequence")
        _expect(self.free_pages() == self.cache.config.num_total_pages, "pages still in use after removing all")


# ----------------------------------------------------------------------------------- the operation mix

class Draw:
    """Random choices for the operation mix; `NumpyDraw` and the property test's hypothesis adapter."""

    def integer(self, lo: int, hi: int) -> int:  # inclusive
        raise NotImplementedError

    def choice(self, options: Sequence[Any]) -> Any:
        return options[self.integer(0, len(options) - 1)]

    def chance(self, p: float) -> bool:
        return self.integer(0, 999) < p * 1000


class NumpyDraw(Draw):
    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng

    def integer(self, lo: int, hi: int) -> int:
        return int(self.rng.integers(lo, hi + 1))


ID_RANGE = 8  # sequence ids 0..7: existing and unknown ids are both drawn often
UNKNOWN_IDS = (-7, 99, 2 ** 40)


def draw_id(draw: Draw, h: Harness, existing: float = 0.7) -> int:
    live = sorted(h.model.seqs)
    if live and draw.chance(existing):
        return draw.choice(live)
    return draw.integer(0, ID_RANGE - 1) if draw.chance(0.9) else draw.choice(UNKNOWN_IDS)


def draw_new_id(draw: Draw, h: Harness) -> int:
    free = [i for i in range(ID_RANGE) if i not in h.model.seqs]
    return draw.choice(free) if free and draw.chance(0.85) else draw_id(draw, h)


def draw_position(draw: Draw, length: int) -> int:
    """-1, 0, mid-page, a page boundary, the full length, anything, or out of range."""
    boundary = (draw.integer(0, length) // PAGE_SIZE) * PAGE_SIZE
    mid = min(length, boundary + draw.integer(1, PAGE_SIZE - 1))
    return draw.choice([-1, 0, mid, boundary, length, draw.integer(0, length), -2, length + 1])


def draw_length(draw: Draw, length: int) -> int:
    """An append length: decode, to the page boundary, a page or two, or long."""
    to_boundary = PAGE_SIZE - length % PAGE_SIZE
    return draw.choice([1, 1, 2, to_boundary, to_boundary + PAGE_SIZE, draw.integer(1, 12), draw.integer(1, CHUNK)])


def op_add(h: Harness, draw: Draw) -> None:
    ids = None
    if h.kind == "prefix" and draw.chance(0.8):  # a prompt: part of a stem, then a few other ids
        stem = draw.choice(STEMS)
        ids = list(stem[:draw.integer(1, len(stem))]) + [draw.integer(0, 15) for _ in range(draw.integer(0, 3))]
    h.add(draw_new_id(draw, h), ids)


def op_remove(h: Harness, draw: Draw) -> None:
    h.remove(draw_id(draw, h, existing=0.9))


def op_fork(h: Harness, draw: Draw) -> None:
    parent = draw_id(draw, h, existing=0.9)
    length = h.model.seqs[parent].length if parent in h.model.seqs else 5
    h.fork(parent, draw_new_id(draw, h), draw_position(draw, length))


def op_checkpoint(h: Harness, draw: Draw) -> None:
    if h.cache.config.kv_dtype is not None:  # refused (NotImplementedError; tests/test_fp8_cache.py)
        return
    h.checkpoint(draw_id(draw, h, existing=0.9), draw_new_id(draw, h))


def op_popn(h: Harness, draw: Draw) -> None:
    seq_id = draw_id(draw, h, existing=0.9)
    length = h.model.seqs[seq_id].length if seq_id in h.model.seqs else 3
    to_boundary = length % PAGE_SIZE or PAGE_SIZE
    h.popn(seq_id, draw.choice([0, 1, length, to_boundary, draw.integer(0, length), length + 1, -1]))


def op_step(h: Harness, draw: Draw) -> None:
    live = sorted(h.model.seqs)
    if not live:
        h.step([draw_id(draw, h)], [1])
        return
    size = draw.integer(1, len(live))
    start = draw.integer(0, len(live) - 1)
    batch = [live[(start + i) % len(live)] for i in range(size)]
    if draw.chance(0.5):
        batch.reverse()
    lengths = [draw_length(draw, h.model.seqs[s].length) for s in batch]
    h.step(batch, lengths, interrupt=draw.choice(["remove", "fork", "popn", "begin"]) if draw.chance(0.05) else None)


def draw_tree(draw: Draw, old: int, n: int) -> List[int]:
    """Parents of ``n`` new nodes after ``old`` earlier ones: chains, stars, random trees, forests."""
    shape = draw.choice(["chain", "star", "random", "random", "forest"])
    out = []
    for i in range(old, old + n):
        if i == 0:
            out.append(-1)
        elif shape == "chain":
            out.append(i - 1)
        elif shape == "star":
            out.append(max(old - 1, 0) if i > old or old else -1)
        elif shape == "forest" and draw.chance(0.3):
            out.append(-1)
        else:
            out.append(draw.integer(max(old - 1, 0), i - 1))
    return out


def op_tree_step(h: Harness, draw: Draw) -> None:
    """A forward step with token trees (speculative decoding), valid or not; on the sliding cache
    trees are rejected (``ForwardError``), so it is drawn there rarely."""
    live = sorted(h.model.seqs)
    if not live or ((h.sliding or h.chunk) and not draw.chance(0.1)):
        return
    size = draw.integer(1, min(len(live), 3))
    start = draw.integer(0, len(live) - 1)
    batch = [live[(start + i) % len(live)] for i in range(size)]
    lengths = [draw.choice([1, 2, 3, draw.integer(1, 8)]) for _ in batch]
    parents: List[Any] = []
    for seq_id, n in zip(batch, lengths):
        tree = h.model.seqs[seq_id].tree
        parents += draw_tree(draw, len(tree) if tree is not None else 0, n)
    if draw.chance(0.1):  # invalid: a node its own parent, a parent below -1, too few entries, unknown id
        i = draw.integer(0, len(parents) - 1)
        bad = draw.choice(["self", "low", "short", "unknown", "dup"])
        if bad == "self":
            parents[i] = i + 50
        elif bad == "low":
            parents[i] = -2
        elif bad == "short":
            parents.pop()
        elif bad == "unknown":
            batch[0] = draw.choice(UNKNOWN_IDS)
        else:
            batch, lengths, parents = batch + batch[:1], lengths + [1], parents + [-1]
    h.step(batch, lengths, parents=parents)


def op_commit(h: Harness, draw: Draw) -> None:
    """commit_accepted_token_tree_nodes: mostly the sequences with uncommitted trees, a leaf among
    the last step's nodes (or -1: accept nothing); sometimes invalid."""
    seqs = h.model.seqs
    pending = sorted(s for s, m in seqs.items() if m.tree is not None)
    if pending and draw.chance(0.85):
        ids = [s for s in pending if draw.chance(0.7)] or pending[:1]
    else:
        ids = [draw_id(draw, h)]  # often a committed sequence: leaf -1 pops its last step (popn rules)
    leaves: List[Any] = []
    for seq_id in ids:
        m = seqs.get(seq_id)
        last = m.last_append if m is not None and m.tree is not None else 0
        leaves.append(draw.integer(-1, last - 1) if last and draw.chance(0.85) else -1)
    if draw.chance(0.15):
        bad = draw.choice(["unknown", "range", "neg", "dup", "lengths", "float", "committed"])
        i = draw.integer(0, len(ids) - 1)
        if bad == "unknown":
            ids[i] = draw.choice(UNKNOWN_IDS)
        elif bad == "range":
            m = seqs.get(ids[i])
            leaves[i] = len(m.tree) if m is not None and m.tree is not None else draw.integer(0, 3)
        elif bad == "neg":
            leaves[i] = draw.choice([-2, -5])
        elif bad == "dup":
            ids, leaves = ids + [ids[i]], leaves + [-1]
        elif bad == "lengths":
            leaves = leaves + [0] if draw.chance(0.5) else leaves[:-1]
        elif bad == "float":
            leaves[i] = 0.0
        else:  # a committed sequence with a leaf: "already committed"
            done = [s for s in seqs if seqs[s].tree is None]
            if done:
                ids[i], leaves[i] = draw.choice(done), 0
                if len(set(ids)) != len(ids):
                    return
    h.commit(ids, leaves)


def op_repeat_decode(h: Harness, draw: Draw) -> None:
    h.repeat_decode()


def op_enable_window(h: Harness, draw: Draw) -> None:
    window = draw.integer(1, 24)
    sink = draw.choice([0, 0, 1, draw.integer(0, window - 1), PAGE_SIZE, window])  # window: invalid
    h.enable_window(draw_id(draw, h, existing=0.9), window, sink)


def op_invalid(h: Harness, draw: Draw) -> None:
    """Requests that are wrong whatever the state (they must raise and change nothing)."""
    live = sorted(h.model.seqs) or [0]
    a = draw.choice(live)
    cases = [
        lambda: h.step([], []),
        lambda: h.step([a], [1, 1]),
        lambda: h.step([a, a], [1, 1]),
        lambda: h.step([a], [0]),
        lambda: h.step([a], [-2]),
        lambda: h.step([a], [CHUNK + 1]),
        lambda: h.step(live + [draw.choice(UNKNOWN_IDS)], [1] * (len(live) + 1)),
        lambda: h.step([a], [1.5]),
        lambda: h.add(2.5),
        lambda: h.add(True),
        lambda: h.remove(draw.choice(UNKNOWN_IDS)),
        lambda: h.fork(draw.choice(UNKNOWN_IDS), ID_RANGE + 1, -1),
        lambda: h.fork(a, a, 0),
        lambda: h.fork(a, ID_RANGE + 1, 1.0),
        lambda: h.popn(a, 0.5),
        lambda: h.popn(draw.choice(UNKNOWN_IDS), 1),
        lambda: h.enable_window(a, 0, 0),
        lambda: h.enable_window(a, 4, -1),
        lambda: h.enable_window(draw.choice(UNKNOWN_IDS), 8, 2),
    ]
    draw.choice(cases)()


#: The soak's operation mix: (operation, weight).
OPERATIONS: Tuple[Tuple[Callable[[Harness, Draw], None], int], ...] = (
    (op_add, 10), (op_remove, 10), (op_fork, 12), (op_popn, 10), (op_step, 16), (op_repeat_decode, 6),
    (op_enable_window, 5), (op_invalid, 6), (op_tree_step, 8), (op_commit, 8), (op_checkpoint, 5),
)


def random_op(h: Harness, draw: Draw) -> None:
    """One operation of the mix, drawn by weight."""
    total = sum(w for _, w in OPERATIONS)
    r = draw.integer(0, total - 1)
    for op, weight in OPERATIONS:
        if r < weight:
            op(h, draw)
            return
        r -= weight
