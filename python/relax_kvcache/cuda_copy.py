"""Asynchronous host-to-device copies on a side stream, through the CUDA runtime (ctypes).

TVM's Python API copies tensors synchronously. Per-step metadata needs one pinned host buffer,
one copy on a separate stream issued at ``begin_forward``, and the compute stream waiting for it
only before the step's first kernel.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Optional

import numpy as np
import tvm
import tvm_ffi

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
    """A pinned int32 host buffer of ``capacity`` elements copied to a device buffer of a CUDA
    ``device`` on its own stream."""

    def __init__(self, device: tvm.runtime.Device, capacity: int) -> None:
        lib = cudart()
        self._device = device
        self._capacity = capacity
        self.device_buffer = tvm.runtime.empty((capacity,), "int32", device)
        ptr = ctypes.c_void_p()
        check_status(lib.cudaMallocHost(ctypes.byref(ptr), ctypes.c_size_t(4 * capacity)), "cudaMallocHost")
        self._host_ptr = ptr
        self.host = np.ctypeslib.as_array((ctypes.c_int32 * capacity).from_address(ptr.value))
        self._stream = ctypes.c_void_p()
        check_status(lib.cudaStreamCreateWithFlags(ctypes.byref(self._stream), NON_BLOCKING), "cudaStreamCreate")
        self._copied = ctypes.c_void_p()
        self._computed = ctypes.c_void_p()
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
        stream's work so far (it may still read the previous step's metadata)."""
        lib = cudart()
        device_ptr = ctypes.c_void_p(self.device_buffer.data_ptr())
        check_status(lib.cudaEventRecord(self._computed, self._compute_stream()), "cudaEventRecord")
        check_status(lib.cudaStreamWaitEvent(self._stream, self._computed, 0), "cudaStreamWaitEvent")
        check_status(lib.cudaMemcpyAsync(device_ptr, self._host_ptr, ctypes.c_size_t(4 * count), _H2D, self._stream),
               "cudaMemcpyAsync")
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
