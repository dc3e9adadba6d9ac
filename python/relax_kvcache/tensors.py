"""Small, fast helpers for TVM tensors: views and argument checks with clear errors."""

from __future__ import annotations

import ctypes
from typing import Any, Optional, Sequence, Tuple

import numpy as np
import tvm
import tvm_ffi
from tvm.runtime import _ffi_api

from .errors import ArgumentError, ConfigError, ForwardError

#: Tensor types the cache reads.
TENSOR_TYPES = (tvm.runtime.Tensor, tvm_ffi.Tensor)

_create_view = _ffi_api.TVMTensorCreateView

#: Alignment (bytes) TVM's kernels assume for the data of every tensor argument (TVM's
#: ``kAllocAlignment``): compiled code may use aligned vector loads, so less is a crash.
DATA_ALIGNMENT = 64

#: Where ``DLTensor.byte_offset`` lies from a tvm-ffi tensor handle (tvm-ffi's stable C ABI,
#: ``TVMFFITensorGetDLTensorPtr``): a 24-byte object header (reference count, type index,
#: deleter), then the DLTensor's data (8), device (8), ndim (4), dtype (4), shape (8) and
#: strides (8) fields. Verified once at import (:func:`_byte_offset_readable`).
_BYTE_OFFSET_AT = 24 + 40
_UINT64 = ctypes.c_uint64


def view(tensor: tvm.runtime.Tensor, shape: Tuple[int, ...], byte_offset: int = 0,
         dtype: Any = None) -> tvm.runtime.Tensor:
    """A view of ``tensor`` with ``shape`` at ``byte_offset``, ~1 us.

    ``dtype`` defaults to the tensor's; pass a cached dtype object on hot paths (reading
    ``tensor.dtype`` builds a new one each time).
    """
    return _create_view(tensor, shape, tensor.dtype if dtype is None else dtype, byte_offset)


def row_view(tensor: tvm.runtime.Tensor, index: int) -> tvm.runtime.Tensor:
    """A view of ``tensor[index]`` (first axis) of a contiguous tensor; not for hot paths (it
    reads ``tensor.dtype``)."""
    shape = tuple(tensor.shape[1:])
    return view(tensor, shape, index * int(np.prod(shape, dtype=np.int64)) * tensor.dtype.itemsize)


def numpy_dtype(dtype: str) -> np.dtype:
    """The numpy dtype of a cache dtype name (bfloat16 through ``ml_dtypes``)."""
    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def allocate(shape: Tuple[int, ...], dtype: str, device: tvm.runtime.Device, what: str) -> tvm.runtime.Tensor:
    """``tvm.runtime.empty``, with an allocation failure (``std::bad_alloc``, device out of
    memory) reported as a ``ConfigError`` naming ``what`` and its shape."""
    try:
        return tvm.runtime.empty(shape, dtype, device)
    except (MemoryError, RuntimeError) as error:
        raise ConfigError(f"cannot allocate the {what} {tuple(shape)} {dtype} on {device}: {error}") from None


def byte_offset(tensor: tvm.runtime.Tensor) -> int:
    """``DLTensor.byte_offset`` of ``tensor`` (non-zero for views made with an offset), ~0.5 us.

    Returns 0 where the field cannot be read safely (see :data:`_BYTE_OFFSET_AT`).
    """
    if not _OFFSET_READABLE:
        return 0
    return _UINT64.from_address(tensor.__chandle__() + _BYTE_OFFSET_AT).value


def _byte_offset_readable() -> bool:
    """Whether :func:`byte_offset` reads the right field in this tvm-ffi build."""
    base = tvm.runtime.empty((64,), "int32", tvm.cpu())
    probe = _create_view(base, (8,), base.dtype, 12)
    read = _UINT64.from_address
    return (read(base.__chandle__() + _BYTE_OFFSET_AT).value == 0
            and read(probe.__chandle__() + _BYTE_OFFSET_AT).value == 12
            and probe.data_ptr() == base.data_ptr() + 12)


_OFFSET_READABLE = _byte_offset_readable()


def check_tensor(
    name: str,
    value: Any,
    *,
    shape: Sequence[Optional[int]],
    dtype: str,
    device: tvm.runtime.Device,
) -> Tuple[int, ...]:
    """Check a tensor argument; ``None`` in ``shape`` matches any extent. Returns its shape.

    Besides shape, dtype and device, the tensor must be contiguous, start at its data pointer
    (no byte offset) and have its data aligned to :data:`DATA_ALIGNMENT` bytes: what the
    kernels assume (a view with an offset makes them raise, possibly after an earlier kernel
    of the same call changed the cache; misaligned data can crash them).

    Raises ``ArgumentError`` when ``value`` is not a tensor, otherwise ``ForwardError``, naming
    the argument, what it got and what was expected.
    """
    if not isinstance(value, TENSOR_TYPES):
        raise ArgumentError(f"{name} must be a tvm.runtime.Tensor, got {type(value).__name__}")
    got = tuple(value.shape)
    if len(got) != len(shape) or any(e is not None and g != e for g, e in zip(got, shape)):
        expected = "(" + ", ".join("*" if e is None else str(e) for e in shape) + ")"
        raise ForwardError(f"{name} has shape {got}, expected {expected}")
    if value.dtype != dtype:
        raise ForwardError(f"{name} has dtype {value.dtype}, expected {dtype}")
    if value.device != device:
        raise ForwardError(f"{name} is on device {value.device}, expected {device}")
    if not value.is_contiguous():
        raise ForwardError(f"{name} must be contiguous (strides {tuple(value.strides)})")
    if (_OFFSET_READABLE and _UINT64.from_address(value.__chandle__() + _BYTE_OFFSET_AT).value) \
            or value.data_ptr() % DATA_ALIGNMENT:
        _placement_error(name, value)
    return got


def _placement_error(name: str, value: tvm.runtime.Tensor) -> None:
    offset = byte_offset(value)
    if offset:
        raise ForwardError(f"{name} is a view with byte offset {offset}; expected 0 (the kernels take tensors "
                           "that start at their data pointer: pass a tensor of its own)")
    raise ForwardError(f"{name} data at {value.data_ptr():#x} is not aligned to {DATA_ALIGNMENT} bytes, as the "
                       "kernels expect")


def check_disjoint(outputs: Sequence[Tuple[str, tvm.runtime.Tensor, int]],
                   inputs: Sequence[Tuple[str, tvm.runtime.Tensor, int]] = ()) -> None:
    """Raise ``ForwardError`` when an output's memory overlaps another output's or an input's.

    Entries are ``(name, tensor, nbytes)`` of tensors already checked by :func:`check_tensor`
    (no byte offset, so their data spans ``[data_ptr, data_ptr + nbytes)``). A kernel writing
    an output that aliases what it still reads gives wrong results without an error.
    """
    spans = [(name, t.data_ptr(), n) for name, t, n in (*outputs, *inputs)]
    for i in range(len(outputs)):
        name, lo, n = spans[i]
        for other, lo2, n2 in spans[i + 1:]:
            if n and n2 and lo < lo2 + n2 and lo2 < lo + n:
                raise ForwardError(f"{name} shares memory with {other}; expected separate tensors (the kernels "
                                   f"write {name} while reading the others)")

