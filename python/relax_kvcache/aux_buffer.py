"""One int32 buffer that carries a step's metadata arrays to the device in one copy.

``upload(arrays)`` packs the arrays back to back into a host buffer, copies the used prefix to
the device once, and returns a device view per array (same shape). On CPU the host buffer *is*
the device buffer (numpy view of the TVM tensor), so the upload is the packing itself.
"""

from __future__ import annotations

from typing import List, Sequence

import numpy as np
import tvm

from .tensors import view

_INT32_BYTES = 4


class AuxBuffer:
    """Reusable host/device int32 buffer for per-step metadata.

    Parameters
    ----------
    device : tvm.runtime.Device
        Where the kernels run.
    capacity : int
        Initial capacity in int32 elements; the buffer grows (doubling) when a step needs more.
    """

    def __init__(self, device: tvm.runtime.Device, capacity: int) -> None:
        self._device = device
        self._on_cpu = device.dlpack_device_type() == tvm.cpu().dlpack_device_type()
        self._allocate(max(int(capacity), 1024))

    def _allocate(self, capacity: int) -> None:
        self._capacity = capacity
        self._device_buffer = tvm.runtime.empty((capacity,), "int32", self._device)
        self._dtype = self._device_buffer.dtype
        if self._on_cpu:
            self._host = np.from_dlpack(self._device_buffer)
        else:
            self._host = np.empty(capacity, dtype=np.int32)

    def upload(self, arrays: Sequence[np.ndarray]) -> List[tvm.runtime.Tensor]:
        """Copy ``arrays`` to the device in one transfer; return one device view per array."""
        sizes = [int(a.size) for a in arrays]
        total = sum(sizes)
        if total > self._capacity:
            self._allocate(max(total, 2 * self._capacity))
        views = []
        offset = 0
        for array, size in zip(arrays, sizes):
            self._host[offset:offset + size] = array.ravel()
            views.append(view(self._device_buffer, array.shape, offset * _INT32_BYTES, self._dtype))
            offset += size
        if not self._on_cpu and total:
            view(self._device_buffer, (total,), 0, self._dtype).copyfrom(self._host[:total])
        return views
