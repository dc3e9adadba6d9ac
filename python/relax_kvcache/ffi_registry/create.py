"""``relax_kvcache.paged_attention_kv_cache_create``: TVM 0.27's creation arguments (docs/api.md)
plus ours (a 7th to 10th ``cache_config`` entry, a 29th to 31st argument), our cache."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import tvm_ffi

from ..args import as_bool, as_float, as_int, as_int_list, describe, exact_int
from ..cache import PagedAttentionKVCache
from ..config import KV_DTYPE_CODES, MAX_INT, MAX_NUM_LAYERS, AttnKind, KVCacheConfig
from ..errors import ArgumentError, ConfigError
from ..kernel_set import KernelSet
from ..tensors import TENSOR_TYPES


def paged_attention_kv_cache_create(*args: Any) -> PagedAttentionKVCache:
    """Create a :class:`PagedAttentionKVCache` from TVM's positional creation arguments.

    Every argument is checked before anything is built: ints must be ints (not floats, bools or
    strings), flags bools or 0/1; a wrong type raises ``ArgumentError``, a bad value
    ``ConfigError`` (``NotImplementedError`` for features relax_kvcache lacks).
    """
    if not 28 <= len(args) <= 31:
        raise ArgumentError("paged_attention_kv_cache_create takes 28 to 31 arguments, got "
                            f"{len(args)}")
    cache_config = as_int_list("cache_config (argument 0)", args[0], max_len=10, error=ConfigError)
    if len(cache_config) not in (5, 6, 7, 8, 9, 10):
        raise ConfigError("cache_config must hold (reserved_num_seqs, total_token_capacity, "
                          "prefill_chunk_size, page_size, support_sliding_window[, "
                          "layer_sliding_window_size[, attention_chunk_size[, kv_dtype[, "
                          f"prefix_caching[, host_cache_pages]]]]]), got {cache_config}")
    if cache_config[4] not in (0, 1):
        raise ConfigError("cache_config[4] (support_sliding_window) must be 0 or 1, got "
                          f"{cache_config[4]}")
    chunk = cache_config[6] if len(cache_config) >= 7 else 0
    if not 0 <= chunk <= MAX_INT:
        raise ConfigError(f"cache_config[6] (attention_chunk_size) must be in [0, {MAX_INT}] (0: "
                          f"no chunked layers), got {chunk}")
    kv_code = cache_config[7] if len(cache_config) >= 8 else 0
    if not 0 <= kv_code < len(KV_DTYPE_CODES):
        raise ConfigError(f"cache_config[7] (kv_dtype) must be 0 (pages of the cache dtype) or 1 + an index "
                          f"into {KV_DTYPE_CODES[1:]}, got {kv_code}")
    prefix_caching = cache_config[8] if len(cache_config) >= 9 else 0
    if prefix_caching not in (0, 1):
        raise ConfigError(f"cache_config[8] (prefix_caching) must be 0 or 1, got {prefix_caching}")
    host_pages = cache_config[9] if len(cache_config) == 10 else 0
    if not 0 <= host_pages <= MAX_INT or (host_pages and not prefix_caching):
        raise ConfigError(f"cache_config[9] (host_cache_pages) must be in [0, {MAX_INT}], and 0 without prefix "
                          f"caching (cache_config[8]), got {host_pages}")
    layer_indptr = as_int_list("layer_indptr (argument 1)", args[1], max_len=2, error=ConfigError)
    if len(layer_indptr) != 2 or not 0 <= layer_indptr[0] < layer_indptr[1]:
        raise ConfigError("layer_indptr must be (layer_begin, layer_end) of one group, got "
                          f"{layer_indptr}")
    if as_bool("enable_kv_transfer (argument 7)", args[7]):
        raise NotImplementedError("enable_kv_transfer (NVSHMEM disaggregation) is not supported "
                                  "by relax_kvcache")
    ext_factors = _ext_factors(args[11])
    init = args[12]
    if type(init) not in TENSOR_TYPES or not init.__chandle__():
        raise ArgumentError("argument 12 must be a tensor giving the cache dtype and device, got "
                            f"{describe(init)} of type {type(init).__name__}")
    begin, end = layer_indptr
    attn_kinds = as_int_list("attn_kinds (argument 6)", args[6], max_len=MAX_NUM_LAYERS,
                             why="the most layers a cache holds", error=ConfigError)
    if len(attn_kinds) < end:
        raise ConfigError(f"attn_kinds has {len(attn_kinds)} entries, fewer than layer_end={end}")
    names = ("num_qo_heads", "num_kv_heads", "qk_head_dim", "v_head_dim")
    heads = [as_int(f"{name} (argument {i})", args[i]) for i, name in enumerate(names, start=2)]
    if ext_factors is not None and (len(ext_factors) % 2 or not 2 <= len(ext_factors) <= heads[2]):
        raise ConfigError(f"rope_ext_factors (argument 11) holds {len(ext_factors)} factors; "
                          f"expected an even count of at most qk_head_dim={heads[2]} (the rotary "
                          "dim's long factors, then its short ones)")
    kinds = attn_kinds[begin:end]
    config = KVCacheConfig(
        num_layers=end - begin, num_qo_heads=heads[0], num_kv_heads=heads[1], head_dim=heads[2],
        v_head_dim=heads[3], page_size=cache_config[3], max_num_seqs=cache_config[0],
        max_total_seq_len=cache_config[1], prefill_chunk_size=cache_config[2],
        rope_mode=as_int("rope_mode (argument 8)", args[8]),
        rope_scale=as_float("rope_scale (argument 9)", args[9], not_finite=ConfigError),
        rope_theta=as_float("rope_theta (argument 10)", args[10], not_finite=ConfigError),
        dtype=str(init.dtype), support_sliding_window=bool(cache_config[4]), attn_kinds=kinds,
        layer_sliding_window_size=cache_config[5] if len(cache_config) >= 6 else 1024,
        # shared by the groups of a model: only a group with chunked layers takes it
        attention_chunk_size=(chunk or None) if AttnKind.MHA_CHUNKED_LOCAL in kinds else None,
        rope_ext_factors=ext_factors,
        # TVM's factors are (rotary_dim,): fewer than qk_head_dim means a partial rotary dim
        rope_rotary_dim=len(ext_factors) if ext_factors and len(ext_factors) < heads[2] else None,
        kv_dtype=KV_DTYPE_CODES[kv_code], prefix_caching=bool(prefix_caching), host_cache_pages=host_pages,
    )
    return PagedAttentionKVCache(config, init.device, kernels=KernelSet.from_creation_args(args, bool(kv_code)),
                                 layer_offset=begin)


def _ext_factors(value: Any) -> Optional[Tuple[float, ...]]:
    """Argument 11: None, or a 1-D float32 tensor of LongRoPE factors (read to the host once).
    As in TVM, 0 (its frontends' ``PrimValue(0)``) and a list of ones carry none; other
    non-tensors, which TVM would ignore silently, are refused."""
    if value is None or exact_int(value) == 0 or _ones(value):
        return None
    if type(value) not in TENSOR_TYPES or not value.__chandle__():
        raise ArgumentError("rope_ext_factors (argument 11) must be None, 0 (TVM's null value), a "
                            "list of ones (no factors) or a float32 tensor of LongRoPE factors, "
                            f"got {describe(value)} of type {type(value).__name__}")
    if str(value.dtype) != "float32" or len(value.shape) != 1:
        raise ConfigError("rope_ext_factors (argument 11) must be a 1-D float32 tensor (rotary-dim "
                          f"factors: long, then short), got {value.dtype} of shape "
                          f"{tuple(value.shape)}")
    return tuple(float(x) for x in value.numpy())


def _ones(value: Any) -> bool:
    """Whether ``value`` is a non-empty list, tuple or tvm_ffi Array of numbers all equal to 1."""
    if not isinstance(value, (list, tuple, tvm_ffi.Array)):
        return False
    items = list(value)
    return bool(items) and all(isinstance(x, (int, float)) and not isinstance(x, bool) and x == 1
                               for x in items)
