"""TVM's ``vm.builtin.kv_state_*`` / ``vm.builtin.attention_kv_cache_*`` functions, made to serve
our cache too: a dispatcher sends a :class:`PagedAttentionKVCache` to our method and anything
else to TVM's original (kept as ``relax_kvcache.original.<name>``)."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Optional, Tuple

import tvm_ffi

from ..args import describe
from ..cache import PagedAttentionKVCache
from ..errors import ArgumentError

ORIGINAL_PREFIX = "relax_kvcache.original."


def _method(name: str) -> Callable[..., Any]:
    """``cache.<name>(*args)``, with the method's signature (for :func:`_arity`)."""
    def call(cache: PagedAttentionKVCache, *args: Any) -> Any:
        return getattr(cache, name)(*args)
    call.__signature__ = inspect.signature(  # type: ignore[attr-defined]
        getattr(PagedAttentionKVCache, name))
    call.method = name  # type: ignore[attr-defined]  # the dispatcher calls it without this frame
    return call


def _merge(cache: PagedAttentionKVCache, o_self, lse_self, o_cross, lse_cross):
    return list(cache.merge_attn_output_inplace(o_self, lse_self, o_cross, lse_cross))


def _append_mla_kv(cache: PagedAttentionKVCache, layer_id, kv):
    cache.append_mla_kv(layer_id, kv)
    return cache  # TVM's builtin returns the cache: the frontend threads it through


def _unsupported(feature: str) -> Callable[..., Any]:
    def run(cache: PagedAttentionKVCache, *args: Any) -> Any:
        raise NotImplementedError(f"{feature} is not supported by relax_kvcache's "
                                  "PagedAttentionKVCache yet")
    run.unsupported = feature  # type: ignore[attr-defined]
    return run


#: builtin name -> how our cache serves it (TVM's argument order after the cache).
BUILTINS: Dict[str, Callable[..., Any]] = {
    **{f"vm.builtin.kv_state_{name}": _method(name) for name in (
        "clear", "add_sequence", "remove_sequence", "popn", "begin_forward", "end_forward")},
    "vm.builtin.kv_state_fork_sequence":  # all three arguments (fork_pos has no default in TVM)
        lambda c, parent_seq_id, child_seq_id, fork_pos: c.fork_sequence(parent_seq_id,
                                                                         child_seq_id, fork_pos),
    **{f"vm.builtin.attention_kv_cache_{name}": _method(name) for name in (
        "empty", "get_num_available_pages", "get_total_sequence_length", "get_sequence_length",
        "get_query_positions", "debug_get_kv", "enable_sliding_window_for_seq",
        "commit_accepted_token_tree_nodes", "debug_get_kv_mla", "get_checkpoint_metadata",
        "get_layout_hash", "export_page_group", "prepare_import", "import_page_group",
        "finish_import")},
    "vm.builtin.attention_kv_cache_attention_with_fused_qkv":
        lambda c, layer_id, sm_scale, qkv, o: c.attention_with_fused_qkv(layer_id, qkv, o, sm_scale),
    "vm.builtin.attention_kv_cache_self_attention":
        lambda c, layer_id, sm_scale, q, k, v, o, lse: c.self_attention(layer_id, q, k, v, o, lse, sm_scale),
    "vm.builtin.attention_kv_cache_cross_attention":
        lambda c, layer_id, sm_scale, q, o, lse: c.cross_attention(layer_id, q, o, lse, sm_scale),
    "vm.builtin.attention_kv_cache_merge_attn_output_inplace": _merge,
    "vm.builtin.attention_kv_cache_attention_with_shared_kv":
        lambda c, source_layer_id, sm_scale, q, k, v, o: c.attention_with_shared_kv(source_layer_id, q, k, v, o,
                                                                                     sm_scale),
    "vm.builtin.attention_kv_cache_append_mla_kv": _append_mla_kv,
    "vm.builtin.kv_cache_disagg_prepare_recv": _unsupported("KV transfer (disaggregation)"),
    "vm.builtin.kv_cache_disagg_mark_send": _unsupported("KV transfer (disaggregation)"),
}


def original(name: str) -> Callable[..., Any]:
    """TVM's own implementation of builtin ``name`` (before relax_kvcache replaced it)."""
    return tvm_ffi.get_global_func(ORIGINAL_PREFIX + name)


def _arity(name: str, ours: Callable[..., Any]) -> Optional[Tuple[int, int, str]]:
    """(fewest, most) arguments after the cache that ``ours`` takes, and its signature; None
    when it takes any number."""
    params = list(inspect.signature(ours).parameters.values())[1:]
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return None
    fewest = sum(p.default is p.empty for p in params)
    names = ", ".join(["cache"] + [p.name if p.default is p.empty else f"[{p.name}]" for p in params])
    return fewest, len(params), f"{name}({names})"


def _dispatcher(name: str, ours: Callable[..., Any], theirs: Callable[..., Any]) -> Callable[..., Any]:
    arity = _arity(name, ours)
    fewest, most, signature = arity if arity is not None else (0, 1 << 30, name)
    method = getattr(ours, "method", None)

    def dispatch(cache: Any, *args: Any) -> Any:
        if isinstance(cache, PagedAttentionKVCache):
            if not fewest <= len(args) <= most:
                raise ArgumentError(f"{signature} takes {fewest if fewest == most else f'{fewest} to {most}'} "
                                    f"argument(s) after the cache, got {len(args)}")
            return getattr(cache, method)(*args) if method is not None else ours(cache, *args)
        if not _is_tvm_state(cache):  # None reaches TVM's functions as a null cache: a crash
            raise ArgumentError(f"{name}: the cache is {describe(cache)} of type {type(cache).__name__}; expected a "
                                "relax_kvcache.PagedAttentionKVCache or a TVM KV cache object")
        return theirs(cache, *args)
    return dispatch


#: Type keys of TVM's state objects (its KV caches and RNN state) that its builtins take.
_TVM_STATE_KEYS = frozenset({"relax.vm.KVState", "relax.vm.AttentionKVCacheLegacy"})


def _is_tvm_state(obj: Any) -> bool:
    """Whether ``obj`` is one of TVM's state objects (by its tvm-ffi type and its ancestors)."""
    if not isinstance(obj, tvm_ffi.Object):
        return False
    info = getattr(type(obj), "__tvm_ffi_type_info__", None)
    while info is not None:
        if info.type_key in _TVM_STATE_KEYS:
            return True
        info = info.parent_type_info
    return False


def register_builtins() -> None:
    """Replace every builtin in :data:`BUILTINS` by a dispatcher (idempotent)."""
    for name, ours in BUILTINS.items():
        theirs = tvm_ffi.get_global_func(ORIGINAL_PREFIX + name, allow_missing=True)
        if theirs is None:
            theirs = tvm_ffi.get_global_func(name, allow_missing=True)
            if theirs is None:
                continue  # not provided by this TVM build
            tvm_ffi.register_global_func(ORIGINAL_PREFIX + name, theirs)
        tvm_ffi.register_global_func(name, _dispatcher(name, ours, theirs), override=True)
