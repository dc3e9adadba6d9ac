"""Blocks of the prefix tree and the pool that recycles their indices like TVM."""

from __future__ import annotations

import dataclasses

from ..errors import KVCacheError


@dataclasses.dataclass(slots=True)
class Block:
    """A node of the prefix tree, a run of tokens in pages of its own (TVM's ``Block``); once
    slid, token ``i >= sink_length`` is at slot ``i - sink_length + sliding_window_offset``."""

    index: int  # in its BlockPool
    page_ids: list[int] = dataclasses.field(default_factory=list)  # no two blocks share a page
    seq_length: int = 0
    start_pos: int = 0  # absolute position of the first token (for RoPE)
    sink_length: int = 0  # set when the last block of a windowed sequence first slides
    sliding_window_offset: int = 0
    parent: int = -1  # -1: a root block
    ref_count: int = 0  # TVM's external_ref_cnt: sequences ending here plus child blocks


class BlockPool:
    """Owner of all blocks and their reference counts; freed indices are reused most recent
    first (TVM's ``GetFreeBlock``)."""

    __slots__ = ("_blocks", "_free", "_live")

    def __init__(self) -> None:
        self._blocks: list[Block] = []
        self._free: list[int] = []
        self._live: list[bool] = []

    def __len__(self) -> int:
        """Blocks ever allocated since the last reset (free or live)."""
        return len(self._blocks)

    def all_free(self) -> bool:
        return len(self._free) == len(self._blocks)

    def free_block_indices(self) -> tuple[int, ...]:
        """The free-index stack, bottom first (the last entry is reused next)."""
        return tuple(self._free)

    def is_live(self, idx: int) -> bool:
        return type(idx) is int and 0 <= idx < len(self._blocks) and self._live[idx]

    def __getitem__(self, idx: int) -> Block:
        """The block ``idx``, unchecked (hot paths)."""
        return self._blocks[idx]

    @property
    def table(self) -> list[Block]:
        """Every block by index, free ones too (read-only; hot paths index it unchecked)."""
        return self._blocks

    def get(self, idx: int) -> Block:
        """The live block ``idx``; KVCacheError if there is none."""
        if not self.is_live(idx):
            raise KVCacheError(f"block {idx!r} is not a live block")
        return self._blocks[idx]

    def live_indices(self) -> list[int]:
        return [i for i, live in enumerate(self._live) if live]

    def reset(self) -> None:
        """Forget every block (TVM clears ``global_block_pool_`` and ``free_block_idx_``)."""
        self._blocks.clear()
        self._free.clear()
        self._live.clear()

    def new_block(self) -> int:
        """Allocate an empty block with ``ref_count == 0``; its index."""
        if self._free:
            idx = self._free.pop()
            self._live[idx] = True
            return idx
        self._blocks.append(Block(len(self._blocks)))
        self._live.append(True)
        return len(self._blocks) - 1

    def retain(self, idx: int, count: int = 1) -> None:
        self.get(idx).ref_count += count

    def release(self, idx: int) -> None:
        """Drop one reference to block ``idx``, which must keep at least one (it is shared)."""
        block = self.get(idx)
        if block.ref_count <= 1:
            raise KVCacheError(f"block {idx} has {block.ref_count} reference(s); expected a "
                               "shared block (>= 2)")
        block.ref_count -= 1

    def free(self, idx: int) -> None:
        """Return block ``idx`` (at most one reference left, its pages released) to the pool."""
        block = self.get(idx)
        if block.ref_count > 1:
            raise KVCacheError(f"block {idx} is still shared ({block.ref_count} references)")
        self._blocks[idx] = Block(idx)
        self._live[idx] = False
        self._free.append(idx)
