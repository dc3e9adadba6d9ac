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
from typing import List, NamedTuple, Optional, Sequence

import numpy as np
import tvm
import tvm_ffi

from ..aux_buffer import NON_BLOCKING, check_status, cudart
from ..paging.host_tier import HostMove
from ..tensors import allocate, view

_D2H, _H2D = 2, 1  # cudaMemcpyDeviceToHost, cudaMemcpyHostToDevice
_DISABLE_TIMING = 2  # cudaEventDisableTiming


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
        self._host_ptr: Optional[ctypes.c_void_p] = None
        if self._cuda:
            self._open_cuda()
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
            self._sync()
            size = self._page_bytes
            base = self._host_ptr.value + (layer * self.capacity + slot) * size  # type: ignore[union-attr]
            return np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(base)).copy()
        return self._view(self._host[layer], slot, 1).numpy().reshape(-1)

    def _view(self, tensor: tvm.runtime.Tensor, first: int, count: int) -> tvm.runtime.Tensor:
        return view(tensor, (count * self._page_bytes,), first * self._page_bytes, "uint8")

    # ------------------------------------------------------------------ CUDA

    def _open_cuda(self) -> None:
        lib = cudart()
        ptr = ctypes.c_void_p()
        size = len(self._pages) * self.capacity * self._page_bytes
        status = lib.cudaMallocHost(ctypes.byref(ptr), ctypes.c_size_t(size))
        if status:
            from ..errors import ConfigError
            raise ConfigError(f"host_cache_pages {self.capacity}: {size} bytes of pinned host memory could not be "
                              f"allocated (CUDA error {status})")
        self._host_ptr = ptr
        self._stream, self._queued, self._copied = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        check_status(lib.cudaStreamCreateWithFlags(ctypes.byref(self._stream), NON_BLOCKING), "cudaStreamCreate")
        for event in (self._queued, self._copied):
            check_status(lib.cudaEventCreateWithFlags(ctypes.byref(event), _DISABLE_TIMING), "cudaEventCreate")

    def _compute_stream(self) -> ctypes.c_void_p:
        return ctypes.c_void_p(tvm_ffi.get_raw_stream(self._device) or None)

    def _run_cuda(self, merged: List[Run]) -> None:
        lib, stream, compute = cudart(), self._stream, self._compute_stream()
        check_status(lib.cudaEventRecord(self._queued, compute), "cudaEventRecord")
        check_status(lib.cudaStreamWaitEvent(stream, self._queued, 0), "cudaStreamWaitEvent")
        size, host = self._page_bytes, self._host_ptr.value  # type: ignore[union-attr]
        for run in merged:
            nbytes = ctypes.c_size_t(run.count * size)
            for layer, pages in enumerate(self._pages):
                device_ptr = ctypes.c_void_p(pages.data_ptr() + run.page * size)
                host_ptr = ctypes.c_void_p(host + (layer * self.capacity + run.slot) * size)
                dst, src, kind = (host_ptr, device_ptr, _D2H) if run.to_host else (device_ptr, host_ptr, _H2D)
                check_status(lib.cudaMemcpyAsync(dst, src, nbytes, kind, stream), "cudaMemcpyAsync")
        check_status(lib.cudaEventRecord(self._copied, stream), "cudaEventRecord")
        check_status(lib.cudaStreamWaitEvent(compute, self._copied, 0), "cudaStreamWaitEvent")

    def _sync(self) -> None:
        check_status(cudart().cudaStreamSynchronize(self._stream), "cudaStreamSynchronize")

    def close(self) -> None:
        """Free the pinned memory, the stream and the events (CUDA)."""
        if self._host_ptr is None:
            return
        lib = cudart()
        lib.cudaStreamSynchronize(self._stream)
        lib.cudaEventDestroy(self._queued)
        lib.cudaEventDestroy(self._copied)
        lib.cudaStreamDestroy(self._stream)
        lib.cudaFreeHost(self._host_ptr)
        self._host_ptr = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
