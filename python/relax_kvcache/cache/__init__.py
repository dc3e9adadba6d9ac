"""The paged KV cache: :class:`PagedAttentionKVCache` and its components.

Modules: ``core`` (the cache class: sequences, the forward protocol, attention entry points),
``planner`` and ``step`` (a step planned on the host, placed on the device, kept as one
object), ``attention`` / ``mla`` (the kernels MHA or MLA layers launch), ``commit`` (token-tree
commits) and ``debug`` (debug reads). Checkpoints live in :mod:`relax_kvcache.checkpoint`.
"""

from .core import PagedAttentionKVCache

__all__ = ["PagedAttentionKVCache"]
