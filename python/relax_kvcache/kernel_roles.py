"""What a kernel library holds: the catalogue of kernel roles (creation argument, TVM's name,
parameter counts, our factories) and the library's identity (:func:`kernel_identity`). No TVM."""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

from .config import KV_DTYPE_CODES, SUPPORTED_DTYPES, KVCacheConfig
from .errors import ConfigError


class Factory(NamedTuple):
    """``tir_kernels.<function>(<set spec>.<spec>, schedule)``."""

    function: str
    spec: str


@dataclasses.dataclass(frozen=True)
class Role:
    """One kernel role: a KernelSet field and library function ``name``, its creation ``argument``
    (None: not one), TVM's ``parameters`` counts (empty: ours only), our factories, the
    multi-head spec attribute it ``requires`` (None: always there), and whether it is a ``host``
    function (no device kernel)."""

    name: str
    argument: Optional[int]
    tvm_name: Optional[str]
    parameters: Tuple[int, ...]
    mha: Optional[Factory] = None
    mla: Optional[Factory] = None
    requires: Optional[str] = None
    host: bool = False


#: Every role, in the order the cache uses them.
CATALOGUE: Tuple[Role, ...] = (
    Role("transpose_append", 13, "f_transpose_append_mha", (4,), mha=Factory("make_transpose_append", "page")),
    Role("transpose_append_mla", 14, "f_transpose_append_mla", (3,), mla=Factory("make_transpose_append_mla", "latent")),
    Role("split_rotary", 24, "f_split_rotary", (6,), mha=Factory("make_split_rotary", "rope")),
    Role("copy_single_page", 25, "f_copy_single_page", (4,), mha=Factory("make_copy_single_page", "page"),
         mla=Factory("make_copy_single_page_mla", "latent")),
    Role("compact_copy", 27, "f_compact_copy", (4,), mha=Factory("make_compact_copy", "page")),
    Role("debug_get_kv", 26, "f_debug_get_kv", (4, 5), mha=Factory("make_debug_get_kv", "page"),
         mla=Factory("make_debug_get_kv_mla", "latent")),
    Role("merge_inplace", 23, "f_merge_inplace", (4,), mha=Factory("make_merge_inplace", "merge"),
         mla=Factory("make_merge_inplace", "absorbed_merge")),
    Role("merge_general", None, None, (4,), mla=Factory("make_merge_inplace", "ragged_merge")),
    Role("attention_prefill_ragged", 15, "f_attention_prefill_ragged", (14,),
         mha=Factory("make_ragged_prefill", "attention"), mla=Factory("make_ragged_prefill", "ragged")),
    Role("attention_prefill", 16, "f_attention_prefill", (15,), mha=Factory("make_paged_prefill", "attention")),
    Role("attention_decode", 17, "f_attention_decode", (13,), mha=Factory("make_paged_decode", "attention")),
    Role("attention_prefill_sliding_window", 18, "f_attention_prefill_sliding_window", (15,),
         mha=Factory("make_paged_prefill", "windowed"), requires="sliding_window"),
    Role("attention_decode_sliding_window", 19, "f_attention_decode_sliding_window", (13,),
         mha=Factory("make_paged_decode", "windowed"), requires="sliding_window"),
    Role("attention_prefill_ragged_sliding_window", 28, "f_attention_prefill_ragged_sliding_window", (14,),
         mha=Factory("make_ragged_prefill", "windowed"), requires="layer_span"),
    Role("attention_prefill_ragged_tree", 21, "f_attention_prefill_with_tree_mask", (14,),
         mha=Factory("make_ragged_tree_prefill", "attention")),
    Role("attention_prefill_tree", 20, "f_attention_prefill_with_tree_mask_paged_kv", (16,),
         mha=Factory("make_paged_tree_prefill", "attention")),
    #: ours only (a 30th creation argument, which TVM does not pass): attention over a cached
    #: prefix and the step's own K/V in one kernel
    Role("attention_prefill_prefixed", 29, "f_attention_prefill_prefixed", (17,),
         mha=Factory("make_prefixed_prefill", "attention")),
    Role("attention_prefill_mla", 22, "f_mla_prefill", (10,), mla=Factory("make_paged_mla", "absorbed")),
    #: ours only (a 31st creation argument): ``check_fused_qkv(qkv, o, position_map)``, a host
    #: function whose argument binding checks an ``attention_with_fused_qkv`` call's tensors
    Role("check_fused_qkv", 30, "f_check_fused_qkv", (3,), mha=Factory("make_fused_qkv_check", "rope"),
         host=True),
)

ROLES: Dict[str, Role] = {role.name: role for role in CATALOGUE}
#: Roles of the kernels of a multi-head set, in the order the cache uses them.
KERNEL_ROLES: Tuple[str, ...] = tuple(role.name for role in CATALOGUE if role.mha)
#: Roles of host functions (no device kernel).
HOST_ROLES: Tuple[str, ...] = tuple(role.name for role in CATALOGUE if role.host)
#: Roles of the kernels of an MLA set (``debug_get_kv`` with the latent layout).
MLA_KERNEL_ROLES: Tuple[str, ...] = tuple(role.name for role in CATALOGUE if role.mla)
#: argument index -> (role, TVM's name for it)
CREATION_KERNELS: Dict[int, Tuple[str, str]] = {
    role.argument: (role.name, role.tvm_name)
    for role in sorted(CATALOGUE, key=lambda role: role.argument or -1) if role.argument}
#: parameters of each role's kernel (TVM's conventions)
PARAMETER_COUNTS: Dict[str, Tuple[int, ...]] = {
    role.name: role.parameters for role in CATALOGUE if role.parameters}

#: roles whose kernels over 8-bit pages take ``kv_scales`` as one more, last, argument
SCALED_ROLES = ("transpose_append", "debug_get_kv", "attention_prefill", "attention_decode",
                "attention_prefill_sliding_window", "attention_decode_sliding_window", "attention_prefill_tree",
                "transpose_append_mla", "attention_prefill_mla")

_EXPECTED = re.compile(r"Expected (\d+) arguments when calling")
_TREE_PAGED, _TREE_RAGGED = 20, 21


def label(index: int, item: Optional[int] = None) -> str:
    """``"argument 20 (f_attention_prefill_with_tree_mask_paged_kv)"``; ``item``: a list entry."""
    name = CREATION_KERNELS[index][1] + ("" if item is None else f"[{item}]")
    return f"argument {index} ({name})"


def parameter_count(kernel: Any) -> Optional[int]:
    """The argument count a compiled kernel checks for, read off the ``TypeError`` it raises
    (touching nothing) when called without arguments; None where it raises nothing else."""
    try:
        kernel()
    except TypeError as err:
        match = _EXPECTED.search(str(err))
        return int(match.group(1)) if match else None
    except Exception:  # noqa: BLE001 - a foreign callable refusing an empty call its own way
        return None
    return None


def check_role(role: str, kernel: Any, where: str, quantized: bool = False) -> None:
    """Refuse ``kernel`` for ``role`` (``ConfigError`` naming ``where``, the creation argument)
    when its parameter count is known and not the role's (``quantized``: over 8-bit pages,
    :data:`SCALED_ROLES` take one more)."""
    count = parameter_count(kernel)
    expected = tuple(n + (quantized and role in SCALED_ROLES) for n in PARAMETER_COUNTS[role])
    if count is not None and count not in expected:
        fits = [other for other, counts in PARAMETER_COUNTS.items() if count in counts and other != role]
        hint = f" (as {', '.join(fits[:3])} kernels take)" if fits else ""
        raise ConfigError(f"paged_attention_kv_cache_create: {where} is a kernel of {count} "
                          f"parameters{hint}; expected the {role} kernel, of "
                          f"{' or '.join(map(str, expected))} parameters (TVM's convention for this "
                          f"argument{', with kv_scales' if quantized and role in SCALED_ROLES else ''})")


def order_tree_kernels(paged: Any, ragged: Any) -> Tuple[Any, Any, bool]:
    """Arguments 20 (paged) and 21 (ragged tree attention) in their roles: ``(paged, ragged,
    swapped)``; swapped back, with a warning, where the parameter counts show TVM 0.27's
    ``llvm`` order (docs/compatibility.md)."""
    if paged is None or ragged is None:
        return paged, ragged, False
    if (parameter_count(paged), parameter_count(ragged)) != (
            PARAMETER_COUNTS["attention_prefill_ragged_tree"][0],
            PARAMETER_COUNTS["attention_prefill_tree"][0]):
        return paged, ragged, False
    warnings.warn(f"paged_attention_kv_cache_create: {label(_TREE_PAGED)} holds the ragged "
                  f"tree-attention kernel and {label(_TREE_RAGGED)} the paged one (the order of "
                  "TVM 0.27's TIRPagedKVCache for llvm targets); each is used in its own role",
                  stacklevel=3)
    return ragged, paged, True


#: Prefix of the functions of a built library that return its :func:`kernel_identity`.
IDENTITY_PREFIX = "kernel_spec_"
#: The fields of :func:`kernel_identity`, in order.
IDENTITY_FIELDS = (
    "mla", "dtype", "page_size", "num_qo_heads", "num_kv_heads", "head_dim", "v_head_dim",
    "mla_original_qk_head_dim", "mla_original_v_head_dim", "rope_theta", "rope_scale",
    "sliding_window", "layer_sliding_window_size", "longrope_original_max_position",
    "longrope_attention_factor", "rope_rotary_dim", "rope_interleaved", "attention_chunk_size", "kv_dtype")


def kernel_identity(config: KVCacheConfig) -> Dict[str, float]:
    """What ``config``'s kernels depend on, from the config alone (a runtime-only host has no
    specs): the dtype as its index in ``SUPPORTED_DTYPES``, ``kv_dtype`` as its index in
    ``KV_DTYPE_CODES``, flags 0 / 1, fields that do not apply 0. A library returns each from
    ``kernel_spec_<field>()``."""
    cfg, mla = config, config.is_mla
    longrope = cfg.rope_ext_factors is not None  # split_rotary takes the factors tensor
    return {
        "mla": int(mla), "dtype": SUPPORTED_DTYPES.index(cfg.dtype), "page_size": cfg.page_size,
        "num_qo_heads": cfg.num_qo_heads, "num_kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "v_head_dim": cfg.v_head_dim,
        "mla_original_qk_head_dim": (cfg.mla_original_qk_head_dim or 0) if mla else 0,
        "mla_original_v_head_dim": (cfg.mla_original_v_head_dim or 0) if mla else 0,
        "rope_theta": 0.0 if mla else float(cfg.rope_theta),
        "rope_scale": 0.0 if mla else float(cfg.rope_scale),
        "sliding_window": int(not mla and (cfg.support_sliding_window or cfg.has_layer_windows)),
        "layer_sliding_window_size": cfg.layer_span.window,
        "attention_chunk_size": cfg.layer_span.chunk,
        "longrope_original_max_position":
            (cfg.rope_original_max_position_embeddings or 0) if longrope else 0,
        "longrope_attention_factor": cfg.rope_attention_factor if longrope else 0.0,
        "rope_rotary_dim": 0 if mla else cfg.rotary_dim,
        "rope_interleaved": int(cfg.rope_interleaved),
        "kv_dtype": KV_DTYPE_CODES.index(cfg.kv_dtype),
    }


def read_identity(get: Callable[[str], Optional[Any]]) -> Optional[Tuple[Tuple[str, float], ...]]:
    """A library's ``kernel_spec_<field>`` values as (field, value) pairs, through ``get`` (name ->
    function or None); None where one is missing (TVM's kernels)."""
    functions = [(name, get(IDENTITY_PREFIX + name)) for name in IDENTITY_FIELDS]
    if any(f is None for _, f in functions):
        return None
    return tuple((name, f()) for name, f in functions)
