"""The first stage of a step: check ``begin_forward``'s arguments and plan the step on the host
(repeated decode batches through :mod:`relax_kvcache.decode_plan`)."""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

from tvm.runtime import ShapeTuple

from .. import metadata as md
from ..args import as_int_list
from ..config import KVCacheConfig
from ..decode_plan import DecodePlanner
from ..errors import ForwardError, KVCacheError, SequenceError
from ..kernel_set import KernelSet
from ..paging import PagingState
from ..token_tree import TokenTree


def unwindowed_chunk_limit(config: KVCacheConfig, kernels: KernelSet) -> int:
    """Most tokens a sequence may append per step (0: no limit): the window of ``MHA_SLIDING``
    layers without the windowed ragged kernel."""
    return config.layer_span.window if kernels.attention_prefill_ragged_sliding_window is None else 0


class StepPlanner:
    """Checks and plans steps; ``tree_refusal()``: why token-tree steps are refused, or None."""

    def __init__(self, config: KVCacheConfig, kernels: KernelSet, paging: PagingState,
                 tree_refusal: Callable[[], Optional[KVCacheError]]) -> None:
        self._config, self._paging, self._tree_refusal = config, paging, tree_refusal
        self._window_limit = unwindowed_chunk_limit(config, kernels)
        self._span, self._slides = config.layer_span, config.slides_sequences
        # prefill steps of plain sequences attend over grown page lists: MHA caches on our kernels
        # (with TVM's, which lack the prefixed kernel, the cache keeps TVM's kernel sequence)
        self._grow_pages = not config.is_mla and kernels.attention_prefill_prefixed is not None
        self.decode = DecodePlanner(config.page_size, self._span)

    def plan(self, seq_ids: Any, append_lengths: Any, parent_ptr: Optional[Sequence[int]],
             importing: Optional[int]) -> md.StepMetadata:
        """The step ``begin_forward(seq_ids, append_lengths, parent_ptr)``, its pages reserved
        (``importing``: a sequence that cannot join)."""
        step = None
        if parent_ptr is None:  # the same decode batch again: update the last step
            step = self.decode.next_step(self._paging, seq_ids, append_lengths)
            if step is None and not self._slides and importing is None:  # a new batch of single-block sequences
                step = self.decode.fresh(self._paging, seq_ids, append_lengths, self._config.prefill_chunk_size)
        if step is None:
            seq_ids, append_lengths = self._check_batch(seq_ids, append_lengths, importing)
            trees = self._check_trees(seq_ids, append_lengths, parent_ptr)
            step, last_depths = md.plan_step(self._paging, seq_ids, append_lengths, trees,
                                             sliding_window=self._slides, layer_span=self._span,
                                             grow_pages=self._grow_pages)
            self.decode.start(self._paging, step, last_depths)
        return step

    def is_repeated_decode(self, step: md.StepMetadata) -> bool:
        """Whether the decode planner keeps ``step`` (its next steps may be derived from it)."""
        return self.decode.current is step

    def _check_batch(self, seq_ids: Any, append_lengths: Any, importing: Optional[int]):
        most, why = max(self._paging.num_sequences, 1), "the number of sequences in the cache"
        # a ShapeTuple (what vm.builtin passes) holds ints only
        seq_ids = (list(seq_ids) if isinstance(seq_ids, ShapeTuple)
                   else as_int_list("seq_ids", seq_ids, max_len=most, why=why))
        append_lengths = (list(append_lengths) if isinstance(append_lengths, ShapeTuple)
                          else as_int_list("append_lengths", append_lengths, max_len=most, why=why))
        if len(seq_ids) != len(append_lengths):
            raise ForwardError(f"seq_ids has {len(seq_ids)} entries but append_lengths has "
                               f"{len(append_lengths)}; expected equal lengths")
        if not seq_ids:
            raise ForwardError("begin_forward needs at least one sequence, got an empty batch")
        if importing is not None and importing in seq_ids:
            raise ForwardError(f"sequence {importing} is importing a checkpoint; finish_import it (or "
                               "remove it) before it joins a step")
        for seq_id, n in zip(seq_ids, append_lengths):
            if n < 1:
                raise ForwardError(f"append length {n} of sequence {seq_id} must be at least 1")
        window = self._window_limit
        if window and max(append_lengths) > window:
            raise ForwardError(
                f"a sequence appends {max(append_lengths)} tokens in one step, more than the MHA_SLIDING layers' "
                f"window ({window}), and this cache has no windowed ragged kernel (TVM's creation arguments lack "
                "it): the new tokens would not be windowed among themselves; append at most the window per "
                "step, or pass the kernel (29th creation argument, as relax_kvcache.frontend does)")
        total = sum(append_lengths)
        if total > self._config.prefill_chunk_size:
            raise ForwardError(f"the step appends {total} tokens, more than prefill_chunk_size="
                               f"{self._config.prefill_chunk_size}")
        return seq_ids, append_lengths

    def _check_trees(self, seq_ids: List[int], append_lengths: List[int],
                     parent_ptr: Optional[Sequence[int]]) -> Optional[List[TokenTree]]:
        """Each sequence's token tree after the step (or None); parent pointers index the
        uncommitted nodes of earlier steps, then this step's."""
        paging = self._paging
        if parent_ptr is None:
            for seq_id in seq_ids:
                if not paging.sequence(seq_id).accepted_indices_committed:
                    raise SequenceError(
                        f"sequence {seq_id} has uncommitted token-tree nodes: call commit_accepted_token_tree_nodes "
                        "before a step without a token tree")
            return None
        refusal = self._tree_refusal()
        if refusal is not None:
            raise refusal
        parents = as_int_list("token_tree_parent_ptr", parent_ptr, max_len=sum(append_lengths),
                              why="the sum of append_lengths", error=ForwardError)
        if len(parents) != sum(append_lengths):
            raise ForwardError(f"token_tree_parent_ptr has {len(parents)} entries, expected the sum of "
                               f"append_lengths ({sum(append_lengths)})")
        trees, offset = [], 0
        for seq_id, n in zip(seq_ids, append_lengths):
            previous = paging.sequence(seq_id).token_tree
            earlier = previous.parents if previous is not None else ()
            trees.append(TokenTree.build(earlier + tuple(parents[offset:offset + n]), seq_id=seq_id))
            offset += n
        return trees
