"""The K / V scales of a cache over 8-bit pages (``KVCacheConfig.kv_dtype``): their owner, the
checks of :meth:`PagedAttentionKVCache.set_kv_scales`, the kernels' trailing arguments and the
calibration from the first step's K / V (:meth:`PagedAttentionKVCache.calibrate_kv_scales`)."""

from __future__ import annotations

from typing import Any, List, Set, Tuple

import numpy as np
import tvm

from ..args import as_float, describe
from ..config import KV_DTYPE_MAX, KVCacheConfig, RopeMode
from ..errors import ArgumentError, KVCacheError

#: Calibration's floor of a head's maximum: a head that is all zeros in the calibrating step gets
#: scale ``MIN_AMAX / format max`` instead of 0.
MIN_AMAX = 1e-6


def kv_amax(config: KVCacheConfig, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Per (K or V, KV head) the largest magnitude the cache stores for ``k`` / ``v``
    ``(n, num_kv_heads, head_dim)``, float64 ``(2, num_kv_heads)``.

    In NORMAL RoPE mode the cache stores K rotated, at the token's position: a rotary pair
    ``(x_i, x_j)`` becomes ``(x_i cos - x_j sin, x_j cos + x_i sin)`` (times LongRoPE's attention
    factor), whose elements never exceed ``sqrt(x_i^2 + x_j^2)``; that bound, valid at any
    position, stands for the pair's elements, the features beyond the rotary dim count as they are.
    """
    k, v = np.abs(k.astype(np.float64)), np.abs(v.astype(np.float64))
    per_head = [np.max(x, axis=(0, 2), initial=0.0) for x in (k, v)]
    if config.effective_rope_mode == RopeMode.NORMAL and k.shape[0]:
        r = config.rotary_dim
        first, second = ((k[..., 0:r:2], k[..., 1:r:2]) if config.rope_interleaved
                         else (k[..., :r // 2], k[..., r // 2:r]))
        bound = np.hypot(first, second).max(axis=(0, 2)) * config.rope_attention_factor
        rest = np.max(k[..., r:], axis=(0, 2), initial=0.0)
        per_head[0] = np.maximum(bound, rest)
    return np.stack(per_head)


class KVScales:
    """One float32 scale per layer, K or V and KV head: a page element is ``value / scale``
    stored in ``kv_dtype`` and read back as ``stored * scale`` (vLLM's and FlashInfer's
    convention); 1.0 until set. MLA caches (one latent head) keep K's and V's equal: one scale
    per layer for the latent row.

    ``args[layer]`` are the trailing arguments of the layer's page kernels (append, paged
    attention, ``debug_get_kv``): ``(scales (2, num_kv_heads) float32,)`` over 8-bit pages, ``()``
    over pages of the model dtype (TVM's signatures).
    """

    def __init__(self, config: KVCacheConfig, device: tvm.runtime.Device) -> None:
        self._config = config
        self.quantized = config.kv_dtype is not None
        self.host = np.ones((config.num_layers if self.quantized else 0, 2, config.num_kv_heads), np.float32)
        self._tensors = [tvm.runtime.tensor(layer, device) for layer in self.host]
        self.args: List[Tuple[Any, ...]] = ([(t,) for t in self._tensors] if self.quantized
                                            else [()] * config.num_layers)
        self.pending: Set[int] = set()  # layers whose scales the calibrating step sets
        self._margin, self._step = 1.0, None  # calibration's margin; the step it runs in

    def arm(self, margin: Any, stored: int) -> None:
        """Calibrate every layer in the next step (``calibrate_kv_scales``; ``stored``: the
        tokens the cache holds, which must be none).

        vLLM's ``calculate_kv_scales``: each layer's first ``attention_with_fused_qkv`` (MLA:
        ``append_mla_kv``, from the latent rows, one scale) of that step sets, per KV head,
        ``scale = margin * max|x| / format max`` for K and for V, with
        ``max|x|`` floored at :data:`MIN_AMAX` and, for K the cache rotates, the bound of
        :func:`kv_amax`, valid at any position. Computed on the host: one copy of the step's
        qkv per layer, once. ``margin > 1`` leaves headroom for later tokens (values beyond
        ``format max * scale`` saturate). ``set_kv_scales`` or a checkpoint import before that
        step cancels it for the layers they set; a layer the step does not append keeps its
        scales."""
        self._require_quantized("calibrate_kv_scales")
        margin = as_float("margin", margin, not_finite=ArgumentError)
        if not 0 < margin <= np.finfo(np.float32).max:
            raise ArgumentError(f"calibrate_kv_scales: margin must be a positive finite number, got {margin}")
        if stored:
            raise KVCacheError(f"calibrate_kv_scales while the cache holds {stored} tokens stored with the current "
                               "scales; call it before the first append")
        self.pending, self._margin, self._step = set(range(self._config.num_layers)), margin, None

    def get(self, layer: int) -> Tuple[np.ndarray, np.ndarray]:
        """``(k_scale, v_scale)`` of ``layer``, float32 copies (``get_kv_scales``)."""
        self._require_quantized("get_kv_scales")
        k, v = self.host[layer].copy()
        return k, v

    def _require_quantized(self, what: str) -> None:
        if not self.quantized:
            raise KVCacheError(f"{what} needs a cache over 8-bit pages (KVCacheConfig.kv_dtype); this one stores "
                               f"{self._config.dtype}")

    def calibrate(self, layer: int, step: Any, qkv: tvm.runtime.Tensor) -> None:
        """Set ``layer``'s scales from the K / V of fused ``qkv`` (the step's rows) when it is
        pending and ``step`` is the first step since :meth:`arm`; later steps disarm."""
        if self._calibrating(layer, step):
            cfg = self._config
            rows = qkv.numpy()
            hq, hkv = cfg.num_qo_heads, cfg.num_kv_heads
            self._set_from_amax(layer, kv_amax(cfg, rows[:, hq:hq + hkv], rows[:, hq + hkv:]))

    def calibrate_latent(self, layer: int, step: Any, kv: tvm.runtime.Tensor) -> None:
        """:meth:`calibrate` of an MLA layer from its latent rows ``kv (n, width)`` (the model
        RoPE'd them already): one scale, from their largest magnitude, for K and V."""
        if self._calibrating(layer, step):
            amax = np.max(np.abs(kv.numpy().astype(np.float64)), initial=0.0)
            self._set_from_amax(layer, np.full((2, 1), amax))

    def _calibrating(self, layer: int, step: Any) -> bool:
        """Whether ``layer`` is pending and ``step`` the first step since :meth:`arm` (later
        steps disarm)."""
        if self._step is None:
            self._step = step
        if step is not self._step:
            self.pending.clear()
        return layer in self.pending

    def _set_from_amax(self, layer: int, amax: np.ndarray) -> None:
        scales = np.maximum(amax, MIN_AMAX) * self._margin / KV_DTYPE_MAX[self._config.kv_dtype]
        self.set(layer, np.minimum(scales, np.finfo(np.float32).max).astype(np.float32))

    def checked(self, layer: int, k_scale: Any, v_scale: Any) -> np.ndarray:
        """``(2, num_kv_heads)`` float32 scales from a number or ``num_kv_heads`` numbers each,
        positive normal finite float32 values; raises naming the bad value."""
        cfg = self._config
        self._require_quantized("set_kv_scales")
        rows = []
        for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
            try:
                array = np.asarray(value)
                if array.dtype.kind not in "fiu":
                    raise TypeError
                row = np.broadcast_to(array.astype(np.float64), (cfg.num_kv_heads,))
            except (TypeError, ValueError):
                raise ArgumentError(f"set_kv_scales: {name} must be a number or {cfg.num_kv_heads} numbers (one "
                                    f"per KV head), got {describe(value)}") from None
            tiny, big = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)
            bad = ~((row >= tiny) & (row <= big))
            if bad.any():
                raise ArgumentError(f"set_kv_scales: {name} of layer {layer} must be positive finite float32 "
                                    f"numbers, got {describe(value)}")
            rows.append(row)
        scales = np.stack(rows).astype(np.float32)
        if cfg.is_mla and not np.array_equal(scales[0], scales[1]):
            raise ArgumentError(f"set_kv_scales: an MLA cache has one scale per layer (one latent vector serves K "
                                f"and V), so v_scale must equal k_scale; got k_scale {describe(k_scale)}, v_scale "
                                f"{describe(v_scale)} for layer {layer}")
        return scales

    def set(self, layer: int, scales: np.ndarray) -> None:
        """Store checked ``scales`` (:meth:`checked`) for ``layer`` (no calibration of it then)."""
        self.host[layer] = scales
        self._tensors[layer].copyfrom(scales)
        self.pending.discard(layer)
