"""The Llama decoder of :mod:`.llama` in numpy float64, recomputed from scratch per sequence.

No cache: the logits of a sequence's tokens are computed from its whole token history, so
forks, rollbacks and removals of the compiled model's cache are checked without modelling them.
Shares nothing with the kernels or the cache; RoPE and attention come from the float64
reference the kernel tests use (:mod:`relax_kvcache.reference`).
"""

from __future__ import annotations

from typing import Dict, Sequence

import numpy as np

from ..reference import attention, rope
from .config import LlamaConfig


class LlamaNumpy:
    """``logits(tokens)``: float64 logits ``(len(tokens), vocab)`` of every position."""

    def __init__(self, cfg: LlamaConfig, weights: Dict[str, np.ndarray]) -> None:
        self.cfg = cfg
        self.w = {name: np.asarray(value, dtype=np.float64) for name, value in weights.items()}

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        cfg, w = self.cfg, self.w
        x = w["embed_tokens.weight"][np.asarray(tokens)]
        positions = np.arange(len(tokens))
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            x = x + self._attention(self._rms(x, w[p + "input_layernorm.weight"]), p + "self_attn.", positions)
            x = x + self._mlp(self._rms(x, w[p + "post_attention_layernorm.weight"]), p + "mlp.")
        return self._rms(x, w["norm.weight"]) @ w["lm_head.weight"].T

    def _rms(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.cfg.rms_norm_eps) * weight

    def _mlp(self, x: np.ndarray, prefix: str) -> np.ndarray:
        gate, up = np.split(x @ self.w[prefix + "gate_up_proj.weight"].T, 2, axis=-1)
        return (gate / (1.0 + np.exp(-gate)) * up) @ self.w[prefix + "down_proj.weight"].T

    def _attention(self, x: np.ndarray, prefix: str, positions: np.ndarray) -> np.ndarray:
        cfg = self.cfg
        n, hq, hkv, d = len(x), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = (x @ self.w[prefix + "qkv_proj.weight"].T).reshape(n, hq + 2 * hkv, d)
        q = rope(qkv[:, :hq], positions, cfg.rope_theta, 1.0)
        k = rope(qkv[:, hq:hq + hkv], positions, cfg.rope_theta, 1.0)
        o, _ = attention(q, k, qkv[:, hq + hkv:], d ** -0.5, causal=True)
        return o.reshape(n, hq * d) @ self.w[prefix + "o_proj.weight"].T
