"""Argument validation shared by the paging modules (raises before any state changes)."""

from __future__ import annotations

from ..args import as_int  # noqa: F401 - the paging modules' integer check (ArgumentError)
from ..errors import SequenceError
from .sequences import Sequence

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


def as_seq_id(value: object) -> int:
    """``value`` as a sequence id: an int in the int64 range."""
    seq_id = as_int("sequence id", value)
    if not INT64_MIN <= seq_id <= INT64_MAX:
        raise SequenceError(f"sequence id {seq_id} is outside the int64 range [{INT64_MIN}, "
                            f"{INT64_MAX}]")
    return seq_id


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def check_pop_length(seq: Sequence, n: object) -> int:
    n = as_int("pop length", n)
    if not 0 <= n <= seq.seq_length:
        raise SequenceError(f"cannot pop {n} tokens from sequence {seq.seq_id} of length "
                            f"{seq.seq_length}: expected 0 <= n <= {seq.seq_length}")
    return n
