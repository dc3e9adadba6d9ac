"""Small, fast helpers for TVM tensors: views and argument checks with clear errors."""

from __future__ import annotations

import ctypes
import math
from typing import Any, Optional, Sequence, Tuple

import numpy as np
import tvm
import tvm_ffi
from tvm.runtime import _ffi_api

from .errors import ArgumentError, ConfigError, ForwardError

#: Tensor types the cache reads.
TENSOR_TYPES = (tvm.runtime.Tensor, tvm_ffi.Tensor)

_create_view = _ffi_api.TVMTensorCreateView

#: Alignment (bytes) TVM's kernels assume for tensor data (TVM's ``kAllocAlignment``).
DATA_ALIGNMENT = 64

#: ``DLTensor`` as six 64-bit words after the 24-byte tvm-ffi object header: data, device (type, id),
#: ndim and dtype, shape, strides, byte_offset; the layout is verified once at import.
_DLTENSOR_WORDS = ctypes.c_uint64 * 6


def view(tensor: tvm.runtime.Tensor, shape: Tuple[int, ...], byte_offset: int = 0,
         dtype: Any = None) -> tvm.runtime.Tensor:
    """A view of ``tensor`` of ``shape`` at ``byte_offset`` (hot paths pass a cached ``dtype``)."""
    return _create_view(tensor, shape, tensor.dtype if dtype is None else dtype, byte_offset)


def row_view(tensor: tvm.runtime.Tensor, index: int) -> tvm.runtime.Tensor:
    """A view of ``tensor[index]`` (first axis) of a contiguous tensor."""
    shape = tuple(tensor.shape[1:])
    return view(tensor, shape, index * int(np.prod(shape, dtype=np.int64)) * tensor.dtype.itemsize)


def numpy_dtype(dtype: str) -> np.dtype:
    """The numpy dtype of a cache dtype name (bfloat16 through ``ml_dtypes``)."""
    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def allocate(shape: Tuple[int, ...], dtype: str, device: tvm.runtime.Device, what: str) -> tvm.runtime.Tensor:
    """``tvm.runtime.empty``, an allocation failure raised as ``ConfigError`` naming ``what``."""
    try:
        return tvm.runtime.empty(shape, dtype, device)
    except (MemoryError, RuntimeError) as error:
        raise ConfigError(f"cannot allocate the {what} {tuple(shape)} {dtype} on {device}: {error}") from None


def raw_words(handle: int) -> Any:
    """The six ``DLTensor`` words of the tensor at FFI handle ``handle``, indexable in place
    (read only where `RAW_READABLE`)."""
    return _DLTENSOR_WORDS.from_address(handle + 24)


def raw_fields(tensor: tvm.runtime.Tensor) -> Tuple[int, ...]:
    """The six ``DLTensor`` words of a tensor (read only where `RAW_READABLE`)."""
    return tuple(raw_words(tensor.__chandle__())[:])


def _layout_verified() -> bool:
    base = tvm.runtime.tensor(np.zeros((2, 32), dtype=np.float32))
    data, device, ndim_dtype, _, _, offset = raw_fields(_create_view(base, (2, 3), base.dtype, 12))
    return (data == base.data_ptr() and device == 1 and ndim_dtype == 2 | 0x12002 << 32 and offset == 12
            and raw_fields(base)[5] == 0)


RAW_READABLE = _layout_verified()


def byte_offset(tensor: tvm.runtime.Tensor) -> int:
    """``DLTensor.byte_offset`` of ``tensor`` (0 where the field cannot be read safely)."""
    return raw_fields(tensor)[5] if RAW_READABLE else 0


def check_tensor(
    name: str,
    value: Any,
    *,
    shape: Sequence[Optional[int]],
    dtype: str,
    device: tvm.runtime.Device,
) -> Tuple[int, ...]:
    """Check a tensor argument (``None`` in ``shape`` matches any extent); its shape. It must
    also be contiguous, start at its data pointer and be aligned, as the kernels assume."""
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
    offset = byte_offset(value)
    if offset:
        raise ForwardError(f"{name} is a view with byte offset {offset}; expected 0 (the kernels take tensors "
                           "that start at their data pointer: pass a tensor of its own)")
    if value.data_ptr() % DATA_ALIGNMENT:
        raise ForwardError(f"{name} data at {value.data_ptr():#x} is not aligned to {DATA_ALIGNMENT} bytes, as "
                           "the kernels expect")
    return got


def check_disjoint(outputs: Sequence[Tuple[str, tvm.runtime.Tensor]],
                   inputs: Sequence[Tuple[str, tvm.runtime.Tensor]] = ()) -> None:
    """Raise ``ForwardError`` when an output's memory overlaps another output's or an input's
    (entries ``(name, tensor)``, contiguous tensors)."""
    spans = [(name, t.data_ptr(), math.prod(t.shape) * t.dtype.itemsize) for name, t in (*outputs, *inputs)]
    for i in range(len(outputs)):
        name, lo, n = spans[i]
        for other, lo2, n2 in spans[i + 1:]:
            if n and n2 and lo < lo2 + n2 and lo2 < lo + n:
                raise ForwardError(f"{name} shares memory with {other}; expected separate tensors (the kernels "
                                   f"write {name} while reading the others)")

