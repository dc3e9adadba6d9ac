"""Checkpoint export / import of one sequence's KV, in TVM 0.27's format (docs/api.md).

The format (:func:`metadata`, :func:`parse_import`), moving page groups with the cache's own
kernels (:class:`PageGroupMover`) or, for 8-bit pages, byte for byte (:class:`PageBytes`) and a
cache's checkpoint I/O (:class:`CheckpointIO`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import tvm

from .args import as_int
from .config import DTYPE_BYTES, AttnKind, KVCacheConfig
from .errors import ArgumentError, CacheFullError, ConfigError, KVCacheError, SequenceError
from .paging import PagingState
from .paging._checks import INT64_MAX, INT64_MIN, ceil_div
from .tensors import TENSOR_TYPES, allocate, check_tensor, numpy_dtype, view

FORMAT_VERSION = 1
CACHE_TYPE = "relax.vm.PagedAttentionKVCache"
PAGE_GROUP_LAYOUT = "1,num_logical_pages,2,num_kv_heads,page_size,qk_head_dim"
#: Longest sequence a checkpoint may hold (TVM's sizes are int32).
MAX_SEQ_LENGTH = 2**31 - 1
#: Fields of an 8-bit checkpoint holding its K and V scales (per layer, per KV head).
SCALE_FIELDS = ("k_scales", "v_scales")


def _json(value: Any) -> str:
    """Compact JSON as TVM writes it: whole floats below 2**53 ``%.1f``, others ``%.17g``."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(key)}:{_json(item)}" for key, item in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_json(item) for item in value) + "]"
    if isinstance(value, float):
        return f"{value:.1f}" if value == int(value) and abs(value) < 2.0**53 else f"{value:.17g}"
    return json.dumps(value)


def _layout(config: KVCacheConfig, layer_offset: int) -> List[Tuple[str, Any]]:
    """The layout fields of the metadata, in order, with JSON values."""
    return [
        ("format_version", FORMAT_VERSION), ("cache_type", CACHE_TYPE), ("page_size", config.page_size),
        ("num_layers", config.num_layers), ("layer_begin", layer_offset),
        ("layer_end", layer_offset + config.num_layers), ("num_qo_heads", config.num_qo_heads),
        ("num_kv_heads", config.num_kv_heads), ("qk_head_dim", config.head_dim), ("v_head_dim", config.v_head_dim),
    ]


def _rope_fields(config: KVCacheConfig) -> List[Tuple[str, Any]]:
    return [
        ("rope_mode", config.effective_rope_mode.name.lower()), ("rotary_scale", float(config.rope_scale)),
        ("rotary_theta", float(config.rope_theta)), ("has_rope_ext_factors", config.rope_ext_factors is not None),
        ("support_sliding_window", config.support_sliding_window),
        ("support_layer_sliding_window", AttnKind.MHA_SLIDING in config.attn_kinds),
    ]


def layout_string(config: KVCacheConfig, layer_offset: int = 0) -> str:
    """The string TVM hashes for the layout hash (``key=value;``, TVM's order and formatting)."""
    def text(value: Any) -> str:  # doubles as %.17g
        if isinstance(value, bool):
            return str(int(value))
        return f"{value:.17g}" if isinstance(value, float) else str(value)

    fields = _layout(config, layer_offset) + [("dtype", config.dtype)] + _rope_fields(config)
    kinds = ",".join(kind.name.lower() for kind in config.attn_kinds)
    eight_bit = f";kv_dtype={config.kv_dtype}" if config.kv_dtype is not None else ""  # TVM has no 8-bit pages
    return ("".join(f"{key}={text(value)};" for key, value in fields)
            + f"page_group_layout={PAGE_GROUP_LAYOUT};attn_kinds={kinds}{eight_bit}")


def layout_hash(config: KVCacheConfig, layer_offset: int = 0) -> str:
    """64-bit FNV-1a of :func:`layout_string`, as 16 hex digits (TVM's ``get_layout_hash``)."""
    h = 0xCBF29CE484222325
    for byte in layout_string(config, layer_offset).encode():
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def unsupported_layout(config: KVCacheConfig) -> Optional[str]:
    """Why caches of ``config`` cannot checkpoint (None: they can)."""
    if config.is_mla:
        return "MLA layers (the page-group layout is TVM's MHA one)"
    if config.rope_ext_factors is not None:
        return "RoPE extension factors (the format does not carry their values; as in TVM)"
    return None


def group_shape(config: KVCacheConfig, length: int) -> Tuple[int, ...]:
    """Shape of a page group of a sequence of ``length`` tokens."""
    return (1, ceil_div(length, config.page_size), 2, config.num_kv_heads, config.page_size,
            config.head_dim)


def metadata(config: KVCacheConfig, layer_offset: int, seq_id: int, length: int,
             reserved_num_seqs: int, scales: Optional[np.ndarray] = None) -> Dict[str, Any]:
    """The metadata of sequence ``seq_id`` of ``length`` tokens (TVM's fields, in its order).

    Over 8-bit pages also ``kv_dtype`` (after ``dtype``; the groups hold ``kv_dtype``) and, at
    the end, the layers' scales ``k_scales`` / ``v_scales`` (``num_layers`` lists of
    ``num_kv_heads`` float32 values), from ``scales (num_layers, 2, num_kv_heads)``.
    """
    ps, pages = config.page_size, ceil_div(length, config.page_size)
    shape = list(group_shape(config, length))
    page_dtype, eight_bit = config.page_dtype, config.kv_dtype is not None
    fields = _layout(config, layer_offset) + [
        ("reserved_num_seqs", reserved_num_seqs), ("num_total_pages", config.num_total_pages),
        ("prefill_chunk_size", config.prefill_chunk_size), ("dtype", config.dtype),
        *([("kv_dtype", config.kv_dtype)] if eight_bit else []),
        ("attn_kinds", [kind.name.lower() for kind in config.attn_kinds])] + _rope_fields(config) + [
        ("page_group_layout", PAGE_GROUP_LAYOUT), ("layout_hash", layout_hash(config, layer_offset)),
        ("seq_id", seq_id), ("seq_length", length),
        *([("rope_rotary_dim", config.rotary_dim)] if config.rotary_dim != config.head_dim else []),
        *([("rope_interleaved", True)] if config.rope_interleaved else []),
        *([("attention_chunk_size", config.attention_chunk_size)] if config.layer_span.chunk else []),
        ("logical_pages", [{"logical_page_index": i, "start_pos": i * ps, "length": min(ps, length - i * ps)}
                           for i in range(pages)]),
        ("groups", [{"group_index": g, "layer_begin": layer_offset + g, "layer_end": layer_offset + g + 1,
                     "num_logical_pages": pages,
                     "dtype": page_dtype, "shape": shape,
                     "nbytes": int(np.prod(shape)) * (1 if eight_bit else DTYPE_BYTES[page_dtype])}
                    for g in range(config.num_layers)]),
    ]
    if eight_bit and scales is not None:
        fields += [(name, [[float(x) for x in layer[kv]] for layer in scales])
                   for kv, name in enumerate(SCALE_FIELDS)]
    return dict(fields)


def parse_import(config: KVCacheConfig, layer_offset: int, text: Any) -> Tuple[int, Optional[np.ndarray]]:
    """Validate checkpoint metadata (a JSON string) against this cache's layout; return the
    sequence length it holds (in one page group per layer of the cache) and, over 8-bit pages,
    its scales ``(num_layers, 2, num_kv_heads)`` float32 (None otherwise).

    Raises
    ------
    ArgumentError
        Not a string, not JSON, or a field missing, of the wrong type or inconsistent.
    ConfigError
        A checkpoint of another layout (the page dtype, the first differing field, then the
        layout hash).
    """
    if not isinstance(text, str):
        raise ArgumentError(f"checkpoint metadata must be a JSON string, got {type(text).__name__}")
    try:
        meta = json.loads(text)
    except (ValueError, RecursionError) as err:  # RecursionError: nesting deeper than Python's stack
        raise ArgumentError(f"checkpoint metadata is not valid JSON: {type(err).__name__}: {err}") from None
    if not isinstance(meta, dict):
        raise ArgumentError(f"checkpoint metadata must be a JSON object, got {type(meta).__name__}")
    if _field(meta, "format_version", int) != FORMAT_VERSION:
        raise ArgumentError(f"checkpoint format_version {meta['format_version']} is not supported; expected "
                            f"{FORMAT_VERSION}")
    for name in ("reserved_num_seqs", "num_total_pages", "prefill_chunk_size"):
        if _field(meta, name, int) <= 0:
            raise ArgumentError(f"checkpoint field {name!r} must be positive, got {meta[name]}")
    _check_page_dtype(config, meta)
    ours = metadata(config, layer_offset, 0, 0, 1)
    for name in [key for key, _ in _layout(config, layer_offset)] + ["dtype", "attn_kinds", "page_group_layout"] + [
            key for key, _ in _rope_fields(config)]:
        if not _same(meta.get(name), ours[name]):
            raise ConfigError(f"the checkpoint's {name} is {_short(meta.get(name))}, this cache's {_short(ours[name])}; "
                              "a checkpoint imports into a cache of the same layout")
    for name, default, want, why in (  # our fields, written only where they differ from the default
            ("rope_rotary_dim", config.head_dim, config.rotary_dim, "keys are stored rotated"),
            ("rope_interleaved", False, config.rope_interleaved, "keys are stored rotated"),
            ("attention_chunk_size", 0, config.layer_span.chunk, "another model's chunked layers")):
        got = meta.get(name, default)
        if not _same(got, want):
            raise ConfigError(f"the checkpoint's {name} is {_short(got)}, this cache's {want} "
                              f"({why})")
    if _field(meta, "layout_hash", str) != ours["layout_hash"]:
        raise ConfigError(f"checkpoint layout hash mismatch: expected {ours['layout_hash']}, got "
                          f"{meta['layout_hash']}")
    _field(meta, "seq_id", int)
    length = _field(meta, "seq_length", int)
    if not 0 <= length <= MAX_SEQ_LENGTH:
        raise ArgumentError(f"checkpoint seq_length must be in [0, {MAX_SEQ_LENGTH}], got {length}")
    pages = ceil_div(length, config.page_size)
    if pages > meta["num_total_pages"]:
        raise ArgumentError(f"checkpoint seq_length {length} needs {pages} pages, more than its num_total_pages "
                            f"{meta['num_total_pages']}")
    if pages > config.num_total_pages:
        raise CacheFullError(f"a checkpoint of {length} tokens needs {pages} pages; this cache holds "
                             f"{config.num_total_pages} in all")
    expected = metadata(config, layer_offset, meta["seq_id"], length, 1)
    for name in ("logical_pages", "groups"):
        if not _same(meta.get(name), expected[name]):
            raise ArgumentError(f"checkpoint field {name!r} does not describe a sequence of seq_length {length} in "
                                f"{config.num_layers} page group(s) of this layout: got {_short(meta.get(name))}, "
                                f"expected {_short(expected[name])}")
    return length, (_scales(config, meta) if config.kv_dtype is not None else None)


def _check_page_dtype(config: KVCacheConfig, meta: Dict[str, Any]) -> None:
    """Refuse a checkpoint whose pages hold another type than this cache's (8-bit or not): its
    bytes are copied as stored, so 8-bit pages import only into pages of the same format."""
    theirs = meta.get("kv_dtype")
    if theirs is None and config.kv_dtype is None:
        return
    if theirs is not None and type(theirs) is not str:
        raise ArgumentError(f"checkpoint field 'kv_dtype' must be a string, got {_short(theirs)}")
    stored = theirs if theirs is not None else meta.get("dtype")  # 16-bit checkpoints hold their dtype
    if stored != config.page_dtype:
        shown = stored if type(stored) is str and len(stored) <= 40 else _short(stored)
        raise ConfigError(f"the checkpoint stores {shown} pages, this cache {config.page_dtype} pages "
                          f"(KVCacheConfig.kv_dtype {config.kv_dtype!r}); a checkpoint imports into a cache whose "
                          "pages have the same dtype (its bytes are copied as stored)")


def _scales(config: KVCacheConfig, meta: Dict[str, Any]) -> np.ndarray:
    """The scales of an 8-bit checkpoint, ``(num_layers, 2, num_kv_heads)`` float32: each a
    positive normal float32 value, as ``set_kv_scales`` takes."""
    layers, heads = config.num_layers, config.num_kv_heads
    rows = []
    for name in SCALE_FIELDS:
        value = meta.get(name)
        if not (type(value) is list and len(value) == layers and all(
                type(layer) is list and len(layer) == heads and all(type(x) in (int, float) for x in layer)
                for layer in value)):
            raise ArgumentError(f"checkpoint field {name!r} must hold {layers} list(s) of {heads} numbers (one per "
                                f"layer and KV head), got {_short(value)}")
        for layer, row in enumerate(value):
            for head, x in enumerate(row):
                if not _is_scale(x):
                    raise ArgumentError(f"checkpoint field {name!r}: layer {layer} head {head} must be a positive "
                                        f"finite float32 number, got {_short(x)}")
        rows.append(np.array(value, np.float32))
    return np.stack(rows, axis=1)


def _is_scale(x: Any) -> bool:
    """Whether JSON number ``x`` is a positive normal float32 value, exactly."""
    try:
        wide = float(x)
    except OverflowError:  # an int beyond float64
        return False
    with np.errstate(over="ignore"):
        narrow = np.float32(wide)
    return bool(np.finfo(np.float32).tiny <= narrow <= np.finfo(np.float32).max) and float(narrow) == wide


def _same(got: Any, want: Any) -> bool:
    """JSON equality with TVM's reader's types: an int field takes an int or a bool, a bool
    field a bool, a float field a number."""
    if isinstance(want, bool):
        return type(got) is bool and got == want
    if isinstance(want, int):
        return type(got) in (int, bool) and got == want
    if isinstance(want, float):
        return type(got) in (int, float) and got == want
    if isinstance(want, list):
        return type(got) is list and len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want))
    if isinstance(want, dict):
        return type(got) is dict and got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want)
    return type(got) is type(want) and got == want


def _field(meta: Dict[str, Any], name: str, kind: type) -> Any:
    """``meta[name]`` of exactly type ``kind`` (not a bool for an int); ints within int64."""
    value = meta.get(name)
    if type(value) is not kind or (kind is int and not INT64_MIN <= value <= INT64_MAX):
        raise ArgumentError(f"checkpoint field {name!r} must be {'an int64' if kind is int else 'a string'}, got "
                            f"{_short(value)}")
    return value


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 200 else text[:200] + "..."


class PageGroupMover:
    """Moves positions between the page pool and a page group (position ``p`` at slot ``p``) in
    chunks: ``debug_get_kv`` gathers them, ``transpose_append`` scatters them."""

    def __init__(self, config: KVCacheConfig, kernels: Any, device: tvm.runtime.Device) -> None:
        self._config, self._kernels, self._device = config, kernels, device
        self._buffers: Optional[Tuple[tvm.runtime.Tensor, tvm.runtime.Tensor, int]] = None

    def _gather_buffers(self) -> Tuple[tvm.runtime.Tensor, tvm.runtime.Tensor, int]:
        """``(k, v, layers)`` gather buffers ``(layers, C, H, D)``, made on first use (``layers``
        is 1, or the layer count a foreign kernel was compiled for)."""
        if self._buffers is None:
            cfg = self._config
            rows = min(cfg.prefill_chunk_size, 4096)
            for layers in (1, cfg.num_layers):
                chunk = max(cfg.page_size, rows // layers)
                k, v = (allocate((layers, chunk, cfg.num_kv_heads, cfg.head_dim), cfg.dtype, self._device,
                                 "checkpoint buffer") for _ in range(2))
                if layers == cfg.num_layers or self._accepts(k, v):
                    self._buffers = (k, v, layers)
                    break
        return self._buffers

    def _accepts(self, k: tvm.runtime.Tensor, v: tvm.runtime.Tensor) -> bool:
        """Whether ``debug_get_kv`` takes one-layer buffers (TVM's take only their layer count)."""
        cfg = self._config
        pages = allocate((1, 2, cfg.num_kv_heads, cfg.page_size, cfg.head_dim), cfg.dtype, self._device, "probe page")
        rows = view(k, (1, 1, cfg.num_kv_heads, cfg.head_dim)), view(v, (1, 1, cfg.num_kv_heads, cfg.head_dim))
        try:
            self._kernels.debug_get_kv(pages, self._positions(np.zeros(1, np.int32)), *rows, 0)
        except Exception:  # noqa: BLE001 - a shape mismatch: use buffers of the compiled layer count
            return False
        return True

    def _positions(self, slots: np.ndarray) -> tvm.runtime.Tensor:
        return tvm.runtime.tensor(np.ascontiguousarray(slots, dtype=np.int32), self._device)

    def move(self, src_pages: tvm.runtime.Tensor, src_slots: np.ndarray, dst_pages: tvm.runtime.Tensor,
             dst_slots: np.ndarray) -> None:
        """Copy the K/V at ``src_slots`` of ``src_pages`` to ``dst_slots`` of ``dst_pages``."""
        k, v, layers = self._gather_buffers()
        cfg, chunk = self._config, k.shape[1]
        h, d = cfg.num_kv_heads, cfg.head_dim
        for start in range(0, len(src_slots), chunk):
            n = min(chunk, len(src_slots) - start)
            gathered = view(k, (layers, n, h, d)), view(v, (layers, n, h, d))
            self._kernels.debug_get_kv(src_pages, self._positions(src_slots[start:start + n]), *gathered, 0)
            rows = view(k, (n, h, d)), view(v, (n, h, d))  # layer 0 of the gathered rows
            self._kernels.transpose_append(dst_pages, *rows, self._positions(dst_slots[start:start + n]))

    def zero(self, pages: tvm.runtime.Tensor, slots: np.ndarray) -> None:
        """Write zeros at ``slots`` of ``pages``."""
        if len(slots) == 0:
            return
        cfg = self._config
        zeros = np.zeros((len(slots), cfg.num_kv_heads, cfg.head_dim), dtype=numpy_dtype(cfg.dtype))
        rows = [allocate(zeros.shape, cfg.dtype, self._device, "zero rows") for _ in range(2)]
        for t in rows:
            t.copyfrom(zeros)
        self._kernels.transpose_append(pages, *rows, self._positions(slots))


class PageBytes:
    """Moves a sequence's pages between the page pool and a page group byte for byte (8-bit
    pages: ``debug_get_kv`` dequantizes and ``transpose_append`` quantizes again, which need not
    give back the same bytes). A sequence without a window holds position ``p`` at slot
    ``p % page_size`` of its ``p // page_size``-th page (its blocks start page-aligned), so
    whole pages move; runs of consecutive pool pages move in one copy. Works between any two
    devices (a host group and device pages)."""

    def __init__(self, config: KVCacheConfig) -> None:
        self._config = config
        self._page = (2, config.num_kv_heads, config.page_size, config.head_dim)  # one page, in bytes
        self._page_bytes = int(np.prod(self._page))

    def _pages(self, tensor: tvm.runtime.Tensor, first: int, count: int) -> tvm.runtime.Tensor:
        """Pages ``[first, first + count)`` of ``tensor`` (pool or group) as bytes."""
        return view(tensor, (count, *self._page), first * self._page_bytes, "uint8")

    def runs(self, slots: np.ndarray) -> List[Tuple[int, int, int]]:
        """``(group page, pool page, count)`` runs of the pages holding ``slots`` (position p at
        slot ``slots[p]``)."""
        ps, n = self._config.page_size, len(slots)
        if n == 0:
            return []
        pool = slots[::ps].astype(np.int64) // ps
        lanes = np.arange(n, dtype=np.int64)
        if not np.array_equal(slots, pool[lanes // ps] * ps + lanes % ps):
            raise KVCacheError("checkpoint: the sequence's positions do not fill its pages from slot 0; its pages "
                               "cannot move byte for byte")
        breaks = np.flatnonzero(np.diff(pool) != 1) + 1
        starts, ends = np.concatenate([[0], breaks]), np.concatenate([breaks, [len(pool)]])
        return [(int(a), int(pool[a]), int(b - a)) for a, b in zip(starts, ends)]

    def export(self, pool: tvm.runtime.Tensor, slots: np.ndarray, group: tvm.runtime.Tensor) -> None:
        """Copy the pages holding ``slots`` into ``group`` (page group); the last page's slots
        past the sequence are zero."""
        ps, n = self._config.page_size, len(slots)
        tail = n % ps
        for first, page, count in self.runs(slots):
            last = first + count == ceil_div(n, ps)
            whole = count - (1 if last and tail else 0)
            if whole:
                self._pages(pool, page, whole).copyto(self._pages(group, first, whole))
            if whole < count:  # the partial last page: its used slots, the rest zero
                rows = self._pages(pool, page + whole, 1).numpy()
                rows[:, :, :, tail:] = 0
                self._pages(group, first + whole, 1).copyfrom(rows)

    def import_(self, group: tvm.runtime.Tensor, pool: tvm.runtime.Tensor, slots: np.ndarray) -> None:
        """Copy ``group``'s pages into the (fresh) pages holding ``slots``."""
        for first, page, count in self.runs(slots):
            self._pages(group, first, count).copyto(self._pages(pool, page, count))


def group_as_pages(group: tvm.runtime.Tensor) -> tvm.runtime.Tensor:
    """A page group ``(1, P, 2, H, ps, D)`` seen as pages ``(P, 2, H, ps, D)``."""
    return view(group, tuple(group.shape[1:]))


@dataclasses.dataclass(frozen=True)
class ImportState:
    """A checkpoint import in progress: the sequence, its positions' slots, groups still due."""

    seq_id: int
    slots: np.ndarray  # (seq_length,) int32
    pending: frozenset


class CheckpointIO:
    """A cache's checkpoints, and the import in progress (``require_no_step(what)`` raises
    while a forward step or a callback is active; ``kv_scales``: the cache's ``KVScales``).

    Over 8-bit pages a checkpoint carries the stored bytes (:class:`PageBytes`) and the scales
    they were stored with. An import whose scales differ from the cache's sets them when the
    cache holds no tokens and is refused otherwise (the stored bytes keep their scales).
    """

    def __init__(self, config: KVCacheConfig, layer_offset: int, kernels: Any, device: tvm.runtime.Device,
                 paging: PagingState, pages: List[tvm.runtime.Tensor], require_no_step: Callable[[str], None],
                 kv_scales: Any) -> None:
        self._config, self._layer_offset, self._kernels, self._device = config, layer_offset, kernels, device
        self._paging, self._pages, self._require_no_step = paging, pages, require_no_step
        self._kv_scales = kv_scales
        self._mover = PageGroupMover(config, kernels, device)
        self._bytes = PageBytes(config) if config.kv_dtype is not None else None
        self.importing: Optional[ImportState] = None

    def layout_hash(self) -> str:
        self._require_checkpointable("get_layout_hash")
        return layout_hash(self._config, self._layer_offset)

    def _begin(self, what: str, seq_id: Any) -> int:
        """``seq_id`` as an int, once ``what`` may run now (no step, a cache that checkpoints)."""
        seq_id = as_int("seq_id", seq_id)
        self._require_no_step(what)
        self._require_checkpointable(what)
        return seq_id

    def metadata(self, seq_id: Any) -> str:
        seq_id = self._checkpoint_sequence(seq_id, "get_checkpoint_metadata")
        length = self._paging.sequence_length(seq_id)
        return _json(metadata(self._config, self._layer_offset, seq_id, length, self._config.max_num_seqs,
                              self._kv_scales.host))

    def export_group(self, seq_id: Any, group_id: Any, out: Any) -> None:
        seq_id = self._checkpoint_sequence(seq_id, "export_page_group")
        group = self._group_id(group_id)
        length = self._paging.sequence_length(seq_id)
        shape = group_shape(self._config, length)
        host = self._check_group_tensor("out", out, shape)
        if length == 0:
            return
        if self._bytes is not None:
            self._bytes.export(self._pages[group], self._paging.position_map(seq_id), out)
            return
        target = allocate(shape, self._config.dtype, self._device, "page group") if host else out
        pages = group_as_pages(target)
        self._mover.move(self._pages[group], self._paging.position_map(seq_id), pages,
                         np.arange(length, dtype=np.int32))
        self._mover.zero(pages, np.arange(length, shape[1] * self._config.page_size, dtype=np.int32))
        if host:
            target.copyto(out)

    def prepare(self, seq_id: Any, text: Any) -> None:
        seq_id = self._begin("prepare_import", seq_id)
        if self.importing is not None:
            raise SequenceError(f"prepare_import({seq_id}): the import into sequence {self.importing.seq_id} is not "
                                "finished; finish_import it or remove that sequence first")
        length, scales = parse_import(self._config, self._layer_offset, text)
        new_scales = scales is not None and not np.array_equal(scales, self._kv_scales.host)
        stored = self._paging.total_sequence_length()
        if new_scales and stored:
            layer = int(np.flatnonzero((scales != self._kv_scales.host).any(axis=(1, 2)))[0])
            raise KVCacheError(f"prepare_import({seq_id}): the checkpoint's scales of layer "
                               f"{layer + self._layer_offset} (K {scales[layer, 0].tolist()}, V "
                               f"{scales[layer, 1].tolist()}) differ from this cache's (K "
                               f"{self._kv_scales.host[layer, 0].tolist()}, V {self._kv_scales.host[layer, 1].tolist()}), "
                               f"which its {stored} stored tokens keep; import it into a cache without tokens "
                               "(it takes the checkpoint's scales) or one with the same scales")
        slots = self._paging.import_sequence(seq_id, length)
        if scales is not None:  # also cancels a pending calibration
            for layer, layer_scales in enumerate(scales):
                self._kv_scales.set(layer, layer_scales)
        self.importing = ImportState(seq_id, slots, frozenset(range(self._config.num_layers)))

    def import_group(self, seq_id: Any, group_id: Any, group: Any) -> None:
        seq_id, group_id = self._begin("import_page_group", seq_id), self._group_id(group_id)
        state = self._importing(seq_id, "import_page_group")
        if group_id not in state.pending:
            raise SequenceError(f"page group {group_id} of sequence {seq_id} was already imported")
        shape = group_shape(self._config, len(state.slots))
        host = self._check_group_tensor("group", group, shape)
        if self._bytes is not None:
            self._bytes.import_(group, self._pages[group_id], state.slots)
        elif len(state.slots):
            if host:  # upload it first
                staged = allocate(shape, self._config.dtype, self._device, "page group")
                staged.copyfrom(group)
                group = staged
            self._mover.move(group_as_pages(group), np.arange(len(state.slots), dtype=np.int32),
                             self._pages[group_id], state.slots)
        self.importing = dataclasses.replace(state, pending=state.pending - {group_id})

    def finish(self, seq_id: Any) -> None:
        seq_id = self._begin("finish_import", seq_id)
        state = self._importing(seq_id, "finish_import")
        if state.pending:
            raise SequenceError(f"the import into sequence {seq_id} is missing page group(s) {sorted(state.pending)}; "
                                "import_page_group each before finish_import")
        self.importing = None

    @property
    def importing_id(self) -> Optional[int]:
        """The sequence whose import is in progress, if any."""
        return self.importing.seq_id if self.importing is not None else None

    def abandon(self, seq_id: int) -> None:
        """Drop the import into ``seq_id`` (a removed sequence), if there is one."""
        if self.importing_id == seq_id:
            self.importing = None

    def check_not_importing(self, seq_id: int, what: str) -> None:
        """Refuse ``what`` on the sequence whose import is unfinished."""
        if self.importing_id == seq_id:
            raise SequenceError(f"{what}: sequence {seq_id} is importing a checkpoint; finish_import it (or remove "
                                "it) first")

    def _checkpoint_sequence(self, seq_id: Any, what: str) -> int:
        """A sequence that can be saved now (its id)."""
        seq_id = self._begin(what, seq_id)
        self.check_not_importing(seq_id, what)
        seq = self._paging.sequence(seq_id)
        if seq.token_tree is not None or seq.sliding_window_size != -1:
            raise SequenceError(f"{what}: sequence {seq_id} has " + ("an uncommitted token tree; commit it first"
                                if seq.token_tree is not None else "a sliding window, which checkpoints do not "
                                "hold (as in TVM)"))
        return seq_id

    def _require_checkpointable(self, what: str) -> None:
        why = unsupported_layout(self._config)
        if why is not None:
            raise NotImplementedError(f"{what}: checkpoints of caches with {why} are not supported")
        missing = self._kernels.missing(["debug_get_kv", "transpose_append"] if self._bytes is None else [])
        if missing:
            raise KVCacheError(f"{what} needs the {' and '.join(missing)} kernel(s), which this cache was "
                               "created without")

    def _check_group_tensor(self, name: str, value: Any, shape: Tuple[int, ...]) -> bool:
        """Check a page group tensor; True when it is on the host while the cache is not."""
        host = isinstance(value, TENSOR_TYPES) and value.device == tvm.cpu() and self._device != tvm.cpu()
        check_tensor(name, value, shape=shape, dtype=self._config.page_dtype,
                     device=tvm.cpu() if host else self._device)
        return host

    def _group_id(self, group_id: Any) -> int:
        group_id, layers = as_int("group_id", group_id), self._config.num_layers
        if not 0 <= group_id < layers:
            raise ArgumentError(f"group_id {group_id} is out of range [0, {layers}): a checkpoint "
                                "has one page group per layer of the cache")
        return group_id

    def _importing(self, seq_id: int, what: str) -> ImportState:
        state = self.importing
        if state is None or state.seq_id != seq_id:
            raise SequenceError(f"{what}: no checkpoint import into sequence {seq_id} is in progress"
                                + (f" (sequence {state.seq_id} is importing)" if state else
                                   "; call prepare_import first"))
        return state
