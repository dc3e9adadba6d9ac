"""Float64 numpy models of what a paged KV cache holds and returns: the tests' and benchmarks' reference.

* :class:`CacheModel` (with :func:`rope`, :func:`longrope`, :func:`attend` and the token-tree
  helpers) is written independently of ``relax_kvcache.reference``; the differential tests, the
  state machine (``state_machine_model``) and the GPU LongRoPE check use it.
* :class:`ReferenceCache` keeps RoPE positions per token and masks attention by them (attention
  from :func:`relax_kvcache.reference.attention`); the cache tests and the workloads of ``tests/test_workloads.py`` use it.
* :class:`MLAModel` and :class:`MLAWeights`: DeepSeek's multi-head latent attention.

:class:`CacheModel` keeps every sequence's K/V as the
cache should store them (K rotated in RoPE NORMAL mode, raw otherwise), the fork ancestry of each
sequence (to aim forks / pops into shared prefixes) and computes expected attention outputs in
float64.

Sliding windows, modelled as TVM's own test suite does:

* per-sequence windows with attention sinks (``enable_window``): a step attends over the kept
  tokens before the step plus the step's tokens (causal); afterwards a sequence longer than its
  window keeps its first ``sink`` tokens and its last ``window - sink`` ones. RoPE positions are
  indices in the kept sequence (StreamingLLM style).
* per-layer windows (``layer_windows[layer] = W > 0``, AttnKind.MHA_SLIDING): the query at
  absolute position p sees keys at positions p - W < j <= p.
* chunked local layers (``layer_chunks[layer] = C > 0``, AttnKind.MHA_CHUNKED_LOCAL): the query
  at absolute position p sees keys of its own chunk, C * floor(p / C) <= j <= p.

Token trees (speculative decoding, ``tree_step`` / ``commit``): a sequence's uncommitted tree
nodes follow its committed prefix in the cache, in the order they were appended (over one or
several steps). A node sits at RoPE position (tree start) + (its depth) and sees the committed
prefix, its ancestors and itself. A commit keeps the committed prefix followed by the accepted
path's nodes (indices in the whole uncommitted tree, all its steps); leaf -1 drops the tree.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from relax_kvcache.reference import attention


def rope(x: np.ndarray, positions: np.ndarray, theta: float, scale: float,
         rotary_dim: Optional[int] = None, interleaved: bool = False) -> np.ndarray:
    """Rotate-half RoPE (TVM's convention: angle = pos * scale / theta^(2i/d)) of x (n, h, d);
    with ``rotary_dim`` only the first ``rotary_dim`` features (``d`` = it), the rest as given;
    ``interleaved`` (GPT-J): pair i is features (2i, 2i + 1) instead of (i, i + d/2)."""
    x = np.asarray(x, np.float64)
    if rotary_dim is not None and rotary_dim < x.shape[-1]:
        return np.concatenate([rope(x[..., :rotary_dim], positions, theta, scale, interleaved=interleaved),
                               x[..., rotary_dim:]], axis=-1)
    if interleaved:  # gather the pairs into halves, rotate, scatter back
        d = x.shape[-1]
        order = np.r_[0:d:2, 1:d:2]
        out = np.empty_like(x)
        out[..., order] = rope(x[..., order], positions, theta, scale)
        return out
    d = x.shape[-1]
    inv_freq = scale / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.asarray(positions, np.float64)[:, None] * inv_freq[None, :]
    ang = np.concatenate([ang, ang], axis=-1)[:, None, :]
    rotated = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], axis=-1)
    return x * np.cos(ang) + rotated * np.sin(ang)


def longrope(x: np.ndarray, positions: np.ndarray, theta: float, scale: float, factors: Sequence[float],
             original: int, attention_factor: float) -> np.ndarray:
    """LongRoPE (Phi-3, TVM's factor layout) of x (n, h, d): frequency i of a token at position
    p is ``p * scale / (factor * theta^(2i/d))``, factor the long one (``factors[i]``) when
    ``p >= original``, else the short one (``factors[d/2 + i]``); cos / sin times
    ``attention_factor``. Fewer factors than features: a partial rotary dim (the rest as given)."""
    x = np.asarray(x, np.float64)
    if len(factors) < x.shape[-1]:
        r = len(factors)
        return np.concatenate([longrope(x[..., :r], positions, theta, scale, factors, original, attention_factor),
                               x[..., r:]], axis=-1)
    d = x.shape[-1]
    factors = np.asarray(factors, np.float64).reshape(2, d // 2)
    pos = np.asarray(positions, np.float64)
    chosen = np.where((pos >= original)[:, None], factors[0][None, :], factors[1][None, :])
    ang = pos[:, None] * scale / (chosen * theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    ang = np.concatenate([ang, ang], axis=-1)[:, None, :]
    rotated = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], axis=-1)
    return attention_factor * (x * np.cos(ang) + rotated * np.sin(ang))


def attend(q, k, v, sm_scale: float, *, causal_offset: Optional[int], window: int = 0, chunk: int = 0
           ) -> Tuple[np.ndarray, np.ndarray]:
    """q (n, Hq, d) over k/v (m, Hkv, d), GQA by contiguous groups.

    ``causal_offset``: query i sees keys j <= causal_offset + i (None: all keys).
    ``window`` > 0 (with ``causal_offset``): query i sees only keys j > causal_offset + i - window.
    ``chunk`` > 0 (with ``causal_offset``): query i sees only keys j with j // chunk equal to
    (causal_offset + i) // chunk.
    Returns o (n, Hq, d) and the base-2 LSE (n, Hq); no visible key: o = 0, lse = -inf.
    """
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    n, hq, _ = q.shape
    m, hkv, _ = k.shape
    g = hq // hkv
    s = np.einsum("nhd,mhd->hnm", q, np.repeat(k, g, axis=1)) * sm_scale
    if causal_offset is not None:
        vis = np.arange(m)[None, :] <= causal_offset + np.arange(n)[:, None]
        if window > 0:
            vis &= np.arange(m)[None, :] > causal_offset + np.arange(n)[:, None] - window
        if chunk > 0:
            vis &= np.arange(m)[None, :] // chunk == (causal_offset + np.arange(n)[:, None]) // chunk
        s = np.where(vis[None], s, -np.inf)
    mx = s.max(axis=-1, keepdims=True, initial=-np.inf)
    mx_safe = np.where(np.isfinite(mx), mx, 0.0)
    p = np.exp(s - mx_safe)
    den = p.sum(axis=-1, keepdims=True)
    o = np.einsum("hnm,mhd->nhd", p / np.where(den > 0, den, 1.0), np.repeat(v, g, axis=1))
    with np.errstate(divide="ignore"):
        lse = np.where(den[..., 0] > 0, (np.log(np.where(den[..., 0] > 0, den[..., 0], 1.0))
                                        + mx_safe[..., 0]) / np.log(2.0), -np.inf)
    return o, lse.T


@dataclasses.dataclass
class SeqModel:
    k: np.ndarray  # (L, len, Hkv, D) as stored
    v: np.ndarray
    shared: int = 0  # length of the prefix inherited by fork (possibly shared with others)
    #: parent pointers of the uncommitted token tree (accumulated over steps), None when committed
    tree: Optional[List[int]] = None
    tree_start: int = 0  # position of the uncommitted tree's roots (committed prefix length)
    last_append: int = 0  # tokens appended by the sequence's last step

    @property
    def length(self) -> int:
        return self.k.shape[1]


class CacheModel:
    """Expected contents and attention outputs of a cache."""

    def __init__(self, num_layers, num_qo_heads, num_kv_heads, head_dim, rope_mode, rope_theta,
                 rope_scale) -> None:
        self.L, self.hq, self.hkv, self.d = num_layers, num_qo_heads, num_kv_heads, head_dim
        self.rope_mode, self.theta, self.scale = rope_mode, rope_theta, rope_scale
        self.seqs: Dict[int, SeqModel] = {}
        self.windows: Dict[int, Tuple[int, int]] = {}  # seq -> (sliding window, attention sink)
        self.layer_windows: List[int] = [0] * num_layers  # > 0: MHA_SLIDING window of the layer
        self.layer_chunks: List[int] = [0] * num_layers  # > 0: MHA_CHUNKED_LOCAL chunk of the layer
        #: (x, positions) -> rotated x; replace for other RoPE variants (e.g. ``longrope``)
        self.rope = lambda x, positions: rope(x, positions, self.theta, self.scale)

    # -- structure
    def add(self, seq_id: int) -> None:
        z = np.zeros((self.L, 0, self.hkv, self.d))
        self.seqs[seq_id] = SeqModel(z, z.copy())

    def remove(self, seq_id: int) -> None:
        del self.seqs[seq_id]
        self.windows.pop(seq_id, None)

    def enable_window(self, seq_id: int, window: int, sink: int) -> None:
        assert seq_id in self.seqs and seq_id not in self.windows and 0 <= sink < window
        self.windows[seq_id] = (window, sink)

    def slide(self, seq_id: int) -> None:
        """Apply the sequence's window (after a step): keep sink + most recent tokens."""
        if seq_id not in self.windows:
            return
        window, sink = self.windows[seq_id]
        s = self.seqs[seq_id]
        if s.length <= window:
            return
        keep = np.r_[0:sink, s.length - (window - sink):s.length]
        s.k, s.v = s.k[:, keep], s.v[:, keep]
        s.shared = min(s.shared, sink)

    def fork(self, parent: int, child: int, pos: int) -> None:
        p = self.seqs[parent]
        end = p.length if pos == -1 else pos
        self.seqs[child] = SeqModel(p.k[:, :end].copy(), p.v[:, :end].copy(), shared=end)

    def popn(self, seq_id: int, n: int) -> None:
        s = self.seqs[seq_id]
        keep = s.length - n
        s.k, s.v = s.k[:, :keep], s.v[:, :keep]
        s.shared = min(s.shared, keep)
        s.last_append = max(0, s.last_append - n)

    def clear(self) -> None:
        self.seqs.clear()
        self.windows.clear()

    def length(self, seq_id: int) -> int:
        return self.seqs[seq_id].length

    def total_length(self) -> int:
        return sum(s.length for s in self.seqs.values())

    # -- forward
    def step(self, batch: Sequence[Tuple[int, int]], qkv_layers: List[np.ndarray], sm_scale: float
             ) -> List[np.ndarray]:
        """Append the batch's K/V; expected ``attention_with_fused_qkv`` output per layer."""
        hq, hkv = self.hq, self.hkv
        starts, off = [], 0
        for seq_id, n in batch:
            s = self.seqs[seq_id]
            assert s.tree is None, f"sequence {seq_id} has an uncommitted token tree"
            s.last_append = n
            starts.append(s.length)
            new = np.stack([q[off:off + n] for q in qkv_layers]).astype(np.float64)
            k_new = new[:, :, hq:hq + hkv]
            if self.rope_mode == 1:
                pos = np.arange(s.length, s.length + n)
                k_new = np.stack([self.rope(k_new[l], pos) for l in range(self.L)])
            s.k = np.concatenate([s.k, k_new], axis=1)
            s.v = np.concatenate([s.v, new[:, :, hq + hkv:]], axis=1)
            off += n
        outs = []
        for layer, qkv in enumerate(qkv_layers):
            out = np.zeros((qkv.shape[0], hq, self.d))
            off = 0
            for (seq_id, n), start in zip(batch, starts):
                q, k = self.query(qkv[off:off + n], start), self.seqs[seq_id].k[layer]
                if self.rope_mode == 2:
                    k = self.rope(k, np.arange(k.shape[0]))
                out[off:off + n] = attend(q, k, self.seqs[seq_id].v[layer], sm_scale,
                                          causal_offset=start, window=self.layer_windows[layer],
                                          chunk=self.layer_chunks[layer])[0]
                off += n
            outs.append(out)
        for seq_id, _ in batch:
            self.slide(seq_id)
        return outs

    # -- token trees
    def tree_step(self, batch: Sequence[Tuple[int, int]], trees: Dict[int, Sequence[int]],
                  qkv_layers: List[np.ndarray], sm_scale: float) -> List[np.ndarray]:
        """A step appending token-tree nodes: ``trees[seq]`` holds the parents of the sequence's new
        nodes, indexing its accumulated uncommitted tree. Returns the expected outputs per layer."""
        assert self.rope_mode in (0, 1) and not any(self.layer_windows + self.layer_chunks) and not self.windows
        hq, hkv = self.hq, self.hkv
        info, off = [], 0
        for seq_id, n in batch:
            s = self.seqs[seq_id]
            parents = list(trees[seq_id])
            assert len(parents) == n
            if s.tree is None:
                s.tree, s.tree_start = [], s.length
            old = len(s.tree)
            s.tree = s.tree + parents
            depths = tree_depths(s.tree)
            pos = s.tree_start + np.asarray(depths[old:])
            new = np.stack([q[off:off + n] for q in qkv_layers]).astype(np.float64)
            k_new = new[:, :, hq:hq + hkv]
            if self.rope_mode == 1:
                k_new = np.stack([self.rope(k_new[l], pos) for l in range(self.L)])
            s.k = np.concatenate([s.k, k_new], axis=1)
            s.v = np.concatenate([s.v, new[:, :, hq + hkv:]], axis=1)
            s.last_append = n
            info.append((seq_id, n, off, old, pos))
            off += n
        outs = []
        for layer, qkv in enumerate(qkv_layers):
            out = np.zeros((qkv.shape[0], hq, self.d))
            for seq_id, n, off, old, pos in info:
                s = self.seqs[seq_id]
                q = np.asarray(qkv[off:off + n, :hq], np.float64)
                if self.rope_mode != 0:
                    q = self.rope(q, pos)
                vis = tree_visible(s.tree)[old:]
                for i in range(n):
                    keys = np.r_[0:s.tree_start, s.tree_start + np.nonzero(vis[i])[0]]
                    out[off + i] = attend(q[i:i + 1], s.k[layer, keys], s.v[layer, keys], sm_scale,
                                          causal_offset=None)[0][0]
            outs.append(out)
        return outs

    def commit(self, seq_id: int, leaf: int) -> None:
        """Keep the accepted path (see the module docstring); ``leaf == -1``: drop the tree (on a
        sequence without one, its last step)."""
        s = self.seqs[seq_id]
        assert leaf == -1 or s.tree is not None, "already committed"
        path = tree_path(s.tree, leaf) if leaf != -1 else []
        base = s.length - (len(s.tree) if s.tree is not None else s.last_append)
        keep = np.r_[0:base, base + np.asarray(path, dtype=np.int64)].astype(np.int64)
        s.k, s.v = s.k[:, keep], s.v[:, keep]
        s.shared = min(s.shared, base + len(path))
        s.tree, s.last_append = None, 0

    def tree_positions(self, batch: Sequence[Tuple[int, int]],
                       trees: Dict[int, Sequence[int]]) -> np.ndarray:
        """Query RoPE positions of a tree step (before ``tree_step`` runs)."""
        out = []
        for seq_id, n in batch:
            s = self.seqs[seq_id]
            earlier = s.tree or []
            start = s.tree_start if s.tree is not None else s.length
            out.append(start + np.asarray(tree_depths(list(earlier) + list(trees[seq_id]))[len(earlier):]))
        return np.concatenate(out).astype(np.int32)

    def shared_kv_attention(self, batch: Sequence[Tuple[int, int]], starts: Sequence[int],
                            source_layer: int, q: np.ndarray, sm_scale: float) -> np.ndarray:
        """Expected ``attention_with_shared_kv`` output: q (n, Hq, d) over the KV the source
        layer holds after this step (``starts``: lengths before the step; call before sliding,
        i.e. on a model whose windows do not slide in this step)."""
        out = np.zeros(q.shape, np.float64)
        off = 0
        for (seq_id, n), start in zip(batch, starts):
            qs = self.query(q[off:off + n], start)
            k, v = self.cached_kv_for_attention(seq_id, source_layer, start + n)
            out[off:off + n] = attend(qs, k, v, sm_scale, causal_offset=start,
                                      window=self.layer_windows[source_layer],
                                      chunk=self.layer_chunks[source_layer])[0]
            off += n
        return out

    def query(self, qkv_rows: np.ndarray, start: int) -> np.ndarray:
        q = np.asarray(qkv_rows[:, : self.hq], np.float64)
        if self.rope_mode != 0:
            q = self.rope(q, np.arange(start, start + q.shape[0]))
        return q

    def cached_kv_for_attention(self, seq_id: int, layer: int, end: Optional[int] = None):
        """K (rotated the way attention sees it) and V of the first ``end`` tokens."""
        s = self.seqs[seq_id]
        end = s.length if end is None else end
        k = s.k[layer, :end]
        if self.rope_mode == 2:
            k = self.rope(k, np.arange(end))
        return k, s.v[layer, :end]


# -- token-tree helpers

def tree_depths(parents: Sequence[int]) -> List[int]:
    """Depth of every node (roots 0); checks -1 <= parent < node."""
    depths: List[int] = []
    for node, parent in enumerate(parents):
        assert -1 <= parent < node, (node, parent)
        depths.append(0 if parent == -1 else depths[parent] + 1)
    return depths


def tree_path(parents: Sequence[int], leaf: int) -> List[int]:
    """Nodes from the root to ``leaf`` (inclusive)."""
    path = []
    while leaf != -1:
        path.append(leaf)
        leaf = parents[leaf]
    return path[::-1]


def tree_visible(parents: Sequence[int]) -> np.ndarray:
    """(n, n) bool: node i sees node j iff j is i or an ancestor of i."""
    n = len(parents)
    vis = np.zeros((n, n), bool)
    for i in range(n):
        j = i
        while j != -1:
            vis[i, j] = True
            j = parents[j]
    return vis


def _tree_mask(parents: Sequence[int], start: int, length: int) -> np.ndarray:
    """(length, length) visibility of a sequence whose tokens from ``start`` are tree nodes:
    everything sees the prefix; a node sees its ancestors and itself."""
    visible = np.tril(np.ones((length, length), dtype=bool))
    visible[start:, start:] = tree_visible(parents)[: length - start, : length - start]
    return visible


# -- the cache model with RoPE positions per token (attention from relax_kvcache.reference)

class ReferenceCache:
    """Numpy float64 model of what a KV cache holds and what its attention returns.

    Keeps each sequence's K (before RoPE) and V per layer; handles add / fork / popn /
    remove and computes the expected output of ``attention_with_fused_qkv`` for a step.

    Parameters
    ----------
    num_layers, num_qo_heads, num_kv_heads, head_dim : int
        Model shape.
    rope_mode : int
        0 none, 1 normal (stored K is rotated), 2 inline (stored K is not rotated).
    rope_theta, rope_scale : float
        RoPE parameters.
    layer_windows : list of int, optional
        Per layer, the window of an ``MHA_SLIDING`` layer (keys at positions ``(p - W, p]``), 0
        for none.
    layer_chunks : list of int, optional
        Per layer, the attention chunk of an ``MHA_CHUNKED_LOCAL`` layer (keys at positions
        ``[p - p % C, p]``), 0 for none.
    """

    def __init__(self, num_layers: int, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                 rope_mode: int, rope_theta: float = 1e4, rope_scale: float = 1.0,
                 layer_windows: Optional[list] = None, layer_chunks: Optional[list] = None) -> None:
        self.num_layers, self.num_qo_heads = num_layers, num_qo_heads
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.rope_mode, self.rope_theta, self.rope_scale = rope_mode, rope_theta, rope_scale
        self.layer_windows = list(layer_windows) if layer_windows is not None else [0] * num_layers
        self.layer_chunks = list(layer_chunks) if layer_chunks is not None else [0] * num_layers
        self.k: dict = {}
        self.v: dict = {}
        self.pos: dict = {}  # seq -> RoPE position of every stored token
        self.windows: dict = {}  # seq -> (window size, sink tokens kept)
        self.trees: dict = {}  # seq -> (tree start index, parents) of an uncommitted token tree
        self.last_append: dict = {}  # seq -> tokens appended by its last step

    def enable_window(self, seq_id: int, window: int, sink: int) -> None:
        """Per-sequence sliding window: after each step keep the first ``sink`` and the last
        ``window - sink`` tokens; positions (RoPE) are those within the kept tokens."""
        self.windows[seq_id] = (window, sink)

    def add(self, seq_id: int) -> None:
        shape = (self.num_layers, 0, self.num_kv_heads, self.head_dim)
        self.k[seq_id], self.v[seq_id] = np.zeros(shape), np.zeros(shape)
        self.pos[seq_id] = np.zeros(0, dtype=np.int64)

    def remove(self, seq_id: int) -> None:
        del self.k[seq_id], self.v[seq_id], self.pos[seq_id]
        self.windows.pop(seq_id, None)
        self.trees.pop(seq_id, None)

    def fork(self, parent: int, child: int, pos: int = -1) -> None:
        end = self.length(parent) if pos == -1 else pos
        self.k[child], self.v[child] = self.k[parent][:, :end], self.v[parent][:, :end]
        self.pos[child] = self.pos[parent][:end]

    def popn(self, seq_id: int, n: int) -> None:
        keep = self.length(seq_id) - n
        self.k[seq_id], self.v[seq_id] = self.k[seq_id][:, :keep], self.v[seq_id][:, :keep]
        self.pos[seq_id] = self.pos[seq_id][:keep]
        self.last_append[seq_id] = max(0, self.last_append.get(seq_id, 0) - n)

    def commit(self, seq_id: int, leaf: int) -> None:
        """The path root..leaf of the sequence's uncommitted tree (node indices over all its tree
        steps) moves to consecutive positions at the tree's start; the other nodes are dropped
        (TVM's commit for a tree appended in one step). ``leaf == -1`` drops the whole tree, or
        on a sequence without one its last step."""
        start, parents = self.trees.pop(seq_id, (None, ()))
        path = tree_path(parents, leaf)
        base = start if start is not None else self.length(seq_id) - self.last_append.get(seq_id, 0)
        keep = np.r_[0:base, [base + node for node in path]].astype(np.int64)
        self.k[seq_id], self.v[seq_id] = self.k[seq_id][:, keep], self.v[seq_id][:, keep]
        # RoPE was applied at each node's depth: the path's node of depth d lands at base + d.
        self.pos[seq_id] = self.pos[seq_id][keep]
        self.last_append[seq_id] = 0  # consumed: a second commit with leaf -1 pops nothing

    def length(self, seq_id: int) -> int:
        return self.k[seq_id].shape[1]

    def step(self, batch, qkv_layers, sm_scale: float, trees: Optional[dict] = None) -> list:
        """Append the batch's K/V and return the expected outputs, one ``(n, Hq, D)`` per layer.

        ``batch`` is a list of ``(seq_id, append_length)``; ``qkv_layers[l]`` is the fused
        ``(n, Hq + 2 Hkv, D)`` input of layer l (rows in batch order). ``trees[seq_id]`` (optional)
        holds the parent pointers of that sequence's new tokens within its uncommitted tree:
        a node sits at its root's position + its depth and sees the prefix, its ancestors and
        itself.
        """
        hq, hkv = self.num_qo_heads, self.num_kv_heads
        masks, q_positions = {}, {}
        offset = 0
        for seq_id, n in batch:
            length = self.length(seq_id)
            if trees is not None:
                start, parents = self.trees.get(seq_id, (length, ()))
                parents = tuple(parents) + tuple(trees[seq_id])
                self.trees[seq_id] = (start, parents)
                positions = start + np.asarray(tree_depths(parents)[-n:])  # root at the tree's index
                masks[seq_id] = _tree_mask(parents, start, length + n)[-n:]
            else:
                positions = np.arange(length, length + n)
            q_positions[seq_id] = positions
            new = np.stack([np.asarray(qkv, np.float64)[offset:offset + n] for qkv in qkv_layers])
            self.k[seq_id] = np.concatenate([self.k[seq_id], new[:, :, hq:hq + hkv]], axis=1)
            self.v[seq_id] = np.concatenate([self.v[seq_id], new[:, :, hq + hkv:]], axis=1)
            self.pos[seq_id] = np.concatenate([self.pos[seq_id], positions])
            self.last_append[seq_id] = n
            offset += n
        outputs = []
        for layer, qkv in enumerate(qkv_layers):
            qkv = np.asarray(qkv, np.float64)
            out = np.zeros((qkv.shape[0], hq, self.head_dim))
            offset = 0
            for seq_id, n in batch:
                q, k = qkv[offset:offset + n, :hq], self.k[seq_id][layer]
                q_pos, k_pos = q_positions[seq_id], self.pos[seq_id]
                if self.rope_mode != 0:
                    q = rope(q, q_pos, self.rope_theta, self.rope_scale)
                    k = rope(k, k_pos, self.rope_theta, self.rope_scale)
                window, chunk = self.layer_windows[layer], self.layer_chunks[layer]
                mask = masks.get(seq_id)
                if window:
                    mask = k_pos[None, :] > q_pos[:, None] - window
                elif chunk:
                    mask = k_pos[None, :] // chunk == q_pos[:, None] // chunk
                local = bool(window or chunk)
                out[offset:offset + n], _ = attention(q, k, self.v[seq_id][layer], sm_scale,
                                                      causal=mask is None or local, mask=mask)
                offset += n
            outputs.append(out)
        for seq_id, _ in batch:
            self._slide(seq_id)
        return outputs

    def _slide(self, seq_id: int) -> None:
        if seq_id not in self.windows:
            return
        window, sink = self.windows[seq_id]
        length = self.length(seq_id)
        if length > window:
            keep = np.r_[0:sink, length - (window - sink):length]
            self.k[seq_id], self.v[seq_id] = self.k[seq_id][:, keep], self.v[seq_id][:, keep]
            self.pos[seq_id] = np.arange(window)  # positions are those within the kept tokens

    def stored_kv(self, seq_id: int) -> tuple:
        """``(k, v)`` of shape ``(num_layers, length, Hkv, D)`` as the cache stores them."""
        k = self.k[seq_id]
        if self.rope_mode == 1:
            positions = self.pos[seq_id]
            k = np.stack([rope(k[l], positions, self.rope_theta, self.rope_scale) for l in range(k.shape[0])])
        return k, self.v[seq_id]


# -- multi-head latent attention

@dataclasses.dataclass(frozen=True)
class MLAWeights:
    """Up-projections: ``w_uk (H, P, L)``, ``w_uv (H, L, V)`` (float64)."""

    w_uk: np.ndarray
    w_uv: np.ndarray

    @classmethod
    def draw(cls, rng: np.random.Generator, heads: int, lora: int, nope: int, v: int) -> "MLAWeights":
        scale = lora ** -0.5  # keeps decompressed k / v near unit variance
        return cls(rng.standard_normal((heads, nope, lora)) * scale, rng.standard_normal((heads, lora, v)) * scale)

    @property
    def lora(self) -> int:
        return self.w_uk.shape[2]

    def keys_values(self, latent: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """Decompressed ``k (t, H, P + R)`` and ``v (t, H, V)`` of latent rows ``(t, L + R)``."""
        latent = np.asarray(latent, np.float64)
        kv_c, k_pe = latent[:, :self.lora], latent[:, self.lora:]
        k_nope = np.einsum("tl,hpl->thp", kv_c, self.w_uk)
        k_pe = np.broadcast_to(k_pe[:, None, :], (latent.shape[0], self.w_uk.shape[0], k_pe.shape[1]))
        return np.concatenate([k_nope, k_pe], axis=-1), np.einsum("tl,hlv->thv", kv_c, self.w_uv)

    def absorb(self, q: np.ndarray) -> np.ndarray:
        """Absorbed queries ``[q_nope @ W_UK, q_pe] (n, H, L + R)`` of ``q (n, H, P + R)``."""
        nope = self.w_uk.shape[1]
        q = np.asarray(q, np.float64)
        return np.concatenate([np.einsum("nhp,hpl->nhl", q[..., :nope], self.w_uk), q[..., nope:]], axis=-1)

    def up_v(self, o_latent: np.ndarray) -> np.ndarray:
        """``o (n, H, L) @ W_UV`` per head -> ``(n, H, V)``."""
        return np.einsum("nhl,hlv->nhv", np.asarray(o_latent, np.float64), self.w_uv)


class MLAModel:
    """Each sequence's latent rows per layer, as the cache should hold them."""

    def __init__(self, num_layers: int, width: int) -> None:
        self.num_layers, self.width = num_layers, width
        self.seqs: Dict[int, np.ndarray] = {}  # seq_id -> (layers, t, W) float64

    def add(self, seq_id: int) -> None:
        self.seqs[seq_id] = np.zeros((self.num_layers, 0, self.width))

    def fork(self, parent: int, child: int, pos: int) -> None:
        rows = self.seqs[parent]
        self.seqs[child] = rows[:, : rows.shape[1] if pos == -1 else pos].copy()

    def popn(self, seq_id: int, n: int) -> None:
        self.seqs[seq_id] = self.seqs[seq_id][:, : self.seqs[seq_id].shape[1] - n]

    def append(self, seq_id: int, layer: int, rows: np.ndarray) -> None:
        seq = self.seqs[seq_id]
        if layer == 0:
            grown = np.zeros((self.num_layers, seq.shape[1] + rows.shape[0], self.width))
            grown[:, : seq.shape[1]] = seq
            self.seqs[seq_id] = seq = grown
        seq[layer, seq.shape[1] - rows.shape[0]:] = rows

    def expected(self, weights: MLAWeights, seq_id: int, layer: int, q: np.ndarray, sm_scale: float):
        """Causal attention of the sequence's last ``n`` tokens, ``q (n, H, P + R)``, over all
        its rows: ``o (n, H, V)`` and base-2 ``lse (n, H)``."""
        rows = self.seqs[seq_id][layer]
        k, v = weights.keys_values(rows)
        return attend(q, k, v, sm_scale, causal_offset=rows.shape[0] - q.shape[0])

    def context(self, weights: MLAWeights, seq_id: int, layer: int, q: np.ndarray, sm_scale: float):
        """Attention of ``q (n, H, P + R)`` over the sequence's rows before its last ``n``."""
        rows = self.seqs[seq_id][layer][: self.seqs[seq_id].shape[1] - q.shape[0]]
        k, v = weights.keys_values(rows)
        return attend(q, k, v, sm_scale, causal_offset=None)
