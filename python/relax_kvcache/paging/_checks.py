"""Argument validation shared by the paging modules (raises before any state changes)."""

from __future__ import annotations

from ..args import as_int  # noqa: F401 - the paging modules' integer check (ArgumentError)
from ..errors import SequenceError

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


def as_seq_id(value: object) -> int:
    """Return ``value`` as a sequence id: an int in the int64 range."""
    seq_id = as_int("sequence id", value)
    if not INT64_MIN <= seq_id <= INT64_MAX:
        raise SequenceError(f"sequence id {seq_id} is outside the int64 range [{INT64_MIN}, {INT64_MAX}]")
    return seq_id


def ceil_div(a: int, b: int) -> int:
    """Ceiling of ``a / b`` for ``a >= 0`` and ``b > 0``."""
    return -(-a // b)
