"""`DecodeLane`: a batch of sequences that grows by one token per step (repeated decode steps).

A serving loop runs the same decode batch step after step; each step only adds one token to
every sequence's last block and, every ``page_size`` steps, a page. `PagingState.open_lane`
snapshots such a batch into flat arrays once; `PagingState.advance_lane` then applies a step
with numpy over the arrays and touches Python objects only where they change, instead of
validating and planning every sequence again. A lane is valid while the paging state is at the
version it was opened or last advanced at: any other change (add, remove, fork, popn, a
reservation outside the lane, windows, token trees) invalidates it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .block_pool import Block
from .sequences import Sequence


@dataclasses.dataclass(eq=False)
class DecodeLane:
    """Flat view of a decode batch, owned and advanced by `PagingState`.

    Attributes
    ----------
    version : int
        The `PagingState.version` the arrays describe.
    seq_ids : tuple of int
        The batch, in order (B sequences).
    seq_length : int64 [B]
        Each sequence's length.
    block_length : int64 [B]
        Tokens in each sequence's last block.
    page_capacity : int64 [B]
        Token slots of the pages each last block holds (``pages * page_size``).
    last_page : int64 [B]
        Id of each last block's last page (-1 when it has none).
    """

    version: int
    seq_ids: tuple[int, ...]
    seq_length: np.ndarray
    block_length: np.ndarray
    page_capacity: np.ndarray
    last_page: np.ndarray
    _pairs: tuple[tuple[Sequence, Block], ...] = dataclasses.field(repr=False)
