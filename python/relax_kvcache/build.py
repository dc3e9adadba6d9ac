"""Compile the kernel set of a cache configuration for a target, with an on-disk cache.

The kernel set is one IRModule whose functions are named by role (``KERNEL_ROLES``); it is
compiled once per (kernel specs, target, TVM version, kernel sources) and stored as a shared
library under :func:`cache_dir`. Later builds load that library instead of compiling.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import tempfile
from typing import Callable, Dict, Optional

import tvm
from tvm import tirx

from . import tir_kernels as tk
from .config import AttnKind, KVCacheConfig

#: Roles of the kernels in a set, in the order the cache uses them.
KERNEL_ROLES = (
    "transpose_append",
    "split_rotary",
    "copy_single_page",
    "compact_copy",
    "debug_get_kv",
    "merge_inplace",
    "attention_prefill_ragged",
    "attention_prefill",
    "attention_decode",
    "attention_prefill_sliding_window",
    "attention_decode_sliding_window",
    "attention_prefill_ragged_sliding_window",
    "attention_prefill_ragged_tree",
    "attention_prefill_tree",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelSetSpec:
    """What the kernels of a cache depend on (nothing else of the config enters the key)."""

    page: tk.PageLayoutSpec
    rope: tk.RopeSplitSpec
    merge: tk.MergeSpec
    attention: tk.AttentionSpec
    sliding_window: bool
    layer_window: int = 0

    @classmethod
    def from_config(cls, config: KVCacheConfig) -> "KernelSetSpec":
        if any(kind == AttnKind.MLA for kind in config.attn_kinds):
            raise NotImplementedError("MLA layers are not supported by relax_kvcache yet")
        attention = tk.AttentionSpec(
            num_qo_heads=config.num_qo_heads, num_kv_heads=config.num_kv_heads,
            qk_head_dim=config.head_dim, v_head_dim=config.v_head_dim, dtype=config.dtype,
            page_size=config.page_size)
        return cls(
            page=tk.PageLayoutSpec(num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                                   page_size=config.page_size, dtype=config.dtype),
            rope=tk.RopeSplitSpec(num_qo_heads=config.num_qo_heads, num_kv_heads=config.num_kv_heads,
                                  head_dim=config.head_dim, dtype=config.dtype,
                                  rope_theta=config.rope_theta, rope_scale=config.rope_scale),
            merge=tk.MergeSpec(num_heads=config.num_qo_heads, head_dim=config.v_head_dim,
                               dtype=config.dtype),
            attention=attention,
            sliding_window=config.support_sliding_window or config.has_layer_windows,
            layer_window=config.layer_sliding_window_size if config.has_layer_windows else 0,
        )

    def kernel_functions(self, sched: tk.CpuSchedule) -> Dict[str, tirx.PrimFunc]:
        """The PrimFuncs of the set, keyed by role.

        The ``_sliding_window`` variants take ``[3, B]`` length info; with per-layer windows
        (``layer_window > 0``) they also mask keys outside each query's window, and a windowed
        ragged kernel serves the new tokens of ``MHA_SLIDING`` layers.
        """
        windowed = dataclasses.replace(self.attention, sliding_window=True, window=self.layer_window)
        makers: Dict[str, Callable[[], tirx.PrimFunc]] = {
            "transpose_append": lambda: tk.make_transpose_append(self.page, sched),
            "split_rotary": lambda: tk.make_split_rotary(self.rope, sched),
            "copy_single_page": lambda: tk.make_copy_single_page(self.page, sched),
            "compact_copy": lambda: tk.make_compact_copy(self.page, sched),
            "debug_get_kv": lambda: tk.make_debug_get_kv(self.page, sched),
            "merge_inplace": lambda: tk.make_merge_inplace(self.merge, sched),
            "attention_prefill_ragged": lambda: tk.make_ragged_prefill(self.attention, sched),
            "attention_prefill": lambda: tk.make_paged_prefill(self.attention, sched),
            "attention_decode": lambda: tk.make_paged_decode(self.attention, sched),
            "attention_prefill_ragged_tree": lambda: tk.make_ragged_tree_prefill(self.attention, sched),
            "attention_prefill_tree": lambda: tk.make_paged_tree_prefill(self.attention, sched),
        }
        if self.sliding_window:
            makers["attention_prefill_sliding_window"] = lambda: tk.make_paged_prefill(windowed, sched)
            makers["attention_decode_sliding_window"] = lambda: tk.make_paged_decode(windowed, sched)
        if self.layer_window:
            makers["attention_prefill_ragged_sliding_window"] = lambda: tk.make_ragged_prefill(windowed, sched)
        return {role: make() for role, make in makers.items()}


def cache_dir() -> pathlib.Path:
    """Folder of compiled kernel libraries: ``$RELAX_KVCACHE_CACHE_DIR`` or ``~/.cache/relax_kvcache``."""
    env = os.environ.get("RELAX_KVCACHE_CACHE_DIR")
    path = pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "relax_kvcache"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _kernel_source_digest() -> str:
    digest = hashlib.sha256()
    root = pathlib.Path(tk.__file__).parent
    for path in sorted(root.glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def build_key(spec: KernelSetSpec, target: tvm.target.Target) -> str:
    """Cache key of a kernel set: specs, target, TVM version and the kernel sources."""
    text = "\n".join([repr(spec), str(target), tvm.__version__, _kernel_source_digest()])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def build_kernels(
    config: KVCacheConfig,
    target: tvm.target.Target,
    *,
    use_cache: bool = True,
    progress: Optional[Callable[[str], None]] = None,
) -> tvm.runtime.Module:
    """Compile (or load from the on-disk cache) the kernel set for ``config`` and ``target``.

    Parameters
    ----------
    config : KVCacheConfig
        The cache configuration; only the fields in :class:`KernelSetSpec` matter.
    target : tvm.target.Target
        Compilation target, e.g. ``tvm.target.Target({"kind": "llvm", "mcpu": "znver3"})``.
    use_cache : bool
        Read and write the on-disk cache (default True).
    progress : callable, optional
        Called with a one-line message before compiling or loading.

    Returns
    -------
    tvm.runtime.Module
        One module whose functions are named by :data:`KERNEL_ROLES`.
    """
    if not isinstance(target, tvm.target.Target):
        raise TypeError(f"target must be a tvm.target.Target, got {type(target).__name__}")
    spec = KernelSetSpec.from_config(config)
    path = cache_dir() / f"kernels-{build_key(spec, target)}.so"
    if use_cache and path.exists():
        if progress:
            progress(f"loading cached kernels {path.name}")
        return tvm.runtime.load_module(str(path))
    if progress:
        progress(f"compiling kernels for {target.kind.name} ({spec.attention.dtype}, "
                 f"{spec.attention.num_qo_heads}/{spec.attention.num_kv_heads} heads, "
                 f"head_dim {spec.attention.qk_head_dim})")
    funcs = spec.kernel_functions(tk.schedule_for(target))
    mod = tvm.IRModule({role: f.with_attr("global_symbol", role) for role, f in funcs.items()})
    executable = tvm.compile(mod, target=target)
    if not use_cache:
        return executable.jit()
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".so", delete=False) as tmp:
        tmp_path = tmp.name
    try:
        executable.export_library(tmp_path)
        os.replace(tmp_path, path)
    finally:
        if os.path.exists(tmp_path):
            os.unlink(tmp_path)
    return tvm.runtime.load_module(str(path))
