"""Argument validation shared by the paging modules (raises before any state changes)."""

from __future__ import annotations

import numpy as np

from ..errors import KVCacheError

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


def as_int(name: str, value: object) -> int:
    """Return ``value`` as a Python int, rejecting bools, floats and other non-integers.

    Parameters
    ----------
    name : str
        What the value is, for the error message (e.g. ``"sequence id"``).
    value : object
        A Python int or a numpy integer.

    Returns
    -------
    int
        The value as a Python int.

    Raises
    ------
    KVCacheError
        If ``value`` is not an integer (``bool`` counts as not an integer).
    """
    if type(value) is int:  # fast path for the per-step host code
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise KVCacheError(f"{name} must be an int, got {value!r} of type {type(value).__name__}")
    return int(value)


def as_seq_id(value: object) -> int:
    """Return ``value`` as a sequence id: an int in the int64 range."""
    seq_id = as_int("sequence id", value)
    if not INT64_MIN <= seq_id <= INT64_MAX:
        raise KVCacheError(f"sequence id {seq_id} is outside the int64 range")
    return seq_id


def ceil_div(a: int, b: int) -> int:
    """Ceiling of ``a / b`` for ``a >= 0`` and ``b > 0``."""
    return -(-a // b)
