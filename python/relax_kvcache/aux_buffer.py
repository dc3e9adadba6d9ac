"""One int32 buffer that carries a step's metadata arrays to the device in one copy.

``upload(arrays)`` packs the arrays back to back into a host buffer, copies the used prefix to
the device once, and returns a device view per array (same shape). On CPU the host buffer *is*
the device buffer (numpy view of the TVM tensor), so the upload is the packing itself. On CUDA
the host buffer is pinned and the copy runs on a side stream (:mod:`.cuda_copy`); ``wait()``
makes the compute stream wait for it, once, before the first kernel that reads the metadata.
Other GPUs copy synchronously.
"""

from __future__ import annotations

import itertools
from typing import List, Sequence, Tuple

import numpy as np
import tvm

from .cuda_copy import PinnedUploader
from .tensors import view

_INT32_BYTES = 4


class AuxBuffer:
    """Reusable host/device int32 buffer for per-step metadata, of ``capacity`` elements at
    first; it grows (doubling) when a step needs more."""

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
        offsets = list(itertools.accumulate(sizes, initial=0))
        self.write(arrays, offsets)
        return [self.view(array.shape, offset) for array, offset in zip(arrays, offsets)]

    def view(self, shape: Tuple[int, ...], offset: int) -> tvm.runtime.Tensor:
        """A device view of ``shape`` at element ``offset`` of the buffer."""
        return view(self._device_buffer, shape, offset * _INT32_BYTES, self._dtype)

    def write(self, arrays: Sequence[np.ndarray], offsets: Sequence[int]) -> None:
        """Write ``arrays`` at element ``offsets`` and copy the buffer up to the last one's end
        to the device (on CPU they are one buffer), once the previous copy has read it."""
        if self._pinned is not None:
            self._pinned.ready_for_write()
        for array, offset in zip(arrays, offsets):
            self._host[offset:offset + array.size] = array.ravel()
        count = offsets[len(arrays) - 1] + arrays[-1].size if arrays else 0
        if self._pinned is not None:
            self._pinned.copy(count)
        elif not self._on_cpu and count:
            self.view((count,), 0).copyfrom(self._host[:count])


class SlotBuffer:
    """Metadata arrays at fixed places: one slot of each of ``shapes`` per array, device views
    created once.

    Repeated decode steps have the same arrays every step, only their contents change (and the
    page lists grow). Fixed slots keep every kernel argument at the same address with the same
    shape, which is what replaying a captured CUDA graph needs. ``partial[i]``: whether a shorter
    1-D array may go in slot i (page lists, which kernels read through their indptr).
    """

    def __init__(self, device: tvm.runtime.Device, shapes: Sequence[Tuple[int, ...]],
                 partial: Sequence[bool]) -> None:
        self._partial = tuple(bool(p) for p in partial)
        sizes = [int(np.prod(s)) for s in shapes]
        self._offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64).tolist()
        self._buffer = AuxBuffer(device, self._offsets[-1])
        self._shapes = [tuple(s) for s in shapes]
        self.views = [self._buffer.view(s, o) for s, o in zip(self._shapes, self._offsets)]

    def fits(self, arrays: Sequence[np.ndarray]) -> bool:
        """Whether ``arrays`` fit the slots (same count, each no larger than its slot)."""
        return len(arrays) == len(self._shapes) and all(
            a.shape == s or (p and a.ndim == 1 and a.size <= s[0])
            for a, s, p in zip(arrays, self._shapes, self._partial))

    def upload(self, arrays: Sequence[np.ndarray]) -> None:
        """Write ``arrays`` (``fits(arrays)`` holds) into their slots and copy them to the device."""
        self._buffer.write(arrays, self._offsets)

    def wait(self) -> None:
        """Order the compute stream after the last upload (CUDA; no-op elsewhere)."""
        self._buffer.wait()
