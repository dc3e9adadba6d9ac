"""The Llama decoder of :mod:`.llama` in numpy float64, recomputed from scratch per sequence.

No cache: the logits of a sequence's tokens are computed from its whole token history, so
forks, rollbacks and removals of the compiled model's cache are checked without modelling them.
Shares nothing with the kernels or the cache (RoPE is written out here again).
"""

from __future__ import annotations

from typing import Dict, Sequence

import numpy as np

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
        q = self._rope(qkv[:, :hq], positions)
        k = np.repeat(self._rope(qkv[:, hq:hq + hkv], positions), hq // hkv, axis=1)
        v = np.repeat(qkv[:, hq + hkv:], hq // hkv, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
        scores = np.where(np.tril(np.ones((n, n), dtype=bool)), scores, -np.inf)
        p = np.exp(scores - scores.max(axis=-1, keepdims=True))
        o = np.einsum("hqk,khd->qhd", p / p.sum(axis=-1, keepdims=True), v)
        return o.reshape(n, hq * d) @ self.w[prefix + "o_proj.weight"].T

    def _rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        half = x.shape[-1] // 2
        angle = positions[:, None] / self.cfg.rope_theta ** (np.arange(half) * 2 / x.shape[-1])
        cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]
        lo, hi = x[..., :half], x[..., half:]
        return np.concatenate([lo * cos - hi * sin, hi * cos + lo * sin], axis=-1)
