"""Attention components: which kernels a layer's attention launches, with a step's views (MHA
here, MLA in :mod:`.mla`). Components only launch kernels; the cache checks first."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import tvm

from ..config import LOCAL_KINDS, KVCacheConfig, RopeMode
from ..errors import ForwardError, KVCacheError
from ..kernel_set import KernelSet, split_rotary_rope_argument
from .step import DepthViews, DeviceStep, PageViews, Step


class Attention:
    """Kernel launches shared by MHA and MLA layers over the cache's page tensor of each layer."""

    kind = ""  # "MHA" or "MLA": the layers this component attends

    def __init__(self, config: KVCacheConfig, kernels: KernelSet, pages: List[tvm.runtime.Tensor]) -> None:
        self.config, self.kernels, self.pages = config, kernels, pages
        self.windowed = tuple(kind in LOCAL_KINDS for kind in config.attn_kinds)
        self.rotary_mode = 0
        # (KV heads, q / k head dim, v head dim) of self_attention's tensors; the last is also
        # the head dim of the states merge_attn_output_inplace merges
        self.self_attention_dims = (config.num_kv_heads, config.head_dim, config.v_head_dim)

    def tree_refusal(self) -> Optional[KVCacheError]:
        """Why this cache cannot take token-tree steps (the error to raise), or None."""
        raise NotImplementedError

    def ragged(self, step: Step, layer: int, q, k, v, o, lse, sm_scale: float) -> None:
        """Causal attention of the step's queries over the step's k/v."""
        cfg, kernels, dev = self.config, self.kernels, step.device
        if dev.ragged_tree is not None:
            kernels.attention_prefill_ragged_tree(
                q, dev.append_indptr, k, v, dev.append_indptr, dev.q_rope_position, dev.ragged_tree.mn_indptr,
                dev.ragged_tree.mask, o, lse, self.rotary_mode, cfg.rope_scale, cfg.rope_theta, sm_scale)
            return
        f = kernels.attention_prefill_ragged
        if self.windowed[layer] and kernels.attention_prefill_ragged_sliding_window is not None:
            f = kernels.attention_prefill_ragged_sliding_window
        f(q, dev.append_indptr, k, v, dev.append_indptr, dev.q_rope_position,
          dev.k_ragged_rope_pos_offset, o, lse, 1, self.rotary_mode, cfg.rope_scale, cfg.rope_theta, sm_scale)

    def paged(self, step: Step, layer: int, q, o, lse, sm_scale: float, *, first: bool,
              write_empty: bool = False) -> None:
        """Attend q to a layer's cached pages depth by depth, merging into (o, lse) (``first``: the
        first depth writes them). ``write_empty``: with no pages, write the empty state."""
        dev, windowed = step.device, self.windowed[layer]
        depths = dev.depths_with_pages(windowed)
        if not depths and write_empty:
            depth = dev.depths[0]
            depths = ((depth, depth.window if windowed else depth.pages),)
        for depth, views in depths:
            out, out_lse = (o, lse) if first else (dev.tmp_o, dev.tmp_lse)
            self.run_depth(step, layer, depth, views, q, out, out_lse, sm_scale)
            if not first:
                self.kernels.merge_inplace(o, lse, dev.tmp_o, dev.tmp_lse)
            first = False

    def run_depth(self, step: Step, layer: int, depth: DepthViews, views: PageViews, q, o, lse,
                  sm_scale: float) -> None:
        """One depth's paged attention."""
        raise NotImplementedError


class MHAAttention(Attention):
    """Attention of MHA layers (``MHA``, ``MHA_SLIDING``, ``MHA_CHUNKED_LOCAL``)."""

    kind = "MHA"

    def __init__(self, config: KVCacheConfig, kernels: KernelSet, pages: List[tvm.runtime.Tensor],
                 device: tvm.runtime.Device, scale_args: Sequence[Tuple[Any, ...]]) -> None:
        super().__init__(config, kernels, pages)
        self._scale_args = scale_args  # each layer's trailing page-kernel arguments (KVScales.args)
        self.rotary_mode = int(config.effective_rope_mode == RopeMode.INLINE)
        self._split_rope_argument = split_rotary_rope_argument(config, device)
        self._rope = (self.rotary_mode, config.rope_scale, config.rope_theta)  # kernel arguments before sm_scale
        self._sliding = tuple(windowed or config.slides_sequences for windowed in self.windowed)
        self._decode: Tuple[Optional[Step], Tuple[Any, ...]] = (None, ())  # (step, its _decode_launches)

    def tree_refusal(self) -> Optional[KVCacheError]:
        cfg = self.config
        if cfg.effective_rope_mode == RopeMode.INLINE:
            return ForwardError("token-tree attention does not support inline RoPE (rope_mode INLINE, or a cache "
                                "created with support_sliding_window)")
        if cfg.slides_sequences or cfg.has_layer_windows:
            return ForwardError("token-tree attention does not support sliding windows or chunked local layers")
        missing = self.kernels.missing(("attention_prefill_tree", "attention_prefill_ragged_tree"))
        if missing:
            return KVCacheError(f"token-tree steps need the {' and '.join(missing)} kernel(s), which this cache "
                                "was created without")
        return None

    def fused_qkv(self, step: Step, layer: int, qkv: tvm.runtime.Tensor, o: tvm.runtime.Tensor,
                  sm_scale: float) -> None:
        """Split ``qkv`` (n rows), append its K/V and attend (the order the step's plan says)."""
        k, dev = self.kernels, step.device
        if step is not self._decode[0]:
            self._decode = (step, self._decode_launches(step))
        pages, scales = self.pages[layer], self._scale_args[layer]
        decode = self._decode[1][layer]
        k.split_rotary(qkv, dev.q_rope_position, dev.q, dev.k, dev.v, self._split_rope_argument)
        if decode is not None:  # a plain decode step: append, then one decode kernel
            k.transpose_append(pages, dev.k, dev.v, dev.append_position, *scales)
            decode[0](dev.q, pages, *decode[1], o, dev.merged_lse, *self._rope, sm_scale, *scales)
            return
        if step.meta.append_before_attn:  # then attention reads the new K/V from the pages
            k.transpose_append(pages, dev.k, dev.v, dev.append_position, *scales)
            self.paged(step, layer, dev.q, o, dev.merged_lse, sm_scale, first=True)
        elif self._over_grown_pages(step, layer):  # plain prefill: one causal pass over the pages
            k.transpose_append(pages, dev.k, dev.v, dev.append_position, *scales)
            g = dev.grown
            k.attention_prefill(dev.q, dev.append_indptr, pages, g.page_indptr, g.page_indices, g.length_info,
                                g.k_rope_pos_offset, dev.q_rope_position, o, dev.merged_lse, 1, *self._rope, sm_scale,
                                *scales)
        else:
            self.attend(step, layer, dev.q, dev.k, dev.v, o, dev.merged_lse, sm_scale)
            k.transpose_append(pages, dev.k, dev.v, dev.append_position, *scales)

    def _decode_launches(self, step: Step) -> Tuple[Any, ...]:
        """Per layer, ``(decode kernel, its page views and q_rope_position)`` where the step
        attends by one decode kernel after appending (decode steps of one page depth); else None."""
        dev = step.device
        plain = (step.meta.append_before_attn and len(dev.depths) == 1 and dev.depths[0].use_decode_kernel
                 and dev.depths[0].tree is None)
        with_pages = [dev.depths_with_pages(windowed) for windowed in self.windowed]
        return tuple(self._decode_launch(sliding, depths[0][1], dev) if plain and len(depths) == 1 else None
                     for sliding, depths in zip(self._sliding, with_pages))

    def _decode_launch(self, sliding: bool, views: PageViews, dev: DeviceStep) -> Tuple[Any, Tuple[Any, ...]]:
        """``(decode kernel, its arguments after q and the pages, up to q_rope_position)``."""
        f = self.kernels.attention_decode_sliding_window if sliding else self.kernels.attention_decode
        return f, (views.page_indptr, views.page_indices, views.length_info, views.k_rope_pos_offset,
                   dev.q_rope_position)

    def attend(self, step: Step, layer: int, q, k, v, o, lse, sm_scale: float) -> None:
        """Attention of q over a layer's cached KV and the step's k/v, into (o, lse)."""
        if step.meta.append_before_attn:  # the new K/V are already in the pages
            self.paged(step, layer, q, o, lse, sm_scale, first=True)
        elif self._prefixed(step, layer):  # one kernel over the cached prefix and the new rows
            dev, cfg = step.device, self.config
            depth = dev.depths[0].pages
            self.kernels.attention_prefill_prefixed(
                q, dev.append_indptr, self.pages[layer], depth.page_indptr, depth.page_indices,
                depth.length_info, depth.k_rope_pos_offset, dev.q_rope_position, k, v, o, lse, 1,
                self.rotary_mode, cfg.rope_scale, cfg.rope_theta, sm_scale)
        else:
            self.ragged(step, layer, q, k, v, o, lse, sm_scale)
            self.paged(step, layer, q, o, lse, sm_scale, first=False)

    def _over_grown_pages(self, step: Step, layer: int) -> bool:
        """Whether a fused-QKV layer appends first and attends over ``step.device.grown`` (which
        the planner makes for plain prefill steps on our kernels, `metadata.GrownPages`): a
        global layer of such a step."""
        return step.device.grown is not None and not self.windowed[layer]

    def _prefixed(self, step: Step, layer: int) -> bool:
        """Whether ``attention_prefill_prefixed`` serves this step and layer (one plain page list
        per sequence)."""
        dev = step.device
        if (self.kernels.attention_prefill_prefixed is None or dev.ragged_tree is not None
                or len(dev.depths) != 1 or self.windowed[layer] or self.config.slides_sequences):
            return False
        depth = dev.depths[0]
        return (depth.pages.has_pages and not depth.use_decode_kernel and depth.tree is None
                and depth.qo_indptr.shape[0] == dev.append_indptr.shape[0])

    def run_depth(self, step: Step, layer: int, depth: DepthViews, views: PageViews, q, o, lse,
                  sm_scale: float) -> None:
        """Kernel choice and ``causal`` as in TVM (sliding-window variants where windows apply)."""
        k, dev = self.kernels, step.device
        sliding = self._sliding[layer]
        pages, scales = self.pages[layer], self._scale_args[layer]
        if depth.use_decode_kernel and depth.tree is None:
            f, args = self._decode_launch(sliding, views, dev)
            f(q, pages, *args, o, lse, *self._rope, sm_scale, *scales)
            return
        rope: Tuple[Any, ...] = (*self._rope, sm_scale)
        if depth.tree is not None:
            k.attention_prefill_tree(q, depth.qo_indptr, pages, views.page_indptr, views.page_indices,
                                     views.length_info, views.k_rope_pos_offset, dev.q_rope_position, o, lse,
                                     *rope, depth.tree.mn_indptr, depth.tree.mask, *scales)
        else:
            f = k.attention_prefill_sliding_window if sliding else k.attention_prefill
            causal = int(self.windowed[layer] and not step.meta.append_before_attn)
            f(q, depth.qo_indptr, pages, views.page_indptr, views.page_indices, views.length_info,
              views.k_rope_pos_offset, dev.q_rope_position, o, lse, causal, *rope, *scales)
