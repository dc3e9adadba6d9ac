"""Prefix caching for engines that drive the cache through global functions (as MLC-LLM's does):
``relax_kvcache.add_sequence_with_tokens``, ``relax_kvcache.begin_forward_with_tokens`` and
``relax_kvcache.prefix_cache_stats`` (docs/api.md, docs/prefix-caching.md)."""

from __future__ import annotations

from typing import Any, Callable, Dict

import tvm_ffi

from ..args import describe
from ..cache import PagedAttentionKVCache
from ..errors import ArgumentError
from ..tensors import TENSOR_TYPES

PREFIX = "relax_kvcache."


def _our_cache(name: str, cache: Any) -> PagedAttentionKVCache:
    if not isinstance(cache, PagedAttentionKVCache):
        raise ArgumentError(f"{PREFIX}{name}: the cache is {describe(cache)} of type {type(cache).__name__}; "
                            "expected a relax_kvcache.PagedAttentionKVCache (TVM's caches have no prefix caching)")
    return cache


def _token_ids(name: str, token_ids: Any) -> Any:
    """``token_ids`` as the cache takes them: a ShapeTuple, an Array or a list as given; a 1-D
    int32 / int64 host tensor read to a numpy array."""
    if not isinstance(token_ids, TENSOR_TYPES):
        return token_ids
    device = token_ids.device
    if (str(token_ids.dtype) not in ("int32", "int64") or len(token_ids.shape) != 1
            or device.dlpack_device_type() != tvm_ffi.Device("cpu", 0).dlpack_device_type()):
        raise ArgumentError(f"{PREFIX}{name}: token_ids is a tensor of dtype {token_ids.dtype} and shape "
                            f"{tuple(token_ids.shape)} on {device}; expected a 1-D int32 or int64 host (CPU) "
                            "tensor, or a ShapeTuple")
    return token_ids.numpy()


def add_sequence_with_tokens(cache: Any, seq_id: int, token_ids: Any, salt: Any = None) -> int:
    """``cache.add_sequence(seq_id, token_ids, salt)``: the tokens the new sequence starts with
    (from cached pages; 0 without prefix caching)."""
    name = "add_sequence_with_tokens"
    return _our_cache(name, cache).add_sequence(seq_id, _token_ids(name, token_ids), salt)


def begin_forward_with_tokens(cache: Any, seq_ids: Any, append_lengths: Any, token_ids: Any) -> None:
    """``cache.begin_forward(seq_ids, append_lengths, token_ids=token_ids)``: a step whose
    appended tokens' ids (one each, in batch order) register the pages it fills."""
    name = "begin_forward_with_tokens"
    _our_cache(name, cache).begin_forward(seq_ids, append_lengths, token_ids=_token_ids(name, token_ids))


def prefix_cache_stats(cache: Any) -> Dict[str, Any]:
    """``cache.prefix_cache_stats()``, a ``Map`` of str to int (``hit_rate``: float)."""
    return _our_cache("prefix_cache_stats", cache).prefix_cache_stats()


#: global name -> function
PREFIX_FUNCTIONS: Dict[str, Callable[..., Any]] = {
    PREFIX + f.__name__: f for f in (add_sequence_with_tokens, begin_forward_with_tokens, prefix_cache_stats)}


def register_prefix_functions() -> None:
    """Register :data:`PREFIX_FUNCTIONS` (idempotent)."""
    for name, function in PREFIX_FUNCTIONS.items():
        tvm_ffi.register_global_func(name, function, override=True)
