"""A minimal Relax program over ``relax_kvcache.frontend`` for tests of a cache layout.

:func:`fused_vm` compiles ``create_kv_cache`` and ``fused`` (each layer's
``attention_with_fused_qkv`` on its own slice of a ``(layers, 1, n, heads, D)`` input) for the
CPU; :func:`create` calls ``create_kv_cache`` as a model driver does.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.frontend import nn

from relax_kvcache import frontend


def fused_vm(layout: frontend.CacheLayout, sm_scale: float, dtype: str = "float32") -> relax.VirtualMachine:
    """The compiled program of ``layout`` (``fused`` returns one output per layer)."""
    layers, hq = layout.num_layers, layout.num_qo_heads

    class Program(nn.Module):
        def create_kv_cache(self, max_batch_size: tvm.tirx.Var, max_total_seq_len: tvm.tirx.Var,
                            prefill_chunk_size: tvm.tirx.Var):
            return frontend.PagedKVCache.create(layout, "llvm", max_batch_size=max_batch_size,
                                                max_total_seq_len=max_total_seq_len,
                                                prefill_chunk_size=prefill_chunk_size)

        def fused(self, qkv: nn.Tensor, cache: frontend.PagedKVCache):
            parts = nn.op.split(qkv, layers, axis=0) if layers > 1 else [qkv]
            return tuple(cache.attention_with_fused_qkv(layer, parts[layer].reshape(*qkv.shape[1:]),
                                                        num_qo_heads=hq, sm_scale=sm_scale) for layer in range(layers))

    heads = hq + 2 * layout.num_kv_heads
    mod, _ = Program().export_tvm(spec={
        "create_kv_cache": {"max_batch_size": int, "max_total_seq_len": int, "prefill_chunk_size": int},
        "fused": {"qkv": nn.spec.Tensor([layers, 1, "n", heads, layout.head_dim], dtype),
                  "cache": nn.spec.Object(object_type=frontend.PagedKVCache)}}, debug=False)
    return relax.VirtualMachine(frontend.compile(mod, "llvm"), tvm.cpu())


def create(vm: relax.VirtualMachine, max_batch_size: int, max_total_seq_len: int, prefill_chunk_size: int):
    """Call the compiled ``create_kv_cache`` (nn's int arguments arrive as 1-element shapes)."""
    shape = tvm.runtime.ShapeTuple
    return vm["create_kv_cache"](shape([max_batch_size]), shape([max_total_seq_len]), shape([prefill_chunk_size]))
