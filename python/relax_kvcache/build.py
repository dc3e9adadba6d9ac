"""Compile the kernel set of a cache configuration for a target, with an on-disk cache.

The kernel set is one IRModule whose functions are named by role (``KERNEL_ROLES``); it is
compiled once per (kernel specs, target, TVM version, kernel sources) and stored as a shared
library under :func:`cache_dir`, with its SHA-256 beside it (``<library>.sha256``). Later builds
load that library instead of compiling (one whose bytes differ from its checksum is compiled
again).

Targets are any of :data:`relax_kvcache.targets.TARGET_KINDS`. A GPU library can be built on a
machine without that GPU: it is cached and exported (:func:`export_kernels`) as usual, but it is
loaded back only where the device exists (elsewhere :func:`build_kernels` returns the freshly
compiled module, good for ``export_library`` but not for calls). Load exported libraries on the
GPU host with :func:`relax_kvcache.deploy.load`.

This module does not import the kernel factories (TVMScript) until it compiles, so that
``import relax_kvcache`` works with a runtime-only TVM.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import shutil
import tempfile
from typing import TYPE_CHECKING, Callable, Dict, Optional, Tuple, Union

import tvm

from .config import SUPPORTED_DTYPES, KVCacheConfig, LayerSpan
from .deploy import DeployError, verify_checksum, write_checksum
from .errors import ConfigError
from .targets import check_can_compile, describe_target

if TYPE_CHECKING:  # the factories need TVMScript, which a runtime-only TVM lacks
    from tvm import tirx
    from tvm.runtime.executable import Executable

    from . import tir_kernels as tk

_KERNEL_SOURCE_DIR = pathlib.Path(__file__).parent / "tir_kernels"
#: Version of what a built library holds besides the kernels (3: ``kernel_spec_*`` functions;
#: 6: LongRoPE, rotary-dim and interleaved-RoPE fields among them; 7: the attention chunk).
LIBRARY_FORMAT = 7
#: Prefix of the functions of a built library that return its :func:`kernel_identity`.
IDENTITY_PREFIX = "kernel_spec_"
#: The fields of :func:`kernel_identity`, in order.
IDENTITY_FIELDS = ("mla", "dtype", "page_size", "num_qo_heads", "num_kv_heads", "head_dim", "v_head_dim",
                   "mla_original_qk_head_dim", "mla_original_v_head_dim", "rope_theta", "rope_scale",
                   "sliding_window", "layer_sliding_window_size", "longrope_original_max_position",
                   "longrope_attention_factor", "rope_rotary_dim", "rope_interleaved", "attention_chunk_size")
Progress = Optional[Callable[[str], None]]


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
    "attention_prefill_prefixed",
)

#: Roles of the kernels of an MLA cache (``debug_get_kv`` with the latent layout).
MLA_KERNEL_ROLES = (
    "transpose_append_mla",
    "copy_single_page",
    "debug_get_kv",
    "merge_inplace",
    "merge_general",
    "attention_prefill_ragged",
    "attention_prefill_mla",
)


def _longrope_spec(config: KVCacheConfig) -> Optional[tk.LongRopeSpec]:
    """The LongRoPE spec of ``config``'s split_rotary (None without ``rope_ext_factors``)."""
    if config.rope_ext_factors is None:
        return None
    if config.rope_original_max_position_embeddings is None:
        raise ConfigError("building LongRoPE kernels needs KVCacheConfig.rope_original_max_position_embeddings "
                          "(the position from which the long factors apply), got None")
    from . import tir_kernels as tk

    return tk.LongRopeSpec(original_max_position_embeddings=config.rope_original_max_position_embeddings,
                           attention_factor=config.rope_attention_factor)


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelSetSpec:
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

        attention = tk.AttentionSpec(
            num_qo_heads=config.num_qo_heads, num_kv_heads=config.num_kv_heads,
            qk_head_dim=config.head_dim, v_head_dim=config.v_head_dim, dtype=config.dtype,
            page_size=config.page_size)
        return cls(
            page=tk.PageLayoutSpec(num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                                   page_size=config.page_size, dtype=config.dtype),
            rope=tk.RopeSplitSpec(num_qo_heads=config.num_qo_heads, num_kv_heads=config.num_kv_heads,
                                  head_dim=config.head_dim, dtype=config.dtype,
                                  rope_theta=config.rope_theta, rope_scale=config.rope_scale,
                                  longrope=_longrope_spec(config),
                                  rotary_dim=None if config.rotary_dim == config.head_dim else config.rotary_dim,
                                  interleaved=config.rope_interleaved),
            merge=tk.MergeSpec(num_heads=config.num_qo_heads, head_dim=config.v_head_dim,
                               dtype=config.dtype),
            attention=attention,
            sliding_window=config.support_sliding_window or config.has_layer_windows,
            layer_span=config.layer_span,
        )

    def roles(self) -> Tuple[str, ...]:
        """Roles of the kernels in the set (those :meth:`kernel_functions` makes), in
        :data:`KERNEL_ROLES` order."""
        windowed = {
            "attention_prefill_sliding_window": self.sliding_window,
            "attention_decode_sliding_window": self.sliding_window,
            "attention_prefill_ragged_sliding_window": bool(self.layer_span),
        }
        return tuple(role for role in KERNEL_ROLES if windowed.get(role, True))

    def kernel_functions(self, sched: tk.schedule.Schedule) -> Dict[str, tirx.PrimFunc]:
        """The PrimFuncs of the set, keyed by role (:meth:`roles`).

        The ``_sliding_window`` variants take ``[3, B]`` length info; with local layers
        (``layer_span``: a window or an attention chunk) they also mask keys outside what each
        query sees, and a windowed ragged kernel serves the new tokens of local layers.
        """
        return {role: self.kernel_function(role, sched) for role in self.roles()}

    def kernel_function(self, role: str, sched: tk.schedule.Schedule) -> tirx.PrimFunc:
        """The PrimFunc of one role of the set (one of :meth:`roles`)."""
        if role not in self.roles():
            raise ValueError(f"{role!r} is not a kernel role of this set; expected one of {self.roles()}")
        from . import tir_kernels as tk

        plain, windowed = self.attention, dataclasses.replace(
            self.attention, sliding_window=True, window=self.layer_span.window,
            attention_chunk=self.layer_span.chunk)
        makers: Dict[str, Callable[[], tirx.PrimFunc]] = {
            "transpose_append": lambda: tk.make_transpose_append(self.page, sched),
            "split_rotary": lambda: tk.make_split_rotary(self.rope, sched),
            "copy_single_page": lambda: tk.make_copy_single_page(self.page, sched),
            "compact_copy": lambda: tk.make_compact_copy(self.page, sched),
            "debug_get_kv": lambda: tk.make_debug_get_kv(self.page, sched),
            "merge_inplace": lambda: tk.make_merge_inplace(self.merge, sched),
            "attention_prefill_ragged": lambda: tk.make_ragged_prefill(plain, sched),
            "attention_prefill": lambda: tk.make_paged_prefill(plain, sched),
            "attention_decode": lambda: tk.make_paged_decode(plain, sched),
            "attention_prefill_sliding_window": lambda: tk.make_paged_prefill(windowed, sched),
            "attention_decode_sliding_window": lambda: tk.make_paged_decode(windowed, sched),
            "attention_prefill_ragged_sliding_window": lambda: tk.make_ragged_prefill(windowed, sched),
            "attention_prefill_ragged_tree": lambda: tk.make_ragged_tree_prefill(plain, sched),
            "attention_prefill_tree": lambda: tk.make_paged_tree_prefill(plain, sched),
            "attention_prefill_prefixed": lambda: tk.make_prefixed_prefill(plain, sched),
        }
        return makers[role]()


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLAKernelSetSpec:
    """What the kernels of an MLA cache depend on.

    ``latent``: the page layout; ``absorbed``: attention of the W_UK-absorbed queries over the
    one latent head (output ``kv_lora_rank`` wide); ``ragged``: causal self-attention over the
    step's decompressed K/V (one KV head per query head, ``mla_original_*`` head dims), also the
    kernel of :meth:`~relax_kvcache.PagedAttentionKVCache.mla_context_attention`.
    """

    latent: tk.LatentPageSpec
    absorbed: tk.AttentionSpec
    ragged: tk.AttentionSpec

    @classmethod
    def from_config(cls, config: KVCacheConfig) -> "MLAKernelSetSpec":
        if not config.is_mla:
            raise ValueError("MLAKernelSetSpec needs an MLA configuration; use kernel_set_spec(config)")
        if config.mla_original_qk_head_dim is None:
            raise ConfigError("building MLA kernels needs KVCacheConfig.mla_original_qk_head_dim and "
                              "mla_original_v_head_dim (the decompressed self-attention head dims), got None")
        from . import tir_kernels as tk

        hq, dtype, ps = config.num_qo_heads, config.dtype, config.page_size
        return cls(
            latent=tk.LatentPageSpec(width=config.head_dim, page_size=ps, dtype=dtype),
            absorbed=tk.AttentionSpec(num_qo_heads=hq, num_kv_heads=1, qk_head_dim=config.head_dim,
                                      v_head_dim=config.v_head_dim, dtype=dtype, page_size=ps),
            ragged=tk.AttentionSpec(num_qo_heads=hq, num_kv_heads=hq, qk_head_dim=config.mla_original_qk_head_dim,
                                    v_head_dim=config.mla_original_v_head_dim, dtype=dtype, page_size=ps),
        )

    @property
    def attention(self) -> tk.AttentionSpec:
        """The attention over the cache's pages (for messages and benchmarks)."""
        return self.absorbed

    def roles(self) -> Tuple[str, ...]:
        """Roles of the kernels in the set: :data:`MLA_KERNEL_ROLES`."""
        return MLA_KERNEL_ROLES

    def kernel_functions(self, sched: tk.schedule.Schedule) -> Dict[str, tirx.PrimFunc]:
        """The PrimFuncs of the set, keyed by role (:meth:`roles`). ``debug_get_kv`` has TVM's
        MLA convention ``(pages, position_map, kv_out (L, n, W), layer_id)``."""
        return {role: self.kernel_function(role, sched) for role in self.roles()}

    def kernel_function(self, role: str, sched: tk.schedule.Schedule) -> tirx.PrimFunc:
        """The PrimFunc of one role of the set (one of :meth:`roles`)."""
        if role not in self.roles():
            raise ValueError(f"{role!r} is not a kernel role of this set; expected one of {self.roles()}")
        from . import tir_kernels as tk

        hq, dtype = self.absorbed.num_qo_heads, self.absorbed.dtype
        makers: Dict[str, Callable[[], tirx.PrimFunc]] = {
            "copy_single_page": lambda: tk.make_copy_single_page_mla(self.latent, sched),
            "debug_get_kv": lambda: tk.make_debug_get_kv_mla(self.latent, sched),
            "merge_inplace": lambda: tk.make_merge_inplace(
                tk.MergeSpec(num_heads=hq, head_dim=self.absorbed.v_head_dim, dtype=dtype), sched),
            "attention_prefill_ragged": lambda: tk.make_ragged_prefill(self.ragged, sched),
            "transpose_append_mla": lambda: tk.make_transpose_append_mla(self.latent, sched),
            "attention_prefill_mla": lambda: tk.make_paged_mla(self.absorbed, sched),
            "merge_general": lambda: tk.make_merge_inplace(
                tk.MergeSpec(num_heads=hq, head_dim=self.ragged.v_head_dim, dtype=dtype), sched),
        }
        return makers[role]()


AnyKernelSetSpec = Union[KernelSetSpec, MLAKernelSetSpec]


def kernel_set_spec(config: KVCacheConfig) -> AnyKernelSetSpec:
    """The kernel set spec of a configuration: :class:`MLAKernelSetSpec` for MLA caches, else
    :class:`KernelSetSpec`."""
    return MLAKernelSetSpec.from_config(config) if config.is_mla else KernelSetSpec.from_config(config)


def cache_dir() -> pathlib.Path:
    """Folder of compiled kernel libraries: ``$RELAX_KVCACHE_CACHE_DIR`` or ``~/.cache/relax_kvcache``."""
    env = os.environ.get("RELAX_KVCACHE_CACHE_DIR")
    path = pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "relax_kvcache"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _kernel_source_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(_KERNEL_SOURCE_DIR.glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def build_key(spec: AnyKernelSetSpec, target: tvm.target.Target) -> str:
    """Cache key of a kernel set: specs, target, TVM version, the kernel sources and the
    library format (:data:`LIBRARY_FORMAT`)."""
    text = "\n".join([repr(spec), str(target), tvm.__version__, _kernel_source_digest(), str(LIBRARY_FORMAT)])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def build_kernels(
    config: KVCacheConfig,
    target: tvm.target.Target,
    *,
    use_cache: bool = True,
    progress: Progress = None,
) -> tvm.runtime.Module:
    """Compile (or load from the on-disk cache) the kernel set for ``config`` and ``target``.

    Parameters
    ----------
    config : KVCacheConfig
        The cache configuration; only the fields in :class:`KernelSetSpec` matter.
    target : tvm.target.Target
        Compilation target, e.g. ``tvm.target.Target({"kind": "llvm", "mcpu": "znver3"})`` or
        ``relax_kvcache.targets.make_target("cuda", arch="sm_90a")``.
    use_cache : bool
        Read and write the on-disk cache (default True).
    progress : callable, optional
        Called with a one-line message before compiling or loading.

    Returns
    -------
    tvm.runtime.Module
        One module whose functions are named by :data:`KERNEL_ROLES`. For a GPU target whose
        device this process cannot use (e.g. CUDA on a machine without a GPU), the freshly
        compiled module: it can be exported but its functions cannot be called here.

    Raises
    ------
    relax_kvcache.targets.TargetUnavailableError
        TVM or the toolchain cannot compile for ``target`` (e.g. Vulkan without SPIR-V codegen).
    """
    spec = _checked_spec(config, target)
    loadable = can_load_here(target)
    if not use_cache:
        executable = _compile(spec, target, progress, kernel_identity(config))
        return executable.jit() if loadable else executable.mod
    path = cache_path(spec, target)
    cached = _cached_intact(path)  # hashed once
    if loadable and cached:
        _report(progress, f"loading cached kernels {path.name}")
        return tvm.runtime.load_module(str(path))
    executable = _compile(spec, target, progress, kernel_identity(config))
    if not cached:
        _export_atomic(executable, path)
    return tvm.runtime.load_module(str(path)) if loadable else executable.mod


def export_kernels(
    config: KVCacheConfig,
    target: tvm.target.Target,
    path: Union[str, "os.PathLike[str]"],
    *,
    use_cache: bool = True,
    progress: Progress = None,
) -> pathlib.Path:
    """Write the kernel set for ``config`` and ``target`` to one shared library at ``path``.

    The library is copied from the on-disk cache when it is there, else compiled (and cached).
    It does not need the target's device: a CUDA library built on a machine without a GPU
    holds the CUDA source, which :func:`relax_kvcache.deploy.load` compiles on the GPU host.

    Parameters
    ----------
    config : KVCacheConfig
        The cache configuration; only the fields in :class:`KernelSetSpec` matter.
    target : tvm.target.Target
        Compilation target (see :func:`relax_kvcache.targets.make_target`).
    path : path-like
        Library file to write, ending in ``.so``; its folder must exist. Replaced atomically;
        its SHA-256 is written beside it (``<path>.sha256``), which :func:`relax_kvcache.deploy.load`
        checks.
    use_cache : bool
        Read and write the on-disk cache (default True).
    progress : callable, optional
        Called with a one-line message before compiling or copying.

    Returns
    -------
    pathlib.Path
        ``path``, absolute.
    """
    dest = _checked_output(path)
    spec = _checked_spec(config, target)
    if not use_cache:
        _export_atomic(_compile(spec, target, progress, kernel_identity(config)), dest)
        return dest
    cached = cache_path(spec, target)
    if _cached_intact(cached):
        _report(progress, f"copying cached kernels {cached.name}")
    else:
        _export_atomic(_compile(spec, target, progress, kernel_identity(config)), cached)
    _copy_atomic(cached, dest)
    return dest


def _cached_intact(path: pathlib.Path) -> bool:
    """Whether a cached library exists and agrees with its checksum file (``<path>.sha256``);
    one without a checksum or damaged is compiled again and replaced."""
    try:
        return path.exists() and verify_checksum(path)
    except DeployError:
        return False


def cache_path(spec: AnyKernelSetSpec, target: tvm.target.Target) -> pathlib.Path:
    """Where the on-disk cache keeps the library of ``spec`` compiled for ``target``."""
    return cache_dir() / f"kernels-{target.kind.name}-{build_key(spec, target)}.so"


def can_load_here(target: tvm.target.Target) -> bool:
    """Whether a library compiled for ``target`` can be loaded (and run) in this process.

    CPU libraries always can; GPU libraries where the target's device (index 0) exists, which
    also means TVM's runtime for it is loaded.
    """
    kind = target.kind.name
    if kind == "llvm":
        return True
    try:
        return bool(tvm.device(kind, 0).exist)
    except (ValueError, RuntimeError):  # a device type this TVM does not know
        return False


def _checked_spec(config: KVCacheConfig, target: tvm.target.Target) -> AnyKernelSetSpec:
    if not isinstance(config, KVCacheConfig):
        raise TypeError(f"config must be a KVCacheConfig, got {type(config).__name__}")
    if not isinstance(target, tvm.target.Target):
        raise TypeError(f"target must be a tvm.target.Target, got {type(target).__name__}")
    return kernel_set_spec(config)


def _checked_output(path: Union[str, "os.PathLike[str]"]) -> pathlib.Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or path-like, got {type(path).__name__}")
    dest = pathlib.Path(path).expanduser().absolute()
    if dest.suffix != ".so":
        raise ValueError(f"kernel library path must end in '.so', got {str(path)!r}")
    if not dest.parent.is_dir():
        raise FileNotFoundError(f"folder of kernel library path {str(path)!r} does not exist: {dest.parent}")
    if dest.is_dir():
        raise IsADirectoryError(f"kernel library path {str(path)!r} is a folder")
    return dest


def _report(progress: Progress, message: str) -> None:
    if progress:
        progress(message)


def kernel_identity(config: KVCacheConfig) -> Dict[str, float]:
    """What ``config``'s kernels depend on, by field: the fields of its kernel set spec
    (:func:`kernel_set_spec`), read from the config itself so that a host with TVM's runtime
    alone can compute them (the dtype as its index in ``SUPPORTED_DTYPES``, flags as 0 / 1,
    fields that do not apply as 0). Libraries built here return each from a function
    ``kernel_spec_<field>``; :class:`~relax_kvcache.PagedAttentionKVCache` refuses kernels built
    for other values."""
    mla, windows = config.is_mla, config.support_sliding_window or config.has_layer_windows
    return {
        "mla": int(mla), "dtype": SUPPORTED_DTYPES.index(config.dtype), "page_size": config.page_size,
        "num_qo_heads": config.num_qo_heads, "num_kv_heads": config.num_kv_heads, "head_dim": config.head_dim,
        "v_head_dim": config.v_head_dim,
        "mla_original_qk_head_dim": (config.mla_original_qk_head_dim or 0) if mla else 0,
        "mla_original_v_head_dim": (config.mla_original_v_head_dim or 0) if mla else 0,
        "rope_theta": 0.0 if mla else float(config.rope_theta),
        "rope_scale": 0.0 if mla else float(config.rope_scale),
        "sliding_window": int(not mla and windows),
        "layer_sliding_window_size": config.layer_span.window,
        "attention_chunk_size": config.layer_span.chunk,
        # LongRoPE: split_rotary takes the factors tensor (0: the apply-RoPE flag)
        "longrope_original_max_position": ((config.rope_original_max_position_embeddings or 0)
                                           if config.rope_ext_factors is not None else 0),
        "longrope_attention_factor": config.rope_attention_factor if config.rope_ext_factors is not None else 0.0,
        "rope_rotary_dim": 0 if mla else config.rotary_dim,
        "rope_interleaved": int(config.rope_interleaved),
    }


def _identity_functions(identity: Dict[str, float]) -> Dict[str, tirx.PrimFunc]:
    """``kernel_spec_<field>() -> int64 / float64`` for each field of :func:`kernel_identity`."""
    from tvm.script import tirx as T

    def constant(value):
        if isinstance(value, float):
            @T.prim_func(private=True, s_tir=True)
            def field() -> T.float64:
                return T.float64(value)
        else:
            @T.prim_func(private=True, s_tir=True)
            def field() -> T.int64:
                return T.int64(value)
        return field

    return {IDENTITY_PREFIX + name: constant(value) for name, value in identity.items()}


def _compile(spec: AnyKernelSetSpec, target: tvm.target.Target, progress: Progress,
             identity: Dict[str, float]) -> Executable:
    from . import tir_kernels as tk

    check_can_compile(target)
    _report(progress, f"compiling kernels for {describe_target(target)} ({spec.attention.dtype}, "
                      f"{spec.attention.num_qo_heads}/{spec.attention.num_kv_heads} heads, "
                      f"head_dim {spec.attention.qk_head_dim})")
    funcs = spec.kernel_functions(tk.schedule_for(target))
    funcs.update(_identity_functions(identity))
    mod = tvm.IRModule({role: f.with_attr("global_symbol", role) for role, f in funcs.items()})
    with tvm.transform.PassContext(opt_level=3, config=_pass_config(target)):
        return tvm.compile(mod, target=target)


def _pass_config(target: tvm.target.Target) -> Dict[str, object]:
    """GPU kernels compile without TIR common-subexpression elimination: it binds thread-indexed
    addresses to let variables, which hides from TVM's barrier planner that a thread reads back
    what it wrote itself, and the planner then wants barriers inside conditions (an error)."""
    return {"tirx.disable_cse_tir": True} if _is_gpu_target(target) else {}


def _is_gpu_target(target: tvm.target.Target) -> bool:
    from .tir_kernels.schedule import GPU_TARGET_KINDS

    return target.kind.name in GPU_TARGET_KINDS


def _export_atomic(executable: Executable, path: pathlib.Path) -> None:
    """``executable.export_library(path)`` through a temporary file in the same folder."""
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".tmp-", suffix=".so", delete=False) as tmp:
        tmp_path = tmp.name
    try:
        executable.export_library(tmp_path)
        os.chmod(tmp_path, 0o755)  # a temporary file is private (0600); a library is not
        os.replace(tmp_path, path)
        write_checksum(path)
    finally:
        if os.path.exists(tmp_path):
            os.unlink(tmp_path)


def _copy_atomic(src: pathlib.Path, dest: pathlib.Path) -> None:
    with tempfile.NamedTemporaryFile(dir=dest.parent, prefix=".tmp-", suffix=".so", delete=False) as tmp:
        tmp_path = tmp.name
    try:
        shutil.copyfile(src, tmp_path)
        os.chmod(tmp_path, 0o755)
        os.replace(tmp_path, dest)
        write_checksum(dest)
    finally:
        if os.path.exists(tmp_path):
            os.unlink(tmp_path)
