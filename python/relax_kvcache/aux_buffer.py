"""One int32 buffer that carries a step's metadata arrays to the device in one copy. On CPU the
host buffer is the device buffer; on CUDA it is pinned and copied on a side stream (ctypes: TVM's
Python API copies synchronously), which ``wait()`` orders the compute stream after; other GPUs
copy synchronously."""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import tvm
import tvm_ffi

from .tensors import view

_H2D = 1  # cudaMemcpyHostToDevice
NON_BLOCKING = 1  # cudaStreamNonBlocking
_DISABLE_TIMING = 2  # cudaEventDisableTiming
_LIB: Optional[ctypes.CDLL] = None


def cudart() -> ctypes.CDLL:
    """The CUDA runtime library, loaded once."""
    global _LIB
    if _LIB is None:
        names = ["libcudart.so.13", "libcudart.so.12", "libcudart.so", ctypes.util.find_library("cudart")]
        errors = []
        for name in filter(None, names):
            try:
                _LIB = ctypes.CDLL(name)
                break
            except OSError as err:
                errors.append(f"{name}: {err}")
        if _LIB is None:
            raise RuntimeError("the CUDA runtime library (libcudart) was not found; tried " + "; ".join(errors))
    return _LIB


def check_status(status: int, what: str) -> None:
    """Raise RuntimeError naming ``what`` and the CUDA error when ``status`` is not success."""
    if status != 0:
        lib = cudart()
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"{what} failed: CUDA error {status} ({lib.cudaGetErrorString(status).decode()})")


class PinnedUploader:
    """A pinned int32 host buffer copied to a CUDA device buffer on its own stream."""

    def __init__(self, device: tvm.runtime.Device, capacity: int) -> None:
        lib = cudart()
        self._device = device
        self.device_buffer = tvm.runtime.empty((capacity,), "int32", device)
        ptr = ctypes.c_void_p()
        check_status(lib.cudaMallocHost(ctypes.byref(ptr), ctypes.c_size_t(4 * capacity)), "cudaMallocHost")
        self._host_ptr = ptr
        self.host = np.ctypeslib.as_array((ctypes.c_int32 * capacity).from_address(ptr.value))
        self._stream = ctypes.c_void_p()
        check_status(lib.cudaStreamCreateWithFlags(ctypes.byref(self._stream), NON_BLOCKING), "cudaStreamCreate")
        self._copied, self._computed = ctypes.c_void_p(), ctypes.c_void_p()
        for event in (self._copied, self._computed):
            check_status(lib.cudaEventCreateWithFlags(ctypes.byref(event), _DISABLE_TIMING), "cudaEventCreate")
        self._copy_issued = False
        self._pending_wait = False

    def _compute_stream(self) -> ctypes.c_void_p:
        return ctypes.c_void_p(tvm_ffi.get_raw_stream(self._device) or None)

    def ready_for_write(self) -> None:
        """Block until the previous copy has read the host buffer (normally long done)."""
        if self._copy_issued:
            check_status(cudart().cudaEventSynchronize(self._copied), "cudaEventSynchronize")

    def copy(self, count: int) -> None:
        """Copy ``host[:count]`` to the device buffer on the side stream, after the compute
        stream's work so far (it may still read the previous metadata)."""
        lib = cudart()
        device_ptr = ctypes.c_void_p(self.device_buffer.data_ptr())
        check_status(lib.cudaEventRecord(self._computed, self._compute_stream()), "cudaEventRecord")
        check_status(lib.cudaStreamWaitEvent(self._stream, self._computed, 0), "cudaStreamWaitEvent")
        check_status(lib.cudaMemcpyAsync(device_ptr, self._host_ptr, ctypes.c_size_t(4 * count), _H2D,
                                         self._stream), "cudaMemcpyAsync")
        check_status(lib.cudaEventRecord(self._copied, self._stream), "cudaEventRecord")
        self._copy_issued = True
        self._pending_wait = True

    def wait(self) -> None:
        """Make the compute stream wait for the last copy (once per copy; host does not block)."""
        if self._pending_wait:
            check_status(cudart().cudaStreamWaitEvent(self._compute_stream(), self._copied, 0), "cudaStreamWaitEvent")
            self._pending_wait = False

    def close(self) -> None:
        lib = _LIB
        if lib is None or self._host_ptr is None:
            return
        lib.cudaStreamSynchronize(self._stream)
        lib.cudaEventDestroy(self._copied)
        lib.cudaEventDestroy(self._computed)
        lib.cudaStreamDestroy(self._stream)
        lib.cudaFreeHost(self._host_ptr)
        self._host_ptr = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class AuxBuffer:
    """Reusable host/device int32 buffer for per-step metadata, doubling when a step needs more."""

    def __init__(self, device: tvm.runtime.Device, capacity: int) -> None:
        self._device = device
        self._on_cpu = device.dlpack_device_type() == tvm.cpu().dlpack_device_type()
        self._on_cuda = device.dlpack_device_type() == tvm.cuda().dlpack_device_type()
        self._pinned = None
        self._allocate(max(int(capacity), 1024))

    def _allocate(self, capacity: int) -> None:
        self._capacity = capacity
        self._views: Dict[Tuple[Tuple[int, ...], int], tvm.runtime.Tensor] = {}
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
        """A device view of ``shape`` at element ``offset`` of the buffer (made once per shape and
        offset while the buffer stays)."""
        key = (shape, offset)
        made = self._views.get(key)
        if made is None:
            if len(self._views) >= 4096:
                self._views.clear()
            made = self._views[key] = view(self._device_buffer, shape, 4 * offset, self._dtype)
        return made

    def write(self, arrays: Sequence[np.ndarray], offsets: Sequence[int]) -> None:
        """Write ``arrays`` at element ``offsets`` and copy them to the device."""
        if self._pinned is not None:
            self._pinned.ready_for_write()
        host = self._host
        for array, offset in zip(arrays, offsets):
            host[offset:offset + array.size] = array if array.ndim == 1 else array.ravel()
        count = offsets[len(arrays) - 1] + arrays[-1].size if arrays else 0
        if self._pinned is not None:
            self._pinned.copy(count)
        elif not self._on_cpu and count:
            self.view((count,), 0).copyfrom(self._host[:count])


class SlotBuffer:
    """Metadata arrays at fixed places (one slot of each of ``shapes``), so that repeated decode
    steps keep every kernel argument at one address, as a replayed CUDA graph needs.
    ``partial[i]``: a shorter 1-D array may go in slot i (page lists, read through an indptr)."""

    def __init__(self, device: tvm.runtime.Device, shapes: Sequence[Tuple[int, ...]],
                 partial: Sequence[bool]) -> None:
        self._partial = tuple(bool(p) for p in partial)
        sizes = [int(np.prod(s)) for s in shapes]
        self._offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64).tolist()
        self._buffer = AuxBuffer(device, self._offsets[-1])
        self._shapes = [tuple(s) for s in shapes]
        self.views = [self._buffer.view(s, o) for s, o in zip(self._shapes, self._offsets)]
        self._written: List[Optional[np.ndarray]] = [None] * len(self._shapes)  # what each slot holds

    def upload(self, arrays: Sequence[np.ndarray]) -> bool:
        """Write ``arrays`` into their slots and copy them to the device when they all fit (each
        no larger than its slot); whether they did (else nothing changes). Arrays that are the
        very objects the slots hold already (metadata arrays are never changed in place) are not
        written again."""
        written, shapes, partial = self._written, self._shapes, self._partial
        if len(arrays) != len(shapes):
            return False
        changed = []
        for i, a in enumerate(arrays):
            if a is not written[i]:
                if a.shape != shapes[i] and not (partial[i] and a.ndim == 1 and a.size <= shapes[i][0]):
                    return False
                changed.append(i)
        if changed:
            self._buffer.write([arrays[i] for i in changed], [self._offsets[i] for i in changed])
            for i in changed:
                written[i] = arrays[i]
        return True

    def holds(self, i: int, array: np.ndarray) -> bool:
        """Whether slot ``i`` holds ``array`` (the object last written there)."""
        return self._written[i] is array

    def rewrite(self, runs: Sequence[Tuple[int, np.ndarray, Sequence[np.ndarray]]]) -> None:
        """Write each run ``(i, block, arrays)``: ``block`` (1-D) over the slots from ``i``, which
        then hold ``arrays``, as many as the slots it fills exactly (the caller's promise: each
        array is as large as its slot and ``block`` is their concatenation)."""
        self._buffer.write([block for _, block, _ in runs], [self._offsets[i] for i, _, _ in runs])
        for i, _, arrays in runs:
            self._written[i:i + len(arrays)] = arrays

    def wait(self) -> None:
        """Order the compute stream after the last upload (CUDA; no-op elsewhere)."""
        self._buffer.wait()
