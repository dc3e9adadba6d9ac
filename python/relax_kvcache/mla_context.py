"""Chunked MLA context (as vLLM's): the step's cached tokens in chunks of at most ``C`` rows
(:class:`ContextPlan`, planned once per step) and their buffers (:class:`ContextWorkspace`)."""

from __future__ import annotations

import dataclasses
from typing import Sequence, Tuple

import numpy as np
import tvm

from .paging import PagingState
from .tensors import allocate


@dataclasses.dataclass(frozen=True)
class ContextChunk:
    """A run of rows of the step's concatenated context."""

    rows: int  # latent rows (0 only when the step has no cached context at all)
    positions: tvm.runtime.Tensor  # int32 (max(rows, 1),): page slots, sequence after sequence
    kv_indptr: tvm.runtime.Tensor  # int32 (B + 1,): rows of each sequence in the chunk


@dataclasses.dataclass(frozen=True)
class ContextPlan:
    """The step's cached context (the tokens of each sequence before this step) in chunks."""

    chunks: Tuple[ContextChunk, ...]  # at least one, each of at most chunk_size rows
    k_rope_pos_offset: tvm.runtime.Tensor  # int32 zeros (B,): the ragged kernel's (no RoPE)

    @classmethod
    def build(cls, paging: PagingState, seq_ids: Sequence[int], append_lengths: Sequence[int],
              chunk_size: int, device: tvm.runtime.Device) -> "ContextPlan":
        """Plan the context of a step whose pages are already reserved."""
        lengths = [paging.sequence_length(s) - n for s, n in zip(seq_ids, append_lengths)]
        slots = [paging.position_map(s, 0, c) for s, c in zip(seq_ids, lengths) if c > 0]
        positions = np.concatenate(slots).astype(np.int32) if slots else np.zeros(1, np.int32)
        starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        total = int(starts[-1])
        chunks = []
        for begin in range(0, max(total, 1), chunk_size):
            end = min(begin + chunk_size, total)
            counts = np.clip(np.minimum(starts[1:], end) - np.maximum(starts[:-1], begin), 0, None)
            indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
            rows = max(end - begin, 0)
            chunk_positions = positions[begin:end] if rows else positions[:1]
            chunks.append(ContextChunk(rows, tvm.runtime.tensor(chunk_positions, device),
                                       tvm.runtime.tensor(indptr, device)))
        return cls(tuple(chunks), tvm.runtime.tensor(np.zeros(len(seq_ids), np.int32), device))


class ContextWorkspace:
    """Buffers for one chunk: latent rows ``(1, C, W)``, K ``(C, H, Dqk)``, V ``(C, H, Dv)``, and
    a chunk's attention output ``(prefill chunk size, H, Dv)``."""

    def __init__(self, rows: int, max_tokens: int, width: int, heads: int, qk_head_dim: int, v_head_dim: int,
                 dtype: str, device: tvm.runtime.Device) -> None:
        self.dims = (qk_head_dim, v_head_dim)
        self.latent = allocate((1, rows, width), dtype, device, "MLA context latent workspace")
        self.k = allocate((rows, heads, qk_head_dim), dtype, device, "MLA context K workspace")
        self.v = allocate((rows, heads, v_head_dim), dtype, device, "MLA context V workspace")
        self.o = allocate((max_tokens, heads, v_head_dim), dtype, device, "MLA context output workspace")

    def spans(self) -> Tuple[Tuple[str, tvm.runtime.Tensor], ...]:
        """``(name, tensor)`` of every buffer, for `tensors.check_disjoint`."""
        return tuple((f"the context workspace's {name}", t)
                     for name, t in (("latent", self.latent), ("k", self.k), ("v", self.v), ("o", self.o)))
