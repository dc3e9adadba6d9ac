"""One int32 buffer that carries a step's metadata arrays to the device in one copy. On CPU the
host buffer is the device buffer; on CUDA it is pinned and copied on the compute stream
(`PinnedUpload`; ctypes: TVM's Python API copies synchronously); other GPUs copy synchronously.
`SideStream` is the host tier's copy stream."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import itertools
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

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


class _Pinned:
    """Pinned host memory of ``nbytes`` for copies to and from ``device``, freed by `close` after
    `_release` has waited for the copies and freed what a subclass holds.
    ``alloc_error(status)``: the exception for a failed ``cudaMallocHost``."""

    def __init__(self, device: tvm.runtime.Device, nbytes: int,
                 alloc_error: Optional[Callable[[int], Exception]] = None) -> None:
        self._lib = lib = cudart()
        self._device = device
        ptr = ctypes.c_void_p()
        status = lib.cudaMallocHost(ctypes.byref(ptr), ctypes.c_size_t(nbytes))
        if status and alloc_error is not None:
            raise alloc_error(status)
        check_status(status, "cudaMallocHost")
        self.host_ptr: Optional[ctypes.c_void_p] = ptr

    def array(self, ctype: Any, count: int, offset: int = 0) -> np.ndarray:
        """A numpy array over ``count`` ``ctype`` items of the pinned memory from byte ``offset``."""
        address = self.host_ptr.value + offset  # type: ignore[union-attr]
        return np.ctypeslib.as_array((ctype * count).from_address(address))

    def _release(self, lib: ctypes.CDLL) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Wait for the copies, then free the CUDA objects and the pinned memory."""
        lib = _LIB
        if lib is None or self.host_ptr is None:
            return
        self._release(lib)
        lib.cudaFreeHost(self.host_ptr)
        self.host_ptr = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class SideStream(_Pinned):
    """Pinned host memory of ``nbytes`` and a non-blocking CUDA copy stream, ordered against the
    compute stream of ``device`` by two events: copies queued on `stream` between `begin` and `end`
    run after the compute stream's work so far, and before its work queued after `wait`; the host
    does not block. ``alloc_error(status)``: the exception for a failed ``cudaMallocHost``."""

    def __init__(self, device: tvm.runtime.Device, nbytes: int,
                 alloc_error: Optional[Callable[[int], Exception]] = None) -> None:
        super().__init__(device, nbytes, alloc_error)
        lib = self._lib
        self.stream = ctypes.c_void_p()
        check_status(lib.cudaStreamCreateWithFlags(ctypes.byref(self.stream), NON_BLOCKING), "cudaStreamCreate")
        self._computed, self._copied = ctypes.c_void_p(), ctypes.c_void_p()
        for event in (self._computed, self._copied):
            check_status(lib.cudaEventCreateWithFlags(ctypes.byref(event), _DISABLE_TIMING), "cudaEventCreate")
        self._copy_issued = self._pending_wait = False

    def begin(self) -> None:
        """Make the copy stream wait for the compute stream's work so far (it may still use the
        memory that the next copies write)."""
        lib, compute = self._lib, ctypes.c_void_p(tvm_ffi.get_raw_stream(self._device) or None)
        check_status(lib.cudaEventRecord(self._computed, compute), "cudaEventRecord")
        check_status(lib.cudaStreamWaitEvent(self.stream, self._computed, 0), "cudaStreamWaitEvent")

    def end(self) -> None:
        """Record the copies queued on `stream` since `begin`, for `wait` and `ready_for_write`."""
        check_status(self._lib.cudaEventRecord(self._copied, self.stream), "cudaEventRecord")
        self._copy_issued = self._pending_wait = True

    def ready_for_write(self) -> None:
        """Block until the last copy has read the pinned memory (normally long done)."""
        if self._copy_issued:
            check_status(self._lib.cudaEventSynchronize(self._copied), "cudaEventSynchronize")

    def wait(self) -> None:
        """Make the compute stream wait for the copies up to the last `end` (once; host does not block)."""
        if self._pending_wait:
            compute = ctypes.c_void_p(tvm_ffi.get_raw_stream(self._device) or None)
            check_status(self._lib.cudaStreamWaitEvent(compute, self._copied, 0), "cudaStreamWaitEvent")
            self._pending_wait = False

    def synchronize(self) -> None:
        """Block until the copies queued so far are done."""
        check_status(self._lib.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")

    def _release(self, lib: ctypes.CDLL) -> None:
        lib.cudaStreamSynchronize(self.stream)
        lib.cudaEventDestroy(self._copied)
        lib.cudaEventDestroy(self._computed)
        lib.cudaStreamDestroy(self.stream)


class PinnedUpload(_Pinned):
    """Pinned host memory of ``nbytes`` copied to the device on the stream current when `copy`
    is called (the compute stream: after the work queued on it so far, before the work queued
    after), with an event recorded after each copy: the host waits for it only before
    overwriting the memory (`ready_for_write`), and `wait` orders another current stream after
    the copy. Three CUDA runtime calls a step."""

    def __init__(self, device: tvm.runtime.Device, nbytes: int) -> None:
        super().__init__(device, nbytes)
        self._copied = ctypes.c_void_p()
        check_status(self._lib.cudaEventCreateWithFlags(ctypes.byref(self._copied), _DISABLE_TIMING),
                     "cudaEventCreate")
        self._stream: Optional[int] = None  # the stream of the last copy (None: the default stream)
        self._issued = self._pending_wait = False

    def ready_for_write(self) -> None:
        """Block until the last copy has read the pinned memory (it follows the compute stream's
        work queued before it: normally done)."""
        if self._issued:
            check_status(self._lib.cudaEventSynchronize(self._copied), "cudaEventSynchronize")

    def copy(self, dst: ctypes.c_void_p, nbytes: int) -> None:
        """Queue a copy of the first ``nbytes`` of the pinned memory to ``dst`` on the current
        stream, and the event after it."""
        stream = tvm_ffi.get_raw_stream(self._device) or None
        lib, handle = self._lib, ctypes.c_void_p(stream)
        check_status(lib.cudaMemcpyAsync(dst, self.host_ptr, ctypes.c_size_t(nbytes), _H2D, handle), "cudaMemcpyAsync")
        check_status(lib.cudaEventRecord(self._copied, handle), "cudaEventRecord")
        self._stream, self._issued, self._pending_wait = stream, True, True

    def wait(self) -> None:
        """Make the current stream wait for the last copy, unless the copy was queued on it
        (once per copy; the host does not block)."""
        if self._pending_wait:
            stream = tvm_ffi.get_raw_stream(self._device) or None
            if stream != self._stream:
                check_status(self._lib.cudaStreamWaitEvent(ctypes.c_void_p(stream), self._copied, 0),
                             "cudaStreamWaitEvent")
            self._pending_wait = False

    def _release(self, lib: ctypes.CDLL) -> None:
        if self._issued:
            lib.cudaEventSynchronize(self._copied)
        lib.cudaEventDestroy(self._copied)


class AuxBuffer:
    """Reusable host/device int32 buffer for per-step metadata, doubling when a step needs more."""

    def __init__(self, device: tvm.runtime.Device, capacity: int) -> None:
        self._device = device
        self._on_cpu = device.dlpack_device_type() == tvm.cpu().dlpack_device_type()
        self._on_cuda = device.dlpack_device_type() == tvm.cuda().dlpack_device_type()
        self._side: Optional[PinnedUpload] = None
        self._allocate(max(int(capacity), 1024))

    def _allocate(self, capacity: int) -> None:
        self._capacity = capacity
        self._views: Dict[Tuple[Tuple[int, ...], int], tvm.runtime.Tensor] = {}
        if self._side is not None:
            self._side.ready_for_write()
            self._side.close()
        self._device_buffer = tvm.runtime.empty((capacity,), "int32", self._device)
        if self._on_cuda:
            self._device_ptr = ctypes.c_void_p(self._device_buffer.data_ptr())
            self._side = PinnedUpload(self._device, 4 * capacity)
            self._host = self._side.array(ctypes.c_int32, capacity)
        else:
            self._host = (np.from_dlpack(self._device_buffer) if self._on_cpu
                          else np.empty(capacity, dtype=np.int32))
        self._dtype = self._device_buffer.dtype

    def wait(self) -> None:
        """Order the compute stream after the last upload (CUDA; no-op elsewhere)."""
        if self._side is not None:
            self._side.wait()

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
        side = self._side
        if side is not None:
            side.ready_for_write()
        host = self._host
        for array, offset in zip(arrays, offsets):
            host[offset:offset + array.size] = array if array.ndim == 1 else array.ravel()
        count = offsets[len(arrays) - 1] + arrays[-1].size if arrays else 0
        if side is not None:
            side.copy(self._device_ptr, 4 * count)
        elif not self._on_cpu and count:
            self.view((count,), 0).copyfrom(self._host[:count])

    def writer(self, array: np.ndarray, offset: int) -> Callable[[], None]:
        """A function that does ``write([array], [offset])`` again (a 1-D array the caller updates
        in place); on CPU, where the host buffer is the device's, a plain copy."""
        if self._on_cpu:
            return functools.partial(np.copyto, self._host[offset:offset + array.size], array)
        return functools.partial(self.write, [array], [offset])


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
        self.wait = self._buffer.wait  # orders the compute stream after the last upload (CUDA)

    def upload(self, arrays: Sequence[np.ndarray], every: bool = False) -> bool:
        """Write ``arrays`` into their slots and copy them to the device when they all fit (each
        no larger than its slot); whether they did (else nothing changes). Arrays that are the
        very objects the slots hold already are not written again, unless ``every`` (a step
        whose arrays may have changed in place, `DecodePlanner.repeat`)."""
        written = self._written
        if len(arrays) != len(written):
            return False
        changed = []
        for i, a in enumerate(arrays):
            if every or a is not written[i]:
                if not self.fits(i, a):
                    return False
                changed.append(i)
        if changed:
            self._buffer.write([arrays[i] for i in changed], [self._offsets[i] for i in changed])
            for i in changed:
                written[i] = arrays[i]
        return True

    def fits(self, i: int, array: np.ndarray) -> bool:
        """Whether ``array`` may go in slot ``i`` (see `upload`)."""
        shape = self._shapes[i]
        return array.shape == shape or (self._partial[i] and array.ndim == 1 and array.size <= shape[0])

    def holds(self, i: int, array: np.ndarray) -> bool:
        """Whether slot ``i`` holds ``array`` (the object last written there)."""
        return self._written[i] is array

    def rewrite(self, runs: Sequence[Tuple[int, np.ndarray, Sequence[np.ndarray]]]) -> None:
        """Write each run ``(i, block, arrays)``: ``block`` (1-D) over the slots from ``i``, which
        then hold ``arrays`` (the caller's promise: ``block`` is their concatenation, each array
        but the last as large as its slot, the last one that `fits` its slot)."""
        self._buffer.write([block for _, block, _ in runs], [self._offsets[i] for i, _, _ in runs])
        for i, _, arrays in runs:
            self._written[i:i + len(arrays)] = arrays

    def rewriter(self, i: int, block: np.ndarray) -> Callable[[], None]:
        """A function that writes ``block`` over the slots from ``i`` again (`rewrite`), for a
        block the caller updates in place (the slots hold its arrays already)."""
        return self._buffer.writer(block, self._offsets[i])
