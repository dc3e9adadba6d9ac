"""Typed kernel specs: every kernel factory is keyed by one of these frozen dataclasses.

A spec holds exactly what changes the generated code (head counts, head dims, page size, dtype,
variant flags). Runtime values (sequence lengths, RoPE theta for the attention kernels, sm_scale)
are kernel arguments, not spec fields.
"""

from __future__ import annotations

import dataclasses

from ..config import KV_DTYPE_MAX, SUPPORTED_DTYPES, LayerSpan


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _check_dtype(dtype: str) -> None:
    _check(dtype in SUPPORTED_DTYPES, f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype!r}")


#: 8-bit float formats pages may store (``kv_dtype``) and their largest finite values
FP8_MAX = KV_DTYPE_MAX


class _KVStorage:
    """``kv_dtype``: the pages' element type, None for the model ``dtype``; an 8-bit float
    (:data:`FP8_MAX`) stores ``value / scale`` saturated to the format's range, with one float32
    scale per (K or V, KV head) of the layer, passed to the kernels as ``kv_scales (2,
    num_kv_heads) float32``."""

    def _check_kv_dtype(self) -> None:
        _check(self.kv_dtype is None or self.kv_dtype in FP8_MAX,
               f"kv_dtype must be None (the model dtype) or one of {tuple(FP8_MAX)}, got {self.kv_dtype!r}")

    @property
    def page_dtype(self) -> str:
        """The element type of the pages."""
        return self.kv_dtype or self.dtype

    @property
    def quantized(self) -> bool:
        """Whether pages store scaled 8-bit floats (the kernels take ``kv_scales``)."""
        return self.kv_dtype is not None

    def load_lanes(self, lanes: int) -> int:
        """Elements per vector load of K / V rows that are dequantized on the way: at most 4 for
        8-bit pages (TVM's CUDA code generation mis-emits 8-lane 8-bit and float32 vectors)."""
        return min(lanes, 4) if self.quantized else lanes


@dataclasses.dataclass(frozen=True, kw_only=True)
class PageLayoutSpec(_KVStorage):
    """Layout of one layer's MHA pages: ``(num_pages, 2, num_kv_heads, page_size, head_dim)``
    of ``page_dtype`` (:class:`_KVStorage`)."""

    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str
    kv_dtype: "str | None" = None

    def __post_init__(self) -> None:
        _check_dtype(self.dtype)
        self._check_kv_dtype()
        for name in ("num_kv_heads", "head_dim", "page_size"):
            _check(getattr(self, name) > 0, f"{name} must be positive, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LatentPageSpec(_KVStorage):
    """Layout of one MLA layer's pages: ``(num_pages, page_size, width)`` of ``page_dtype``,
    ``width = kv_lora_rank + qk_rope_head_dim``. Keys the ``*_mla`` page kernels. Over 8-bit
    pages (:class:`_KVStorage`) one scale serves the whole latent row: ``kv_scales[0, 0]`` of
    ``kv_scales (2, 1) float32`` (K and V are the same row)."""

    width: int
    page_size: int
    dtype: str
    kv_dtype: "str | None" = None

    def __post_init__(self) -> None:
        _check_dtype(self.dtype)
        self._check_kv_dtype()
        for name in ("width", "page_size"):
            _check(getattr(self, name) > 0, f"{name} must be positive, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LongRopeSpec:
    """LongRoPE (Phi-3) frequency scaling of ``split_rotary``.

    The kernel then takes the factors ``ext_factors (rotary_dim,) float32`` (long factors of the
    ``rotary_dim / 2`` frequencies, then short ones) in place of its apply-RoPE flag: a token at
    position ``p`` uses the long factors when ``p >= original_max_position_embeddings``, and cos
    and sin are multiplied by ``attention_factor``.
    """

    original_max_position_embeddings: int
    attention_factor: float

    def __post_init__(self) -> None:
        _check(self.original_max_position_embeddings > 0, "original_max_position_embeddings must be positive, "
               f"got {self.original_max_position_embeddings}")
        _check(self.attention_factor > 0, f"attention_factor must be positive, got {self.attention_factor}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeSplitSpec:
    """Split fused ``qkv (n, Hq + 2 Hkv, D)`` into q, k, v and apply normal RoPE to q and k.

    RoPE theta and scale are compiled in, as in TVM's ``split_rotary`` convention; ``longrope``
    (optional) adds LongRoPE factors (:class:`LongRopeSpec`).
    """

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    rope_theta: float
    rope_scale: float
    longrope: "LongRopeSpec | None" = None
    #: features rotated (the first ``rotary_dim``; the rest copied); None: all of ``head_dim``
    rotary_dim: "int | None" = None
    #: GPT-J style: rotate neighbouring features ``(2i, 2i + 1)`` (default: ``(i, i + rotary / 2)``)
    interleaved: bool = False

    def __post_init__(self) -> None:
        _check_dtype(self.dtype)
        _check(self.head_dim % 2 == 0, f"head_dim must be even for RoPE, got {self.head_dim}")
        _check(self.rotary % 2 == 0 and 2 <= self.rotary <= self.head_dim,
               f"rotary_dim must be even, in [2, head_dim={self.head_dim}], got {self.rotary_dim}")

    @property
    def rotary(self) -> int:
        """The rotated features: ``rotary_dim`` or ``head_dim``."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim


@dataclasses.dataclass(frozen=True, kw_only=True)
class MergeSpec:
    """Merge two attention states ``(o (n, H, D), lse (n, H))`` in place by log-sum-exp."""

    num_heads: int
    head_dim: int
    dtype: str

    def __post_init__(self) -> None:
        _check_dtype(self.dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionSpec(_KVStorage):
    """Attention of ``Hq`` query heads over ``Hkv`` KV heads (GQA group ``Hq // Hkv``).

    ``kv_dtype`` (paged kernels): the pages' element type (:class:`_KVStorage`); 8-bit pages are
    dequantized on load, in registers.

    ``sliding_window`` selects the ``length_info`` layout of the paged kernels: ``[B]``
    (last page length) when False, ``[3, B]`` (last page length, window offset, sink size)
    when True. Ragged kernels ignore ``page_size`` and ``sliding_window``.

    ``window > 0`` restricts a query at ``q_pos`` to keys at positions ``(q_pos - window, q_pos]``,
    ``attention_chunk > 0`` to its own chunk ``[q_pos - q_pos % attention_chunk, q_pos]``
    (:class:`LayerSpan`).
    """

    num_qo_heads: int
    num_kv_heads: int
    qk_head_dim: int
    v_head_dim: int
    dtype: str
    page_size: int = 16
    sliding_window: bool = False
    window: int = 0
    attention_chunk: int = 0
    kv_dtype: "str | None" = None

    def __post_init__(self) -> None:
        _check_dtype(self.dtype)
        self._check_kv_dtype()
        _check(self.window >= 0 and self.attention_chunk >= 0 and not (self.window and self.attention_chunk),
               f"window and attention_chunk must be >= 0 and not both set, got {self.window}, {self.attention_chunk}")
        _check(self.num_qo_heads % self.num_kv_heads == 0,
               f"num_qo_heads ({self.num_qo_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        _check(self.qk_head_dim % 2 == 0, f"qk_head_dim must be even, got {self.qk_head_dim}")

    @property
    def group_size(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    @property
    def span(self) -> LayerSpan:
        """The keys each query sees by position (falsy: no positional restriction)."""
        return LayerSpan(window=self.window, chunk=self.attention_chunk)

    @property
    def is_local(self) -> bool:
        """Whether keys are restricted by position (a window or an attention chunk)."""
        return bool(self.span)
