"""Tensor argument checks of the per-layer calls, remembered per tensor (by FFI handle, kept
referenced until the step ends or ``limit`` is reached: a tensor never changes, so it needs only
its shape compared again). A new tensor is first checked on its raw ``DLTensor`` fields (dtype
and device words of an earlier valid tensor, offset 0, alignment, contiguity); anything else goes
to `check_tensor`, which raises."""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import tvm

from ..tensors import DATA_ALIGNMENT, RAW_READABLE, TENSOR_TYPES, check_tensor, raw_fields, raw_words


class TensorChecks:
    """`check_tensor` for one dtype and device, remembering the tensors that passed."""

    def __init__(self, dtype: str, device: tvm.runtime.Device, limit: int = 256) -> None:
        self._dtype, self._device, self._limit = dtype, device, limit
        self._passed: Dict[int, Tuple[Any, Tuple[int, ...]]] = {}  # handle -> (tensor, shape)
        self._words: Optional[Tuple[int, int]] = None  # raw device and dtype words of a valid tensor

    def shape(self, name: str, value: Any, expected: Sequence[Optional[int]]) -> Tuple[int, ...]:
        """``check_tensor(name, value, shape=expected, ...)``: the shape of a valid tensor, else
        the error `check_tensor` raises."""
        got = self._known(value)
        if got is not None and (got == expected or (len(got) == len(expected) and all(
                e is None or g == e for g, e in zip(got, expected)))):
            return got
        got = check_tensor(name, value, shape=expected, dtype=self._dtype, device=self._device)
        self._remember(value.__chandle__(), value, got)
        if self._words is None and RAW_READABLE and value.__chandle__():
            raw = raw_fields(value)
            self._words = (raw[1], raw[2] >> 32)
        return got

    def rows(self, name: str, value: Any, tail: Tuple[int, ...]) -> int:
        """The leading extent of a valid tensor of shape ``(rows, *tail)`` (see `shape`)."""
        got = self._known(value)
        if got is not None and got[1:] == tail:
            return got[0]
        return self.shape(name, value, (None, *tail))[0]

    def _known(self, value: Any) -> Optional[Tuple[int, ...]]:
        """The shape of a tensor remembered, or whose raw fields pass (then remembered); else None."""
        if not isinstance(value, TENSOR_TYPES):
            return None
        handle = value.__chandle__()
        known = self._passed.get(handle)
        if known is not None:
            return known[1]
        words = self._words
        if words is None or not handle:
            return None
        raw = raw_words(handle)  # data, device, ndim | dtype << 32, shape, strides, byte offset
        if (raw[1] != words[0] or raw[2] >> 32 != words[1] or raw[5] or raw[0] % DATA_ALIGNMENT
                or not value.is_contiguous()):
            return None
        shape = value.shape  # a tuple
        self._remember(handle, value, shape)
        return shape

    def forget(self) -> None:
        """Forget every tensor (the end of a step)."""
        if self._passed:
            self._passed.clear()

    def _remember(self, handle: int, value: Any, shape: Tuple[int, ...]) -> None:
        if not handle:
            return
        passed = self._passed
        if len(passed) >= self._limit:
            for old in list(passed)[: self._limit // 2]:
                del passed[old]
        passed[handle] = (value, shape)
