"""A small Llama decoder (RMSNorm, GQA with RoPE applied by the cache, SwiGLU) written with
``tvm.relax.frontend.nn`` and our frontend. Entry points: ``create_kv_cache(max_batch_size,
max_total_seq_len, prefill_chunk_size)``, ``prefill(input_ids (1, n), cache, *weights)`` ->
logits ``(1, n, vocab)`` (the step's sequences concatenated), ``prefill_rows(input_ids (1, n),
rows (k,), cache, *weights)`` -> ``(1, k, vocab)`` (only the logits of the rows ``rows``: what a
serving engine samples from), ``decode(input_ids (b, 1), cache, *weights)`` -> ``(b, 1, vocab)``."""

from __future__ import annotations

from typing import Optional

import tvm
from tvm.relax.frontend import nn

from ..config import RopeMode
from ..frontend import CacheLayout, PagedKVCache
from . import LlamaConfig


def cache_layout(cfg: LlamaConfig, page_size: int = 16, kv_dtype: Optional[str] = None) -> CacheLayout:
    """The cache the model needs: one layer per decoder layer, RoPE applied by the cache;
    ``kv_dtype``: pages of an 8-bit float format (docs/fp8.md), else of the model dtype."""
    return CacheLayout(num_layers=cfg.num_layers, num_qo_heads=cfg.num_heads,
                       num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, page_size=page_size,
                       rope_mode=RopeMode.NORMAL, rope_theta=cfg.rope_theta, dtype=cfg.dtype, kv_dtype=kv_dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_id: int) -> None:
        self.cfg, self.layer_id = cfg, layer_id
        heads = cfg.num_heads + 2 * cfg.num_kv_heads
        self.qkv_proj = nn.Linear(cfg.hidden_size, heads * cfg.head_dim, bias=False, dtype=cfg.dtype)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False, dtype=cfg.dtype)

    def forward(self, x: nn.Tensor, cache: PagedKVCache) -> nn.Tensor:
        cfg = self.cfg
        b, s, _ = x.shape
        qkv = self.qkv_proj(x).reshape(b, s, cfg.num_heads + 2 * cfg.num_kv_heads, cfg.head_dim)
        o = cache.attention_with_fused_qkv(self.layer_id, qkv, num_qo_heads=cfg.num_heads,
                                           sm_scale=cfg.head_dim ** -0.5)
        return self.o_proj(o.reshape(b, s, cfg.num_heads * cfg.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False, dtype=cfg.dtype)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False, dtype=cfg.dtype)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        gate, up = nn.op.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(nn.op.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_id: int) -> None:
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, -1, cfg.rms_norm_eps, bias=False, dtype=cfg.dtype)
        self.self_attn = Attention(cfg, layer_id)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, -1, cfg.rms_norm_eps, bias=False,
                                                   dtype=cfg.dtype)
        self.mlp = MLP(cfg)

    def forward(self, x: nn.Tensor, cache: PagedKVCache) -> nn.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """The decoder with its three entry points (see the module docstring); ``kv_dtype``: the
    cache's pages hold an 8-bit float format (``CacheLayout.kv_dtype``)."""

    def __init__(self, cfg: LlamaConfig, target: tvm.target.Target, page_size: int = 16,
                 kv_dtype: Optional[str] = None) -> None:
        self.cfg, self.target, self.page_size, self.kv_dtype = cfg, target, page_size, kv_dtype
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg.num_layers)])
        self.norm = nn.RMSNorm(cfg.hidden_size, -1, cfg.rms_norm_eps, bias=False, dtype=cfg.dtype)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype="float32"
                                 if cfg.dtype == "float32" else cfg.dtype)

    def prefill(self, input_ids: nn.Tensor, cache: PagedKVCache) -> nn.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cache)
        return self.lm_head(self.norm(x)).astype("float32")

    decode = prefill  # the same computation; the two entry points differ in their input shapes

    def prefill_rows(self, input_ids: nn.Tensor, rows: nn.Tensor, cache: PagedKVCache) -> nn.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cache)
        return self.lm_head(self.norm(nn.op.take(x, rows, axis=1))).astype("float32")

    def create_kv_cache(self, max_batch_size: tvm.tirx.Var, max_total_seq_len: tvm.tirx.Var,
                        prefill_chunk_size: tvm.tirx.Var) -> PagedKVCache:
        return PagedKVCache.create(cache_layout(self.cfg, self.page_size, self.kv_dtype), self.target,
                                   max_batch_size=max_batch_size, max_total_seq_len=max_total_seq_len,
                                   prefill_chunk_size=prefill_chunk_size)

    def export_spec(self) -> dict:
        cache = nn.spec.Object(object_type=PagedKVCache)
        return {
            "create_kv_cache": {"max_batch_size": int, "max_total_seq_len": int, "prefill_chunk_size": int,
                                "$": {"param_mode": "none", "effect_mode": "none"}},
            "prefill": {"input_ids": nn.spec.Tensor([1, "n"], "int32"), "cache": cache},
            "prefill_rows": {"input_ids": nn.spec.Tensor([1, "n"], "int32"), "rows": nn.spec.Tensor(["k"], "int32"),
                             "cache": cache},
            "decode": {"input_ids": nn.spec.Tensor(["b", 1], "int32"), "cache": cache},
        }


def build_module(cfg: LlamaConfig, target: tvm.target.Target, page_size: int = 16,
                 kv_dtype: Optional[str] = None) -> tvm.IRModule:
    """The model's IRModule (with the cache's kernels; ``kv_dtype``: over 8-bit pages). Its entry
    points take the weights after their inputs, in :meth:`LlamaConfig.param_shapes` order."""
    model = Llama(cfg, target, page_size, kv_dtype)
    return model.export_tvm(spec=model.export_spec(), debug=False)[0]
