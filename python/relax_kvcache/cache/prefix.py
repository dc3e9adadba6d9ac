"""The cache's side of prefix caching (``KVCacheConfig.prefix_caching``, `paging.prefix`): a
step's token ids checked, and the counters of ``prefix_cache_stats``."""

from __future__ import annotations

from typing import Any, List, Optional

from ..args import as_int_list
from ..errors import ArgumentError, ForwardError, KVCacheError
from ..paging import PagingState
from ..paging.prefix import check_token_ids


def check_step_tokens(seq_ids: Any, append_lengths: Any, parent_ptr: Any, token_ids: Any) -> Optional[List[int]]:
    """``begin_forward``'s ``token_ids`` as a list (one id >= 0 per appended token), or None when
    the batch itself is malformed (the planner then says how)."""
    if parent_ptr is not None:
        raise ForwardError("begin_forward takes token_ids only for steps without a token tree")
    lengths = as_int_list("append_lengths", append_lengths)
    if len(lengths) != len(as_int_list("seq_ids", seq_ids)) or not lengths or min(lengths) < 1:
        return None
    return check_token_ids("token_ids", as_int_list("token_ids", token_ids, error=ArgumentError), sum(lengths))


def stats(paging: PagingState) -> dict:
    """The counters of :meth:`PagedAttentionKVCache.prefix_cache_stats`."""
    if not paging.prefix_caching:
        raise KVCacheError("prefix_cache_stats needs a cache created with KVCacheConfig(prefix_caching=True)")
    counters, cached, evictable, host = paging.prefix_stats()
    lookup = counters.lookup_tokens
    return {"lookups": counters.lookups, "lookup_tokens": lookup, "hit_tokens": counters.hit_tokens,
            "hit_rate": counters.hit_tokens / lookup if lookup else 0.0, "registered_pages": counters.registered,
            "cached_pages": cached, "evictable_pages": evictable, "evicted_pages": counters.evicted,
            "host_pages": host, "spilled_pages": counters.spilled, "loaded_pages": counters.loaded,
            "host_dropped_pages": counters.host_dropped}
