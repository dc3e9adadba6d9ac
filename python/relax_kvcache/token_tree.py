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
        for node, parent in enumerate(parents):
            if not -1 <= parent < node:
                raise ForwardError(f"invalid token tree of sequence {seq_id}: the parent of node {node} is "
                                   f"{parent}; expected -1 (a root) or a node index in [0, {node})")
        sizes = [1] * len(parents)  # of each node's subtree; children come after their parent
        for node in range(len(parents) - 1, -1, -1):
            if parents[node] != -1:
                sizes[parents[node]] += sizes[node]
        # DFS (preorder) number of each node, roots and children in index order
        depths, firsts, next_first = [], [], {-1: 0}
        for node, parent in enumerate(parents):
            firsts.append(next_first[parent])
            next_first[parent] += sizes[node]
            next_first[node] = firsts[node] + 1
            depths.append(depths[parent] + 1 if parent != -1 else 0)
        return cls(parents=parents, depths=tuple(depths),
                   intervals=tuple((first, first + size) for first, size in zip(firsts, sizes)),
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

