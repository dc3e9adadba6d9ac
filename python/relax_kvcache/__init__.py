"""relax_kvcache: a paged KV cache for Apache TVM Relax, Python logic over our own TIR kernels.

Importing the package registers ``relax_kvcache.paged_attention_kv_cache_create`` and makes
TVM's ``vm.builtin.kv_state_*`` / ``vm.builtin.attention_kv_cache_*`` functions accept a
:class:`PagedAttentionKVCache` (they keep serving TVM's native caches).
"""

from .host import configure_cpu_threads

configure_cpu_threads()

from . import deploy, ffi_registry, targets  # noqa: E402
from .build import KERNEL_ROLES, build_kernels, export_kernels  # noqa: E402
from .cache import PagedAttentionKVCache  # noqa: E402
from .config import AttnKind, KVCacheConfig, LayerSpan, RopeMode, longrope_attention_factor  # noqa: E402
from .errors import (  # noqa: E402
    ArgumentError, CacheFullError, ConfigError, ForwardError, KVCacheError, SequenceError)
from .deploy import DeployError  # noqa: E402
from .ffi_registry import paged_attention_kv_cache_create  # noqa: E402
from .kernel_set import KernelSet  # noqa: E402
from .targets import TargetUnavailableError, make_target  # noqa: E402

__version__ = "0.1.0"

ffi_registry.register()

__all__ = [
    "ArgumentError", "AttnKind", "CacheFullError", "ConfigError", "DeployError", "ForwardError",
    "KERNEL_ROLES", "KVCacheConfig", "KVCacheError", "KernelSet", "LayerSpan",
    "PagedAttentionKVCache", "RopeMode", "SequenceError", "TargetUnavailableError",
    "build_kernels", "deploy", "export_kernels", "make_target", "paged_attention_kv_cache_create",
    "longrope_attention_factor", "targets",
]
