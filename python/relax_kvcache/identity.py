"""The identity of a kernel library: the config fields its kernels were built for.

Libraries built by :mod:`relax_kvcache.build` hold one function ``kernel_spec_<field>`` per
field of :func:`kernel_identity`; :meth:`~relax_kvcache.KernelSet.from_module` reads them back
(:func:`read_identity`) and the cache refuses kernels built for another config. Everything here
reads the config alone, so a host with TVM's runtime only can compute it.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

from .config import SUPPORTED_DTYPES, KVCacheConfig

#: Prefix of the functions of a built library that return its :func:`kernel_identity`.
IDENTITY_PREFIX = "kernel_spec_"
#: The fields of :func:`kernel_identity`, in order.
IDENTITY_FIELDS = ("mla", "dtype", "page_size", "num_qo_heads", "num_kv_heads", "head_dim", "v_head_dim",
                   "mla_original_qk_head_dim", "mla_original_v_head_dim", "rope_theta", "rope_scale",
                   "sliding_window", "layer_sliding_window_size", "longrope_original_max_position",
                   "longrope_attention_factor", "rope_rotary_dim", "rope_interleaved", "attention_chunk_size")


def kernel_identity(config: KVCacheConfig) -> Dict[str, float]:
    """What ``config``'s kernels depend on, by field: the fields of its kernel set spec
    (:func:`relax_kvcache.kernel_specs.kernel_set_spec`), read from the config itself so that a host with TVM's runtime
    alone can compute them (the dtype as its index in ``SUPPORTED_DTYPES``, flags as 0 / 1,
    fields that do not apply as 0). Libraries built here return each from a function
    ``kernel_spec_<field>``; :class:`~relax_kvcache.PagedAttentionKVCache` refuses kernels built
    for other values."""
    mla, windows = config.is_mla, config.support_sliding_window or config.has_layer_windows
    return {
        "mla": int(mla), "dtype": SUPPORTED_DTYPES.index(config.dtype), "page_size": config.page_size,
        "num_qo_heads": config.num_qo_heads, "num_kv_heads": config.num_kv_heads, "head_dim": config.head_dim,
        "v_head_dim": config.v_head_dim,
        "mla_original_qk_head_dim": (config.mla_original_qk_head_dim or 0) if mla else 0,
        "mla_original_v_head_dim": (config.mla_original_v_head_dim or 0) if mla else 0,
        "rope_theta": 0.0 if mla else float(config.rope_theta),
        "rope_scale": 0.0 if mla else float(config.rope_scale),
        "sliding_window": int(not mla and windows),
        "layer_sliding_window_size": config.layer_span.window,
        "attention_chunk_size": config.layer_span.chunk,
        # LongRoPE: split_rotary takes the factors tensor (0: the apply-RoPE flag)
        "longrope_original_max_position": ((config.rope_original_max_position_embeddings or 0)
                                           if config.rope_ext_factors is not None else 0),
        "longrope_attention_factor": config.rope_attention_factor if config.rope_ext_factors is not None else 0.0,
        "rope_rotary_dim": 0 if mla else config.rotary_dim,
        "rope_interleaved": int(config.rope_interleaved),
    }


def read_identity(get: Callable[[str], Optional[Any]]) -> Optional[Tuple[Tuple[str, float], ...]]:
    """The ``kernel_spec_<field>`` values of a library, as (field, value) pairs, through ``get``
    (a function's name -> the function, or None where the library has none); None where a field
    is missing (TVM's kernels, libraries built before identities)."""
    functions = [(name, get(IDENTITY_PREFIX + name)) for name in IDENTITY_FIELDS]
    if any(f is None for _, f in functions):
        return None
    return tuple((name, f()) for name, f in functions)
