"""One int32 buffer that carries a step's metadata arrays to the device in one copy.

``upload(arrays)`` packs the arrays back to back into a host buffer, copies the used prefix to
the device once, and returns a device view per array (same shape). On CPU the host buffer *is*
the device buffer (numpy view of the TVM tensor), so the upload is the packing itself. On CUDA
the host buffer is pinned and the copy runs on a side stream (:mod:`.cuda_copy`); ``wait()``
makes the compute stream wait for it, once, before the first kernel that reads the metadata.
Other GPUs copy synchronously.
"""

from __future__ import annotations

from typing import List, Sequence

import numpy as np
import tvm

from .cuda_copy import PinnedUploader
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
        self._on_cuda = device.dlpack_device_type() == tvm.cuda().dlpack_device_type()
        self._pinned = None
        self._allocate(max(int(capacity), 1024))

    def _allocate(self, capacity: int) -> None:
        self._capacity = capacity
        if self._on_cuda:
            if self._pinned is not None:
                self._pinned.ready_for_write()
                self._pinned.close()
            self._pinned = PinnedUploader(self._device, capacity)
            self._device_buffer, self._host = self._pinned.device_buffer, self._pinned.host
        else:
            self._device_buffer = tvm.runtime.empty((capacity,), "int32", self._device)
            self._host = (np.from_dlpack(self._device_buffer) if self._on_cpu
                          else np.empty(capacity, dtype=np.int32))
        self._dtype = self._device_buffer.dtype

    @property
    def asynchronous(self) -> bool:
        """True when uploads are asynchronous (CUDA): call :meth:`wait` before using the views."""
        return self._on_cuda

    def wait(self) -> None:
        """Order the compute stream after the last upload (CUDA; no-op elsewhere)."""
        if self._pinned is not None:
            self._pinned.wait()

    def upload(self, arrays: Sequence[np.ndarray]) -> List[tvm.runtime.Tensor]:
        """Copy ``arrays`` to the device in one transfer; return one device view per array."""
        sizes = [int(a.size) for a in arrays]
        total = sum(sizes)
        if total > self._capacity:
            self._allocate(max(total, 2 * self._capacity))
        if self._pinned is not None:
            self._pinned.ready_for_write()
        views = []
        offset = 0
        for array, size in zip(arrays, sizes):
            self._host[offset:offset + size] = array.ravel()
            views.append(view(self._device_buffer, array.shape, offset * _INT32_BYTES, self._dtype))
            offset += size
        if self._pinned is not None:
            self._pinned.copy(total)
        elif not self._on_cpu and total:
            view(self._device_buffer, (total,), 0, self._dtype).copyfrom(self._host[:total])
        return views
