"""TVM's native C++ paged KV cache with TVM's own CPU kernels: the baseline of benchmarks and
differential tests. Never imported by the library.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional

import tvm
from tvm.runtime import ShapeTuple
from tvm.s_tir import dlight as dl

import relax_kvcache as rk
from relax_kvcache.ffi_registry import original

NATIVE_CREATE = "vm.builtin.paged_attention_kv_cache_create"


@functools.lru_cache(maxsize=None)
def tvm_cpu_kernels(num_layers: int, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                    dtype: str, rope_theta: float, rope_scale: float) -> Dict[str, Any]:
    """Compile TVM's CPU kernels (``tvm.relax.frontend.nn.llm.kv_cache``) for one shape."""
    from tvm.relax.frontend.nn.llm import kv_cache as kc

    scaling: Dict[str, Any] = {}
    funcs = {
        "transpose_append": kc._kv_cache_transpose_append(num_kv_heads, head_dim, dtype, page_size),
        "debug_get_kv": kc._kv_cache_debug_get_kv(num_layers, num_kv_heads, head_dim, dtype),
        "prefill": kc._attention_prefill_cpu(num_kv_heads, num_qo_heads, head_dim, dtype, False, scaling, page_size),
        "decode": kc._attention_decode_cpu(num_kv_heads, num_qo_heads, head_dim, dtype, False, scaling, page_size),
        "prefill_sw": kc._attention_prefill_cpu(num_kv_heads, num_qo_heads, head_dim, dtype, True, scaling, page_size),
        "decode_sw": kc._attention_decode_cpu(num_kv_heads, num_qo_heads, head_dim, dtype, True, scaling, page_size),
        "ragged": kc._attention_prefill_ragged_cpu(num_kv_heads, num_qo_heads, head_dim, head_dim, dtype, scaling),
        "tree": kc.tree_attn_cpu(num_kv_heads, num_qo_heads, head_dim, dtype, scaling),
        "tree_paged": kc.tree_attn_with_paged_kv_cache_cpu(num_kv_heads, num_qo_heads, head_dim, dtype, scaling),
        "merge": kc._merge_state_inplace_cpu(dtype),
        "split_rotary": kc.llama_rope_with_position_map(rope_theta, rope_scale, head_dim, num_qo_heads,
                                                        num_kv_heads, dtype, scaling),
        "copy_single_page": kc._copy_single_page_cpu(num_kv_heads, page_size, head_dim, dtype),
        "compact_copy": kc._compact_kv_copy_cpu(num_kv_heads, head_dim, dtype, page_size),
    }
    target = tvm.target.Target.from_device(tvm.cpu())
    built = {}
    for name, func in funcs.items():
        mod = tvm.IRModule({"main": func})
        with target:
            mod = dl.ApplyDefaultSchedule(dl.gpu.Fallback())(mod)
        built[name] = tvm.tirx.build(mod["main"], target=target).main
    return built


def creation_args(config: rk.KVCacheConfig, kernels: Dict[str, Any], device=None) -> List[Any]:
    """TVM's 28 positional creation arguments for ``config`` with the given kernels."""
    device = tvm.cpu() if device is None else device
    k = kernels
    return [
        ShapeTuple([config.max_num_seqs, config.max_total_seq_len, config.prefill_chunk_size,
                    config.page_size, int(config.support_sliding_window)]),
        ShapeTuple([0, config.num_layers]),
        config.num_qo_heads, config.num_kv_heads, config.head_dim, config.v_head_dim,
        ShapeTuple([int(kind) for kind in config.attn_kinds]),
        False, int(config.rope_mode), config.rope_scale, config.rope_theta, None,
        tvm.runtime.empty((), config.dtype, device=device),
        k["transpose_append"], None,
        ["tirx", k["ragged"]], ["tirx", k["prefill"]], ["tirx", k["decode"]],
        ["tirx", k["prefill_sw"]], ["tirx", k["decode_sw"]],
        ["tirx", k["tree_paged"]], ["tirx", k["tree"]], [],
        [k["merge"]], k["split_rotary"], k["copy_single_page"], k["debug_get_kv"], k["compact_copy"],
    ]


def create_native_cache(config: rk.KVCacheConfig) -> Any:
    """TVM's native C++ cache for ``config`` with TVM's CPU kernels."""
    kernels = tvm_cpu_kernels(config.num_layers, config.num_qo_heads, config.num_kv_heads, config.head_dim,
                              config.page_size, config.dtype, config.rope_theta, config.rope_scale)
    return tvm.get_global_func(NATIVE_CREATE)(*creation_args(config, kernels))


def native_builtin(name: str) -> Callable[..., Any]:
    """TVM's own implementation of ``vm.builtin.<name>`` (bypassing relax_kvcache's dispatch)."""
    return original("vm.builtin." + name)
