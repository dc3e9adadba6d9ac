"""Snapshots of a cache's state, to check that a call which raised changed nothing.

A snapshot holds the paging state (``PagingState.debug_snapshot``), the current forward step
(compared by identity) and the K/V contents of every sequence read back with ``debug_get_kv``
(``debug_get_kv_mla`` for MLA caches); with ``pages=True`` also a copy of every layer's page
tensor, which catches writes to slots no sequence reads yet (e.g. a step's reserved positions).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import numpy as np
import tvm


@dataclasses.dataclass
class Snapshot:
    paging: dict
    step: object
    contents: Dict[int, Tuple[np.ndarray, ...]]
    pages: Optional[Tuple[np.ndarray, ...]]
    importing: object = None  # a checkpoint import in progress: (seq_id, slots, pending groups)


def _read_kv(cache, seq_id: int, length: int) -> Tuple[np.ndarray, ...]:
    cfg = cache.config
    if cfg.is_mla:
        kv = tvm.runtime.empty((cfg.num_layers, length, cfg.head_dim), cfg.dtype, cache.device)
        cache.debug_get_kv_mla(seq_id, 0, length, kv)
        return (kv.numpy(),)
    k = tvm.runtime.empty((cfg.num_layers, length, cfg.num_kv_heads, cfg.head_dim), cfg.dtype, cache.device)
    v = tvm.runtime.empty((cfg.num_layers, length, cfg.num_kv_heads, cfg.v_head_dim), cfg.dtype, cache.device)
    cache.debug_get_kv(seq_id, 0, length, k, v)
    return k.numpy(), v.numpy()


def snapshot(cache, *, pages: bool = False) -> Snapshot:
    """The state of ``cache`` (see the module docstring)."""
    contents = {}
    state = cache._checkpoints.importing
    for seq_id in cache._paging.seq_ids():
        length = cache._paging.sequence_length(seq_id)
        if length and not (state is not None and state.seq_id == seq_id):  # unreadable while importing
            contents[seq_id] = _read_kv(cache, seq_id, length)
    raw = tuple(p.numpy() for p in cache._pages) if pages else None
    importing = None if state is None else (state.seq_id, state.slots.tolist(), sorted(state.pending))
    return Snapshot(cache._paging.debug_snapshot(), cache._step, contents, raw, importing)


def assert_same(before: Snapshot, after: Snapshot) -> None:
    """Assert that two snapshots of a cache are equal."""
    assert before.paging == after.paging, "paging state changed"
    assert before.step is after.step, "forward-step state changed"
    assert before.importing == after.importing, "checkpoint import state changed"
    assert before.contents.keys() == after.contents.keys(), "sequences changed"
    for seq_id, arrays in before.contents.items():
        for a, b in zip(arrays, after.contents[seq_id]):
            _assert_same_bytes(a, b, f"K/V of sequence {seq_id} changed")
    if before.pages is not None and after.pages is not None:
        for layer, (a, b) in enumerate(zip(before.pages, after.pages)):
            _assert_same_bytes(a, b, f"pages of layer {layer} changed")


def _assert_same_bytes(a: np.ndarray, b: np.ndarray, message: str) -> None:
    """Bitwise equality (NaNs included: numpy does not treat bfloat16 NaNs as equal)."""
    assert a.shape == b.shape and a.dtype == b.dtype, message
    np.testing.assert_array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8),
                                  err_msg=message)
