"""Debug reads: copy a sequence's stored K/V (MLA: latent rows) of every layer out of the pages."""

from __future__ import annotations

from typing import Any, Callable, List, Sequence, Tuple

import tvm

from ..args import as_int
from ..config import KVCacheConfig
from ..errors import KVCacheError, SequenceError
from ..kernel_set import KernelSet
from ..paging import PagingState
from ..tensors import check_disjoint, check_tensor


class DebugReader:
    """``debug_get_kv`` / ``debug_get_kv_mla`` of a cache (the cache checks the layer kind)."""

    def __init__(self, config: KVCacheConfig, kernels: KernelSet, device: tvm.runtime.Device,
                 paging: PagingState, pages: List[tvm.runtime.Tensor],
                 check_not_importing: Callable[[int, str], None], scale_args: Sequence[Tuple[Any, ...]]) -> None:
        self._config, self._kernels, self._device = config, kernels, device
        self._paging, self._pages, self._check_not_importing = paging, pages, check_not_importing
        self._scale_args = scale_args  # each layer's trailing kernel arguments (KVScales.args)

    def read(self, what: str, seq_id: Any, start_pos: Any, end_pos: Any, **outputs: Any) -> None:
        """Positions ``[start, end)`` of every layer into ``k_data`` and ``v_data`` ``(num_layers,
        end - start, Hkv, D)``, or into MLA's ``kv_data`` ``(num_layers, end - start, W)``."""
        if self._kernels.debug_get_kv is None:
            raise KVCacheError(f"{what} needs the debug_get_kv kernel, which this cache was created without")
        seq_id, start_pos, end_pos = (as_int("seq_id", seq_id), as_int("start_pos", start_pos),
                                      as_int("end_pos", end_pos))
        self._check_not_importing(seq_id, what)
        length = self._paging.sequence_length(seq_id)
        if not 0 <= start_pos < end_pos <= length:
            raise SequenceError(f"{what} range [{start_pos}, {end_pos}) is invalid for sequence "
                                f"{seq_id} of length {length}; expected 0 <= start < end <= length")
        cfg = self._config
        rows = (cfg.head_dim,) if len(outputs) == 1 else (cfg.num_kv_heads, cfg.head_dim)
        shape = (cfg.num_layers, end_pos - start_pos, *rows)
        for name, tensor in outputs.items():
            check_tensor(name, tensor, shape=shape, dtype=cfg.dtype, device=self._device)
        check_disjoint(list(outputs.items()))
        positions = tvm.runtime.tensor(self._paging.position_map(seq_id, start_pos, end_pos), self._device)
        for layer, pages in enumerate(self._pages):
            self._kernels.debug_get_kv(pages, positions, *outputs.values(), layer, *self._scale_args[layer])
