"""The state machine's model (``state_machine_model``): what the cache should hold per sequence (K/V as
stored, block starts, window and sink, token tree) and which prefixes sequences share, and the check
that the cache holds it. The rules it follows are in ``state_machine_model``'s docstring.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import numpy as np

import relax_kvcache as rk
from reference_model import tree_path
from sm_cache import HEAD_DIM, NUM_KV_HEADS, NUM_LAYERS, PAGE_SIZE, ensure, read_kv, token_kv


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
    ensure(sorted(paging.seq_ids()) == sorted(model.seqs),
            f"sequences {sorted(paging.seq_ids())}, model {sorted(model.seqs)}")
    ensure(cache.get_total_sequence_length() == sum(s.length for s in model.seqs.values()), "total length")
    kv = {}
    for seq_id, s in model.seqs.items():
        ensure(cache.get_sequence_length(seq_id) == s.length,
                f"sequence {seq_id} has length {cache.get_sequence_length(seq_id)}, model {s.length}")
        starts = [b.start_pos for b in paging.trace_blocks(seq_id)]
        ensure(starts == sorted(s.bounds), f"sequence {seq_id} has blocks starting at {starts}, "
                                            f"model {sorted(s.bounds)}")
        rec = paging.sequence(seq_id)
        ensure(rec.sliding_window_size == s.window, f"sequence {seq_id} window {rec.sliding_window_size}, "
                                                     f"model {s.window}")
        if s.window != -1:
            ensure(rec.last_block_attn_sink_size == s.lbass,
                    f"sequence {seq_id} last-block sink {rec.last_block_attn_sink_size}, model {s.lbass}")
        if s.length:
            kv[seq_id] = k, v = read_kv(cache, seq_id, s.length)
            ensure(k.tobytes() == s.k.tobytes() and v.tobytes() == s.v.tobytes(),
                    f"K/V of sequence {seq_id} differ from the model")
    for a, b, shared in model.shared_pairs():  # shared prefixes are the same slots, not copies
        pa, pb = paging.position_map(a, 0, shared), paging.position_map(b, 0, shared)
        ensure(np.array_equal(pa, pb), f"sequences {a} and {b} do not share their first {shared} slots")
    return kv
