"""Exceptions raised by relax_kvcache, always before any state changes (check-then-mutate)."""


class KVCacheError(ValueError):
    """Base class: a request the cache cannot serve; the cache state is unchanged."""


class ConfigError(KVCacheError):
    """An inconsistent or invalid cache configuration."""


class SequenceError(KVCacheError):
    """Unknown or duplicate sequence id, or an operation invalid for the sequence's state."""


class CacheFullError(KVCacheError):
    """Not enough free pages for the request."""


class ForwardError(KVCacheError):
    """Misuse of the forward protocol or tensors of the wrong shape, dtype or device."""


class ArgumentError(KVCacheError, TypeError):
    """An argument of the wrong type (e.g. None or a float where an int is expected, a list
    where a tensor is), or a ``vm.builtin`` function called with the wrong number of arguments.
    Also a ``TypeError``; the cache state is unchanged."""


class DeployError(RuntimeError):
    """A kernel library cannot be loaded here: a runtime library, nvcc or a device is missing."""
