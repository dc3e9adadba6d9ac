"""Argument checks at the cache's boundary: ints, lists of ints, floats and bools (wrong types
raise `ArgumentError` naming the argument and the value)."""

from __future__ import annotations

import functools
import math
import sys
from typing import Any, List, Optional, Tuple

import numpy as np

from .errors import ArgumentError, ForwardError, SequenceError

INT32_MAX = 2**31 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)
_BOOLS = (bool, np.bool_)

#: Containers accepted for a list of ints, besides TVM's ShapeTuple and Array (what
#: ``vm.builtin`` functions receive).
_SEQUENCE_TYPES = (list, tuple, range, np.ndarray)


@functools.lru_cache(maxsize=None)
def _loaded_ffi_types(*names: str) -> Tuple[type, ...]:
    return tuple(getattr(sys.modules["tvm_ffi"], name) for name in names)


def _ffi_types(*names: str) -> Tuple[type, ...]:
    """The types ``tvm_ffi.<name>`` once tvm_ffi is loaded, else ``()`` (we import no TVM)."""
    return _loaded_ffi_types(*names) if "tvm_ffi" in sys.modules else ()


def describe(value: Any) -> str:
    """A one-line description of ``value`` for error messages: the repr of scalars and short lists
    / tuples of them, else the type's name (a tensor's repr copies its data)."""
    if isinstance(value, _ffi_types("Tensor")):  # tvm.runtime.Tensor is one
        if not value.__chandle__():  # Tensor.__new__: reading its shape would crash
            return "a Tensor object without a tensor (null handle)"
        return f"a Tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    text = _plain_repr(value, depth=2)
    if text is None:
        return f"a {type(value).__name__} object"
    return f"{text[:77]}..." if len(text) > 80 else text


def _plain_repr(value: Any, depth: int) -> Optional[str]:
    """``repr(value)`` of scalars and lists / tuples of them (``depth`` levels, 20 items), or None."""
    if value is None or isinstance(value, (int, float, str, bytes, complex, np.number, np.bool_)):
        return repr(value)
    if isinstance(value, (list, tuple)) and depth > 0:
        items = [_plain_repr(v, depth - 1) for v in value[:20]]
        if any(item is None for item in items):
            return None
        inner = ", ".join(items) + (", ..." if len(value) > 20 else "")
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    return None


def as_int(name: str, value: Any) -> int:
    """``value`` (an int, numpy integer or 0-d integer array; not a bool) as a Python int."""
    if isinstance(value, _BOOLS):
        raise ArgumentError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, (int, np.integer)) or (isinstance(value, np.ndarray) and value.ndim == 0
                                                and value.dtype.kind in "iu"):
        return int(value)
    raise ArgumentError(f"{name} must be an integer, got {describe(value)} of type {type(value).__name__}")


def exact_int(value: Any) -> Optional[int]:
    """``value`` as :func:`as_int` takes it, or None where it is not an integer."""
    try:
        return as_int("value", value)
    except ArgumentError:
        return None


def as_int32(name: str, value: Any) -> int:
    """``value`` as an int within int32 (SequenceError outside)."""
    result = as_int(name, value)
    if not -INT32_MAX - 1 <= result <= INT32_MAX:
        raise SequenceError(f"{name} {result} is out of range: expected an int32, at most {INT32_MAX}")
    return result


def as_int_list(name: str, values: Any, *, max_len: int = INT32_MAX, why: str = "",
                error: type = SequenceError) -> List[int]:
    """``values`` (a list, tuple, range, ShapeTuple, tvm_ffi Array or 1-D integer numpy array)
    as a list of Python ints. A ``range`` longer than ``max_len`` raises ``error`` (saying
    ``why``) before it is expanded; callers check the others' lengths afterwards."""
    if (not isinstance(values, _SEQUENCE_TYPES + _ffi_types("Shape", "Array"))
            or (isinstance(values, np.ndarray) and values.ndim != 1)):
        raise ArgumentError(f"{name} must be a sequence of integers (list, tuple or ShapeTuple), got "
                            f"{describe(values)} of type {type(values).__name__}")
    if isinstance(values, range):  # lazy: its length is checked before it is expanded
        length = range_length(values)
        if length > max_len:
            because = f" ({why})" if why else ""
            raise error(f"{name} has {length} entries, more than {max_len}{because}")
        return list(values)
    items = values.tolist() if isinstance(values, np.ndarray) else list(values)
    if all(type(v) is int for v in items):  # fast path: ShapeTuple / list of ints
        return items
    return [as_int(f"{name}[{i}]", v) for i, v in enumerate(items)]


def range_length(values: range) -> int:
    """A range's length, also beyond ``sys.maxsize`` (where ``len`` raises ``OverflowError``)."""
    return max(0, -((values.start - values.stop) // values.step))


def as_float(name: str, value: Any, *, not_finite: type = ForwardError) -> float:
    """``value`` (an int, float or numpy number, not a bool) as a Python float within float32's
    finite range (``not_finite`` raised otherwise)."""
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "iuf":  # a 0-d array
        value = value[()]
    if isinstance(value, _BOOLS) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ArgumentError(f"{name} must be a number, got {describe(value)} of type {type(value).__name__}")
    try:
        result = float(value)
    except OverflowError:
        result = math.inf
    if not (math.isfinite(result) and abs(result) <= FLOAT32_MAX):
        raise not_finite(f"{name} must be a finite number within float32's range (the kernels' type), "
                         f"got {describe(value)}")
    return result


def as_bool(name: str, value: Any, *, error: type = ArgumentError) -> bool:
    """``value`` (a bool, or the integer 0 or 1, as Relax passes booleans) as a bool."""
    if isinstance(value, _BOOLS):
        return bool(value)
    number = exact_int(value)
    if number in (0, 1):
        return bool(number)
    raise error(f"{name} must be a bool (or 0 / 1), got {describe(value)}")
