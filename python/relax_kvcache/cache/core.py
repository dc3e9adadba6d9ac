"""``PagedAttentionKVCache``: sequences, pages and the forward protocol over our TIR kernels;
planning, device placement, kernel launches, checkpoints and debug reads are components."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Optional, Sequence, Tuple

import tvm

from ..args import FLOAT32_MAX, as_float, as_int, as_int32, as_int_list, describe
from ..cache_args import check_cache_args
from ..build import build_kernels
from ..checkpoint import CheckpointIO
from ..config import KVCacheConfig
from ..errors import ArgumentError, ForwardError, KVCacheError, SequenceError
from ..kernel_probe import ProbeCache, check_kernels
from ..kernel_set import KernelSet
from ..paging import PageCopy, PagingState
from ..runtime import default_target
from ..tensors import DATA_ALIGNMENT, TENSOR_TYPES, allocate, check_disjoint, check_tensor
from . import commit, prefix
from .attention import Attention, MHAAttention
from .debug import DebugReader
from .host_pages import HostPages
from .kv_scales import KVScales
from .mla import MLAAttention
from .planner import StepPlanner, unwindowed_chunk_limit
from .step import Scratch, Step, StepUploader
from .stored_kv import StoredKVMethods
from .tensor_checks import TensorChecks


class PagedAttentionKVCache(StoredKVMethods):
    """A paged KV cache with prefix sharing, for TVM Relax LLM inference.

    Parameters
    ----------
    config : KVCacheConfig
        Shapes and policy of the cache.
    device : tvm.runtime.Device, optional
        Where pages live and kernels run (default ``tvm.cpu()``).
    target : tvm.target.Target, optional
        Compilation target of the kernels (default: the device's, see
        :func:`relax_kvcache.runtime.default_target`).
    kernels : KernelSet, optional
        Use these kernels instead of building ours (e.g. TVM's, through
        ``relax_kvcache.paged_attention_kv_cache_create``).
    progress : callable, optional
        Receives one-line messages while kernels are built or loaded.

    Notes
    -----
    Protocol per step: ``begin_forward(seq_ids, append_lengths)``, then per layer one of
    ``attention_with_fused_qkv`` (or ``self_attention`` / ``cross_attention`` /
    ``merge_attn_output_inplace``), then ``end_forward()``. Sequence structure (remove, fork,
    popn) may only change between steps.

    The cache holds device memory (its pages) and the step in progress: it is not picklable and
    must not be copied (``copy.copy`` would share the pages but not the step state). Use one
    cache per model; ``fork_sequence`` shares a sequence's KV.
    """

    def __init__(self, config: KVCacheConfig, device: Optional[tvm.runtime.Device] = None, *,
                 target: Optional[tvm.target.Target] = None, kernels: Optional[KernelSet] = None,
                 progress=None, layer_offset: int = 0) -> None:
        if not isinstance(config, KVCacheConfig):
            raise ArgumentError(f"config must be a KVCacheConfig, got {describe(config)} of type {type(config).__name__}")
        device = tvm.cpu() if device is None else device
        layer_offset = check_cache_args(device, kernels, layer_offset, target)
        if kernels is None:
            target = default_target(device) if target is None else target
            kernels = KernelSet.from_module(build_kernels(config, target, progress=progress))
        dims_given = config.mla_original_qk_head_dim is not None
        config = check_kernels(config, kernels, device,
                               lambda cfg, ks: type(self)._unchecked(cfg, device, ks)._probe_view())
        self._setup(config, device, kernels, layer_offset, lazy_workspace=not dims_given)

    @classmethod
    def _unchecked(cls, config: KVCacheConfig, device: tvm.runtime.Device,
                   kernels: KernelSet) -> "PagedAttentionKVCache":
        """A cache on unchecked ``kernels`` (the kernel probe's own; no host tier)."""
        cache = cls.__new__(cls)
        cache._setup(dataclasses.replace(config, host_cache_pages=0), device, kernels, 0, lazy_workspace=False)
        return cache

    def _setup(self, config: KVCacheConfig, device: tvm.runtime.Device, kernels: KernelSet, layer_offset: int, *,
               lazy_workspace: bool) -> None:
        self.config, self.device, self.layer_offset = config, device, layer_offset
        self._kernels = kernels
        self._paging = PagingState(config.num_total_pages, config.page_size, slide_windows=config.slides_sequences,
                                   prefix_caching=config.prefix_caching, host_pages=config.host_cache_pages)
        page_shape = ((config.num_total_pages, config.page_size, config.head_dim) if config.is_mla else
                      (config.num_total_pages, 2, config.num_kv_heads, config.page_size, config.head_dim))
        self._pages = [allocate(page_shape, config.page_dtype, device, "page tensor") for _ in range(config.num_layers)]
        self._host = HostPages(self._pages, config.host_cache_pages, device) if config.host_cache_pages else None
        self._kv_scales = KVScales(config, device)
        self._scratch = Scratch.allocate(config, device)
        self._attention: Attention = (
            MLAAttention(config, kernels, self._pages, self._paging, device, self._callback, self._kv_scales.args,
                         lazy_workspace=lazy_workspace) if config.is_mla
            else MHAAttention(config, kernels, self._pages, device, self._kv_scales.args))
        self._planner = StepPlanner(config, kernels, self._paging, self._attention.tree_refusal)
        self._uploader = StepUploader(config, device, self._scratch)
        self._step: Optional[Step] = None
        self._step_tokens: Optional[list] = None  # prefix caching: the step's token ids, if given
        self._tensor_checks = TensorChecks(config.dtype, device)
        self._fused_qkv_check = kernels.check_fused_qkv
        self._qkv_heads = (config.num_qo_heads, config.num_kv_heads, config.head_dim)
        self._busy: Optional[str] = None  # the callback of ours running now, if any
        self._checkpoints = CheckpointIO(config, layer_offset, kernels, device, self._paging, self._pages,
                                         self._require_no_step, self._kv_scales)
        self._debug = DebugReader(config, kernels, device, self._paging, self._pages,
                                  self._checkpoints.check_not_importing, self._kv_scales.args)

    def _probe_view(self) -> ProbeCache:
        """This cache as the kernel probe reads it."""
        return ProbeCache(cache=self, kernels=self._kernels, pages=self._pages,
                          position_map=self._paging.position_map, scratch_q=self._scratch.q,
                          partial_scratch=(self._scratch.o, self._scratch.lse, self._scratch.merged_lse),
                          takes_token_trees=self._attention.tree_refusal() is None,
                          max_append=unwindowed_chunk_limit(self.config, self._kernels))

    # ------------------------------------------------------------------ sequences

    def add_sequence(self, seq_id: int, token_ids: Optional[Sequence[int]] = None, salt: Any = None) -> int:
        """Add sequence ``seq_id`` (must be new). Allowed during a step, as in TVM (the
        sequence joins later steps), but not from a callback of ours.

        Parameters
        ----------
        seq_id : int
            The new sequence's id.
        token_ids : sequence of int, optional
            Prefix caching (``KVCacheConfig.prefix_caching``): the prompt's token ids. The
            sequence starts with the cached pages of its longest cached prefix of whole pages,
            at most ``len(token_ids) - 1`` tokens (the last token is always computed); append
            the rest (with their ids, see :meth:`begin_forward`). Ignored without prefix caching.
        salt : str, bytes or int, optional
            Prefix caching: sequences see only pages cached by sequences of the same salt
            (tenant isolation, vLLM's ``cache_salt``).

        Returns
        -------
        int
            The tokens the sequence starts with (0 without prefix caching or ``token_ids``).
        """
        seq_id = as_int("seq_id", seq_id)
        self._check_not_busy("add_sequence")
        if token_ids is not None and self._paging.prefix_caching:
            token_ids = as_int_list("token_ids", token_ids, error=ArgumentError)
        hit = self._paging.add_sequence(seq_id, token_ids, salt)
        self._sync_host()
        return hit

    def remove_sequence(self, seq_id: int) -> None:
        """Remove a sequence, freeing the pages no other sequence shares."""
        seq_id = as_int("seq_id", seq_id)
        self._require_no_step("remove_sequence")
        self._paging.remove_sequence(seq_id)
        self._checkpoints.abandon(seq_id)  # removing the sequence abandons its checkpoint import

    def fork_sequence(self, parent_seq_id: int, child_seq_id: int, fork_pos: int = -1) -> None:
        """Create ``child_seq_id`` sharing the first ``fork_pos`` tokens of the parent (-1: all)."""
        parent, child, pos = (as_int("parent_seq_id", parent_seq_id), as_int("child_seq_id", child_seq_id),
                              as_int("fork_pos", fork_pos))
        self._require_no_step("fork_sequence")
        self._checkpoints.check_not_importing(parent, "fork_sequence")
        self._copy_pages(self._paging.fork_sequence(parent, child, pos))

    def popn(self, seq_id: int, n: int) -> None:
        """Drop the last ``n`` tokens of a sequence."""
        seq_id, n = as_int("seq_id", seq_id), as_int("n", n)
        self._require_no_step("popn")
        self._checkpoints.check_not_importing(seq_id, "popn")
        tree = self._paging.sequence(seq_id).token_tree if self._paging.has_sequence(seq_id) else None
        if tree is not None and n:
            raise SequenceError(f"popn({seq_id}, {n}): sequence {seq_id} has {len(tree)} uncommitted token-tree "
                                "nodes; commit them first (commit_accepted_token_tree_nodes, leaf -1 drops them)")
        self._copy_pages(self._paging.popn(seq_id, n))

    def enable_sliding_window_for_seq(self, seq_id: int, sliding_window_size: int, attn_sink_size: int) -> None:
        """Keep only the first ``attn_sink_size`` and the last tokens of a sequence, up to
        ``sliding_window_size`` in all; pages that slide out return to the pool.

        Tokens in the sequence's earlier blocks (its whole pages shared through a fork, until
        ``popn`` reaches into them) cannot slide and count as sink, as in TVM: the tokens kept
        at the start are ``max(attn_sink_size, prefix)``, also after ``popn``; a window smaller
        than that prefix is refused. Within a step the queries attend to the tokens kept before
        it and, causally, the step's own tokens, also beyond the window (as TVM does). A window
        enabled on a longer sequence frees pages at its next append.

        Needs a cache created with ``support_sliding_window`` (or with ``MHA_SLIDING`` or
        ``MHA_CHUNKED_LOCAL`` layers, where, as in TVM, the sequence is marked but does not
        slide). RoPE positions are those of the kept tokens (StreamingLLM style), as in TVM.
        """
        seq_id, size = as_int("seq_id", seq_id), as_int32("sliding_window_size", sliding_window_size)
        sink = as_int32("attn_sink_size", attn_sink_size)
        self._require_no_step("enable_sliding_window_for_seq")
        self._checkpoints.check_not_importing(seq_id, "enable_sliding_window_for_seq")
        if not (self.config.support_sliding_window or self.config.has_layer_windows):
            raise KVCacheError("enable_sliding_window_for_seq needs a cache created with support_sliding_window=True")
        self._paging.enable_sliding_window(seq_id, size, sink)

    def commit_accepted_token_tree_nodes(self, seq_ids: Sequence[int], leaf_indices: Sequence[int]) -> None:
        """Keep, for each sequence, the token-tree path from the root to its accepted leaf.

        Node indices are those of the sequence's uncommitted tree: the nodes of every tree step
        since the last commit, in the order they were appended (``begin_forward``'s parent
        pointers use the same numbering). The path's K/V move to consecutive positions right
        after the committed prefix (``compact_copy``) and the other nodes are dropped (``popn``
        semantics, their pages freed); ``leaf_indices[i] == -1`` accepts nothing. For a tree
        appended in one step this is TVM's behaviour; for a tree grown over several steps TVM
        resolves the indices against the last step's tokens only (and keeps earlier steps'
        rejected nodes), we against the whole tree. On a sequence without an uncommitted tree,
        leaf -1 pops its last step's tokens (TVM's rule for chains).
        """
        most, why = max(self._paging.num_sequences, 1), "the number of sequences in the cache"
        seq_ids = as_int_list("seq_ids", seq_ids, max_len=most, why=why)
        leaves = as_int_list("leaf_indices", leaf_indices, max_len=most, why=why)
        self._require_no_step("commit_accepted_token_tree_nodes")
        if len(seq_ids) != len(leaves):
            raise SequenceError(f"seq_ids has {len(seq_ids)} entries but leaf_indices has {len(leaves)}; "
                                "expected equal lengths")
        if len(set(seq_ids)) != len(seq_ids):
            raise SequenceError(f"seq_ids {seq_ids} name a sequence more than once")
        for seq_id in seq_ids:
            self._checkpoints.check_not_importing(seq_id, "commit_accepted_token_tree_nodes")
        plans = [commit.plan_commit(self._paging, seq_id, leaf) for seq_id, leaf in zip(seq_ids, leaves)]
        # check-then-mutate: every pop (a re-fork into a shared prefix may need a page) before
        # compacting or popping any sequence
        self._paging.check_pops([(plan.seq_id, plan.pop) for plan in plans if plan.pop])
        if any(plan.moves for plan in plans):
            if self._kernels.compact_copy is None:
                raise KVCacheError("committing a token tree needs the compact_copy kernel, which this cache "
                                   "was created without")
            commit.compact(self._paging, self._kernels, self._pages, self.device, plans)
        for plan in plans:
            self._copy_pages(self._paging.popn(plan.seq_id, plan.pop))  # a re-fork copies its partial page
            self._paging.clear_token_tree(plan.seq_id)

    def clear(self) -> None:
        """Remove every sequence and end any active step."""
        self._check_not_busy("clear")
        self._paging.clear()
        self._step = None
        self._step_tokens = None
        self._tensor_checks.forget()
        self._checkpoints.importing = None

    def empty(self) -> bool:
        """True when no sequence exists and every page and block is free."""
        return self._paging.empty()

    def get_num_available_pages(self) -> int:
        """Number of pages new tokens can take: free ones and, with prefix caching, cached
        pages no sequence holds (evicted when needed)."""
        return self._paging.num_free_pages

    def prefix_cache_stats(self) -> dict:
        """Prefix caching's counters (``KVCacheConfig.prefix_caching``): ``lookups``
        (``add_sequence`` calls with token ids), ``lookup_tokens`` (their tokens but the last),
        ``hit_tokens`` (found cached), ``hit_rate`` (their ratio), ``registered_pages`` (pages
        ever registered), ``cached_pages`` (registered now), ``evictable_pages`` (cached
        pages no sequence holds) and ``evicted_pages``; the host tier's ``host_pages`` (held
        there now), ``spilled_pages`` (evicted pages copied there), ``loaded_pages`` (copied
        back on a hit) and ``host_dropped_pages`` (dropped for room)."""
        return prefix.stats(self._paging)

    def get_total_sequence_length(self) -> int:
        """Sum of the lengths of all sequences."""
        return self._paging.total_sequence_length()

    def get_sequence_length(self, seq_id: int) -> int:
        """Number of tokens of sequence ``seq_id`` (not while its checkpoint import is unfinished,
        as in TVM)."""
        seq_id = as_int("seq_id", seq_id)
        self._checkpoints.check_not_importing(seq_id, "get_sequence_length")
        return self._paging.sequence_length(seq_id)

    def _sync_host(self) -> None:
        """Queue the host-tier copies the last paging operation asked for (before any kernel
        touches those pages again)."""
        if self._host is not None:
            self._host.run(self._paging.take_host_moves())

    def _copy_pages(self, copies: Sequence[PageCopy]) -> None:
        self._sync_host()  # the operation that made the copies may have evicted pages first
        for copy in copies:
            for pages in self._pages:
                self._kernels.copy_single_page(pages, copy.src_page, copy.dst_page, copy.length)

    # ------------------------------------------------------------------ forward protocol

    def begin_forward(self, seq_ids: Sequence[int], append_lengths: Sequence[int],
                      token_tree_parent_ptr: Optional[Sequence[int]] = None,
                      token_ids: Optional[Sequence[int]] = None) -> None:
        """Start a step that appends ``append_lengths[i]`` tokens to ``seq_ids[i]``.

        Reserves pages for the new tokens, plans the step's attention (block depths, decode
        or prefill kernels) and sends its metadata to the device (asynchronously on CUDA, on
        the current stream; a first attention call on another stream waits for it).

        With prefix caching, ``token_ids`` (one per appended token, in batch order) lets the
        pages the step fills be registered when it ends; a sequence appended without ids (or
        in a token-tree step) stops registering. Ignored without prefix caching.
        """
        if self._busy is not None or self._step is not None:
            self._require_no_step("begin_forward")  # raises
        ids = None
        if token_ids is not None and self._paging.prefix_caching:
            ids = prefix.check_step_tokens(seq_ids, append_lengths, token_tree_parent_ptr, token_ids)
        decode = self._planner.decode
        meta = None if token_tree_parent_ptr is not None else decode.repeat(self._paging, seq_ids, append_lengths)
        if meta is None:  # not the same decode batch again (updated in place)
            meta = self._planner.plan(seq_ids, append_lengths, token_tree_parent_ptr, self._checkpoints.importing_id)
        self._step_tokens = ids
        if self._host is not None:  # pages taken may have evicted cached pages to the host tier
            self._sync_host()
        self._step = self._uploader.reuse(meta) or self._uploader.place(
            meta, repeated_decode=self._planner.is_repeated_decode(meta), tokens=decode.plain_tokens(meta),
            window=decode.plain_window(meta))

    def end_forward(self) -> None:
        """End the current step (no-op when none is active)."""
        if self._busy is not None:
            self._check_not_busy("end_forward")  # raises
        step = self._step
        if step is not None and self._paging.prefix_caching:  # an interrupted step registers nothing
            complete = len(step.appended) == self.config.num_layers
            self._paging.record_tokens(step.meta.seq_ids, step.meta.append_lengths,
                                       self._step_tokens if complete else None)
        self._step = None
        self._step_tokens = None
        self._tensor_checks.forget()

    def _active_step(self, what: str) -> Step:
        step = self._step
        if self._busy is not None or step is None:
            self._check_not_busy(what)
            raise ForwardError(f"{what} called without an active step; call begin_forward first")
        step.buffer.wait()
        return step

    def capturable_step(self, any_batch: bool = False) -> Optional[object]:
        """The current step's kernel arguments when a CUDA graph may capture them, else None.

        Decode steps keep their metadata in fixed device slots, a set per batch size and
        page-list structure, so a graph captured on one replays on the next. The returned
        object stands for that set of arguments (compare by identity); it changes when the
        batch (the list of sequence ids) changes or the page lists outgrow their slots
        (sequences removed and added again under the same ids count as the same batch). With
        ``any_batch`` it stands for the slots alone, shared by every batch of their size and
        structure: for callers whose graphed work reads its own inputs from the same tensors
        for all of them (one set per batch size, as SGLang and vLLM do). Also orders the
        current stream after the step's metadata upload, as the first attention call would.
        """
        if type(any_batch) is not bool:
            raise ArgumentError(f"any_batch must be a bool, got {describe(any_batch)}")
        step = self._active_step("capturable_step")
        if not step.fixed_slots:
            return None
        return step.buffer if any_batch else step.device

    def get_query_positions(self) -> tvm.runtime.Tensor:
        """RoPE positions ``int32 (n,)`` of the step's tokens, on the device."""
        return self._active_step("get_query_positions").device.q_rope_position

    # ------------------------------------------------------------------ attention

    def attention_with_fused_qkv(self, layer_id: int, qkv: tvm.runtime.Tensor, o: tvm.runtime.Tensor,
                                 sm_scale: float) -> None:
        """Attention of the step's tokens over their sequences, from fused QKV; appends K/V.

        Parameters
        ----------
        layer_id : int
            Layer index.
        qkv : Tensor, shape (m, num_qo_heads + 2 * num_kv_heads, head_dim), m >= step tokens
            Fused projections; only the first ``n`` (step tokens) rows are read.
        o : Tensor, shape (m, num_qo_heads, head_dim)
            Output; the first ``n`` rows are written.
        sm_scale : float
            Softmax scale (usually ``head_dim ** -0.5``).
        """
        mha = self._attention
        if not isinstance(mha, MHAAttention):
            self._component("attention_with_fused_qkv", MHAAttention)  # raises
        layer = self._local_layer(layer_id)
        step = self._active_step("attention_with_fused_qkv")
        heads, check = self._qkv_heads, self._fused_qkv_check
        if (check is not None and isinstance(qkv, TENSOR_TYPES) and isinstance(o, TENSOR_TYPES)
                and not (qkv.data_ptr() | o.data_ptr()) % DATA_ALIGNMENT):
            try:  # our libraries' check (one host call; it does not check alignment) where rows == n
                check(qkv, o, step.device.q_rope_position)
            except Exception as error:  # noqa: BLE001 - checked again, for the error naming the argument
                qkv, o = self._tensor_checks.fused_qkv(step.total_tokens, qkv, o, heads, error)
        else:
            qkv, o = self._tensor_checks.fused_qkv(step.total_tokens, qkv, o, heads)
        if type(sm_scale) is not float or not -FLOAT32_MAX <= sm_scale <= FLOAT32_MAX:  # fast path of as_float
            sm_scale = as_float("sm_scale", sm_scale)
        if step.meta.reused_pages:
            step.check_not_overwritten(f"attention_with_fused_qkv({layer_id}) a second time", layer, layer_id)
        if self._kv_scales.pending:  # calibrate_kv_scales: this layer's scales from its K / V, before storing
            self._kv_scales.calibrate(layer, step, qkv)
        mha.fused_qkv(step, layer, qkv, o, sm_scale)
        step.appended.add(layer)

    def attention_with_shared_kv(self, source_layer_id: int, q: tvm.runtime.Tensor, k: tvm.runtime.Tensor,
                                 v: tvm.runtime.Tensor, o: tvm.runtime.Tensor, sm_scale: float) -> None:
        """Attention of a layer that reuses the KV another layer wrote (KV-sharing models).

        Attends ``q (n, Hq, D)`` over the cached KV of ``source_layer_id`` plus this step's
        ``k (n, Hkv, D)`` / ``v (n, Hkv, Dv)`` (the source layer's new K/V, not appended again);
        writes ``o (n, Hq, Dv)``. Call it after the source layer's attention of the same step
        (a decode step reads the new token's K/V from the source layer's pages). q and k are
        used as given: RoPE is applied only in INLINE mode.
        """
        mha = self._component("attention_with_shared_kv", MHAAttention)
        cfg = self.config
        layer = self._local_layer(source_layer_id)
        step = self._active_step("attention_with_shared_kv")
        n, hq, hkv, d, dv = step.total_tokens, cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim, cfg.v_head_dim
        inputs = [self._check("q", q, (n, hq, d)), self._check("k", k, (n, hkv, d)),
                  self._check("v", v, (n, hkv, dv))]
        check_disjoint([self._check("o", o, (n, hq, dv))], inputs)
        sm_scale = as_float("sm_scale", sm_scale)
        if layer not in step.appended:
            raise ForwardError(f"attention_with_shared_kv reads layer {source_layer_id}'s KV, which this step has not "
                               "appended yet; call it after that layer's attention_with_fused_qkv")
        if step.meta.reused_pages:
            raise ForwardError(step.reused_pages_message("attention_with_shared_kv", source_layer_id))
        mha.attend(step, layer, q, k, v, o, step.device.merged_lse, sm_scale)

    def self_attention(self, layer_id: int, q: tvm.runtime.Tensor, k: tvm.runtime.Tensor,
                       v: tvm.runtime.Tensor, o: tvm.runtime.Tensor, lse: tvm.runtime.Tensor,
                       sm_scale: float) -> None:
        """Causal attention of the step's tokens over the step's own K/V only (nothing cached).

        ``q (n, Hq, D)``, ``k (n, Hkv, D)``, ``v (n, Hkv, Dv)``, outputs ``o (n, Hq, Dv)`` and
        base-2 ``lse (n, Hq)`` (float32), where n is the number of tokens of the step. MLA
        caches: decompressed q/k/v with one KV head per query head and the
        ``mla_original_*`` head dims (e.g. 192 / 128); no RoPE is applied (as in TVM).
        """
        layer = self._local_layer(layer_id)
        step = self._active_step("self_attention")
        n, hq = step.total_tokens, self.config.num_qo_heads
        hkv, dqk, dv = self._attention.self_attention_dims
        q_arg = self._check("q", q, (n, hq, dqk))
        dqk = q.shape[2]
        inputs = [q_arg, self._check("k", k, (n, hkv, dqk)), self._check("v", v, (n, hkv, dv))]
        outputs = [self._check("o", o, (n, hq, v.shape[2])), self._check("lse", lse, (n, hq), "float32")]
        check_disjoint(outputs, inputs)
        self._attention.ragged(step, layer, q, k, v, o, lse, as_float("sm_scale", sm_scale))

    def cross_attention(self, layer_id: int, q: tvm.runtime.Tensor, o: tvm.runtime.Tensor,
                        lse: tvm.runtime.Tensor, sm_scale: float) -> None:
        """Attention of the step's queries over the cached KV of their sequences.

        ``q (n, Hq, D)``, outputs ``o (n, Hq, Dv)`` and base-2 ``lse (n, Hq)`` (float32).
        Rows with nothing cached get ``o = 0, lse = -inf``. MLA caches: absorbed attention over
        the latent pages, ``q (n, Hq, kv_lora_rank + rope dim)`` (queries multiplied by W_UK),
        ``o (n, Hq, kv_lora_rank)`` (multiply by W_UV after). As for MHA, a decode step's
        pages include its new tokens (append them with :meth:`append_mla_kv` first) and a
        prefill step's do not (merge :meth:`self_attention`'s state).
        """
        cfg = self.config
        layer = self._local_layer(layer_id)
        step = self._active_step("cross_attention")
        n, hq = step.total_tokens, cfg.num_qo_heads
        q_arg = self._check("q", q, (n, hq, cfg.head_dim))
        outputs = [self._check("o", o, (n, hq, cfg.v_head_dim)), self._check("lse", lse, (n, hq), "float32")]
        check_disjoint(outputs, [q_arg])
        sm_scale = as_float("sm_scale", sm_scale)
        step.check_not_overwritten(f"cross_attention({layer_id})", layer, layer_id)
        self._attention.paged(step, layer, q, o, lse, sm_scale, first=True, write_empty=True)

    def merge_attn_output_inplace(self, o_self_attn: tvm.runtime.Tensor, lse_self_attn: tvm.runtime.Tensor,
                                  o_cross_attn: tvm.runtime.Tensor, lse_cross_attn: tvm.runtime.Tensor
                                  ) -> Tuple[tvm.runtime.Tensor, tvm.runtime.Tensor]:
        """Merge two attention states into ``(o_self_attn, lse_self_attn)``; returns them.

        ``o (n, Hq, Dv)``, ``lse (n, Hq)``; MLA caches: ``Dv`` is the decompressed v head dim
        (TVM's second merge function).
        """
        v_dim = self._attention.self_attention_dims[2]
        outputs = [self._check("o_self_attn", o_self_attn, (None, self.config.num_qo_heads, v_dim))]
        shape = tuple(o_self_attn.shape)
        outputs.append(self._check("lse_self_attn", lse_self_attn, shape[:2], "float32"))
        inputs = [self._check("o_cross_attn", o_cross_attn, shape),
                  self._check("lse_cross_attn", lse_cross_attn, shape[:2], "float32")]
        if o_self_attn.data_ptr() == o_cross_attn.data_ptr() and lse_self_attn.data_ptr() == lse_cross_attn.data_ptr():
            inputs = []  # a state merged with itself: elementwise
        check_disjoint(outputs, inputs)
        self._kernels.merge_general(o_self_attn, lse_self_attn, o_cross_attn, lse_cross_attn)
        return o_self_attn, lse_self_attn

    # ------------------------------------------------------------------ MLA

    def append_mla_kv(self, layer_id: int, kv: tvm.runtime.Tensor) -> None:
        """Write the step's latent vectors of an MLA layer into its pages.

        Parameters
        ----------
        layer_id : int
            Layer index.
        kv : Tensor, shape (m, kv_lora_rank + rope dim), m >= step tokens
            ``[compressed kv, RoPE'd k_pe]`` per token; the first ``n`` (step tokens) rows are
            written.
        """
        mla = self._component("append_mla_kv", MLAAttention)
        layer = self._local_layer(layer_id)
        step = self._active_step("append_mla_kv")
        kv = mla.checked_kv(step, kv)
        if self._kv_scales.pending:  # calibrate_kv_scales: this layer's scale from its latent rows, before storing
            self._kv_scales.calibrate_latent(layer, step, kv)
        mla.append_kv(step, layer, kv)
        step.appended.add(layer)

    def mla_context_attention(self, layer_id: int, q: tvm.runtime.Tensor, o: tvm.runtime.Tensor,
                              lse: tvm.runtime.Tensor, sm_scale: float, decompress: Any) -> None:
        """Compute-friendly attention of the step's queries over their cached context, in chunks.

        The cached tokens of the step's sequences (those before this step) are walked in chunks
        of at most ``config.context_workspace_rows`` rows (``context_chunk_size``, capped at the
        rows the pages hold): each chunk's latent rows are gathered, decompressed by
        ``decompress`` into per-head K/V and attended with the ragged kernel; the chunks' states
        are merged by log-sum-exp. Memory is that of one chunk, whatever the context length.
        Merge the result with :meth:`self_attention`'s by :meth:`merge_attn_output_inplace`.

        Parameters
        ----------
        layer_id : int
            MLA layer index.
        q : Tensor, shape (n, Hq, Dqk)
            Decompressed queries (``[q_nope, q_pe]``, e.g. 128 + 64).
        o : Tensor, shape (n, Hq, Dv)
            Output; rows of sequences without context get 0.
        lse : Tensor, float32, shape (n, Hq)
            Base-2 log-sum-exp output; ``-inf`` where there is no context.
        sm_scale : float
            Softmax scale (``Dqk ** -0.5`` times any mscale).
        decompress : callable
            ``decompress(latent (c, W), k (c, Hq, Dqk), v (c, Hq, Dv))`` writes ``k = [latent[:, :L]
            @ W_UK, latent[:, L:]]`` and ``v = latent[:, :L] @ W_UV`` (any packed function or
            Python callable) in place (the cache does not check that it did);
            ``c <= context_workspace_rows``.
        """
        mla = self._component("mla_context_attention", MLAAttention)
        layer = self._local_layer(layer_id)
        step = self._active_step("mla_context_attention")
        mla.context_attention(step, layer, q, o, lse, as_float("sm_scale", sm_scale), decompress)

    # ------------------------------------------------------------------ guards

    def _component(self, what: str, kind: type) -> Any:
        """The attention component when it is of ``kind``, else refuse ``what``."""
        if not isinstance(self._attention, kind):
            need = kind.kind
            raise KVCacheError(f"{what} needs {need} layers, but this cache's layers are {self._attention.kind}")
        return self._attention

    def _check(self, name: str, value: Any, shape: Sequence[Optional[int]], dtype: Optional[str] = None
               ) -> Tuple[str, Any]:
        """Check a tensor argument on the cache's device; its ``(name, tensor)``."""
        check_tensor(name, value, shape=shape, dtype=dtype or self.config.dtype, device=self.device)
        return name, value

    def _local_layer(self, layer_id: int) -> int:
        layer = (layer_id if type(layer_id) is int else as_int("layer_id", layer_id)) - self.layer_offset
        if not 0 <= layer < self.config.num_layers:
            raise ForwardError(f"layer_id {layer_id} is out of range [{self.layer_offset}, "
                               f"{self.layer_offset + self.config.num_layers})")
        return layer

    @contextlib.contextmanager
    def _callback(self, what: str) -> Iterator[None]:
        """Mark a callback of ours as running: the cache refuses calls meanwhile."""
        self._busy = what
        try:
            yield
        finally:
            self._busy = None

    def _check_not_busy(self, what: str) -> None:
        if self._busy is not None:
            raise ForwardError(f"{what} called from inside {self._busy}; the cache can be used again "
                               "once the callback returns")

    def _require_no_step(self, what: str) -> None:
        self._check_not_busy(what)
        if self._step is not None:
            raise ForwardError(f"{what} is not allowed while a forward step is active; call end_forward first")

    def __repr__(self) -> str:
        cfg = self.config
        return (f"PagedAttentionKVCache(layers={cfg.num_layers}, heads={cfg.num_qo_heads}/{cfg.num_kv_heads}, "
                f"head_dim={cfg.head_dim}, dtype={cfg.dtype}, pages={self.get_num_available_pages()}/"
                f"{cfg.num_total_pages} free, device={self.device})")
