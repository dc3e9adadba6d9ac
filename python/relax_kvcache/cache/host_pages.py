"""`HostPages`: the memory of prefix caching's host tier (``KVCacheConfig.host_cache_pages``)
and the copies `PagingState.take_host_moves` asks for.

Each layer's host pages are one buffer of ``host_cache_pages`` pages laid out as its device
page tensor's pages, so a page moves byte for byte, as a checkpoint's 8-bit page groups do.
Moves between consecutive device pages and consecutive host slots are merged: one copy per
layer and run of pages. On CUDA the buffers are pinned and the copies run on a copy stream,
after the work queued so far and before anything queued later (the host does not wait);
elsewhere they are TVM's (synchronous) copies between host and device tensors.
"""

from __future__ import annotations

import ctypes
from typing import List, NamedTuple, Sequence

import numpy as np
import tvm

from ..aux_buffer import SideStream, check_status, cudart
from ..errors import ConfigError
from ..paging.host_tier import HostMove
from ..tensors import allocate, view

_D2H, _H2D = 2, 1  # cudaMemcpyDeviceToHost, cudaMemcpyHostToDevice


class Run(NamedTuple):
    """``count`` pages from device page ``page`` to host slot ``slot`` (``to_host``) or back."""

    to_host: bool
    page: int
    slot: int
    count: int


def runs(moves: Sequence[HostMove]) -> List[Run]:
    """``moves`` merged into runs of consecutive pages and slots, in order."""
    merged: List[Run] = []
    for move in moves:
        last = merged[-1] if merged else None
        if (last is not None and last.to_host == move.to_host and move.page == last.page + last.count
                and move.slot == last.slot + last.count):
            merged[-1] = last._replace(count=last.count + 1)
        else:
            merged.append(Run(move.to_host, move.page, move.slot, 1))
    return merged


class HostPages:
    """Host copies of evicted cached pages: ``capacity`` pages per layer of ``pages``."""

    def __init__(self, pages: Sequence[tvm.runtime.Tensor], capacity: int, device: tvm.runtime.Device) -> None:
        self._pages, self._device = list(pages), device
        self._page_shape = tuple(pages[0].shape[1:])
        self._page_bytes = int(np.prod(self._page_shape)) * pages[0].dtype.itemsize
        self.capacity = capacity
        self._cuda = device.dlpack_device_type() == tvm.cuda().dlpack_device_type()
        if self._cuda:
            size = len(self._pages) * capacity * self._page_bytes
            self._side = SideStream(device, size, lambda status: ConfigError(
                f"host_cache_pages {capacity}: {size} bytes of pinned host memory could not be allocated "
                f"(CUDA error {status})"))
        else:
            self._host = [allocate((capacity, *self._page_shape), str(p.dtype), tvm.cpu(), "host cache pages")
                          for p in self._pages]

    def run(self, moves: Sequence[HostMove]) -> None:
        """Carry out ``moves`` in order (see the module docstring for when they complete)."""
        if not moves:
            return
        merged = runs(moves)
        if self._cuda:
            self._run_cuda(merged)
            return
        for run in merged:
            for layer, pages in enumerate(self._pages):
                device, host = self._view(pages, run.page, run.count), self._view(self._host[layer], run.slot, run.count)
                (device.copyto(host) if run.to_host else host.copyto(device))

    def read(self, layer: int, slot: int) -> np.ndarray:
        """The bytes of host slot ``slot`` of ``layer`` (uint8; for tests and debugging)."""
        if self._cuda:
            self._side.synchronize()
            size = self._page_bytes
            return self._side.array(ctypes.c_uint8, size, (layer * self.capacity + slot) * size).copy()
        return self._view(self._host[layer], slot, 1).numpy().reshape(-1)

    def _view(self, tensor: tvm.runtime.Tensor, first: int, count: int) -> tvm.runtime.Tensor:
        return view(tensor, (count * self._page_bytes,), first * self._page_bytes, "uint8")

    # ------------------------------------------------------------------ CUDA

    def _run_cuda(self, merged: List[Run]) -> None:
        lib, side = cudart(), self._side
        side.begin()
        size, host, stream = self._page_bytes, side.host_ptr.value, side.stream  # type: ignore[union-attr]
        for run in merged:
            nbytes = ctypes.c_size_t(run.count * size)
            for layer, pages in enumerate(self._pages):
                device_ptr = ctypes.c_void_p(pages.data_ptr() + run.page * size)
                host_ptr = ctypes.c_void_p(host + (layer * self.capacity + run.slot) * size)
                dst, src, kind = (host_ptr, device_ptr, _D2H) if run.to_host else (device_ptr, host_ptr, _H2D)
                check_status(lib.cudaMemcpyAsync(dst, src, nbytes, kind, stream), "cudaMemcpyAsync")
        side.end()
        side.wait()

    def close(self) -> None:
        """Free the pinned memory, the stream and the events (CUDA)."""
        if self._cuda:
            self._side.close()
