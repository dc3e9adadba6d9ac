"""Check a kernel set against the config of the cache that would run it.

``check_kernels`` runs at the start of ``PagedAttentionKVCache.__init__``, before the cache
allocates anything. Every set must have the kernels the config's steps call. Our kernel
libraries name the config they were built for (``KernelSet.identity``, ``build.kernel_identity``),
which must be this one; kernels passed through TVM's creation arguments (TVM's own, or ours
compiled into a model's module by the frontend) carry no such record and are probed: each page
kernel the cache calls in the middle of a mutating operation runs on two random pages, where the
right answer is known, so kernels of another shape or dtype fail here with a `ConfigError`
instead of halfway through a fork, a commit or a step; then a small probe cache built on the set
drives a probe sequence through a few steps, so that every attention kernel has run on its
tensors (a decode step's attention, which follows the step's append, cannot fail later).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import tvm

from .build import kernel_identity
from .config import KVCacheConfig, RopeMode
from .errors import ConfigError
from .kernel_set import KernelSet, split_rotary_rope_argument
from .tensors import row_view, view
from .attention_probe import (ProbeCache, exact_random, host_tensor, page_slot, probe_attention, recording, summary,
                              write_values)


def check_kernels(config: KVCacheConfig, kernels: KernelSet, device: tvm.runtime.Device,
                  new_cache: Callable[[KVCacheConfig, KernelSet], ProbeCache]) -> KVCacheConfig:
    """Refuse kernels a cache of ``config`` cannot run on; return the config to build it with.

    ``new_cache(config, kernels)`` builds an unchecked cache for the probe. An MLA config
    without decompressed head dims gets those the foreign kernels accept.

    Raises
    ------
    ConfigError
        Our kernels built for another config, a kernel the config's steps call is missing, or a
        foreign kernel fails its probe (see the module docstring).
    """
    if kernels.identity is not None:
        _check_kernels_match(config, kernels.identity)
    _check_required_kernels(config, kernels)
    if kernels.identity is not None:  # ours, built for this config
        return config
    if config.is_mla and config.mla_original_qk_head_dim is None:
        config = _with_kernel_head_dims(config, kernels, device)
    probe_config = _small(config)
    # a set with the prefixed prefill kernel is probed without it first (ragged + paged + merge,
    # the path of the steps it does not serve), then with it
    passes = [kernels]
    if kernels.attention_prefill_prefixed is not None:
        passes.insert(0, dataclasses.replace(kernels, attention_prefill_prefixed=None))
    for i, kernel_set in enumerate(passes):
        calls: List[str] = []
        probe = new_cache(probe_config, recording(kernel_set, calls))  # roles each step calls
        if i == 0:
            probe_foreign_kernels(probe_config, kernels, probe.pages[0], device)
        probe_attention(probe, kernels, calls)
    return config


def _small(config: KVCacheConfig) -> KVCacheConfig:
    """``config`` with a pool of about 16 pages (enough for every probe step), when it has more."""
    small = dataclasses.replace(config, max_total_seq_len=min(config.max_total_seq_len, 15 * config.page_size),
                                max_num_seqs=1)
    return small if 16 <= small.num_total_pages <= config.num_total_pages else config


def _check_kernels_match(config: KVCacheConfig, built_for: Tuple[Tuple[str, float], ...]) -> None:
    """Refuse kernels built for another configuration (they would read pages of another shape)."""
    expected = kernel_identity(config)
    differ = [f"{name} {value!r} (kernels) vs {expected[name]!r} (config)" for name, value in built_for
              if value != expected[name]]
    if differ:
        raise ConfigError("the kernels were built for another configuration: " + "; ".join(differ)
                          + " (dtype as its index in ('float32', 'float16', 'bfloat16')); build them for this "
                          "config with relax_kvcache.build_kernels(config, target)")


def _check_required_kernels(config: KVCacheConfig, kernels: KernelSet) -> None:
    """Refuse a kernel set without a kernel every step of this config calls (e.g. TVM's creation
    arguments with None), before any step could append K/V and then fail."""
    if config.is_mla:
        roles = ["transpose_append_mla", "attention_prefill_mla", "attention_prefill_ragged"]
    else:
        roles = ["transpose_append", "split_rotary", "attention_prefill_ragged", "attention_prefill",
                 "attention_decode"]
        if config.slides_sequences or config.has_layer_windows:
            roles += ["attention_prefill_sliding_window", "attention_decode_sliding_window"]
        if config.layer_span.chunk:  # the plain ragged kernel cannot split a step at chunk boundaries
            roles += ["attention_prefill_ragged_sliding_window"]
    roles += ["copy_single_page", "merge_inplace", "merge_general"]
    missing = kernels.missing(roles)
    if missing:
        raise ConfigError(f"the kernel set has no {', '.join(missing)} kernel(s), which a cache with this config "
                          "calls in every step; pass them (or let the cache build its own; TVM has no kernels for "
                          "MHA_CHUNKED_LOCAL layers)")


def _with_kernel_head_dims(config: KVCacheConfig, kernels: KernelSet, device: tvm.runtime.Device) -> KVCacheConfig:
    """An MLA config without decompressed head dims, given the dims its foreign kernels accept."""
    qk, v = decompressed_head_dims(config, kernels, device)
    try:
        return dataclasses.replace(config, mla_original_qk_head_dim=qk, mla_original_v_head_dim=v)
    except ConfigError as err:
        raise ConfigError(f"the kernels' decompressed head dims (q / k {qk}, v {v}, the dims the ragged kernel "
                          f"and merge_general accept) do not fit this config: {err}") from None


# token positions of the split_rotary probe (rotations by different angles)
_PROBE_POSITIONS = (7, 1000)


def probe_foreign_kernels(config: KVCacheConfig, kernels: KernelSet, pages: tvm.runtime.Tensor,
                          device: tvm.runtime.Device) -> None:
    """Run the page kernels on pages 0 and 1 (free now) and ``split_rotary``, checking results.

    Pages 0 and 1 are filled with random values; the append writes one token to slot 0 of
    page 0, the single-page copy copies page 0 to page 1, the compact copy moves page 1's last
    slot to page 0's slot 0; after each, both pages must hold exactly what that move gives.

    Raises
    ------
    ConfigError
        A kernel raises on this cache's tensors, or its result is wrong: a page kernel moves
        other values (or none), ``split_rotary`` does not copy v or changes the length of q / k
        head vectors (RoPE only rotates them).
    """
    probe = _PageProbe(config, kernels, pages, device)
    probes: List[Tuple[str, Callable[[], None]]] = []
    if config.is_mla:
        if kernels.transpose_append_mla is not None:
            probes.append(("transpose_append_mla", probe.append))
    else:
        probes.append(("transpose_append", probe.append))
    probes.append(("copy_single_page", probe.copy_page))
    if kernels.compact_copy is not None:
        probes.append(("compact_copy", probe.compact_copy))
    if not config.is_mla:
        probes.append(("split_rotary", lambda: _probe_split_rotary(config, kernels, device)))
    shape = "x".join(map(str, pages.shape))
    probe.fill()
    for role, run in probes:
        try:
            run()
        except ConfigError:
            raise
        except Exception as err:  # noqa: BLE001 - any failure of a foreign kernel
            text = summary(err)
            longrope = (" and the rope_ext_factors tensor as its last argument (TVM's LongRoPE convention)"
                        if role == "split_rotary" and config.rope_ext_factors is not None else "")
            raise ConfigError(f"{kernels.origin(role)}the {role} kernel fails on this cache's tensors ({config.dtype} "
                              f"pages of shape {shape}{longrope}; {type(err).__name__}: {text}); expected kernels "
                              "built for this config") from err


#: Largest decompressed head dim :func:`decompressed_head_dims` looks for (DeepSeek-V3: 192 / 128).
MAX_PROBED_HEAD_DIM = 1024


def decompressed_head_dims(config: KVCacheConfig, kernels: KernelSet,
                           device: tvm.runtime.Device) -> Tuple[int, int]:
    """The decompressed ``(qk, v)`` head dims of a foreign MLA kernel set (TVM's creation
    arguments do not carry them): ``v`` is the head dim ``merge_general`` accepts, ``qk`` the
    one ``attention_prefill_ragged`` accepts with that ``v``.

    A compiled kernel checks its arguments' shapes before it runs, so a call with another head
    dim raises and touches nothing; the calls are on tensors of one token made here, trying
    every dim from 1 up to :data:`MAX_PROBED_HEAD_DIM`.

    Raises
    ------
    ConfigError
        No head dim up to :data:`MAX_PROBED_HEAD_DIM` is accepted.
    """
    hq, dtype, widest = config.num_qo_heads, config.dtype, MAX_PROBED_HEAD_DIM
    wide = [host_tensor(np.zeros((hq * widest,)), dtype, device) for _ in range(2)]
    lse = [host_tensor(np.zeros((1, hq)), "float32", device) for _ in range(2)]
    ints = {v: tvm.runtime.tensor(np.array(v, dtype=np.int32), device) for v in ((0, 1), (0,))}

    def per_head(i: int, dim: int) -> tvm.runtime.Tensor:
        return view(wide[i], (1, hq, dim))

    def merge(dim: int) -> None:
        kernels.merge_general(per_head(0, dim), lse[0], per_head(1, dim), lse[1])

    v_dim = _first_accepted(merge, range(1, widest + 1))
    if v_dim is None:
        raise ConfigError(f"the merge_general kernel accepts no state of head dim 1 to {widest} ({dtype}, "
                          f"{hq} heads); expected TVM's second merge function, at the decompressed v head dim")
    v_buf = [host_tensor(np.zeros((1, hq, v_dim)), dtype, device) for _ in range(2)]

    def ragged(dim: int) -> None:
        kernels.attention_prefill_ragged(per_head(0, dim), ints[(0, 1)], per_head(1, dim), v_buf[0], ints[(0, 1)],
                                         ints[(0,)], ints[(0,)], v_buf[1], lse[0], 1, 0, 1.0, 1e4, 1.0)

    qk_dim = _first_accepted(ragged, range(1, widest + 1))
    if qk_dim is None:
        raise ConfigError(f"the attention_prefill_ragged kernel accepts no q / k head dim from 1 to {widest} with "
                          f"v head dim {v_dim} (merge_general's; {dtype}, {hq} heads); expected the ragged "
                          "kernel and merge functions of one MLA config")
    return qk_dim, v_dim


def _first_accepted(call: Callable[[int], None], dims: Sequence[int]) -> Optional[int]:
    """The first dim for which ``call(dim)`` does not raise."""
    for dim in dims:
        try:
            call(dim)
        except Exception:  # noqa: BLE001 - a foreign kernel refusing the shape
            continue
        return dim
    return None


class _PageProbe:
    """Pages 0 and 1 of a layer's page tensor, their expected contents, and the page kernels'
    probes (each runs a kernel, updates the expected contents and compares)."""

    def __init__(self, config: KVCacheConfig, kernels: KernelSet, pages: tvm.runtime.Tensor,
                 device: tvm.runtime.Device) -> None:
        self.config, self.kernels, self.device = config, kernels, device
        self.pages = pages
        self.views = [row_view(pages, i) for i in (0, 1)]
        self.rng = np.random.default_rng(2)
        self.want = [exact_random(self.rng, tuple(pages.shape[1:])) for _ in (0, 1)]

    def fill(self) -> None:
        for page, values in zip(self.views, self.want):
            write_values(page, values, self.config.dtype)

    def slot(self, page: np.ndarray, slot: int) -> np.ndarray:
        return page_slot(page, slot, is_mla=self.config.is_mla)

    def append(self) -> None:
        """Append one token to position 0 (page 0, slot 0)."""
        cfg, position = self.config, tvm.runtime.tensor(np.zeros(1, dtype=np.int32), self.device)
        if cfg.is_mla:
            kv = exact_random(self.rng, (1, cfg.head_dim))
            self.kernels.transpose_append_mla(self.pages, host_tensor(kv, cfg.dtype, self.device), position)
            self.slot(self.want[0], 0)[...] = kv[0]
        else:
            k, v = (exact_random(self.rng, (1, cfg.num_kv_heads, d)) for d in (cfg.head_dim, cfg.v_head_dim))
            self.kernels.transpose_append(self.pages, host_tensor(k, cfg.dtype, self.device),
                                          host_tensor(v, cfg.dtype, self.device), position)
            self.slot(self.want[0], 0)[...] = np.stack([k[0], v[0]])
        role = "transpose_append_mla" if cfg.is_mla else "transpose_append"
        self.expect(role, "write one token's K/V to its position (and nothing else)")

    def copy_page(self) -> None:
        self.kernels.copy_single_page(self.pages, 0, 1, self.config.page_size)
        self.want[1] = self.want[0].copy()
        self.expect("copy_single_page", "copy page 0 to page 1")

    def compact_copy(self) -> None:
        """Move page 1's last slot to page 0's slot 0 (page 1 refilled first)."""
        ps = self.config.page_size
        self.want[1] = exact_random(self.rng, self.want[1].shape)
        write_values(self.views[1], self.want[1], self.config.dtype)
        indptr = tvm.runtime.tensor(np.array([0, 1], dtype=np.int32), self.device)
        positions = tvm.runtime.tensor(np.array([[2 * ps - 1], [0]], dtype=np.int32), self.device)
        self.kernels.compact_copy(self.pages, indptr, positions, 1)
        self.slot(self.want[0], 0)[...] = self.slot(self.want[1], ps - 1)
        self.expect("compact_copy", f"move position {2 * ps - 1} to position 0")

    def expect(self, role: str, what: str) -> None:
        for i, (page, want) in enumerate(zip(self.views, self.want)):
            got = page.numpy().astype(np.float64)
            if not np.array_equal(got, want):
                wrong = int(np.count_nonzero(got != want))
                raise ConfigError(f"{self.kernels.origin(role)}the {role} kernel does not {what}: {wrong} values of "
                                  f"page {i} differ from "
                                  "the expected result; expected kernels built for this config")


def _probe_split_rotary(config: KVCacheConfig, kernels: KernelSet, device: tvm.runtime.Device) -> None:
    """Split a random fused QKV of two tokens: v must be copied; q and k copied (no RoPE at
    append time) or rotated. Any rotation passes, each head vector keeping its length: with
    RoPE at append time the kernel defines the rotation (as in TVM: it may implement Llama-3
    frequency scaling or a partial rotary dim, which the config does not describe). With
    LongRoPE factors the kernel gets them (TVM's convention) and may scale every head vector by
    one attention factor (positive, the same for all)."""
    hq, hkv, d = config.num_qo_heads, config.num_kv_heads, config.head_dim
    qkv = exact_random(np.random.default_rng(0), (len(_PROBE_POSITIONS), hq + 2 * hkv, d))
    tensors = [host_tensor(qkv, config.dtype, device)]
    tensors.append(tvm.runtime.tensor(np.array(_PROBE_POSITIONS, dtype=np.int32), device))
    n = len(_PROBE_POSITIONS)
    tensors += [tvm.runtime.empty((n, h, d), config.dtype, device) for h in (hq, hkv, hkv)]
    applies_rope = config.effective_rope_mode == RopeMode.NORMAL
    kernels.split_rotary(*tensors, split_rotary_rope_argument(config, device))
    q, k, v = (t.numpy().astype(np.float64) for t in tensors[2:])
    given = {"q": qkv[:, :hq], "k": qkv[:, hq:hq + hkv], "v": qkv[:, hq + hkv:]}
    tol = 1e-3 if config.dtype == "float32" else 5e-2
    kernel = kernels.origin("split_rotary") + "the split_rotary kernel"
    ratios = {}
    rotary = config.rotary_dim  # a partial rotary dim: the features past it are copied
    for name, got in (("q", q), ("k", k), ("v", v)):
        if name == "v" or not applies_rope:
            _expect_close(kernel, f"{name} (a copy of the fused input)", got, given[name], tol)
            continue
        if rotary < d:
            _expect_close(kernel, f"{name} past the rotary dim {rotary} (a copy)", got[..., rotary:],
                          given[name][..., rotary:], tol)
        ratios[name] = (np.linalg.norm(got[..., :rotary], axis=-1)
                        / np.maximum(np.linalg.norm(given[name][..., :rotary], axis=-1), 1e-6))
    if ratios:  # a rotation: every head vector keeps its length (times LongRoPE's attention factor)
        factor = 1.0
        if config.rope_ext_factors is not None:
            factor = float(np.median(ratios["q"]))
            if not factor > 0:
                raise ConfigError(f"{kernel} does not compute q as a rotation: head vectors scaled by "
                                  f"{factor:.3g}; expected kernels built for this config")
        for name, ratio in ratios.items():
            _expect_close(kernel, f"{name} as a rotation (head vectors keep their length"
                          + (f", times {factor:.4g}" if factor != 1.0 else "") + ")",
                          ratio / factor, np.ones_like(ratio), tol)


def _expect_close(kernel: str, what: str, got: np.ndarray, want: np.ndarray, tol: float) -> None:
    err = float(np.abs(got - want).max())
    if not err <= tol:
        raise ConfigError(f"{kernel} does not compute {what}: max error {err:.3g}; expected kernels "
                          "built for this config")

