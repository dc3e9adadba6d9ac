"""Kernel set specs: what the kernels of a cache configuration depend on (typed specs of
:mod:`relax_kvcache.tir_kernels`), and their PrimFuncs through the catalogue's factories."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Dict, Optional, Tuple, Union

from .config import KVCacheConfig, LayerSpan
from .errors import ConfigError
from .kernel_roles import KERNEL_ROLES, MLA_KERNEL_ROLES, ROLES

if TYPE_CHECKING:  # the factories need TVMScript, which a runtime-only TVM lacks
    from tvm import tirx

    from . import tir_kernels as tk


class _SetSpec:
    """The roles of a set spec and their PrimFuncs (``_FACTORY``: the catalogue's factory field)."""

    _FACTORY = "mha"

    def roles(self) -> Tuple[str, ...]:
        """Roles of the kernels in the set, in :data:`KERNEL_ROLES` order."""
        return tuple(role for role in KERNEL_ROLES
                     if not ROLES[role].requires or getattr(self, ROLES[role].requires))

    def kernel_functions(self, sched: tk.schedule.Schedule) -> Dict[str, tirx.PrimFunc]:
        """The PrimFuncs of the set, keyed by role (:meth:`roles`)."""
        return {role: self.kernel_function(role, sched) for role in self.roles()}

    def kernel_function(self, role: str, sched: tk.schedule.Schedule) -> tirx.PrimFunc:
        """The PrimFunc of one role of the set (one of :meth:`roles`)."""
        if role not in self.roles():
            raise ValueError(f"{role!r} is not a kernel role of this set; expected one of "
                             f"{self.roles()}")
        factory = getattr(ROLES[role], self._FACTORY)
        from . import tir_kernels as tk

        return getattr(tk, factory.function)(getattr(self, factory.spec), sched)


def _longrope_spec(config: KVCacheConfig) -> Optional[tk.LongRopeSpec]:
    """The LongRoPE spec of ``config``'s split_rotary (None without ``rope_ext_factors``)."""
    if config.rope_ext_factors is None:
        return None
    if config.rope_original_max_position_embeddings is None:
        raise ConfigError("building LongRoPE kernels needs KVCacheConfig."
                          "rope_original_max_position_embeddings (the position from which the "
                          "long factors apply), got None")
    from . import tir_kernels as tk

    return tk.LongRopeSpec(original_max_position_embeddings=config.rope_original_max_position_embeddings,
                           attention_factor=config.rope_attention_factor)


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelSetSpec(_SetSpec):
    """What the kernels of a cache depend on (nothing else of the config enters the key)."""

    page: tk.PageLayoutSpec
    rope: tk.RopeSplitSpec
    merge: tk.MergeSpec
    attention: tk.AttentionSpec
    sliding_window: bool
    layer_span: LayerSpan = LayerSpan()

    @classmethod
    def from_config(cls, config: KVCacheConfig) -> "KernelSetSpec":
        if config.is_mla:
            raise ValueError("an MLA configuration has an MLAKernelSetSpec; use kernel_set_spec(config)")
        from . import tir_kernels as tk

        return cls(
            page=tk.PageLayoutSpec(num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                                   page_size=config.page_size, dtype=config.dtype, kv_dtype=config.kv_dtype),
            rope=tk.RopeSplitSpec(
                num_qo_heads=config.num_qo_heads, num_kv_heads=config.num_kv_heads,
                head_dim=config.head_dim, dtype=config.dtype, rope_theta=config.rope_theta,
                rope_scale=config.rope_scale, longrope=_longrope_spec(config),
                rotary_dim=None if config.rotary_dim == config.head_dim else config.rotary_dim,
                interleaved=config.rope_interleaved),
            merge=tk.MergeSpec(num_heads=config.num_qo_heads, head_dim=config.v_head_dim,
                               dtype=config.dtype),
            attention=tk.AttentionSpec(
                num_qo_heads=config.num_qo_heads, num_kv_heads=config.num_kv_heads,
                qk_head_dim=config.head_dim, v_head_dim=config.v_head_dim, dtype=config.dtype,
                page_size=config.page_size, kv_dtype=config.kv_dtype),
            sliding_window=config.support_sliding_window or config.has_layer_windows,
            layer_span=config.layer_span,
        )

    #: roles whose kernels read pages of the model dtype only (none in a set over 8-bit pages)
    MODEL_DTYPE_ROLES = ("attention_prefill_prefixed",)

    def roles(self) -> Tuple[str, ...]:
        """Roles of the kernels in the set (:data:`KERNEL_ROLES` order; over 8-bit pages without
        :attr:`MODEL_DTYPE_ROLES`)."""
        roles = super().roles()
        return tuple(r for r in roles if r not in self.MODEL_DTYPE_ROLES) if self.page.quantized else roles

    @property
    def windowed(self) -> tk.AttentionSpec:
        """The attention of the ``_sliding_window`` kernels: ``[3, B]`` length info, and keys
        outside what each query sees masked in local layers (``layer_span``)."""
        return dataclasses.replace(self.attention, sliding_window=True, window=self.layer_span.window,
                                   attention_chunk=self.layer_span.chunk)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLAKernelSetSpec(_SetSpec):
    """What the kernels of an MLA cache depend on: the ``latent`` page layout, ``absorbed``
    attention over the one latent head, ``ragged`` self-attention at the decompressed head dims
    (docs/kernels.md)."""

    latent: tk.LatentPageSpec
    absorbed: tk.AttentionSpec
    ragged: tk.AttentionSpec
    _FACTORY = "mla"

    @classmethod
    def from_config(cls, config: KVCacheConfig) -> "MLAKernelSetSpec":
        if not config.is_mla:
            raise ValueError("MLAKernelSetSpec needs an MLA configuration; use kernel_set_spec(config)")
        if config.mla_original_qk_head_dim is None:
            raise ConfigError("building MLA kernels needs KVCacheConfig.mla_original_qk_head_dim "
                              "and mla_original_v_head_dim (the decompressed self-attention head "
                              "dims), got None")
        from . import tir_kernels as tk

        hq, dtype, ps = config.num_qo_heads, config.dtype, config.page_size
        return cls(
            latent=tk.LatentPageSpec(width=config.head_dim, page_size=ps, dtype=dtype, kv_dtype=config.kv_dtype),
            absorbed=tk.AttentionSpec(num_qo_heads=hq, num_kv_heads=1, qk_head_dim=config.head_dim,
                                      v_head_dim=config.v_head_dim, dtype=dtype, page_size=ps,
                                      kv_dtype=config.kv_dtype),
            ragged=tk.AttentionSpec(num_qo_heads=hq, num_kv_heads=hq, dtype=dtype, page_size=ps,
                                    qk_head_dim=config.mla_original_qk_head_dim,
                                    v_head_dim=config.mla_original_v_head_dim),
        )

    @property
    def attention(self) -> tk.AttentionSpec:
        """The attention over the cache's pages (for messages and benchmarks)."""
        return self.absorbed

    def _merge(self, attention: tk.AttentionSpec) -> tk.MergeSpec:
        from . import tir_kernels as tk

        return tk.MergeSpec(num_heads=self.absorbed.num_qo_heads, head_dim=attention.v_head_dim,
                            dtype=self.absorbed.dtype)

    #: ``merge_inplace``: absorbed-attention outputs (``kv_lora_rank`` wide)
    absorbed_merge = property(lambda self: self._merge(self.absorbed))
    #: ``merge_general``: at the decompressed v head dim
    ragged_merge = property(lambda self: self._merge(self.ragged))

    def roles(self) -> Tuple[str, ...]:
        """Roles of the kernels in the set: :data:`MLA_KERNEL_ROLES`."""
        return MLA_KERNEL_ROLES


AnyKernelSetSpec = Union[KernelSetSpec, MLAKernelSetSpec]


def kernel_set_spec(config: KVCacheConfig) -> AnyKernelSetSpec:
    """The kernel set spec of a configuration (:class:`MLAKernelSetSpec` for MLA caches)."""
    return (MLAKernelSetSpec if config.is_mla else KernelSetSpec).from_config(config)

