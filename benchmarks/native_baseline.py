"""TVM's native paged KV cache (C++ runtime + TVM's CPU TIR kernels): the baseline of the benchmarks
and the differential tests.

Benchmarks and tests only: relax_kvcache itself never imports TVM's ``nn.llm`` kernels or its native cache.

* :func:`tvm_kernels` builds TVM's CPU kernels for a :class:`Shape` (memoized per process).
* :func:`create_args` assembles the 28 positional arguments of
  ``vm.builtin.paged_attention_kv_cache_create`` (TVM 0.27) from a kernel list, so the same
  arguments can create TVM's native cache and ours (``relax_kvcache.paged_attention_kv_cache_create``).
* :func:`our_kernel_list` puts our own kernels (``relax_kvcache.build_kernels``) in TVM's
  argument format.
* :class:`Builtins` holds the ``vm.builtin.*`` functions the tests drive both caches through.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, List, Optional, Tuple

import numpy as np
import tvm
from tvm.runtime import ShapeTuple

CREATE_NATIVE = "vm.builtin.paged_attention_kv_cache_create"
CREATE_OURS = "relax_kvcache.paged_attention_kv_cache_create"


@dataclasses.dataclass(frozen=True)
class Shape:
    """A cache shape and policy, in the terms of TVM's creation arguments."""

    num_layers: int = 2
    num_qo_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    page_size: int = 16
    max_num_seqs: int = 16
    max_total_seq_len: int = 1024
    prefill_chunk_size: int = 256
    rope_mode: int = 0
    rope_theta: float = 1e4
    rope_scale: float = 1.0
    dtype: str = "float32"
    support_sliding_window: bool = False
    #: per-layer AttnKind values (None: MHA everywhere); 3 = MHA_SLIDING
    attn_kinds: Optional[Tuple[int, ...]] = None
    #: window of MHA_SLIDING layers, TVM's optional 6th cache_config entry (None: not passed)
    layer_window: Optional[int] = None
    #: LongRoPE factors (head_dim floats: long, then short) and TVM's rope_scaling positions
    #: (``max_position_embeddings``, ``original_max_position_embeddings``); None: plain RoPE
    ext_factors: Optional[Tuple[float, ...]] = None
    longrope_positions: Tuple[int, int] = (0, 0)
    #: RoPE's rotated features (None: head_dim), TVM's ``rotary_dim``
    rotary_dim: Optional[int] = None
    #: GPT-J style RoPE pairs (TVM's ``rope_type: gptj``)
    rope_interleaved: bool = False

    @property
    def longrope_attention_factor(self) -> float:
        import relax_kvcache as rk

        return rk.longrope_attention_factor(*self.longrope_positions) if self.ext_factors else 1.0

    @property
    def kinds(self) -> Tuple[int, ...]:
        return tuple(self.attn_kinds) if self.attn_kinds is not None else (0,) * self.num_layers

    @property
    def layer_window_size(self) -> int:
        """The window TVM and ours use for MHA_SLIDING layers (TVM's default: 1024)."""
        return 1024 if self.layer_window is None else self.layer_window

    @property
    def effective_rope_mode(self) -> int:
        """TVM switches a non-NONE RoPE mode to INLINE when sliding windows are supported."""
        return 2 if self.support_sliding_window and self.rope_mode != 0 else self.rope_mode

    @property
    def num_total_pages(self) -> int:
        pages = -(-self.max_total_seq_len // self.page_size) + 1
        return pages + (2 * self.max_num_seqs if self.support_sliding_window else 0)

    def our_config(self):
        import relax_kvcache as rk

        return rk.KVCacheConfig(
            num_layers=self.num_layers, num_qo_heads=self.num_qo_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, page_size=self.page_size,
            max_num_seqs=self.max_num_seqs, max_total_seq_len=self.max_total_seq_len,
            prefill_chunk_size=self.prefill_chunk_size, rope_mode=self.rope_mode,
            rope_theta=self.rope_theta, rope_scale=self.rope_scale, dtype=self.dtype,
            support_sliding_window=self.support_sliding_window, attn_kinds=self.attn_kinds,
            layer_sliding_window_size=self.layer_window_size, rope_ext_factors=self.ext_factors,
            rope_rotary_dim=self.rotary_dim, rope_interleaved=self.rope_interleaved,
            rope_original_max_position_embeddings=self.longrope_positions[1] if self.ext_factors else None,
            rope_attention_factor=self.longrope_attention_factor)


# Kernel list order (TVM's own CPU test suite order).
KERNEL_NAMES = ("transpose_append", "debug_get_kv", "attention_prefill", "attention_decode",
                "attention_prefill_sliding_window", "attention_decode_sliding_window",
                "attention_prefill_ragged", "tree_attn", "tree_attn_paged", "merge_inplace",
                "split_rotary", "copy_single_page", "compact_copy")


@functools.lru_cache(maxsize=None)
def _tvm_kernels(num_layers, num_qo_heads, num_kv_heads, head_dim, page_size, dtype, rope_theta,
                 rope_scale, layer_window=1024, longrope_positions=None, rotary_dim=None, gptj=False) -> tuple:
    from tvm.relax.frontend.nn.llm import kv_cache as kc
    from tvm.s_tir import dlight as dl

    rs = {}
    rope_scaling = {} if longrope_positions is None else {
        "rope_type": "longrope", "max_position_embeddings": longrope_positions[0],
        "original_max_position_embeddings": longrope_positions[1]}
    if gptj:
        rope_scaling = {"rope_type": "gptj"}
    hkv, hq, d = num_kv_heads, num_qo_heads, head_dim
    ps = page_size
    funcs = [
        kc._kv_cache_transpose_append(hkv, d, dtype, page_size=ps),
        kc._kv_cache_debug_get_kv(num_layers, hkv, d, dtype),
        kc._attention_prefill_cpu(hkv, hq, d, dtype, False, rs, page_size=ps),
        kc._attention_decode_cpu(hkv, hq, d, dtype, False, rs, page_size=ps),
        kc._attention_prefill_cpu(hkv, hq, d, dtype, True, rs, page_size=ps,
                                  sliding_window_size=layer_window),
        kc._attention_decode_cpu(hkv, hq, d, dtype, True, rs, page_size=ps),
        kc._attention_prefill_ragged_cpu(hkv, hq, d, d, dtype, rs),
        kc.tree_attn_cpu(hkv, hq, d, dtype, rs),
        kc.tree_attn_with_paged_kv_cache_cpu(hkv, hq, d, dtype, rs),
        kc._merge_state_inplace_cpu(dtype),
        _tvm_split_rotary(rope_theta, rope_scale, d, hq, hkv, dtype, rope_scaling, rotary_dim),
        kc._copy_single_page_cpu(hkv, page_size, d, dtype),
        kc._compact_kv_copy_cpu(hkv, d, dtype, page_size=ps),
    ]
    target = tvm.target.Target.from_device(tvm.cpu())
    built = []
    for f in funcs:
        mod = tvm.IRModule({"main": f})
        with target:
            mod = dl.ApplyDefaultSchedule(dl.gpu.Fallback())(mod)
        built.append(tvm.tirx.build(mod["main"], target=target).main)
    return tuple(built)


def _tvm_split_rotary(theta, scale, d, hq, hkv, dtype, rope_scaling, rotary_dim=None):
    """TVM's ``llama_rope_with_position_map``. Its LongRoPE variant does not build in TVM 0.27:
    ``_rope`` tests ``if ext_factors:`` on a buffer, and 0.27's buffers are ``Var`` expressions,
    whose truth value raises. While it is built (test-only), a Var is truthy."""
    from tvm.ir.expr import Var
    from tvm.relax.frontend.nn.llm import kv_cache as kc

    if not rope_scaling:
        return kc.llama_rope_with_position_map(theta, scale, d, hq, hkv, dtype, rope_scaling, rotary_dim)
    Var.__bool__ = lambda self: True
    try:
        return kc.llama_rope_with_position_map(theta, scale, d, hq, hkv, dtype, rope_scaling, rotary_dim)
    finally:
        del Var.__bool__


def tvm_kernels(shape: Shape) -> dict:
    """TVM's CPU kernels for ``shape``, by :data:`KERNEL_NAMES` name."""
    built = _tvm_kernels(shape.num_layers, shape.num_qo_heads, shape.num_kv_heads, shape.head_dim,
                         shape.page_size, shape.dtype, shape.rope_theta, shape.rope_scale,
                         shape.layer_window_size, shape.longrope_positions if shape.ext_factors else None,
                         shape.rotary_dim, shape.rope_interleaved)
    return dict(zip(KERNEL_NAMES, built))


@functools.lru_cache(maxsize=None)
def _our_module(shape: Shape):
    import relax_kvcache as rk
    from relax_kvcache.runtime import default_target

    return rk.build_kernels(shape.our_config(), default_target(tvm.cpu()))


def our_kernels(shape: Shape) -> dict:
    """Our kernels (``relax_kvcache.build_kernels``) in the slots of :data:`KERNEL_NAMES`.

    Tree-attention and compact-copy slots TVM needs but we do not use stay TVM's (never called).
    """
    mod = _our_module(shape)
    ours = {}
    for name in KERNEL_NAMES:
        if mod.implements_function(name, query_imports=True):
            ours[name] = mod.get_function(name, query_imports=True)
    kernels = tvm_kernels(shape) if len(ours) < len(KERNEL_NAMES) else {}
    return {name: ours.get(name, kernels.get(name)) for name in KERNEL_NAMES}


def create_args(shape: Shape, kernels: dict, *, merge_functions: int = 1) -> List[Any]:
    """The 28 positional arguments of TVM's ``paged_attention_kv_cache_create``."""
    k = kernels
    L = shape.num_layers
    return [
        ShapeTuple([shape.max_num_seqs, shape.max_total_seq_len, shape.prefill_chunk_size,
                    shape.page_size, int(shape.support_sliding_window)]
                   + ([] if shape.layer_window is None else [shape.layer_window])),
        ShapeTuple([0, L]),
        shape.num_qo_heads, shape.num_kv_heads, shape.head_dim, shape.head_dim,
        ShapeTuple(list(shape.kinds)),  # AttnKind per layer (0 = MHA, 3 = MHA_SLIDING)
        False,  # enable_kv_transfer
        shape.rope_mode, shape.rope_scale, shape.rope_theta,
        None if shape.ext_factors is None else tvm.runtime.tensor(np.array(shape.ext_factors, np.float32)),
        tvm.runtime.empty((), shape.dtype, device=tvm.cpu()),
        k["transpose_append"], None,
        ["tirx", k["attention_prefill_ragged"]], ["tirx", k["attention_prefill"]],
        ["tirx", k["attention_decode"]], ["tirx", k["attention_prefill_sliding_window"]],
        ["tirx", k["attention_decode_sliding_window"]], ["tirx", k["tree_attn_paged"]],
        ["tirx", k["tree_attn"]],
        [],  # MLA prefill
        [k["merge_inplace"]] * merge_functions,
        k["split_rotary"], k["copy_single_page"], k["debug_get_kv"], k["compact_copy"],
    ]


def create_native(shape: Shape, *, merge_functions: int = 2):
    """TVM's native C++ cache with TVM's CPU kernels."""
    return tvm.get_global_func(CREATE_NATIVE)(*create_args(shape, tvm_kernels(shape),
                                                           merge_functions=merge_functions))


def create_ours_direct(shape: Shape):
    """Our cache with our kernels, through the Python constructor."""
    import relax_kvcache as rk

    return rk.PagedAttentionKVCache(shape.our_config(), tvm.cpu())


def create_ours_packed(shape: Shape, *, tvm_kernel_set: bool = False):
    """Our cache through ``relax_kvcache.paged_attention_kv_cache_create`` (TVM's argument format),
    fed our kernels or (``tvm_kernel_set``) TVM's."""
    import relax_kvcache  # noqa: F401  (registers the create function)

    kernels = tvm_kernels(shape) if tvm_kernel_set else our_kernels(shape)
    return tvm.get_global_func(CREATE_OURS)(*create_args(shape, kernels))


class Builtins:
    """The ``vm.builtin.*`` functions (resolved after ``import relax_kvcache``)."""

    def __init__(self) -> None:
        import relax_kvcache  # noqa: F401  (installs the dispatchers)

        g = tvm.get_global_func
        self.clear = g("vm.builtin.kv_state_clear")
        self.add = g("vm.builtin.kv_state_add_sequence")
        self.remove = g("vm.builtin.kv_state_remove_sequence")
        self.fork = g("vm.builtin.kv_state_fork_sequence")
        self.popn = g("vm.builtin.kv_state_popn")
        self._begin = g("vm.builtin.kv_state_begin_forward")
        self.end = g("vm.builtin.kv_state_end_forward")
        self.empty = g("vm.builtin.attention_kv_cache_empty")
        self.num_available_pages = g("vm.builtin.attention_kv_cache_get_num_available_pages")
        self.total_sequence_length = g("vm.builtin.attention_kv_cache_get_total_sequence_length")
        self.query_positions = g("vm.builtin.attention_kv_cache_get_query_positions")
        self.debug_get_kv = g("vm.builtin.attention_kv_cache_debug_get_kv")
        self.attention = g("vm.builtin.attention_kv_cache_attention_with_fused_qkv")
        self.self_attention = g("vm.builtin.attention_kv_cache_self_attention")
        self.cross_attention = g("vm.builtin.attention_kv_cache_cross_attention")
        self.merge = g("vm.builtin.attention_kv_cache_merge_attn_output_inplace")
        self.enable_window = g("vm.builtin.attention_kv_cache_enable_sliding_window_for_seq")
        self.shared_kv = g("vm.builtin.attention_kv_cache_attention_with_shared_kv")
        self._commit = g("vm.builtin.attention_kv_cache_commit_accepted_token_tree_nodes")

    def begin(self, cache, seq_ids, lengths, token_tree_parent_ptr=None) -> None:
        """``kv_state_begin_forward``; with ``token_tree_parent_ptr`` (parents of the new nodes,
        concatenated over the batch) the 4-argument token-tree form."""
        args = [cache, ShapeTuple(list(seq_ids)), ShapeTuple(list(lengths))]
        if token_tree_parent_ptr is not None:
            args.append(ShapeTuple(list(token_tree_parent_ptr)))
        self._begin(*args)

    def commit(self, cache, seq_ids, leaf_indices) -> None:
        """``attention_kv_cache_commit_accepted_token_tree_nodes``."""
        self._commit(cache, ShapeTuple(list(seq_ids)), ShapeTuple(list(leaf_indices)))
