"""The K / V scales of a cache over 8-bit pages (``KVCacheConfig.kv_dtype``): their owner, the
checks of :meth:`PagedAttentionKVCache.set_kv_scales`, and the kernels' trailing arguments."""

from __future__ import annotations

from typing import Any, List, Tuple

import numpy as np
import tvm

from ..args import describe
from ..config import KVCacheConfig
from ..errors import ArgumentError, KVCacheError


class KVScales:
    """One float32 scale per layer, K or V and KV head: a page element is ``value / scale``
    stored in ``kv_dtype`` and read back as ``stored * scale`` (vLLM's and FlashInfer's
    convention); 1.0 until set.

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

    def checked(self, layer: int, k_scale: Any, v_scale: Any) -> np.ndarray:
        """``(2, num_kv_heads)`` float32 scales from a number or ``num_kv_heads`` numbers each,
        positive normal finite float32 values; raises naming the bad value."""
        cfg = self._config
        if not self.quantized:
            raise KVCacheError(f"set_kv_scales needs a cache over 8-bit pages (KVCacheConfig.kv_dtype); this one "
                               f"stores {cfg.dtype}")
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
        return np.stack(rows).astype(np.float32)

    def set(self, layer: int, scales: np.ndarray) -> None:
        """Store checked ``scales`` (:meth:`checked`) for ``layer``."""
        self.host[layer] = scales
        self._tensors[layer].copyfrom(scales)
