"""Independent numpy float64 reference of the math the kernels compute.

Used by the creation probe, the demos and the tests. Nothing here shares code with the kernels.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

LN2 = np.log(2.0)


def rope(x: np.ndarray, positions: np.ndarray, theta: float, scale: float) -> np.ndarray:
    """Rotate-half RoPE of ``x (n, heads, d)`` at ``positions (n,)`` (float64 result)."""
    x = np.asarray(x, dtype=np.float64)
    d = x.shape[-1]
    half = d // 2
    inv_freq = scale / theta ** (np.arange(half, dtype=np.float64) * 2 / d)
    angle = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    x0, x1 = x[..., :half], x[..., half:]
    return np.concatenate([x0 * cos - x1 * sin, x1 * cos + x0 * sin], axis=-1)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, sm_scale: float, *, causal: bool,
              mask: Optional[np.ndarray] = None) -> tuple[np.ndarray, np.ndarray]:
    """Attention of one sequence: ``q (n, Hq, d)``, ``k/v (m, Hkv, d)``, GQA by head groups.

    With ``causal`` query i sees keys ``j <= m - n + i``. ``mask (n, m)`` (True = visible) is
    combined with it. Returns ``o (n, Hq, dv)`` and the base-2 log-sum-exp ``lse (n, Hq)``;
    rows with no visible key give ``o = 0, lse = -inf``.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    n, hq, _ = q.shape
    m, hkv, dv = v.shape
    group = hq // hkv
    visible = np.ones((n, m), dtype=bool)
    if causal:
        visible &= np.arange(m)[None, :] <= (m - n + np.arange(n))[:, None]
    if mask is not None:
        visible &= mask
    kh = np.repeat(k, group, axis=1)  # (m, Hq, d)
    vh = np.repeat(v, group, axis=1)
    scores = np.einsum("nhd,mhd->hnm", q, kh) * sm_scale
    scores = np.where(visible[None], scores, -np.inf)
    mx = scores.max(axis=-1, keepdims=True, initial=-np.inf)
    safe = np.where(np.isfinite(mx), mx, 0.0)
    p = np.exp(scores - safe)
    denom = p.sum(axis=-1, keepdims=True)
    out = np.einsum("hnm,mhd->nhd", p / np.where(denom > 0, denom, 1.0), vh)
    with np.errstate(divide="ignore"):
        lse = (np.log(denom[..., 0]) + safe[..., 0]) / LN2
    lse = np.where(denom[..., 0] > 0, lse, -np.inf).T
    return out, lse


def merge_states(o1, lse1, o2, lse2) -> tuple[np.ndarray, np.ndarray]:
    """Merge two attention states over disjoint key sets (base-2 LSE)."""
    o1, o2 = np.asarray(o1, np.float64), np.asarray(o2, np.float64)
    lse1, lse2 = np.asarray(lse1, np.float64), np.asarray(lse2, np.float64)
    mx = np.maximum(lse1, lse2)
    safe = np.where(np.isfinite(mx), mx, 0.0)
    w1, w2 = np.exp2(lse1 - safe), np.exp2(lse2 - safe)
    total = w1 + w2
    denom = np.where(total > 0, total, 1.0)
    o = (o1 * w1[..., None] + o2 * w2[..., None]) / denom[..., None]
    with np.errstate(divide="ignore"):
        lse = np.where(total > 0, np.log2(denom) + safe, -np.inf)
    return o, lse
