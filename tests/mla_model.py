"""A float64 numpy model of DeepSeek's multi-head latent attention (seed 002's notation).

Per token the cache holds one latent row ``[kv_c (L), k_pe (R)]``. With ``W_UK (H, P, L)`` and
``W_UV (H, L, V)`` the decompressed per-head keys and values are ``k = [kv_c @ W_UK^T, k_pe]``
and ``v = kv_c @ W_UV``; queries are ``q = [q_nope (P), q_pe (R)]``. :meth:`MLAModel.expected`
is causal attention with those, computed directly (no absorption, no chunks), so it checks the
absorbed path (``q_nope @ W_UK`` against the latent rows) and the chunked compute path alike.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Tuple

import numpy as np

from cache_model import attend


@dataclasses.dataclass(frozen=True)
class MLAWeights:
    """Up-projections: ``w_uk (H, P, L)``, ``w_uv (H, L, V)`` (float64)."""

    w_uk: np.ndarray
    w_uv: np.ndarray

    @classmethod
    def draw(cls, rng: np.random.Generator, heads: int, lora: int, nope: int, v: int) -> "MLAWeights":
        scale = lora ** -0.5  # keeps decompressed k / v near unit variance
        return cls(rng.standard_normal((heads, nope, lora)) * scale, rng.standard_normal((heads, lora, v)) * scale)

    @property
    def lora(self) -> int:
        return self.w_uk.shape[2]

    def keys_values(self, latent: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """Decompressed ``k (t, H, P + R)`` and ``v (t, H, V)`` of latent rows ``(t, L + R)``."""
        latent = np.asarray(latent, np.float64)
        kv_c, k_pe = latent[:, :self.lora], latent[:, self.lora:]
        k_nope = np.einsum("tl,hpl->thp", kv_c, self.w_uk)
        k_pe = np.broadcast_to(k_pe[:, None, :], (latent.shape[0], self.w_uk.shape[0], k_pe.shape[1]))
        return np.concatenate([k_nope, k_pe], axis=-1), np.einsum("tl,hlv->thv", kv_c, self.w_uv)

    def absorb(self, q: np.ndarray) -> np.ndarray:
        """Absorbed queries ``[q_nope @ W_UK, q_pe] (n, H, L + R)`` of ``q (n, H, P + R)``."""
        nope = self.w_uk.shape[1]
        q = np.asarray(q, np.float64)
        return np.concatenate([np.einsum("nhp,hpl->nhl", q[..., :nope], self.w_uk), q[..., nope:]], axis=-1)

    def up_v(self, o_latent: np.ndarray) -> np.ndarray:
        """``o (n, H, L) @ W_UV`` per head -> ``(n, H, V)``."""
        return np.einsum("nhl,hlv->nhv", np.asarray(o_latent, np.float64), self.w_uv)


class MLAModel:
    """Each sequence's latent rows per layer, as the cache should hold them."""

    def __init__(self, num_layers: int, width: int) -> None:
        self.num_layers, self.width = num_layers, width
        self.seqs: Dict[int, np.ndarray] = {}  # seq_id -> (layers, t, W) float64

    def add(self, seq_id: int) -> None:
        self.seqs[seq_id] = np.zeros((self.num_layers, 0, self.width))

    def fork(self, parent: int, child: int, pos: int) -> None:
        rows = self.seqs[parent]
        self.seqs[child] = rows[:, : rows.shape[1] if pos == -1 else pos].copy()

    def popn(self, seq_id: int, n: int) -> None:
        self.seqs[seq_id] = self.seqs[seq_id][:, : self.seqs[seq_id].shape[1] - n]

    def append(self, seq_id: int, layer: int, rows: np.ndarray) -> None:
        seq = self.seqs[seq_id]
        if layer == 0:
            grown = np.zeros((self.num_layers, seq.shape[1] + rows.shape[0], self.width))
            grown[:, : seq.shape[1]] = seq
            self.seqs[seq_id] = seq = grown
        seq[layer, seq.shape[1] - rows.shape[0]:] = rows

    def expected(self, weights: MLAWeights, seq_id: int, layer: int, q: np.ndarray, sm_scale: float):
        """Causal attention of the sequence's last ``n`` tokens, ``q (n, H, P + R)``, over all
        its rows: ``o (n, H, V)`` and base-2 ``lse (n, H)``."""
        rows = self.seqs[seq_id][layer]
        k, v = weights.keys_values(rows)
        return attend(q, k, v, sm_scale, causal_offset=rows.shape[0] - q.shape[0])

    def context(self, weights: MLAWeights, seq_id: int, layer: int, q: np.ndarray, sm_scale: float):
        """Attention of ``q (n, H, P + R)`` over the sequence's rows before its last ``n``."""
        rows = self.seqs[seq_id][layer][: self.seqs[seq_id].shape[1] - q.shape[0]]
        k, v = weights.keys_values(rows)
        return attend(q, k, v, sm_scale, causal_offset=None)
