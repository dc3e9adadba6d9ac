"""Example models built on the frontend: the toy Llama's shape, seeded weights and float64 numpy
implementation (no TVM compiler needed; ``models.llama``, the ``nn`` model, needs it)."""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence, Tuple

import numpy as np

from ..reference import attention, rope

__all__ = ["LlamaConfig", "LlamaNumpy", "random_weights"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Shape of the model (defaults: a 2-layer toy with Llama-3's 4:1 GQA)."""

    vocab_size: int = 512
    hidden_size: int = 256
    intermediate_size: int = 512
    num_layers: int = 2
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    dtype: str = "float32"

    def param_shapes(self) -> List[Tuple[str, Tuple[int, ...]]]:
        """Every parameter (name, shape) in the order the compiled entry points take them."""
        h, heads = self.hidden_size, self.num_heads + 2 * self.num_kv_heads
        shapes = [("embed_tokens.weight", (self.vocab_size, h))]
        for i in range(self.num_layers):
            p = f"layers.{i}."
            shapes += [(p + "input_layernorm.weight", (h,)),
                       (p + "self_attn.qkv_proj.weight", (heads * self.head_dim, h)),
                       (p + "self_attn.o_proj.weight", (h, self.num_heads * self.head_dim)),
                       (p + "post_attention_layernorm.weight", (h,)),
                       (p + "mlp.gate_up_proj.weight", (2 * self.intermediate_size, h)),
                       (p + "mlp.down_proj.weight", (h, self.intermediate_size))]
        return shapes + [("norm.weight", (h,)), ("lm_head.weight", (self.vocab_size, h))]


def random_weights(cfg: LlamaConfig, seed: int) -> Dict[str, np.ndarray]:
    """Deterministic float32 weights: N(0, 1/fan_in) matrices (activations keep unit scale),
    norm weights near 1, embeddings N(0, 1). Keys in :meth:`LlamaConfig.param_shapes` order."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in cfg.param_shapes():
        if name.endswith("norm.weight"):
            weights[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype("float32")
        elif name == "embed_tokens.weight":
            weights[name] = rng.standard_normal(shape).astype("float32")
        else:  # Linear (out, in)
            weights[name] = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype("float32")
    return weights


class LlamaNumpy:
    """``logits(tokens)``: float64 logits ``(len(tokens), vocab)`` of every position, from the
    whole token history (shares nothing with the kernels or the cache)."""

    def __init__(self, cfg: LlamaConfig, weights: Dict[str, np.ndarray]) -> None:
        self.cfg = cfg
        self.w = {name: np.asarray(value, dtype=np.float64) for name, value in weights.items()}

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        cfg, w = self.cfg, self.w
        x = w["embed_tokens.weight"][np.asarray(tokens)]
        positions = np.arange(len(tokens))
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            h = self._rms(x, w[p + "input_layernorm.weight"])
            x = x + self._attention(h, p + "self_attn.", positions)
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
