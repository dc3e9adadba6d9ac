"""Check a kernel set against the config of the cache that would run it, before the cache
allocates anything (``check_kernels``); docs/reliability.md describes the probe of foreign kernels.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
import tvm

from .build import kernel_identity
from .config import LOCAL_KINDS, KVCacheConfig, RopeMode
from .errors import ConfigError
from .kernel_set import KernelSet, split_rotary_rope_argument
from .reference import attention, merge_states
from .tensors import numpy_dtype, row_view, view

#: The end of every refusal of the probe.
EXPECTED = "; expected kernels built for this config"
#: Largest decompressed head dim a foreign MLA kernel set is probed for (DeepSeek-V3: 192 / 128).
MAX_PROBED_HEAD_DIM = 1024


@dataclasses.dataclass(frozen=True)
class ProbeCache:
    """A fresh cache on the kernels under test, and what the probe reads besides its API
    (``position_map(seq_id, start, end)``: slots; ``max_append``: 0 for no limit)."""

    cache: Any
    kernels: KernelSet
    pages: Sequence[tvm.runtime.Tensor]
    position_map: Callable[[int, int, int], np.ndarray]
    scratch_q: Optional[tvm.runtime.Tensor]
    partial_scratch: Tuple[tvm.runtime.Tensor, ...]
    takes_token_trees: bool
    max_append: int


def check_kernels(config: KVCacheConfig, kernels: KernelSet, device: tvm.runtime.Device,
                  new_cache: Callable[[KVCacheConfig, KernelSet], ProbeCache]) -> KVCacheConfig:
    """Refuse kernels a cache of ``config`` cannot run on (``ConfigError``); return the config to
    build it with (MLA without decompressed head dims: those the foreign kernels accept).
    ``new_cache(config, kernels)`` builds an unchecked cache for the probe."""
    if kernels.identity is not None:
        want = kernel_identity(config)
        differ = [f"{name} {value!r} (kernels) vs {want[name]!r} (config)"
                  for name, value in kernels.identity if value != want[name]]
        if differ:
            raise ConfigError(
                "the kernels were built for another configuration: " + "; ".join(differ)
                + " (dtype as its index in ('float32', 'float16', 'bfloat16')); build them for "
                "this config with relax_kvcache.build_kernels(config, target)")
    roles = ["attention_prefill_ragged", "copy_single_page", "merge_inplace", "merge_general"]
    roles += (["transpose_append_mla", "attention_prefill_mla"] if config.is_mla else
              ["transpose_append", "split_rotary", "attention_prefill", "attention_decode"])
    if config.slides_sequences or config.has_layer_windows:
        roles += ["attention_prefill_sliding_window", "attention_decode_sliding_window"]
    if config.layer_span.chunk:  # the plain ragged kernel cannot split a step at chunk boundaries
        roles += ["attention_prefill_ragged_sliding_window"]
    missing = kernels.missing(roles)
    if missing:
        raise ConfigError(
            f"the kernel set has no {', '.join(missing)} kernel(s), which a cache with this config "
            "calls in every step; pass them (or let the cache build its own; TVM has no kernels "
            "for MHA_CHUNKED_LOCAL layers)")
    if kernels.identity is not None:  # ours, built for this config
        return config
    if config.kv_dtype is not None:  # only our kernels read 8-bit pages (their arity is checked at creation)
        return config
    if config.is_mla and config.mla_original_qk_head_dim is None:
        qk, v = _decompressed_head_dims(config, kernels, device)
        try:
            config = dataclasses.replace(config, mla_original_qk_head_dim=qk,
                                         mla_original_v_head_dim=v)
        except ConfigError as err:
            raise ConfigError(f"the kernels' decompressed head dims (q / k {qk}, v {v}, the dims "
                              "the ragged kernel and merge_general accept) do not fit this config: "
                              f"{err}") from None
    # a pool of about 16 pages (enough for every probe step) and one sequence
    small = dataclasses.replace(config, max_num_seqs=1, max_total_seq_len=min(
        config.max_total_seq_len, 15 * config.page_size))
    small = small if 16 <= small.num_total_pages <= config.num_total_pages else config
    # a set with the prefixed prefill kernel is probed without it first (ragged + paged + merge,
    # the path of the steps it does not serve), then with it
    passes = [dataclasses.replace(kernels, attention_prefill_prefixed=None), kernels]
    for i, kernel_set in enumerate(passes[kernels.attention_prefill_prefixed is None:]):
        calls: List[str] = []  # the roles each step calls
        probe = new_cache(small, _recording(kernel_set, calls))
        if i == 0:
            _probe_page_kernels(small, kernels, probe.pages[0], device)
        _probe_attention(probe, kernels, calls)
    return config


def _probe_page_kernels(config: KVCacheConfig, kernels: KernelSet, pages: tvm.runtime.Tensor,
                        device: tvm.runtime.Device) -> None:
    """Append to, copy and compact-copy pages 0 and 1 (free, random values); after each both pages
    must hold exactly what that move gives. Then ``split_rotary``."""
    rng, ps, dtype, mla = np.random.default_rng(2), config.page_size, config.dtype, config.is_mla
    views = [row_view(pages, i) for i in (0, 1)]
    want = [exact_random(rng, tuple(pages.shape[1:])) for _ in (0, 1)]
    for page, values in zip(views, want):
        _write(page, values)
    rows = [exact_random(rng, (1, d) if mla else (1, config.num_kv_heads, d))  # MLA: one latent row
            for d in ((config.head_dim,) if mla else (config.head_dim, config.v_head_dim))]
    append_role = "transpose_append_mla" if mla else "transpose_append"

    def append() -> None:
        getattr(kernels, append_role)(pages, *(_tensor(x, dtype, device) for x in rows), _ints([0], device))
        page_slot(want[0], 0, is_mla=mla)[...] = rows[0][0] if mla else np.stack([x[0] for x in rows])

    def copy_page() -> None:
        kernels.copy_single_page(pages, 0, 1, ps)
        want[1] = want[0].copy()

    def compact_copy() -> None:
        want[1] = exact_random(rng, want[1].shape)
        _write(views[1], want[1])
        kernels.compact_copy(pages, _ints([0, 1], device), _ints([[2 * ps - 1], [0]], device), 1)
        page_slot(want[0], 0, is_mla=mla)[...] = page_slot(want[1], ps - 1, is_mla=mla)

    table = [(append_role, append, "write one token's K/V to its position (and nothing else)"),
             ("copy_single_page", copy_page, "copy page 0 to page 1"),
             ("compact_copy", compact_copy, f"move position {2 * ps - 1} to position 0"),
             ("split_rotary", lambda: _probe_split_rotary(config, kernels, device), None)]
    for role, run, what in table:
        if not callable(getattr(kernels, role)) or (role == "split_rotary" and mla):
            continue
        try:
            run()
        except ConfigError:
            raise
        except Exception as err:  # noqa: BLE001 - any failure of a foreign kernel
            extra = ("; the rope_ext_factors tensor as its last argument (TVM's LongRoPE convention)"
                     if role == "split_rotary" and config.rope_ext_factors is not None else "")
            raise _failure(f"{kernels.origin(role)}the {role} kernel", err,
                           f"; {dtype} pages of shape {'x'.join(map(str, pages.shape))}{extra}") from err
        for i in (0, 1) if what else ():
            wrong = np.count_nonzero(views[i].numpy().astype(np.float64) != want[i])
            if wrong:
                raise ConfigError(f"{kernels.origin(role)}the {role} kernel does not {what}: {wrong} values of page "
                                  f"{i} differ from the expected result" + EXPECTED)


def _probe_split_rotary(config: KVCacheConfig, kernels: KernelSet, device: tvm.runtime.Device) -> None:
    """Split a random fused QKV of two tokens: v copied; q and k copied or rotated (any rotation
    keeping head vector lengths, times LongRoPE's attention factor)."""
    hq, hkv, d, rotary = config.num_qo_heads, config.num_kv_heads, config.head_dim, config.rotary_dim
    qkv = exact_random(np.random.default_rng(0), (2, hq + 2 * hkv, d))
    outs = [tvm.runtime.empty((2, h, d), config.dtype, device) for h in (hq, hkv, hkv)]
    positions = _ints([7, 1000], device)  # rotations by different angles
    kernels.split_rotary(_tensor(qkv, config.dtype, device), positions, *outs,
                         split_rotary_rope_argument(config, device))
    kernel = kernels.origin("split_rotary") + "the split_rotary kernel"
    tol = 1e-3 if config.dtype == "float32" else 5e-2

    def expect_close(what: str, got: np.ndarray, want: Any) -> None:
        err = float(np.abs(got - want).max())
        if not err <= tol:
            raise ConfigError(f"{kernel} does not compute {what}: max error {err:.3g}" + EXPECTED)

    ratios = []
    for name, out, given in zip("qkv", outs, np.split(qkv, [hq, hq + hkv], axis=1)):
        got = out.numpy().astype(np.float64)
        if name == "v" or config.effective_rope_mode != RopeMode.NORMAL:
            expect_close(f"{name} (a copy of the fused input)", got, given)
            continue
        if rotary < d:  # a partial rotary dim: the features past it are copied
            expect_close(f"{name} past the rotary dim {rotary} (a copy)", got[..., rotary:], given[..., rotary:])
        ratios.append((name, np.linalg.norm(got[..., :rotary], axis=-1)
                       / np.maximum(np.linalg.norm(given[..., :rotary], axis=-1), 1e-6)))
    factor = float(np.median(ratios[0][1])) if ratios and config.rope_ext_factors is not None else 1.0
    if not factor > 0:
        raise ConfigError(f"{kernel} does not compute q as a rotation: head vectors scaled by {factor:.3g}" + EXPECTED)
    for name, ratio in ratios:  # a rotation: every head vector keeps its length (times LongRoPE's factor)
        expect_close(f"{name} as a rotation (head vectors keep their length"
                     + (f", times {factor:.4g})" if factor != 1.0 else ")"), ratio / factor, 1.0)


def _decompressed_head_dims(config: KVCacheConfig, kernels: KernelSet, device: tvm.runtime.Device) -> Tuple[int, int]:
    """The decompressed ``(qk, v)`` head dims of a foreign MLA set: the first that
    ``merge_general``, then ``attention_prefill_ragged`` accept on one-token tensors."""
    hq, dtype, widest = config.num_qo_heads, config.dtype, MAX_PROBED_HEAD_DIM
    wide = [_tensor(np.zeros((hq * widest,)), dtype, device) for _ in range(2)]
    lse = [_tensor(np.zeros((1, hq)), "float32", device) for _ in range(2)]
    indptr, zero = _ints([0, 1], device), _ints([0], device)

    def first_accepted(call: Callable[[Callable[[int], tvm.runtime.Tensor]], None]) -> Optional[int]:
        for dim in range(1, widest + 1):
            try:
                call(lambda i: view(wide[i], (1, hq, dim)))
            except Exception:  # noqa: BLE001 - a foreign kernel refusing the shape
                continue
            return dim
        return None

    v_dim = first_accepted(lambda head: kernels.merge_general(head(0), lse[0], head(1), lse[1]))
    if v_dim is None:
        raise ConfigError(f"the merge_general kernel accepts no state of head dim 1 to {widest} ({dtype}, "
                          f"{hq} heads); expected TVM's second merge function, at the decompressed v head dim")
    v_buf = [_tensor(np.zeros((1, hq, v_dim)), dtype, device) for _ in range(2)]
    qk_dim = first_accepted(lambda head: kernels.attention_prefill_ragged(
        head(0), indptr, head(1), v_buf[0], indptr, zero, zero, v_buf[1], lse[0], 1, 0, 1.0, 1e4, 1.0))
    if qk_dim is None:
        raise ConfigError(f"the attention_prefill_ragged kernel accepts no q / k head dim from 1 to {widest} with "
                          f"v head dim {v_dim} (merge_general's; {dtype}, {hq} heads); expected the ragged "
                          "kernel and merge functions of one MLA config")
    return qk_dim, v_dim


def _failure(kernel: str, err: Exception, detail: str = "") -> ConfigError:
    text = " ".join(str(err).split())
    text = text if len(text) <= 200 else text[:197] + "..."
    return ConfigError(f"{kernel} fails on this cache's tensors ({type(err).__name__}: {text}{detail}){EXPECTED}")


def _tensor(values: np.ndarray, dtype: str, device: tvm.runtime.Device) -> tvm.runtime.Tensor:
    return _write(tvm.runtime.empty(values.shape, dtype, device), values)


def _write(tensor: tvm.runtime.Tensor, values: np.ndarray) -> tvm.runtime.Tensor:
    tensor.copyfrom(values.astype(numpy_dtype(str(tensor.dtype))))
    return tensor


def page_slot(page: np.ndarray, slot: int, *, is_mla: bool) -> np.ndarray:
    """A slot's values in a page's host array (latent ``(ps, W)``, MHA ``(2, H, ps, D)``)."""
    return page[slot] if is_mla else page[:, :, slot]


def exact_random(rng: np.random.Generator, shape: Tuple[int, ...]) -> np.ndarray:
    """Multiples of 1/8 in [-2, 2]: exact in every cache dtype."""
    return rng.integers(-16, 17, size=shape) / 8.0


def _ints(values: Any, device: tvm.runtime.Device) -> tvm.runtime.Tensor:
    return tvm.runtime.tensor(np.array(values, dtype=np.int32), device)


def _nan(shape: Tuple[int, ...], dtype: str, device: tvm.runtime.Device) -> tvm.runtime.Tensor:
    return _tensor(np.full(shape, np.nan), dtype, device)


def _scale(rng: np.random.Generator, head_dim: int) -> float:
    """A float32 softmax scale other than ``head_dim ** -0.5`` (catches kernels ignoring ``sm_scale``)."""
    return float(np.float32(rng.uniform(0.4, 0.8) * head_dim ** -0.5))


def _recording(kernels: KernelSet, calls: List[str]) -> KernelSet:
    """``kernels``, each appending its role to ``calls`` when called."""
    def wrap(role: str, kernel: Callable) -> Callable:
        def call(*args: Any) -> Any:
            calls.append(role)
            return kernel(*args)
        return call

    return dataclasses.replace(kernels, **{field.name: wrap(field.name, getattr(kernels, field.name))
                                           for field in dataclasses.fields(kernels)
                                           if field.init and callable(getattr(kernels, field.name))})


def _probe_attention(probe: ProbeCache, kernels: KernelSet, calls: List[str]) -> None:
    """Steps of one probe sequence, one layer of each attention kind each, outputs checked where
    the host knows the queries the kernels see (else finite); then ``debug_get_kv``, merges."""
    cache, cfg, rng = probe.cache, probe.cache.config, np.random.default_rng(1)
    # TVM's windowed prefill kernel gives NaN for a query whose window holds no cached token (a
    # chunk as long as the window over a prefix): keep the prefill step shorter than the window
    max_length = max(1, probe.max_append - 1) if probe.max_append else cfg.prefill_chunk_size
    layers = sorted({cfg.attn_kinds.index(kind) for kind in cfg.attn_kinds})
    run = _mla_step if cfg.is_mla else _mha_step
    cache.add_sequence(0)
    tree: Optional[Tuple[int, List[int]]] = None  # (committed length, parents of every tree node so far)
    try:
        for length, parents in _probe_steps(cfg, probe.takes_token_trees, max_length):
            calls.clear()
            if parents is not None:
                tree = tree or (cache.get_sequence_length(0), [])
                tree[1].extend(parents)
            cache.begin_forward([0], [length], parents)
            try:
                for layer in layers:
                    for scratch in probe.partial_scratch:  # a paged kernel writing nothing leaves NaN
                        shape = (length,) + tuple(scratch.shape[1:])
                        _write(view(scratch, shape), np.full(shape, np.nan))
                    run(probe, rng, layer, _visible(cache.get_sequence_length(0), length, tree))
            finally:
                cache.end_forward()
        calls.clear()
        _probe_debug_get_kv(probe, layers)
        _probe_merges(probe, rng)
    except ConfigError as err:
        if kernels.sources is None or not calls:
            raise
        named = [f"{role} = creation {kernels.source(role)}" if kernels.source(role) else role
                 for role in dict.fromkeys(calls)]
        raise ConfigError(f"{err}; kernels of that step: {', '.join(named)}") from err
    except Exception as err:  # noqa: BLE001 - any failure of a foreign kernel
        raise _failure(f"{kernels.origin(calls[-1])}the {calls[-1]} kernel" if calls else "an attention kernel",
                      err) from err


def _probe_steps(cfg: KVCacheConfig, tree: bool, max_length: int) -> List[Tuple[int, Optional[Sequence[int]]]]:
    """(length, tree parents) of the steps that fit: decode, a prefill into a second page, decode,
    then a tree (two roots, then a child of the first: the paged tree kernel)."""
    capacity, ps = cfg.num_total_pages * cfg.page_size, cfg.page_size
    prefill = max(1, min(cfg.prefill_chunk_size, max_length, ps + 1 if ps <= 256 else 2, capacity - 2))
    steps = [(1, None), (prefill, None), (1, None)]
    if tree and min(cfg.prefill_chunk_size, max_length) >= 2:
        steps += [(2, [-1, -1]), (1, [0])]
    return [step for i, step in enumerate(steps) if sum(length for length, _ in steps[:i + 1]) <= capacity]


def _visible(length: int, n: int, tree: Optional[Tuple[int, List[int]]]) -> np.ndarray:
    """Which stored rows each of the step's ``n`` last tokens sees (causal, or its tree path)."""
    mask = np.tril(np.ones((length, length), dtype=bool))[length - n:]
    for i, node in enumerate(range(len(tree[1]) - n, len(tree[1])) if tree else ()):
        mask[i, tree[0]:] = False
        while node != -1:
            mask[i, tree[0] + node] = True
            node = tree[1][node]
    return mask


def _mha_step(probe: ProbeCache, rng: np.random.Generator, layer: int, visible: np.ndarray) -> None:
    cache, cfg = probe.cache, probe.cache.config
    n, hq, hkv, d = len(visible), cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim
    qkv, o, scale = exact_random(rng, (n, hq + 2 * hkv, d)), _nan((n, hq, d), cfg.dtype, cache.device), _scale(rng, d)
    cache.attention_with_fused_qkv(cache.layer_offset + layer, _tensor(qkv, cfg.dtype, cache.device), o, scale)
    k, v = _stored_rows(probe, layer)  # the step's tokens included (appended before or after attention)
    rope, span, windowed = cfg.effective_rope_mode, cfg.layer_span, cfg.attn_kinds[layer] in LOCAL_KINDS
    if windowed and span.chunk:  # keys of the query's own chunk (rows are positions: nothing slides)
        visible = visible & (np.arange(len(k))[None, :] >= span.first_visible(np.arange(len(k) - n, len(k)))[:, None])
    # a window is checked only while it spans the sequence (TVM's kernels, which the creation
    # function may pass, window the new tokens of a step per page list, not per query)
    checked = not windowed or span.chunk or span.window >= len(k)
    want = None
    if len(k) == 1 or (rope != RopeMode.INLINE and checked):  # queries as the kernel sees them
        q = (qkv[:, :hq] if rope == RopeMode.NONE
             else view(probe.scratch_q, (n,) + tuple(probe.scratch_q.shape[1:])).numpy())
        want = attention(q, k, v, scale, causal=False, mask=visible)[0]
    _check_output("attention_with_fused_qkv", o, want, cfg.dtype, "float64 attention over the stored K/V")
    if n > 1 and not (windowed or cfg.slides_sequences) and probe.kernels.attention_prefill_prefixed is not None:
        # a prefill step's attention_with_shared_kv reads the prefix from the pages and the given
        # rows (the prefixed kernel; attention_with_fused_qkv attends over the grown page lists)
        q = exact_random(rng, (n, hq, d))
        o = _nan((n, hq, d), cfg.dtype, cache.device)
        cache.attention_with_shared_kv(cache.layer_offset + layer, _tensor(q, cfg.dtype, cache.device),
                                       _tensor(k[-n:], cfg.dtype, cache.device), _tensor(v[-n:], cfg.dtype, cache.device),
                                       o, scale)
        want = attention(q, k, v, scale, causal=False, mask=visible)[0] if rope != RopeMode.INLINE else None
        _check_output("attention_with_shared_kv", o, want, cfg.dtype, "float64 attention over the stored K/V")


def _mla_step(probe: ProbeCache, rng: np.random.Generator, layer: int, visible: np.ndarray) -> None:
    cache, cfg = probe.cache, probe.cache.config
    n, hq, lora, dtype, device = len(visible), cfg.num_qo_heads, cfg.v_head_dim, cfg.dtype, cache.device
    layer_id, width = cache.layer_offset + layer, cfg.head_dim
    cache.append_mla_kv(layer_id, _tensor(exact_random(rng, (n, width)), dtype, device))
    q, scale = exact_random(rng, (n, hq, width)), _scale(rng, width)
    o, lse = _nan((n, hq, lora), dtype, device), _nan((n, hq), "float32", device)
    cache.cross_attention(layer_id, _tensor(q, dtype, device), o, lse, scale)
    # absorbed attention over the stored latent rows (L, 1, W): a decode step's include its new
    # token, a prefill step's queries see the prefix only (self_attention covers the new tokens)
    latent = _stored_rows(probe, layer)[0]
    seen = len(latent) if n == 1 else len(latent) - n
    want = attention(q, latent, latent[..., :lora], scale, causal=False,
                     mask=np.arange(len(latent))[None, :] < seen)[0] if seen else None
    _check_output("cross_attention", o, want, dtype, "float64 attention over the stored latent rows")
    dqk, dv = cfg.mla_original_qk_head_dim, cfg.mla_original_v_head_dim
    q, k, v = (exact_random(rng, (n, hq, dim)) for dim in (dqk, dqk, dv))
    scale, o, lse = _scale(rng, dqk), _nan((n, hq, dv), dtype, device), _nan((n, hq), "float32", device)
    cache.self_attention(layer_id, *(_tensor(x, dtype, device) for x in (q, k, v)), o, lse, scale)
    _check_output("self_attention", o, attention(q, k, v, scale, causal=True)[0], dtype, "float64 causal attention")


def _stored_rows(probe: ProbeCache, layer: int) -> Tuple[np.ndarray, np.ndarray]:
    """The probe sequence's stored K, V ``(L, Hkv, D)`` of a layer (MLA: latent rows, V empty)."""
    cfg = probe.cache.config
    pages, slots = np.divmod(np.asarray(probe.position_map(0, 0, probe.cache.get_sequence_length(0)), np.int64),
                             cfg.page_size)
    with np.errstate(invalid="ignore"):  # unused slots of a page may hold any bits
        read = {page: row_view(probe.pages[layer], page).numpy().astype(np.float64) for page in set(pages.tolist())}
    rows = np.stack([page_slot(read[p], s, is_mla=cfg.is_mla) for p, s in zip(pages.tolist(), slots.tolist())])
    return (rows[:, None], np.zeros(0)) if cfg.is_mla else (rows[:, 0], rows[:, 1])


def _probe_debug_get_kv(probe: ProbeCache, layers: Sequence[int]) -> None:
    """``debug_get_kv`` (MLA: ``_mla``) must return exactly the rows stored in the probed layers."""
    cache, cfg = probe.cache, probe.cache.config
    if probe.kernels.debug_get_kv is None:
        return
    length = cache.get_sequence_length(0)
    # fresh pages hold any bits, possibly a probed layer's rows (an earlier probe's freed pages):
    # NaN in the sequence's pages of the other layers, so that reading one of them is refused
    for page in {int(p) // cfg.page_size for p in probe.position_map(0, 0, length)}:
        for layer in set(range(cfg.num_layers)) - set(layers):
            target = row_view(probe.pages[layer], page)
            _write(target, np.full(tuple(target.shape), np.nan))
    row = (cfg.head_dim,) if cfg.is_mla else (cfg.num_kv_heads, cfg.head_dim)
    outputs = [_nan((cfg.num_layers, length) + row, cfg.dtype, cache.device) for _ in range(1 if cfg.is_mla else 2)]
    (cache.debug_get_kv_mla if cfg.is_mla else cache.debug_get_kv)(0, 0, length, *outputs)
    with np.errstate(invalid="ignore"):  # layers the probe did not write hold any bits
        got = [out.numpy().astype(np.float64) for out in outputs]
    for layer in layers:
        k, v = _stored_rows(probe, layer)
        if not all(np.array_equal(g[layer], w) for g, w in zip(got, [k[:, 0]] if cfg.is_mla else [k, v])):
            raise ConfigError("the kernel behind debug_get_kv does not return the K/V stored in the pages" + EXPECTED)


def _probe_merges(probe: ProbeCache, rng: np.random.Generator) -> None:
    """Merge two states with ``merge_inplace`` and ``merge_attn_output_inplace``."""
    cache, cfg = probe.cache, probe.cache.config
    dv = cfg.mla_original_v_head_dim if cfg.is_mla else cfg.v_head_dim
    for what, dim, merge in (("merge_inplace", cfg.v_head_dim, probe.kernels.merge_inplace),
                             ("merge_attn_output_inplace", dv, cache.merge_attn_output_inplace)):
        o = [exact_random(rng, (1, cfg.num_qo_heads, dim)) for _ in range(2)]
        lse = [exact_random(rng, (1, cfg.num_qo_heads)) for _ in range(2)]
        tensors = [_tensor(x, dtype, cache.device) for i in (0, 1)
                   for x, dtype in ((o[i], cfg.dtype), (lse[i], "float32"))]
        merge(*tensors)
        want_o, want_lse = merge_states(o[0], lse[0], o[1], lse[1])
        _check_output(what, tensors[0], want_o, cfg.dtype, "the LSE-weighted mean of two states")
        _check_output(what, tensors[1], want_lse, "float32", "the LSE-weighted mean of two states (its LSE)")


def _check_output(what: str, out: tvm.runtime.Tensor, want: Optional[np.ndarray], dtype: str, expected: str) -> None:
    got = out.numpy().astype(np.float64)
    if not np.isfinite(got).all():
        raise ConfigError(f"the kernel behind {what} writes non-finite values on a probe step" + EXPECTED)
    err = 0.0 if want is None else float(np.abs(got - np.reshape(want, got.shape)).max())
    if not err <= (1e-3 if dtype == "float32" else 2e-2):
        raise ConfigError(f"the kernel behind {what} does not return {expected} (max error {err:.3g})" + EXPECTED)
