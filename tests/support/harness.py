"""The harness of the cache tests and workloads: :class:`Check` drives a
``PagedAttentionKVCache`` and the float64 ``ReferenceCache`` with the same operations (add,
fork, popn, remove, windows, token trees, forward steps with random inputs and NaN-poisoned
outputs), compares the outputs and stored K/V, and records every mismatch; :class:`Harness`
fails at the first. Also the cache configurations of ``test_cache``.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import ml_dtypes
import numpy as np
import tvm

import relax_kvcache as rk
from relax_kvcache.reference import rope
from reference_model import ReferenceCache

TOLERANCE = {"float32": 2e-3, "float16": 2e-2, "bfloat16": 8e-2}
NP_DTYPE = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
GRID_SCALES = (0.25, 2.0)  # K and V scales of caches over 8-bit pages
EMPTY_LSE = -5e4  # log-sum-exp at or below this means "no visible key"


def make_config(**overrides) -> rk.KVCacheConfig:
    base = dict(num_layers=2, num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, max_num_seqs=16,
                max_total_seq_len=1536, prefill_chunk_size=96, rope_mode=rk.RopeMode.NORMAL,
                rope_theta=1e4, rope_scale=1.0, dtype="float32")
    base.update(overrides)
    return rk.KVCacheConfig(**base)


CONFIGS = {
    "fp32-gqa-normal": make_config(),
    "fp32-mqa-inline-d128": make_config(num_qo_heads=4, num_kv_heads=1, head_dim=128, rope_mode=rk.RopeMode.INLINE,
                                    rope_theta=5e5, rope_scale=0.5),
    "fp16-mha-none": make_config(num_qo_heads=4, num_kv_heads=4, dtype="float16", rope_mode=rk.RopeMode.NONE),
    "bf16-gqa-normal": make_config(dtype="bfloat16"),
    "fp32-sliding-support-inline": make_config(support_sliding_window=True, rope_mode=rk.RopeMode.NORMAL),
    "fp32-d96-page8": make_config(num_qo_heads=6, num_kv_heads=3, head_dim=96, page_size=8, rope_mode=rk.RopeMode.INLINE),
    "fp32-d256": make_config(num_qo_heads=2, num_kv_heads=1, head_dim=256, num_layers=1),
}


class Check:
    """Drives a cache and the reference with the same operations and records every mismatch
    (:class:`Harness`: fails at the first).

    Parameters
    ----------
    cache : PagedAttentionKVCache
        The cache under test (on any device).
    rng : numpy.random.Generator
        Source of the random inputs.
    tolerance : float, optional
        Largest accepted absolute error (default: :data:`TOLERANCE` of the cache dtype).
    """

    def __init__(self, cache: rk.PagedAttentionKVCache, rng: np.random.Generator,
                 tolerance: Optional[float] = None) -> None:
        cfg = cache.config
        self.cache, self.cfg, self.rng = cache, cfg, rng
        self.tolerance = TOLERANCE[cfg.dtype] if tolerance is None else tolerance
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

    def problem(self, message: str) -> None:
        """Record a mismatch."""
        self.problems.append(message)

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
            self.problem(f"{what}: shape {value.shape}, expected {expected.shape}")
            return
        if np.isnan(value).any():
            self.problem(f"{what}: {int(np.isnan(value).sum())} of {value.size} values are NaN "
                                 "(not written, or computed as NaN)")
            return
        finite = np.isfinite(expected)
        if not np.array_equal(value[~finite], expected[~finite]) or not np.isfinite(value[finite]).all():
            self.problem(f"{what}: infinities where the reference has none, or the other way round")
            return
        error = float(np.abs(value[finite] - expected[finite]).max(initial=0.0))
        self.max_error = max(self.max_error, error)
        if error > self.tolerance:
            self.problem(f"{what}: max abs error {error:.3g} > {self.tolerance:g}")

    def expect_equal(self, what: str, got, expected) -> None:
        if not np.array_equal(np.asarray(got), np.asarray(expected)):
            self.problem(f"{what}: got {np.asarray(got).tolist()}, expected {np.asarray(expected).tolist()}")

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


class Harness(Check):
    """:class:`Check` that fails at the first mismatch (an ``AssertionError`` naming it)."""

    def problem(self, message: str) -> None:
        raise AssertionError(message)


def layer_window_config(**overrides) -> rk.KVCacheConfig:
    """``make_config`` with per-layer windows: layers 0 and 2 ``MHA_SLIDING`` (window 20), 3 layers."""
    base = dict(num_layers=3, page_size=8, layer_sliding_window_size=20, max_total_seq_len=2048,
                prefill_chunk_size=128,
                attn_kinds=[rk.AttnKind.MHA_SLIDING, rk.AttnKind.MHA, rk.AttnKind.MHA_SLIDING])
    base.update(overrides)
    return make_config(**base)
