"""MLA cases shared by ``test_mla_kernels``, ``test_mla_cache`` and ``gpu_kernel_libs.py`` (which
builds their libraries for a GPU host): the latent layout's shape, the kernels as PrimFuncs and
the MLA cache's configuration."""

from __future__ import annotations

import dataclasses

from relax_kvcache import AttnKind, KVCacheConfig, RopeMode

LORA, ROPE, HEADS, PAGE = 512, 64, 8, 16
#: query heads of the ``attention_h32`` variant (on CUDA: two 16-head groups per token)
MANY_HEADS = 32
WIDTH = LORA + ROPE
DTYPES = ["float32", "float16", "bfloat16"]
#: shared memory of the GPUs (sm_86 / sm_89) that get the 32-row MLA tile
SMALL_SHARED = 99 * 1024


def kernel_funcs(dtype: str, sched, *, attention: bool = True):
    """The MLA kernels of ``test_mla_kernels`` as PrimFuncs, by name."""
    from relax_kvcache import tir_kernels as tk  # TVMScript: not on a runtime-only TVM

    page = tk.LatentPageSpec(width=WIDTH, page_size=PAGE, dtype=dtype)
    funcs = {
        "append": tk.make_transpose_append_mla(page, sched),
        "copy": tk.make_copy_single_page_mla(page, sched),
        "gather": tk.make_debug_get_kv_mla(page, sched),
    }
    if attention:
        attn = tk.AttentionSpec(num_qo_heads=HEADS, num_kv_heads=1, qk_head_dim=WIDTH, v_head_dim=LORA,
                                dtype=dtype, page_size=PAGE)
        funcs["attention"] = tk.make_paged_mla(attn, sched)
        funcs["attention_h32"] = tk.make_paged_mla(dataclasses.replace(attn, num_qo_heads=MANY_HEADS), sched)
        if getattr(sched, "dynamic_shared_bytes", 0) > SMALL_SHARED:
            # the 32-row tile that GPUs with less shared memory get (sm_86 / sm_89: 99 KiB)
            funcs["attention_kc32"] = tk.make_paged_mla(attn, dataclasses.replace(sched, dynamic_shared_bytes=SMALL_SHARED))
    return {name: f.with_attr("global_symbol", name) for name, f in funcs.items()}


def cache_config(dtype: str) -> KVCacheConfig:
    """``test_mla_cache``'s cache: two MLA layers of DeepSeek's latent width (512 + 64), 4 heads,
    128-wide original q / v heads, 40-token context chunks."""
    layers, nope, v_dim = 2, 128, 128
    return KVCacheConfig(
        num_layers=layers, num_qo_heads=4, num_kv_heads=1, head_dim=LORA + ROPE, v_head_dim=LORA,
        mla_original_qk_head_dim=nope + ROPE, mla_original_v_head_dim=v_dim, page_size=16, max_num_seqs=16,
        max_total_seq_len=2048, prefill_chunk_size=256, rope_mode=RopeMode.NONE, dtype=dtype,
        attn_kinds=[AttnKind.MLA] * layers, context_chunk_size=40)


#: 8-bit page formats of ``test_fp8_mla``'s caches
FP8_FORMATS = ("float8_e4m3fn", "float8_e5m2")


def fp8_cache_config(dtype: str, kv_dtype: str) -> KVCacheConfig:
    """``test_fp8_mla``'s cache: :func:`cache_config` over 8-bit pages of ``kv_dtype``."""
    return dataclasses.replace(cache_config(dtype), kv_dtype=kv_dtype)
