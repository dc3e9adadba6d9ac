"""Blocks of the prefix tree and the pool that recycles their indices like TVM."""

from __future__ import annotations

import dataclasses

from ..errors import KVCacheError


@dataclasses.dataclass(slots=True)
class Block:
    """A node of the prefix tree: a run of tokens stored in pages of its own (TVM's ``Block``).

    Parameters
    ----------
    index : int
        Global index of the block in its `BlockPool`.
    page_ids : list of int
        Pages holding the block's tokens; no two blocks share a page.
    seq_length : int
        Number of tokens in the block.
    start_pos : int
        Absolute position of the block's first token in the sequence (for RoPE).
    sink_length : int
        Attention-sink tokens pinned at the start of the block: set when the last block of a
        sliding-window sequence first slides, 0 otherwise. Token ``i < sink_length`` of the
        block lives at in-block slot ``i`` (slot ``k`` is ``page_ids[k // page_size]``, offset
        ``k % page_size``).
    sliding_window_offset : int
        In-block slot of the first token after the sink, 0 until the block slides. Token
        ``i >= sink_length`` lives at slot ``i - sink_length + sliding_window_offset``; the
        block holds ``ceil((seq_length - sink_length + sliding_window_offset) / page_size)``
        pages.
    parent : int
        Index of the parent block, or -1 for a root block.
    ref_count : int
        TVM's ``external_ref_cnt``: sequences whose last block this is plus child blocks.
        Only `BlockPool` changes it.
    """

    index: int
    page_ids: list[int] = dataclasses.field(default_factory=list)
    seq_length: int = 0
    start_pos: int = 0
    sink_length: int = 0
    sliding_window_offset: int = 0
    parent: int = -1
    ref_count: int = 0

    def reset(self) -> None:
        """Clear everything but the index (TVM's ``Block::Reset``)."""
        self.page_ids = []
        self.seq_length = 0
        self.start_pos = 0
        self.sink_length = 0
        self.sliding_window_offset = 0
        self.parent = -1
        self.ref_count = 0


class BlockPool:
    """Owner of all blocks and of their reference counts.

    Block indices are recycled through a stack of freed indices, as TVM's
    ``free_block_idx_`` / ``GetFreeBlock``: a new block reuses the most recently freed index,
    else gets the next unused one.
    """

    __slots__ = ("_blocks", "_free", "_live")

    def __init__(self) -> None:
        self._blocks: list[Block] = []
        self._free: list[int] = []
        self._live: list[bool] = []

    def __len__(self) -> int:
        """Number of blocks ever allocated since the last reset (free or live)."""
        return len(self._blocks)

    @property
    def num_free(self) -> int:
        """Number of freed block indices waiting for reuse."""
        return len(self._free)

    def all_free(self) -> bool:
        """Return True if every block ever allocated is free again (part of TVM's ``Empty``)."""
        return len(self._free) == len(self._blocks)

    def free_block_indices(self) -> tuple[int, ...]:
        """Return the free-index stack, bottom first (the last entry is reused next)."""
        return tuple(self._free)

    def is_live(self, idx: int) -> bool:
        """Return True if ``idx`` names an allocated, not freed, block."""
        return type(idx) is int and 0 <= idx < len(self._blocks) and self._live[idx]

    def __getitem__(self, idx: int) -> Block:
        """Return the live block ``idx`` (no check, for internal hot paths)."""
        return self._blocks[idx]

    def get(self, idx: int) -> Block:
        """Return the live block ``idx``.

        Raises
        ------
        KVCacheError
            If ``idx`` is not a live block index.
        """
        if not self.is_live(idx):
            raise KVCacheError(f"block {idx!r} is not a live block")
        return self._blocks[idx]

    def live_indices(self) -> list[int]:
        """Return the indices of all live blocks, ascending."""
        return [i for i, live in enumerate(self._live) if live]

    def reset(self) -> None:
        """Forget every block (TVM clears ``global_block_pool_`` and ``free_block_idx_``)."""
        self._blocks.clear()
        self._free.clear()
        self._live.clear()

    def new_block(self) -> int:
        """Allocate a reset block with ``ref_count == 0`` and return its index."""
        if self._free:
            idx = self._free.pop()
            self._blocks[idx].reset()
            self._live[idx] = True
            return idx
        idx = len(self._blocks)
        self._blocks.append(Block(idx))
        self._live.append(True)
        return idx

    def retain(self, idx: int, count: int = 1) -> None:
        """Add ``count`` references to the live block ``idx``."""
        self.get(idx).ref_count += count

    def release(self, idx: int) -> None:
        """Drop one reference to block ``idx``, which must keep at least one (it is shared)."""
        block = self.get(idx)
        if block.ref_count <= 1:
            raise KVCacheError(
                f"block {idx} has {block.ref_count} reference(s); expected a shared block (>= 2)"
            )
        block.ref_count -= 1

    def free(self, idx: int) -> None:
        """Return block ``idx`` to the pool; its pages must already be released by the caller.

        The block must hold at most one reference: the one that is going away with it.
        """
        block = self.get(idx)
        if block.ref_count > 1:
            raise KVCacheError(f"block {idx} is still shared ({block.ref_count} references)")
        block.reset()
        self._live[idx] = False
        self._free.append(idx)
