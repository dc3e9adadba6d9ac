"""Cache configuration: enums with TVM's integer values and the validated `KVCacheConfig`."""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional, Sequence, Tuple

import ml_dtypes
import numpy as np

from .args import as_bool, as_float, as_int_list, describe, exact_int
from .errors import ArgumentError, ConfigError, KVCacheError

SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")
#: 8-bit float formats pages may store (``KVCacheConfig.kv_dtype``)
KV_DTYPES = ("float8_e4m3fn", "float8_e5m2")
#: ``kv_dtype`` as an int (its index here; 0: pages of the model dtype), as the 8th creation
#: ``cache_config`` entry and a kernel library's identity carry it
KV_DTYPE_CODES = (None, *KV_DTYPES)
#: the largest finite value of each 8-bit format (what storing saturates to)
KV_DTYPE_MAX = {name: float(ml_dtypes.finfo(getattr(ml_dtypes, name)).max) for name in KV_DTYPES}
MAX_HEAD_DIM = 256
#: Widest latent vector of an MLA cache (DeepSeek-V3: 512 + 64 = 576).
MAX_LATENT_WIDTH = 1024
#: Sizes are int32 in the kernels (and in TVM's creation convention).
MAX_INT = 2**31 - 1
#: Most memory the cache may allocate: beyond any device, far below where byte counts overflow.
MAX_TENSOR_BYTES = 2**48
#: Most layers per cache (one page tensor each; models have at most a few hundred).
MAX_NUM_LAYERS = 2**16
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class RopeMode(enum.IntEnum):
    """Where rotary position embedding is applied (TVM's values).

    NONE: never. NORMAL: to q and k in the split kernel, before k enters the cache.
    INLINE: on the fly inside the attention kernels; the cache stores k without RoPE.
    """

    NONE = 0
    NORMAL = 1
    INLINE = 2


class AttnKind(enum.IntEnum):
    """Attention kind of a layer (TVM's values; ``MHA_CHUNKED_LOCAL`` is ours)."""

    MHA = 0
    MLA = 1
    MHA_SLIDING = 3
    MHA_CHUNKED_LOCAL = 4  # ours (TVM has no such kind): Llama 4's chunked local attention


LOCAL_KINDS = (AttnKind.MHA_SLIDING, AttnKind.MHA_CHUNKED_LOCAL)  # layers whose keys are bounded by position


@dataclasses.dataclass(frozen=True)
class LayerSpan:
    """The keys a query of a local layer sees, by absolute position: ``[first_visible(p), p]``.

    ``window > 0``: a sliding window, keys in ``(p - window, p]`` (``AttnKind.MHA_SLIDING``).
    ``chunk > 0``: chunked local attention (Llama 4's ``attention_chunk_size``), keys of the
    query's own chunk, ``[p - p % chunk, p]`` (``AttnKind.MHA_CHUNKED_LOCAL``). One of the two.
    """

    window: int = 0
    chunk: int = 0

    def __post_init__(self) -> None:
        if not (self.window >= 0 and self.chunk >= 0 and not (self.window and self.chunk)):
            raise ValueError(f"a layer span is a window or an attention chunk (non-negative, not both), "
                             f"got window {self.window}, chunk {self.chunk}")

    def __bool__(self) -> bool:
        return bool(self.window or self.chunk)

    def first_visible(self, pos):
        """First key position a query at ``pos`` sees (a Python int or a TIR int32 expression;
        ``%`` is floor modulo for both, and positions are never negative)."""
        if self.window:
            return pos - self.window + 1
        return pos - pos % self.chunk


def _positive(name: str, value: object) -> int:
    """A positive int32 (Python or numpy integer) as a Python int."""
    number = exact_int(value)
    if number is None or not 0 < number <= MAX_INT:
        raise ConfigError(f"KVCacheConfig.{name} must be a positive int, got {describe(value)} (sizes are int32: "
                          f"1 to {MAX_INT})")
    return number


def _dtype(value: object) -> str:
    """The KV dtype's name, from a name, numpy dtype, TVM DataType or numpy scalar type."""
    if isinstance(value, (str, np.dtype)):  # a TVM DataType is a str
        name = str(value)
    elif isinstance(value, type) and issubclass(value, np.generic):
        name = str(np.dtype(value))
    else:
        name = None
    if name not in SUPPORTED_DTYPES:
        raise ConfigError(f"KVCacheConfig.dtype must be one of {SUPPORTED_DTYPES}, got {describe(value)}")
    return name


def _rope_float(name: str, value: object, *, used: bool) -> float:
    """RoPE theta / scale as a finite float32 value, positive and normal where RoPE is used."""
    try:
        result = as_float(f"KVCacheConfig.{name}", value, not_finite=ConfigError)
    except ArgumentError:
        raise ConfigError(f"KVCacheConfig.{name} must be a number, got {describe(value)}") from None
    except ConfigError:
        raise ConfigError(f"KVCacheConfig.{name} must be a finite float32 number, got {describe(value)}") from None
    f32 = np.finfo(np.float32)
    if used and not result >= float(f32.tiny):
        raise ConfigError(f"KVCacheConfig.{name} must be positive (at least {f32.tiny:.3g}, float32's smallest "
                          f"normal number) when RoPE is used, got {describe(value)}")
    return result


def _ext_factors(values: object, head_dim: int) -> Tuple[float, ...]:
    """LongRoPE factors as a tuple of ``head_dim`` (the rotary dim) positive float32 values."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise ConfigError(f"KVCacheConfig.rope_ext_factors must be a sequence of {head_dim} floats (long factors, "
                          f"then short ones), got {describe(values)} of type {type(values).__name__}")
    if isinstance(values, np.ndarray):
        numbers = values.dtype.kind in "fiu"
    else:  # each element a Python or numpy number (not a bool, str or bytes, which numpy converts)
        numbers = all(isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) for x in values)
    if not numbers:
        raise ConfigError(f"KVCacheConfig.rope_ext_factors must hold numbers, got {describe(values)}")
    try:
        array = np.array(values, dtype=np.float64)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"KVCacheConfig.rope_ext_factors must hold numbers, got {describe(values)}") from None
    if array.shape != (head_dim,):
        raise ConfigError(f"KVCacheConfig.rope_ext_factors must hold rotary_dim={head_dim} floats (the long factors "
                          f"of the {head_dim // 2} frequencies, then the short ones), got shape {array.shape}")
    f32 = np.finfo(np.float32)
    bad = ~((array >= float(f32.tiny)) & (array <= float(f32.max)))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ConfigError(f"KVCacheConfig.rope_ext_factors[{i}] must be a positive finite float32 number, "
                          f"got {array[i]!r}")
    return tuple(float(x) for x in array.astype(np.float32))


def longrope_attention_factor(max_position_embeddings: int, original_max_position_embeddings: int) -> float:
    """LongRoPE's cos / sin scale: ``sqrt(1 + ln(s) / ln(original))`` with
    ``s = max / original``, 1 when ``s <= 1`` (Phi-3; HF's and TVM's default)."""
    for name, value in (("max_position_embeddings", max_position_embeddings),
                        ("original_max_position_embeddings", original_max_position_embeddings)):
        if exact_int(value) is None or value < 2:
            raise ConfigError(f"longrope_attention_factor: {name} must be an int of at least 2, got {describe(value)}")
    scale = max_position_embeddings / original_max_position_embeddings
    if scale <= 1.0:
        return 1.0
    return float(np.sqrt(1.0 + np.log(scale) / np.log(original_max_position_embeddings)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVCacheConfig:
    """Shape and policy of a paged KV cache. Keyword-only and validated on construction.

    Parameters
    ----------
    num_layers : int
        Number of attention layers whose KV the cache holds.
    num_qo_heads, num_kv_heads : int
        Query/output heads and key/value heads; ``num_qo_heads % num_kv_heads == 0`` (GQA/MQA).
    head_dim : int
        Features per q/k head; even, at most 256. MLA caches: the latent width
        ``kv_lora_rank + qk_rope_head_dim`` (DeepSeek-V3: 576), at most 1024.
    v_head_dim : int, optional
        Features per v head; defaults to ``head_dim`` and must equal it for MHA layers. MLA
        caches: ``kv_lora_rank`` (DeepSeek-V3: 512), the absorbed attention's output width.
    page_size : int
        Tokens per page.
    max_num_seqs : int
        Sequences the cache reserves metadata room for (TVM's ``reserved_num_seqs``), and with
        ``support_sliding_window`` the spare pages (2 each) that windows borrow while sliding.
        As in TVM it sizes, it does not limit: more sequences, or larger batches, grow the
        metadata buffer, and a batch whose windows find no spare page raises `CacheFullError`.
    max_total_seq_len : int
        Token capacity over all sequences; the page pool holds
        ``ceil(max_total_seq_len / page_size) + 1`` pages (+ 2 per sequence with sliding windows).
    prefill_chunk_size : int
        Maximum number of tokens appended in one forward step.
    rope_mode : RopeMode
        Where RoPE is applied. With ``support_sliding_window`` a non-NONE mode becomes INLINE.
    rope_theta, rope_scale : float
        RoPE base and position scale (frequency ``pos * scale / theta^(2i/d)``).
    rope_rotary_dim : int, optional
        Features of each q / k head that RoPE rotates (the first ``rope_rotary_dim``, pairs
        ``(i, i + rope_rotary_dim / 2)``, frequency ``pos * scale / theta^(2i/rope_rotary_dim)``);
        the others pass unrotated (GPT-NeoX / Phi-2 partial rotary, TVM's ``rotary_dim``). Even,
        at most ``head_dim`` (the default); below it only with RoPE applied at append time
        (NORMAL mode: the attention kernels' inline RoPE rotates whole heads).
    rope_interleaved : bool
        GPT-J style RoPE: neighbouring features ``(2i, 2i + 1)`` form the rotated pairs (TVM's
        ``rope_type: gptj``) instead of ``(i, i + rotary_dim / 2)``; NORMAL mode only, like a
        partial rotary dim.
    rope_ext_factors : sequence of float, optional
        LongRoPE (Phi-3) frequency factors in TVM's layout: ``rope_rotary_dim`` floats, the long
        factors of the ``rope_rotary_dim / 2`` frequencies, then the short ones. Frequency ``i`` becomes
        ``pos * scale / (factor[i] * theta^(2i/d))``. Needs ``rope_mode`` NORMAL (and no
        ``support_sliding_window``), as in TVM; the cache passes them to ``split_rotary`` as a
        float32 tensor in place of its apply-RoPE flag (TVM's convention).
    rope_original_max_position_embeddings : int, optional
        LongRoPE: a token at a position at least this uses the long factors, one before it the
        short ones (per token, so a token's rotation never depends on how steps were batched).
        Compiled into our ``split_rotary``; needed to build it, not by given kernels.
    rope_attention_factor : float
        LongRoPE: cos and sin are multiplied by it (HF's ``attention_factor``; see
        :func:`longrope_attention_factor`). Compiled into our ``split_rotary``; default 1.
    dtype : str
        Model dtype of q, k, v and outputs: ``"float32"``, ``"float16"`` or ``"bfloat16"``.
    kv_dtype : str, optional
        What the pages store: None (the default) for ``dtype``, or ``"float8_e4m3fn"`` /
        ``"float8_e5m2"``: each K / V element as ``value / scale`` saturated to the 8-bit format's
        range, with one float32 scale per layer, K or V and KV head
        (:meth:`PagedAttentionKVCache.set_kv_scales`, default 1.0); half the memory of 16-bit
        pages. MLA caches: one scale per layer for the latent row (K and V are the same row).
    support_sliding_window : bool
        Reserve sliding-window support; kernels then take ``length_info`` of shape ``[3, B]``.
    attn_kinds : sequence of AttnKind, optional
        Per-layer attention kind; defaults to MHA everywhere.
    layer_sliding_window_size : int
        Window of ``AttnKind.MHA_SLIDING`` layers (TVM's optional 6th ``cache_config`` entry).
    attention_chunk_size : int, optional
        Chunk of ``AttnKind.MHA_CHUNKED_LOCAL`` layers (Llama 4's chunked local attention, HF's
        ``attention_chunk_size``): a query at position ``p`` sees the keys at positions
        ``[p - p % attention_chunk_size, p]``. Required with such layers, refused without them;
        a cache has ``MHA_SLIDING`` or ``MHA_CHUNKED_LOCAL`` layers, not both (one set of local
        kernels).
    mla_original_qk_head_dim, mla_original_v_head_dim : int, optional
        MLA caches: q/k and v head dims of the decompressed self-attention over the step's new
        tokens (DeepSeek-V3: 128 + 64 = 192 and 128), as in TVM's frontend. Our kernels need
        them; a cache created with given kernels without them reads them off its ragged and
        merge kernels (the dims those accept).
    context_chunk_size : int, optional
        MLA caches: most cached tokens :meth:`PagedAttentionKVCache.mla_context_attention`
        decompresses at once (its workspace; capped at the rows the pages hold,
        :attr:`context_workspace_rows`); defaults to ``prefill_chunk_size``. Chunks' partial
        states are merged in the cache dtype, so in 16-bit dtypes many tiny chunks lose precision
        (bfloat16, 1500 cached tokens: 14% of the largest output with 1-row chunks, 2% with 4,
        0.5% with 64, 0.2% with 4096); use at least a few dozen rows.
    prefix_caching : bool
        Automatic prefix caching (docs/prefix-caching.md): full pages are registered under a
        hash chain of their token ids (given to ``add_sequence`` / ``begin_forward``), kept
        after their sequences let go and reused by new sequences with the same leading tokens;
        cached pages no sequence holds count as available and are evicted least recently used
        first when the free pages run out.
    host_cache_pages : int
        Prefix caching's host tier: how many evicted cached pages are kept in host memory
        (pinned on CUDA; the same page bytes per layer as on the device) and copied back when a
        new sequence's prompt hits them. 0 (the default): evicted pages are dropped.

    Notes
    -----
    All layers of a cache are MLA or none is (as in DeepSeek models); an MLA cache has one
    latent KV head (``num_kv_heads == 1``), no sliding windows and no token trees (as in TVM).
    """

    num_layers: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: Optional[int] = None
    page_size: int = 16
    max_num_seqs: int = 32
    max_total_seq_len: int = 4096
    prefill_chunk_size: int = 2048
    rope_mode: RopeMode = RopeMode.NORMAL
    rope_theta: float = 10000.0
    rope_scale: float = 1.0
    rope_rotary_dim: Optional[int] = None
    rope_interleaved: bool = False
    rope_ext_factors: Optional[Tuple[float, ...]] = None
    rope_original_max_position_embeddings: Optional[int] = None
    rope_attention_factor: float = 1.0
    dtype: str = "float16"
    kv_dtype: Optional[str] = None
    support_sliding_window: bool = False
    attn_kinds: Optional[Tuple[AttnKind, ...]] = None
    layer_sliding_window_size: int = 1024
    attention_chunk_size: Optional[int] = None
    mla_original_qk_head_dim: Optional[int] = None
    mla_original_v_head_dim: Optional[int] = None
    context_chunk_size: Optional[int] = None
    prefix_caching: bool = False
    host_cache_pages: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_qo_heads", "num_kv_heads", "head_dim", "page_size",
                     "max_num_seqs", "max_total_seq_len", "prefill_chunk_size",
                     "layer_sliding_window_size"):
            object.__setattr__(self, name, _positive(name, getattr(self, name)))
        if self.num_layers > MAX_NUM_LAYERS:
            raise ConfigError(f"KVCacheConfig.num_layers {self.num_layers} is more than {MAX_NUM_LAYERS}, "
                              "the most a cache holds (one page tensor per layer)")
        if self.num_qo_heads % self.num_kv_heads != 0:
            raise ConfigError(f"KVCacheConfig.num_qo_heads ({self.num_qo_heads}) must be a "
                              f"multiple of num_kv_heads ({self.num_kv_heads})")
        v_head_dim = self.head_dim if self.v_head_dim is None else _positive("v_head_dim", self.v_head_dim)
        object.__setattr__(self, "v_head_dim", v_head_dim)
        object.__setattr__(self, "dtype", _dtype(self.dtype))
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"KVCacheConfig.kv_dtype must be None (pages of dtype) or one of {KV_DTYPES}, "
                              f"got {describe(self.kv_dtype)}")
        if self.kv_dtype is not None:
            object.__setattr__(self, "kv_dtype", str(self.kv_dtype))
        if not isinstance(self.prefix_caching, (bool, np.bool_)):
            raise ConfigError(f"KVCacheConfig.prefix_caching must be a bool, got {describe(self.prefix_caching)}")
        object.__setattr__(self, "prefix_caching", bool(self.prefix_caching))
        host = exact_int(self.host_cache_pages)
        if host is None or not 0 <= host <= MAX_INT or (host and not self.prefix_caching):
            raise ConfigError(f"KVCacheConfig.host_cache_pages must be an int in [0, {MAX_INT}], and 0 without "
                              f"prefix_caching; got {describe(self.host_cache_pages)} (prefix_caching="
                              f"{self.prefix_caching})")
        object.__setattr__(self, "host_cache_pages", host)
        try:
            object.__setattr__(self, "rope_mode", RopeMode(exact_int(self.rope_mode)))  # not an int: None, ValueError
        except ValueError:
            raise ConfigError("KVCacheConfig.rope_mode must be 0 (NONE), 1 (NORMAL) or 2 "
                              f"(INLINE), got {describe(self.rope_mode)}") from None
        for name in ("rope_theta", "rope_scale"):
            value = _rope_float(name, getattr(self, name), used=self.rope_mode != RopeMode.NONE)
            object.__setattr__(self, name, value)
        sliding = as_bool("KVCacheConfig.support_sliding_window", self.support_sliding_window, error=ConfigError)
        object.__setattr__(self, "support_sliding_window", sliding)
        object.__setattr__(self, "attn_kinds", self._validated_attn_kinds(self.attn_kinds))
        if self.is_mla:
            self._check_mla()
        else:
            self._check_mha()
        self._check_local_layers()
        self._check_rotary_dim()
        self._check_longrope()
        chunk = self.prefill_chunk_size if self.context_chunk_size is None else self.context_chunk_size
        object.__setattr__(self, "context_chunk_size", _positive("context_chunk_size", chunk))
        self._check_tensor_sizes()

    def _check_tensor_sizes(self) -> None:
        """Refuse configs whose tensors no device holds or int32 indices cannot reach."""
        qk, v = self.mla_original_qk_head_dim or 0, self.mla_original_v_head_dim or 0
        widest = max(self.head_dim, self.v_head_dim, qk, v)
        page_width = self.head_dim if self.is_mla else 2 * self.num_kv_heads * self.head_dim
        chunk, heads, rows = self.prefill_chunk_size, self.num_qo_heads, self.context_workspace_rows
        mla_fields = ("context_chunk_size", "num_qo_heads", "mla_original_qk_head_dim", "mla_original_v_head_dim")
        sizes = [  # (what, elements, the fields that set it)
            ("page tensors", self.num_layers * self.num_total_pages * self.page_size * page_width,
             ("num_layers", "max_total_seq_len", "page_size", "num_kv_heads", "head_dim")),
            ("per-step scratch tensors", chunk * heads * widest,
             ("prefill_chunk_size", "num_qo_heads", "head_dim", "v_head_dim"))]
        counts = [("one page", self.page_size * page_width, ("page_size", "num_kv_heads", "head_dim"))]
        if self.is_mla:  # q (n, Hq, latent width), outputs (n, Hq, v dims): no fused q / k / v
            counts.append(("a step's queries / outputs", chunk * heads * widest,
                           ("prefill_chunk_size", "num_qo_heads", "head_dim")))
        else:
            counts.append(("a step's fused q / k / v", chunk * (heads + 2 * self.num_kv_heads) * widest,
                           ("prefill_chunk_size", "num_qo_heads", "num_kv_heads", "head_dim")))
        if self.is_mla and qk:  # k (C, Hq, qk), v (C, Hq, v), latent rows (C, width)
            sizes.append(("MLA context workspace", rows * (heads * (qk + v) + self.head_dim), mla_fields))
            counts.append(("an MLA context chunk's k / v", rows * max(heads * max(qk, v), self.head_dim),
                           mla_fields))

        def given(fields: Tuple[str, ...]) -> str:
            return ", ".join(f"{name}={getattr(self, name)}" for name in fields)

        for what, elements, fields in sizes:
            if elements * DTYPE_BYTES[self.dtype] > MAX_TENSOR_BYTES:
                raise ConfigError(f"KVCacheConfig: the {what} would take {elements * DTYPE_BYTES[self.dtype]} bytes, "
                                  f"more than {MAX_TENSOR_BYTES} ({given(fields)})")
        for what, elements, fields in counts:
            if elements > MAX_INT:
                raise ConfigError(f"KVCacheConfig: {what} would hold {elements} elements; the kernels index it with "
                                  f"int32, so at most {MAX_INT} ({given(fields)})")

    def _check_mha(self) -> None:
        if self.head_dim % 2 != 0 or self.head_dim > MAX_HEAD_DIM:
            raise ConfigError(
                f"KVCacheConfig.head_dim must be even and at most {MAX_HEAD_DIM}, got {self.head_dim}")
        if self.v_head_dim != self.head_dim:
            raise ConfigError(f"KVCacheConfig.v_head_dim ({self.v_head_dim}) must equal head_dim "
                              f"({self.head_dim}) for MHA layers")
        for name in ("mla_original_qk_head_dim", "mla_original_v_head_dim"):
            if getattr(self, name) is not None:
                raise ConfigError(f"KVCacheConfig.{name} applies to MLA caches only, got {describe(getattr(self, name))} "
                                  f"with attn_kinds {self._kind_names}")

    def _check_mla(self) -> None:
        if any(kind != AttnKind.MLA for kind in self.attn_kinds):
            raise ConfigError(f"KVCacheConfig.attn_kinds mixes MLA with other kinds "
                              f"({self._kind_names}); expected all layers MLA or none")
        if self.num_kv_heads != 1:
            raise ConfigError(f"KVCacheConfig.num_kv_heads must be 1 for MLA (one latent head), got {self.num_kv_heads}")
        if self.head_dim % 2 != 0 or self.head_dim > MAX_LATENT_WIDTH or not self.v_head_dim < self.head_dim:
            raise ConfigError(
                f"MLA KVCacheConfig needs an even head_dim (latent width kv_lora_rank + rope dim) of at most "
                f"{MAX_LATENT_WIDTH} and v_head_dim (kv_lora_rank) < head_dim; got head_dim {self.head_dim}, "
                f"v_head_dim {self.v_head_dim}")
        if self.support_sliding_window:
            raise ConfigError("KVCacheConfig.support_sliding_window is not supported for MLA (as in TVM)")
        dims = (self.mla_original_qk_head_dim, self.mla_original_v_head_dim)
        if (dims[0] is None) != (dims[1] is None):
            raise ConfigError(f"KVCacheConfig.mla_original_qk_head_dim and mla_original_v_head_dim must be given "
                              f"together, got {describe(dims[0])} and {describe(dims[1])}")
        if dims[0] is not None:
            qk = _positive("mla_original_qk_head_dim", dims[0])
            v = _positive("mla_original_v_head_dim", dims[1])
            if qk % 2 != 0 or qk > MAX_HEAD_DIM or v > MAX_HEAD_DIM:
                raise ConfigError(f"KVCacheConfig.mla_original_qk_head_dim must be even and both original head dims "
                                  f"at most {MAX_HEAD_DIM}, got {qk} and {v}")
            object.__setattr__(self, "mla_original_qk_head_dim", qk)  # Python ints: no int64 wraparound
            object.__setattr__(self, "mla_original_v_head_dim", v)

    def _check_local_layers(self) -> None:
        chunked = AttnKind.MHA_CHUNKED_LOCAL in self.attn_kinds
        if not chunked:
            if self.attention_chunk_size is not None:
                raise ConfigError(f"KVCacheConfig.attention_chunk_size applies to AttnKind.MHA_CHUNKED_LOCAL layers "
                                  f"only, got {describe(self.attention_chunk_size)} with attn_kinds "
                                  f"{self._kind_names}")
            return
        if AttnKind.MHA_SLIDING in self.attn_kinds:
            raise ConfigError("KVCacheConfig.attn_kinds mixes MHA_SLIDING and MHA_CHUNKED_LOCAL layers "
                              f"({self._kind_names}); a cache has one kind of local layer")
        if self.attention_chunk_size is None:
            raise ConfigError("KVCacheConfig.attention_chunk_size is required with AttnKind.MHA_CHUNKED_LOCAL layers "
                              f"(attn_kinds {self._kind_names}), got None")
        object.__setattr__(self, "attention_chunk_size", _positive("attention_chunk_size", self.attention_chunk_size))

    def _check_rotary_dim(self) -> None:
        interleaved = as_bool("KVCacheConfig.rope_interleaved", self.rope_interleaved, error=ConfigError)
        object.__setattr__(self, "rope_interleaved", interleaved)
        if interleaved and (self.is_mla or self.effective_rope_mode != RopeMode.NORMAL):
            raise ConfigError("KVCacheConfig.rope_interleaved (GPT-J style RoPE) needs rope_mode NORMAL on an MHA cache "
                              "without support_sliding_window (the attention kernels' inline RoPE pairs halves), got "
                              f"rope_mode {self.rope_mode.name}, support_sliding_window {self.support_sliding_window}")
        if self.rope_rotary_dim is None:
            return
        rotary = _positive("rope_rotary_dim", self.rope_rotary_dim)
        if self.is_mla or rotary % 2 or rotary > self.head_dim:
            raise ConfigError(f"KVCacheConfig.rope_rotary_dim must be even and at most head_dim={self.head_dim} on an "
                              f"MHA cache, got {rotary}" + (" (MLA caches: the model applies RoPE)" if self.is_mla else ""))
        if rotary < self.head_dim and self.effective_rope_mode != RopeMode.NORMAL:
            raise ConfigError(f"KVCacheConfig.rope_rotary_dim {rotary} < head_dim {self.head_dim} needs rope_mode NORMAL "
                              f"without support_sliding_window (the attention kernels' inline RoPE rotates whole heads), "
                              f"got rope_mode {self.rope_mode.name}, support_sliding_window {self.support_sliding_window}")
        object.__setattr__(self, "rope_rotary_dim", rotary)

    @property
    def _kind_names(self) -> list:
        return [kind.name for kind in self.attn_kinds]

    @property
    def rotary_dim(self) -> int:
        """Features of a q / k head that RoPE rotates: ``rope_rotary_dim`` or ``head_dim``."""
        return self.head_dim if self.rope_rotary_dim is None else self.rope_rotary_dim

    def _check_longrope(self) -> None:
        """Validate the LongRoPE fields; store the factors as float32 values."""
        factors = self.rope_ext_factors
        attention = _rope_float("rope_attention_factor", self.rope_attention_factor, used=True)
        object.__setattr__(self, "rope_attention_factor", attention)
        if factors is None:
            if self.rope_original_max_position_embeddings is not None or attention != 1.0:
                raise ConfigError("KVCacheConfig.rope_original_max_position_embeddings and rope_attention_factor apply "
                                  "with rope_ext_factors only, got "
                                  f"{describe(self.rope_original_max_position_embeddings)} and {attention}")
            return
        if self.is_mla or self.effective_rope_mode != RopeMode.NORMAL:
            raise ConfigError("KVCacheConfig.rope_ext_factors (LongRoPE) need rope_mode NORMAL on an MHA cache "
                              f"without support_sliding_window (as in TVM), got rope_mode {self.rope_mode.name}, "
                              f"support_sliding_window {self.support_sliding_window}, "
                              f"attn_kinds {self._kind_names}")
        object.__setattr__(self, "rope_ext_factors", _ext_factors(factors, self.rotary_dim))
        if self.rope_original_max_position_embeddings is not None:
            object.__setattr__(self, "rope_original_max_position_embeddings",
                               _positive("rope_original_max_position_embeddings",
                                         self.rope_original_max_position_embeddings))

    def _validated_attn_kinds(self, kinds: Optional[Sequence[int]]) -> Tuple[AttnKind, ...]:
        if kinds is None:
            return (AttnKind.MHA,) * self.num_layers
        try:
            kinds = tuple(as_int_list("KVCacheConfig.attn_kinds", kinds, max_len=MAX_NUM_LAYERS))
        except KVCacheError:
            raise ConfigError(f"KVCacheConfig.attn_kinds must be a list, tuple or 1-D array of ints (0, 1, 3 or 4), "
                              f"got {describe(kinds)} of type {type(kinds).__name__}") from None
        if len(kinds) != self.num_layers:
            raise ConfigError(
                f"KVCacheConfig.attn_kinds has {len(kinds)} entries, expected num_layers={self.num_layers}")
        try:
            return tuple(AttnKind(exact_int(k)) for k in kinds)
        except ValueError:
            raise ConfigError("KVCacheConfig.attn_kinds entries must be 0 (MHA), 1 (MLA), 3 "
                              "(MHA_SLIDING) or 4 (MHA_CHUNKED_LOCAL), got "
                              f"{describe(kinds)}") from None

    @property
    def num_total_pages(self) -> int:
        """Pages in the pool, computed as TVM's creation function does."""
        pages = -(-self.max_total_seq_len // self.page_size) + 1
        if self.support_sliding_window:
            pages += 2 * self.max_num_seqs
        return pages

    @property
    def context_workspace_rows(self) -> int:
        """Rows of the MLA context workspace: a chunk, never more than the pages hold."""
        return min(self.context_chunk_size, self.num_total_pages * self.page_size)

    @property
    def page_dtype(self) -> str:
        """The pages' element type: ``kv_dtype``, or ``dtype`` without it."""
        return self.kv_dtype or self.dtype

    @property
    def is_mla(self) -> bool:
        """Whether the layers are ``AttnKind.MLA`` (latent pages ``(P, page_size, head_dim)``)."""
        return AttnKind.MLA in self.attn_kinds

    @property
    def has_layer_windows(self) -> bool:
        """Whether some layer is local: ``AttnKind.MHA_SLIDING`` (attends over the last
        ``layer_sliding_window_size`` positions) or ``AttnKind.MHA_CHUNKED_LOCAL`` (over its
        query's attention chunk). Such caches run the windowed kernels (``[3, B]`` length info)."""
        return any(kind in LOCAL_KINDS for kind in self.attn_kinds)

    @property
    def layer_span(self) -> LayerSpan:
        """What the local layers' queries see (falsy when no layer is local)."""
        if AttnKind.MHA_CHUNKED_LOCAL in self.attn_kinds:
            return LayerSpan(chunk=self.attention_chunk_size)
        if AttnKind.MHA_SLIDING in self.attn_kinds:
            return LayerSpan(window=self.layer_sliding_window_size)
        return LayerSpan()

    @property
    def slides_sequences(self) -> bool:
        """Whether per-sequence sliding windows (``enable_sliding_window_for_seq``) really slide.

        As in TVM, a model with per-layer sliding windows does not slide sequences even when
        ``support_sliding_window`` is set.
        """
        return self.support_sliding_window and not self.has_layer_windows

    @property
    def effective_rope_mode(self) -> RopeMode:
        """RoPE mode the cache runs with: sliding windows force INLINE (as TVM does)."""
        if self.support_sliding_window and self.rope_mode != RopeMode.NONE:
            return RopeMode.INLINE
        return self.rope_mode

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_qo_heads // self.num_kv_heads
