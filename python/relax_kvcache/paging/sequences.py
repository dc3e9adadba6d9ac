"""The per-sequence record of the paged KV cache."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(slots=True)
class Sequence:
    """A live sequence, a path in the block tree ending at ``last_block`` (TVM's ``Sequence``);
    owned by `PagingState`, read-only elsewhere."""

    seq_id: int
    last_block: int  # ancestors are reached through Block.parent
    seq_length: int = 0  # the sum of the lengths of the blocks on the path
    sliding_window_size: int = -1  # -1: no window
    attn_sink_size: int = 0  # the sink the window was enabled with
    last_block_attn_sink_size: int = 0  # max(attn_sink_size - prefix length, 0)
    accepted_indices_committed: bool = True  # the last step's token-tree nodes are committed
    token_tree: object = None  # the uncommitted relax_kvcache.token_tree.TokenTree, or None
    last_append_length: int = 0  # tokens of the last step (what a commit's leaf -1 pops)
    tokens: object = None  # prefix caching: the paging.prefix.TokenLog, None when not registering
