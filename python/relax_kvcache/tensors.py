"""Small, fast helpers for TVM tensors: views and argument checks with clear errors."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import tvm
from tvm.runtime import _ffi_api

from .errors import ForwardError

_create_view = _ffi_api.TVMTensorCreateView


def view(tensor: tvm.runtime.Tensor, shape: Tuple[int, ...], byte_offset: int = 0,
         dtype: Any = None) -> tvm.runtime.Tensor:
    """A view of ``tensor`` with ``shape`` at ``byte_offset``, ~1 us.

    ``dtype`` defaults to the tensor's; pass a cached dtype object on hot paths (reading
    ``tensor.dtype`` builds a new one each time).
    """
    return _create_view(tensor, shape, tensor.dtype if dtype is None else dtype, byte_offset)


def check_tensor(
    name: str,
    value: Any,
    *,
    shape: Sequence[Optional[int]],
    dtype: str,
    device: tvm.runtime.Device,
) -> Tuple[int, ...]:
    """Check a tensor argument; ``None`` in ``shape`` matches any extent. Returns its shape.

    Raises ``ForwardError`` naming the argument, what it got and what was expected.
    """
    if not isinstance(value, tvm.runtime.Tensor):
        raise ForwardError(f"{name} must be a tvm.runtime.Tensor, got {type(value).__name__}")
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
    return got
