"""Tensor argument checks of the per-layer calls. The last valid tensor of each argument name is
remembered (by FFI handle, kept referenced until the step ends: a tensor never changes, so the
same tensor again needs only its shape compared). A new tensor is first checked on its raw
``DLTensor`` fields (dtype and device words of an earlier valid tensor, offset 0, alignment,
contiguity); anything else goes to `check_tensor`, which raises."""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import tvm

from ..errors import ForwardError
from ..tensors import DATA_ALIGNMENT, RAW_READABLE, TENSOR_TYPES, check_tensor, raw_fields, raw_words, view


class TensorChecks:
    """`check_tensor` for one dtype and device, remembering the last valid tensor of each name."""

    def __init__(self, dtype: str, device: tvm.runtime.Device) -> None:
        self._dtype, self._device = dtype, device
        self._last: Dict[str, Tuple[int, Any, Tuple[int, ...]]] = {}  # name -> (handle, tensor, shape)
        self._words: Optional[Tuple[int, int]] = None  # raw device and dtype words of a valid tensor

    def shape(self, name: str, value: Any, expected: Sequence[Optional[int]]) -> Tuple[int, ...]:
        """``check_tensor(name, value, shape=expected, ...)``: the shape of a valid tensor, else
        the error `check_tensor` raises."""
        got = self._known(name, value)
        if got is not None and (got == expected or (len(got) == len(expected) and all(
                e is None or g == e for g, e in zip(got, expected)))):
            return got
        got = check_tensor(name, value, shape=expected, dtype=self._dtype, device=self._device)
        handle = value.__chandle__()
        if handle:
            self._last[name] = (handle, value, got)
            if self._words is None and RAW_READABLE:
                raw = raw_fields(value)
                self._words = (raw[1], raw[2] >> 32)
        return got

    def rows(self, name: str, value: Any, tail: Tuple[int, ...]) -> int:
        """The leading extent of a valid tensor of shape ``(rows, *tail)`` (see `shape`)."""
        got = self._known(name, value)
        if got is not None and got[1:] == tail:
            return got[0]
        return self.shape(name, value, (None, *tail))[0]

    def fused_qkv(self, n: int, qkv: Any, o: Any, heads: Tuple[int, int, int],
                  error: Optional[Exception] = None) -> Tuple[Any, Any]:
        """``qkv (m, Hq + 2 Hkv, D)`` and ``o (m, Hq, D)`` of an ``attention_with_fused_qkv`` step
        of ``n <= m`` tokens (``heads``: Hq, Hkv, D), as their first ``n`` rows (views where
        ``m > n``); else the error naming what is wrong, or ``error`` (what the library's check
        raised) where nothing here is."""
        hq, hkv, d = heads
        rows = self.rows("qkv", qkv, (hq + 2 * hkv, d))
        self.shape("o", o, (rows, hq, d))
        if rows < n:
            raise ForwardError(f"qkv has {rows} rows, fewer than the {n} tokens of the step")
        if rows == n:
            if error is not None:
                raise error
            return qkv, o
        return view(qkv, (n, hq + 2 * hkv, d)), view(o, (n, hq, d))

    def _known(self, name: str, value: Any) -> Optional[Tuple[int, ...]]:
        """The shape of the tensor last remembered as ``name``, or of a new one whose raw fields
        pass (then remembered); else None."""
        if not isinstance(value, TENSOR_TYPES):
            return None
        handle = value.__chandle__()
        last = self._last.get(name)
        if last is not None and last[0] == handle:
            return last[2]
        words = self._words
        if words is None or not handle:
            return None
        raw = raw_words(handle)  # data, device, ndim | dtype << 32, shape, strides, byte offset
        if (raw[1] != words[0] or raw[2] >> 32 != words[1] or raw[5] or raw[0] % DATA_ALIGNMENT
                or not value.is_contiguous()):
            return None
        shape = value.shape  # a tuple
        self._last[name] = (handle, value, shape)
        return shape

    def forget(self) -> None:
        """Forget every tensor (the end of a step)."""
        if self._last:
            self._last.clear()
