"""Our TIR kernels: TVMScript factories keyed by typed specs, scheduled per target."""

from .attention import (
    make_paged_decode,
    make_paged_prefill,
    make_paged_tree_prefill,
    make_ragged_prefill,
    make_ragged_tree_prefill,
)
from .attention_mla import make_paged_mla
from .attention_prefixed import make_prefixed_prefill
from .merge import make_merge_inplace
from .page_ops import (
    make_compact_copy,
    make_copy_single_page,
    make_copy_single_page_mla,
    make_debug_get_kv,
    make_debug_get_kv_mla,
    make_transpose_append,
    make_transpose_append_mla,
)
from .rope import make_fused_qkv_check, make_split_rotary
from .schedule import CpuSchedule, schedule_for
from .spec import AttentionSpec, LatentPageSpec, LayerSpan, LongRopeSpec, MergeSpec, PageLayoutSpec, RopeSplitSpec

__all__ = [
    "AttentionSpec",
    "LayerSpan",
    "CpuSchedule",
    "LatentPageSpec",
    "LongRopeSpec",
    "MergeSpec",
    "PageLayoutSpec",
    "RopeSplitSpec",
    "make_compact_copy",
    "make_copy_single_page",
    "make_copy_single_page_mla",
    "make_debug_get_kv",
    "make_debug_get_kv_mla",
    "make_fused_qkv_check",
    "make_merge_inplace",
    "make_paged_decode",
    "make_paged_mla",
    "make_paged_prefill",
    "make_paged_tree_prefill",
    "make_prefixed_prefill",
    "make_ragged_prefill",
    "make_ragged_tree_prefill",
    "make_split_rotary",
    "make_transpose_append",
    "make_transpose_append_mla",
    "schedule_for",
]
