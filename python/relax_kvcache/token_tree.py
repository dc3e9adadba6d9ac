"""Token trees for speculative decoding: parent pointers, depths and the attention mask encoding.

A sequence appends draft tokens as a tree (``parents[n]`` is node n's parent, -1 for a root, and
always ``< n``). A node attends to the committed prefix and to its ancestors and itself. The mask
is encoded as TVM does: each node gets a DFS interval ``[first, last)`` (roots in index order,
children in index order); node j is an ancestor-or-self of node i iff
``first[j] <= first[i] < last[j]``.
"""

from __future__ import annotations

import dataclasses
from typing import List, Sequence, Tuple

from .errors import ForwardError

#: Largest token tree a sequence may hold (TVM's ``kTreeAttnMaxTreeSize``).
MAX_TREE_SIZE = 256


@dataclasses.dataclass(frozen=True)
class TokenTree:
    """A validated token tree."""

    parents: Tuple[int, ...]  # -1 for roots
    depths: Tuple[int, ...]  # roots 0
    intervals: Tuple[Tuple[int, int], ...]  # DFS interval [first, last) of each node
    is_chain: bool  # every node's parent is the previous node: plain causal attention

    @classmethod
    def build(cls, parents: Sequence[int], *, seq_id: int) -> "TokenTree":
        """Validate ``parents`` (of sequence ``seq_id``) and derive depths and intervals."""
        parents = tuple(parents)
        if len(parents) > MAX_TREE_SIZE:
            raise ForwardError(f"the token tree of sequence {seq_id} has {len(parents)} nodes, more than the "
                               f"maximum tree size {MAX_TREE_SIZE}")
        depths: List[int] = []
        children: List[List[int]] = [[] for _ in parents]
        roots: List[int] = []
        for node, parent in enumerate(parents):
            if not -1 <= parent < node:
                raise ForwardError(f"invalid token tree of sequence {seq_id}: the parent of node {node} is "
                                   f"{parent}; expected -1 (a root) or a node index in [0, {node})")
            if parent == -1:
                roots.append(node)
                depths.append(0)
            else:
                children[parent].append(node)
                depths.append(depths[parent] + 1)
        return cls(parents=parents, depths=tuple(depths), intervals=_dfs_intervals(children, roots),
                   is_chain=all(parent == node - 1 for node, parent in enumerate(parents)))

    def __len__(self) -> int:
        return len(self.parents)

    def path_to(self, leaf: int) -> List[int]:
        """Nodes from the root to ``leaf`` (inclusive), in order."""
        path = []
        while leaf != -1:
            path.append(leaf)
            leaf = self.parents[leaf]
        return path[::-1]


def _dfs_intervals(children: List[List[int]], roots: List[int]) -> Tuple[Tuple[int, int], ...]:
    """Iterative DFS from the roots in order: ``first`` is the visit order, ``last`` one past the
    largest ``first`` in the subtree."""
    intervals = [(0, 0)] * len(children)
    counter = 0
    for root in roots:
        stack = [(root, False)]
        while stack:
            node, done = stack.pop()
            if done:
                last = max([intervals[node][0] + 1] + [intervals[c][1] for c in children[node]])
                intervals[node] = (intervals[node][0], last)
                continue
            intervals[node] = (counter, 0)
            counter += 1
            stack.append((node, True))
            stack.extend((child, False) for child in reversed(children[node]))
    return tuple(intervals)
