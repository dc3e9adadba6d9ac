"""The attention part of the kernel probe (:mod:`relax_kvcache.kernel_probe`): a probe
sequence through a few steps of a small cache built on the kernels under test, each output
compared with float64 attention over the K/V the cache stored; and the probe's value helpers.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
import tvm

from .config import LOCAL_KINDS, KVCacheConfig, RopeMode
from .errors import ConfigError
from .kernel_set import KernelSet
from .tensors import numpy_dtype, row_view, view



@dataclasses.dataclass(frozen=True)
class ProbeCache:
    """A fresh cache built on the kernels under test, and what the probe reads besides its API.

    Attributes
    ----------
    cache : PagedAttentionKVCache
        Driven through its public methods.
    kernels : KernelSet
        The kernels it runs (wrapped by :func:`recording`).
    pages : sequence of Tensor
        Its page tensor of each layer.
    position_map : callable
        ``position_map(seq_id, start, end)``: page slots of a sequence's positions.
    scratch_q : Tensor, optional
        ``split_rotary``'s q output ``(chunk, Hq, D)`` (MHA): the queries the kernels see.
    partial_scratch : tuple of Tensor
        The partial-state scratch (o, lse, merged lse), poisoned before each probe layer.
    takes_token_trees : bool
        Whether the cache takes token-tree steps.
    max_append : int
        Most tokens a sequence may append per step (0: no limit).
    """

    cache: Any
    kernels: KernelSet
    pages: Sequence[tvm.runtime.Tensor]
    position_map: Callable[[int, int, int], np.ndarray]
    scratch_q: Optional[tvm.runtime.Tensor]
    partial_scratch: Tuple[tvm.runtime.Tensor, ...]
    takes_token_trees: bool
    max_append: int


def summary(err: Exception) -> str:
    """An exception's message on one line, at most 200 characters (TVM's span several lines)."""
    text = " ".join(str(err).split())
    return text if len(text) <= 200 else text[:197] + "..."


def host_tensor(values: np.ndarray, dtype: str, device: tvm.runtime.Device) -> tvm.runtime.Tensor:
    out = tvm.runtime.empty(values.shape, dtype, device)
    write_values(out, values, dtype)
    return out


def write_values(tensor: tvm.runtime.Tensor, values: np.ndarray, dtype: str) -> None:
    """Copy host ``values`` (any float dtype) into ``tensor`` of cache dtype ``dtype``."""
    tensor.copyfrom(values.astype(numpy_dtype(dtype)))


def page_slot(page: np.ndarray, slot: int, *, is_mla: bool) -> np.ndarray:
    """A slot's values in a page's host array (latent ``(ps, W)``, MHA ``(2, H, ps, D)``)."""
    return page[slot] if is_mla else page[:, :, slot]


def probe_attention(probe: ProbeCache, kernels: KernelSet, calls: List[str]) -> None:
    """Run the attention kernels of a fresh probe cache once, through its own API.

    A probe sequence takes a decode step of one token, a prefill step over that prefix that
    crosses into a second page (pages of at most 256 tokens), another decode step and, where the
    cache takes them, a token-tree step, as far as the page pool and the chunk size allow; one
    layer of each attention kind attends in each. Decode and prefill outputs must match float64
    attention over the K/V stored in the pages where the host can tell the queries the kernels
    see (RoPE NONE or NORMAL, MLA, and any one-key decode); the others must be finite.
    ``merge_attn_output_inplace`` merges two states of different LSE. ``calls`` records the
    roles the probe cache's (recording) kernels run, for error messages.

    Raises
    ------
    ConfigError
        A kernel raises on this cache's tensors, writes a non-finite output, or an output
        differs from float64 attention (or the merge from its float64 value).
    """
    cfg = probe.cache.config
    rng = np.random.default_rng(1)
    # TVM's windowed prefill kernel gives NaN for a query whose window holds no cached token (a
    # chunk as long as the window over a prefix): keep the prefill step shorter than the window
    window_limit = probe.max_append
    steps = _probe_steps(cfg, tree=probe.takes_token_trees,
                         max_length=max(1, window_limit - 1) if window_limit else cfg.prefill_chunk_size)
    layers = sorted({cfg.attn_kinds.index(kind) for kind in cfg.attn_kinds})
    run = _probe_mla_step if cfg.is_mla else _probe_mha_step
    _probe_steps_once(probe, rng, steps, layers, run, kernels, calls)


def recording(kernels: KernelSet, calls: List[str]) -> KernelSet:
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


def _probe_steps_once(probe: ProbeCache, rng: np.random.Generator, steps, layers: Sequence[int], run: Callable,
                      kernels: KernelSet, calls: List[str]) -> None:
    """The steps of :func:`_probe_attention` on its fresh probe cache."""
    cache = probe.cache
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
                    _poison_scratch(probe, length)
                    run(probe, rng, layer, _visible(cache.get_sequence_length(0), length, tree))
            finally:
                cache.end_forward()
        calls.clear()
        _probe_debug_get_kv(probe, layers)
        _probe_merge(probe, rng)
    except ConfigError as err:
        if kernels.sources is None or not calls:
            raise
        raise ConfigError(f"{err}{_called(kernels, calls)}") from err
    except Exception as err:  # noqa: BLE001 - any failure of a foreign kernel
        text = summary(err)
        which = f"{kernels.origin(calls[-1])}the {calls[-1]} kernel" if calls else "an attention kernel"
        raise ConfigError(f"{which} fails on this cache's tensors ({type(err).__name__}: {text}); "
                          "expected kernels built for this config") from err


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


def _probe_mha_step(probe: ProbeCache, rng: np.random.Generator, layer: int, visible: np.ndarray) -> None:
    cache = probe.cache
    cfg = cache.config
    n = len(visible)
    hq, hkv, d = cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = exact_random(rng, (n, hq + 2 * hkv, d))
    o = _poisoned((n, hq, d), cfg.dtype, cache.device)
    scale = _scale(rng, d)
    cache.attention_with_fused_qkv(cache.layer_offset + layer, host_tensor(qkv, cfg.dtype, cache.device), o, scale)
    want = None
    k, v = _stored_rows(probe, layer)  # the step's tokens included (appended before or after attention)
    rope, span = cfg.effective_rope_mode, cfg.layer_span
    windowed = cfg.attn_kinds[layer] in LOCAL_KINDS
    if windowed and span.chunk:  # keys of the query's own chunk (rows are positions: nothing slides)
        q_pos = np.arange(len(k) - n, len(k))
        visible = visible & (np.arange(len(k))[None, :] >= span.first_visible(q_pos)[:, None])
    # a window is checked only while it spans the sequence (TVM's kernels, which the creation
    # function may pass, window the new tokens of a step per page list, not per query)
    checked = not windowed or span.chunk or span.window >= len(k)
    if len(k) == 1 or (rope != RopeMode.INLINE and checked):  # queries as the kernel sees them
        q = qkv[:, :hq] if rope == RopeMode.NONE else _rows(probe.scratch_q, n)
        group = hq // hkv
        want = _attention(q, np.repeat(k, group, axis=1), np.repeat(v, group, axis=1), scale, visible)
    _check_output("attention_with_fused_qkv", o, want, cfg.dtype, expected="float64 attention over the stored K/V")


def _probe_mla_step(probe: ProbeCache, rng: np.random.Generator, layer: int, visible: np.ndarray) -> None:
    cache = probe.cache
    cfg = cache.config
    n = len(visible)
    hq, width, lora = cfg.num_qo_heads, cfg.head_dim, cfg.v_head_dim
    cache.append_mla_kv(cache.layer_offset + layer, host_tensor(exact_random(rng, (n, width)), cfg.dtype, cache.device))
    q = exact_random(rng, (n, hq, width))
    o, lse = _poisoned((n, hq, lora), cfg.dtype, cache.device), _poisoned((n, hq), "float32", cache.device)
    scale = _scale(rng, width)
    cache.cross_attention(cache.layer_offset + layer, host_tensor(q, cfg.dtype, cache.device), o, lse, scale)
    # absorbed attention over the stored latent rows: a decode step's include its new token, a
    # prefill step's queries see the prefix only (self_attention covers the new tokens)
    latent = _stored_rows(probe, layer)[0][:, 0]
    keys = np.broadcast_to(latent[:, None], (len(latent), hq, width))
    seen = len(latent) if n == 1 else len(latent) - n
    want = (_attention(q, keys, keys[..., :lora], scale, np.arange(len(latent))[None, :] < seen)
            if seen else None)
    _check_output("cross_attention", o, want, cfg.dtype, expected="float64 attention over the stored latent rows")
    dqk, dv = cfg.mla_original_qk_head_dim, cfg.mla_original_v_head_dim
    q, k, v = (exact_random(rng, (n, hq, dim)) for dim in (dqk, dqk, dv))
    scale = _scale(rng, dqk)
    o_self = _poisoned((n, hq, dv), cfg.dtype, cache.device)
    lse_self = _poisoned((n, hq), "float32", cache.device)
    cache.self_attention(cache.layer_offset + layer, *(host_tensor(x, cfg.dtype, cache.device) for x in (q, k, v)),
                         o_self, lse_self, scale)
    want = _attention(q, k, v, scale, _visible(n, n, None))  # causal over the step's tokens
    _check_output("self_attention", o_self, want, cfg.dtype, expected="float64 causal attention")


def _stored_rows(probe: ProbeCache, layer: int) -> Tuple[np.ndarray, np.ndarray]:
    """The probe sequence's stored K and V ``(L, Hkv, D)`` of a layer, read from its pages
    (MLA: the latent rows as K ``(L, 1, W)``, V empty)."""
    cfg = probe.cache.config
    read = {}
    k, v = [], []
    for position in probe.position_map(0, 0, probe.cache.get_sequence_length(0)):
        page, slot = divmod(int(position), cfg.page_size)
        if page not in read:
            with np.errstate(invalid="ignore"):  # unused slots of the page may hold any bits
                read[page] = row_view(probe.pages[layer], page).numpy().astype(np.float64)
        values = page_slot(read[page], slot, is_mla=cfg.is_mla)
        if cfg.is_mla:
            k.append(values[None])
        else:
            k.append(values[0])
            v.append(values[1])
    return np.stack(k), (np.stack(v) if v else np.zeros(0))


def _probe_debug_get_kv(probe: ProbeCache, layers: Sequence[int]) -> None:
    """``debug_get_kv`` (MLA: ``debug_get_kv_mla``) of the probe sequence must return exactly
    the rows stored in the pages of the probed layers (MLA's chunked context reads through it)."""
    cache = probe.cache
    cfg = cache.config
    if probe.kernels.debug_get_kv is None:
        return
    length = cache.get_sequence_length(0)
    _poison_unprobed_pages(probe, layers)
    row = (cfg.head_dim,) if cfg.is_mla else (cfg.num_kv_heads, cfg.head_dim)
    outputs = [_poisoned((cfg.num_layers, length) + row, cfg.dtype, cache.device) for _ in range(1 if cfg.is_mla else 2)]
    if cfg.is_mla:
        cache.debug_get_kv_mla(0, 0, length, outputs[0])
    else:
        cache.debug_get_kv(0, 0, length, *outputs)
    with np.errstate(invalid="ignore"):  # layers the probe did not write hold any bits
        got = [out.numpy().astype(np.float64) for out in outputs]
    for layer in layers:
        stored = _stored_rows(probe, layer)
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


def _probe_merge(probe: ProbeCache, rng: np.random.Generator) -> None:
    """Merge two states whose base-2 LSEs differ: ``o = (2^a o_a + 2^b o_b) / (2^a + 2^b)``,
    with ``merge_inplace`` (the merge over block depths, at the cache's v head dim) and through
    ``merge_attn_output_inplace`` (``merge_general``: MLA's decompressed v head dim)."""
    cache = probe.cache
    cfg = cache.config
    _probe_merge_kernel(cache, rng, "merge_inplace", cfg.v_head_dim, probe.kernels.merge_inplace)
    dv = cfg.mla_original_v_head_dim if cfg.is_mla else cfg.v_head_dim
    _probe_merge_kernel(cache, rng, "merge_attn_output_inplace", dv, cache.merge_attn_output_inplace)


def _probe_merge_kernel(cache: Any, rng: np.random.Generator, what: str, dv: int, merge: Callable) -> None:
    cfg, hq = cache.config, cache.config.num_qo_heads
    o = [exact_random(rng, (1, hq, dv)) for _ in range(2)]
    lse = [exact_random(rng, (1, hq)) for _ in range(2)]
    weights = [np.exp2(x)[..., None] for x in lse]
    want_o = (weights[0] * o[0] + weights[1] * o[1]) / (weights[0] + weights[1])
    want_lse = np.log2(np.exp2(lse[0]) + np.exp2(lse[1]))
    tensors = [host_tensor(o[0], cfg.dtype, cache.device), host_tensor(lse[0], "float32", cache.device),
               host_tensor(o[1], cfg.dtype, cache.device), host_tensor(lse[1], "float32", cache.device)]
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


def _poison_unprobed_pages(probe: ProbeCache, probed: Sequence[int]) -> None:
    """NaN in the probe sequence's pages of the layers the probe did not attend in: fresh pages
    hold any bits, possibly the probed layer's rows (an earlier probe's freed pages), so a
    ``debug_get_kv`` reading another layer could return them."""
    cfg = probe.cache.config
    pages = sorted({int(p) // cfg.page_size for p in probe.position_map(0, 0, probe.cache.get_sequence_length(0))})
    for layer in sorted(set(range(cfg.num_layers)) - set(probed)):
        for page in pages:
            target = row_view(probe.pages[layer], page)
            write_values(target, np.full(tuple(target.shape), np.nan), cfg.dtype)


def _poison_scratch(probe: ProbeCache, rows: int) -> None:
    """NaN in the first rows of the cache's partial-state scratch, so that a paged kernel that
    writes nothing makes the merged output non-finite instead of merging stale values."""
    for scratch in probe.partial_scratch:
        shape = (rows,) + tuple(scratch.shape[1:])
        write_values(view(scratch, shape), np.full(shape, np.nan), str(scratch.dtype))


def _poisoned(shape: Tuple[int, ...], dtype: str, device: tvm.runtime.Device) -> tvm.runtime.Tensor:
    """An output tensor full of NaN: a kernel that writes nothing leaves it non-finite."""
    return host_tensor(np.full(shape, np.nan), dtype, device)


def _scale(rng: np.random.Generator, head_dim: int) -> float:
    """A softmax scale other than ``head_dim ** -0.5`` (a kernel that ignores its ``sm_scale``
    argument for the usual value fails), a float32 value."""
    return float(np.float32(rng.uniform(0.4, 0.8) * head_dim ** -0.5))


def exact_random(rng: np.random.Generator, shape: Tuple[int, ...]) -> np.ndarray:
    """Multiples of 1/8 in [-2, 2]: exact in every cache dtype."""
    return rng.integers(-16, 17, size=shape) / 8.0
