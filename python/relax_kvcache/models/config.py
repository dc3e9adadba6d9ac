"""The toy Llama's shape and weights (no compiler imports: usable with a runtime-only TVM)."""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Tuple

import numpy as np


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
