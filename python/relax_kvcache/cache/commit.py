"""Token-tree commits: which K/V move where, and the moves themselves (``compact_copy``)."""

from __future__ import annotations

import dataclasses
from typing import List, Sequence, Tuple

import numpy as np
import tvm

from .. import metadata as md
from ..errors import SequenceError
from ..kernel_set import KernelSet
from ..paging import PagingState


@dataclasses.dataclass(frozen=True)
class CommitPlan:
    """One sequence's commit: ``moves`` are (source, destination) indices among its last
    ``span`` tokens (its uncommitted tree, or its last step without one); ``pop`` tokens go."""

    seq_id: int
    span: int
    moves: Tuple[Tuple[int, int], ...]
    pop: int


def plan_commit(paging: PagingState, seq_id: int, leaf: int) -> CommitPlan:
    """The moves and the pop of one sequence's commit, all checked."""
    seq = paging.sequence(seq_id)
    tree = seq.token_tree
    if leaf < -1:
        raise SequenceError(f"leaf index {leaf} of sequence {seq_id} is invalid; expected >= -1")
    if leaf != -1 and tree is None:
        raise SequenceError(f"the accepted nodes of sequence {seq_id} are already committed (leaf index {leaf})")
    if leaf != -1 and leaf >= len(tree):
        raise SequenceError(f"leaf index {leaf} of sequence {seq_id} is out of range [-1, {len(tree)})")
    span = len(tree) if tree is not None else seq.last_append_length
    path = tree.path_to(leaf) if leaf != -1 else []
    moves = tuple((src, dst) for dst, src in enumerate(path) if src != dst)
    return CommitPlan(seq_id=seq_id, span=span, moves=moves, pop=span - len(path))


def compact(paging: PagingState, kernels: KernelSet, pages: List[tvm.runtime.Tensor],
            device: tvm.runtime.Device, plans: Sequence[CommitPlan]) -> None:
    """Move accepted nodes' K/V to their consecutive positions in every layer (compact_copy)."""
    lengths, src_dst = [], [[], []]
    for plan in plans:
        if not plan.moves:
            lengths.append(0)
            continue
        seq = paging.sequence(plan.seq_id)
        slots = paging.position_map(plan.seq_id, seq.seq_length - plan.span, seq.seq_length)
        for src, dst in plan.moves:
            src_dst[0].append(int(slots[src]))
            src_dst[1].append(int(slots[dst]))
        lengths.append(len(plan.moves))
    indptr = tvm.runtime.tensor(md.indptr(lengths), device)
    positions = tvm.runtime.tensor(np.array(src_dst, dtype=np.int32), device)
    for layer_pages in pages:
        kernels.compact_copy(layer_pages, indptr, positions, len(plans))
