"""The roles of the kernels among TVM's creation arguments, and the checks of their signatures.

``paged_attention_kv_cache_create`` takes its kernels positionally (arguments 13 to 27, and our
optional 29th). A compiled TIR kernel checks its argument count before it reads anything: called
without arguments it raises ``TypeError: Expected N arguments when calling: `name(...)` `` and
touches nothing. :func:`parameter_count` reads N that way, so a kernel passed in a role whose
convention takes another count is refused at creation with an error that names its argument,
and the two tree-attention kernels (16 parameters over paged K/V, 14 over ragged K/V) are told
apart when they arrive in each other's place. Kernels whose count cannot be read (a Python
function) are left to the creation probe (:mod:`relax_kvcache.kernel_probe`).
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Dict, Optional, Tuple

from .errors import ConfigError

#: argument index -> (role in :class:`~relax_kvcache.kernel_set.KernelSet`, TVM's name for it)
CREATION_KERNELS: Dict[int, Tuple[str, str]] = {
    13: ("transpose_append", "f_transpose_append_mha"),
    14: ("transpose_append_mla", "f_transpose_append_mla"),
    15: ("attention_prefill_ragged", "f_attention_prefill_ragged"),
    16: ("attention_prefill", "f_attention_prefill"),
    17: ("attention_decode", "f_attention_decode"),
    18: ("attention_prefill_sliding_window", "f_attention_prefill_sliding_window"),
    19: ("attention_decode_sliding_window", "f_attention_decode_sliding_window"),
    20: ("attention_prefill_tree", "f_attention_prefill_with_tree_mask_paged_kv"),
    21: ("attention_prefill_ragged_tree", "f_attention_prefill_with_tree_mask"),
    22: ("attention_prefill_mla", "f_mla_prefill"),
    23: ("merge_inplace", "f_merge_inplace"),
    24: ("split_rotary", "f_split_rotary"),
    25: ("copy_single_page", "f_copy_single_page"),
    26: ("debug_get_kv", "f_debug_get_kv"),
    27: ("compact_copy", "f_compact_copy"),
    28: ("attention_prefill_ragged_sliding_window", "f_attention_prefill_ragged_sliding_window"),
}

#: parameters of each role's kernel (TVM's conventions; debug_get_kv and copy_single_page take
#: the latent page layout's arguments in MLA caches)
PARAMETER_COUNTS: Dict[str, Tuple[int, ...]] = {
    "transpose_append": (4,), "transpose_append_mla": (3,), "attention_prefill_ragged": (14,),
    "attention_prefill": (15,), "attention_decode": (13,), "attention_prefill_sliding_window": (15,),
    "attention_decode_sliding_window": (13,), "attention_prefill_tree": (16,),
    "attention_prefill_ragged_tree": (14,), "attention_prefill_mla": (10,), "merge_inplace": (4,),
    "merge_general": (4,), "split_rotary": (6,), "copy_single_page": (4,), "debug_get_kv": (4, 5),
    "compact_copy": (4,), "attention_prefill_ragged_sliding_window": (14,),
}

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
