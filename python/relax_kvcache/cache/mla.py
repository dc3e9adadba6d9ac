"""Attention of MLA layers: latent pages, absorbed paged attention, the chunked context
(docs/architecture.md)."""

from __future__ import annotations

from typing import Any, Callable, ContextManager, List, Optional, Sequence, Tuple

import tvm
import tvm_ffi

from ..config import KVCacheConfig
from ..errors import ForwardError, KVCacheError
from ..kernel_set import KernelSet
from ..mla_context import ContextPlan, ContextWorkspace
from ..paging import PagingState
from ..tensors import check_disjoint, check_tensor, view
from .attention import Attention
from .step import DepthViews, PageViews, Step


class MLAAttention(Attention):
    """Attention of MLA layers. ``callback(what)``: the context the model's ``decompress`` runs
    in; ``lazy_workspace``: make the context workspace on first use; ``scale_args``: each
    layer's trailing page-kernel arguments (``KVScales.args``: 8-bit pages' scales, or none)."""

    kind = "MLA"

    def __init__(self, config: KVCacheConfig, kernels: KernelSet, pages: List[tvm.runtime.Tensor],
                 paging: PagingState, device: tvm.runtime.Device, callback: Callable[[str], ContextManager],
                 scale_args: Sequence[Tuple[Any, ...]], *, lazy_workspace: bool = False) -> None:
        super().__init__(config, kernels, pages)
        self._scale_args = scale_args
        self.self_attention_dims = (config.num_qo_heads, config.mla_original_qk_head_dim,
                                    config.mla_original_v_head_dim)
        self._paging, self._device, self._callback = paging, device, callback
        self._dtype = tvm_ffi.dtype(config.dtype)  # of the step's tensors and the workspace (not the pages)
        self._context: Optional[Tuple[Step, ContextPlan]] = None  # the chunked context of a step
        self.workspace: Optional[ContextWorkspace] = None
        if not lazy_workspace:
            self.workspace = self._new_workspace(config.mla_original_qk_head_dim, config.mla_original_v_head_dim)

    def tree_refusal(self) -> Optional[KVCacheError]:
        return ForwardError("token-tree attention is not supported for MLA layers (as in TVM); got a "
                            "token_tree_parent_ptr")

    def run_depth(self, step: Step, layer: int, depth: DepthViews, views: PageViews, q, o, lse,
                  sm_scale: float) -> None:
        """One kernel for decode and prefill, no causal mask (as in TVM)."""
        self.kernels.attention_prefill_mla(q, depth.qo_indptr, self.pages[layer], views.page_indptr,
                                           views.page_indices, views.length_info, o, lse, 0, sm_scale,
                                           *self._scale_args[layer])

    def checked_kv(self, step: Step, kv: Any) -> Any:
        """Check ``kv (m >= n, width)``; its first ``n`` rows (the step's latent rows)."""
        cfg, n = self.config, step.total_tokens
        shape = check_tensor("kv", kv, shape=(None, cfg.head_dim), dtype=cfg.dtype, device=self._device)
        if shape[0] < n:
            raise ForwardError(f"kv has {shape[0]} rows, fewer than the {n} tokens of the step")
        if self.kernels.transpose_append_mla is None:
            raise KVCacheError("append_mla_kv needs the transpose_append_mla kernel, which this cache was "
                               "created without")
        return kv if shape[0] == n else view(kv, (n, cfg.head_dim), 0, self._dtype)

    def append_kv(self, step: Step, layer: int, kv: Any) -> None:
        """Write ``kv``'s rows (:meth:`checked_kv`) into the layer's pages."""
        self.kernels.transpose_append_mla(self.pages[layer], kv, step.device.append_position,
                                          *self._scale_args[layer])

    def context_attention(self, step: Step, layer: int, q: Any, o: Any, lse: Any, sm_scale: float,
                          decompress: Any) -> None:
        """Attend q over the step's cached context chunk by chunk, merged into (o, lse)."""
        ws = self._check_context_args(step, q, o, lse, decompress)
        dev, n, hq, dv = step.device, step.total_tokens, self.config.num_qo_heads, ws.dims[1]
        plan = self._context_plan(step)
        tmp_o, tmp_lse = view(ws.o, (n, hq, dv), 0, self._dtype), dev.tmp_lse
        for i, chunk in enumerate(plan.chunks):
            k, v = self._decompressed_chunk(layer, ws, chunk, decompress)
            out, out_lse = (o, lse) if i == 0 else (tmp_o, tmp_lse)
            self.kernels.attention_prefill_ragged(
                q, dev.append_indptr, k, v, chunk.kv_indptr, dev.q_rope_position, plan.k_rope_pos_offset,
                out, out_lse, 0, 0, self.config.rope_scale, self.config.rope_theta, sm_scale)
            if i:
                self.kernels.merge_general(o, lse, tmp_o, tmp_lse)

    def _check_context_args(self, step: Step, q: Any, o: Any, lse: Any, decompress: Any) -> ContextWorkspace:
        """Check :meth:`context_attention`'s tensors and callback; the workspace for them."""
        cfg, dev = self.config, self._device
        n, hq = step.total_tokens, cfg.num_qo_heads
        dqk = check_tensor("q", q, shape=(n, hq, cfg.mla_original_qk_head_dim), dtype=cfg.dtype, device=dev)[2]
        dv = check_tensor("o", o, shape=(n, hq, cfg.mla_original_v_head_dim), dtype=cfg.dtype, device=dev)[2]
        check_tensor("lse", lse, shape=(n, hq), dtype="float32", device=dev)
        ws = self.workspace
        ws_spans = ws.spans() if ws is not None else []
        check_disjoint([("o", o), ("lse", lse)], [("q", q), *ws_spans])
        check_disjoint([("q", q)], ws_spans)  # the workspace is written
        if not callable(decompress):
            raise ForwardError(f"decompress must be callable (latent, k, v), got {type(decompress).__name__}")
        if self.kernels.debug_get_kv is None:
            raise KVCacheError("mla_context_attention gathers latent rows with the debug_get_kv kernel, which "
                               "this cache was created without")
        if ws is None:  # a cache that read its dims off foreign kernels makes it on first use
            ws = self.workspace = self._new_workspace(dqk, dv)
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
        self.kernels.debug_get_kv(self.pages[layer], chunk.positions, gathered, 0, *self._scale_args[layer])
        latent = view(ws.latent, (rows, cfg.head_dim), 0, self._dtype)
        with self._callback("mla_context_attention's decompress callback"):
            decompress(latent, k, v)
        return k, v

    def _new_workspace(self, dqk: int, dv: int) -> ContextWorkspace:
        cfg = self.config
        return ContextWorkspace(cfg.context_workspace_rows, cfg.prefill_chunk_size, cfg.head_dim, cfg.num_qo_heads,
                                dqk, dv, cfg.dtype, self._device)

    def _context_plan(self, step: Step) -> ContextPlan:
        """The step's chunked context, planned on first use and kept for the step."""
        if self._context is None or self._context[0] is not step:
            plan = ContextPlan.build(self._paging, step.meta.seq_ids, step.meta.append_lengths,
                                     self.config.context_workspace_rows, self._device)
            self._context = (step, plan)
        return self._context[1]
