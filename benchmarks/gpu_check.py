"""Correctness of every cache feature on a device, against the float64 reference model.

Runs random workloads on ``PagedAttentionKVCache`` with the kernels ``gpu_prepare.py`` built
and compares every output with the numpy float64 ``ReferenceCache`` of ``reference_model.py``:
chunked prefill mixed with decode over several sequences, forks at arbitrary positions (mid-page
included), popn, remove, per-sequence sliding windows with attention sinks, per-layer windows
(``MHA_SLIDING``), token trees (``begin_forward`` with parent pointers,
``commit_accepted_token_tree_nodes``, decode after), ``attention_with_shared_kv``,
``self_attention`` / ``cross_attention`` / ``merge_attn_output_inplace`` and ``debug_get_kv``
after each phase, in all three RoPE modes.

Inputs are unit-variance random values in the cache dtype (caches over 8-bit pages: K and V
on the 8-bit grid times power-of-two scales set with ``set_kv_scales``, which the pages store
exactly, so the float64 reference holds for them unchanged); every output is poisoned with NaN
before the kernel call that writes it and must come back free of NaN, with infinities only
where the reference has them (the log-sum-exp of rows that see nothing), and within
``--tolerance`` (max abs error, default 2e-2 for float16) of the reference.

One line per (configuration, workload): name, forward steps, max error, PASS/FAIL. The exit
status is nonzero when anything fails.

Usage::

    python benchmarks/gpu_check.py --libs .gpu                 # on the GPU host (runtime-only TVM)
    python benchmarks/gpu_check.py --device cpu                # here: CPU kernels built in process
    python benchmarks/gpu_check.py --device cpu --libs .gpu-cpu   # here: libraries from gpu_prepare --target llvm
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import sys
import time
import traceback
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import ml_dtypes
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpu_prepare as gp  # noqa: E402  (also puts python/ on sys.path)

import tvm  # noqa: E402

import relax_kvcache as rk  # noqa: E402
from relax_kvcache.reference import attention, merge_states, rope  # noqa: E402
from reference_model import ReferenceCache  # noqa: E402  (tests/)

NP_DTYPE = {"float32": np.float32, "float16": np.float16}
DEFAULT_TOLERANCE = {"float32": 2e-3, "float16": 2e-2}
GRID_SCALES = (0.25, 2.0)  # K and V scales of caches over 8-bit pages
EMPTY_LSE = -5e4  # log-sum-exp at or below this means "no visible key"


# ----------------------------------------------------------------------------- harness

class Check:
    """Drives a cache and the reference with the same operations and records every mismatch.

    Parameters
    ----------
    cache : PagedAttentionKVCache
        The cache under test (on any device).
    rng : numpy.random.Generator
        Source of the random inputs.
    tolerance : float
        Largest accepted absolute error.
    """

    def __init__(self, cache: rk.PagedAttentionKVCache, rng: np.random.Generator, tolerance: float) -> None:
        cfg = cache.config
        self.cache, self.cfg, self.rng, self.tolerance = cache, cfg, rng, tolerance
        self.device = cache.device
        self.np_dtype = NP_DTYPE[cfg.dtype]
        self.rope_mode = int(cfg.effective_rope_mode)
        self.layer_windows = [cfg.layer_sliding_window_size if kind == rk.AttnKind.MHA_SLIDING else 0
                              for kind in cfg.attn_kinds]
        self.layer_chunks = [cfg.attention_chunk_size if kind == rk.AttnKind.MHA_CHUNKED_LOCAL else 0
                             for kind in cfg.attn_kinds]
        self.ref = ReferenceCache(cfg.num_layers, cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim,
                                  self.rope_mode, cfg.rope_theta, cfg.rope_scale, layer_windows=self.layer_windows,
                                  layer_chunks=self.layer_chunks)
        self.sm_scale = 1.1 / math.sqrt(cfg.head_dim)
        self.step_qkv: List[np.ndarray] = []  # float64 fused QKV of the current step, per layer
        self.steps = 0
        self.max_error = 0.0
        self.problems: List[str] = []
        self.ghosts: set = set()  # removed from the cache, kept in the reference (sources of prefix hits)
        if cfg.kv_dtype is not None:  # K / V scales of every layer (powers of two: exact)
            for layer in range(cfg.num_layers):
                cache.set_kv_scales(layer, *GRID_SCALES)

    # -- tensors
    def random(self, shape) -> Tuple[tvm.runtime.Tensor, np.ndarray]:
        """A unit-variance random tensor on the device and its float64 value."""
        host = self.rng.standard_normal(shape).astype(self.np_dtype)
        return tvm.runtime.tensor(host, self.device), host.astype(np.float64)

    def qkv_values(self, n: int) -> np.ndarray:
        """A fused q / k / v step input's values in the cache dtype (float64): unit-variance,
        and over 8-bit pages K and V on the 8-bit grid times the scales (stored exactly)."""
        cfg = self.cfg
        hq, hkv = cfg.num_qo_heads, cfg.num_kv_heads
        host = self.rng.standard_normal((n, hq + 2 * hkv, cfg.head_dim))
        if cfg.kv_dtype is not None:
            grid = ml_dtypes.finfo(getattr(ml_dtypes, cfg.kv_dtype))
            for part, scale in ((slice(hq, hq + hkv), GRID_SCALES[0]), (slice(hq + hkv, None), GRID_SCALES[1])):
                values = host[:, part] * np.exp2(self.rng.integers(-3, 3, host[:, part].shape))
                host[:, part] = np.clip(values, -float(grid.max), float(grid.max)).astype(grid.dtype).astype(np.float64) * scale
        return host.astype(self.np_dtype).astype(np.float64)

    def random_qkv(self, n: int) -> Tuple[tvm.runtime.Tensor, np.ndarray]:
        """:meth:`qkv_values` on the device, and the values."""
        host = self.qkv_values(n)
        return self.upload(host), host

    def upload(self, array: np.ndarray) -> tvm.runtime.Tensor:
        return tvm.runtime.tensor(np.asarray(array).astype(self.np_dtype), self.device)

    def poisoned(self, shape, dtype: Optional[str] = None) -> tvm.runtime.Tensor:
        """A NaN-filled tensor on the device (an output before the kernel that writes it)."""
        return tvm.runtime.tensor(np.full(shape, np.nan, dtype=NP_DTYPE[dtype or self.cfg.dtype]), self.device)

    def compare(self, what: str, got: tvm.runtime.Tensor, expected: np.ndarray, *, lse: bool = False) -> None:
        """Record the error of ``got`` against ``expected`` (and any NaN or misplaced infinity).

        ``lse``: a log-sum-exp, where values <= -5e4 count as -inf (no visible key; TVM's
        kernels write -5e4 there, ours -inf; merging treats both alike).
        """
        value = got.numpy().astype(np.float64)
        expected = np.asarray(expected, np.float64)
        if lse:
            value = np.where(value <= EMPTY_LSE, -np.inf, value)
        if value.shape != expected.shape:
            self.problems.append(f"{what}: shape {value.shape}, expected {expected.shape}")
            return
        if np.isnan(value).any():
            self.problems.append(f"{what}: {int(np.isnan(value).sum())} of {value.size} values are NaN "
                                 "(not written, or computed as NaN)")
            return
        finite = np.isfinite(expected)
        if not np.array_equal(value[~finite], expected[~finite]) or not np.isfinite(value[finite]).all():
            self.problems.append(f"{what}: infinities where the reference has none, or the other way round")
            return
        error = float(np.abs(value[finite] - expected[finite]).max(initial=0.0))
        self.max_error = max(self.max_error, error)
        if error > self.tolerance:
            self.problems.append(f"{what}: max abs error {error:.3g} > {self.tolerance:g}")

    def expect_equal(self, what: str, got, expected) -> None:
        if not np.array_equal(np.asarray(got), np.asarray(expected)):
            self.problems.append(f"{what}: got {np.asarray(got).tolist()}, expected {np.asarray(expected).tolist()}")

    # -- sequence structure
    def add(self, seq: int) -> None:
        self.cache.add_sequence(seq)
        self.ref.add(seq)

    def remove(self, seq: int) -> None:
        self.cache.remove_sequence(seq)
        self.ref.remove(seq)

    def fork(self, parent: int, child: int, pos: int) -> None:
        self.cache.fork_sequence(parent, child, pos)
        self.ref.fork(parent, child, pos)

    def release(self, seq: int) -> None:
        """Remove ``seq`` from the cache only: its pages may stay cached (prefix caching)."""
        self.cache.remove_sequence(seq)
        self.ghosts.add(seq)

    def add_cached(self, seq: int, ids: List[int], source: int, expected_hit: int) -> None:
        """Add ``seq`` with prompt ``ids`` (prefix caching): it must start on ``expected_hit``
        cached tokens, which ``source`` (live or released) holds in the reference."""
        hit = self.cache.add_sequence(seq, ids)
        self.expect_equal(f"tokens of sequence {seq} found cached", hit, expected_hit)
        self.ref.fork(source, seq, hit)

    def popn(self, seq: int, n: int) -> None:
        self.cache.popn(seq, n)
        self.ref.popn(seq, n)

    def enable_window(self, seq: int, window: int, sink: int) -> None:
        self.cache.enable_sliding_window_for_seq(seq, window, sink)
        self.ref.enable_window(seq, window, sink)

    def commit(self, leaves: Dict[int, int]) -> None:
        seqs = list(leaves)
        self.cache.commit_accepted_token_tree_nodes(seqs, [leaves[s] for s in seqs])
        for seq in seqs:
            self.ref.commit(seq, leaves[seq])

    # -- forward steps
    def step(self, batch: Sequence[Tuple[int, int]], trees: Optional[Dict[int, List[int]]] = None,
             during: Optional[Callable[[], None]] = None, token_ids: Optional[List[int]] = None) -> None:
        """One forward step of ``batch`` ``[(seq, tokens)]`` through every layer, checked.

        ``trees[seq]``: parent pointers of the sequence's new tokens (a token-tree step).
        ``during``: called after the layers' attention, before ``end_forward``.
        ``token_ids``: the new tokens' ids, in batch order (prefix caching registers their pages).
        """
        cfg = self.cfg
        n = sum(length for _, length in batch)
        qkvs = [self.random_qkv(n) for _ in range(cfg.num_layers)]
        outs = [self.poisoned((n, cfg.num_qo_heads, cfg.head_dim)) for _ in range(cfg.num_layers)]
        self.step_qkv = [host for _, host in qkvs]
        parents = None if trees is None else [p for seq, _ in batch for p in trees[seq]]
        self.cache.begin_forward([s for s, _ in batch], [length for _, length in batch], parents, token_ids)
        for layer in range(cfg.num_layers):
            self.cache.attention_with_fused_qkv(layer, qkvs[layer][0], outs[layer], self.sm_scale)
        if during is not None:
            during()
        self.cache.end_forward()
        expected = self.ref.step(list(batch), self.step_qkv, self.sm_scale, trees=trees)
        self.steps += 1
        for layer, (out, exp) in enumerate(zip(outs, expected)):
            self.compare(f"step {self.steps} layer {layer} batch {list(batch)}", out, exp)

    def new_kv(self, layer: int, batch: Sequence[Tuple[int, int]], starts: Sequence[int]
               ) -> Tuple[np.ndarray, np.ndarray]:
        """The current step's new K and V of a layer as the cache stores them (K rotated at the
        tokens' positions in NORMAL mode); ``starts``: sequence lengths before the step."""
        cfg = self.cfg
        hq, hkv = cfg.num_qo_heads, cfg.num_kv_heads
        qkv = self.step_qkv[layer]
        k, v = qkv[:, hq:hq + hkv].copy(), qkv[:, hq + hkv:]
        if self.rope_mode == int(rk.RopeMode.NORMAL):
            offset = 0
            for (_, length), start in zip(batch, starts):
                r = slice(offset, offset + length)
                k[r] = rope(k[r], np.arange(start, start + length), cfg.rope_theta, cfg.rope_scale)
                offset += length
        return k, v

    def check_contents(self) -> None:
        """Lengths and ``debug_get_kv`` of every sequence against the reference."""
        cfg = self.cfg
        live = [seq for seq in self.ref.k if seq not in self.ghosts]
        for seq in live:
            length = self.ref.length(seq)
            self.expect_equal(f"length of sequence {seq}", self.cache.get_sequence_length(seq), length)
            if length == 0:
                continue
            shape = (cfg.num_layers, length, cfg.num_kv_heads, cfg.head_dim)
            k, v = self.poisoned(shape), self.poisoned(shape)
            self.cache.debug_get_kv(seq, 0, length, k, v)
            k_ref, v_ref = self.ref.stored_kv(seq)
            self.compare(f"debug_get_kv K of sequence {seq} after step {self.steps}", k, k_ref)
            self.compare(f"debug_get_kv V of sequence {seq} after step {self.steps}", v, v_ref)
            if cfg.kv_dtype is not None:
                self.check_page_bytes(seq, k_ref, v_ref)
        self.expect_equal("total sequence length", self.cache.get_total_sequence_length(),
                          sum(self.ref.length(s) for s in live))

    def check_page_bytes(self, seq: int, k_ref: np.ndarray, v_ref: np.ndarray) -> None:
        """8-bit pages hold ``value / scale``: the raw elements at the sequence's positions."""
        cfg = self.cfg
        slots = np.asarray(self.cache._paging.position_map(seq, 0, k_ref.shape[1]), np.int64)
        for layer in range(cfg.num_layers):
            pages = self.cache._pages[layer].numpy()
            raw = pages[slots // cfg.page_size, :, :, slots % cfg.page_size].astype(np.float64)  # (n, 2, H, D)
            for kv, (ref, scale) in enumerate(((k_ref, GRID_SCALES[0]), (v_ref, GRID_SCALES[1]))):
                self.expect_equal(f"8-bit page elements ({'KV'[kv]}) of sequence {seq}, layer {layer}",
                                  bool(np.array_equal(raw[:, kv], ref[layer] / scale)), True)

    def as_attended(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """``x`` as the kernels see it: rotated at ``positions`` in INLINE mode, as given otherwise."""
        if self.rope_mode == int(rk.RopeMode.INLINE):
            return rope(x, positions, self.cfg.rope_theta, self.cfg.rope_scale)
        return np.asarray(x, np.float64)


# ----------------------------------------------------------------------------- workloads

def wl_random(c: Check, steps: int = 40) -> None:
    """Random add / fork (any position) / popn / remove and steps mixing decode and prefill chunks."""
    rng, cfg = c.rng, c.cfg
    live: List[int] = []
    next_id = 0
    for _ in range(steps):
        op = rng.choice(["step", "step", "step", "add", "fork", "popn", "remove"])
        if op == "add" or not live:
            c.add(next_id)
            live.append(next_id)
            next_id += 1
            op = "step"
        if op == "fork":
            parent = int(rng.choice(live))
            length = c.ref.length(parent)
            pos = int(rng.choice([-1, 0, length, rng.integers(0, length + 1),
                                  (length // cfg.page_size) * cfg.page_size]))
            c.fork(parent, next_id, pos)
            live.append(next_id)
            next_id += 1
            c.check_contents()
        elif op == "popn":
            seq = int(rng.choice(live))
            c.popn(seq, int(rng.integers(0, c.ref.length(seq) + 1)))
            c.check_contents()
        elif op == "remove" and len(live) > 1:
            seq = int(rng.choice(live))
            c.remove(seq)
            live.remove(seq)
            c.check_contents()
        elif op == "step":
            members = rng.choice(live, size=min(len(live), int(rng.integers(1, 6))), replace=False)
            budget, batch = cfg.prefill_chunk_size, []
            for i, seq in enumerate(members):
                length = 1 if rng.random() < 0.5 else int(rng.integers(2, 60))
                length = min(length, budget - (len(members) - i - 1))
                if length < 1:
                    break
                budget -= length
                batch.append((int(seq), length))
            if c.cache.get_num_available_pages() < 8 * len(batch) + 8:
                for seq in live[:-1]:
                    c.remove(seq)
                live[:-1] = []
                continue
            c.step(batch)
    c.check_contents()
    for seq in list(live):
        c.remove(seq)
    c.expect_equal("cache empty after removing everything", c.cache.empty(), True)


def wl_prefix_chain(c: Check) -> None:
    """Prefixes forked six levels deep (multi-depth attention), then decode and mixed batches."""
    c.add(0)
    c.step([(0, 30)])
    for child in range(1, 7):  # 0 <- 1 <- ... <- 6, each forked mid-page at the parent's end
        c.fork(child - 1, child, -1)
        c.step([(child, 5 + 3 * child)])
    c.check_contents()
    for _ in range(3):
        c.step([(s, 1) for s in range(7)])
    c.step([(6, 20), (3, 1), (0, 7)])
    c.fork(4, 7, 37)  # inside a shared prefix
    c.step([(7, 1), (4, 1), (2, 9)])
    c.check_contents()


def _random_tree(rng: np.random.Generator, size: int, shape: str) -> List[int]:
    if shape == "chain":
        return [i - 1 for i in range(size)]
    if shape == "star":
        return [-1] + [0] * (size - 1)
    if shape == "binary":
        return [(i - 1) // 2 for i in range(size)]
    return [-1] + [int(rng.integers(0, i)) for i in range(1, size)]


def wl_token_tree(c: Check) -> None:
    """Token trees: random trees per sequence, commit of a random leaf, decode after; then a tree
    grown over several steps (earlier nodes in the pages) and committed."""
    rng = c.rng
    for seq in range(4):
        c.add(seq)
    c.step([(0, 10), (1, 21), (2, 8), (3, 40)])
    c.fork(1, 4, 13)  # a shared prefix: two block depths
    c.step([(4, 3)])
    shapes = ["chain", "star", "binary", "random"]
    for round_ in range(3):
        sizes = {seq: int(rng.integers(1, 20)) for seq in range(5)}
        trees = {seq: _random_tree(rng, sizes[seq], shapes[(seq + round_) % 4]) for seq in range(5)}
        c.step([(seq, sizes[seq]) for seq in range(5)], trees=trees)
        c.commit({seq: int(rng.integers(-1, sizes[seq])) for seq in range(5)})
        c.check_contents()
        c.step([(seq, 1) for seq in range(5)])
    full = [(k - 1) // 2 for k in range(15)]  # binary tree of 4 levels appended level by level
    for level in range(4):
        lo, hi = 2 ** level - 1, 2 ** (level + 1) - 1
        c.step([(seq, hi - lo) for seq in range(3)], trees={seq: full[lo:hi] for seq in range(3)})
    c.commit({0: 3, 1: 5, 2: -1})
    c.check_contents()
    c.step([(0, 1), (1, 1), (2, 1)])
    c.check_contents()


def wl_self_cross_merge(c: Check) -> None:
    """cross_attention (cached KV) + self_attention (new tokens) merged == attention over both;
    a sequence with nothing cached gets o = 0, lse = -inf from cross_attention."""
    cfg = c.cfg
    for seq in range(3):
        c.add(seq)
    c.step([(0, 21), (1, 40)])
    batch = [(0, 3), (1, 1), (2, 5)]
    n = sum(length for _, length in batch)
    hq, hkv, d = cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim
    (q, q_np), (k, k_np), (v, v_np) = c.random((n, hq, d)), c.random((n, hkv, d)), c.random((n, hkv, d))
    o_self, o_cross = c.poisoned((n, hq, d)), c.poisoned((n, hq, d))
    lse_self, lse_cross = c.poisoned((n, hq), "float32"), c.poisoned((n, hq), "float32")
    c.cache.begin_forward([s for s, _ in batch], [length for _, length in batch])
    starts = [c.ref.length(seq) for seq, _ in batch]
    positions = np.concatenate([np.arange(s, s + length) for s, (_, length) in zip(starts, batch)])
    c.expect_equal("get_query_positions", c.cache.get_query_positions().numpy(), positions)
    for layer in range(cfg.num_layers):
        c.cache.self_attention(layer, q, k, v, o_self, lse_self, c.sm_scale)
        c.cache.cross_attention(layer, q, o_cross, lse_cross, c.sm_scale)
        exp_self = np.zeros((n, hq, d))
        exp_self_lse = np.zeros((n, hq))
        exp_cross, exp_cross_lse = np.zeros((n, hq, d)), np.zeros((n, hq))
        offset = 0
        for (seq, length), start in zip(batch, starts):
            r = slice(offset, offset + length)
            q_pos = np.arange(start, start + length)
            qs = c.as_attended(q_np[r], q_pos)
            k_cached, v_cached = (x[layer] for x in c.ref.stored_kv(seq))
            k_cached = c.as_attended(k_cached, c.ref.pos[seq])
            exp_cross[r], exp_cross_lse[r] = attention(qs, k_cached, v_cached, c.sm_scale, causal=False)
            exp_self[r], exp_self_lse[r] = attention(qs, c.as_attended(k_np[r], q_pos), v_np[r], c.sm_scale,
                                                     causal=True)
            offset += length
        c.compare(f"self_attention o layer {layer}", o_self, exp_self)
        c.compare(f"self_attention lse layer {layer}", lse_self, exp_self_lse, lse=True)
        c.compare(f"cross_attention o layer {layer}", o_cross, exp_cross)
        c.compare(f"cross_attention lse layer {layer}", lse_cross, exp_cross_lse, lse=True)
        merged_o, merged_lse = c.cache.merge_attn_output_inplace(o_self, lse_self, o_cross, lse_cross)
        exp_o, exp_lse = merge_states(exp_self, exp_self_lse, exp_cross, exp_cross_lse)
        c.compare(f"merge_attn_output_inplace o layer {layer}", merged_o, exp_o)
        c.compare(f"merge_attn_output_inplace lse layer {layer}", merged_lse, exp_lse, lse=True)
        for x in (o_self, o_cross):  # poison again for the next layer
            x.copyfrom(np.full(x.shape, np.nan, c.np_dtype))
        for x in (lse_self, lse_cross):
            x.copyfrom(np.full(x.shape, np.nan, np.float32))
    c.cache.end_forward()
    c.steps += 1
    for seq, length in batch:  # the step reserved its tokens, but self/cross attention store no K/V
        c.cache.popn(seq, length)
    c.check_contents()


def wl_seq_windows(c: Check) -> None:
    """Per-sequence sliding windows with attention sinks beside a plain sequence: appends longer
    than the window, long decode, a fork inside the sink."""
    specs = {0: (20, 6), 1: (25, 0), 2: (33, 17)}  # seq -> (window, sink)
    for seq, (window, sink) in specs.items():
        c.add(seq)
        c.enable_window(seq, window, sink)
    c.add(3)
    c.step([(0, 4), (1, 6), (2, 30), (3, 5)])
    c.step([(0, 20), (1, 19), (2, 9), (3, 3)])
    c.step([(0, 40), (1, 3), (2, 2), (3, 1)])  # 40 > window: slides within one step
    c.check_contents()
    for _ in range(20):
        c.step([(0, 1), (1, 1), (2, 1), (3, 1)])
    c.check_contents()
    c.fork(2, 4, 12)  # within sequence 2's sink of 17
    c.step([(4, 5), (2, 2)])
    c.popn(3, 4)
    c.step([(3, 17), (4, 1), (0, 1)])
    c.check_contents()


def wl_layer_windows(c: Check) -> None:
    """MHA_SLIDING or MHA_CHUNKED_LOCAL layers: steps longer than the window (or across attention
    chunks), decode, forks (mid-page and page-aligned), popn."""
    c.add(0)
    c.add(1)
    c.step([(0, 90), (1, 7)])  # 90 > window 40: the window applies inside the chunk
    c.step([(0, 1), (1, 1)])
    c.fork(0, 2, 73)
    c.fork(2, 3, -1)
    c.check_contents()
    c.step([(2, 60), (3, 4), (1, 50)])
    for _ in range(4):
        c.step([(0, 1), (2, 1), (3, 1)])
    c.fork(1, 4, 16)
    c.step([(4, 3), (1, 45), (0, 2)])
    c.popn(0, 5)
    c.step([(0, 1), (4, 1)])
    c.check_contents()


def wl_shared_kv(c: Check) -> None:
    """attention_with_shared_kv over every layer's KV (MHA and MHA_SLIDING sources) after that
    layer's attention in the same step, in prefill, mixed and decode steps."""
    cfg = c.cfg
    hq, d = cfg.num_qo_heads, cfg.head_dim
    for seq in range(2):
        c.add(seq)
    for batch in ([(0, 50), (1, 9)], [(0, 3), (1, 1)], [(0, 1), (1, 1)], [(0, 60), (1, 1)], [(0, 1), (1, 1)]):
        n = sum(length for _, length in batch)
        starts = [c.ref.length(seq) for seq, _ in batch]
        queries = [c.random((n, hq, d)) for _ in range(cfg.num_layers)]
        outs = [c.poisoned((n, hq, d)) for _ in range(cfg.num_layers)]

        def shared_calls():
            for layer in range(cfg.num_layers):
                k_new, v_new = c.new_kv(layer, batch, starts)
                c.cache.attention_with_shared_kv(layer, queries[layer][0], c.upload(k_new), c.upload(v_new),
                                                 outs[layer], c.sm_scale)

        c.step(batch, during=shared_calls)
        for layer in range(cfg.num_layers):
            expected = np.zeros((n, hq, d))
            offset = 0
            for (seq, length), start in zip(batch, starts):
                r = slice(offset, offset + length)
                q_pos = np.arange(start, start + length)
                k_all, v_all = (x[layer, :start + length] for x in c.ref.stored_kv(seq))
                k_pos = c.ref.pos[seq][:start + length]
                mask = None
                if c.layer_windows[layer]:
                    mask = k_pos[None, :] > q_pos[:, None] - c.layer_windows[layer]
                elif c.layer_chunks[layer]:
                    mask = k_pos[None, :] // c.layer_chunks[layer] == q_pos[:, None] // c.layer_chunks[layer]
                expected[r], _ = attention(c.as_attended(queries[layer][1][r], q_pos), c.as_attended(k_all, k_pos),
                                           v_all, c.sm_scale, causal=True, mask=mask)
                offset += length
            c.compare(f"attention_with_shared_kv source layer {layer} step {c.steps}", outs[layer], expected)
    c.check_contents()


def wl_long_context(c: Check) -> None:
    """12 sequences of 300..1400 tokens (prefilled in chunks of whole sequences), then decode
    steps of every sequence and of subsets: long KV walks (many chunks per block), decode
    batches without KV splits. (The float64 reference makes this the slowest workload.)"""
    rng = c.rng
    lengths = [int(x) for x in rng.integers(300, 1400, size=12)]
    for seq in range(len(lengths)):
        c.add(seq)
    batch, used = [], 0
    for seq, length in enumerate(lengths):
        if used + length > c.cfg.prefill_chunk_size:
            c.step(batch)
            batch, used = [], 0
        batch.append((seq, length))
        used += length
    c.step(batch)
    c.step([(seq, 1) for seq in range(len(lengths))])
    c.step([(seq, 1) for seq in range(0, len(lengths), 5)])
    c.check_contents()


def wl_checkpoint(c: Check) -> None:
    """Checkpoints: sequences (one forked inside a page) saved as page groups (checked against
    the reference: positions in page-size runs, the last page's tail zero; on the device, then
    on the host) and imported into new ids while another sequence steps; then the copies decode
    alongside the originals. Over 8-bit pages the groups hold the stored elements (``value /
    scale``), compared as such."""
    cfg = c.cfg
    ps, hkv, d = cfg.page_size, cfg.num_kv_heads, cfg.head_dim
    group_dtype = cfg.kv_dtype or cfg.dtype
    np_group = getattr(ml_dtypes, cfg.kv_dtype) if cfg.kv_dtype else c.np_dtype
    scales = np.array(GRID_SCALES if cfg.kv_dtype else (1.0, 1.0)).reshape(1, 1, 2, 1, 1, 1)  # K, V
    c.add(0)
    c.step([(0, 70)])
    c.fork(0, 1, 37)
    c.step([(1, 20), (0, 3)])
    for src, dst in ((1, 5), (0, 6)):
        length = c.ref.length(src)
        pages = -(-length // ps)
        meta = c.cache.get_checkpoint_metadata(src)
        shape = (1, pages, 2, hkv, ps, d)
        nan = np.full(shape, np.nan, np.float32).astype(np_group)
        groups = [tvm.runtime.tensor(nan, c.device) if src == 1 else  # the second checkpoint in host memory
                  tvm.runtime.tensor(nan) for _ in range(cfg.num_layers)]
        assert str(groups[0].dtype) == group_dtype
        k_ref, v_ref = c.ref.stored_kv(src)
        for layer, group in enumerate(groups):
            c.cache.export_page_group(src, layer, group)
            expected = np.zeros((pages * ps, 2, hkv, d))
            expected[:length, 0], expected[:length, 1] = k_ref[layer], v_ref[layer]
            expected = expected.reshape(pages, ps, 2, hkv, d).transpose(0, 2, 3, 1, 4)[None]
            if cfg.kv_dtype:  # the stored elements: exact
                stored = group.numpy().astype(np.float64) * scales
                c.expect_equal(f"page group {layer} of sequence {src} (8-bit elements)", stored.tobytes(),
                               expected.tobytes())
            else:
                c.compare(f"page group {layer} of sequence {src}", group, expected)
        c.cache.prepare_import(dst, meta)
        c.step([(0, 1)] if src != 0 else [(1, 1)])  # other sequences step during the import
        for layer in reversed(range(cfg.num_layers)):
            c.cache.import_page_group(dst, layer, groups[layer])
        c.cache.finish_import(dst)
        c.ref.fork(src, dst, length)  # the copy holds the tokens saved
    c.check_contents()
    c.step([(5, 1), (6, 1), (0, 1)])
    c.step([(5, 9), (1, 2)])
    c.check_contents()


def wl_graph_decode(c: Check, steps: int = 60) -> None:
    """Repeated decode steps of one batch replayed as a CUDA graph (`cuda_graph.DecodeGraphs`):
    fixed q / k / v and output buffers, fresh random values copied in before each step, every
    step's outputs checked against float64. The steps cross pages and, with local layers, window
    and chunk edges (the window pages change inside the fixed slots). CUDA only (a no-op on CPU)."""
    from relax_kvcache.cuda_graph import DecodeGraphs

    if c.device.dlpack_device_type() != tvm.cuda().dlpack_device_type():
        return
    cfg = c.cfg
    hq, hkv, d = cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim
    for seq in range(3):
        c.add(seq)
    c.step([(0, 37), (1, 70), (2, 5)])
    batch = [(0, 1), (1, 1), (2, 1)]
    qkvs = [tvm.runtime.empty((3, hq + 2 * hkv, d), cfg.dtype, c.device) for _ in range(cfg.num_layers)]
    outs = [tvm.runtime.empty((3, hq, d), cfg.dtype, c.device) for _ in range(cfg.num_layers)]

    def forward() -> None:
        for layer in range(cfg.num_layers):
            c.cache.attention_with_fused_qkv(layer, qkvs[layer], outs[layer], c.sm_scale)

    graphs, runs = DecodeGraphs(c.cache), {}
    with graphs.stream_context():
        for _ in range(steps):
            host = [c.qkv_values(3).astype(c.np_dtype) for _ in range(cfg.num_layers)]
            for layer in range(cfg.num_layers):
                qkvs[layer].copyfrom(host[layer])
                outs[layer].copyfrom(np.full((3, hq, d), np.nan, c.np_dtype))
            c.cache.begin_forward([s for s, _ in batch], [n for _, n in batch])
            how = graphs.run(forward)
            c.cache.end_forward()
            graphs.synchronize()
            runs[how] = runs.get(how, 0) + 1
            expected = c.ref.step(batch, [h.astype(np.float64) for h in host], c.sm_scale)
            c.steps += 1
            for layer in range(cfg.num_layers):
                c.compare(f"graph step {c.steps} ({how}) layer {layer}", outs[layer], expected[layer])
    graphs.close()
    if runs.get("replayed", 0) < steps // 2:
        c.problems.append(f"graph_decode: too few replays {runs}")
    c.check_contents()


def wl_prefix_cache(c: Check) -> None:
    """Prefix caching (a config with ``prefix_caching`` and a host tier): hits on a live and on
    a released sequence's pages, decode filling pages, a fork and a pop into a shared cached
    page (copy-on-write); then the cache filled until those pages go to the host tier, and a
    prompt that brings them back. Every output against the reference."""
    ps, rng = c.cfg.page_size, c.rng

    def ids(n: int) -> List[int]:
        return rng.integers(0, 32000, n).tolist()

    system, source = ids(5 * ps + 3), 100  # the reference keeps the system prompt's K/V as "sequence" 100
    c.add(0)
    c.step([(0, len(system))], token_ids=system)
    c.ref.fork(0, source, -1)
    c.ghosts.add(source)
    first = system[:3 * ps] + ids(7)
    c.add_cached(1, first, source, 3 * ps)  # three whole pages, live in sequence 0
    c.step([(1, 7)], token_ids=first[3 * ps:])
    for _ in range(ps):  # decode: sequence 1's fourth page fills and registers
        c.step([(0, 1), (1, 1)], token_ids=ids(2))
    c.fork(1, 2, 3 * ps + 5)
    c.popn(0, c.ref.length(0) - (3 * ps - 4))  # into the third page, shared with 1 and 2: copied first
    c.step([(0, 5), (2, 3)], token_ids=ids(8))
    c.check_contents()
    for seq in (0, 1, 2):
        c.release(seq)
    c.add_cached(3, system[:4 * ps + 1], source, 4 * ps)  # all released: their pages stay cached
    c.step([(3, 1)], token_ids=system[4 * ps:4 * ps + 1])
    c.release(3)
    c.add(4)  # fill the cache without ids: every cached page is evicted to the host tier
    while c.cache.get_num_available_pages():
        c.step([(4, min(c.cfg.prefill_chunk_size, c.cache.get_num_available_pages() * ps))])
    c.remove(4)
    stats = c.cache.prefix_cache_stats()
    if stats["spilled_pages"] < 4 or stats["evictable_pages"]:
        c.problems.append(f"prefix_cache: cached pages did not all go to the host tier: {stats}")
    c.add_cached(5, system[:4 * ps] + ids(3), source, 4 * ps)  # back from the host
    c.step([(5, 3)], token_ids=ids(3))
    c.step([(5, 1)], token_ids=ids(1))
    c.check_contents()
    stats = c.cache.prefix_cache_stats()
    if stats["loaded_pages"] < 4:
        c.problems.append(f"prefix_cache: the hit did not load from the host tier: {stats}")


WORKLOADS: Dict[str, Callable[[Check], None]] = {
    "prefix_cache": wl_prefix_cache,
    "graph_decode": wl_graph_decode,
    "long_context": wl_long_context,
    "checkpoint": wl_checkpoint,
    "random": wl_random,
    "prefix_chain": wl_prefix_chain,
    "token_tree": wl_token_tree,
    "self_cross_merge": wl_self_cross_merge,
    "seq_windows": wl_seq_windows,
    "layer_windows": wl_layer_windows,
    "shared_kv": wl_shared_kv,
}


# ----------------------------------------------------------------------------- driver

@dataclasses.dataclass
class Case:
    """One configuration to check: its config, workloads and kernels (None: failed to load)."""

    name: str
    config: rk.KVCacheConfig
    workloads: List[str]
    kernels: Optional[rk.KernelSet]
    error: str = ""


def cases_from_libs(libs: pathlib.Path, device: tvm.runtime.Device) -> List[Case]:
    """Configurations and kernels from a folder prepared by ``gpu_prepare.py``."""
    manifest = gp.read_manifest(libs)
    modules: Dict[str, rk.KernelSet] = {}
    cases = []
    for name, entry in manifest["check"].items():
        config = gp.config_from_json(entry["config"])
        file, kernels, error = entry["library"], None, ""
        if file is None:
            error = f"library not built: {entry.get('error')}"
        else:
            try:
                if file not in modules:
                    modules[file] = rk.KernelSet.from_module(gp.load_library(libs / file, device))
                kernels = modules[file]
            except Exception as err:  # noqa: BLE001
                error = f"loading {file}: {type(err).__name__}: {err}"
        cases.append(Case(name, config, list(entry["workloads"]), kernels, error))
    return cases


def case_with_tvm_kernels(libs: Optional[pathlib.Path], device: tvm.runtime.Device) -> Case:
    """Our cache with TVM's kernels of the benchmark shape (8 layers, as TVM's ``debug_get_kv``
    was built): tells harness or cache-logic problems on a device apart from kernel problems."""
    from native_baseline import create_args

    shape = gp.BENCH_SHAPE
    workloads = ["random", "prefix_chain", "token_tree", "self_cross_merge"]
    try:
        if libs is None:
            module = gp.build_tvm(shape, gp.make_target("llvm", ""))
        else:
            bench = gp.read_manifest(libs)["bench"]
            shape = gp.shape_from_json(bench["shape"])
            if not bench.get("tvm"):
                raise RuntimeError("the manifest has no TVM library")
            module = gp.load_library(libs / bench["tvm"], device)
        shape = dataclasses.replace(shape, max_num_seqs=16, max_total_seq_len=2048, prefill_chunk_size=128)
        kernels = rk.KernelSet.from_creation_args(create_args(shape, gp.tvm_kernel_dict(module)))
        return Case("tvm-kernels", shape.our_config(), workloads, kernels)
    except Exception as err:  # noqa: BLE001
        return Case("tvm-kernels", gp.BENCH_SHAPE.our_config(), workloads, None, f"{type(err).__name__}: {err}")


def cases_built_here(dtype: Optional[str]) -> List[Case]:
    """Configurations of ``gpu_prepare.CHECK_CONFIGS`` with CPU kernels built in process."""
    target = gp.make_target("llvm", "")
    cases = []
    for name, (fields, workloads) in gp.CHECK_CONFIGS.items():
        config = gp.config_from_json(dict(fields, dtype=dtype or fields["dtype"]))
        kernels = rk.KernelSet.from_module(rk.build_kernels(config, target))
        cases.append(Case(name, config, list(workloads), kernels))
    return cases


def run_case(case: Case, workload: str, device: tvm.runtime.Device, seed: int,
             tolerance: Optional[float]) -> Tuple[bool, str]:
    """Run one workload on a fresh cache; returns (passed, report line)."""
    label = f"{case.name:<20} {workload:<17}"
    if case.kernels is None:
        return False, f"{label} steps   0  max err      -    FAIL  {case.error}"
    tol = tolerance if tolerance is not None else DEFAULT_TOLERANCE[case.config.dtype]
    rng = np.random.default_rng([seed, sum(map(ord, case.name + workload))])
    start = time.perf_counter()
    check = None
    try:
        cache = rk.PagedAttentionKVCache(case.config, device, kernels=case.kernels)
        check = Check(cache, rng, tol)
        WORKLOADS[workload](check)
    except Exception as err:  # noqa: BLE001  (a crash is a failure of this workload only)
        tb = traceback.extract_tb(err.__traceback__)[-1]
        problem = f"{type(err).__name__}: {err} (at {pathlib.Path(tb.filename).name}:{tb.lineno})"
        if check is None:
            return False, f"{label} steps   0  max err      -    FAIL  {problem}"
        check.problems.insert(0, problem)
    seconds = time.perf_counter() - start
    passed = not check.problems
    line = (f"{label} steps {check.steps:>3}  max err {check.max_error:8.2e}  {'PASS' if passed else 'FAIL'}"
            f"  ({seconds:.1f} s)")
    if not passed:
        more = f" (+{len(check.problems) - 1} more)" if len(check.problems) > 1 else ""
        line += f"  {check.problems[0]}{more}"
    return passed, line


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--libs", type=pathlib.Path, help="folder prepared by gpu_prepare.py "
                        "(default .gpu for cuda; for cpu without it, CPU kernels are built here)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", choices=sorted(NP_DTYPE), help="override the dtype (CPU kernels built here only)")
    parser.add_argument("--tolerance", type=float, help="max abs error (default 2e-2 float16, 2e-3 float32)")
    parser.add_argument("--only", nargs="*", default=[], help="only these configurations / workloads (names)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tvm-kernels", action="store_true",
                        help="also run our cache with TVM's kernels of the benchmark shape (a harness baseline)")
    args = parser.parse_args(argv)

    device = tvm.cuda(0) if args.device == "cuda" else tvm.cpu(0)
    if args.device == "cuda" and args.libs is None:
        args.libs = gp.REPO / ".gpu"
    if args.libs is not None:
        cases = cases_from_libs(args.libs, device)
        source = f"libraries from {args.libs}"
    else:
        cases = cases_built_here(args.dtype)
        source = f"CPU kernels built here ({gp.make_target('llvm', '')})"
    if args.tvm_kernels:
        cases.append(case_with_tvm_kernels(args.libs, device))
    print(f"gpu_check on {device} ({source}), TVM {tvm.__version__}; {gp.describe_device(device)}", flush=True)
    failures = total = 0
    for case in cases:
        for workload in case.workloads:
            if args.only and case.name not in args.only and workload not in args.only:
                continue
            passed, line = run_case(case, workload, device, args.seed, args.tolerance)
            total += 1
            failures += not passed
            print(line, flush=True)
    print(f"gpu_check: {total - failures}/{total} passed" + (f", {failures} FAILED" if failures else ""))
    return 1 if failures or not total else 0


if __name__ == "__main__":
    sys.exit(main())
