"""Global packed functions: ``relax_kvcache.*`` and the ``vm.builtin.*`` dispatch."""

import tvm_ffi

from .. import errors

from .builtins import BUILTINS, original, register_builtins
from .create import paged_attention_kv_cache_create
from .prefix import PREFIX_FUNCTIONS, register_prefix_functions

CREATE_FUNCTION = "relax_kvcache.paged_attention_kv_cache_create"


def register() -> None:
    """Register ``relax_kvcache.paged_attention_kv_cache_create``, the prefix caching functions
    (:data:`PREFIX_FUNCTIONS`), the builtin dispatchers and our
    exception classes (so errors keep their Python type when raised through ``vm.builtin.*``)."""
    for error in (errors.KVCacheError, errors.ConfigError, errors.SequenceError, errors.CacheFullError,
                  errors.ForwardError, errors.ArgumentError, NotImplementedError):
        tvm_ffi.register_error(error)
    tvm_ffi.register_global_func(CREATE_FUNCTION, paged_attention_kv_cache_create, override=True)
    register_prefix_functions()
    register_builtins()


__all__ = ["BUILTINS", "CREATE_FUNCTION", "PREFIX_FUNCTIONS", "original", "paged_attention_kv_cache_create",
           "register"]
