"""The catalogue of kernel roles, and the checks of kernels passed as TVM's creation arguments.

:data:`CATALOGUE` is the one list of the roles a :class:`~relax_kvcache.kernel_set.KernelSet`
holds: for each, its place among the creation arguments of ``paged_attention_kv_cache_create``
(arguments 13 to 27, and our optional 29th) and TVM's name for it, the parameter counts of
TVM's convention, and the factory that builds our kernel for it in a multi-head
(:class:`~relax_kvcache.kernel_specs.KernelSetSpec`) or MLA set
(:class:`~relax_kvcache.kernel_specs.MLAKernelSetSpec`). :data:`KERNEL_ROLES`,
:data:`MLA_KERNEL_ROLES`, :data:`CREATION_KERNELS` and :data:`PARAMETER_COUNTS` are derived from it.
Factories are named, not imported: this module needs no TVM.

A compiled TIR kernel checks its argument count before it reads anything: called without
arguments it raises ``TypeError: Expected N arguments when calling: `name(...)` `` and touches
nothing. :func:`parameter_count` reads N that way, so a kernel passed in a role whose convention
takes another count is refused at creation with an error that names its argument, and the two
tree-attention kernels (16 parameters over paged K/V, 14 over ragged K/V) are told apart when
they arrive in each other's place. Kernels whose count cannot be read (a Python function) are
left to the creation probe (:mod:`relax_kvcache.kernel_probe`).
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Any, Dict, NamedTuple, Optional, Tuple

from .errors import ConfigError


class Factory(NamedTuple):
    """A kernel factory of :mod:`relax_kvcache.tir_kernels` (``function``), called with the set
    spec's attribute ``spec`` and a schedule."""

    function: str
    spec: str


@dataclasses.dataclass(frozen=True)
class Role:
    """One kernel role.

    Attributes
    ----------
    name : str
        The role (a :class:`~relax_kvcache.kernel_set.KernelSet` field, a library function name).
    argument : int or None
        Its index among TVM's creation arguments (None: not one of them; ``merge_general`` is the
        second entry of argument 23).
    tvm_name : str or None
        TVM's name for that argument.
    parameters : tuple of int
        The parameter counts of TVM's convention for it (empty: ours only).
    mha, mla : Factory or None
        Our kernel for it in a multi-head or MLA set (None: not in such a set).
    requires : str or None
        A multi-head set spec's attribute that must be true for the set to have the role.
    """

    name: str
    argument: Optional[int]
    tvm_name: Optional[str]
    parameters: Tuple[int, ...]
    mha: Optional[Factory] = None
    mla: Optional[Factory] = None
    requires: Optional[str] = None


#: Every role, in the order the cache uses them (the order of :data:`KERNEL_ROLES` and
#: :data:`MLA_KERNEL_ROLES`).
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
    #: ours only: attention over a cached prefix and the step's own K/V in one kernel
    Role("attention_prefill_prefixed", None, None, (), mha=Factory("make_prefixed_prefill", "attention")),
    Role("attention_prefill_mla", 22, "f_mla_prefill", (10,), mla=Factory("make_paged_mla", "absorbed")),
)

#: role name -> :class:`Role`
ROLES: Dict[str, Role] = {role.name: role for role in CATALOGUE}

#: Roles of the kernels of a multi-head set, in the order the cache uses them.
KERNEL_ROLES: Tuple[str, ...] = tuple(role.name for role in CATALOGUE if role.mha)

#: Roles of the kernels of an MLA set (``debug_get_kv`` with the latent layout).
MLA_KERNEL_ROLES: Tuple[str, ...] = tuple(role.name for role in CATALOGUE if role.mla)

#: argument index -> (role in :class:`~relax_kvcache.kernel_set.KernelSet`, TVM's name for it)
CREATION_KERNELS: Dict[int, Tuple[str, str]] = {
    role.argument: (role.name, role.tvm_name)
    for role in sorted(CATALOGUE, key=lambda role: role.argument if role.argument is not None else -1)
    if role.argument is not None}

#: parameters of each role's kernel (TVM's conventions; debug_get_kv and copy_single_page take
#: the latent page layout's arguments in MLA caches)
PARAMETER_COUNTS: Dict[str, Tuple[int, ...]] = {role.name: role.parameters for role in CATALOGUE if role.parameters}

_EXPECTED = re.compile(r"Expected (\d+) arguments when calling")
_TREE_PAGED, _TREE_RAGGED = 20, 21


def label(index: int, item: Optional[int] = None) -> str:
    """``"argument 20 (f_attention_prefill_with_tree_mask_paged_kv)"``; ``item`` names an entry of
    the list argument 23."""
    name = CREATION_KERNELS[index][1] + ("" if item is None else f"[{item}]")
    return f"argument {index} ({name})"


def parameter_count(kernel: Any) -> Optional[int]:
    """The argument count a compiled kernel checks for, read off the ``TypeError`` it raises when
    called without arguments; None where it raises nothing or something else."""
    try:
        kernel()
    except TypeError as err:
        match = _EXPECTED.search(str(err))
        return int(match.group(1)) if match else None
    except Exception:  # noqa: BLE001 - a foreign callable refusing an empty call its own way
        return None
    return None


def check_role(role: str, kernel: Any, where: str) -> None:
    """Refuse ``kernel`` for ``role`` when its parameter count is known and not the role's.

    Raises
    ------
    ConfigError
        Naming ``where`` (the creation argument), the kernel's count and the role's.
    """
    count = parameter_count(kernel)
    expected = PARAMETER_COUNTS[role]
    if count is not None and count not in expected:
        fits = [other for other, counts in PARAMETER_COUNTS.items() if count in counts and other != role]
        hint = f" (as {', '.join(fits[:3])} kernels take)" if fits else ""
        raise ConfigError(f"paged_attention_kv_cache_create: {where} is a kernel of {count} parameters{hint}; "
                          f"expected the {role} kernel, of {' or '.join(map(str, expected))} parameters "
                          "(TVM's convention for this argument)")


def order_tree_kernels(paged: Optional[Any], ragged: Optional[Any]) -> Tuple[Optional[Any], Optional[Any], bool]:
    """Arguments 20 (paged) and 21 (ragged tree attention) in their roles: ``(paged, ragged,
    swapped)``. TVM 0.27's ``TIRPagedKVCache`` passes them the other way round for ``llvm``
    targets (its CUDA path and its C++ cache use this order); a pair whose parameter counts say
    so is swapped back, with a warning."""
    if paged is None or ragged is None:
        return paged, ragged, False
    counts = parameter_count(paged), parameter_count(ragged)
    if counts != (PARAMETER_COUNTS["attention_prefill_ragged_tree"][0], PARAMETER_COUNTS["attention_prefill_tree"][0]):
        return paged, ragged, False
    warnings.warn(f"paged_attention_kv_cache_create: {label(_TREE_PAGED)} holds the ragged tree-attention kernel and "
                  f"{label(_TREE_RAGGED)} the paged one (the order of TVM 0.27's TIRPagedKVCache for llvm targets); "
                  "each is used in its own role", stacklevel=3)
    return ragged, paged, True
