"""Numpy float64 model of what a KV cache holds and what its attention returns, for the tests
and ``benchmarks/gpu_check.py`` (RoPE, attention and merges from :mod:`relax_kvcache.reference`)."""

from __future__ import annotations

from typing import Optional

import numpy as np

from relax_kvcache.reference import attention, rope


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
        path = []
        while leaf != -1:
            path.append(leaf)
            leaf = parents[leaf]
        path.reverse()
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
                positions = start + np.asarray(_tree_depths(parents)[-n:])  # root at the tree's index
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


def _tree_depths(parents) -> list:
    depths = []
    for parent in parents:
        depths.append(0 if parent == -1 else depths[parent] + 1)
    return depths


def _tree_mask(parents, start: int, length: int) -> np.ndarray:
    """(length, length) visibility of a sequence whose tokens from ``start`` are tree nodes:
    everything sees the prefix; a node sees its ancestors and itself."""
    visible = np.tril(np.ones((length, length), dtype=bool))
    visible[start:, start:] = False
    for node in range(len(parents)):
        ancestor = node
        while ancestor != -1:
            visible[start + node, start + ancestor] = True
            ancestor = parents[ancestor]
    return visible
