"""``PagedAttentionKVCache``: sequences, pages and the forward protocol over our TIR kernels.

The cache owns one page tensor per layer, the paging state (:mod:`.paging`) and the current
step's metadata (:mod:`.metadata`). ``begin_forward`` plans a step once on the host;
attention calls then only launch kernels (split/RoPE, append, ragged and paged attention,
merge) with the step's prebuilt device views. Every public method validates its arguments
before changing anything, so an exception leaves the cache as it was.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import tvm

from . import checkpoint as ckpt
from . import metadata as md
from .args import as_float as _as_float, as_int as _as_int, as_int32, as_int_list as _as_int_list, describe
from .aux_buffer import AuxBuffer, SlotBuffer
from .build import build_kernels, kernel_identity
from .cache_args import check_cache_args
from .config import _DTYPE_BYTES, LOCAL_KINDS, KVCacheConfig, RopeMode
from .decode_plan import DecodePlanner
from .errors import ArgumentError, ConfigError, ForwardError, KVCacheError, SequenceError
from .kernel_probe import decompressed_head_dims, probe_foreign_attention, probe_foreign_kernels
from .kernel_set import KernelSet, split_rotary_rope_argument
from .mla_context import ContextPlan, ContextWorkspace
from .paging import PageCopy, PagingState
from .runtime import default_target
from .tensors import TENSOR_TYPES, allocate, check_disjoint, check_tensor, view
from .token_tree import TokenTree


#: Page ids per sequence that fixed decode slots leave free for the page lists to grow into.
_DECODE_PAGE_HEADROOM = 32


@dataclasses.dataclass(frozen=True)
class _PageViews:
    """Device views of a set of page lists (see :class:`metadata.DepthMetadata`)."""

    page_indptr: tvm.runtime.Tensor
    page_indices: tvm.runtime.Tensor
    length_info: tvm.runtime.Tensor
    k_rope_pos_offset: tvm.runtime.Tensor
    has_pages: bool


@dataclasses.dataclass(frozen=True)
class _TreeViews:
    """Device views of token-tree masks (see :class:`metadata.TreeMask`)."""

    mn_indptr: tvm.runtime.Tensor
    mask: tvm.runtime.Tensor


@dataclasses.dataclass(frozen=True)
class _DepthViews:
    """Device views of one depth: all its pages, what local layers read, tree masks."""

    qo_indptr: tvm.runtime.Tensor
    use_decode_kernel: bool
    pages: _PageViews
    window: Optional[_PageViews]
    tree: Optional[_TreeViews]


@dataclasses.dataclass(frozen=True)
class _DeviceStep:
    """Device views a step's kernels read, created once per step (first attention call)."""

    append_indptr: tvm.runtime.Tensor
    k_ragged_rope_pos_offset: tvm.runtime.Tensor
    q_rope_position: tvm.runtime.Tensor
    append_position: tvm.runtime.Tensor
    depths: Tuple[_DepthViews, ...]
    ragged_tree: Optional[_TreeViews]
    q: Optional[tvm.runtime.Tensor]  # (n, Hq, D) scratch: split/RoPE output (None for MLA)
    k: Optional[tvm.runtime.Tensor]  # (n, Hkv, D)
    v: Optional[tvm.runtime.Tensor]  # (n, Hkv, D)
    tmp_o: tvm.runtime.Tensor  # (n, Hq, Dv) per-depth partial output
    tmp_lse: tvm.runtime.Tensor  # (n, Hq)
    merged_lse: tvm.runtime.Tensor  # (n, Hq) lse of attention_with_fused_qkv's output

    def depths_with_pages(self, windowed: bool) -> Tuple[Tuple[_DepthViews, _PageViews], ...]:
        """(depth, the page views a layer reads) for the depths where it reads any page."""
        views = ((d, d.window if windowed else d.pages) for d in self.depths)
        return tuple((d, p) for d, p in views if p.has_pages)


def _check_kernels_match(config: KVCacheConfig, built_for: Tuple[Tuple[str, float], ...]) -> None:
    """Refuse kernels built for another configuration (they would read pages of another shape)."""
    expected = kernel_identity(config)
    differ = [f"{name} {value!r} (kernels) vs {expected[name]!r} (config)" for name, value in built_for
              if value != expected[name]]
    if differ:
        raise ConfigError("the kernels were built for another configuration: " + "; ".join(differ)
                          + " (dtype as its index in ('float32', 'float16', 'bfloat16')); build them for this "
                          "config with relax_kvcache.build_kernels(config, target)")


def _check_required_kernels(config: KVCacheConfig, kernels: KernelSet) -> None:
    """Refuse a kernel set without a kernel every step of this config calls (e.g. TVM's creation
    arguments with None), before any step could append K/V and then fail."""
    if config.is_mla:
        roles = ["transpose_append_mla", "attention_prefill_mla", "attention_prefill_ragged"]
    else:
        roles = ["transpose_append", "split_rotary", "attention_prefill_ragged", "attention_prefill",
                 "attention_decode"]
        if config.slides_sequences or config.has_layer_windows:
            roles += ["attention_prefill_sliding_window", "attention_decode_sliding_window"]
        if config.layer_span.chunk:  # the plain ragged kernel cannot split a step at chunk boundaries
            roles += ["attention_prefill_ragged_sliding_window"]
    roles += ["copy_single_page", "merge_inplace", "merge_general"]
    missing = kernels.missing(roles)
    if missing:
        raise ConfigError(f"the kernel set has no {', '.join(missing)} kernel(s), which a cache with this config "
                          "calls in every step; pass them (or let the cache build its own; TVM has no kernels for "
                          "MHA_CHUNKED_LOCAL layers)")


def _with_kernel_head_dims(config: KVCacheConfig, kernels: KernelSet, device: tvm.runtime.Device) -> KVCacheConfig:
    """An MLA config without decompressed head dims, given the dims its foreign kernels accept."""
    qk, v = decompressed_head_dims(config, kernels, device)
    try:
        return dataclasses.replace(config, mla_original_qk_head_dim=qk, mla_original_v_head_dim=v)
    except ConfigError as err:
        raise ConfigError(f"the kernels' decompressed head dims (q / k {qk}, v {v}, the dims the ragged kernel "
                          f"and merge_general accept) do not fit this config: {err}") from None


@dataclasses.dataclass(frozen=True)
class _ImportState:
    """A checkpoint import in progress: the sequence, its positions' slots, groups still due."""

    seq_id: int
    slots: np.ndarray  # (seq_length,) int32
    pending: frozenset


@dataclasses.dataclass(frozen=True)
class _CommitPlan:
    """One sequence's commit: ``moves`` are (source, destination) indices among its last
    ``span`` tokens (its uncommitted tree, or its last step without one); ``pop`` tokens go."""

    seq_id: int
    span: int
    moves: Tuple[Tuple[int, int], ...]
    pop: int


class PagedAttentionKVCache:
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
        elif kernels.identity is not None:
            _check_kernels_match(config, kernels.identity)
        _check_required_kernels(config, kernels)
        dims_given = config.mla_original_qk_head_dim is not None
        if config.is_mla and not dims_given and kernels.identity is None:
            config = _with_kernel_head_dims(config, kernels, device)
        self.config = config
        self.device = device
        self.layer_offset = layer_offset
        self._kernels = kernels
        self._mla = config.is_mla
        self._paging = PagingState(config.num_total_pages, config.page_size,
                                   slide_windows=config.slides_sequences)
        page_shape = ((config.num_total_pages, config.page_size, config.head_dim) if self._mla else
                      (config.num_total_pages, 2, config.num_kv_heads, config.page_size, config.head_dim))
        self._pages = [allocate(page_shape, config.dtype, device, "page tensor") for _ in range(config.num_layers)]
        if kernels.identity is None:
            probe_foreign_kernels(config, kernels, self._pages[0], device)
        chunk, hq, hkv = config.prefill_chunk_size, config.num_qo_heads, config.num_kv_heads
        if not self._mla:  # MLA layers take q/k/v from the model: no split scratch
            self._scratch_q = allocate((chunk, hq, config.head_dim), config.dtype, device, "q scratch")
            self._scratch_k = allocate((chunk, hkv, config.head_dim), config.dtype, device, "k scratch")
            self._scratch_v = allocate((chunk, hkv, config.v_head_dim), config.dtype, device, "v scratch")
        self._scratch_o = allocate((chunk, hq, config.v_head_dim), config.dtype, device, "o scratch")
        self._scratch_lse = allocate((chunk, hq), "float32", device, "lse scratch")
        self._scratch_merged_lse = allocate((chunk, hq), "float32", device, "lse scratch")
        self._dtype, self._float32 = self._scratch_o.dtype, self._scratch_lse.dtype
        self._itemsize = _DTYPE_BYTES[config.dtype]
        self._aux = AuxBuffer(device, 4 * (config.max_num_seqs + 1) * (md.MAX_BLOCK_DEPTH + 2)
                              + md.MAX_BLOCK_DEPTH * config.num_total_pages + 2 * chunk)
        rope = config.effective_rope_mode
        self._rotary_mode = int(rope == RopeMode.INLINE and not self._mla)  # MLA: the model applies RoPE
        self._split_rope_argument = None if self._mla else split_rotary_rope_argument(config, device)
        self._windowed_layers = tuple(kind in LOCAL_KINDS for kind in config.attn_kinds)
        # prefill steps of one page list per sequence take attention_prefill_prefixed when the
        # set has it (the creation probe turns it off to probe the three-kernel path too)
        self._prefixed_enabled = True
        self._step: Optional[md.StepMetadata] = None
        self._device_step: Optional[_DeviceStep] = None
        self._decode_planner = DecodePlanner(config.page_size, config.layer_span)
        # repeated decode steps' fixed slots: (depths' has_pages, slots, the step's views, batch)
        self._decode_slots: Optional[Tuple[Tuple[bool, ...], SlotBuffer, _DeviceStep, Tuple[int, ...]]] = None
        self._uploader: Any = self._aux  # what the step's metadata was uploaded through
        self._context: Optional[ContextPlan] = None  # the step's chunked MLA context, planned on first use
        self._context_workspace: Optional[ContextWorkspace] = None
        if self._mla and dims_given:  # read off foreign kernels: made on first use (TVM's models never use it)
            self._context_workspace = self._new_context_workspace(config.mla_original_qk_head_dim,
                                                                  config.mla_original_v_head_dim)
        self._import: Optional[_ImportState] = None  # a checkpoint import in progress
        self._group_mover = ckpt.PageGroupMover(config, kernels, device)
        self._busy: Optional[str] = None  # the callback of ours running now, if any
        self._appended_layers: set = set()  # layers whose K/V this step has appended
        # most tokens a sequence may append per step: MHA_SLIDING layers without the windowed
        # ragged kernel are exact only while the new tokens fit in the window (0: no limit)
        # (MHA_CHUNKED_LOCAL layers require that kernel: see _check_required_kernels)
        self._unwindowed_chunk_limit = (config.layer_span.window
                                        if kernels.attention_prefill_ragged_sliding_window is None else 0)
        if kernels.identity is None:
            probe_foreign_attention(self)

    # ------------------------------------------------------------------ sequences

    def add_sequence(self, seq_id: int) -> None:
        """Add an empty sequence ``seq_id`` (must be new). Allowed during a step, as in TVM (the
        sequence joins later steps), but not from a callback of ours."""
        seq_id = _as_int("seq_id", seq_id)
        self._check_not_busy("add_sequence")
        self._paging.add_sequence(seq_id)

    def remove_sequence(self, seq_id: int) -> None:
        """Remove a sequence, freeing the pages no other sequence shares."""
        seq_id = _as_int("seq_id", seq_id)
        self._require_no_step("remove_sequence")
        self._paging.remove_sequence(seq_id)
        if self._import is not None and self._import.seq_id == seq_id:
            self._import = None  # removing the sequence abandons its checkpoint import

    def fork_sequence(self, parent_seq_id: int, child_seq_id: int, fork_pos: int = -1) -> None:
        """Create ``child_seq_id`` sharing the first ``fork_pos`` tokens of the parent (-1: all)."""
        parent, child, pos = (_as_int("parent_seq_id", parent_seq_id), _as_int("child_seq_id", child_seq_id),
                              _as_int("fork_pos", fork_pos))
        self._require_no_step("fork_sequence")
        self._check_not_importing(parent, "fork_sequence")
        self._copy_pages(self._paging.fork_sequence(parent, child, pos))

    def popn(self, seq_id: int, n: int) -> None:
        """Drop the last ``n`` tokens of a sequence."""
        seq_id, n = _as_int("seq_id", seq_id), _as_int("n", n)
        self._require_no_step("popn")
        self._check_not_importing(seq_id, "popn")
        tree = self._paging.sequence(seq_id).token_tree if self._paging.has_sequence(seq_id) else None
        if tree is not None and n:
            raise SequenceError(f"popn({seq_id}, {n}): sequence {seq_id} has {len(tree)} uncommitted token-tree "
                                "nodes; commit them first (commit_accepted_token_tree_nodes, leaf -1 drops them)")
        self._copy_pages(self._paging.popn(seq_id, n))

    def enable_sliding_window_for_seq(self, seq_id: int, sliding_window_size: int, attn_sink_size: int) -> None:
        """Keep only the first ``attn_sink_size`` and the last tokens of a sequence, up to
        ``sliding_window_size`` in all; pages that slide out return to the pool.

        Tokens in the sequence's earlier blocks (a prefix shared through a fork) cannot slide
        and count as sink, as in TVM: the tokens kept at the start are
        ``max(attn_sink_size, prefix)``; a window smaller than that prefix is refused. A
        forked sequence's prefix is its whole shared pages (a partial page is copied into its
        own block). Blocks are not merged back when the fork that split them is removed (as
        in TVM): the prefix stays what forks made it until ``popn`` reaches into it. The window
        stays through ``popn`` (also into a shared prefix), and the sink follows the prefix
        there: ``max(attn_sink_size, new prefix)``.

        The window bounds what is kept after each step; within a step, the queries attend to
        the tokens kept before it and, causally, the step's own tokens, also when the step
        appends more tokens than the window (as TVM does). Enabling a window on a sequence
        longer than it frees pages at its next append.

        Needs a cache created with ``support_sliding_window`` (or with ``MHA_SLIDING`` or
        ``MHA_CHUNKED_LOCAL`` layers, where, as in TVM, the sequence is marked but does not slide). RoPE positions are those
        of the kept tokens in the cache (StreamingLLM style), as in TVM.
        """
        seq_id, size = _as_int("seq_id", seq_id), as_int32("sliding_window_size", sliding_window_size)
        sink = as_int32("attn_sink_size", attn_sink_size)
        self._require_no_step("enable_sliding_window_for_seq")
        self._check_not_importing(seq_id, "enable_sliding_window_for_seq")
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
        seq_ids = _as_int_list("seq_ids", seq_ids, max_len=most, why=why)
        leaves = _as_int_list("leaf_indices", leaf_indices, max_len=most, why=why)
        self._require_no_step("commit_accepted_token_tree_nodes")
        if len(seq_ids) != len(leaves):
            raise SequenceError(f"seq_ids has {len(seq_ids)} entries but leaf_indices has {len(leaves)}; "
                                "expected equal lengths")
        if len(set(seq_ids)) != len(seq_ids):
            raise SequenceError(f"seq_ids {seq_ids} name a sequence more than once")
        for seq_id in seq_ids:
            self._check_not_importing(seq_id, "commit_accepted_token_tree_nodes")
        plans = [self._plan_commit(seq_id, leaf) for seq_id, leaf in zip(seq_ids, leaves)]
        # check-then-mutate: every pop (a re-fork into a shared prefix may need a page) before
        # compacting or popping any sequence
        self._paging.check_pops([(plan.seq_id, plan.pop) for plan in plans if plan.pop])
        if any(plan.moves for plan in plans):
            if self._kernels.compact_copy is None:
                raise KVCacheError("committing a token tree needs the compact_copy kernel, which this cache "
                                   "was created without")
            self._compact(plans)
        for plan in plans:
            self._copy_pages(self._paging.popn(plan.seq_id, plan.pop))  # a re-fork copies its partial page
            self._paging.clear_token_tree(plan.seq_id)

    def _plan_commit(self, seq_id: int, leaf: int) -> "_CommitPlan":
        """The moves and the pop of one sequence's commit, all checked."""
        seq = self._paging.sequence(seq_id)
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
        return _CommitPlan(seq_id=seq_id, span=span, moves=moves, pop=span - len(path))

    def _compact(self, plans: Sequence["_CommitPlan"]) -> None:
        """Move accepted nodes' K/V to their consecutive positions in every layer (compact_copy)."""
        lengths, src_dst = [], [[], []]
        for plan in plans:
            if not plan.moves:
                lengths.append(0)
                continue
            seq = self._paging.sequence(plan.seq_id)
            slots = self._paging.position_map(plan.seq_id, seq.seq_length - plan.span, seq.seq_length)
            for src, dst in plan.moves:
                src_dst[0].append(int(slots[src]))
                src_dst[1].append(int(slots[dst]))
            lengths.append(len(plan.moves))
        indptr = tvm.runtime.tensor(md.indptr(lengths), self.device)
        positions = tvm.runtime.tensor(np.array(src_dst, dtype=np.int32), self.device)
        for pages in self._pages:
            self._kernels.compact_copy(pages, indptr, positions, len(plans))

    def clear(self) -> None:
        """Remove every sequence and end any active step."""
        self._check_not_busy("clear")
        self._paging.clear()
        self._step = None
        self._device_step = None
        self._context = None
        self._import = None

    def empty(self) -> bool:
        """True when no sequence exists and every page and block is free."""
        return self._paging.empty()

    def get_num_available_pages(self) -> int:
        """Number of free pages."""
        return self._paging.num_free_pages

    def get_total_sequence_length(self) -> int:
        """Sum of the lengths of all sequences."""
        return self._paging.total_sequence_length()

    def get_sequence_length(self, seq_id: int) -> int:
        """Number of tokens of sequence ``seq_id`` (not while its checkpoint import is unfinished,
        as in TVM)."""
        seq_id = _as_int("seq_id", seq_id)
        self._check_not_importing(seq_id, "get_sequence_length")
        return self._paging.sequence_length(seq_id)

    def _copy_pages(self, copies: Sequence[PageCopy]) -> None:
        for copy in copies:
            for pages in self._pages:
                self._kernels.copy_single_page(pages, copy.src_page, copy.dst_page, copy.length)

    # ------------------------------------------------------------------ forward protocol

    def begin_forward(self, seq_ids: Sequence[int], append_lengths: Sequence[int],
                      token_tree_parent_ptr: Optional[Sequence[int]] = None) -> None:
        """Start a step that appends ``append_lengths[i]`` tokens to ``seq_ids[i]``.

        Reserves pages for the new tokens and plans the step's attention (block depths, decode
        or prefill kernels); the metadata reaches the device before the first attention call.
        """
        self._check_not_busy("begin_forward")
        if self._step is not None:
            raise ForwardError("begin_forward called while a step is active; call end_forward first")
        step = None
        if token_tree_parent_ptr is None:  # the same decode batch again: update the last step
            step = self._decode_planner.next_step(self._paging, seq_ids, append_lengths)
        if step is None:
            step = self._plan_checked(seq_ids, append_lengths, token_tree_parent_ptr)
        self._step = step
        self._appended_layers.clear()
        # asynchronous devices: issue the metadata copy now, wait for it at the first kernel
        self._device_step = self._upload(self._step) if self._aux.asynchronous else None

    def _plan_checked(self, seq_ids: Any, append_lengths: Any,
                      token_tree_parent_ptr: Optional[Sequence[int]]) -> md.StepMetadata:
        """Validate a step's arguments and plan it in full."""
        most, why = max(self._paging.num_sequences, 1), "the number of sequences in the cache"
        seq_ids = _as_int_list("seq_ids", seq_ids, max_len=most, why=why)
        append_lengths = _as_int_list("append_lengths", append_lengths, max_len=most, why=why)
        if len(seq_ids) != len(append_lengths):
            raise ForwardError(f"seq_ids has {len(seq_ids)} entries but append_lengths has "
                               f"{len(append_lengths)}; expected equal lengths")
        if not seq_ids:
            raise ForwardError("begin_forward needs at least one sequence, got an empty batch")
        if self._import is not None and self._import.seq_id in seq_ids:
            raise ForwardError(f"sequence {self._import.seq_id} is importing a checkpoint; finish_import it (or "
                               "remove it) before it joins a step")
        for seq_id, n in zip(seq_ids, append_lengths):
            if n < 1:
                raise ForwardError(f"append length {n} of sequence {seq_id} must be at least 1")
        window = self._unwindowed_chunk_limit
        if window and max(append_lengths) > window:
            raise ForwardError(
                f"a sequence appends {max(append_lengths)} tokens in one step, more than the MHA_SLIDING layers' "
                f"window ({window}), and this cache has no windowed ragged kernel (TVM's creation arguments lack "
                "it): the new tokens would not be windowed among themselves; append at most the window per "
                "step, or pass the kernel (29th creation argument, as relax_kvcache.frontend does)")
        total = sum(append_lengths)
        if total > self.config.prefill_chunk_size:
            raise ForwardError(f"the step appends {total} tokens, more than prefill_chunk_size="
                               f"{self.config.prefill_chunk_size}")
        trees = self._check_trees(seq_ids, append_lengths, token_tree_parent_ptr)
        return self._plan_step(seq_ids, append_lengths, trees)

    def _check_trees(self, seq_ids: List[int], append_lengths: List[int],
                     parent_ptr: Optional[Sequence[int]]) -> Optional[List[TokenTree]]:
        """Validate a step's token trees; return each sequence's tree after the step (or None).

        Parent pointers index each sequence's accumulated tree: its uncommitted nodes from earlier
        steps followed by this step's ``append_lengths[i]`` nodes.
        """
        paging = self._paging
        if parent_ptr is None:
            for seq_id in seq_ids:
                if not paging.sequence(seq_id).accepted_indices_committed:
                    raise SequenceError(
                        f"sequence {seq_id} has uncommitted token-tree nodes: call commit_accepted_token_tree_nodes "
                        "before a step without a token tree")
            return None
        refusal = self._token_tree_refusal()
        if refusal is not None:
            raise refusal
        parents = _as_int_list("token_tree_parent_ptr", parent_ptr, max_len=sum(append_lengths),
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

    def _plan_step(self, seq_ids: List[int], append_lengths: List[int],
                   trees: Optional[List[TokenTree]]) -> md.StepMetadata:
        paging, cfg = self._paging, self.config
        sliding = cfg.slides_sequences
        span = cfg.layer_span
        structure = md.BatchStructure.collect(paging, seq_ids, append_lengths, trees)
        extends_tree = any(not paging.sequence(s).accepted_indices_committed for s in seq_ids)
        append_before_attn = (not sliding and structure.use_decode_kernel[-1]) or extends_tree
        if append_before_attn:
            reused = paging.reserve_append(seq_ids, append_lengths)
            depths = md.build_depths(paging, structure, sliding_window=sliding, layer_span=span)
        else:
            depths = md.build_depths(paging, structure, sliding_window=sliding, layer_span=span)
            reused = paging.reserve_append(seq_ids, append_lengths)
        if trees is not None:
            for seq_id, tree in zip(seq_ids, trees):
                paging.set_token_tree(seq_id, tree)
        ragged_tree, depth_trees = md.build_tree_masks(structure, append_before_attn=append_before_attn)
        q_rope_position, append_position = md.build_token_maps(paging, structure)
        step = md.StepMetadata(
            seq_ids=tuple(seq_ids),
            append_lengths=tuple(append_lengths),
            append_indptr=md.indptr(append_lengths),
            k_ragged_rope_pos_offset=np.asarray(structure.rope_offsets, dtype=np.int32),
            q_rope_position=q_rope_position,
            append_position=append_position,
            depths=tuple(dataclasses.replace(d, tree=t) if t is not None else d for d, t in zip(depths, depth_trees)),
            append_before_attn=append_before_attn,
            ragged_tree=ragged_tree,
            reused_pages=tuple(reused),
        )
        self._decode_planner.start(paging, step, structure.last_depths)
        return step

    def end_forward(self) -> None:
        """End the current step (no-op when none is active)."""
        self._check_not_busy("end_forward")
        self._appended_layers.clear()
        self._step = None
        self._device_step = None
        self._context = None

    def _active_step(self, what: str) -> _DeviceStep:
        if self._busy is not None:
            self._check_not_busy(what)
        if self._step is None:
            raise ForwardError(f"{what} called without an active step; call begin_forward first")
        if self._device_step is None:
            self._device_step = self._upload(self._step)
        self._uploader.wait()
        return self._device_step

    def _upload(self, step: md.StepMetadata) -> _DeviceStep:
        """Send the step's metadata to the device; return the views the kernels read."""
        if self._decode_planner.current is step:
            return self._upload_decode(step)
        arrays = [step.append_indptr, step.k_ragged_rope_pos_offset, step.q_rope_position,
                  step.append_position]
        for depth in step.depths:
            arrays += [depth.qo_indptr, depth.page_indptr, depth.page_indices, depth.length_info,
                       depth.k_rope_pos_offset]
            if depth.window is not None:
                w = depth.window
                arrays += [w.page_indptr, w.page_indices, w.length_info, w.k_rope_pos_offset]
            if depth.tree is not None:
                arrays += [depth.tree.mn_indptr, depth.tree.mask]
        if step.ragged_tree is not None:
            arrays += [step.ragged_tree.mn_indptr, step.ragged_tree.mask]
        self._uploader = self._aux
        return self._device_views(step, self._aux.upload(arrays))

    def _upload_decode(self, step: md.StepMetadata) -> _DeviceStep:
        """`_upload` for repeated decode steps: fixed slots, the same views every step.

        The views (and so every kernel argument) stay the same while the batch keeps its
        structure and its page lists fit the slots' headroom; a CUDA graph captured on one such
        step replays on the next ones (see :mod:`relax_kvcache.cuda_graph`).
        """
        fixed, page_lists = self._decode_arrays(step)
        arrays = fixed + page_lists
        has_pages = tuple((d.has_pages, d.window.has_pages if d.window is not None else None) for d in step.depths)
        slots = self._decode_slots
        if slots is None or slots[0] != has_pages or not slots[1].fits(arrays):
            headroom = _DECODE_PAGE_HEADROOM * step.batch_size
            shapes = [a.shape for a in fixed] + [(a.size + headroom,) for a in page_lists]
            buffer = SlotBuffer(self.device, shapes, [False] * len(fixed) + [True] * len(page_lists))
            slots = self._decode_slots = (has_pages, buffer, self._slot_step(step, buffer), step.seq_ids)
        elif slots[3] != step.seq_ids:
            # another batch of the same structure: the same slots, but a new object, so that a
            # graph captured with the old batch's forward is not replayed for this one
            slots = self._decode_slots = (has_pages, slots[1], self._slot_step(step, slots[1]), step.seq_ids)
        slots[1].upload(arrays)
        self._uploader = slots[1]
        return slots[2]

    @staticmethod
    def _decode_arrays(step: md.StepMetadata) -> Tuple[List[np.ndarray], List[np.ndarray]]:
        """A decode step's arrays for `SlotBuffer` slots: (fixed-shape arrays, page lists).

        Fixed: the step's four token arrays, then per depth its qo_indptr, page_indptr,
        length_info and k_rope_pos_offset (and its window's page_indptr, length_info and
        k_rope_pos_offset). Page lists: per depth its page_indices (and its window's)."""
        fixed = [step.append_indptr, step.k_ragged_rope_pos_offset, step.q_rope_position, step.append_position]
        page_lists = []
        for depth in step.depths:
            fixed += [depth.qo_indptr, depth.page_indptr, depth.length_info, depth.k_rope_pos_offset]
            page_lists.append(depth.page_indices)
            if depth.window is not None:
                w = depth.window
                fixed += [w.page_indptr, w.length_info, w.k_rope_pos_offset]
                page_lists.append(w.page_indices)
        return fixed, page_lists

    def _slot_step(self, step: md.StepMetadata, buffer: SlotBuffer) -> _DeviceStep:
        """The `_DeviceStep` of a decode step whose arrays live in ``buffer``'s slots (laid out
        by `_decode_arrays`), in `_device_views`' order (page indices second in each view set)."""
        fixed_count = 4 + sum(4 if depth.window is None else 7 for depth in step.depths)
        fixed, page_lists = iter(buffer.views[:fixed_count]), iter(buffer.views[fixed_count:])
        views = [next(fixed) for _ in range(4)]
        for depth in step.depths:
            qo, indptr, info, rope = (next(fixed) for _ in range(4))
            views += [qo, indptr, next(page_lists), info, rope]
            if depth.window is not None:
                w_indptr, w_info, w_rope = (next(fixed) for _ in range(3))
                views += [w_indptr, next(page_lists), w_info, w_rope]
        return self._device_views(step, views)

    def _device_views(self, step: md.StepMetadata, views: Sequence[tvm.runtime.Tensor]) -> _DeviceStep:
        """The `_DeviceStep` of ``step`` from its arrays' device views, in `_upload`'s order."""
        views = iter(views)
        head = [next(views) for _ in range(4)]
        depths = []
        for depth in step.depths:
            qo_indptr = next(views)
            pages = _PageViews(next(views), next(views), next(views), next(views), depth.has_pages)
            window = (_PageViews(next(views), next(views), next(views), next(views), depth.window.has_pages)
                      if depth.window is not None else None)
            tree = _TreeViews(next(views), next(views)) if depth.tree is not None else None
            depths.append(_DepthViews(qo_indptr, depth.use_decode_kernel, pages, window, tree))
        ragged_tree = _TreeViews(next(views), next(views)) if step.ragged_tree is not None else None
        n, cfg, dt, f32 = step.total_tokens, self.config, self._dtype, self._float32
        split = not self._mla
        return _DeviceStep(
            append_indptr=head[0], k_ragged_rope_pos_offset=head[1], q_rope_position=head[2],
            append_position=head[3], depths=tuple(depths), ragged_tree=ragged_tree,
            q=view(self._scratch_q, (n, cfg.num_qo_heads, cfg.head_dim), 0, dt) if split else None,
            k=view(self._scratch_k, (n, cfg.num_kv_heads, cfg.head_dim), 0, dt) if split else None,
            v=view(self._scratch_v, (n, cfg.num_kv_heads, cfg.v_head_dim), 0, dt) if split else None,
            tmp_o=view(self._scratch_o, (n, cfg.num_qo_heads, cfg.v_head_dim), 0, dt),
            tmp_lse=view(self._scratch_lse, (n, cfg.num_qo_heads), 0, f32),
            merged_lse=view(self._scratch_merged_lse, (n, cfg.num_qo_heads), 0, f32),
        )

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
        self._require_kind("attention_with_fused_qkv", mla=False)
        cfg = self.config
        layer = self._local_layer(layer_id)
        step = self._active_step("attention_with_fused_qkv")
        n = self._step.total_tokens
        shape = check_tensor("qkv", qkv, shape=(None, cfg.num_qo_heads + 2 * cfg.num_kv_heads, cfg.head_dim),
                             dtype=cfg.dtype, device=self.device)
        check_tensor("o", o, shape=(shape[0], cfg.num_qo_heads, cfg.head_dim), dtype=cfg.dtype,
                     device=self.device)
        if shape[0] < n:
            raise ForwardError(f"qkv has {shape[0]} rows, fewer than the {n} tokens of the step")
        if shape[0] != n:
            qkv = view(qkv, (n,) + shape[1:], 0, self._dtype)
            o = view(o, (n, cfg.num_qo_heads, cfg.head_dim), 0, self._dtype)
        sm_scale = _as_float("sm_scale", sm_scale)
        self._check_not_overwritten(f"attention_with_fused_qkv({layer_id}) a second time", layer, layer_id)
        k = self._kernels
        k.split_rotary(qkv, step.q_rope_position, step.q, step.k, step.v, self._split_rope_argument)
        pages = self._pages[layer]
        if self._step.append_before_attn:
            k.transpose_append(pages, step.k, step.v, step.append_position)
        self._attend(step, layer, step.q, step.k, step.v, o, step.merged_lse, sm_scale)
        if not self._step.append_before_attn:
            k.transpose_append(pages, step.k, step.v, step.append_position)
        self._appended_layers.add(layer)

    def attention_with_shared_kv(self, source_layer_id: int, q: tvm.runtime.Tensor, k: tvm.runtime.Tensor,
                                 v: tvm.runtime.Tensor, o: tvm.runtime.Tensor, sm_scale: float) -> None:
        """Attention of a layer that reuses the KV another layer wrote (KV-sharing models).

        Attends ``q (n, Hq, D)`` over the cached KV of ``source_layer_id`` plus this step's
        ``k (n, Hkv, D)`` / ``v (n, Hkv, Dv)`` (the source layer's new K/V, not appended again);
        writes ``o (n, Hq, Dv)``. Call it after the source layer's attention of the same step
        (a decode step reads the new token's K/V from the source layer's pages). q and k are
        used as given: RoPE is applied only in INLINE mode.
        """
        self._require_kind("attention_with_shared_kv", mla=False)
        cfg = self.config
        layer = self._local_layer(source_layer_id)
        step = self._active_step("attention_with_shared_kv")
        n = self._step.total_tokens
        check_tensor("q", q, shape=(n, cfg.num_qo_heads, cfg.head_dim), dtype=cfg.dtype, device=self.device)
        check_tensor("k", k, shape=(n, cfg.num_kv_heads, cfg.head_dim), dtype=cfg.dtype, device=self.device)
        check_tensor("v", v, shape=(n, cfg.num_kv_heads, cfg.v_head_dim), dtype=cfg.dtype, device=self.device)
        check_tensor("o", o, shape=(n, cfg.num_qo_heads, cfg.v_head_dim), dtype=cfg.dtype, device=self.device)
        size, hq, hkv = self._itemsize, cfg.num_qo_heads, cfg.num_kv_heads
        check_disjoint([("o", o, n * hq * cfg.v_head_dim * size)],
                       [("q", q, n * hq * cfg.head_dim * size), ("k", k, n * hkv * cfg.head_dim * size),
                        ("v", v, n * hkv * cfg.v_head_dim * size)])
        sm_scale = _as_float("sm_scale", sm_scale)
        if layer not in self._appended_layers:
            raise ForwardError(f"attention_with_shared_kv reads layer {source_layer_id}'s KV, which this step has not "
                               "appended yet; call it after that layer's attention_with_fused_qkv")
        if self._step.reused_pages:
            raise ForwardError(self._reused_pages_message("attention_with_shared_kv", source_layer_id))
        self._attend(step, layer, q, k, v, o, step.merged_lse, sm_scale)

    def _check_not_overwritten(self, what: str, layer: int, layer_id: int) -> None:
        """Refuse ``what``, a read of ``layer``'s KV, once its append overwrote pages that slid
        out of a window this step."""
        if self._step.reused_pages and layer in self._appended_layers:
            raise ForwardError(self._reused_pages_message(what, layer_id))

    def _reused_pages_message(self, what: str, layer_id: int) -> str:
        return (f"{what} would read layer {layer_id}'s KV after its append overwrote page(s) "
                f"{list(dict.fromkeys(self._step.reused_pages))[:8]}: in this step they slid out of a sequence's window, "
                "whose attention reads their old tokens, and hold new tokens of this step. Steps where "
                "windows slide attend before appending, so a layer's KV can be read only by its own "
                "attention_with_fused_qkv call (a batch whose windows free no page for others avoids this)")

    def _attend(self, step: _DeviceStep, layer: int, q, k, v, o, lse, sm_scale: float) -> None:
        """Attention of q over a layer's cached KV and the step's k/v, into (o, lse)."""
        if self._step.append_before_attn:  # the new K/V are already in the pages
            self._paged_attention(step, layer, q, o, lse, sm_scale, first=True)
        elif self._prefixed(step, layer):  # one kernel over the cached prefix and the new rows
            depth, cfg = step.depths[0].pages, self.config
            self._kernels.attention_prefill_prefixed(
                q, step.append_indptr, self._pages[layer], depth.page_indptr, depth.page_indices,
                depth.length_info, depth.k_rope_pos_offset, step.q_rope_position, k, v, o, lse, 1,
                self._rotary_mode, cfg.rope_scale, cfg.rope_theta, sm_scale)
        else:
            self._ragged_attention(step, layer, q, k, v, o, lse, sm_scale)
            self._paged_attention(step, layer, q, o, lse, sm_scale, first=False)

    def _prefixed(self, step: _DeviceStep, layer: int) -> bool:
        """Whether ``attention_prefill_prefixed`` serves this step and layer: every sequence has
        one plain page list (one depth, one chunk per sequence), no tree, no window."""
        if (self._kernels.attention_prefill_prefixed is None or not self._prefixed_enabled
                or step.ragged_tree is not None
                or len(step.depths) != 1 or self._windowed_layers[layer] or self.config.slides_sequences):
            return False
        depth = step.depths[0]
        return (depth.pages.has_pages and not depth.use_decode_kernel and depth.tree is None
                and depth.qo_indptr.shape[0] == step.append_indptr.shape[0])

    def self_attention(self, layer_id: int, q: tvm.runtime.Tensor, k: tvm.runtime.Tensor,
                       v: tvm.runtime.Tensor, o: tvm.runtime.Tensor, lse: tvm.runtime.Tensor,
                       sm_scale: float) -> None:
        """Causal attention of the step's tokens over the step's own K/V only (nothing cached).

        ``q (n, Hq, D)``, ``k (n, Hkv, D)``, ``v (n, Hkv, Dv)``, outputs ``o (n, Hq, Dv)`` and
        base-2 ``lse (n, Hq)`` (float32), where n is the number of tokens of the step. MLA
        caches: decompressed q/k/v with one KV head per query head and the
        ``mla_original_*`` head dims (e.g. 192 / 128); no RoPE is applied (as in TVM).
        """
        cfg = self.config
        layer = self._local_layer(layer_id)
        step = self._active_step("self_attention")
        n, hq = self._step.total_tokens, cfg.num_qo_heads
        hkv, dqk, dv = ((hq, cfg.mla_original_qk_head_dim, cfg.mla_original_v_head_dim) if self._mla
                        else (cfg.num_kv_heads, cfg.head_dim, cfg.v_head_dim))
        dqk = check_tensor("q", q, shape=(n, hq, dqk), dtype=cfg.dtype, device=self.device)[2]
        check_tensor("k", k, shape=(n, hkv, dqk), dtype=cfg.dtype, device=self.device)
        dv = check_tensor("v", v, shape=(n, hkv, dv), dtype=cfg.dtype, device=self.device)[2]
        check_tensor("o", o, shape=(n, hq, dv), dtype=cfg.dtype, device=self.device)
        check_tensor("lse", lse, shape=(n, hq), dtype="float32", device=self.device)
        size = self._itemsize
        check_disjoint([("o", o, n * hq * dv * size), ("lse", lse, n * hq * 4)],
                       [("q", q, n * hq * dqk * size), ("k", k, n * hkv * dqk * size), ("v", v, n * hkv * dv * size)])
        self._ragged_attention(step, layer, q, k, v, o, lse, _as_float("sm_scale", sm_scale))

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
        n = self._step.total_tokens
        check_tensor("q", q, shape=(n, cfg.num_qo_heads, cfg.head_dim), dtype=cfg.dtype, device=self.device)
        check_tensor("o", o, shape=(n, cfg.num_qo_heads, cfg.v_head_dim), dtype=cfg.dtype, device=self.device)
        check_tensor("lse", lse, shape=(n, cfg.num_qo_heads), dtype="float32", device=self.device)
        rows = n * cfg.num_qo_heads
        check_disjoint([("o", o, rows * cfg.v_head_dim * self._itemsize), ("lse", lse, rows * 4)],
                       [("q", q, rows * cfg.head_dim * self._itemsize)])
        sm_scale = _as_float("sm_scale", sm_scale)
        self._check_not_overwritten(f"cross_attention({layer_id})", layer, layer_id)
        self._paged_attention(step, layer, q, o, lse, sm_scale, first=True, write_empty=True)

    def merge_attn_output_inplace(self, o_self_attn: tvm.runtime.Tensor, lse_self_attn: tvm.runtime.Tensor,
                                  o_cross_attn: tvm.runtime.Tensor, lse_cross_attn: tvm.runtime.Tensor
                                  ) -> Tuple[tvm.runtime.Tensor, tvm.runtime.Tensor]:
        """Merge two attention states into ``(o_self_attn, lse_self_attn)``; returns them.

        ``o (n, Hq, Dv)``, ``lse (n, Hq)``; MLA caches: ``Dv`` is the decompressed v head dim
        (TVM's second merge function).
        """
        cfg = self.config
        dv = cfg.mla_original_v_head_dim if self._mla else cfg.v_head_dim
        shape = check_tensor("o_self_attn", o_self_attn, shape=(None, cfg.num_qo_heads, dv),
                             dtype=cfg.dtype, device=self.device)
        check_tensor("lse_self_attn", lse_self_attn, shape=shape[:2], dtype="float32", device=self.device)
        check_tensor("o_cross_attn", o_cross_attn, shape=shape, dtype=cfg.dtype, device=self.device)
        check_tensor("lse_cross_attn", lse_cross_attn, shape=shape[:2], dtype="float32", device=self.device)
        rows = shape[0] * shape[1]
        o_bytes, lse_bytes = rows * shape[2] * self._itemsize, rows * 4
        exact = o_self_attn.data_ptr() == o_cross_attn.data_ptr() and \
            lse_self_attn.data_ptr() == lse_cross_attn.data_ptr()  # a state merged with itself: elementwise
        if exact:
            check_disjoint([("o_self_attn", o_self_attn, o_bytes), ("lse_self_attn", lse_self_attn, lse_bytes)])
        else:
            check_disjoint([("o_self_attn", o_self_attn, o_bytes), ("lse_self_attn", lse_self_attn, lse_bytes)],
                           [("o_cross_attn", o_cross_attn, o_bytes), ("lse_cross_attn", lse_cross_attn, lse_bytes)])
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
        self._require_kind("append_mla_kv", mla=True)
        cfg = self.config
        layer = self._local_layer(layer_id)
        step = self._active_step("append_mla_kv")
        n = self._step.total_tokens
        shape = check_tensor("kv", kv, shape=(None, cfg.head_dim), dtype=cfg.dtype, device=self.device)
        if shape[0] < n:
            raise ForwardError(f"kv has {shape[0]} rows, fewer than the {n} tokens of the step")
        if self._kernels.transpose_append_mla is None:
            raise KVCacheError("append_mla_kv needs the transpose_append_mla kernel, which this cache was "
                               "created without")
        if shape[0] != n:
            kv = view(kv, (n, cfg.head_dim), 0, self._dtype)
        self._kernels.transpose_append_mla(self._pages[layer], kv, step.append_position)

    def mla_context_attention(self, layer_id: int, q: tvm.runtime.Tensor, o: tvm.runtime.Tensor,
                              lse: tvm.runtime.Tensor, sm_scale: float, decompress: Any) -> None:
        """Compute-friendly attention of the step's queries over their cached context, in chunks.

        The cached tokens of the step's sequences (those before this step) are walked in chunks
        of at most ``config.context_workspace_rows`` rows (``context_chunk_size``, capped at the
        rows the pages hold): each chunk's latent rows are gathered,
        decompressed by ``decompress`` into per-head K/V and attended with the ragged kernel;
        the chunks' states are merged by log-sum-exp (seed 002's chunked context). Memory is
        that of one chunk, whatever the context length. Merge the result with
        :meth:`self_attention`'s by :meth:`merge_attn_output_inplace`.

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
        self._require_kind("mla_context_attention", mla=True)
        layer = self._local_layer(layer_id)
        step = self._active_step("mla_context_attention")
        sm_scale = _as_float("sm_scale", sm_scale)
        ws = self._check_context_args(q, o, lse, decompress)
        n, hq, dv = self._step.total_tokens, self.config.num_qo_heads, ws.dims[1]
        plan = self._context_plan()
        tmp_o, tmp_lse = view(ws.o, (n, hq, dv), 0, self._dtype), step.tmp_lse
        for i, chunk in enumerate(plan.chunks):
            k, v = self._decompressed_chunk(layer, ws, chunk, decompress)
            out, out_lse = (o, lse) if i == 0 else (tmp_o, tmp_lse)
            self._kernels.attention_prefill_ragged(
                q, step.append_indptr, k, v, chunk.kv_indptr, step.q_rope_position, plan.k_rope_pos_offset,
                out, out_lse, 0, 0, self.config.rope_scale, self.config.rope_theta, sm_scale)
            if i:
                self._kernels.merge_general(o, lse, tmp_o, tmp_lse)

    def _check_context_args(self, q: Any, o: Any, lse: Any, decompress: Any) -> ContextWorkspace:
        """Check :meth:`mla_context_attention`'s tensors and callback; the workspace for them."""
        cfg = self.config
        n, hq = self._step.total_tokens, cfg.num_qo_heads
        dqk = check_tensor("q", q, shape=(n, hq, cfg.mla_original_qk_head_dim), dtype=cfg.dtype,
                           device=self.device)[2]
        dv = check_tensor("o", o, shape=(n, hq, cfg.mla_original_v_head_dim), dtype=cfg.dtype,
                          device=self.device)[2]
        check_tensor("lse", lse, shape=(n, hq), dtype="float32", device=self.device)
        ws = self._context_workspace
        ws_spans = ws.spans() if ws is not None else []
        q_span = ("q", q, n * hq * dqk * self._itemsize)
        check_disjoint([("o", o, n * hq * dv * self._itemsize), ("lse", lse, n * hq * 4)], [q_span, *ws_spans])
        check_disjoint([q_span], ws_spans)  # the workspace is written
        if not callable(decompress):
            raise ForwardError(f"decompress must be callable (latent, k, v), got {type(decompress).__name__}")
        if self._kernels.debug_get_kv is None:
            raise KVCacheError("mla_context_attention gathers latent rows with the debug_get_kv kernel, which "
                               "this cache was created without")
        if ws is None:  # a cache that read its dims off foreign kernels makes it on first use
            ws = self._context_workspace = self._new_context_workspace(dqk, dv)
        return ws

    def _decompressed_chunk(self, layer: int, ws: ContextWorkspace, chunk: Any, decompress: Any) -> Tuple[Any, Any]:
        """Gather a context chunk's latent rows and let ``decompress`` fill its K/V."""
        cfg = self.config
        hq, (dqk, dv) = cfg.num_qo_heads, ws.dims
        rows = max(chunk.rows, 1)
        k, v = view(ws.k, (rows, hq, dqk), 0, self._dtype), view(ws.v, (rows, hq, dv), 0, self._dtype)
        if not chunk.rows:
            return k, v
        gathered = view(ws.latent, (1, rows, cfg.head_dim), 0, self._dtype)
        self._kernels.debug_get_kv(self._pages[layer], chunk.positions, gathered, 0)
        latent = view(ws.latent, (rows, cfg.head_dim), 0, self._dtype)
        self._busy = "mla_context_attention's decompress callback"
        try:
            decompress(latent, k, v)
        finally:
            self._busy = None
        return k, v

    def _new_context_workspace(self, dqk: int, dv: int) -> ContextWorkspace:
        cfg = self.config
        return ContextWorkspace(cfg.context_workspace_rows, cfg.prefill_chunk_size, cfg.head_dim, cfg.num_qo_heads,
                                dqk, dv, cfg.dtype, self.device)

    def _context_plan(self) -> ContextPlan:
        """The current step's chunked context, planned on first use and kept for the step."""
        if self._context is None:
            step = self._step
            # chunks of the workspace's rows: context_chunk_size, capped at the pages' rows (a
            # context counts a shared prefix once per sequence, so it can be longer than that)
            self._context = ContextPlan.build(self._paging, step.seq_ids, step.append_lengths,
                                              self.config.context_workspace_rows, self.device)
        return self._context

    def _ragged_attention(self, step: _DeviceStep, layer: int, q, k, v, o, lse, sm_scale: float) -> None:
        """Causal attention of the step's queries over the step's k/v (windowed on local layers
        when the kernel set has the windowed ragged kernel)."""
        cfg, kernels = self.config, self._kernels
        if step.ragged_tree is not None:
            kernels.attention_prefill_ragged_tree(
                q, step.append_indptr, k, v, step.append_indptr, step.q_rope_position, step.ragged_tree.mn_indptr,
                step.ragged_tree.mask, o, lse, self._rotary_mode, cfg.rope_scale, cfg.rope_theta, sm_scale)
            return
        f = kernels.attention_prefill_ragged
        if self._windowed_layers[layer] and kernels.attention_prefill_ragged_sliding_window is not None:
            f = kernels.attention_prefill_ragged_sliding_window
        f(q, step.append_indptr, k, v, step.append_indptr, step.q_rope_position,
          step.k_ragged_rope_pos_offset, o, lse, 1, self._rotary_mode, cfg.rope_scale, cfg.rope_theta, sm_scale)

    def _paged_attention(self, step: _DeviceStep, layer: int, q, o, lse, sm_scale: float, *, first: bool,
                         write_empty: bool = False) -> None:
        """Attend q to a layer's cached pages depth by depth, merging into (o, lse).

        ``first``: the first depth writes (o, lse) directly; otherwise every depth is merged into
        them. ``write_empty``: when no depth has pages, run depth 0 anyway so that (o, lse)
        become the empty state (o = 0, lse = -inf).
        """
        windowed = self._windowed_layers[layer]
        depths = step.depths_with_pages(windowed)
        if not depths and write_empty:
            depth = step.depths[0]
            depths = ((depth, depth.window if windowed else depth.pages),)
        for depth, views in depths:
            out, out_lse = (o, lse) if first else (step.tmp_o, step.tmp_lse)
            self._run_depth(step, layer, depth, views, q, out, out_lse, sm_scale)
            if not first:
                self._kernels.merge_inplace(o, lse, step.tmp_o, step.tmp_lse)
            first = False

    def _run_depth(self, step: _DeviceStep, layer: int, depth: _DepthViews, views: _PageViews, q, o, lse,
                   sm_scale: float) -> None:
        """One depth's paged attention. Kernel choice and ``causal`` follow TVM: sliding-window
        variants for local layers and for caches whose sequences slide; ``causal`` is set
        for local layers outside decode (their kernels mask by position)."""
        cfg, k = self.config, self._kernels
        windowed = self._windowed_layers[layer]
        sliding = windowed or cfg.slides_sequences
        pages = self._pages[layer]
        if self._mla:  # one kernel for decode and prefill, no causal mask (as in TVM)
            k.attention_prefill_mla(q, depth.qo_indptr, pages, views.page_indptr, views.page_indices,
                                    views.length_info, o, lse, 0, sm_scale)
        elif depth.tree is not None:
            k.attention_prefill_tree(
                q, depth.qo_indptr, pages, views.page_indptr, views.page_indices, views.length_info,
                views.k_rope_pos_offset, step.q_rope_position, o, lse, self._rotary_mode, cfg.rope_scale,
                cfg.rope_theta, sm_scale, depth.tree.mn_indptr, depth.tree.mask)
        elif depth.use_decode_kernel:
            f = k.attention_decode_sliding_window if sliding else k.attention_decode
            f(q, pages, views.page_indptr, views.page_indices, views.length_info, views.k_rope_pos_offset,
              step.q_rope_position, o, lse, self._rotary_mode, cfg.rope_scale, cfg.rope_theta, sm_scale)
        else:
            f = k.attention_prefill_sliding_window if sliding else k.attention_prefill
            causal = int(windowed and not self._step.append_before_attn)
            f(q, depth.qo_indptr, pages, views.page_indptr, views.page_indices, views.length_info,
              views.k_rope_pos_offset, step.q_rope_position, o, lse, causal, self._rotary_mode,
              cfg.rope_scale, cfg.rope_theta, sm_scale)

    def capturable_step(self) -> Optional[object]:
        """The current step's kernel arguments when a CUDA graph may capture them, else None.

        Repeated decode steps of the same batch (see :mod:`relax_kvcache.decode_plan`) keep
        their metadata in fixed device slots: every kernel argument of such a step is the same
        tensor as in the previous step, so a graph captured on one replays on the next. The
        returned object stands for that set of arguments (compare by identity); it changes when
        the batch (the list of sequence ids) changes or the page lists outgrow their slots.
        Sequences removed and added again under the same ids count as the same batch: key
        per-request buffers of a captured ``forward`` by sequence id. Also orders the current stream
        after the step's metadata upload, as the first attention call would.
        """
        step = self._active_step("capturable_step")
        return step if self._uploader is not self._aux else None

    def get_query_positions(self) -> tvm.runtime.Tensor:
        """RoPE positions ``int32 (n,)`` of the step's tokens, on the device."""
        return self._active_step("get_query_positions").q_rope_position

    # ------------------------------------------------------------------ debugging

    def debug_get_kv(self, seq_id: int, start_pos: int, end_pos: int, k_data: tvm.runtime.Tensor,
                     v_data: tvm.runtime.Tensor) -> None:
        """Copy positions ``[start_pos, end_pos)`` of a sequence's K/V of every layer.

        ``k_data`` / ``v_data``: ``(num_layers, end_pos - start_pos, num_kv_heads, head_dim)``.
        K is stored after RoPE in NORMAL mode and before it otherwise.
        """
        self._require_kind("debug_get_kv", mla=False)
        seq_id, start_pos, end_pos = self._debug_range("debug_get_kv", seq_id, start_pos, end_pos)
        cfg = self.config
        shape = (cfg.num_layers, end_pos - start_pos, cfg.num_kv_heads, cfg.head_dim)
        check_tensor("k_data", k_data, shape=shape, dtype=cfg.dtype, device=self.device)
        check_tensor("v_data", v_data, shape=shape, dtype=cfg.dtype, device=self.device)
        nbytes = int(np.prod(shape)) * self._itemsize
        check_disjoint([("k_data", k_data, nbytes), ("v_data", v_data, nbytes)])
        positions = tvm.runtime.tensor(self._paging.position_map(seq_id, start_pos, end_pos), self.device)
        for layer, pages in enumerate(self._pages):
            self._kernels.debug_get_kv(pages, positions, k_data, v_data, layer)

    def debug_get_kv_mla(self, seq_id: int, start_pos: int, end_pos: int, kv_data: tvm.runtime.Tensor) -> None:
        """Copy positions ``[start_pos, end_pos)`` of a sequence's latent vectors of every layer
        into ``kv_data (num_layers, end_pos - start_pos, kv_lora_rank + rope dim)`` (MLA caches)."""
        self._require_kind("debug_get_kv_mla", mla=True)
        seq_id, start_pos, end_pos = self._debug_range("debug_get_kv_mla", seq_id, start_pos, end_pos)
        cfg = self.config
        check_tensor("kv_data", kv_data, shape=(cfg.num_layers, end_pos - start_pos, cfg.head_dim),
                     dtype=cfg.dtype, device=self.device)
        positions = tvm.runtime.tensor(self._paging.position_map(seq_id, start_pos, end_pos), self.device)
        for layer, pages in enumerate(self._pages):
            self._kernels.debug_get_kv(pages, positions, kv_data, layer)

    def _debug_range(self, what: str, seq_id: Any, start_pos: Any, end_pos: Any) -> Tuple[int, int, int]:
        if self._kernels.debug_get_kv is None:
            raise KVCacheError(f"{what} needs the debug_get_kv kernel, which this cache was created without")
        seq_id, start_pos, end_pos = (_as_int("seq_id", seq_id), _as_int("start_pos", start_pos),
                                      _as_int("end_pos", end_pos))
        self._check_not_importing(seq_id, what)
        length = self._paging.sequence_length(seq_id)
        if not 0 <= start_pos < end_pos <= length:
            raise SequenceError(f"{what} range [{start_pos}, {end_pos}) is invalid for sequence "
                               f"{seq_id} of length {length}; expected 0 <= start < end <= length")
        return seq_id, start_pos, end_pos

    # ------------------------------------------------------------------ checkpoints

    def get_layout_hash(self) -> str:
        """The layout hash of checkpoints of this cache (TVM's: 16 hex digits of a 64-bit
        FNV-1a over the layout; checkpoints import only into caches of the same hash)."""
        self._require_checkpointable("get_layout_hash")
        return ckpt.layout_hash(self.config, self.layer_offset)

    def get_checkpoint_metadata(self, seq_id: int) -> str:
        """JSON metadata of a checkpoint of sequence ``seq_id`` (TVM's format): the layout, its
        hash, the sequence length, its logical pages and one page group per layer.

        Any sequence without a sliding window or an uncommitted token tree can be saved, also
        one sharing a prefix with others (TVM: sequence 0 only). Not while a step is active.
        """
        seq_id = self._checkpoint_sequence(seq_id, "get_checkpoint_metadata")
        length = self._paging.sequence_length(seq_id)
        meta = ckpt.metadata(self.config, self.layer_offset, seq_id, length, self.config.max_num_seqs)
        return ckpt.metadata_json(meta)

    def export_page_group(self, seq_id: int, group_id: int, out: tvm.runtime.Tensor) -> None:
        """Write layer ``group_id``'s K/V of sequence ``seq_id`` into ``out`` of shape
        ``(1, ceil(length / page_size), 2, num_kv_heads, page_size, head_dim)``: position p at
        page ``p // page_size``, slot ``p % page_size``; the last page's unused slots are zero.
        ``out`` may be on the cache's device or, for a GPU cache, on the host."""
        seq_id = self._checkpoint_sequence(seq_id, "export_page_group")
        group = self._group_id(group_id)
        length = self._paging.sequence_length(seq_id)
        shape = ckpt.group_shape(self.config, length)
        host = self._check_group_tensor("out", out, shape)
        if length == 0:
            return
        target = allocate(shape, self.config.dtype, self.device, "page group") if host else out
        pages = ckpt.group_as_pages(target)
        self._group_mover.move(self._pages[group], self._paging.position_map(seq_id), pages,
                               np.arange(length, dtype=np.int32))
        self._group_mover.zero(pages, np.arange(length, shape[1] * self.config.page_size, dtype=np.int32))
        if host:
            target.copyto(out)

    def prepare_import(self, seq_id: int, metadata: str) -> None:
        """Start importing a checkpoint (``metadata`` from :meth:`get_checkpoint_metadata`, ours
        or TVM's) into sequence ``seq_id``: new, or empty without a window (TVM: sequence 0).

        The sequence gets its pages now; fill them with :meth:`import_page_group` (each layer
        once), then :meth:`finish_import`. Until then the sequence cannot join a step, fork,
        pop, be saved or report its length; other sequences work as usual. Removing the
        sequence (or ``clear``) abandons the import. One import at a time.
        """
        seq_id = _as_int("seq_id", seq_id)
        self._require_no_step("prepare_import")
        self._require_checkpointable("prepare_import")
        if self._import is not None:
            raise SequenceError(f"prepare_import({seq_id}): the import into sequence {self._import.seq_id} is not "
                                "finished; finish_import it or remove that sequence first")
        length = ckpt.parse_import(self.config, self.layer_offset, metadata)
        slots = self._paging.import_sequence(seq_id, length)
        self._import = _ImportState(seq_id, slots, frozenset(range(self.config.num_layers)))

    def import_page_group(self, seq_id: int, group_id: int, group: tvm.runtime.Tensor) -> None:
        """Copy page group ``group_id`` (layer ``group_id``'s K/V, the layout of
        :meth:`export_page_group`; on the cache's device or the host) into the importing
        sequence's pages."""
        self._require_checkpointable("import_page_group")
        seq_id, group_id = _as_int("seq_id", seq_id), self._group_id(group_id)
        self._require_no_step("import_page_group")
        state = self._importing(seq_id, "import_page_group")
        if group_id not in state.pending:
            raise SequenceError(f"page group {group_id} of sequence {seq_id} was already imported")
        shape = ckpt.group_shape(self.config, len(state.slots))
        if self._check_group_tensor("group", group, shape):  # a host tensor: upload it first
            staged = allocate(shape, self.config.dtype, self.device, "page group")
            staged.copyfrom(group)
            group = staged
        if len(state.slots):
            self._group_mover.move(ckpt.group_as_pages(group), np.arange(len(state.slots), dtype=np.int32),
                                   self._pages[group_id], state.slots)
        self._import = dataclasses.replace(state, pending=state.pending - {group_id})

    def finish_import(self, seq_id: int) -> None:
        """End the import into ``seq_id`` once every page group is in."""
        self._require_checkpointable("finish_import")
        seq_id = _as_int("seq_id", seq_id)
        self._require_no_step("finish_import")
        state = self._importing(seq_id, "finish_import")
        if state.pending:
            raise SequenceError(f"the import into sequence {seq_id} is missing page group(s) {sorted(state.pending)}; "
                                "import_page_group each before finish_import")
        self._import = None

    def _checkpoint_sequence(self, seq_id: Any, what: str) -> int:
        """A sequence that can be saved now (its id)."""
        seq_id = _as_int("seq_id", seq_id)
        self._require_no_step(what)
        self._require_checkpointable(what)
        self._check_not_importing(seq_id, what)
        seq = self._paging.sequence(seq_id)
        if seq.token_tree is not None or seq.sliding_window_size != -1:
            raise SequenceError(f"{what}: sequence {seq_id} has " + ("an uncommitted token tree; commit it first"
                                if seq.token_tree is not None else "a sliding window, which checkpoints do not "
                                "hold (as in TVM)"))
        return seq_id

    def _require_checkpointable(self, what: str) -> None:
        why = ckpt.unsupported_layout(self.config)
        if why is not None:
            raise NotImplementedError(f"{what}: checkpoints of caches with {why} are not supported")
        missing = self._kernels.missing(["debug_get_kv", "transpose_append"])
        if missing:
            raise KVCacheError(f"{what} needs the {' and '.join(missing)} kernel(s), which this cache was "
                               "created without")

    def _check_group_tensor(self, name: str, value: Any, shape: Tuple[int, ...]) -> bool:
        """Check a page group tensor; True when it is on the host while the cache is not."""
        host = isinstance(value, TENSOR_TYPES) and value.device == tvm.cpu() and self.device != tvm.cpu()
        check_tensor(name, value, shape=shape, dtype=self.config.dtype, device=tvm.cpu() if host else self.device)
        return host

    def _group_id(self, group_id: Any) -> int:
        group_id = _as_int("group_id", group_id)
        if not 0 <= group_id < self.config.num_layers:
            raise ArgumentError(f"group_id {group_id} is out of range [0, {self.config.num_layers}): a checkpoint "
                                "has one page group per layer of the cache")
        return group_id

    def _importing(self, seq_id: int, what: str) -> _ImportState:
        if self._import is None or self._import.seq_id != seq_id:
            raise SequenceError(f"{what}: no checkpoint import into sequence {seq_id} is in progress"
                                + (f" (sequence {self._import.seq_id} is importing)" if self._import else
                                   "; call prepare_import first"))
        return self._import

    def _check_not_importing(self, seq_id: int, what: str) -> None:
        if self._import is not None and self._import.seq_id == seq_id:
            raise SequenceError(f"{what}: sequence {seq_id} is importing a checkpoint; finish_import it (or remove "
                                "it) first")

    # ------------------------------------------------------------------ helpers

    def _token_tree_refusal(self) -> Optional[KVCacheError]:
        """Why this cache cannot take token-tree steps (the error to raise), or None."""
        cfg = self.config
        if self._mla:
            return ForwardError("token-tree attention is not supported for MLA layers (as in TVM); got a "
                                "token_tree_parent_ptr")
        if cfg.effective_rope_mode == RopeMode.INLINE:
            return ForwardError("token-tree attention does not support inline RoPE (rope_mode INLINE, or a cache "
                                "created with support_sliding_window)")
        if cfg.slides_sequences or cfg.has_layer_windows:
            return ForwardError("token-tree attention does not support sliding windows or chunked local layers")
        missing = self._kernels.missing(("attention_prefill_tree", "attention_prefill_ragged_tree"))
        if missing:
            return KVCacheError(f"token-tree steps need the {' and '.join(missing)} kernel(s), which this cache "
                                "was created without")
        return None

    def _local_layer(self, layer_id: int) -> int:
        layer = _as_int("layer_id", layer_id) - self.layer_offset
        if not 0 <= layer < self.config.num_layers:
            raise ForwardError(f"layer_id {layer_id} is out of range [{self.layer_offset}, "
                               f"{self.layer_offset + self.config.num_layers})")
        return layer

    def _require_kind(self, what: str, *, mla: bool) -> None:
        if self._mla != mla:
            need, have = ("MLA", "MHA") if mla else ("MHA", "MLA")
            raise KVCacheError(f"{what} needs {need} layers, but this cache's layers are {have}")

    def _check_not_busy(self, what: str) -> None:
        """Refuse calls made from inside a callback of ours (``mla_context_attention``'s
        ``decompress``): they would change the step or the workspace the caller is using."""
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

