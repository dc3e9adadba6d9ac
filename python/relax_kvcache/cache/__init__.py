"""The paged KV cache: :class:`PagedAttentionKVCache` (``core``) and its components."""

from .core import PagedAttentionKVCache

__all__ = ["PagedAttentionKVCache"]
