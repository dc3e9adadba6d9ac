"""Check kernels that carry no record of their config before a cache relies on them.

Our kernel libraries name the config they were built for (``build.kernel_identity``); kernels
passed through TVM's creation arguments (TVM's own, or ours compiled into a model's module by
the frontend) do not. A cache built on them runs each kernel it calls in the middle of a
mutating operation once at construction, on inputs where the right answer is known, so kernels
of another shape or dtype fail there with a `ConfigError` instead of halfway through a fork, a
commit or a step; then it drives a probe sequence through a few steps, so that every attention
kernel it calls has run on its tensors (and a decode step's attention, which follows the step's
append, cannot fail later on a mismatched kernel), and clears itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
import tvm

from .config import KVCacheConfig, RopeMode
from .errors import ConfigError
from .kernel_set import KernelSet, split_rotary_rope_argument
from .tensors import numpy_dtype, row_view, view

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
            summary = _summary(err)
            longrope = (" and the rope_ext_factors tensor as its last argument (TVM's LongRoPE convention)"
                        if role == "split_rotary" and config.rope_ext_factors is not None else "")
            raise ConfigError(f"{kernels.origin(role)}the {role} kernel fails on this cache's tensors ({config.dtype} "
                              f"pages of shape {shape}{longrope}; {type(err).__name__}: {summary}); expected kernels "
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
    wide = [_tensor(np.zeros((hq * widest,)), dtype, device) for _ in range(2)]
    lse = [_tensor(np.zeros((1, hq)), "float32", device) for _ in range(2)]
    ints = {v: tvm.runtime.tensor(np.array(v, dtype=np.int32), device) for v in ((0, 1), (0,))}

    def per_head(i: int, dim: int) -> tvm.runtime.Tensor:
        return view(wide[i], (1, hq, dim))

    def merge(dim: int) -> None:
        kernels.merge_general(per_head(0, dim), lse[0], per_head(1, dim), lse[1])

    v_dim = _first_accepted(merge, range(1, widest + 1))
    if v_dim is None:
        raise ConfigError(f"the merge_general kernel accepts no state of head dim 1 to {widest} ({dtype}, "
                          f"{hq} heads); expected TVM's second merge function, at the decompressed v head dim")
    v_buf = [_tensor(np.zeros((1, hq, v_dim)), dtype, device) for _ in range(2)]

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


def _summary(err: Exception) -> str:
    """An exception's message on one line, at most 200 characters (TVM's span several lines)."""
    text = " ".join(str(err).split())
    return text if len(text) <= 200 else text[:197] + "..."


class _PageProbe:
    """Pages 0 and 1 of a layer's page tensor, their expected contents, and the page kernels'
    probes (each runs a kernel, updates the expected contents and compares)."""

    def __init__(self, config: KVCacheConfig, kernels: KernelSet, pages: tvm.runtime.Tensor,
                 device: tvm.runtime.Device) -> None:
        self.config, self.kernels, self.device = config, kernels, device
        self.pages = pages
        self.views = [row_view(pages, i) for i in (0, 1)]
        self.rng = np.random.default_rng(2)
        self.want = [_exact_random(self.rng, tuple(pages.shape[1:])) for _ in (0, 1)]

    def fill(self) -> None:
        for page, values in zip(self.views, self.want):
            _write(page, values, self.config.dtype)

    def slot(self, page: np.ndarray, slot: int) -> np.ndarray:
        return _slot(page, slot, is_mla=self.config.is_mla)

    def append(self) -> None:
        """Append one token to position 0 (page 0, slot 0)."""
        cfg, position = self.config, tvm.runtime.tensor(np.zeros(1, dtype=np.int32), self.device)
        if cfg.is_mla:
            kv = _exact_random(self.rng, (1, cfg.head_dim))
            self.kernels.transpose_append_mla(self.pages, _tensor(kv, cfg.dtype, self.device), position)
            self.slot(self.want[0], 0)[...] = kv[0]
        else:
            k, v = (_exact_random(self.rng, (1, cfg.num_kv_heads, d)) for d in (cfg.head_dim, cfg.v_head_dim))
            self.kernels.transpose_append(self.pages, _tensor(k, cfg.dtype, self.device),
                                          _tensor(v, cfg.dtype, self.device), position)
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
        self.want[1] = _exact_random(self.rng, self.want[1].shape)
        _write(self.views[1], self.want[1], self.config.dtype)
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
    qkv = _exact_random(np.random.default_rng(0), (len(_PROBE_POSITIONS), hq + 2 * hkv, d))
    tensors = [_tensor(qkv, config.dtype, device)]
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


def _tensor(values: np.ndarray, dtype: str, device: tvm.runtime.Device) -> tvm.runtime.Tensor:
    out = tvm.runtime.empty(values.shape, dtype, device)
    _write(out, values, dtype)
    return out


def _write(tensor: tvm.runtime.Tensor, values: np.ndarray, dtype: str) -> None:
    """Copy host ``values`` (any float dtype) into ``tensor`` of cache dtype ``dtype``."""
    tensor.copyfrom(values.astype(numpy_dtype(dtype)))


def _slot(page: np.ndarray, slot: int, *, is_mla: bool) -> np.ndarray:
    """A slot's values in a page's host array (latent ``(ps, W)``, MHA ``(2, H, ps, D)``)."""
    return page[slot] if is_mla else page[:, :, slot]


def probe_foreign_attention(cache: Any) -> None:
    """Run the attention kernels of a fresh cache once, through its own API, then clear it.

    A probe sequence takes a decode step of one token, a prefill step over that prefix that
    crosses into a second page (pages of at most 256 tokens), another decode step and, where the
    cache takes them, a token-tree step, as far as the page pool and the chunk size allow; one
    layer of each attention kind attends in each. Decode and prefill outputs must match float64
    attention over the K/V stored in the pages where the host can tell the queries the kernels
    see (RoPE NONE or NORMAL, MLA, and any one-key decode); the others must be finite.
    ``merge_attn_output_inplace`` merges two states of different LSE. ``clear()`` then restores
    the fresh state (free list order included).

    Raises
    ------
    ConfigError
        A kernel raises on this cache's tensors, writes a non-finite output, or an output
        differs from float64 attention (or the merge from its float64 value).
    """
    cfg = cache.config
    rng = np.random.default_rng(1)
    # TVM's windowed prefill kernel gives NaN for a query whose window holds no cached token (a
    # chunk as long as the window over a prefix): keep the prefill step shorter than the window
    window_limit = cache._unwindowed_chunk_limit
    steps = _probe_steps(cfg, tree=cache._token_tree_refusal() is None,
                         max_length=max(1, window_limit - 1) if window_limit else cfg.prefill_chunk_size)
    layers = sorted({cfg.attn_kinds.index(kind) for kind in cfg.attn_kinds})
    run = _probe_mla_step if cfg.is_mla else _probe_mha_step
    kernels, calls = cache._kernels, []
    cache._kernels = _recording(kernels, calls)  # the roles each step calls, for error messages
    try:
        # a set with the prefixed prefill kernel is probed without it (ragged + paged + merge, the
        # path of the steps it does not serve), then with it
        for prefixed in ((False, True) if kernels.attention_prefill_prefixed is not None else (True,)):
            cache._prefixed_enabled = prefixed
            _probe_steps_once(cache, rng, steps, layers, run, kernels, calls)
    finally:
        cache._kernels = kernels
        cache._prefixed_enabled = True


def _recording(kernels: KernelSet, calls: List[str]) -> KernelSet:
    """``kernels`` with each kernel wrapped to append its role to ``calls`` before it runs."""
    def wrap(role: str, kernel: Callable) -> Callable:
        def call(*args: Any) -> Any:
            calls.append(role)
            return kernel(*args)
        return call

    return dataclasses.replace(kernels, **{field.name: wrap(field.name, getattr(kernels, field.name))
                                           for field in dataclasses.fields(kernels)
                                           if field.init and callable(getattr(kernels, field.name))})


def _called(kernels: KernelSet, calls: List[str]) -> str:
    """The kernels of the failing step, with their creation arguments where known."""
    roles = list(dict.fromkeys(calls))
    named = [f"{role} = creation {kernels.source(role)}" if kernels.source(role) else role for role in roles]
    return "; kernels of that step: " + ", ".join(named) if named else ""


def _probe_steps_once(cache: Any, rng: np.random.Generator, steps, layers: Sequence[int], run: Callable,
                      kernels: KernelSet, calls: List[str]) -> None:
    """One pass of :func:`probe_foreign_attention`'s steps on a fresh cache, cleared after."""
    cache.add_sequence(0)
    tree: Optional[Tuple[int, List[int]]] = None  # (committed length, parents of every tree node so far)
    try:
        for length, parents in steps:
            calls.clear()
            if parents is not None:
                tree = (cache.get_sequence_length(0), []) if tree is None else tree
                tree[1].extend(parents)
            cache.begin_forward([0], [length], parents)
            try:
                for layer in layers:
                    _poison_scratch(cache, length)
                    run(cache, rng, layer, _visible(cache.get_sequence_length(0), length, tree))
            finally:
                cache.end_forward()
        calls.clear()
        _probe_debug_get_kv(cache, layers)
        _probe_merge(cache, rng)
    except ConfigError as err:
        if kernels.sources is None or not calls:
            raise
        raise ConfigError(f"{err}{_called(kernels, calls)}") from err
    except Exception as err:  # noqa: BLE001 - any failure of a foreign kernel
        summary = _summary(err)
        which = f"{kernels.origin(calls[-1])}the {calls[-1]} kernel" if calls else "an attention kernel"
        raise ConfigError(f"{which} fails on this cache's tensors ({type(err).__name__}: {summary}); "
                          "expected kernels built for this config") from err
    finally:
        cache.clear()


def _probe_steps(cfg: KVCacheConfig, *, tree: bool, max_length: int) -> List[Tuple[int, Optional[Sequence[int]]]]:
    """(length, token-tree parents) of the probe steps that fit in the pool, the chunk size
    and ``max_length``; the tree last, as it stays uncommitted: two roots, then a child of the
    first in a second step (whose paged part holds the first step's nodes: the paged tree
    kernel)."""
    capacity, ps = cfg.num_total_pages * cfg.page_size, cfg.page_size
    prefill = max(1, min(cfg.prefill_chunk_size, max_length, ps + 1 if ps <= 256 else 2, capacity - 2))
    steps = [(1, None), (prefill, None), (1, None)]
    if tree and min(cfg.prefill_chunk_size, max_length) >= 2:
        steps += [(2, [-1, -1]), (1, [0])]
    kept, total = [], 0
    for length, parents in steps:
        total += length
        if total <= capacity:
            kept.append((length, parents))
    return kept


def _visible(length: int, n: int, tree: Optional[Tuple[int, List[int]]]) -> np.ndarray:
    """Which of a sequence's ``length`` stored rows each of the step's ``n`` (last) tokens sees:
    causal, or in a token tree the committed prefix and the node's ancestors and itself."""
    rows = np.arange(length)
    if tree is None:
        return rows[None, :] < np.arange(length - n + 1, length + 1)[:, None]
    base, parents = tree
    mask = np.zeros((n, length), dtype=bool)
    mask[:, :base] = True
    for i, node in enumerate(range(len(parents) - n, len(parents))):
        while node != -1:
            mask[i, base + node] = True
            node = parents[node]
    return mask


def _probe_mha_step(cache: Any, rng: np.random.Generator, layer: int, visible: np.ndarray) -> None:
    cfg = cache.config
    n = len(visible)
    hq, hkv, d = cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = _exact_random(rng, (n, hq + 2 * hkv, d))
    o = _poisoned((n, hq, d), cfg.dtype, cache.device)
    scale = _scale(rng, d)
    cache.attention_with_fused_qkv(cache.layer_offset + layer, _tensor(qkv, cfg.dtype, cache.device), o, scale)
    want = None
    k, v = _stored_rows(cache, layer)  # the step's tokens included (appended before or after attention)
    rope, span = cfg.effective_rope_mode, cfg.layer_span
    windowed = cache._windowed_layers[layer]
    if windowed and span.chunk:  # keys of the query's own chunk (rows are positions: nothing slides)
        q_pos = np.arange(len(k) - n, len(k))
        visible = visible & (np.arange(len(k))[None, :] >= span.first_visible(q_pos)[:, None])
    # a window is checked only while it spans the sequence (TVM's kernels, which the creation
    # function may pass, window the new tokens of a step per page list, not per query)
    checked = not windowed or span.chunk or span.window >= len(k)
    if len(k) == 1 or (rope != RopeMode.INLINE and checked):  # queries as the kernel sees them
        q = qkv[:, :hq] if rope == RopeMode.NONE else _rows(cache._scratch_q, n)
        group = hq // hkv
        want = _attention(q, np.repeat(k, group, axis=1), np.repeat(v, group, axis=1), scale, visible)
    _check_output("attention_with_fused_qkv", o, want, cfg.dtype, expected="float64 attention over the stored K/V")


def _probe_mla_step(cache: Any, rng: np.random.Generator, layer: int, visible: np.ndarray) -> None:
    cfg = cache.config
    n = len(visible)
    hq, width, lora = cfg.num_qo_heads, cfg.head_dim, cfg.v_head_dim
    cache.append_mla_kv(cache.layer_offset + layer, _tensor(_exact_random(rng, (n, width)), cfg.dtype, cache.device))
    q = _exact_random(rng, (n, hq, width))
    o, lse = _poisoned((n, hq, lora), cfg.dtype, cache.device), _poisoned((n, hq), "float32", cache.device)
    scale = _scale(rng, width)
    cache.cross_attention(cache.layer_offset + layer, _tensor(q, cfg.dtype, cache.device), o, lse, scale)
    # absorbed attention over the stored latent rows: a decode step's include its new token, a
    # prefill step's queries see the prefix only (self_attention covers the new tokens)
    latent = _stored_rows(cache, layer)[0][:, 0]
    keys = np.broadcast_to(latent[:, None], (len(latent), hq, width))
    seen = len(latent) if n == 1 else len(latent) - n
    want = (_attention(q, keys, keys[..., :lora], scale, np.arange(len(latent))[None, :] < seen)
            if seen else None)
    _check_output("cross_attention", o, want, cfg.dtype, expected="float64 attention over the stored latent rows")
    dqk, dv = cfg.mla_original_qk_head_dim, cfg.mla_original_v_head_dim
    q, k, v = (_exact_random(rng, (n, hq, dim)) for dim in (dqk, dqk, dv))
    scale = _scale(rng, dqk)
    o_self = _poisoned((n, hq, dv), cfg.dtype, cache.device)
    lse_self = _poisoned((n, hq), "float32", cache.device)
    cache.self_attention(cache.layer_offset + layer, *(_tensor(x, cfg.dtype, cache.device) for x in (q, k, v)),
                         o_self, lse_self, scale)
    want = _attention(q, k, v, scale, _visible(n, n, None))  # causal over the step's tokens
    _check_output("self_attention", o_self, want, cfg.dtype, expected="float64 causal attention")


def _stored_rows(cache: Any, layer: int) -> Tuple[np.ndarray, np.ndarray]:
    """The probe sequence's stored K and V ``(L, Hkv, D)`` of a layer, read from its pages
    (MLA: the latent rows as K ``(L, 1, W)``, V empty)."""
    cfg = cache.config
    read = {}
    k, v = [], []
    for position in cache._paging.position_map(0, 0, cache.get_sequence_length(0)):
        page, slot = divmod(int(position), cfg.page_size)
        if page not in read:
            with np.errstate(invalid="ignore"):  # unused slots of the page may hold any bits
                read[page] = row_view(cache._pages[layer], page).numpy().astype(np.float64)
        values = _slot(read[page], slot, is_mla=cfg.is_mla)
        if cfg.is_mla:
            k.append(values[None])
        else:
            k.append(values[0])
            v.append(values[1])
    return np.stack(k), (np.stack(v) if v else np.zeros(0))


def _probe_debug_get_kv(cache: Any, layers: Sequence[int]) -> None:
    """``debug_get_kv`` (MLA: ``debug_get_kv_mla``) of the probe sequence must return exactly
    the rows stored in the pages of the probed layers (MLA's chunked context reads through it)."""
    cfg = cache.config
    if cache._kernels.debug_get_kv is None:
        return
    length = cache.get_sequence_length(0)
    _poison_unprobed_pages(cache, layers)
    row = (cfg.head_dim,) if cfg.is_mla else (cfg.num_kv_heads, cfg.head_dim)
    outputs = [_poisoned((cfg.num_layers, length) + row, cfg.dtype, cache.device) for _ in range(1 if cfg.is_mla else 2)]
    if cfg.is_mla:
        cache.debug_get_kv_mla(0, 0, length, outputs[0])
    else:
        cache.debug_get_kv(0, 0, length, *outputs)
    with np.errstate(invalid="ignore"):  # layers the probe did not write hold any bits
        got = [out.numpy().astype(np.float64) for out in outputs]
    for layer in layers:
        stored = _stored_rows(cache, layer)
        want = [stored[0][:, 0]] if cfg.is_mla else list(stored)
        if not all(np.array_equal(g[layer], w) for g, w in zip(got, want)):
            raise ConfigError("the kernel behind debug_get_kv does not return the K/V stored in the pages; "
                              "expected kernels built for this config")


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, visible: np.ndarray) -> np.ndarray:
    """Float64 attention of ``q (n, H, D)`` over ``k (L, H, D)``, ``v (L, H, Dv)``; query i sees
    the keys where ``visible[i]`` (a bool ``(n, L)`` or ``(1, L)`` mask) is true."""
    scores = np.einsum("nhd,lhd->nhl", q, k) * scale
    scores = np.where(visible[:, None, :], scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=2, keepdims=True))
    weights /= weights.sum(axis=2, keepdims=True)
    return np.einsum("nhl,lhd->nhd", weights, v)


def _rows(tensor: tvm.runtime.Tensor, rows: int) -> np.ndarray:
    """The first rows of a tensor, as float64 (without copying the rest to the host)."""
    shape = (rows,) + tuple(tensor.shape[1:])
    return view(tensor, shape).numpy().astype(np.float64)


def _probe_merge(cache: Any, rng: np.random.Generator) -> None:
    """Merge two states whose base-2 LSEs differ: ``o = (2^a o_a + 2^b o_b) / (2^a + 2^b)``,
    with ``merge_inplace`` (the merge over block depths, at the cache's v head dim) and through
    ``merge_attn_output_inplace`` (``merge_general``: MLA's decompressed v head dim)."""
    cfg = cache.config
    _probe_merge_kernel(cache, rng, "merge_inplace", cfg.v_head_dim, cache._kernels.merge_inplace)
    dv = cfg.mla_original_v_head_dim if cfg.is_mla else cfg.v_head_dim
    _probe_merge_kernel(cache, rng, "merge_attn_output_inplace", dv, cache.merge_attn_output_inplace)


def _probe_merge_kernel(cache: Any, rng: np.random.Generator, what: str, dv: int, merge: Callable) -> None:
    cfg, hq = cache.config, cache.config.num_qo_heads
    o = [_exact_random(rng, (1, hq, dv)) for _ in range(2)]
    lse = [_exact_random(rng, (1, hq)) for _ in range(2)]
    weights = [np.exp2(x)[..., None] for x in lse]
    want_o = (weights[0] * o[0] + weights[1] * o[1]) / (weights[0] + weights[1])
    want_lse = np.log2(np.exp2(lse[0]) + np.exp2(lse[1]))
    tensors = [_tensor(o[0], cfg.dtype, cache.device), _tensor(lse[0], "float32", cache.device),
               _tensor(o[1], cfg.dtype, cache.device), _tensor(lse[1], "float32", cache.device)]
    merge(*tensors)
    expected = "the LSE-weighted mean of two states"
    _check_output(what, tensors[0], want_o, cfg.dtype, expected=expected)
    _check_output(what, tensors[1], want_lse, "float32", expected=expected + " (its LSE)")


def _check_output(what: str, out: tvm.runtime.Tensor, want: Optional[np.ndarray], dtype: str, *,
                  expected: str) -> None:
    got = out.numpy().astype(np.float64)
    if not np.isfinite(got).all():
        raise ConfigError(f"the kernel behind {what} writes non-finite values on a probe step; expected "
                          "kernels built for this config")
    if want is not None:
        err = float(np.abs(got - np.reshape(want, got.shape)).max())
        if not err <= (1e-3 if dtype == "float32" else 2e-2):
            raise ConfigError(f"the kernel behind {what} does not return {expected} (max error {err:.3g}); "
                              "expected kernels built for this config")


def _poison_unprobed_pages(cache: Any, probed: Sequence[int]) -> None:
    """NaN in the probe sequence's pages of the layers the probe did not attend in: fresh pages
    hold any bits, possibly the probed layer's rows (an earlier probe's freed pages), so a
    ``debug_get_kv`` reading another layer could return them."""
    pages = sorted({int(p) // cache.config.page_size
                    for p in cache._paging.position_map(0, 0, cache.get_sequence_length(0))})
    for layer in sorted(set(range(cache.config.num_layers)) - set(probed)):
        for page in pages:
            target = row_view(cache._pages[layer], page)
            _write(target, np.full(tuple(target.shape), np.nan), cache.config.dtype)


def _poison_scratch(cache: Any, rows: int) -> None:
    """NaN in the first rows of the cache's partial-state scratch, so that a paged kernel that
    writes nothing makes the merged output non-finite instead of merging stale values."""
    for scratch in (cache._scratch_o, cache._scratch_lse, cache._scratch_merged_lse):
        shape = (rows,) + tuple(scratch.shape[1:])
        _write(view(scratch, shape), np.full(shape, np.nan), str(scratch.dtype))


def _poisoned(shape: Tuple[int, ...], dtype: str, device: tvm.runtime.Device) -> tvm.runtime.Tensor:
    """An output tensor full of NaN: a kernel that writes nothing leaves it non-finite."""
    return _tensor(np.full(shape, np.nan), dtype, device)


def _scale(rng: np.random.Generator, head_dim: int) -> float:
    """A softmax scale other than ``head_dim ** -0.5`` (a kernel that ignores its ``sm_scale``
    argument for the usual value fails), a float32 value."""
    return float(np.float32(rng.uniform(0.4, 0.8) * head_dim ** -0.5))


def _exact_random(rng: np.random.Generator, shape: Tuple[int, ...]) -> np.ndarray:
    """Multiples of 1/8 in [-2, 2]: exact in every cache dtype."""
    return rng.integers(-16, 17, size=shape) / 8.0
