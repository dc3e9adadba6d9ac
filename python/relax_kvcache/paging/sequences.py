"""The per-sequence record of the paged KV cache."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(slots=True)
class Sequence:
    """A live sequence: a path in the block tree ending at ``last_block`` (TVM's ``Sequence``).

    Owned and mutated by `PagingState`; callers get it for reading only.

    Parameters
    ----------
    seq_id : int
        The caller's id of the sequence.
    last_block : int
        Index of the sequence's last block; ancestors are reached through ``Block.parent``.
    seq_length : int
        Total number of tokens: the sum of the lengths of the blocks on the path.
    sliding_window_size : int
        Sliding window size, or -1 when sliding window is not enabled. Once the sequence is
        longer than its window (and the cache slides windows), ``seq_length`` is the window
        size: the tokens kept are the sink tokens followed by the most recent ones.
    attn_sink_size : int
        The attention sink the window was enabled with (tokens from the sequence's start).
    last_block_attn_sink_size : int
        Attention-sink tokens of the last block: ``max(attn_sink_size - prefix_length, 0)``
        (the prefix blocks cannot slide and act as a sink already); the last block's
        ``sink_length`` once it has slid. Reduced when a fork moves tokens of the last block
        into a prefix block (a split, or a new empty last block); recomputed when popping
        makes an earlier block the last one.
    accepted_indices_committed : bool
        Whether the accepted token-tree nodes of the last forward step are committed.
    token_tree : object
        The uncommitted token tree (``relax_kvcache.token_tree.TokenTree``), or None.
    last_append_length : int
        Tokens appended to the sequence by its last forward step (what a token-tree commit
        resolves node indices against, as TVM does).
    """

    seq_id: int
    last_block: int
    seq_length: int = 0
    sliding_window_size: int = -1
    attn_sink_size: int = 0
    last_block_attn_sink_size: int = 0
    accepted_indices_committed: bool = True
    token_tree: object = None
    last_append_length: int = 0
