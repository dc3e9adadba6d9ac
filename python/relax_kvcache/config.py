"""Cache configuration: enums with TVM's integer values and the validated `KVCacheConfig`."""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Optional, Sequence, Tuple

from .errors import ConfigError

SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")
MAX_HEAD_DIM = 256


class RopeMode(enum.IntEnum):
    """Where rotary position embedding is applied (TVM's values).

    NONE: never. NORMAL: to q and k in the split kernel, before k enters the cache.
    INLINE: on the fly inside the attention kernels; the cache stores k without RoPE.
    """

    NONE = 0
    NORMAL = 1
    INLINE = 2


class AttnKind(enum.IntEnum):
    """Attention kind of a layer (TVM's values)."""

    MHA = 0
    MLA = 1
    MHA_SLIDING = 3


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"KVCacheConfig.{name} must be a positive int, got {value!r}")
    return value


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
        Features per q/k head; even, at most 256.
    v_head_dim : int, optional
        Features per v head; defaults to ``head_dim`` and must equal it for MHA layers.
    page_size : int
        Tokens per page.
    max_num_seqs : int
        Sequences the cache reserves metadata room for (TVM's ``reserved_num_seqs``).
    max_total_seq_len : int
        Token capacity over all sequences; the page pool holds
        ``ceil(max_total_seq_len / page_size) + 1`` pages (+ 2 per sequence with sliding windows).
    prefill_chunk_size : int
        Maximum number of tokens appended in one forward step.
    rope_mode : RopeMode
        Where RoPE is applied. With ``support_sliding_window`` a non-NONE mode becomes INLINE.
    rope_theta, rope_scale : float
        RoPE base and position scale (frequency ``pos * scale / theta^(2i/d)``).
    dtype : str
        KV dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"``.
    support_sliding_window : bool
        Reserve sliding-window support; kernels then take ``length_info`` of shape ``[3, B]``.
    attn_kinds : sequence of AttnKind, optional
        Per-layer attention kind; defaults to MHA everywhere.
    layer_sliding_window_size : int
        Window of ``AttnKind.MHA_SLIDING`` layers (TVM's optional 6th ``cache_config`` entry).
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
    dtype: str = "float16"
    support_sliding_window: bool = False
    attn_kinds: Optional[Tuple[AttnKind, ...]] = None
    layer_sliding_window_size: int = 1024

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_qo_heads", "num_kv_heads", "head_dim", "page_size",
                     "max_num_seqs", "max_total_seq_len", "prefill_chunk_size",
                     "layer_sliding_window_size"):
            _positive(name, getattr(self, name))
        if self.num_qo_heads % self.num_kv_heads != 0:
            raise ConfigError(
                f"KVCacheConfig.num_qo_heads ({self.num_qo_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2 != 0 or self.head_dim > MAX_HEAD_DIM:
            raise ConfigError(
                f"KVCacheConfig.head_dim must be even and at most {MAX_HEAD_DIM}, got {self.head_dim}")
        v_head_dim = self.head_dim if self.v_head_dim is None else _positive("v_head_dim", self.v_head_dim)
        object.__setattr__(self, "v_head_dim", v_head_dim)
        if self.dtype not in SUPPORTED_DTYPES:
            raise ConfigError(f"KVCacheConfig.dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        try:
            object.__setattr__(self, "rope_mode", RopeMode(self.rope_mode))
        except ValueError:
            raise ConfigError(
                f"KVCacheConfig.rope_mode must be 0 (NONE), 1 (NORMAL) or 2 (INLINE), got {self.rope_mode!r}"
            ) from None
        for name in ("rope_theta", "rope_scale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"KVCacheConfig.{name} must be a finite number, got {value!r}")
            if self.rope_mode != RopeMode.NONE and not value > 0:
                raise ConfigError(f"KVCacheConfig.{name} must be positive when RoPE is used, got {value!r}")
            object.__setattr__(self, name, float(value))
        object.__setattr__(self, "support_sliding_window", bool(self.support_sliding_window))
        object.__setattr__(self, "attn_kinds", self._validated_attn_kinds(self.attn_kinds))
        if any(kind != AttnKind.MLA for kind in self.attn_kinds) and v_head_dim != self.head_dim:
            raise ConfigError(
                f"KVCacheConfig.v_head_dim ({v_head_dim}) must equal head_dim ({self.head_dim}) "
                "for MHA layers")

    def _validated_attn_kinds(self, kinds: Optional[Sequence[int]]) -> Tuple[AttnKind, ...]:
        if kinds is None:
            return (AttnKind.MHA,) * self.num_layers
        kinds = tuple(kinds)
        if len(kinds) != self.num_layers:
            raise ConfigError(
                f"KVCacheConfig.attn_kinds has {len(kinds)} entries, expected num_layers={self.num_layers}")
        try:
            return tuple(AttnKind(int(k)) for k in kinds)
        except ValueError:
            raise ConfigError(
                f"KVCacheConfig.attn_kinds entries must be 0 (MHA), 1 (MLA) or 3 (MHA_SLIDING), got {kinds}"
            ) from None

    @property
    def num_total_pages(self) -> int:
        """Pages in the pool, computed as TVM's creation function does."""
        pages = -(-self.max_total_seq_len // self.page_size) + 1
        if self.support_sliding_window:
            pages += 2 * self.max_num_seqs
        return pages

    @property
    def has_layer_windows(self) -> bool:
        """Whether some layer is ``AttnKind.MHA_SLIDING`` (attends over the last
        ``layer_sliding_window_size`` tokens only)."""
        return AttnKind.MHA_SLIDING in self.attn_kinds

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
