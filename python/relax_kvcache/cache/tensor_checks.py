"""Tensor argument checks of the per-layer calls, remembered per tensor object.

A tensor's shape, dtype, device, strides and data pointer never change, so a tensor object that
passed `check_tensor` once needs only its shape compared again. Tensors are recognised by their
FFI handle (a `vm.builtin` call wraps the same tensor in a new Python object every time); the
remembered ones are kept referenced, so a handle cannot be reused by another tensor while it is
remembered. The cache forgets them at the end of every step (so that it never keeps a model's
activations alive) and beyond ``limit`` tensors.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import tvm

from ..tensors import TENSOR_TYPES, check_tensor


class TensorChecks:
    """`check_tensor` for one dtype and device, remembering the tensors that passed."""

    def __init__(self, dtype: str, device: tvm.runtime.Device, limit: int = 256) -> None:
        self._dtype, self._device, self._limit = dtype, device, limit
        self._passed: Dict[int, Tuple[Any, Tuple[int, ...]]] = {}  # handle -> (tensor, shape)

    def shape(self, name: str, value: Any, expected: Sequence[Optional[int]]) -> Tuple[int, ...]:
        """``check_tensor(name, value, shape=expected, ...)``: the shape of a valid tensor, else
        the error `check_tensor` raises."""
        if isinstance(value, TENSOR_TYPES):
            known = self._passed.get(value.__chandle__())
            if known is not None:
                got = known[1]
                if got == expected or (len(got) == len(expected)
                                       and all(e is None or g == e for g, e in zip(got, expected))):
                    return got
        got = check_tensor(name, value, shape=expected, dtype=self._dtype, device=self._device)
        self._remember(value, got)
        return got

    def rows(self, name: str, value: Any, tail: Tuple[int, ...]) -> int:
        """The leading extent of a valid tensor of shape ``(rows, *tail)`` (see `shape`)."""
        if isinstance(value, TENSOR_TYPES):
            known = self._passed.get(value.__chandle__())
            if known is not None and known[1][1:] == tail:
                return known[1][0]
        return self.shape(name, value, (None, *tail))[0]

    def forget(self) -> None:
        """Forget every tensor (the end of a step)."""
        if self._passed:
            self._passed.clear()

    def _remember(self, value: Any, shape: Tuple[int, ...]) -> None:
        handle = value.__chandle__()
        if not handle:
            return
        passed = self._passed
        if len(passed) >= self._limit:
            for old in list(passed)[: self._limit // 2]:
                del passed[old]
        passed[handle] = (value, shape)
