"""The packed functions a cache calls, by role: ours (built) or any with TVM's conventions."""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import tvm

from . import kernel_roles as roles
from .config import RopeMode
from .errors import ConfigError
from .tensors import allocate

Function = Any  # a tvm_ffi.Function (or any callable with the same convention)


@dataclasses.dataclass(frozen=True)
class KernelSet:
    """Kernels by role (one field per role of :data:`relax_kvcache.kernel_roles.CATALOGUE`), with
    TVM's argument conventions (docs/kernels.md). ``merge_general`` is the merge of
    ``merge_attn_output_inplace`` (TVM's second merge function); optional roles are None when
    absent. Not picklable: ship a library (``export_kernels``, ``deploy.load``,
    :meth:`from_module`).
    """

    transpose_append: Optional[Function]
    split_rotary: Optional[Function]
    copy_single_page: Function
    compact_copy: Optional[Function]
    debug_get_kv: Optional[Function]
    merge_inplace: Function
    merge_general: Function
    attention_prefill_ragged: Optional[Function]
    attention_prefill: Optional[Function]
    attention_decode: Optional[Function]
    attention_prefill_sliding_window: Optional[Function] = None
    attention_decode_sliding_window: Optional[Function] = None
    attention_prefill_ragged_sliding_window: Optional[Function] = None
    attention_prefill_ragged_tree: Optional[Function] = None
    attention_prefill_tree: Optional[Function] = None
    transpose_append_mla: Optional[Function] = None
    attention_prefill_mla: Optional[Function] = None
    #: ours only: attention over a cached prefix and the step's own K/V in one kernel
    attention_prefill_prefixed: Optional[Function] = None
    #: ours only: checks ``attention_with_fused_qkv``'s tensors in one host call
    check_fused_qkv: Optional[Function] = None
    #: :func:`relax_kvcache.build.kernel_identity` pairs of the config the kernels were built
    #: for; set only by :meth:`from_module` (a replaced or foreign set is probed instead)
    identity: Optional[Tuple[Tuple[str, float], ...]] = dataclasses.field(default=None, init=False)
    #: (role, creation argument) pairs of a set made by :meth:`from_creation_args`
    sources: Optional[Tuple[Tuple[str, str], ...]] = dataclasses.field(default=None, init=False)

    def missing(self, roles: Sequence[str]) -> List[str]:
        """The roles among ``roles`` this set has no kernel for."""
        return [role for role in roles if not callable(getattr(self, role))]

    @classmethod
    def from_module(cls, mod: tvm.runtime.Module) -> "KernelSet":
        """Our kernel set from :func:`relax_kvcache.build_kernels`."""
        def get(role: str) -> Optional[Function]:
            found = mod.implements_function(role, query_imports=True)
            return mod.get_function(role, query_imports=True) if found else None

        found = {role.name: get(role.name) for role in roles.CATALOGUE}
        found["merge_general"] = found["merge_general"] or found["merge_inplace"]
        kernels = cls(**found)
        object.__setattr__(kernels, "identity", roles.read_identity(get))
        return kernels

    @classmethod
    def from_creation_args(cls, args: Sequence[Any], quantized: bool = False) -> "KernelSet":
        """Kernels from the positional arguments 13..27 of ``paged_attention_kv_cache_create``
        and the optional 29th to 31st (ours: the windowed ragged kernel, the prefixed prefill
        kernel, ``check_fused_qkv``); a kernel whose parameter count is not its role's is refused,
        naming its argument."""
        merges = _list(args[23], 23)
        if not merges:
            raise ConfigError("paged_attention_kv_cache_create: argument 23 (merge functions) is "
                              "empty; at least one merge_inplace function is required")
        kernels = {index: (_attention(args[index], index) if 15 <= index <= 22 or 28 <= index <= 29 else
                           None if args[index] is None else _function(args[index], index))
                   for index in roles.CREATION_KERNELS if index != 23 and index < len(args)}
        kernels[25] = _function(args[25], 25)
        sources = {role: roles.label(index) for index, (role, _) in roles.CREATION_KERNELS.items()}
        kernels[20], kernels[21], swapped = roles.order_tree_kernels(kernels[20], kernels[21])
        if swapped:
            sources.update(attention_prefill_tree=roles.label(21),
                           attention_prefill_ragged_tree=roles.label(20))
        found = {roles.CREATION_KERNELS[index][0]: kernel for index, kernel in kernels.items()}
        found["merge_inplace"] = _function(merges[0], 23)
        found["merge_general"] = _function(merges[1] if len(merges) > 1 else merges[0], 23)
        sources["merge_inplace"] = roles.label(23, 0)
        sources["merge_general"] = roles.label(23, 1 if len(merges) > 1 else 0)
        for role, kernel in found.items():
            if kernel is not None:
                roles.check_role(role, kernel, sources[role], quantized)
        kernel_set = cls(**found)
        object.__setattr__(kernel_set, "sources", tuple(sorted(sources.items())))
        return kernel_set

    def source(self, role: str) -> Optional[str]:
        """The creation argument a role's kernel came from, or None."""
        return dict(self.sources or ()).get(role)

    def origin(self, role: str) -> str:
        """``"creation <source>: "`` (a prefix for messages), or "" where :meth:`source` is None."""
        where = self.source(role)
        return f"creation {where}: " if where else ""


def split_rotary_rope_argument(config: Any, device: tvm.runtime.Device) -> Any:
    """The last argument of ``split_rotary`` (TVM's convention): the LongRoPE factors on
    ``device``, else the apply-RoPE flag (1 in NORMAL mode)."""
    if config.rope_ext_factors is None:
        return int(config.effective_rope_mode == RopeMode.NORMAL)
    factors = allocate((config.rotary_dim,), "float32", device, "RoPE extension factors")
    factors.copyfrom(np.array(config.rope_ext_factors, dtype=np.float32))
    return factors


def _list(value: Any, index: int) -> list:
    """A list argument (None: empty)."""
    if value is None:
        return []
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ConfigError(f"paged_attention_kv_cache_create: argument {index} must be a list, "
                          f"got {type(value).__name__}")
    return list(value)


def _function(value: Any, index: int) -> Function:
    if not callable(value):
        raise ConfigError(f"paged_attention_kv_cache_create: argument {index} must be a packed "
                          f"function, got {type(value).__name__}")
    return value


def _attention(value: Any, index: int) -> Optional[Function]:
    """An attention backend entry: ``[]`` (absent) or ``["tirx", f]`` (also the older ``"tir"``)."""
    entry = _list(value, index)
    if not entry:
        return None
    backend = str(entry[0])
    if backend in ("tirx", "tir") and len(entry) == 2:
        return _function(entry[1], index)
    if backend == "flashinfer":
        raise NotImplementedError(
            f"paged_attention_kv_cache_create: argument {index} uses the FlashInfer backend, which "
            "relax_kvcache does not support; pass TIR kernels ([\"tirx\", f])")
    raise ConfigError(f"paged_attention_kv_cache_create: argument {index} must be [] or "
                      f"[\"tirx\", f], got {entry!r}")
